//! `mode = "retry"`: a wait queue with back-off and a bounded number of
//! attempts, for messages a consumer rejected (`basic.reject`/`nack` with
//! `requeue=false`) from a work queue whose dead-letter exchange routes to
//! delayd's queue.
//!
//! **Counting.** The attempts that failed so far are the larger of
//! - the `x-death` count of the work queue (`retry.work_queue`; without it,
//!   the largest count of any `rejected` entry): RabbitMQ 3.x increments it
//!   on every rejection because delayd republishes the message with its
//!   `x-death`;
//! - `x-delayd-attempt`, the attempt number delayd wrote on the message it
//!   republished: RabbitMQ 4.x ignores client-set `x-death`, so there the
//!   broker's count restarts at 1 each time;
//! - 1 (the message is here, so one attempt failed).
//!
//! **Deciding.** With `n` failed attempts and `max_attempts` allowed: if
//! `n >= max_attempts` the message is parked with `x-delayd-park-reason` and
//! `x-delayd-attempts`; otherwise it waits the `n`-th back-off delay and is
//! republished to the work exchange with `x-delayd-attempt = n + 1`.
//! The decision is made at intake, so the stored message already carries
//! its new attempt number and its due time includes any jitter.

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use delayd_adapters::{FieldTable, Value};

use super::ttl::{as_count, X_DEATH};
use crate::config::{BackoffConfig, RetryConfig};

pub const X_DELAYD_ATTEMPT: &str = "x-delayd-attempt";
pub const X_DELAYD_PARK_REASON: &str = "x-delayd-park-reason";
pub const X_DELAYD_ATTEMPTS: &str = "x-delayd-attempts";
/// The x-death reason of a message a consumer rejected.
pub const REJECTED: &str = "rejected";

/// How long to wait before each retry.
#[derive(Debug, Clone, PartialEq)]
pub enum Backoff {
    /// Delay before retry 1, 2, ...; the last one repeats.
    List(Vec<Duration>),
    Exponential(BackoffConfig),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    pub backoff: Backoff,
    /// Processing attempts in all, the first included.
    pub max_attempts: u32,
    pub work_queue: Option<String>,
}

/// What to do with a rejected message.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Wait `delay`, then republish it as attempt `attempt`.
    Retry { delay: Duration, attempt: u32 },
    /// Give up: `attempts` attempts failed.
    Park { attempts: u32 },
}

impl Policy {
    pub fn from_config(config: &RetryConfig) -> Policy {
        let backoff = match &config.backoff {
            Some(b) => Backoff::Exponential(b.clone()),
            None => Backoff::List(config.delays.clone()),
        };
        let default_attempts = config.delays.len().saturating_add(1) as u32;
        Policy {
            backoff,
            max_attempts: config.max_attempts.unwrap_or(default_attempts).max(1),
            work_queue: config.work_queue.clone(),
        }
    }

    /// Attempts that failed so far (see the module docs).
    pub fn failed_attempts(&self, headers: &FieldTable) -> u32 {
        let from_header = headers
            .get(X_DELAYD_ATTEMPT)
            .and_then(|v| as_count(v).or_else(|| v.as_text()?.trim().parse().ok()))
            .unwrap_or(0);
        let from_x_death = self.x_death_count(headers);
        from_header.max(from_x_death).clamp(1, u32::MAX as i64) as u32
    }

    fn x_death_count(&self, headers: &FieldTable) -> i64 {
        let Some(Value::Array(entries)) = headers.get(X_DEATH) else {
            return 0;
        };
        entries
            .iter()
            .filter_map(|e| match e {
                Value::Table(t) => Some(t),
                _ => None,
            })
            .filter(|t| {
                let field = |k: &str| t.get(k).and_then(Value::as_text);
                match &self.work_queue {
                    Some(q) => field("queue") == Some(q.as_str()),
                    None => field("reason") == Some(REJECTED),
                }
            })
            .filter_map(|t| t.get("count").and_then(as_count))
            .max()
            .unwrap_or(0)
    }

    /// Retry or park, given the message's headers; `random` in [0, 1)
    /// spreads an exponential delay by the configured jitter.
    pub fn decide(&self, headers: &FieldTable, random: f64) -> Decision {
        let failed = self.failed_attempts(headers);
        if failed >= self.max_attempts {
            return Decision::Park { attempts: failed };
        }
        Decision::Retry {
            delay: self.delay_before_retry(failed, random),
            attempt: failed + 1,
        }
    }

    /// The delay before retry `n` (1-based).
    pub fn delay_before_retry(&self, n: u32, random: f64) -> Duration {
        let n = n.max(1);
        match &self.backoff {
            Backoff::List(delays) => delays
                .get(n as usize - 1)
                .or(delays.last())
                .copied()
                .unwrap_or_default(),
            Backoff::Exponential(b) => {
                let max = b.max.as_secs_f64();
                let exp = b.multiplier.powi(n.saturating_sub(1).min(1024) as i32);
                let base = (b.initial.as_secs_f64() * exp).min(max);
                let spread = 1.0 + b.jitter * (2.0 * random.clamp(0.0, 1.0) - 1.0);
                // `max` as f64 can round above Duration::MAX: saturate, never panic.
                Duration::try_from_secs_f64((base * spread).clamp(0.0, max)).unwrap_or(b.max)
            }
        }
    }
}

