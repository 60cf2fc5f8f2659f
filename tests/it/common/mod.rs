//! Harness for the end-to-end tests: runs the real `delayd` binary as a child
//! process against the RabbitMQ broker at 127.0.0.1:5672 (guest/guest;
//! override with `AMQP_URL`), and talks to the broker with a plain lapin
//! client.
//!
//! Every test gets names of its own (queues, exchanges, route), a WAL
//! directory and an admin HTTP port of its own, so tests run in parallel.
//! delayd's stderr and stdout go to a log file in the test's temporary
//! directory; the tail of it is printed when the test fails.
//!
//! Nothing sleeps blindly: every wait polls a condition until a deadline.
#![allow(dead_code)]

pub mod kafka;
pub mod seed;
pub mod tls;

use std::collections::HashSet;
use std::fs::File;
use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_lite::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicRejectOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, Consumer,
    ExchangeKind, PublisherConfirm,
};
use tempfile::TempDir;

/// Longest wait for anything that should happen "soon" (start-up, a message).
pub const DEADLINE: Duration = Duration::from_secs(20);

/// How late a message may arrive before a test counts it as a bug: generous
/// on a noisy 2-core machine, but finite, so a regression that made every
/// delivery seconds late fails.
pub const LATE_MS: u64 = 5000;

/// Interval between two polls of a condition.
const POLL: Duration = Duration::from_millis(50);

/// The queues delayd parks messages in by default.
pub const INVALID_QUEUE: &str = "delayd.invalid";
pub const UNROUTABLE_QUEUE: &str = "delayd.unroutable";

pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// Aborts this machine's TCP connection from local port `port` to the
/// broker's AMQP port (`ss -K`, which needs `CAP_NET_ADMIN`): the process
/// and the broker both see it reset at once, as when a node goes away,
/// where `rabbitmqctl close_connection` takes a second or more to start.
pub fn abort_broker_connection(port: u16) {
    let sport = port.to_string();
    let output = Command::new("ss")
        .args([
            "-K",
            "-t",
            "dst",
            "127.0.0.1",
            "dport",
            "=",
            "5672",
            "sport",
            "=",
            &sport,
        ])
        .output()
        .expect("cannot run ss (iproute2)");
    assert!(
        output.status.success(),
        "ss -K failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// One TCP connection to the broker cut while both ends live: every packet
/// of it dropped, both ways (iptables), until dropped.
pub struct CutConnection {
    rules: [[String; 6]; 2],
}

impl CutConnection {
    /// Cut the connection whose local (client) port is `port`.
    pub fn new(port: u16) -> CutConnection {
        let port = port.to_string();
        let rule =
            |chain: &str, side: &str| [chain, "-p", "tcp", side, &port, "-j"].map(str::to_owned);
        let cut = CutConnection {
            rules: [rule("INPUT", "--dport"), rule("OUTPUT", "--sport")],
        };
        for rule in &cut.rules {
            cut.iptables("-I", rule);
        }
        cut
    }

    fn iptables(&self, action: &str, rule: &[String; 6]) -> bool {
        Command::new("iptables")
            .args(["-w", action])
            .args(rule)
            .arg("DROP")
            .status()
            .expect("cannot run iptables")
            .success()
    }
}

impl Drop for CutConnection {
    fn drop(&mut self) {
        for rule in &self.rules {
            self.iptables("-D", rule);
        }
    }
}

/// The broker closes the connections whose broker pids are `pids`, as a
/// drain does (CONNECTION_FORCED).
pub fn close_broker_connections(pids: &[String]) {
    let closers: Vec<Child> = pids
        .iter()
        .map(|pid| {
            Command::new("rabbitmqctl")
                .args([
                    "close_connection",
                    pid,
                    "delayd-it: closed mid-stream",
                    "-q",
                ])
                .stdout(Stdio::null())
                .spawn()
                .expect("cannot run rabbitmqctl close_connection")
        })
        .collect();
    for mut closer in closers {
        let status = closer.wait().expect("rabbitmqctl close_connection");
        assert!(
            status.success(),
            "rabbitmqctl close_connection failed: {status}"
        );
    }
}

/// Properties of a test message: `message_id` = `id`, `x-delay` = `delay_ms`.
pub fn delayed(id: &str, delay_ms: u64) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(
        ShortString::from("x-delay"),
        AMQPValue::LongLongInt(delay_ms as i64),
    );
    BasicProperties::default()
        .with_message_id(id.into())
        .with_headers(headers)
}

/// Wall-clock milliseconds since the epoch, truncated (the clock delayd uses).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("system clock before 1970")
        .as_millis() as u64
}

/// A number in `range` drawn for a kill point or similar, printed with
/// `what` and the seed so a failing run can be replayed.
pub fn seeded(what: &str, range: std::ops::Range<u64>) -> u64 {
    let mut seed = seed::Seed::from_env(what);
    let value = seed.draw(range);
    println!("{what}: {value}");
    value
}

