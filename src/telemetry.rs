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
    let _ = HANDLE.set(handle.clone());
    Ok(handle)
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
