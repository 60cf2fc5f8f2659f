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

/// HELP text for every metric delayd exports (docs/metrics.md has the
/// same table). Counters end in `_total`; units are in the name.
fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    let per_route = [
        ("delayd_scheduled_total", "Messages stored and armed."),
        ("delayd_fired_total", "Messages published to their target."),
        (
            "delayd_invalid_total",
            "Messages sent to the route's invalid destination.",
        ),
        (
            "delayd_unroutable_total",
            "Due messages sent to the unroutable destination.",
        ),
        (
            "delayd_parked_total",
            "Retry-mode messages parked after their last attempt.",
        ),
        (
            "delayd_cancelled_total",
            "Messages cancelled through the admin API or a Kafka tombstone.",
        ),
        (
            "delayd_handed_off_total",
            "Messages retired after being handed back to their ingress.",
        ),
        (
            "delayd_released_total",
            "Messages left to another instance when their Kafka partition was revoked (broker-kept store).",
        ),
        (
            "delayd_store_restored_total",
            "Pending messages read back from the state topic when a partition was assigned.",
        ),
        (
            "delayd_store_records_skipped_total",
            "Undecodable records (not written by delayd) skipped while reading the route's state streams.",
        ),
        (
            "delayd_store_write_failures_total",
            "State topic writes (Schedule or tombstone) that failed.",
        ),
        (
            "delayd_publish_retries_total",
            "Publishes that failed and were re-armed with back-off.",
        ),
        (
            "delayd_store_failures_total",
            "Deliveries that could not be stored (held, not acked).",
        ),
        (
            "delayd_backpressure_held_total",
            "Deliveries held while the route was paused.",
        ),
    ];
    for (name, help) in per_route {
        describe_counter!(name, help);
    }
    describe_counter!(
        "delayd_redeliveries_deduplicated_total",
        "Broker redeliveries recognised as already stored."
    );
    describe_counter!(
        "delayd_handoff_messages_total",
        "Messages handed back to their ingress at shutdown."
    );
    describe_counter!(
        "delayd_store_writes_total",
        "State topic records written, per route and kind (schedule, tombstone)."
    );
    describe_gauge!(
        "delayd_store_restoring_partitions",
        "Partitions whose pending messages are being restored from the state topic."
    );
    describe_counter!(
        "delayd_wal_fsyncs_total",
        "Group commits (fdatasync) of the WAL."
    );
    describe_counter!(
        "delayd_wal_written_bytes_total",
        Unit::Bytes,
        "Bytes written to the WAL."
    );
    describe_counter!("delayd_wal_compactions_total", "WAL segments compacted.");
    describe_counter!(
        "delayd_wal_corrupt_frames_total",
        "Damaged WAL frames found by recovery."
    );
    describe_gauge!(
        "delayd_pending_messages",
        "Messages waiting or being published, per route."
    );
    describe_gauge!(
        "delayd_backpressure",
        "1 while the route's intake is paused."
    );
    describe_gauge!("delayd_wal_bytes", Unit::Bytes, "WAL size on disk.");
    describe_gauge!(
        "delayd_wal_live_bytes",
        Unit::Bytes,
        "WAL bytes still needed."
    );
    describe_gauge!("delayd_wal_segments", "WAL segment files.");
    describe_histogram!(
        "delayd_lateness_seconds",
        Unit::Seconds,
        "How long after its due time a message was handed to its target."
    );
    describe_histogram!(
        "delayd_wal_fsync_seconds",
        Unit::Seconds,
        "Duration of one WAL group commit."
    );
}

/// The standard process metrics (`process_cpu_seconds_total`,
/// `process_resident_memory_bytes`, open fds, ...), read from the OS.
static PROCESS: std::sync::LazyLock<metrics_process::Collector> =
    std::sync::LazyLock::new(metrics_process::Collector::default);

/// Everything in Prometheus text, the process metrics read just now.
pub fn render(handle: &PrometheusHandle) -> String {
    PROCESS.collect();
    handle.render()
}

static HANDLE: std::sync::OnceLock<PrometheusHandle> = std::sync::OnceLock::new();

/// The handle installed by [`init_metrics`], if any.
pub fn metrics_handle() -> Option<PrometheusHandle> {
    HANDLE.get().cloned()
}