/// A suffix no other test of this run (or of an earlier run) uses.
pub fn unique_suffix() -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("system clock before 1970")
        .as_nanos();
    format!("{}.{n}.{nanos}", std::process::id())
}

/// Polls `check` every 50 ms until it returns `Some`, or panics with `what`
/// after `within`.
pub async fn wait_for<T, F, Fut>(what: &str, within: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            start.elapsed() < within,
            "timed out after {within:?} waiting for {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}

// ------------------------------------------------------------------- names

/// The broker names of one test's route. The source queue and exchange are
/// declared by delayd; the target exchange and queue by the test.
#[derive(Debug, Clone)]
pub struct Names {
    pub route: String,
    /// `from.queue`: the durable queue delayd consumes.
    pub from_queue: String,
    /// `from.exchange`: the topic exchange producers publish to.
    pub from_exchange: String,
    /// `to.exchange`: where due messages are republished.
    pub to_exchange: String,
    /// A queue bound to `to_exchange` with `#`, read by the test.
    pub target_queue: String,
}

impl Names {
    pub fn new(test: &str) -> Names {
        let base = format!("delayd-it.{test}.{}", unique_suffix());
        Names {
            route: format!("it-{test}"),
            from_queue: format!("{base}.in"),
            from_exchange: format!("{base}.delayed"),
            to_exchange: format!("{base}.out"),
            target_queue: format!("{base}.target"),
        }
    }

    /// A guard deleting every queue and exchange of these names when dropped.
    pub fn cleanup(&self) -> Cleanup {
        Cleanup {
            queues: vec![self.from_queue.clone(), self.target_queue.clone()],
            exchanges: vec![self.from_exchange.clone(), self.to_exchange.clone()],
        }
    }
}

/// Deletes queues and exchanges when dropped, also when the test panics
/// (best effort: errors are printed, not raised). Declare it before the
/// [`Delayd`] so it drops after delayd has stopped.
pub struct Cleanup {
    pub queues: Vec<String>,
    pub exchanges: Vec<String>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let queues = std::mem::take(&mut self.queues);
        let exchanges = std::mem::take(&mut self.exchanges);
        // Drop cannot await, and may run inside the test's runtime: use a
        // thread with a runtime of its own.
        let done = std::thread::spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => return eprintln!("cleanup: no runtime: {e}"),
            };
            runtime.block_on(async move {
                let work = async {
                    let client = Client::try_connect("delayd-it-cleanup").await?;
                    for queue in &queues {
                        client
                            .channel
                            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                            .await?;
                    }
                    for exchange in &exchanges {
                        client
                            .channel
                            .exchange_delete(
                                exchange.as_str().into(),
                                ExchangeDeleteOptions::default(),
                            )
                            .await?;
                    }
                    client.close().await;
                    Ok::<(), lapin::Error>(())
                };
                match tokio::time::timeout(Duration::from_secs(10), work).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => eprintln!("cleanup of {queues:?} {exchanges:?} failed: {e}"),
                    Err(_) => eprintln!("cleanup of {queues:?} {exchanges:?} timed out"),
                }
            });
        });
        let _ = done.join();
    }
}

/// One test's names, a client, and a running delayd routing between them.
pub struct Setup {
    pub names: Names,
    // Dropped in reverse order: delayd stops before the names are deleted.
    pub _cleanup: Cleanup,
    pub delayd: Delayd,
    pub client: Client,
}

impl Setup {
    /// Declares the target exchange and queue (plus `extra_queues`, cleaned
    /// up too), then starts delayd with `opts`.
    pub async fn start(names: Names, extra_queues: &[&str], opts: DelaydOptions) -> Setup {
        let mut cleanup = names.cleanup();
        cleanup
            .queues
            .extend(extra_queues.iter().map(|q| q.to_string()));
        let client = Client::connect(&format!("delayd-it-{}", names.route)).await;
        client
            .declare_target(&names.to_exchange, &names.target_queue)
            .await;
        let delayd = Delayd::start(&names, opts).await;
        Setup {
            names,
            _cleanup: cleanup,
            delayd,
            client,
        }
    }
}

// ------------------------------------------------------------------ delayd

/// How to configure one delayd instance.
#[derive(Debug, Clone)]
pub struct DelaydOptions {
    /// `engine.shutdown_grace`.
    pub shutdown_grace: String,
    /// `from.prefetch` of the route.
    pub prefetch: u16,
    /// `wal.max_message_bytes`.
    pub max_message_bytes: u32,
    /// `engine.max_pending` (0 = no limit).
    pub max_pending: u64,
    /// `http.token`, if any.
    pub token: Option<String>,
    /// The route's `mode`: delay, ttl or retry.
    pub mode: String,
    /// `to.routing_key` of the route (kept from the message when `None`).
    pub to_routing_key: Option<String>,
    /// TOML lines appended to the route after `to` (route keys first, then
    /// sub-tables such as `[routes.retry]`).
    pub route_extra: String,
    /// Keys added to the route's inline `from` table (`, key = value`...).
    pub from_extra: String,
    /// TOML lines added to `[engine]`.
    pub engine_extra: String,
}

