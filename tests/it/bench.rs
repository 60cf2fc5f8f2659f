//! `delayd bench`, the load generator, against a real delayd and RabbitMQ:
//! its report counts every message it published and received, and it refuses
//! an exchange that does not exist instead of publishing into nothing.

use crate::common;

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
        "--metrics".into(),
        format!("http://{}/metrics", setup.delayd.http_addr()),
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
    // Not late either: generous for this machine, but finite.
    assert!(max < 5_000, "a message was {max} ms late: {report}");
    // --metrics read delayd's own process metrics around the run. A CPU
    // figure per message only from a second of CPU or more (the kernel's
    // 10 ms ticks): 300 messages may not take that long.
    let cpu = report["delayd_cpu_us_per_message"].as_f64();
    assert!(cpu.is_none_or(|us| us >= 1e6 / messages as f64), "{report}");
    let rss = report["delayd_resident_bytes"].as_f64();
    assert!(rss.is_some_and(|b| b > 1e6), "{report}");
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
            .any(|l| l == format!("delayd_pending_messages{{route=\"{}\"}} 0", names.route)),
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

/// Against an exchange that delays by itself (the plugin's), the broker
/// returns every mandatory publish as unroutable at once. With
/// `--delaying-exchange` a confirmed publish counts as published all the
/// same; and no message body reaches the log on the way. An exchange with
/// no queue bound answers like the plugin does, so it stands in for it
/// (the plugin is not packaged for this machine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_counts_a_delaying_exchange_s_returned_publishes_as_published() {
    let exchange = format!("delayd-it.bench-returns.{}", unique_suffix());
    let client = Client::connect("bench-returns").await;
    client.declare_exchange(&exchange).await;
    let queue = format!("{exchange}.q"); // declared by the bench, bound to nothing
    let run = |flag: Option<&str>| {
        let mut args = vec![
            "--url".to_string(),
            amqp_url(),
            "--exchange".into(),
            exchange.clone(),
            "--queue".into(),
            queue.clone(),
            "--count".into(),
            "40".into(),
            "--rate".into(),
            "400".into(),
            "--delay-min".into(),
            "0".into(),
            "--delay-max".into(),
            "0".into(),
            "--drain-timeout".into(),
            "1s".into(),
            "--json".into(),
            "--quiet".into(),
        ];
        args.extend(flag.map(str::to_string));
        bench(args)
    };
    client
        .declare_bound_queue(&queue, Default::default(), "amq.direct", &queue)
        .await;

    let (ok, stdout, stderr) = run(None).await;
    assert!(!ok, "none published: the bench must fail");
    assert!(stderr.contains("--delaying-exchange"), "{stderr}");
    let report: Value = serde_json::from_str(stdout.trim()).expect("JSON report");
    assert_eq!(count(&report, "published"), 0, "{report}");
    assert_eq!(count(&report, "publish_failures"), 40, "{report}");

    let (ok, stdout, stderr_flagged) = run(Some("--delaying-exchange")).await;
    assert!(!ok, "nothing arrives here either: lost, not unpublished");
    let report: Value = serde_json::from_str(stdout.trim()).expect("JSON report");
    assert_eq!(count(&report, "published"), 40, "{report}");
    assert_eq!(count(&report, "lost"), 40, "{report}");
    // The bench's bodies are 256 'x's (byte 120): in neither log, as text
    // nor as the byte list lapin's WARN on a returned message prints.
    for log in [stderr, stderr_flagged] {
        let bytes = ["120"; 16].join(", ");
        assert!(
            !log.contains(&"x".repeat(64)) && !log.contains(&bytes),
            "a body was logged:\n{log}"
        );
    }
    client.close().await;
}

/// `--bind-to` an exchange that exists binds to it as it is, whatever its
/// type (it was redeclared as a topic exchange, which the broker refuses
/// for a plugin or fanout exchange).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_binds_to_an_existing_exchange_of_another_type() {
    let exchange = format!("delayd-it.bench-fanout.{}", unique_suffix());
    let client = Client::connect("bench-fanout").await;
    client.declare_fanout_exchange(&exchange).await;
    let (ok, stdout, stderr) = bench(vec![
        "--url".into(),
        amqp_url(),
        "--exchange".into(),
        exchange.clone(),
        "--queue".into(),
        format!("{exchange}.q"),
        "--bind-to".into(),
        exchange.clone(),
        "--count".into(),
        "30".into(),
        "--rate".into(),
        "300".into(),
        "--delay-min".into(),
        "0".into(),
        "--delay-max".into(),
        "0".into(),
        "--json".into(),
        "--quiet".into(),
    ])
    .await;
    assert!(ok, "bench failed: {stderr}");
    let report: Value = serde_json::from_str(stdout.trim()).expect("JSON report");
    assert_eq!(count(&report, "received"), 30, "{report}");
    client.close().await;
}
