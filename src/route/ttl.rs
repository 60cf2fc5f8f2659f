//! `mode = "ttl"`: emulate a TTL wait queue with a dead-letter exchange.
//!
//! **Delay.** The per-message `expiration` property (a string of whole
//! milliseconds, as RabbitMQ requires) and the route's `message_ttl` (like
//! the queue argument `x-message-ttl`); when both are set the lower wins.
//! Unlike a real queue, every message has its own timer: a 1 s message never
//! waits behind a 1 h one.
//!
//! **Dead-lettering** follows RabbitMQ's `rabbit_dead_letter` rules:
//!
//! - the message keeps its routing key, and its `CC` header (so it reaches
//!   the same queues), unless the route sets `to.routing_key`, which replaces
//!   the key and drops `CC`; `BCC` is always removed;
//! - `expiration` is removed, so the message does not expire again;
//! - `x-death` holds one table per {queue, reason}, most recent first: an
//!   existing entry has its `count` incremented (its `time`, `exchange`,
//!   `routing-keys` stay those of the first death) and moves to the front; a
//!   new one gets `count` 1, `reason`, `queue`, `time` (seconds), `exchange`,
//!   `routing-keys` (routing key then CC and BCC keys) and, when the message
//!   had one, `original-expiration`;
//! - `x-first-death-{reason,queue,exchange}` are set when the message had no
//!   `x-death` yet; `x-last-death-{reason,queue,exchange}` every time (as
//!   RabbitMQ 3.13+ does).

use std::time::Duration;

use delayd_adapters::{FieldTable, Message, Value};

pub const X_DEATH: &str = "x-death";
pub const X_FIRST_DEATH_REASON: &str = "x-first-death-reason";
pub const X_FIRST_DEATH_QUEUE: &str = "x-first-death-queue";
pub const X_FIRST_DEATH_EXCHANGE: &str = "x-first-death-exchange";
pub const X_LAST_DEATH_REASON: &str = "x-last-death-reason";
pub const X_LAST_DEATH_QUEUE: &str = "x-last-death-queue";
pub const X_LAST_DEATH_EXCHANGE: &str = "x-last-death-exchange";
pub const CC: &str = "CC";
pub const BCC: &str = "BCC";
/// The x-death reason of a message whose TTL ran out.
pub const EXPIRED: &str = "expired";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidTtl {
    #[error("expiration property {0:?} is not a whole number of milliseconds")]
    Expiration(String),
    #[error("the message has no expiration property and the route no message_ttl")]
    Missing,
    #[error("TTL of {ttl_ms} ms is over the route's max_delay of {max_ms} ms")]
    TooLong { ttl_ms: u128, max_ms: u128 },
}

/// The due time (epoch ms) of a message that arrived at `now_ms`.
pub fn due(
    expiration: Option<&str>,
    message_ttl: Option<Duration>,
    now_ms: u64,
    max_delay: Duration,
) -> Result<u64, InvalidTtl> {
    let per_message = expiration.map(parse_expiration).transpose()?;
    let queue = message_ttl.map(|d| d.as_millis());
    let ttl = match (per_message, queue) {
        (Some(a), Some(b)) => a.min(b),
        (Some(a), None) | (None, Some(a)) => a,
        (None, None) => return Err(InvalidTtl::Missing),
    };
    let max_ms = max_delay.as_millis();
    if ttl > max_ms {
        return Err(InvalidTtl::TooLong {
            ttl_ms: ttl,
            max_ms,
        });
    }
    Ok(now_ms.saturating_add(ttl as u64))
}

/// RabbitMQ accepts only a non-negative integer written in digits.
fn parse_expiration(text: &str) -> Result<u128, InvalidTtl> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(InvalidTtl::Expiration(text.to_owned()));
    }
    text.parse()
        .map_err(|_| InvalidTtl::Expiration(text.to_owned()))
}

/// One death to record: where and why.
#[derive(Debug, Clone, Copy)]
pub struct Death<'a> {
    /// The queue named in `x-death` (the route's ingress or configured queue).
    pub queue: &'a str,
    pub reason: &'a str,
    /// Seconds since the epoch.
    pub time_s: u64,
    /// `to.routing_key` is set: the routing key is replaced and `CC` dropped.
    pub replaces_routing_key: bool,
}