impl Default for DelaydOptions {
    fn default() -> Self {
        Self {
            shutdown_grace: "10s".into(),
            prefetch: 1000,
            max_message_bytes: 16 << 20,
            max_pending: 0,
            token: None,
            mode: "delay".into(),
            to_routing_key: None,
            route_extra: String::new(),
            from_extra: String::new(),
            engine_extra: String::new(),
        }
    }
}

/// `text` with its first `from` replaced by `to`; panics if there is none
/// (a test that edits a config must not quietly run the unedited one).
pub fn must_replace(text: &str, from: &str, to: &str) -> String {
    assert!(text.contains(from), "{from:?} is not in:\n{text}");
    text.replacen(from, to, 1)
}

/// TOML string literal (basic string, escaped).
pub fn toml_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The config file of a delayd with one route from `names.from_exchange`
/// (via `names.from_queue`) to `names.to_exchange`.
pub fn config_toml(
    names: &Names,
    wal_dir: &Path,
    http: SocketAddr,
    opts: &DelaydOptions,
) -> String {
    let wal_dir = wal_dir.to_str().expect("temporary paths are UTF-8");
    format!(
        r#"[wal]
dir = {wal_dir}
create_dir = true
max_message_bytes = {max_message_bytes}

[http]
listen = "{http}"
{token}
[engine]
shutdown_grace = {grace}
max_pending = {max_pending}
{engine_extra}

[log]
format = "pretty"
level = "info"

[brokers.rabbit]
kind = "amqp"
url = {url}

[[routes]]
name = {route}
mode = {mode}
from = {{ broker = "rabbit", queue = {queue}, exchange = {exchange}, exchange_type = "topic", prefetch = {prefetch}{from_extra} }}
to = {{ broker = "rabbit", exchange = {to}{to_key} }}
{extra}
"#,
        mode = toml_string(&opts.mode),
        to_key = opts
            .to_routing_key
            .as_deref()
            .map(|k| format!(", routing_key = {}", toml_string(k)))
            .unwrap_or_default(),
        extra = opts.route_extra,
        engine_extra = opts.engine_extra,
        from_extra = opts.from_extra,
        wal_dir = toml_string(wal_dir),
        grace = toml_string(&opts.shutdown_grace),
        url = toml_string(&amqp_url()),
        route = toml_string(&names.route),
        queue = toml_string(&names.from_queue),
        exchange = toml_string(&names.from_exchange),
        prefetch = opts.prefetch,
        max_message_bytes = opts.max_message_bytes,
        to = toml_string(&names.to_exchange),
        max_pending = opts.max_pending,
        token = opts
            .token
            .as_deref()
            .map(|t| format!("token = {}\n", toml_string(t)))
            .unwrap_or_default(),
    )
}

/// A `delayd run` child process with its own temporary directory (config,
/// WAL, log). Killed when dropped; its log tail is printed if the test failed.
pub struct Delayd {
    dir: TempDir,
    config: PathBuf,
    log: PathBuf,
    http: SocketAddr,
    from_queue: String,
    child: Option<Child>,
    starts: u32,
}

impl Delayd {
    /// Writes the config, starts delayd and waits until it consumes
    /// `names.from_queue` (so the source exchange and binding exist).
    pub async fn start(names: &Names, opts: DelaydOptions) -> Delayd {
        Delayd::start_consuming(
            |wal, http| config_toml(names, wal, http, &opts),
            &names.from_queue,
        )
        .await
    }

    /// Starts delayd with the config `config(wal_dir, http_addr)` and waits
    /// for `/healthz` only (routes with no AMQP queue to watch, e.g. Kafka).
    pub async fn start_with(config: impl Fn(&Path, SocketAddr) -> String) -> Delayd {
        Delayd::start_consuming(config, "").await
    }

    /// Like [`Delayd::start_with`], then waits until delayd consumes
    /// `from_queue` (unless it is empty).
    pub async fn start_consuming(
        config: impl Fn(&Path, SocketAddr) -> String,
        from_queue: &str,
    ) -> Delayd {
        let dir = tempfile::Builder::new()
            .prefix("delayd-it.")
            .tempdir()
            .expect("cannot create a temporary directory");
        // Port 0: delayd binds a free port itself and logs it (a port picked
        // here and released could be taken by another process first).
        let http = SocketAddr::from(([127, 0, 0, 1], 0));
        let config_path = dir.path().join("delayd.toml");
        let wal_dir = dir.path().join("wal");
        std::fs::write(&config_path, config(&wal_dir, http)).expect("cannot write delayd.toml");
        let mut delayd = Delayd {
            log: dir.path().join("delayd.log"),
            dir,
            config: config_path,
            http,
            from_queue: from_queue.to_owned(),
            child: None,
            starts: 0,
        };
        delayd.spawn();
        delayd.wait_ready().await;
        delayd
    }

