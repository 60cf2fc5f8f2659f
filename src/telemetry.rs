//! Logs (tracing, pretty or JSON) and metrics (Prometheus text).

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::EnvFilter;

use crate::config::{LogFormat, LogSection};

/// Install the global subscriber. `RUST_LOG` (or `DELAYD_LOG__LEVEL`) sets the level.
pub fn init_logging(log: &LogSection) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&log.level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(quiet_bodies(filter))
        .with_writer(std::io::stderr);
    let _ = match log.format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Pretty => builder.try_init(),
    };
}

/// lapin logs every message the broker returns, body included, at WARN.
/// Message bodies are the users' data: never in the log.
fn quiet_bodies(filter: EnvFilter) -> EnvFilter {
    match "lapin::returned_messages=error".parse() {
        Ok(directive) => filter.add_directive(directive),
        Err(_) => filter,
    }
}

/// Install the Prometheus recorder and return the handle that renders it.
pub fn init_metrics() -> anyhow::Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("delayd_lateness_seconds".into()),
            &[
                0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0, 300.0,
            ],
        )?
        .set_buckets_for_metric(
            Matcher::Full("delayd_publish_seconds".into()),
            &[
                0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 30.0,
            ],
        )?
        .set_buckets_for_metric(
            Matcher::Full("delayd_wal_fsync_seconds".into()),
            &[
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5,
            ],
        )?
        .install_recorder()?;
    PROCESS.describe();
    describe_metrics();
    let _ = HANDLE.set(handle.clone());
    Ok(handle)
}

/// A metric's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One metric delayd exports: docs/metrics.md has a row for each (a unit
/// test holds the two together), and the HELP line is `help`.
#[derive(Debug, Clone, Copy)]
pub struct MetricDef {
    pub name: &'static str,
    pub kind: Kind,
    pub labels: &'static [&'static str],
    pub help: &'static str,
    /// Computed at each scrape by the admin API rather than recorded as
    /// things happen (see [`write_family`]).
    pub at_scrape: bool,
}

const fn def(
    name: &'static str,
    kind: Kind,
    labels: &'static [&'static str],
    help: &'static str,
) -> MetricDef {
    MetricDef {
        name,
        kind,
        labels,
        help,
        at_scrape: false,
    }
}

const fn scraped(
    name: &'static str,
    labels: &'static [&'static str],
    help: &'static str,
) -> MetricDef {
    MetricDef {
        name,
        kind: Kind::Gauge,
        labels,
        help,
        at_scrape: true,
    }
}

use Kind::{Counter, Gauge, Histogram};

const ROUTE: &[&str] = &["route"];

