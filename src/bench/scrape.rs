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

/// CPU microseconds per message between two samples.
pub fn cpu_us_per_message(before: ProcessSample, after: ProcessSample, messages: u64) -> f64 {
    (after.cpu_seconds - before.cpu_seconds) * 1e6 / messages.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

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
            cpu_seconds: 1.5,
            resident_bytes: 0.0,
        };
        assert_eq!(cpu_us_per_message(a, b, 5000), 100.0);
    }
}