    pub fn config_path(&self) -> &Path {
        &self.config
    }

    pub fn wal_dir(&self) -> PathBuf {
        self.dir.path().join("wal")
    }

    /// Process id of the running child.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("delayd is not running").id()
    }

    fn spawn(&mut self) {
        assert!(self.child.is_none(), "delayd is already running");
        self.starts += 1;
        let mut log = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("cannot open the delayd log file");
        writeln!(log, "===== delayd start #{} =====", self.starts).expect("write log");
        let stdout = log.try_clone().expect("cannot clone the log file handle");
        let mut command = Command::new(env!("CARGO_BIN_EXE_delayd"));
        command
            .arg("run")
            .arg("--config")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(log)
            .env("NO_COLOR", "1");
        // The test's own environment must not reconfigure delayd.
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("DELAYD_") {
                command.env_remove(key);
            }
        }
        if std::env::var_os("RUST_LOG").is_none() {
            command.env("RUST_LOG", "info");
        }
        let child = command.spawn().expect("cannot start delayd");
        self.child = Some(child);
    }

    /// The admin address this start of delayd logged (`admin API
    /// listening listen=ADDR`), once it has.
    fn logged_http_addr(&self) -> Option<SocketAddr> {
        let text = std::fs::read_to_string(&self.log).ok()?;
        let marker = format!("===== delayd start #{} =====", self.starts);
        let this_start = &text[text.rfind(&marker)?..];
        let line = this_start
            .lines()
            .find(|l| l.contains("admin API listening"))?;
        let addr = line.split("listen=").nth(1)?.split_whitespace().next()?;
        addr.trim_matches('"').parse().ok()
    }

    /// Panics (with the log) if the child has exited.
    fn assert_running(&mut self, during: &str) {
        let child = self.child.as_mut().expect("delayd is not running");
        if let Some(status) = child.try_wait().expect("cannot poll the delayd process") {
            panic!(
                "delayd exited with {status} while {during}; log:\n{}",
                self.log_tail(200)
            );
        }
    }

    /// Waits until the admin API answers `/healthz` and delayd has a consumer
    /// on its source queue (seen by the broker, not by delayd's own report).
    /// `/readyz` is not used, so tests can start a delayd that cannot be
    /// ready (see `readyz_waits_until_every_route_consumes`).
    pub async fn wait_ready(&mut self) {
        let start = Instant::now();
        loop {
            self.assert_running("starting");
            if let Some(addr) = self.logged_http_addr() {
                self.http = addr;
                if matches!(self.http_get("/healthz"), Ok((200, _))) {
                    break;
                }
            }
            assert!(
                start.elapsed() < DEADLINE,
                "delayd did not answer /healthz within {DEADLINE:?}; log:\n{}",
                self.log_tail(200)
            );
            tokio::time::sleep(POLL).await;
        }
        if self.from_queue.is_empty() {
            return;
        }
        let client = Client::connect("delayd-it-ready").await;
        loop {
            self.assert_running("starting to consume");
            if let Some((_, consumers)) = client.queue_counts(&self.from_queue).await {
                if consumers > 0 {
                    break;
                }
            }
            assert!(
                start.elapsed() < DEADLINE,
                "delayd did not consume {} within {DEADLINE:?}; log:\n{}",
                self.from_queue,
                self.log_tail(200)
            );
            tokio::time::sleep(POLL).await;
        }
        client.close().await;
    }

    /// Send signal `sig` (`-STOP`, `-CONT`...) with kill(1).
    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {sig}");
    }

    /// SIGKILL, then reap the process.
    pub fn kill_9(&mut self) {
        let mut child = self.child.take().expect("delayd is not running");
        child.kill().expect("cannot SIGKILL delayd");
        child.wait().expect("cannot reap delayd");
    }

    /// SIGTERM, then wait up to `within` for the process to exit.
    pub async fn sigterm_and_wait(&mut self, within: Duration) -> ExitStatus {
        let pid = self.pid();
        let status = Command::new("kill")
            .arg("-TERM")
            .arg(pid.to_string())
            .status()
            .expect("cannot run kill");
        assert!(status.success(), "kill -TERM {pid} failed: {status}");
        self.wait_exit("of SIGTERM", within).await
    }

    /// Waits up to `within` for the process to exit by itself.
    pub async fn wait_exit(&mut self, after: &str, within: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            let child = self.child.as_mut().expect("delayd is not running");
            if let Some(status) = child.try_wait().expect("cannot poll the delayd process") {
                self.child = None;
                return status;
            }
            assert!(
                start.elapsed() < within,
                "delayd did not exit within {within:?} {after}; log:\n{}",
                self.log_tail(200)
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// Starts delayd again with the same config and WAL, and waits until ready.
    pub async fn restart(&mut self) {
        self.spawn();
        self.wait_ready().await;
    }

    /// A blocking HTTP/1.1 GET of the admin API: (status, body).
    pub fn http_get(&self, path: &str) -> std::io::Result<(u16, String)> {
        http_get(self.http, path)
    }

    /// The admin API's address.
    pub fn http_addr(&self) -> SocketAddr {
        self.http
    }

    /// `method path` on the admin API with an optional bearer token; panics
    /// unless the answer is JSON. Returns (status, JSON body).
    pub fn api(&self, method: &str, path: &str, token: Option<&str>) -> (u16, serde_json::Value) {
        let (status, body) = http_request(self.http, method, path, token)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let json = serde_json::from_str(&body).unwrap_or_else(|e| {
            panic!("{method} {path} answered {status} with non-JSON {body:?}: {e}")
        });
        (status, json)
    }

    /// The sum of a metric's samples on `/metrics` (0 if absent).
    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.http_get("/metrics").expect("GET /metrics");
        text.lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .fold(0.0, |a, b| a + b)
    }

    /// The `/readyz` JSON (answered with 200 or 503 alike).
    pub fn readyz(&self) -> serde_json::Value {
        self.api("GET", "/readyz", None).1
    }

    /// `pending` of `/readyz` (answered with 200 or 503 alike).
    pub fn pending(&self) -> u64 {
        let (status, body) = self
            .http_get("/readyz")
            .expect("GET /readyz of a running delayd");
        let json: serde_json::Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("/readyz answered {status} with non-JSON {body:?}: {e}"));
        json["pending"]
            .as_u64()
            .unwrap_or_else(|| panic!("/readyz has no numeric pending: {body}"))
    }

    /// delayd's whole log, every start of it.
    pub fn full_log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `lines` lines of delayd's log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Closes, through `rabbitmqctl close_connection`, every AMQP connection
    /// the running delayd has open, and returns how many were closed.
    ///
    /// Unlike `rabbitmqctl close_all_connections` this leaves the connections
    /// of parallel tests (and of anything else using the broker) alone. The
    /// connections are told apart by their client port: delayd's sockets are
    /// found in `/proc/<pid>/fd`, their ports in `/proc/<pid>/net/tcp*`, and
    /// matched with `peer_port` of `rabbitmqctl list_connections`.
    pub fn close_broker_connections(&self) -> usize {
        let pids: Vec<String> = self
            .broker_connections(None)
            .into_iter()
            .map(|(pid, _)| pid)
            .collect();
        close_broker_connections(&pids);
        pids.len()
    }

    /// The broker's pids of this delayd's connections named `name` (found
    /// ahead: the CLI takes seconds on a busy machine), for
    /// [`close_broker_connections`].
    pub fn broker_connection_pids_named(&self, name: &str) -> Vec<String> {
        self.broker_connections(Some(name))
            .into_iter()
            .map(|(pid, _)| pid)
            .collect()
    }

    /// The local ports of this delayd's broker connections whose client-given
    /// name (`connection_name`) is `name`.
    pub fn broker_connection_ports_named(&self, name: &str) -> Vec<u16> {
        self.broker_connections(Some(name))
            .into_iter()
            .map(|(_, port)| port)
            .collect()
    }

    /// This delayd's broker connections (named `name`, if given): the
    /// broker's connection pid and the client port of each, from
    /// `rabbitmqctl list_connections` matched with the ports of its sockets.
    fn broker_connections(&self, name: Option<&str>) -> Vec<(String, u16)> {
        let ports = amqp_client_ports(self.pid());
        assert!(
            !ports.is_empty(),
            "delayd (pid {}) has no connection to port 5672",
            self.pid()
        );
        let output = Command::new("rabbitmqctl")
            .args([
                "list_connections",
                "pid",
                "peer_port",
                "client_properties",
                "-q",
                "--no-table-headers",
            ])
            .output()
            .expect("cannot run rabbitmqctl list_connections");
        assert!(
            output.status.success(),
            "rabbitmqctl list_connections failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|line| {
                let mut fields = line.split_whitespace();
                let pid = fields.next()?;
                let port: u16 = fields.next()?.parse().ok()?;
                let named =
                    name.is_none_or(|n| line.contains(&format!("{{\"connection_name\",\"{n}\"}}")));
                (ports.contains(&port) && named).then(|| (pid.to_owned(), port))
            })
            .collect()
    }
}