/// Every `delayd_*` metric, in the order of docs/metrics.md.
pub const METRICS: &[MetricDef] = &[
    def("delayd_pending_messages", Gauge, ROUTE, "Messages waiting or being published, per route."),
    def("delayd_scheduled_total", Counter, ROUTE, "Messages stored and armed."),
    def("delayd_fired_total", Counter, ROUTE, "Messages published to their target."),
    def("delayd_invalid_total", Counter, ROUTE, "Messages sent to the route's invalid destination."),
    def("delayd_unroutable_total", Counter, ROUTE, "Due messages sent to the unroutable destination."),
    def("delayd_parked_total", Counter, ROUTE, "Retry-mode messages parked after their last attempt."),
    def("delayd_cancelled_total", Counter, ROUTE, "Messages cancelled or purged through the admin API, or cancelled by a Kafka tombstone."),
    def("delayd_handed_off_total", Counter, ROUTE, "Messages retired after being handed back to their ingress."),
    def("delayd_handoff_messages_total", Counter, &[], "Messages handed back to their ingress at shutdown."),
    def("delayd_released_total", Counter, ROUTE, "Broker-kept store: messages left to the next owner (a revoked Kafka partition, a lost RabbitMQ route lock)."),
    def("delayd_store_restored_total", Counter, ROUTE, "Broker-kept store: pending messages read back from the state topic or state streams."),
    def("delayd_store_records_skipped_total", Counter, ROUTE, "Undecodable records (not written by delayd) skipped while reading the route's state streams."),
    def(
        "delayd_store_pointer_repairs_total",
        Counter,
        ROUTE,
        "Broker-kept store (RabbitMQ): elections that found the route's two pointer streams disagreeing and wrote both again.",
    ),
    def(
        "delayd_store_orphans_deleted_total",
        Counter,
        ROUTE,
        "Broker-kept store (RabbitMQ): generation streams a crash had left below the current one, deleted by a restore.",
    ),
    def(
        "delayd_store_state_missing",
        Gauge,
        ROUTE,
        "Broker-kept store (RabbitMQ): 1 while the generation stream the pointers name is missing (the route is not consumed).",
    ),
    def(
        "delayd_clock_behind_broker_seconds",
        Gauge,
        ROUTE,
        "How far the last broker time seen ahead of this host's clock (by more than 1 s) was ahead.",
    ),
    def("delayd_store_restoring_partitions", Gauge, ROUTE, "Broker-kept store: partitions (Kafka) or routes (RabbitMQ) being restored now."),
    def("delayd_store_writes_total", Counter, &["route", "kind"], "Broker-kept store: state records written, per kind (schedule; tombstone on Kafka, done on RabbitMQ)."),
    def("delayd_store_write_failures_total", Counter, ROUTE, "Broker-kept store: state writes that failed."),
    def("delayd_store_dones_after_session_total", Counter, ROUTE, "RabbitMQ broker-kept store: Dones a former owner wrote after its session ended."),
    scraped("delayd_store_owner", ROUTE, "Broker-kept store: 1 while this instance owns the route (RabbitMQ) or consumes it in the group (Kafka), 0 while it is a standby or starting."),
    def("delayd_publish_retries_total", Counter, ROUTE, "Publishes that failed and were re-armed with back-off."),
    def("delayd_store_failures_total", Counter, ROUTE, "Deliveries that could not be stored (held, not acked)."),
    def("delayd_backpressure", Gauge, ROUTE, "1 while the route's intake is paused."),
    def("delayd_backpressure_held_total", Counter, ROUTE, "Deliveries held while the route was paused."),
    def("delayd_redeliveries_deduplicated_total", Counter, ROUTE, "Broker redeliveries recognised as already stored."),
    def("delayd_redeliveries_in_doubt_total", Counter, ROUTE, "Broker redeliveries equal to a stored message whose ack was in doubt, stored again under its id."),
    def(
        "delayd_stream_truncated_offsets_total",
        Counter,
        &["queue"],
        "Stream ingress: offsets its retention removed before delayd read them (at most that many messages lost; the route is not ready until restarted).",
    ),
    def("delayd_redeliveries_superseding_total", Counter, ROUTE, "Held deliveries not stored again because the broker redelivered them (their channel closed); the redelivery kept their identity."),
    def("delayd_lateness_seconds", Histogram, ROUTE, "How long after its due time a message was handed to its target."),
    def("delayd_publish_seconds", Histogram, ROUTE, "From a message's hand-over to its target until the publish settled (confirmed, failed or released)."),
    scraped("delayd_next_due_timestamp_seconds", ROUTE, "Due time (Unix seconds) of the route's earliest pending message; absent when none is pending."),
    scraped("delayd_oldest_overdue_seconds", ROUTE, "How long the route's oldest message past its due time has been waiting; 0 when none is."),
    scraped("delayd_broker_connected", &["broker", "role"], "1 while the broker connection for the role (consume, publish) is open, 0 while it is not."),
    scraped("delayd_build_info", &["version"], "Always 1; the version of the running delayd."),
    def("delayd_wal_bytes", Gauge, &[], "WAL size on disk."),
    def("delayd_wal_live_bytes", Gauge, &[], "WAL bytes still needed."),
    def("delayd_wal_segments", Gauge, &[], "WAL segment files."),
    def("delayd_wal_fsync_seconds", Histogram, &[], "Duration of one WAL group commit."),
    def("delayd_wal_fsyncs_total", Counter, &[], "Group commits (fdatasync) of the WAL."),
    def("delayd_wal_written_bytes_total", Counter, &[], "Bytes written to the WAL."),
    def("delayd_wal_compactions_total", Counter, &[], "WAL segments compacted."),
    def(
        "delayd_wal_remembered_owed_total",
        Counter,
        &[],
        "Remembered frames a full disk kept from being written before their segment went.",
    ),
    def("delayd_wal_corrupt_frames_total", Counter, &[], "Damaged WAL frames found by recovery."),
    def("delayd_disk_reserve_held", Gauge, &[], "1 while the disk reserve (<wal.dir>/reserve) is on disk; 0 after a full disk released it (no new message is taken in meanwhile)."),
    def("delayd_disk_reserve_released_total", Counter, &[], "Times a full disk released the disk reserve to the writes that free space."),
    def("delayd_far_messages", Gauge, &[], "Pending messages in the far tier (due beyond engine.horizon), on disk only."),
    def("delayd_far_bytes", Gauge, &[], "Far tier size on disk."),
    def("delayd_far_buckets", Gauge, &[], "Far tier bucket files."),
    def("delayd_far_spilled_total", Counter, &[], "Messages moved from memory and the WAL into the far tier."),
    def("delayd_far_loaded_total", Counter, &[], "Messages loaded back from the far tier as the horizon reached their bucket."),
    def("delayd_far_errors_total", Counter, &[], "Far tier spills or loads that failed (retried the next round)."),
    def("delayd_far_corrupt_frames_total", Counter, &[], "Damaged frames found reading a far tier bucket."),
];

