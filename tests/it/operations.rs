//! Operating delayd: the admin API (list, get, cancel by id and by
//! `message_id`, 404s, the bearer token), the `delayd messages` CLI,
//! backpressure with a tiny `engine.max_pending`, a full WAL disk (a small
//! tmpfs, so root is needed), `delayd wal inspect` on a corrupted WAL, and
//! the compose file.
//!
//! The API and backpressure tests run the real `delayd` binary against the
//! real RabbitMQ at 127.0.0.1:5672 (see `common`).

use crate::common;

use std::collections::{BTreeMap, HashSet};
use std::ffi::OsStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::BasicProperties;
use serde_json::Value;

/// Properties with a `message_id` and an `x-delay` in ms.
fn delayed(message_id: &str, delay_ms: i32) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(ShortString::from("x-delay"), AMQPValue::LongInt(delay_ms));
    BasicProperties::default()
        .with_message_id(message_id.into())
        .with_headers(headers)
}

/// A route with its target queue declared, and delayd consuming.
async fn setup(test: &str, opts: DelaydOptions) -> Setup {
    Setup::start(Names::new(test), &[], opts).await
}

/// Waits until delayd reports `n` pending messages.
async fn wait_pending(delayd: &Delayd, n: u64) {
    wait_for(&format!("{n} pending messages"), DEADLINE, || async {
        (delayd.pending() == n).then_some(())
    })
    .await;
}

/// Waits until /readyz says `names.route` is paused for `reason`, with no
/// consumer on its queue and messages waiting there (as `observer` sees it).
async fn wait_paused(delayd: &Delayd, observer: &Client, names: &Names, reason: &str) {
    let what = format!("delayd paused ({reason}) with messages waiting in the broker");
    wait_for(&what, DEADLINE, || async {
        let ready = delayd.readyz();
        let (waiting, consumers) = observer.queue_counts(&names.from_queue).await?;
        (ready["paused_routes"][names.route.as_str()] == reason && consumers == 0 && waiting > 0)
            .then_some(())
    })
    .await;
}

/// Waits until delayd consumes `names.from_queue` again and has drained it.
async fn wait_consuming_again(delayd: &Delayd, observer: &Client, names: &Names) {
    wait_for("delayd consuming again", DEADLINE, || async {
        let ready = delayd.readyz();
        let (waiting, consumers) = observer.queue_counts(&names.from_queue).await?;
        (ready["backpressure"] == false && consumers == 1 && waiting == 0).then_some(())
    })
    .await;
}

/// Runs `delayd messages ARGS` and returns (success, stdout, stderr).
fn messages_cli(args: &[&str]) -> (bool, String, String) {
    delayd_cli("messages", args)
}

/// Receives every message of `sent` (`message_id` -> publish time, ms) within
/// 60 s: each once, none early (before `delay_ms` after its publish), none
/// more than `late_ms` after `delay_ms` counted from the later of its
/// publish and `since_ms` (when whatever held the messages back in the
/// broker ended; 0 if nothing did), and no message outside `sent`. The
/// receiver must consume from before the first message falls due, so that
/// its receive times are arrival times.
async fn receive_each_once(
    receiver: &mut Receiver,
    sent: &BTreeMap<String, u64>,
    delay_ms: u64,
    since_ms: u64,
    late_ms: u64,
) -> Vec<Received> {
    let mut arrived: HashSet<String> = HashSet::new();
    let mut all = Vec::new();
    let mut latest = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while arrived.len() < sent.len() {
        let received = receiver.next(deadline).await.unwrap_or_else(|| {
            panic!(
                "only {} of {} arrived within 60 s",
                arrived.len(),
                sent.len()
            )
        });
        let id = received.message_id().unwrap_or_default().to_owned();
        let sent_at = sent
            .get(&id)
            .unwrap_or_else(|| panic!("unexpected message {id:?}"));
        assert!(received.at_ms >= sent_at + delay_ms, "{id} arrived early");
        let late = received
            .at_ms
            .saturating_sub((*sent_at).max(since_ms) + delay_ms);
        latest = latest.max(late);
        assert!(
            late <= late_ms,
            "{id} arrived {late} ms late (more than {late_ms} ms)"
        );
        assert!(arrived.insert(id.clone()), "{id} arrived twice");
        all.push(received);
    }
    println!("latest of {}: {latest} ms late", sent.len());
    all
}

fn error_text(body: &Value) -> &str {
    body["error"]
        .as_str()
        .unwrap_or_else(|| panic!("error answer without an \"error\" message: {body}"))
}