impl Drop for Delayd {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            eprintln!(
                "----- delayd log ({}), last 300 lines -----\n{}\n----- end of delayd log -----",
                self.log.display(),
                self.log_tail(300)
            );
        }
    }
}

/// Local ports of the TCP connections process `pid` has to port 5672.
fn amqp_client_ports(pid: u32) -> HashSet<u16> {
    let mut inodes = HashSet::new();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).expect("cannot list /proc/<pid>/fd");
    for fd in fds.flatten() {
        if let Ok(target) = std::fs::read_link(fd.path()) {
            let target = target.to_string_lossy();
            if let Some(inode) = target
                .strip_prefix("socket:[")
                .and_then(|s| s.strip_suffix(']'))
            {
                inodes.insert(inode.to_owned());
            }
        }
    }
    let mut ports = HashSet::new();
    for table in ["tcp", "tcp6"] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
            continue;
        };
        for line in text.lines().skip(1) {
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 10 || !inodes.contains(fields[9]) {
                continue;
            }
            let port_of = |addr: &str| {
                addr.rsplit(':')
                    .next()
                    .and_then(|p| u16::from_str_radix(p, 16).ok())
            };
            if port_of(fields[2]) == Some(5672) {
                if let Some(local) = port_of(fields[1]) {
                    ports.insert(local);
                }
            }
        }
    }
    ports
}

