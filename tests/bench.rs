//! `delayd bench`, the load generator, against a real delayd and RabbitMQ:
//! its report counts every message it published and received, and it refuses
//! an exchange that does not exist instead of publishing into nothing.

mod common;

use std::time::Instant;

use common::*;
use serde_json::Value;

/// Runs `delayd bench ARGS` off the runtime's threads; (success, stdout, stderr).
async fn bench(args: Vec<String>) -> (bool, String, String) {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        delayd_cli("bench", &args)
    })
    .await
    .expect("bench task")
}

fn count(report: &Value, key: &str) -> u64 {
    report[key]
        .as_u64()
        .unwrap_or_else(|| panic!("report has no {key}: {report}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_through_delayd_reports_every_message_delivered_and_none_early() {
    let setup = Setup::start(Names::new("bench"), &[], DelaydOptions::default()).await;
    let names = &setup.names;
    let messages = 300u64;
    let (ok, stdout, stderr) = bench(vec![
        "--url".into(),
        amqp_url(),
        "--exchange".into(),
        names.from_exchange.clone(),
        "--queue".into(),
        names.target_queue.clone(),
        "--count".into(),
        messages.to_string(),
        "--rate".into(),
        "300".into(),
        "--delay-min".into(),
        "200".into(),
        "--delay-max".into(),
        "900".into(),
        "--drain-timeout".into(),
        "20s".into(),
        "--json".into(),
        "--quiet".into(),
    ])
    .await;
    assert!(ok, "bench failed:\n{stderr}\n{}", setup.delayd.log_tail(30));
    let report: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("bench --json printed no JSON ({e}):\n{stdout}"));
    assert_eq!(count(&report, "published"), messages, "{report}");
    assert_eq!(count(&report, "received"), messages, "{report}");
    assert_eq!(count(&report, "lost"), 0, "{report}");
    assert_eq!(count(&report, "early"), 0, "{report}");
    assert_eq!(count(&report, "duplicates"), 0, "{report}");
    let (p50, p99, max) = (
        count(&report, "lateness_p50_ms"),
        count(&report, "lateness_p99_ms"),
        count(&report, "lateness_max_ms"),
    );
    assert!(p50 <= p99 && p99 <= max, "{report}");
    // They went through delayd (not around it), each fired once.
    let fired = format!("delayd_fired_total{{route=\"{}\"}} {messages}", names.route);
    wait_for(&fired, DEADLINE, || async {
        let (_, metrics) = setup.delayd.http_get("/metrics").ok()?;
        metrics.lines().any(|l| l == fired).then_some(())
    })
    .await;
    wait_for("nothing pending", DEADLINE, || async {
        (setup.delayd.pending() == 0).then_some(())
    })
    .await;
    // A scrape shows the pending count as it is, not as of the last second.
    let (_, metrics) = setup.delayd.http_get("/metrics").expect("GET /metrics");
    assert!(
        metrics
            .lines()
            .any(|l| l == "delayd_pending_messages_total 0"),
        "stale pending gauge:\n{}",
        metrics
            .lines()
            .filter(|l| l.starts_with("delayd_pending"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_refuses_an_exchange_that_does_not_exist() {
    let missing = format!("delayd-it.bench-missing.{}", unique_suffix());
    let started = Instant::now();
    let (ok, _, stderr) = bench(vec![
        "--url".into(),
        amqp_url(),
        "--exchange".into(),
        missing.clone(),
        "--queue".into(),
        format!("{missing}.q"),
        "--count".into(),
        "100".into(),
        "--quiet".into(),
    ])
    .await;
    assert!(!ok, "bench to a missing exchange succeeded");
    assert!(
        stderr.contains(&format!("exchange {missing:?} does not exist")),
        "stderr: {stderr}"
    );
    assert!(
        started.elapsed() < DEADLINE,
        "bench took {:?} to give up",
        started.elapsed()
    );
}
