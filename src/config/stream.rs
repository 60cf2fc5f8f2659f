//! A stream ingress's retention (`from.queue_type = "stream"`): what delayd
//! declares the stream with, and what `delayd check` says of it. A message
//! retention removes before delayd read it is lost, so retention must
//! outlast the longest outage of delayd its operators plan for.

use std::time::Duration;

use super::{FromConfig, QueueArgument};

/// `x-max-age` when the config names none: a week.
pub const DEFAULT_MAX_AGE: &str = "7D";
/// `x-max-length-bytes` when the config names none: 10 GB, so a long
/// outage does not fill the broker's disk either.
pub const DEFAULT_MAX_LENGTH_BYTES: i64 = 10_000_000_000;
/// `delayd check` warns about a stream kept for less than this.
pub const SHORTEST_SAFE_AGE: Duration = Duration::from_secs(24 * 3600);

/// A stream ingress's retention, as declared.
#[derive(Debug, Clone, PartialEq)]
pub struct Retention {
    /// `x-max-age`, RabbitMQ's notation ("7D", "12h").
    pub max_age: String,
    /// `x-max-length-bytes`.
    pub max_length_bytes: i64,
}

impl Retention {
    /// The route's own values, or the defaults.
    pub fn of(from: &FromConfig) -> Retention {
        let max_age = match from.queue_arguments.get("x-max-age") {
            Some(QueueArgument::Str(s)) => s.clone(),
            _ => DEFAULT_MAX_AGE.to_owned(),
        };
        let max_length_bytes = match from.queue_arguments.get("x-max-length-bytes") {
            Some(QueueArgument::Int(n)) => *n,
            _ => DEFAULT_MAX_LENGTH_BYTES,
        };
        Retention {
            max_age,
            max_length_bytes,
        }
    }

    /// What `delayd check` warns about, if anything.
    pub fn warning(&self) -> Option<String> {
        let age = max_age(&self.max_age)?;
        (age < SHORTEST_SAFE_AGE).then(|| {
            format!(
                "x-max-age = {:?} keeps messages {}: a delayd down longer loses those it had not read; keep them at least as long as the longest outage you plan for",
                self.max_age,
                humantime::format_duration(age)
            )
        })
    }
}

/// `x-max-age` in RabbitMQ's notation: a positive whole number and one of
/// the units Y, M, D, h, m, s (a month is 30 days, a year 365).
pub fn max_age(text: &str) -> Option<Duration> {
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (number, unit) = text.split_at(split);
    let n: u64 = number.parse().ok().filter(|n| *n > 0)?;
    let seconds = match unit {
        "Y" => 365 * 86_400,
        "M" => 30 * 86_400,
        "D" => 86_400,
        "h" => 3_600,
        "m" => 60,
        "s" => 1,
        _ => return None,
    };
    Some(Duration::from_secs(n.checked_mul(seconds)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_age_reads_rabbitmqs_notation() {
        assert_eq!(max_age("7D"), Some(Duration::from_secs(7 * 86_400)));
        assert_eq!(max_age("12h"), Some(Duration::from_secs(12 * 3_600)));
        assert_eq!(max_age("1Y"), Some(Duration::from_secs(365 * 86_400)));
        for bad in ["", "D", "7", "7d", "0D", "-1D", "7 D", "1.5h"] {
            assert_eq!(max_age(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_short_retention_is_warned_about() {
        let short = Retention {
            max_age: "6h".into(),
            max_length_bytes: DEFAULT_MAX_LENGTH_BYTES,
        };
        let w = short.warning().expect("a warning");
        assert!(w.contains("x-max-age") && w.contains("6h"), "{w}");
        let default = Retention::of(&FromConfig::default());
        assert_eq!(default.max_age, DEFAULT_MAX_AGE);
        assert_eq!(default.warning(), None);
    }
}