/// A blocking HTTP/1.1 GET: (status, body). Enough for the admin API.
pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    http_request(addr, "GET", path, None)
}

/// A blocking HTTP/1.1 request with an optional bearer token: (status, body),
/// with delayd's own admin API client (callable from async tests too).
pub fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
) -> std::io::Result<(u16, String)> {
    let mut client = delayd::client::Client::new(addr.to_string(), token.map(str::to_owned));
    client.timeout = Duration::from_secs(2);
    let response = client
        .request(method, path)
        .map_err(|e| std::io::Error::other(e.detail()))?;
    Ok((
        response.status,
        String::from_utf8_lossy(&response.body).into_owned(),
    ))
}

/// Runs `delayd run` with `config` until it exits by itself, which it must
/// within `within`: (exited successfully, its whole output).
pub async fn run_until_exit(config: &str, within: Duration) -> (bool, String) {
    let dir = tempfile::Builder::new()
        .prefix("delayd-it.")
        .tempdir()
        .expect("cannot create a temporary directory");
    let config_path = dir.path().join("delayd.toml");
    std::fs::write(&config_path, config).expect("cannot write delayd.toml");
    let log_path = dir.path().join("delayd.log");
    let log = File::create(&log_path).expect("cannot create the log");
    let mut command = Command::new(env!("CARGO_BIN_EXE_delayd"));
    command
        .arg("run")
        .arg("--config")
        .arg(&config_path)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log handle"))
        .stderr(log)
        .env("NO_COLOR", "1");
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("DELAYD_") {
            command.env_remove(key);
        }
    }
    let mut child = command.spawn().expect("cannot start delayd");
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("cannot poll delayd") {
            let output = std::fs::read_to_string(&log_path).unwrap_or_default();
            return (status.success(), output);
        }
        if start.elapsed() > within {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "delayd did not exit within {within:?}; its output:\n{}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Runs `delayd <args>` to completion (for commands other than `run`).
pub fn delayd_command(args: &[&std::ffi::OsStr]) -> std::process::Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_delayd"));
    command.args(args).env("NO_COLOR", "1");
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("DELAYD_") {
            command.env_remove(key);
        }
    }
    command.output().expect("cannot run delayd")
}