/// Rewrite `message` as RabbitMQ dead-letters it (see the module docs).
pub fn dead_letter(message: &mut Message, death: Death<'_>) {
    let headers = &mut message.headers;
    let mut routing_keys = vec![Value::LongString(message.routing_key.as_bytes().to_vec())];
    for key in [CC, BCC] {
        routing_keys.extend(header_routes(headers.get(key)));
    }
    let mut info = vec![
        ("reason".to_owned(), text(death.reason)),
        ("queue".to_owned(), text(death.queue)),
        ("time".to_owned(), Value::Timestamp(death.time_s)),
        ("exchange".to_owned(), text(&message.source)),
        ("routing-keys".to_owned(), Value::Array(routing_keys)),
    ];
    if let Some(expiration) = &message.properties.expiration {
        info.push(("original-expiration".to_owned(), text(expiration)));
    }
    update_x_death(headers, info, &death, &message.source);
    headers.insert(X_LAST_DEATH_REASON, text(death.reason));
    headers.insert(X_LAST_DEATH_QUEUE, text(death.queue));
    headers.insert(X_LAST_DEATH_EXCHANGE, text(&message.source));
    if death.replaces_routing_key {
        headers.remove(CC);
    }
    headers.remove(BCC);
    message.properties.expiration = None;
}

fn text(s: &str) -> Value {
    Value::LongString(s.as_bytes().to_vec())
}

/// The keys of a `CC`/`BCC` header: an array of strings (others are ignored,
/// as RabbitMQ ignores them for routing).
fn header_routes(value: Option<&Value>) -> Vec<Value> {
    match value {
        Some(Value::Array(items)) => items.iter().filter_map(Value::as_text).map(text).collect(),
        _ => Vec::new(),
    }
}

fn update_x_death(
    headers: &mut FieldTable,
    info: Vec<(String, Value)>,
    death: &Death<'_>,
    exchange: &str,
) {
    let fresh = || {
        let mut entry = vec![("count".to_owned(), Value::I64(1))];
        entry.extend(info.iter().cloned());
        Value::Table(FieldTable(entry))
    };
    let entries = match headers.get(X_DEATH) {
        None => {
            headers.insert(X_FIRST_DEATH_REASON, text(death.reason));
            headers.insert(X_FIRST_DEATH_QUEUE, text(death.queue));
            headers.insert(X_FIRST_DEATH_EXCHANGE, text(exchange));
            vec![fresh()]
        }
        Some(Value::Array(existing)) => {
            let is_ours = |v: &Value| match v {
                Value::Table(t) => {
                    field_text(t, "queue") == Some(death.queue)
                        && field_text(t, "reason") == Some(death.reason)
                }
                _ => false,
            };
            let mut entries = Vec::with_capacity(existing.len() + 1);
            let mut others = Vec::with_capacity(existing.len());
            let mut matched = None;
            for entry in existing {
                if matched.is_none() && is_ours(entry) {
                    matched = Some(entry.clone());
                } else {
                    others.push(entry.clone());
                }
            }
            entries.push(match matched {
                Some(Value::Table(mut t)) => {
                    let count = t.get("count").and_then(as_count).unwrap_or(0);
                    t.insert("count", Value::I64(count.saturating_add(1)));
                    Value::Table(t)
                }
                _ => fresh(),
            });
            entries.extend(others);
            entries
        }
        // Not an array: RabbitMQ replaces it with a fresh history.
        Some(_) => vec![fresh()],
    };
    headers.insert(X_DEATH, Value::Array(entries));
}

fn field_text<'a>(table: &'a FieldTable, key: &str) -> Option<&'a str> {
    table.get(key).and_then(Value::as_text)
}

