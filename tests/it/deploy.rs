//! What a deployment relies on: `delayd healthcheck` (the container's
//! health check), purging a route (`DELETE /v1/messages?route=R`,
//! `delayd messages purge`), the metrics as docs/metrics.md lists them, and
//! the status page's access rules. The real `delayd` binary against the
//! real RabbitMQ (see `common`); the status page in a browser is
//! scripts/deploy/status_page.mjs.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::*;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::BasicProperties;

fn delayed(message_id: &str, delay_ms: i32) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(ShortString::from("x-delay"), AMQPValue::LongInt(delay_ms));
    BasicProperties::default()
        .with_message_id(message_id.into())
        .with_headers(headers)
}

async fn publish_delayed(s: &Setup, prefix: &str, n: usize, delay_ms: i32) {
    for i in 0..n {
        s.client
            .publish(
                &s.names.from_exchange,
                "k",
                b"{}",
                delayed(&format!("{prefix}-{i}"), delay_ms),
            )
            .await;
    }
}

async fn wait_pending(delayd: &Delayd, n: u64) {
    wait_for(&format!("{n} pending messages"), DEADLINE, || async {
        (delayd.pending() == n).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthcheck_exits_0_against_a_ready_delayd_and_non_zero_against_a_stopped_one() {
    let mut s = Setup::start(Names::new("healthcheck"), &[], DelaydOptions::default()).await;
    let addr = s.delayd.http_addr().to_string();

    let (ok, out, err) = delayd_cli("healthcheck", &["--http", &addr]);
    assert!(
        ok,
        "healthcheck against a running delayd failed: {out}{err}"
    );
    assert!(out.contains("/healthz"), "{out}");
    wait_for("/readyz 200", DEADLINE, || async {
        matches!(s.delayd.http_get("/readyz"), Ok((200, _))).then_some(())
    })
    .await;
    let (ok, out, err) = delayd_cli("healthcheck", &["--http", &addr, "--ready"]);
    assert!(
        ok,
        "healthcheck --ready against a ready delayd failed: {out}{err}"
    );
    // The address from the config, as in the image (DELAYD_CONFIG there).
    let config = std::fs::read_to_string(s.delayd.config_path()).unwrap();
    let with_port = config.replace("127.0.0.1:0", &addr);
    let path = s.delayd.config_path().with_file_name("healthcheck.toml");
    std::fs::write(&path, with_port).unwrap();
    let (ok, out, err) = delayd_cli("healthcheck", &["--config", path.to_str().unwrap()]);
    assert!(ok, "healthcheck --config failed: {out}{err}");

    let status = s.delayd.sigterm_and_wait(Duration::from_secs(30)).await;
    assert!(status.success(), "delayd exited with {status}");
    let (ok, out, err) = delayd_cli("healthcheck", &["--http", &addr, "--timeout", "2s"]);
    assert!(!ok, "healthcheck against a stopped delayd succeeded: {out}");
    assert!(err.contains(&addr), "the error names the address: {err}");
    s.client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_counts_first_removes_only_with_yes_and_its_dones_are_durable() {
    let token = "purge-token";
    let opts = DelaydOptions {
        token: Some(token.into()),
        ..DelaydOptions::default()
    };
    let mut s = Setup::start(Names::new("purge"), &[], opts).await;
    let route = s.names.route.clone();
    let addr = s.delayd.http_addr().to_string();
    // 20 due in about 5 minutes, 10 in about 10.
    publish_delayed(&s, "soon", 20, 300_000).await;
    publish_delayed(&s, "later", 10, 600_000).await;
    wait_pending(&s.delayd, 30).await;
    let window_from = (now_ms() + 450_000).to_string();

    // Without --yes: counts, removes nothing, exits non-zero.
    let cli = |extra: &[&str]| {
        let mut args = vec![
            "--http", &addr, "--token", token, "purge", "--route", &route,
        ];
        args.extend_from_slice(extra);
        delayd_cli("messages", &args)
    };
    let (ok, out, err) = cli(&["--due-from", &window_from]);
    assert!(!ok, "purge without --yes succeeded: {out}");
    assert!(
        out.contains("10 pending message(s)") && out.contains("would be removed"),
        "{out}"
    );
    assert!(err.contains("--yes"), "{err}");
    assert_eq!(s.delayd.pending(), 30, "nothing removed without --yes");

    // The API needs the token, and knows its routes.
    let path = format!("/v1/messages?route={route}");
    let (status, _) = s.delayd.api("DELETE", &path, None);
    assert_eq!(status, 401);
    let (status, body) = s
        .delayd
        .api("DELETE", "/v1/messages?route=no-such-route", Some(token));
    assert_eq!(status, 404, "{body}");
    let (status, body) = s
        .delayd
        .api("DELETE", &format!("{path}&dry_run=true"), Some(token));
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        (body["matched"].as_u64(), body["purged"].as_u64()),
        (Some(30), Some(0))
    );

    // With --yes: the window only.
    let (ok, out, err) = cli(&["--due-from", &window_from, "--yes"]);
    assert!(ok, "purge --yes failed: {out}{err}");
    assert!(out.contains("removed 10"), "{out}");
    assert_eq!(s.delayd.pending(), 20);
    let (_, page) = s
        .delayd
        .api("GET", &format!("{path}&limit=1000"), Some(token));
    let left: BTreeSet<&str> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i["message_id"].as_str())
        .collect();
    assert_eq!(left.len(), 20);
    assert!(left.iter().all(|m| m.starts_with("soon-")), "{left:?}");

    // The whole route over HTTP.
    let (status, body) = s.delayd.api("DELETE", &path, Some(token));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["purged"].as_u64(), Some(20), "{body}");
    assert_eq!(s.delayd.pending(), 0);
    assert_eq!(s.delayd.metric("delayd_cancelled_total"), 30.0);

    // Durable: a restart from the same WAL brings none back.
    s.delayd.kill_9();
    s.delayd.restart().await;
    assert_eq!(
        s.delayd.pending(),
        0,
        "purged messages came back after a restart"
    );
    s.client.close().await;
}

/// Every `delayd_*` series of a scrape is in `telemetry::METRICS` (which a
/// unit test holds equal to docs/metrics.md) with the same labels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_match_the_documented_names_types_and_labels() {
    let s = Setup::start(Names::new("metrics"), &[], DelaydOptions::default()).await;
    let mut receiver = s.client.consume(&s.names.target_queue).await;
    publish_delayed(&s, "now", 5, 200).await;
    publish_delayed(&s, "later", 3, 600_000).await;
    // An unusable delay: invalid.
    let mut headers = FieldTable::default();
    headers.insert(
        ShortString::from("x-delay"),
        AMQPValue::LongString("soon".into()),
    );
    s.client
        .publish(
            &s.names.from_exchange,
            "k",
            b"{}",
            BasicProperties::default().with_headers(headers),
        )
        .await;
    for _ in 0..5 {
        receiver.expect("a due message").await;
    }
    wait_pending(&s.delayd, 3).await;
    wait_for("the publish connection counted", DEADLINE, || async {
        (s.delayd.metric("delayd_fired_total") == 5.0).then_some(())
    })
    .await;

    let (status, text) = s.delayd.http_get("/metrics").unwrap();
    assert_eq!(status, 200);
    let mut types = BTreeMap::new();
    let mut labels: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
            types.insert(name.to_owned(), kind.to_owned());
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let series = line.rsplit_once(' ').unwrap().0;
        let (name, set) = match series.split_once('{') {
            Some((name, rest)) => (
                name,
                rest.trim_end_matches('}')
                    .split("\",")
                    .filter_map(|kv| kv.split_once('=').map(|(k, _)| k.to_owned()))
                    .filter(|k| k != "le")
                    .collect(),
            ),
            None => (series, BTreeSet::new()),
        };
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| {
                name.strip_suffix(s)
                    .filter(|b| types.get(*b).is_some_and(|t| t == "histogram"))
            })
            .unwrap_or(name);
        labels.insert(base.to_owned(), set);
    }
    assert_eq!(
        types.get("process_cpu_seconds_total").map(String::as_str),
        Some("counter")
    );
    for (name, set) in &labels {
        if !name.starts_with("delayd_") {
            continue;
        }
        let def = delayd::telemetry::metric(name)
            .unwrap_or_else(|| panic!("{name} is exported but not in METRICS/docs/metrics.md"));
        assert_eq!(types[name], def.kind.as_str(), "{name}: type");
        let want: BTreeSet<String> = def.labels.iter().map(|l| l.to_string()).collect();
        assert_eq!(set, &want, "{name}: labels");
    }
    // The ones this scrape must show.
    for name in [
        "delayd_build_info",
        "delayd_broker_connected",
        "delayd_next_due_timestamp_seconds",
        "delayd_oldest_overdue_seconds",
        "delayd_redeliveries_deduplicated_total",
        "delayd_invalid_total",
        "delayd_lateness_seconds",
        "delayd_backpressure",
    ] {
        assert!(labels.contains_key(name), "{name} missing from /metrics");
    }
    let route = &s.names.route;
    let sample = |series: &str| {
        text.lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {series} in /metrics"))
    };
    assert_eq!(
        sample("delayd_broker_connected{broker=\"rabbit\",role=\"consume\"}"),
        1.0
    );
    assert_eq!(
        sample("delayd_broker_connected{broker=\"rabbit\",role=\"publish\"}"),
        1.0
    );
    assert_eq!(
        sample(&format!("delayd_invalid_total{{route=\"{route}\"}}")),
        1.0
    );
    let next_due = sample(&format!(
        "delayd_next_due_timestamp_seconds{{route=\"{route}\"}}"
    ));
    let in_s = next_due - now_ms() as f64 / 1000.0;
    assert!((500.0..=600.0).contains(&in_s), "next due in {in_s} s");
    assert_eq!(
        sample(&format!(
            "delayd_oldest_overdue_seconds{{route=\"{route}\"}}"
        )),
        0.0
    );
    s.client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_is_read_only_without_a_token_and_asks_for_one_when_set() {
    let open = Setup::start(Names::new("page-open"), &[], DelaydOptions::default()).await;
    publish_delayed(&open, "p", 3, 600_000).await;
    wait_pending(&open.delayd, 3).await;
    let (status, html) = open.delayd.http_get("/").unwrap();
    assert_eq!(status, 200, "{html}");
    assert!(html.contains("id=\"total-pending\">3<"), "{html}");
    assert!(html.contains(&format!("data-route=\"{}\"", open.names.route)));
    assert_eq!(html.matches("<tr data-id=").count(), 3, "{html}");
    assert!(
        !html.contains("class=\"cancel\""),
        "a cancel button without a token"
    );
    assert!(html.contains("read-only"));
    let (_, page) = open.delayd.api("GET", "/v1/messages", None);
    let id = page["items"][0]["id"].as_str().unwrap().to_owned();
    let (status, _) = http_form(
        open.delayd.http_addr(),
        "/ui/cancel",
        &format!("id={id}&csrf=x"),
    );
    assert_eq!(status, 403, "a cancel from the page without a token");
    assert_eq!(open.delayd.pending(), 3);

    let token = "page-token";
    let closed = Setup::start(
        Names::new("page-token"),
        &[],
        DelaydOptions {
            token: Some(token.into()),
            ..DelaydOptions::default()
        },
    )
    .await;
    let (status, html) = closed.delayd.http_get("/").unwrap();
    assert_eq!(status, 401);
    assert!(
        html.contains("form method=\"post\" action=\"/ui/login\""),
        "{html}"
    );
    assert!(
        !html.contains("total-pending"),
        "the page without the token: {html}"
    );
    let (status, html) = http_request(closed.delayd.http_addr(), "GET", "/", Some(token)).unwrap();
    assert_eq!(status, 200);
    assert!(html.contains("id=\"total-pending\">0<"), "{html}");
    open.client.close().await;
    closed.client.close().await;
}

/// POST an `application/x-www-form-urlencoded` body: (status, body).
fn http_form(addr: std::net::SocketAddr, path: &str, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, answer)
}