/// The definition of metric `name`, if delayd exports it.
pub fn metric(name: &str) -> Option<&'static MetricDef> {
    METRICS.iter().find(|m| m.name == name)
}

/// Start every per-route counter of `routes` at 0, and the backpressure
/// gauge, so their series exist from the start: `increase()` then sees a
/// route's first invalid message, and a dashboard shows 0 rather than no
/// data. (The lateness histogram appears with the first delivery.)
pub fn register_routes<'a>(routes: impl IntoIterator<Item = &'a str>) {
    for route in routes {
        for m in METRICS.iter().filter(|m| !m.at_scrape && m.labels == ROUTE) {
            match m.kind {
                Kind::Counter => {
                    metrics::counter!(m.name, "route" => route.to_owned()).increment(0)
                }
                Kind::Gauge if m.name == "delayd_backpressure" => {
                    metrics::gauge!(m.name, "route" => route.to_owned()).increment(0.0)
                }
                _ => {}
            }
        }
    }
}

/// HELP text for every recorded metric (the scrape-time ones carry theirs
/// in [`write_family`]).
fn describe_metrics() {
    for m in METRICS.iter().filter(|m| !m.at_scrape) {
        let unit = if m.name.ends_with("_seconds") {
            Some(metrics::Unit::Seconds)
        } else if m.name.ends_with("_bytes") || m.name.ends_with("_bytes_total") {
            Some(metrics::Unit::Bytes)
        } else {
            None
        };
        match (m.kind, unit) {
            (Kind::Counter, Some(u)) => metrics::describe_counter!(m.name, u, m.help),
            (Kind::Counter, None) => metrics::describe_counter!(m.name, m.help),
            (Kind::Gauge, Some(u)) => metrics::describe_gauge!(m.name, u, m.help),
            (Kind::Gauge, None) => metrics::describe_gauge!(m.name, m.help),
            (Kind::Histogram, Some(u)) => metrics::describe_histogram!(m.name, u, m.help),
            (Kind::Histogram, None) => metrics::describe_histogram!(m.name, m.help),
        }
    }
}

/// Append one scrape-time family (`# HELP`, `# TYPE` and its samples) in
/// Prometheus text. Each sample is its label values, in the order of the
/// definition's labels, and its value. Nothing is written without samples.
pub fn write_family(out: &mut String, name: &str, samples: &[(Vec<String>, f64)]) {
    use std::fmt::Write;
    let Some(m) = metric(name) else {
        debug_assert!(false, "{name} is not in METRICS");
        return;
    };
    if samples.is_empty() {
        return;
    }
    let _ = writeln!(out, "# HELP {} {}", m.name, m.help);
    let _ = writeln!(out, "# TYPE {} {}", m.name, m.kind.as_str());
    for (values, value) in samples {
        debug_assert_eq!(values.len(), m.labels.len(), "{name}");
        out.push_str(m.name);
        if !values.is_empty() {
            out.push('{');
            for (i, (label, v)) in m.labels.iter().zip(values).enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{label}=\"{}\"", escape_label(v));
            }
            out.push('}');
        }
        let _ = writeln!(out, " {value}");
    }
    out.push('\n');
}