/// Runs `delayd <subcommand> <args>`; (success, stdout, stderr).
pub fn delayd_cli(subcommand: &str, args: &[&str]) -> (bool, String, String) {
    let mut all = vec![std::ffi::OsStr::new(subcommand)];
    all.extend(args.iter().map(std::ffi::OsStr::new));
    let output = delayd_command(&all);
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

// ------------------------------------------------------------------ client

/// A plain lapin connection with one channel in publisher-confirm mode.
pub struct Client {
    pub connection: Connection,
    pub channel: Channel,
}

impl Client {
    pub async fn try_connect(name: &str) -> Result<Client, lapin::Error> {
        Client::try_connect_to(&amqp_url(), name).await
    }

    /// Connects as `user` (password `password`) to the test broker.
    pub async fn connect_as(name: &str, user: &str, password: &str) -> Client {
        let url = amqp_url().replacen("guest:guest", &format!("{user}:{password}"), 1);
        Client::try_connect_to(&url, name)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to RabbitMQ as {user}: {e}"))
    }

    pub async fn try_connect_to(url: &str, name: &str) -> Result<Client, lapin::Error> {
        let props = ConnectionProperties::default().with_connection_name(name.into());
        let connection = Connection::connect(url, props).await?;
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Client {
            connection,
            channel,
        })
    }

    pub async fn connect(name: &str) -> Client {
        Client::try_connect(name)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to RabbitMQ at {}: {e}", amqp_url()))
    }

    pub async fn close(self) {
        let _ = self.connection.close(200, "bye".into()).await;
    }

    /// Declares a (non-durable) topic exchange.
    pub async fn declare_exchange(&self, exchange: &str) {
        self.channel
            .exchange_declare(
                exchange.into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("exchange.declare {exchange}: {e}"));
    }

    /// Declares a (non-durable) fanout exchange.
    pub async fn declare_fanout_exchange(&self, exchange: &str) {
        self.channel
            .exchange_declare(
                exchange.into(),
                ExchangeKind::Fanout,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("exchange.declare {exchange}: {e}"));
    }

    /// Declares the topic exchange `exchange` and `queue` bound to it with `#`.
    pub async fn declare_target(&self, exchange: &str, queue: &str) {
        self.declare_exchange(exchange).await;
        self.declare_bound_queue(queue, FieldTable::default(), exchange, "#")
            .await;
    }

    /// Declares a durable topic exchange and a durable queue bound to it
    /// with `#`: both survive a broker restart.
    pub async fn declare_durable_target(&self, exchange: &str, queue: &str) {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        self.channel
            .exchange_declare(
                exchange.into(),
                ExchangeKind::Topic,
                durable,
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("exchange.declare {exchange}: {e}"));
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        self.channel
            .queue_declare(queue.into(), durable, FieldTable::default())
            .await
            .unwrap_or_else(|e| panic!("queue.declare {queue}: {e}"));
        self.bind(queue, exchange, "#").await;
    }

    async fn bind(&self, queue: &str, exchange: &str, key: &str) {
        self.channel
            .queue_bind(
                queue.into(),
                exchange.into(),
                key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("queue.bind {queue} to {exchange}: {e}"));
    }

    /// Declares `queue` (non-durable) with `arguments`, e.g. a dead-letter
    /// exchange, and binds it to `exchange` with `key`.
    pub async fn declare_bound_queue(
        &self,
        queue: &str,
        arguments: FieldTable,
        exchange: &str,
        key: &str,
    ) {
        self.channel
            .queue_declare(queue.into(), QueueDeclareOptions::default(), arguments)
            .await
            .unwrap_or_else(|e| panic!("queue.declare {queue}: {e}"));
        self.bind(queue, exchange, key).await;
    }

    /// (ready messages, consumers) of `queue`, or `None` if it does not
    /// exist. Uses a channel of its own (a failed passive declare closes it).
    pub async fn queue_counts(&self, queue: &str) -> Option<(u32, u32)> {
        let channel = self
            .connection
            .create_channel()
            .await
            .expect("cannot open a channel");
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let result = channel
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await;
        let _ = channel.close(200, "bye".into()).await;
        result.ok().map(|q| (q.message_count(), q.consumer_count()))
    }

    /// Queue `queue`'s (ready, unacknowledged) message counts, from
    /// `rabbitmqctl` on the default node (the passive declare of
    /// [`Client::queue_counts`] counts only ready ones).
    pub fn queue_unsettled(queue: &str) -> Option<(u64, u64)> {
        let out = std::process::Command::new("rabbitmqctl")
            .args([
                "list_queues",
                "-q",
                "name",
                "messages_ready",
                "messages_unacknowledged",
            ])
            .output()
            .expect("rabbitmqctl list_queues");
        String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
            let mut fields = l.split('\t');
            (fields.next() == Some(queue)).then_some(())?;
            let ready = fields.next()?.trim().parse().ok()?;
            let unacked = fields.next()?.trim().parse().ok()?;
            Some((ready, unacked))
        })
    }

    /// Publishes without waiting for the confirm.
    pub async fn publish_unconfirmed(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> PublisherConfirm {
        self.channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions::default(),
                body,
                properties,
            )
            .await
            .unwrap_or_else(|e| panic!("basic.publish to {exchange}: {e}"))
    }

    /// Publishes and waits for the broker's ack.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) {
        let confirm = self
            .publish_unconfirmed(exchange, routing_key, body, properties)
            .await;
        assert_confirmed(confirm).await;
    }

    /// Consumes `queue` with manual acks (see [`Receiver`]).
    pub async fn consume(&self, queue: &str) -> Receiver {
        let channel = self
            .connection
            .create_channel()
            .await
            .expect("cannot open a channel");
        let consumer = channel
            .basic_consume(
                queue.into(),
                format!("delayd-it.{}", unique_suffix()).into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("basic.consume {queue}: {e}"));
        Receiver {
            channel,
            consumer,
            queue: queue.to_owned(),
        }
    }
}

/// Waits for a publisher confirm and asserts it is a plain ack.
pub async fn assert_confirmed(confirm: PublisherConfirm) {
    match confirm.await {
        Ok(Confirmation::Ack(None)) => {}
        other => panic!("publish not confirmed: {other:?}"),
    }
}