/// An `x-death` count of any integer type.
pub fn as_count(value: &Value) -> Option<i64> {
    match value {
        Value::I8(x) => Some(*x as i64),
        Value::U8(x) => Some(*x as i64),
        Value::I16(x) => Some(*x as i64),
        Value::U16(x) => Some(*x as i64),
        Value::I32(x) => Some(*x as i64),
        Value::U32(x) => Some(*x as i64),
        Value::I64(x) => Some(*x),
        Value::U64(x) => i64::try_from(*x).ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_700_000_000_000;
    const MAX: Duration = Duration::from_secs(86400);

    fn death(queue: &str) -> Death<'_> {
        Death {
            queue,
            reason: EXPIRED,
            time_s: 1_700_000_000,
            replaces_routing_key: false,
        }
    }

    fn message() -> Message {
        let mut m = Message::with_body("b");
        m.source = "orders.wait".into();
        m.routing_key = "order.created".into();
        m.properties.expiration = Some("5000".into());
        m
    }

    fn x_death(m: &Message) -> Vec<FieldTable> {
        match m.headers.get(X_DEATH) {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::Table(t) => t.clone(),
                    other => panic!("x-death entry {other:?}"),
                })
                .collect(),
            other => panic!("x-death {other:?}"),
        }
    }

    #[test]
    fn lower_of_expiration_and_message_ttl_wins() {
        let ttl = Some(Duration::from_secs(2));
        assert_eq!(due(Some("500"), ttl, NOW, MAX), Ok(NOW + 500));
        assert_eq!(due(Some("5000"), ttl, NOW, MAX), Ok(NOW + 2000));
        assert_eq!(due(None, ttl, NOW, MAX), Ok(NOW + 2000));
        assert_eq!(due(Some("0"), None, NOW, MAX), Ok(NOW));
        assert_eq!(due(None, None, NOW, MAX), Err(InvalidTtl::Missing));
    }

    #[test]
    fn bad_expiration_is_invalid_with_the_text() {
        for bad in ["", "-1", "1.5", " 10", "soon", "1e3"] {
            let e = due(Some(bad), None, NOW, MAX).unwrap_err();
            assert_eq!(e, InvalidTtl::Expiration(bad.into()));
        }
        assert!(matches!(
            due(Some("99999999999999999999999999"), None, NOW, MAX),
            Err(InvalidTtl::TooLong { .. })
        ));
    }

    #[test]
    fn first_death_adds_x_death_and_first_and_last_headers() {
        let mut m = message();
        dead_letter(&mut m, death("orders.wait.q"));
        assert_eq!(m.properties.expiration, None);
        let entries = x_death(&m);
        assert_eq!(entries.len(), 1);
        let e = &entries[0];
        assert_eq!(e.get("count"), Some(&Value::I64(1)));
        assert_eq!(field_text(e, "reason"), Some("expired"));
        assert_eq!(field_text(e, "queue"), Some("orders.wait.q"));
        assert_eq!(field_text(e, "exchange"), Some("orders.wait"));
        assert_eq!(e.get("time"), Some(&Value::Timestamp(1_700_000_000)));
        assert_eq!(field_text(e, "original-expiration"), Some("5000"));
        assert_eq!(
            e.get("routing-keys"),
            Some(&Value::Array(vec![text("order.created")]))
        );
        for (k, v) in [
            (X_FIRST_DEATH_REASON, "expired"),
            (X_FIRST_DEATH_QUEUE, "orders.wait.q"),
            (X_FIRST_DEATH_EXCHANGE, "orders.wait"),
            (X_LAST_DEATH_REASON, "expired"),
            (X_LAST_DEATH_QUEUE, "orders.wait.q"),
            (X_LAST_DEATH_EXCHANGE, "orders.wait"),
        ] {
            assert_eq!(m.headers.get(k).and_then(Value::as_text), Some(v), "{k}");
        }
    }

    #[test]
    fn later_deaths_increment_and_move_to_front_keeping_first_time() {
        let mut m = message();
        dead_letter(&mut m, death("q1"));
        m.properties.expiration = Some("10".into());
        let mut second = death("q2");
        second.time_s += 5;
        dead_letter(&mut m, second);
        let e = x_death(&m);
        assert_eq!(
            e.iter().map(|t| field_text(t, "queue")).collect::<Vec<_>>(),
            [Some("q2"), Some("q1")]
        );
        m.properties.expiration = Some("10".into());
        let mut third = death("q1");
        third.time_s += 60;
        dead_letter(&mut m, third);
        let e = x_death(&m);
        assert_eq!(e.len(), 2);
        assert_eq!(field_text(&e[0], "queue"), Some("q1"));
        assert_eq!(e[0].get("count"), Some(&Value::I64(2)));
        assert_eq!(e[0].get("time"), Some(&Value::Timestamp(1_700_000_000)));
        assert_eq!(field_text(&e[0], "original-expiration"), Some("5000"));
        assert_eq!(e[1].get("count"), Some(&Value::I64(1)));
        assert_eq!(
            m.headers.get(X_FIRST_DEATH_QUEUE).and_then(Value::as_text),
            Some("q1")
        );
        assert_eq!(
            m.headers.get(X_LAST_DEATH_QUEUE).and_then(Value::as_text),
            Some("q1")
        );
    }

    #[test]
    fn same_queue_other_reason_is_a_separate_entry() {
        let mut m = message();
        let mut rejected = death("q");
        rejected.reason = "rejected";
        dead_letter(&mut m, rejected);
        dead_letter(&mut m, death("q"));
        let e = x_death(&m);
        assert_eq!(e.len(), 2);
        assert_eq!(field_text(&e[0], "reason"), Some("expired"));
        assert_eq!(
            m.headers.get(X_FIRST_DEATH_REASON).and_then(Value::as_text),
            Some("rejected")
        );
    }

    #[test]
    fn cc_kept_unless_key_replaced_and_bcc_always_removed() {
        let keys = |v: &[&str]| Value::Array(v.iter().map(|k| text(k)).collect());
        let mut m = message();
        m.headers.insert(CC, keys(&["cc.a", "cc.b"]));
        m.headers.insert(BCC, keys(&["bcc.a"]));
        let mut kept = m.clone();
        dead_letter(&mut kept, death("q"));
        assert_eq!(kept.headers.get(CC), Some(&keys(&["cc.a", "cc.b"])));
        assert_eq!(kept.headers.get(BCC), None);
        assert_eq!(
            x_death(&kept)[0].get("routing-keys"),
            Some(&keys(&["order.created", "cc.a", "cc.b", "bcc.a"]))
        );
        let mut replaced = m;
        let mut d = death("q");
        d.replaces_routing_key = true;
        dead_letter(&mut replaced, d);
        assert_eq!(replaced.headers.get(CC), None);
        assert_eq!(replaced.headers.get(BCC), None);
    }

    #[test]
    fn a_non_array_x_death_is_replaced() {
        let mut m = message();
        m.headers.insert(X_DEATH, Value::Bool(true));
        m.properties.expiration = None;
        dead_letter(&mut m, death("q"));
        let e = x_death(&m);
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].get("original-expiration"), None);
    }

    #[test]
    fn a_ttl_of_exactly_max_delay_is_accepted() {
        let max_ms = MAX.as_millis() as u64;
        assert_eq!(
            due(Some(&max_ms.to_string()), None, NOW, MAX),
            Ok(NOW + max_ms)
        );
        assert_eq!(
            due(Some(&(max_ms + 1).to_string()), None, NOW, MAX),
            Err(InvalidTtl::TooLong {
                ttl_ms: u128::from(max_ms) + 1,
                max_ms: u128::from(max_ms)
            })
        );
        // A sign is not a digit, though Rust's parser would take it.
        assert_eq!(
            due(Some("+5"), None, NOW, MAX),
            Err(InvalidTtl::Expiration("+5".into()))
        );
    }

    #[test]
    fn counts_of_every_integer_type_are_read() {
        for (value, want) in [
            (Value::I8(-3), Some(-3)),
            (Value::U8(200), Some(200)),
            (Value::I16(-300), Some(-300)),
            (Value::U16(60_000), Some(60_000)),
            (Value::I32(-70_000), Some(-70_000)),
            (Value::U32(4_000_000_000), Some(4_000_000_000)),
            (Value::I64(1 << 40), Some(1 << 40)),
            (Value::U64(1 << 50), Some(1 << 50)),
            (Value::U64(u64::MAX), None),
            (text("7"), None),
        ] {
            assert_eq!(as_count(&value), want, "{value:?}");
        }
    }
}