/// A label value in Prometheus text: backslash, quote and newline escaped.
fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The standard process metrics (`process_cpu_seconds_total`,
/// `process_resident_memory_bytes`, open fds, ...), read from the OS.
static PROCESS: std::sync::LazyLock<metrics_process::Collector> =
    std::sync::LazyLock::new(metrics_process::Collector::default);

/// Everything recorded, in Prometheus text, the process metrics read just
/// now.
pub fn render(handle: &PrometheusHandle) -> String {
    PROCESS.collect();
    cpu_seconds_as_counter(handle.render())
}

/// `process_cpu_seconds_total` is recorded as a gauge, because the
/// recorder's counters hold whole numbers and CPU seconds need their
/// fractions; it only ever grows, so it is typed a counter, as every
/// Prometheus client library types it (`rate()` needs that).
fn cpu_seconds_as_counter(text: String) -> String {
    text.replacen(
        "# TYPE process_cpu_seconds_total gauge",
        "# TYPE process_cpu_seconds_total counter",
        1,
    )
}

static HANDLE: std::sync::OnceLock<PrometheusHandle> = std::sync::OnceLock::new();

/// The handle installed by [`init_metrics`], if any.
pub fn metrics_handle() -> Option<PrometheusHandle> {
    HANDLE.get().cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/metrics.md's delayd table: (name, type, labels) per row.
    fn documented() -> Vec<(String, String, Vec<String>)> {
        let doc = include_str!("../docs/metrics.md");
        let table = doc
            .split("## delayd")
            .nth(1)
            .and_then(|t| t.split("\n## ").next())
            .expect("docs/metrics.md has a '## delayd' section");
        table
            .lines()
            .filter(|l| l.starts_with("| `"))
            .map(|l| {
                let cells: Vec<&str> = l.split('|').map(str::trim).collect();
                let labels = cells[3]
                    .split(',')
                    .map(|c| c.trim().trim_matches('`').to_owned())
                    .filter(|c| !c.is_empty())
                    .collect();
                (
                    cells[1].trim_matches('`').to_owned(),
                    cells[2].to_owned(),
                    labels,
                )
            })
            .collect()
    }

    #[test]
    fn docs_metrics_md_lists_every_metric_with_its_type_and_labels() {
        let from_code: Vec<(String, String, Vec<String>)> = METRICS
            .iter()
            .map(|m| {
                (
                    m.name.to_owned(),
                    m.kind.as_str().to_owned(),
                    m.labels.iter().map(|l| l.to_string()).collect(),
                )
            })
            .collect();
        assert_eq!(documented(), from_code);
    }

    #[test]
    fn names_follow_prometheus_conventions() {
        for m in METRICS {
            assert!(m.name.starts_with("delayd_"), "{}", m.name);
            assert_eq!(
                m.kind == Kind::Counter,
                m.name.ends_with("_total"),
                "{}: counters, and only they, end in _total",
                m.name
            );
            assert!(m.help.ends_with('.'), "{}", m.name);
        }
    }

    #[test]
    fn process_cpu_seconds_is_typed_a_counter() {
        let text = "# HELP process_cpu_seconds_total x\n# TYPE process_cpu_seconds_total gauge\nprocess_cpu_seconds_total 1.25\n# TYPE process_threads gauge\n";
        let out = cpu_seconds_as_counter(text.to_owned());
        assert!(out.contains("# TYPE process_cpu_seconds_total counter\n"));
        assert!(out.contains("process_cpu_seconds_total 1.25\n"));
        assert!(out.contains("# TYPE process_threads gauge\n"));
    }

    #[test]
    fn scrape_time_families_are_written_with_help_type_and_escaped_labels() {
        let mut out = String::new();
        write_family(
            &mut out,
            "delayd_broker_connected",
            &[(vec!["rab\"bit".into(), "consume".into()], 1.0)],
        );
        write_family(&mut out, "delayd_oldest_overdue_seconds", &[]);
        assert_eq!(
            out,
            "# HELP delayd_broker_connected 1 while the broker connection for the role (consume, publish) is open, 0 while it is not.\n\
             # TYPE delayd_broker_connected gauge\n\
             delayd_broker_connected{broker=\"rab\\\"bit\",role=\"consume\"} 1\n\n"
        );
    }
}