/// A number in [0, 1) for jitter, from the standard library's randomly
/// seeded hasher (no extra dependency; this is spreading, not security).
pub fn random_unit() -> f64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(delays: &[u64], max: Option<u32>) -> Policy {
        Policy::from_config(&RetryConfig {
            delays: delays.iter().map(|s| Duration::from_secs(*s)).collect(),
            max_attempts: max,
            work_queue: Some("work".into()),
            ..RetryConfig::default()
        })
    }

    fn death(queue: &str, reason: &str, count: i64) -> Value {
        Value::Table(FieldTable(vec![
            ("count".into(), Value::I64(count)),
            ("queue".into(), Value::LongString(queue.as_bytes().to_vec())),
            (
                "reason".into(),
                Value::LongString(reason.as_bytes().to_vec()),
            ),
        ]))
    }

    fn headers(deaths: Vec<Value>, attempt: Option<i64>) -> FieldTable {
        let mut h = FieldTable::new();
        if !deaths.is_empty() {
            h.insert(X_DEATH, Value::Array(deaths));
        }
        if let Some(a) = attempt {
            h.insert(X_DELAYD_ATTEMPT, Value::I64(a));
        }
        h
    }

    #[test]
    fn list_delays_default_max_attempts_and_last_delay_repeats() {
        let p = list(&[10, 60, 600], None);
        assert_eq!(p.max_attempts, 4);
        assert_eq!(p.delay_before_retry(1, 0.5), Duration::from_secs(10));
        assert_eq!(p.delay_before_retry(3, 0.5), Duration::from_secs(600));
        assert_eq!(p.delay_before_retry(9, 0.5), Duration::from_secs(600));
    }

    #[test]
    fn first_rejection_retries_as_attempt_two() {
        let p = list(&[10, 60], None);
        let h = headers(vec![death("work", REJECTED, 1)], None);
        assert_eq!(
            p.decide(&h, 0.0),
            Decision::Retry {
                delay: Duration::from_secs(10),
                attempt: 2
            }
        );
        // No x-death at all: still one failed attempt.
        assert_eq!(
            p.decide(&FieldTable::new(), 0.0),
            Decision::Retry {
                delay: Duration::from_secs(10),
                attempt: 2
            }
        );
    }

    #[test]
    fn x_death_count_of_the_work_queue_counts_on_rabbitmq_3() {
        let p = list(&[10, 60], Some(3));
        let h = headers(
            vec![death("other", REJECTED, 7), death("work", REJECTED, 2)],
            Some(2),
        );
        assert_eq!(
            p.decide(&h, 0.0),
            Decision::Retry {
                delay: Duration::from_secs(60),
                attempt: 3
            }
        );
        let h = headers(vec![death("work", REJECTED, 3)], Some(3));
        assert_eq!(p.decide(&h, 0.0), Decision::Park { attempts: 3 });
    }

    #[test]
    fn attempt_header_counts_when_the_broker_resets_x_death() {
        // RabbitMQ 4.x: the broker's own entry always says 1.
        let p = list(&[10], Some(3));
        let h = headers(vec![death("work", REJECTED, 1)], Some(3));
        assert_eq!(p.decide(&h, 0.0), Decision::Park { attempts: 3 });
    }

    #[test]
    fn without_work_queue_any_rejection_counts() {
        let mut p = list(&[10], Some(5));
        p.work_queue = None;
        let h = headers(
            vec![death("a", "expired", 9), death("b", REJECTED, 4)],
            None,
        );
        assert_eq!(p.failed_attempts(&h), 4);
    }

    #[test]
    fn exponential_backoff_caps_and_jitters_within_bounds() {
        let p = Policy::from_config(&RetryConfig {
            backoff: Some(BackoffConfig {
                initial: Duration::from_secs(1),
                multiplier: 2.0,
                max: Duration::from_secs(30),
                jitter: 0.2,
            }),
            max_attempts: Some(10),
            ..RetryConfig::default()
        });
        assert_eq!(p.delay_before_retry(1, 0.5), Duration::from_secs(1));
        assert_eq!(p.delay_before_retry(3, 0.5), Duration::from_secs(4));
        assert_eq!(p.delay_before_retry(9, 0.5), Duration::from_secs(30));
        assert_eq!(p.delay_before_retry(9, 0.999), Duration::from_secs(30));
        let low = p.delay_before_retry(3, 0.0);
        assert!(low >= Duration::from_millis(3199) && low <= Duration::from_millis(3201));
        for _ in 0..100 {
            let r = random_unit();
            assert!((0.0..1.0).contains(&r));
            let d = p.delay_before_retry(2, r);
            assert!(d >= Duration::from_millis(1599) && d <= Duration::from_millis(2401));
        }
    }

    #[test]
    fn a_huge_backoff_saturates_instead_of_panicking() {
        let policy = Policy {
            backoff: Backoff::Exponential(BackoffConfig {
                initial: Duration::from_secs(1),
                multiplier: 2.0,
                max: Duration::MAX,
                jitter: 0.5,
            }),
            max_attempts: 200,
            work_queue: None,
        };
        assert_eq!(policy.delay_before_retry(150, 1.0), Duration::MAX);
        assert_eq!(policy.delay_before_retry(1, 0.5), Duration::from_secs(1));
    }

    #[test]
    fn random_units_spread_over_zero_to_one() {
        let draws: Vec<f64> = (0..200).map(|_| random_unit()).collect();
        assert!(draws.iter().all(|r| (0.0..1.0).contains(r)));
        assert!(draws.iter().any(|&r| r < 0.5), "{draws:?}");
        assert!(draws.iter().any(|&r| r >= 0.5), "{draws:?}");
    }
}
