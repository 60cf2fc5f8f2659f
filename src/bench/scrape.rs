//! `--metrics URL`: read delayd's process metrics before and after a run,
//! so the report shows what delayd spent per message beside its lateness.

use anyhow::Context;

use crate::client::Client;

/// One scrape of the two standard process metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProcessSample {
    pub cpu_seconds: f64,
    pub resident_bytes: f64,
}

/// The `/metrics` endpoint to scrape, from `http://host:port/path`,
/// `host:port/path` or `host:port` (path `/metrics`).
pub struct Scraper {
    client: Client,
    path: String,
}

impl Scraper {
    pub fn new(url: &str) -> anyhow::Result<Scraper> {
        let rest = url.strip_prefix("http://").unwrap_or(url);
        anyhow::ensure!(
            !rest.contains("://"),
            "--metrics {url:?}: only plain http:// is supported"
        );
        let (addr, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/metrics"),
        };
        anyhow::ensure!(!addr.is_empty(), "--metrics {url:?}: no host:port");
        Ok(Scraper {
            client: Client::new(addr, None),
            path: path.to_string(),
        })
    }

    /// Scrape once.
    pub async fn sample(&self) -> anyhow::Result<ProcessSample> {
        let response = self
            .client
            .send("GET", &self.path)
            .await
            .context("scraping delayd's metrics")?;
        anyhow::ensure!(
            response.status == 200,
            "{}{} answered {}",
            self.client.addr,
            self.path,
            response.status
        );
        let text = String::from_utf8_lossy(&response.body);
        parse(&text).with_context(|| format!("{}{}", self.client.addr, self.path))
    }
}

/// Reads `process_cpu_seconds_total` and `process_resident_memory_bytes`.
pub fn parse(text: &str) -> anyhow::Result<ProcessSample> {
    let value = |name: &str| {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| {
                let (metric, v) = l.rsplit_once(' ')?;
                // Without labels, or with some: `name{...} v`.
                let bare = metric.split('{').next()?;
                (bare == name).then(|| v.parse::<f64>().ok()).flatten()
            })
            .with_context(|| format!("no {name} in the metrics"))
    };
    Ok(ProcessSample {
        cpu_seconds: value("process_cpu_seconds_total")?,
        resident_bytes: value("process_resident_memory_bytes")?,
    })
}

/// This process's own CPU time (user and system, all threads) from
/// `/proc/self/stat`: what the bench itself spends on the same AMQP or Kafka
/// work, to set beside delayd's in the same run.
pub fn own_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    parse_stat_cpu(&stat, rustix::param::clock_ticks_per_second())
}

/// `utime + stime` (fields 14 and 15) of a `/proc/PID/stat` line, in seconds.
fn parse_stat_cpu(stat: &str, ticks_per_second: u64) -> Option<f64> {
    // The command name (field 2) may hold spaces and parentheses: count
    // from the last ')'; field 3 is then the first.
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) as f64 / ticks_per_second.max(1) as f64)
}

/// The least CPU time a per-message figure is drawn from: the kernel counts
/// CPU time in clock ticks (10 ms at the usual 100 Hz), so a run of 20
/// messages shows 0 or 10 or 20 ms, and "1000 us per message" would mean
/// nothing. A second of CPU is 100 ticks: within 1 %.
pub const MIN_CPU_SECONDS: f64 = 1.0;

/// CPU microseconds per message for `cpu_seconds` over `messages`, or
/// `None` when too little CPU was counted to mean anything
/// ([`MIN_CPU_SECONDS`]).
pub fn us_per_message(cpu_seconds: f64, messages: u64) -> Option<f64> {
    (cpu_seconds >= MIN_CPU_SECONDS && messages > 0).then(|| cpu_seconds * 1e6 / messages as f64)
}

/// delayd's CPU microseconds per message between two samples (see
/// [`us_per_message`]).
pub fn cpu_us_per_message(
    before: ProcessSample,
    after: ProcessSample,
    messages: u64,
) -> Option<f64> {
    us_per_message(after.cpu_seconds - before.cpu_seconds, messages)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_per_message_figure_needs_a_second_of_cpu() {
        assert_eq!(us_per_message(0.02, 20), None);
        assert_eq!(us_per_message(0.99, 100_000), None);
        assert_eq!(us_per_message(2.0, 100_000), Some(20.0));
        assert_eq!(us_per_message(2.0, 0), None);
    }

    #[test]
    fn stat_cpu_is_utime_plus_stime_counted_from_the_last_paren() {
        // A command name with a space and a ')' of its own.
        let stat = "4242 (a) b) S 1 4242 4242 0 -1 4194560 900 0 0 0 250 130 0 0 20 0 9 0 77 0";
        assert_eq!(parse_stat_cpu(stat, 100), Some(3.8));
        assert_eq!(parse_stat_cpu("4242 (short) S 1", 100), None);
    }

    #[test]
    fn own_cpu_is_read_and_grows_with_work() {
        let before = own_cpu_seconds().expect("/proc/self/stat");
        // Spin until 50 ms of CPU show (a few clock ticks), however busy
        // the machine is; a reading that never grows fails at the deadline.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut x = 0u64;
        let mut after = before;
        while after < before + 0.05 && std::time::Instant::now() < deadline {
            for _ in 0..100_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
            after = own_cpu_seconds().expect("/proc/self/stat");
        }
        assert!(after >= before + 0.05, "{before} -> {after}");
    }

    #[test]
    fn reads_the_two_process_metrics_with_or_without_labels() {
        let text = "# HELP process_cpu_seconds_total x\n\
                    # TYPE process_cpu_seconds_total counter\n\
                    process_cpu_seconds_total 12.5\n\
                    process_cpu_seconds_total_other 99\n\
                    process_resident_memory_bytes{pod=\"a\"} 1048576\n";
        let s = parse(text).unwrap();
        assert_eq!(s.cpu_seconds, 12.5);
        assert_eq!(s.resident_bytes, 1_048_576.0);
    }

    #[test]
    fn a_missing_metric_is_named() {
        let err = parse("process_cpu_seconds_total 1\n").unwrap_err();
        assert!(
            err.to_string().contains("process_resident_memory_bytes"),
            "{err}"
        );
    }

    #[test]
    fn urls_with_and_without_scheme_and_path() {
        let s = Scraper::new("http://127.0.0.1:9464/metrics").unwrap();
        assert_eq!(
            (s.client.addr.as_str(), s.path.as_str()),
            ("127.0.0.1:9464", "/metrics")
        );
        let s = Scraper::new("localhost:1").unwrap();
        assert_eq!(
            (s.client.addr.as_str(), s.path.as_str()),
            ("localhost:1", "/metrics")
        );
        assert!(Scraper::new("https://x:1/metrics").is_err());
    }

    #[test]
    fn cpu_per_message() {
        let a = ProcessSample {
            cpu_seconds: 1.0,
            resident_bytes: 0.0,
        };
        let b = ProcessSample {
            cpu_seconds: 2.5,
            resident_bytes: 0.0,
        };
        assert_eq!(cpu_us_per_message(a, b, 5000), Some(300.0));
        // Half a second of CPU is too little to mean anything.
        let c = ProcessSample {
            cpu_seconds: 1.5,
            resident_bytes: 0.0,
        };
        assert_eq!(cpu_us_per_message(a, c, 5000), None);
    }
}
