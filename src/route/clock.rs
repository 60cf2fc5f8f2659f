//! What a delay counts from (`delay_from`).
//!
//! A due time is `x-delay` (or a TTL) after the moment the broker took the
//! message, so that a restart, a rebalance or a backlog in front of delayd
//! shifts nothing: what fell due meanwhile leaves at once. The broker's
//! moment is:
//!
//! - Kafka: the record's timestamp. `CreateTime` (the default) is the
//!   producer's clock; a topic with `message.timestamp.type=LogAppendTime`
//!   gives the broker's.
//! - RabbitMQ: the `timestamp_in_ms` header, which RabbitMQ ≥ 3.12 stamps on
//!   every incoming message that has none with
//!   `message_interceptors.incoming.set_header_timestamp.overwrite = false`
//!   (the setting delayd recommends: `true` would also replace the
//!   producer's `timestamp` property, which must reach the consumer).
//!
//! Otherwise, and with `delay_from = "intake"`, it is when delayd read the
//! message. So it is too for a message whose stamp is from an earlier trip
//! through the broker, which a broker that keeps stamps does not renew:
//! - one that carries `x-death` came by dead-lettering, which keeps the
//!   stamp of its first publish, long before it reached delayd's queue;
//! - one that carries `x-delayd-id` came out of delayd before (a consumer
//!   sending it back with its headers for a retry, or a route whose target
//!   is another route's exchange): its stamp is from its first publish.
//!
//! A time after delayd's own clock (a producer or host clock ahead) is
//! taken as delayd's clock: a delay never counts from the future. Retry
//! mode always counts from intake: a back-off follows the failure that sent
//! the message, not its first publish.

use delayd_adapters::{Message, Value};

use super::rewrite::X_DELAYD_ID;
use super::ttl::X_DEATH;

/// The header RabbitMQ's `set_header_timestamp` interceptor stamps.
pub const TIMESTAMP_IN_MS: &str = "timestamp_in_ms";

/// When the broker took `message` (epoch ms), if the message says.
pub fn broker_time(message: &Message) -> Option<u64> {
    if let Some(ts) = message.timestamp_ms {
        // Kafka: -1 (or any negative) means "no timestamp".
        return u64::try_from(ts).ok();
    }
    // A stamp from an earlier trip through the broker (see above).
    if message.headers.get(X_DEATH).is_some() || message.headers.get(X_DELAYD_ID).is_some() {
        return None;
    }
    match message.headers.get(TIMESTAMP_IN_MS)? {
        Value::I64(ms) => u64::try_from(*ms).ok(),
        Value::U64(ms) => Some(*ms),
        Value::I32(ms) => u64::try_from(*ms).ok(),
        Value::U32(ms) => Some(u64::from(*ms)),
        _ => None,
    }
}

/// A broker time this far ahead of delayd's clock is reported: transit
/// time cannot put a stamp in the future, so the clocks disagree.
const SKEW_REPORTED_MS: u64 = 1000;

/// Report a broker time ahead of delayd's clock (`now_ms`) by more than
/// [`SKEW_REPORTED_MS`]: the gauge `delayd_clock_behind_broker_seconds`
/// and, at most once a minute, a warning. The other way round (delayd's
/// clock ahead) cannot be told from transit and backlog; see
/// docs/headers.md, "Clocks".
pub fn watch_skew(route: &str, message: &Message, now_ms: u64) {
    static LAST_WARNING_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let Some(ahead) = broker_time(message)
        .and_then(|t| t.checked_sub(now_ms))
        .filter(|&a| a > SKEW_REPORTED_MS)
    else {
        return;
    };
    metrics::gauge!("delayd_clock_behind_broker_seconds", "route" => route.to_owned())
        .set(ahead as f64 / 1000.0);
    let last = LAST_WARNING_MS.load(std::sync::atomic::Ordering::Relaxed);
    if now_ms.saturating_sub(last) >= 60_000
        && LAST_WARNING_MS
            .compare_exchange(
                last,
                now_ms,
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
            )
            .is_ok()
    {
        tracing::warn!(route, ahead_ms = ahead, "a message's broker time is ahead of this host's clock: the clocks disagree (run NTP); delays count from this host's clock for such messages");
    }
}

/// The moment a delay counts from: the broker's, never after `now_ms`.
pub fn counts_from(message: &Message, now_ms: u64) -> u64 {
    broker_time(message).map_or(now_ms, |t| t.min(now_ms))
}

#[cfg(test)]
mod tests {
    use super::*;
    use delayd_adapters::FieldTable;

    fn stamped(value: Value) -> Message {
        Message {
            headers: FieldTable(vec![(TIMESTAMP_IN_MS.into(), value)]),
            ..Message::default()
        }
    }

    #[test]
    fn rabbitmq_s_stamp_is_the_start() {
        assert_eq!(counts_from(&stamped(Value::I64(1_000)), 5_000), 1_000);
        assert_eq!(counts_from(&stamped(Value::U64(1_000)), 5_000), 1_000);
    }

    #[test]
    fn a_kafka_timestamp_is_the_start() {
        let m = Message {
            timestamp_ms: Some(2_000),
            ..Message::default()
        };
        assert_eq!(counts_from(&m, 5_000), 2_000);
        let none = Message {
            timestamp_ms: Some(-1),
            ..Message::default()
        };
        assert_eq!(counts_from(&none, 5_000), 5_000);
    }

    #[test]
    fn a_time_ahead_of_ours_is_ours() {
        assert_eq!(counts_from(&stamped(Value::I64(9_000)), 5_000), 5_000);
    }

    #[test]
    fn without_a_usable_stamp_it_is_intake() {
        assert_eq!(counts_from(&Message::default(), 5_000), 5_000);
        for unusable in [
            Value::I64(-3),
            Value::LongString(b"1000".to_vec()),
            Value::Timestamp(1),
        ] {
            assert_eq!(counts_from(&stamped(unusable), 5_000), 5_000);
        }
    }

    #[test]
    fn a_dead_lettered_message_counts_from_intake() {
        let mut m = stamped(Value::I64(1_000));
        m.headers.insert(X_DEATH, Value::Array(Vec::new()));
        assert_eq!(counts_from(&m, 5_000), 5_000);
    }

    /// A consumer that sends a message it got from delayd back with all its
    /// headers (a retry) brings the stamp of its first publish, which a
    /// broker with `overwrite = false` keeps: counted from it, the new delay
    /// would end early.
    #[test]
    fn a_message_that_came_out_of_delayd_before_counts_from_intake() {
        let mut m = stamped(Value::I64(1_000));
        m.headers.insert(
            X_DELAYD_ID,
            Value::LongString(b"9ae7a85ac46bc772000000000000053d".to_vec()),
        );
        assert_eq!(counts_from(&m, 5_000), 5_000);
    }
}