// ------------------------------------------------------------- admin API

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_lists_with_pagination_gets_and_cancels() {
    let s = setup("api", DelaydOptions::default()).await;
    let route = &s.names.route;
    // Five messages due in 10..14 minutes: they stay pending for the test.
    for i in 0..5 {
        s.client
            .publish(
                &s.names.from_exchange,
                "order.created",
                format!("body-{i}").as_bytes(),
                delayed(&format!("m{i}"), 600_000 + i * 60_000),
            )
            .await;
    }
    wait_pending(&s.delayd, 5).await;

    // Pages of two, in due order, with a cursor; the last page has none.
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/messages?route={route}&limit=2&cursor={c}"),
            None => format!("/v1/messages?route={route}&limit=2"),
        };
        let (status, page) = s.delayd.api("GET", &path, None);
        assert_eq!(status, 200, "{path}: {page}");
        pages += 1;
        let items = page["items"].as_array().expect("items array").clone();
        assert!(items.len() <= 2, "page larger than limit: {page}");
        seen.extend(items);
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
        assert!(pages < 10, "pagination does not end");
    }
    assert_eq!(pages, 3, "5 messages by 2 make 3 pages");
    let ids: Vec<&str> = seen
        .iter()
        .map(|i| i["message_id"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        ids,
        ["m0", "m1", "m2", "m3", "m4"],
        "not in due order: {seen:?}"
    );
    let dues: Vec<u64> = seen
        .iter()
        .map(|i| i["due_ms"].as_u64().unwrap_or(0))
        .collect();
    assert!(
        dues.windows(2).all(|w| w[0] < w[1]),
        "dues not increasing: {dues:?}"
    );
    let first = &seen[0];
    assert_eq!(first["route"], Value::from(route.as_str()));
    assert_eq!(
        first["target"]["destination"],
        Value::from(s.names.to_exchange.as_str())
    );
    assert_eq!(first["target"]["routing_key"], Value::from("order.created"));
    assert!(
        first["size"].as_u64().unwrap_or(0) > "body-0".len() as u64,
        "{first}"
    );
    // Due-window filter.
    let (_, window) = s.delayd.api(
        "GET",
        &format!(
            "/v1/messages?route={route}&due_from={}&due_to={}",
            dues[1], dues[3]
        ),
        None,
    );
    assert_eq!(
        window["items"].as_array().map(Vec::len),
        Some(3),
        "{window}"
    );
    // Lookup by message_id.
    let (_, by_key) = s.delayd.api(
        "GET",
        &format!("/v1/messages?route={route}&message_id=m2"),
        None,
    );
    assert_eq!(by_key["items"][0]["id"], seen[2]["id"], "{by_key}");

    // Get: metadata and headers; the body only when asked.
    let id0 = seen[0]["id"].as_str().expect("string id").to_owned();
    let (status, shown) = s.delayd.api("GET", &format!("/v1/messages/{id0}"), None);
    assert_eq!(status, 200, "{shown}");
    assert_eq!(shown["headers"]["x-delay"], Value::from(600_000));
    assert_eq!(shown["properties"]["message_id"], Value::from("m0"));
    assert!(shown.get("body").is_none(), "body sent unasked: {shown}");
    let (_, with_body) = s
        .delayd
        .api("GET", &format!("/v1/messages/{id0}?body=true"), None);
    assert_eq!(with_body["body"], Value::from("body-0"));

    // Cancel by id; then it is gone: 404 with a JSON message.
    let (status, body) = s.delayd.api("DELETE", &format!("/v1/messages/{id0}"), None);
    assert_eq!(
        (status, body["cancelled"].as_str()),
        (200, Some(id0.as_str())),
        "{body}"
    );
    for method in ["DELETE", "GET"] {
        let (status, body) = s.delayd.api(method, &format!("/v1/messages/{id0}"), None);
        assert_eq!(status, 404, "{method} of a cancelled message: {body}");
        assert!(error_text(&body).contains(&id0), "{body}");
    }
    let (status, body) = s.delayd.api("DELETE", "/v1/messages/123456789012", None);
    assert_eq!(status, 404, "{body}");
    error_text(&body);
    let (status, body) = s.delayd.api("GET", "/v1/messages/not-a-number", None);
    assert_eq!(status, 404, "{body}");

    // Cancel by AMQP message_id; a second time there is nothing left.
    let path = format!("/v1/messages?route={route}&message_id=m3");
    let (status, body) = s.delayd.api("DELETE", &path, None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["cancelled"], Value::from(vec![seen[3]["id"].clone()]));
    let (status, body) = s.delayd.api("DELETE", &path, None);
    assert_eq!(status, 404, "{body}");
    error_text(&body);
    let (status, body) = s.delayd.api("DELETE", "/v1/messages?message_id=m4", None);
    assert_eq!(
        status, 400,
        "a cancel by message_id needs the route: {body}"
    );

    // Malformed input and unknown endpoints answer JSON too.
    let (status, body) = s.delayd.api("GET", "/v1/messages?limit=many", None);
    assert_eq!(status, 400, "{body}");
    error_text(&body);
    let (status, body) = s.delayd.api("GET", "/v1/nothing", None);
    assert_eq!(status, 404, "{body}");
    let (status, body) = s.delayd.api("POST", "/v1/messages", None);
    assert_eq!(status, 405, "{body}");
    error_text(&body);

    // Counts: three left.
    let (_, counts) = s.delayd.api("GET", "/v1/counts", None);
    assert_eq!(counts["routes"][route.as_str()], Value::from(3), "{counts}");

    // The CLI talks to the same API.
    let http = s.delayd.http_addr().to_string();
    let (ok, out, err) = messages_cli(&["--http", &http, "list", "--route", route, "--limit", "2"]);
    assert!(ok, "messages list failed: {err}");
    assert!(
        out.contains("m1") && out.contains("m2") && !out.contains("m4"),
        "{out}"
    );
    assert!(out.contains("next page: --cursor"), "{out}");
    let (ok, out, err) = messages_cli(&[
        "--http",
        &http,
        "cancel",
        "--route",
        route,
        "--message-id",
        "m4",
    ]);
    assert!(ok, "messages cancel --message-id failed: {err}");
    assert!(out.contains(seen[4]["id"].as_str().unwrap_or("?")), "{out}");
    let id1 = seen[1]["id"].as_str().unwrap_or("?");
    let (ok, out, err) = messages_cli(&["--http", &http, "cancel", id1]);
    assert!(ok, "messages cancel ID failed: {err}");
    assert!(out.contains(id1), "{out}");
    let (ok, _, err) = messages_cli(&["--http", &http, "cancel", id1]);
    assert!(
        !ok && err.contains("404"),
        "a second cancel must fail with 404: {err}"
    );
    wait_pending(&s.delayd, 1).await;
    s.client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_messages_never_arrive() {
    let s = setup("cancel", DelaydOptions::default()).await;
    // b and c are cancelled; d, due after them, is the sentinel: delayd fires
    // in due order, so once d arrived b and c would have too.
    let plan = [("a", 1500), ("b", 1600), ("c", 1700), ("d", 2500)];
    for (id, delay) in plan {
        s.client
            .publish(
                &s.names.from_exchange,
                "k",
                id.as_bytes(),
                delayed(id, delay),
            )
            .await;
    }
    wait_pending(&s.delayd, 4).await;
    let (_, list) = s.delayd.api(
        "GET",
        &format!("/v1/messages?route={}", s.names.route),
        None,
    );
    let id_of = |mid: &str| {
        list["items"]
            .as_array()
            .and_then(|items| items.iter().find(|i| i["message_id"] == mid))
            .and_then(|i| i["id"].as_str())
            .unwrap_or_else(|| panic!("{mid} not listed: {list}"))
            .to_owned()
    };
    let b = id_of("b");
    let (status, body) = s.delayd.api("DELETE", &format!("/v1/messages/{b}"), None);
    assert_eq!(status, 200, "{body}");
    let (status, body) = s.delayd.api(
        "DELETE",
        &format!("/v1/messages?route={}&message_id=c", s.names.route),
        None,
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(s.delayd.pending(), 2);

    let mut receiver = s.client.consume(&s.names.target_queue).await;
    let mut arrived = Vec::new();
    while !arrived.iter().any(|m| m == "d") {
        let received = receiver
            .next(Instant::now() + DEADLINE)
            .await
            .unwrap_or_else(|| panic!("only {arrived:?} arrived within {DEADLINE:?}"));
        arrived.push(received.message_id().unwrap_or_default().to_owned());
    }
    assert_eq!(arrived, ["a", "d"], "cancelled messages arrived");
    // Nothing else is on its way: delayd published two and cancelled two
    // (its own counts, not a wait for what does not come).
    wait_pending(&s.delayd, 0).await;
    assert_eq!(s.delayd.metric("delayd_fired_total"), 2.0);
    assert_eq!(s.delayd.metric("delayd_cancelled_total"), 2.0);
    receiver.close().await;
    s.client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_is_required_when_set() {
    let token = "s3cret-token";
    let s = setup(
        "token",
        DelaydOptions {
            token: Some(token.into()),
            ..DelaydOptions::default()
        },
    )
    .await;
    for wrong in [None, Some("wrong")] {
        let (status, body) = s.delayd.api("GET", "/v1/messages", wrong);
        assert_eq!(status, 401, "token {wrong:?}: {body}");
        error_text(&body);
        let (status, _) = s.delayd.api("DELETE", "/v1/messages/1", wrong);
        assert_eq!(status, 401);
    }
    let (status, body) = s.delayd.api("GET", "/v1/messages", Some(token));
    assert_eq!(status, 200, "{body}");
    // Probes and metrics stay open.
    assert_eq!(s.delayd.http_get("/healthz").map(|r| r.0).ok(), Some(200));

    let http = s.delayd.http_addr().to_string();
    let (ok, _, err) = messages_cli(&["--http", &http, "list"]);
    assert!(!ok && err.contains("401"), "the CLI without a token: {err}");
    let (ok, out, err) = messages_cli(&["--http", &http, "--token", token, "list"]);
    assert!(ok, "the CLI with the token: {err}");
    assert!(out.contains("0 message(s)"), "{out}");
    s.client.close().await;
}

#[test]
fn a_public_listener_without_a_token_is_refused() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let config = dir.path().join("public.toml");
    std::fs::write(
        &config,
        format!(
            "[wal]\ndir = {:?}\n[http]\nlisten = \"0.0.0.0:0\"\n",
            dir.path().join("wal").display().to_string(),
        ),
    )
    .expect("write config");
    let output = delayd_command(&[
        OsStr::new("run"),
        OsStr::new("--config"),
        config.as_os_str(),
    ]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "delayd started: {stderr}");
    assert!(
        stderr.contains("http.listen") && stderr.contains("token"),
        "{stderr}"
    );
    assert!(
        stderr.contains("public.toml"),
        "the error should name the file: {stderr}"
    );
}

// ---------------------------------------------------------- backpressure

/// With `max_pending = 5`, delayd never holds more than 5 pending messages:
/// it cancels its consumer (the rest wait in the broker queue) and consumes
/// again as messages fall due. All 50 arrive, once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backpressure_stops_consuming_at_max_pending_and_loses_nothing() {
    const LIMIT: u64 = 5;
    const COUNT: usize = 50;
    let s = setup(
        "backpressure",
        DelaydOptions {
            max_pending: LIMIT,
            prefetch: 10,
            ..DelaydOptions::default()
        },
    )
    .await;

    // Watch /readyz throughout: the largest pending count ever reported.
    let max_seen = Arc::new(AtomicU64::new(0));
    let watching = Arc::new(AtomicBool::new(true));
    let watcher = {
        let (max_seen, watching) = (max_seen.clone(), watching.clone());
        let addr = s.delayd.http_addr();
        std::thread::spawn(move || {
            while watching.load(Ordering::Relaxed) {
                if let Ok((_, body)) = http_get(addr, "/readyz") {
                    if let Ok(v) = serde_json::from_str::<Value>(&body) {
                        let pending = v["pending"].as_u64().unwrap_or(0);
                        max_seen.fetch_max(pending, Ordering::Relaxed);
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };

    let mut sent = BTreeMap::new();
    for i in 0..COUNT {
        let id = format!("bp-{i}");
        sent.insert(id.clone(), now_ms());
        s.client
            .publish(
                &s.names.from_exchange,
                "k",
                id.as_bytes(),
                delayed(&id, 1000),
            )
            .await;
    }

    // At the limit: paused (no consumer on the queue), the rest in the broker,
    // and /readyz and /metrics say so.
    let observer = Client::connect("delayd-it-backpressure-observer").await;
    wait_paused(&s.delayd, &observer, &s.names, "max_pending").await;
    let ready = s.delayd.readyz();
    assert_eq!(ready["backpressure"], Value::from(true), "{ready}");
    assert_eq!(ready["limits"]["max_pending"], Value::from(LIMIT));
    let (status, metrics) = s.delayd.http_get("/metrics").expect("GET /metrics");
    assert_eq!(status, 200);
    let gauge = format!("delayd_backpressure{{route=\"{}\"}} 1", s.names.route);
    assert!(metrics.contains(&gauge), "no `{gauge}` in /metrics");

    // Everything arrives, exactly once and not early, as delayd resumes:
    // LIMIT at a time, each a second after it was let in, so the last ones
    // leave about COUNT / LIMIT seconds after they were published.
    let mut receiver = s.client.consume(&s.names.target_queue).await;
    let throughput_ms = (COUNT as u64 / LIMIT) * 1000;
    receive_each_once(&mut receiver, &sent, 1000, 0, throughput_ms + LATE_MS).await;
    watching.store(false, Ordering::Relaxed);
    let _ = watcher.join();
    // It got to the limit (the watcher saw it: a test that never sampled
    // would prove nothing) and never past it.
    assert_eq!(
        max_seen.load(Ordering::Relaxed),
        LIMIT,
        "most pending seen, with max_pending = {LIMIT}"
    );
    // Deliveries prefetched beyond the limit were held, not dropped.
    let held = s.delayd.metric("delayd_backpressure_held_total");
    assert!(held >= 1.0, "no delivery was held at the limit");
    assert_eq!(
        s.delayd.metric("delayd_fired_total"),
        COUNT as f64,
        "fired count"
    );

    // Below the limit again: consuming, not paused.
    wait_consuming_again(&s.delayd, &observer, &s.names).await;
    let (_, metrics) = s.delayd.http_get("/metrics").expect("GET /metrics");
    let gauge = format!("delayd_backpressure{{route=\"{}\"}} 0", s.names.route);
    assert!(metrics.contains(&gauge), "no `{gauge}` in /metrics");
    receiver.close().await;
    observer.close().await;
    s.client.close().await;
}

// ------------------------------------------------------------- full disk

/// A small tmpfs (needs root, as CI and the dev machines run), unmounted on drop.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    fn mount(bytes: u64) -> SmallDisk {
        let dir = tempfile::Builder::new()
            .prefix("delayd-it-disk.")
            .tempdir()
            .expect("cannot create a temporary directory");
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .expect("cannot run mount");
        assert!(
            status.success(),
            "mounting a {bytes}-byte tmpfs failed (the test needs root)"
        );
        SmallDisk { dir }
    }

    fn path(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Write a file until the disk is full.
    fn fill(&self, name: &str) {
        use std::io::Write;
        let mut file = std::fs::File::create(self.path().join(name)).expect("create filler");
        let chunk = vec![0u8; 4096];
        loop {
            match file.write(&chunk) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(28) => break,
                Err(e) => panic!("filling the disk: {e}"),
            }
        }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_pauses_consuming_and_loses_nothing_once_space_is_freed() {
    const COUNT: usize = 20;
    let disk = SmallDisk::mount(4 << 20);
    let wal_dir = disk.path().join("wal");
    let names = Names::new("diskfull");
    let _cleanup = names.cleanup();
    let client = Client::connect("delayd-it-diskfull").await;
    client
        .declare_target(&names.to_exchange, &names.target_queue)
        .await;
    let opts = DelaydOptions {
        prefetch: 10,
        ..DelaydOptions::default()
    };
    let delayd = Delayd::start_consuming(
        |_, http| config_toml(&names, &wal_dir, http, &opts),
        &names.from_queue,
    )
    .await;

    // The WAL volume fills up; then messages come in.
    disk.fill("filler");
    let body = vec![b'x'; 8192];
    let mut sent = BTreeMap::new();
    for i in 0..COUNT {
        let id = format!("full-{i}");
        sent.insert(id.clone(), now_ms());
        client
            .publish(&names.from_exchange, "k", &body, delayed(&id, 1000))
            .await;
    }

    // delayd stops consuming; the messages wait in the broker, none stored.
    let observer = Client::connect("delayd-it-diskfull-observer").await;
    wait_paused(&delayd, &observer, &names, "disk_full").await;
    assert_eq!(delayd.pending(), 0, "a full disk took messages in");
    assert!(
        delayd.log_tail(200).contains("DISK FULL"),
        "no DISK FULL error in the log:\n{}",
        delayd.log_tail(50)
    );

    // Space is freed: delayd resumes by itself (its held deliveries probe
    // the disk every 5 s) and every message arrives, once, not early,
    // byte-equal, a second after it could be stored.
    let mut receiver = client.consume(&names.target_queue).await;
    std::fs::remove_file(disk.path().join("filler")).expect("remove filler");
    let stored_by_ms = now_ms() + 5000;
    for received in receive_each_once(&mut receiver, &sent, 1000, stored_by_ms, LATE_MS).await {
        assert_eq!(received.delivery.data, body, "body changed");
    }
    wait_consuming_again(&delayd, &observer, &names).await;
    receiver.close().await;
    observer.close().await;
    client.close().await;
}

/// Stored messages still go out while the disk is full. Their Done records
/// hit ENOSPC, and the disk reserve (`wal.reserve_bytes`) is released to
/// them: they fit, so the messages are not sent again after a restart, and
/// delayd keeps running (the test requires the release in the log).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_messages_are_delivered_while_the_disk_is_full() {
    // Enough Done records (33 bytes each) to exceed one tmpfs page: the
    // filler leaves the WAL's last page partly free, and fewer Dones, all
    // in one lazy batch, can fit in that slack and never fail.
    const COUNT: usize = 200;
    let disk = SmallDisk::mount(4 << 20);
    let wal_dir = disk.path().join("wal");
    let s = Names::new("diskfull-fire");
    let _cleanup = s.cleanup();
    let client = Client::connect("delayd-it-diskfull-fire").await;
    client.declare_target(&s.to_exchange, &s.target_queue).await;
    let opts = DelaydOptions::default();
    let mut delayd = Delayd::start_consuming(
        |_, http| config_toml(&s, &wal_dir, http, &opts),
        &s.from_queue,
    )
    .await;

    let mut sent = BTreeMap::new();
    for i in 0..COUNT {
        let id = format!("fire-{i}");
        sent.insert(id.clone(), now_ms());
        client
            .publish(&s.from_exchange, "k", b"stored", delayed(&id, 5000))
            .await;
    }
    wait_pending(&delayd, COUNT as u64).await;
    disk.fill("filler");

    let mut receiver = client.consume(&s.target_queue).await;
    receive_each_once(&mut receiver, &sent, 5000, 0, LATE_MS).await;
    wait_pending(&delayd, 0).await;
    // The disk really was full: their Done records took the reserve.
    wait_for(
        "the full disk to show in delayd's log",
        DEADLINE,
        || async {
            delayd
                .log_tail(200)
                .contains("the disk reserve")
                .then_some(())
        },
    )
    .await;
    let (status, _) = delayd.http_get("/healthz").expect("GET /healthz");
    assert_eq!(status, 200, "delayd is still up:\n{}", delayd.log_tail(30));

    // Space back: delayd still takes and delivers new messages.
    std::fs::remove_file(disk.path().join("filler")).expect("remove filler");
    let after = BTreeMap::from([("after".to_owned(), now_ms())]);
    client
        .publish(&s.from_exchange, "k", b"after", delayed("after", 500))
        .await;
    receive_each_once(&mut receiver, &after, 500, 0, LATE_MS).await;
    assert_eq!(
        delayd
            .sigterm_and_wait(Duration::from_secs(15))
            .await
            .code(),
        Some(0)
    );
    receiver.close().await;
    client.close().await;
}

/// Backpressure must not spend a quorum queue's delivery limit. With
/// `x-delivery-limit = 3` the broker drops a message returned more than three
/// times; delayd at `max_pending` used to nack-requeue every delivery it had
/// no room for, at each pause, and lost messages this way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backpressure_on_a_quorum_queue_with_a_delivery_limit_loses_nothing() {
    const COUNT: usize = 40;
    let s = setup(
        "quorum-limit",
        DelaydOptions {
            max_pending: 4,
            prefetch: 20,
            from_extra: r#", queue_type = "quorum", queue_arguments = { "x-delivery-limit" = 3 }"#
                .into(),
            ..DelaydOptions::default()
        },
    )
    .await;
    let mut receiver = s.client.consume(&s.names.target_queue).await;
    let mut sent = BTreeMap::new();
    for i in 0..COUNT {
        let id = format!("quorum-{i}");
        sent.insert(id.clone(), now_ms());
        s.client
            .publish(
                &s.names.from_exchange,
                "k",
                id.as_bytes(),
                delayed(&id, 300),
            )
            .await;
    }
    // Four at a time (max_pending), each 300 ms after it was let in.
    let throughput_ms = (COUNT as u64 / 4) * 300;
    for received in receive_each_once(&mut receiver, &sent, 300, 0, throughput_ms + LATE_MS).await {
        assert_eq!(
            received.delivery.data,
            received.message_id().unwrap_or_default().as_bytes()
        );
    }
    // The queue really is a quorum queue with the limit (a classic queue
    // would not drop anything, and the test would prove nothing).
    let info = std::process::Command::new("rabbitmqctl")
        .args(["list_queues", "-q", "name", "type", "arguments"])
        .output()
        .expect("rabbitmqctl list_queues");
    let listing = String::from_utf8_lossy(&info.stdout);
    let line = listing
        .lines()
        .find(|l| l.starts_with(&s.names.from_queue))
        .unwrap_or_else(|| panic!("no queue {} in:\n{listing}", s.names.from_queue));
    assert!(
        line.contains("quorum") && line.contains("x-delivery-limit"),
        "{line}"
    );
    receiver.close().await;
}

/// Big messages with a byte budget of 1 MiB (`engine.max_bytes_in_flight`)
/// on both sides: each 700 KB message is stored, and later published, about
/// one at a time, and all arrive byte-equal, none early.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_messages_pass_a_small_byte_budget_intact() {
    const COUNT: usize = 12;
    let s = Names::new("byte-budget");
    let _cleanup = s.cleanup();
    let client = Client::connect("delayd-it-byte-budget").await;
    client.declare_target(&s.to_exchange, &s.target_queue).await;
    let opts = DelaydOptions::default();
    let delayd = Delayd::start_consuming(
        |wal, http| {
            config_toml(&s, wal, http, &opts)
                .replace("[engine]\n", "[engine]\nmax_bytes_in_flight = 1048576\n")
        },
        &s.from_queue,
    )
    .await;
    let mut receiver = client.consume(&s.target_queue).await;
    let mut sent = BTreeMap::new();
    let body = |i: usize| -> Vec<u8> { (0..700_000).map(|j| (i * 31 + j) as u8).collect() };
    for i in 0..COUNT {
        let id = format!("big-{i}");
        sent.insert(id.clone(), now_ms());
        client
            .publish(&s.from_exchange, "k", &body(i), delayed(&id, 800))
            .await;
    }
    for received in receive_each_once(&mut receiver, &sent, 800, 0, LATE_MS).await {
        let id = received.message_id().unwrap_or_default().to_owned();
        let i: usize = id["big-".len()..].parse().unwrap();
        assert!(received.delivery.data == body(i), "{id} changed");
    }
    wait_pending(&delayd, 0).await;
    receiver.close().await;
    client.close().await;
}

/// A fatal WAL error stops delayd even when nothing is consumed. The WAL
/// volume goes away while messages wait; the Done records of the fired
/// messages soon need a new segment, which cannot be created. delayd must exit non-zero (it used to log the error and run on,
/// `/healthz` saying ok), and lose nothing: with the volume back, whatever
/// did not go out, or went out without its Done, goes out after the
/// restart, each copy under its message's one id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wal_failure_without_intake_traffic_stops_delayd() {
    // Their Done records alone fill more than a 4 KiB segment.
    const COUNT: usize = 200;
    const DELAY_MS: u64 = 1500;
    let s = Names::new("wal-fatal");
    let _cleanup = s.cleanup();
    let client = Client::connect("delayd-it-wal-fatal").await;
    client.declare_target(&s.to_exchange, &s.target_queue).await;
    let opts = DelaydOptions::default();
    let mut delayd = Delayd::start_consuming(
        |wal, http| {
            config_toml(&s, wal, http, &opts).replace("[wal]\n", "[wal]\nsegment_bytes = 4096\n")
        },
        &s.from_queue,
    )
    .await;
    let mut sent = BTreeMap::new();
    for i in 0..COUNT {
        let id = format!("fatal-{i}");
        sent.insert(id.clone(), now_ms());
        client
            .publish(
                &s.from_exchange,
                "k",
                b"fatal",
                delayed(&id, DELAY_MS as i32),
            )
            .await;
    }
    wait_pending(&delayd, COUNT as u64).await;
    let wal_dir = delayd.wal_dir();
    let moved = wal_dir.with_extension("gone");
    std::fs::rename(&wal_dir, &moved).expect("move the WAL away");

    let mut receiver = client.consume(&s.target_queue).await;
    let status = delayd.wait_exit("of the WAL failure", DEADLINE).await;
    assert!(
        !status.success(),
        "delayd exited with {status} after a fatal WAL error"
    );
    let log = delayd.log_tail(usize::MAX);
    assert!(log.contains("the WAL stopped"), "no reason logged:\n{log}");

    std::fs::rename(&moved, &wal_dir).expect("bring the WAL back");
    let restarted = now_ms();
    delayd.restart().await;
    // Every message at least once, none early, none later than LATE_MS
    // past its due time or the restart; copies share one x-delayd-id.
    let mut ids: BTreeMap<String, String> = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while ids.len() < COUNT {
        let received = receiver
            .next(deadline)
            .await
            .unwrap_or_else(|| panic!("only {} of {COUNT} arrived: {ids:?}", ids.len()));
        let id = received.message_id().unwrap_or_default().to_owned();
        let sent_at = sent[&id];
        assert!(received.at_ms >= sent_at + DELAY_MS, "{id} arrived early");
        let bound = (sent_at + DELAY_MS).max(restarted) + LATE_MS;
        assert!(
            received.at_ms <= bound,
            "{id} arrived {} ms late",
            received.at_ms - bound + LATE_MS
        );
        let uid = received
            .header_text("x-delayd-id")
            .unwrap_or_else(|| panic!("{id} has no x-delayd-id"));
        let first = ids.entry(id.clone()).or_insert_with(|| uid.clone());
        assert_eq!(*first, uid, "{id} came under two ids");
    }
    wait_pending(&delayd, 0).await;
    receiver.close().await;
    client.close().await;
}

// ----------------------------------------------------------- wal inspect

#[test]
fn wal_inspect_reports_a_corrupted_frame_with_segment_and_offset() {
    use delayd::wal::{Wal, WalConfig};

    let dir = tempfile::tempdir().expect("temporary directory");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (wal, _) = Wal::open(WalConfig::new(dir.path()), |_, _| {}).expect("open WAL");
    runtime.block_on(async {
        for i in 0..3u64 {
            wal.append_schedule(
                4_000_000_000_000 + i,
                u128::from(i) + 1,
                "orders",
                vec![b'x'; 64],
            )
            .expect("append")
            .await
            .expect("writer")
            .expect("durable");
        }
    });
    wal.close().expect("close WAL");
    // The segment: the directory also holds the lock and the ledger of
    // owed frames.
    let segment = std::fs::read_dir(dir.path())
        .expect("list WAL")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .max_by_key(|p| p.metadata().map(|m| m.len()).unwrap_or(0))
        .expect("a segment");

    let inspect = |json: bool| {
        let mut args = vec![
            OsStr::new("wal"),
            OsStr::new("inspect"),
            dir.path().as_os_str(),
        ];
        if json {
            args.push(OsStr::new("--json"));
        }
        delayd_command(&args)
    };
    let clean = inspect(false);
    let out = String::from_utf8_lossy(&clean.stdout);
    assert!(clean.status.success(), "{out}");
    assert!(
        out.contains("live records: 3") && out.contains("corruption: none"),
        "{out}"
    );

    // Flip a byte in the first frame (after the 16-byte segment header);
    // frames after it are intact, so this is corruption, not a torn tail.
    let mut bytes = std::fs::read(&segment).expect("read segment");
    bytes[16 + 30] ^= 0xff;
    std::fs::write(&segment, &bytes).expect("write segment");

    let corrupt = inspect(false);
    let out = String::from_utf8_lossy(&corrupt.stdout);
    let err = String::from_utf8_lossy(&corrupt.stderr);
    assert!(
        !corrupt.status.success(),
        "corruption must fail inspect: {out}"
    );
    let name = segment
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    assert!(
        out.lines()
            .any(|l| l.starts_with("CORRUPT") && l.contains(&name) && l.contains("at offset 16")),
        "no CORRUPT line naming {name} at offset 16:\n{out}"
    );
    assert!(out.contains("live records: 2"), "{out}");
    assert!(err.contains("1 corrupt frame"), "{err}");

    let json = inspect(true);
    let report: Value = serde_json::from_slice(&json.stdout).expect("JSON report");
    assert_eq!(report["corruption"][0]["offset"], Value::from(16));
    assert!(
        report["corruption"][0]["segment"]
            .as_str()
            .is_some_and(|s| s.ends_with(&name)),
        "{report}"
    );
    assert_eq!(report["oldest_due_ms"], Value::from(4_000_000_000_001u64));
    assert_eq!(report["newest_due_ms"], Value::from(4_000_000_000_002u64));
}

// ------------------------------------------------- one process per WAL dir

/// A child process that is killed if the test fails before it exits.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A second `delayd run` on a WAL directory in use exits non-zero, naming
/// the directory and the running process's pid, and touches nothing: the
/// first keeps running and delivers what it holds. `wal inspect` still
/// reads the live WAL and says who holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_delayd_on_the_same_wal_dir_is_refused() {
    let s = setup("wal-lock", DelaydOptions::default()).await;
    let sent = now_ms();
    s.client
        .publish(&s.names.from_exchange, "k", b"held", delayed("held", 6000))
        .await;
    wait_pending(&s.delayd, 1).await;

    // The same config (so the same WAL) with another admin port.
    let text = std::fs::read_to_string(s.delayd.config_path()).expect("read config");
    let text: Vec<String> = text
        .lines()
        .map(|l| match l.starts_with("listen = ") {
            true => "listen = \"127.0.0.1:0\"".to_owned(),
            false => l.to_owned(),
        })
        .collect();
    let second = s.delayd.config_path().with_file_name("second.toml");
    std::fs::write(&second, text.join("\n")).expect("write config");
    let mut child = KillOnDrop(
        std::process::Command::new(env!("CARGO_BIN_EXE_delayd"))
            .arg("run")
            .arg("--config")
            .arg(&second)
            .env("NO_COLOR", "1")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start a second delayd"),
    );
    let status = wait_for("the second delayd to exit", DEADLINE, || {
        let status = child.0.try_wait().expect("poll the second delayd");
        async move { status }
    })
    .await;
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.0.stderr.take().expect("piped"), &mut stderr)
        .expect("read stderr");
    assert!(!status.success(), "the second delayd exited 0:\n{stderr}");
    let wal_dir = s.delayd.wal_dir().display().to_string();
    let pid = s.delayd.pid().to_string();
    assert!(
        stderr.contains(&wal_dir) && stderr.contains(&format!("pid {pid}")),
        "the error should name {wal_dir} and pid {pid}:\n{stderr}"
    );

    let (ok, out, err) = delayd_cli("wal", &["inspect", &wal_dir]);
    assert!(ok, "wal inspect on a live WAL: {out}{err}");
    assert!(
        out.contains(&format!("in use by delayd pid {pid}")) && out.contains("live records: 1"),
        "{out}"
    );

    let mut receiver = s.client.consume(&s.names.target_queue).await;
    let received = receiver
        .next(Instant::now() + DEADLINE)
        .await
        .expect("the first delayd still delivers its pending message");
    receiver.close().await;
    assert_eq!(received.delivery.data, b"held");
    assert!(
        received.at_ms >= sent + 6000,
        "early by {} ms",
        sent + 6000 - received.at_ms
    );
    wait_pending(&s.delayd, 0).await;
    s.client.close().await;
}