/// A message as the test received it.
pub struct Received {
    pub delivery: Delivery,
    /// Wall-clock ms when the test got it.
    pub at_ms: u64,
}

impl Received {
    pub fn properties(&self) -> &BasicProperties {
        &self.delivery.properties
    }

    pub fn message_id(&self) -> Option<&str> {
        self.delivery
            .properties
            .message_id()
            .as_ref()
            .map(ShortString::as_str)
    }

    pub fn header(&self, key: &str) -> Option<&AMQPValue> {
        self.delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(key))
    }

    /// A header that is a long string, as lossy UTF-8.
    pub fn header_text(&self, key: &str) -> Option<String> {
        match self.header(key)? {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            _ => None,
        }
    }
}

/// A consumer with manual acks on a channel of its own. Closing it (or
/// dropping the client) returns unacked messages to the queue.
pub struct Receiver {
    channel: Channel,
    consumer: Consumer,
    queue: String,
}

impl Receiver {
    /// The next delivery, not yet acked, or `None` once `deadline` passes.
    pub async fn next_unacked(&mut self, deadline: Instant) -> Option<Received> {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, self.consumer.next()).await {
            Err(_) => None,
            Ok(None) => panic!("consumer of {} ended", self.queue),
            Ok(Some(Err(e))) => panic!("consumer of {} failed: {e}", self.queue),
            Ok(Some(Ok(delivery))) => Some(Received {
                delivery,
                at_ms: now_ms(),
            }),
        }
    }

    /// The next delivery, acked, or `None` once `deadline` passes.
    pub async fn next(&mut self, deadline: Instant) -> Option<Received> {
        let received = self.next_unacked(deadline).await?;
        ack(&received).await;
        Some(received)
    }

    /// The next delivery, acked; panics naming `what` after [`DEADLINE`].
    pub async fn expect(&mut self, what: &str) -> Received {
        self.next(Instant::now() + DEADLINE)
            .await
            .unwrap_or_else(|| panic!("no message ({what}) on {} within {DEADLINE:?}", self.queue))
    }

    /// Reads `queue` until every message id in `wanted` was seen, acking
    /// those and leaving every other message unacked (they return to the
    /// queue when the receiver closes), so a queue shared with other tests
    /// can be read safely. Panics after [`DEADLINE`].
    pub async fn collect_by_message_id(&mut self, wanted: &[&str]) -> Vec<Received> {
        let deadline = Instant::now() + DEADLINE;
        let mut found: Vec<Received> = Vec::new();
        while found.len() < wanted.len() {
            let Some(received) = self.next_unacked(deadline).await else {
                let seen: Vec<_> = found.iter().filter_map(Received::message_id).collect();
                panic!(
                    "only {seen:?} of {wanted:?} arrived on {} within {DEADLINE:?}",
                    self.queue
                );
            };
            let id = received.message_id().unwrap_or_default().to_owned();
            if wanted.contains(&id.as_str()) {
                // Ours: ack it, also a duplicate, so none is left behind.
                ack(&received).await;
                if found.iter().all(|f| f.message_id() != Some(&id)) {
                    found.push(received);
                }
            }
        }
        found
    }

    pub async fn close(self) {
        let _ = self.channel.close(200, "bye".into()).await;
    }
}

/// `basic.reject` with `requeue=false`: the broker dead-letters it.
pub async fn reject(received: &Received) {
    received
        .delivery
        .acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .expect("basic.reject");
}

/// The major version of the RabbitMQ server, from `rabbitmqctl version`
/// (`None` when it cannot be run, e.g. a remote broker).
pub fn rabbitmq_major() -> Option<u32> {
    let out = Command::new("rabbitmqctl").arg("version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .rev()
        .find_map(|l| l.trim().split('.').next()?.parse().ok())
}

pub async fn ack(received: &Received) {
    received
        .delivery
        .acker
        .ack(BasicAckOptions::default())
        .await
        .expect("basic.ack");
}

/// A broker-kept store session of the test's own (no delayd) on the lock of
/// `names`, registered on the single node and elected.
pub async fn elected_state_session(
    names: &delayd_adapters::amqp::state::StateNames,
) -> delayd_adapters::amqp::state::StateSession {
    use delayd_adapters::amqp::state::Candidate;
    use delayd_adapters::amqp::{Broker, BrokerOptions};
    let broker =
        Broker::new(&amqp_url(), BrokerOptions::named("delayd-it-session")).expect("broker");
    let candidate = Candidate::register(broker.open_dedicated().await.expect("connect"), names)
        .await
        .expect("register on the lock queue");
    tokio::time::timeout(DEADLINE, candidate.elected(Duration::from_secs(1), |_| {}))
        .await
        .expect("elected in time")
        .expect("elected")
}