// ------------------------------------------------------------ deployment

/// `docker-compose config -q` accepts the compose file (Debian's
/// docker-compose validates offline). Skipped when the tool is missing.
#[test]
fn compose_file_is_valid() {
    let root = env!("CARGO_MANIFEST_DIR");
    let output = match std::process::Command::new("docker-compose")
        .args(["-f", "docker-compose.yml", "config", "-q"])
        .current_dir(root)
        // The file commits no token; it requires one from the environment.
        .env("DELAYD_HTTP__TOKEN", "compose-test-token")
        .output()
    {
        Ok(output) => output,
        // scripts/test.sh installs it; a silent pass would prove nothing.
        Err(e) => panic!(
            "docker-compose is needed to validate docker-compose.yml ({e}); \
             `apt-get install docker-compose`, or run scripts/test.sh"
        ),
    };
    assert!(
        output.status.success(),
        "docker-compose config -q rejected docker-compose.yml:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The compose file publishes ports on the host's loopback only and commits
/// no admin token: it takes the token from the environment, with no default.
#[test]
fn compose_file_binds_loopback_and_commits_no_token() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docker-compose.yml");
    let text = std::fs::read_to_string(path).expect("read docker-compose.yml");
    let mut published = 0;
    for line in text
        .lines()
        .filter(|l| l.trim_start().starts_with("ports:"))
    {
        for port in line.split('"').skip(1).step_by(2) {
            published += 1;
            assert!(
                port.starts_with("127.0.0.1:"),
                "port {port:?} is published on every interface: {line}"
            );
        }
    }
    assert!(
        published >= 3,
        "expected the published ports inline: {text}"
    );
    let token = text
        .lines()
        .find(|l| l.trim_start().starts_with("DELAYD_HTTP__TOKEN:"))
        .expect("the delayd service sets DELAYD_HTTP__TOKEN");
    assert!(
        token.contains("${DELAYD_HTTP__TOKEN:?"),
        "the token must come from the environment, required, with no default: {token}"
    );
    assert!(!text.contains("change-me"), "a committed token is left");
}

/// A quorum ingress queue with RabbitMQ 4's default delivery limit (20):
/// RabbitMQ 4.3 counts a delivery returned by a closed channel or a lost
/// connection (a delayd crash, a network cut) against it, and drops the
/// message past it. delayd declares its quorum queues with a limit never
/// reached (`x-delivery-limit` = 2^31-1; -1 drops every return on 3.10)
/// unless the config sets one, and strips the
/// counts the broker adds (`x-delivery-count`, `x-acquired-count`). Here a
/// message is returned 22 times while delayd is stopped (as 22 crashes
/// with it in flight would): it still arrives once, on time from the
/// restart, with only the headers its producer set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_returned_more_often_than_the_default_delivery_limit_is_not_dropped() {
    const RETURNS: usize = 22;
    let mut s = setup(
        "quorum-returns",
        DelaydOptions {
            from_extra: r#", queue_type = "quorum""#.into(),
            ..DelaydOptions::default()
        },
    )
    .await;
    let status = s.delayd.sigterm_and_wait(Duration::from_secs(20)).await;
    assert_eq!(status.code(), Some(0));
    let id = "returned";
    s.client
        .publish(&s.names.from_exchange, "k", id.as_bytes(), delayed(id, 500))
        .await;
    for n in 0..RETURNS {
        let channel = s.client.connection.create_channel().await.expect("channel");
        let got = wait_for(&format!("delivery {n}"), DEADLINE, || async {
            channel
                .basic_get(
                    s.names.from_queue.as_str().into(),
                    lapin::options::BasicGetOptions { no_ack: false },
                )
                .await
                .expect("basic.get")
        })
        .await;
        assert_eq!(got.delivery.data, id.as_bytes());
        // Closed unacked: the broker takes it back and counts it.
        channel.close(200, "return".into()).await.expect("close");
    }
    s.delayd.restart().await;
    let since = now_ms();
    let sent = BTreeMap::from([(id.to_owned(), since)]);
    let mut receiver = s.client.consume(&s.names.target_queue).await;
    for received in receive_each_once(&mut receiver, &sent, 0, since, 500 + LATE_MS).await {
        let headers = received
            .delivery
            .properties
            .headers()
            .clone()
            .unwrap_or_default();
        for count in ["x-delivery-count", "x-acquired-count"] {
            assert!(
                !headers.inner().contains_key(count),
                "{count} reached the target: {headers:?}"
            );
        }
        assert!(headers.inner().contains_key("x-delay"), "{headers:?}");
    }
    receiver.close().await;
}
