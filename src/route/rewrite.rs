//! Egress header rewrites: the only changes delayd makes to a message in
//! `delay` mode (`ttl` mode dead-letters it instead, see [`super::ttl`]).
//!
//! - `x-delay` becomes its negative (as the plugin does, a signed 32-bit int
//!   when it fits, else 64-bit), so consumers can tell it was delayed.
//! - `x-delayd-id` is added (the message's identity, `crate::id`, as a long
//!   string), so consumers can deduplicate the rare republish after a crash.
//! - `x-delayd-error` is added on messages sent to an invalid/unroutable place.

use delayd_adapters::{Message, Value};

use super::delay::{delay_ms, X_DELAY};
use crate::id::MessageId;

pub const X_DELAYD_ID: &str = "x-delayd-id";
pub const X_DELAYD_ERROR: &str = "x-delayd-error";

/// Rewrite a due message's headers for republishing.
pub fn for_delivery(message: &mut Message, id: MessageId) {
    // Only a positive delay is negated; 0 or negative stay as they were.
    if let Some(delay) = message
        .headers
        .get(X_DELAY)
        .and_then(delay_ms)
        .filter(|d| *d > 0)
    {
        let negative = -(delay.min(i64::MAX as i128) as i64);
        let value = i32::try_from(negative)
            .map(Value::I32)
            .unwrap_or(Value::I64(negative));
        message.headers.insert(X_DELAY, value);
    }
    add_id(message, id);
}

/// Add `x-delayd-id`, for consumers to deduplicate (replacing one the
/// message brought in: it is a new message to delayd, see `crate::id`).
pub fn add_id(message: &mut Message, id: MessageId) {
    message
        .headers
        .insert(X_DELAYD_ID, Value::LongString(id.to_string().into_bytes()));
}

/// Mark a message with why it could not be scheduled or delivered.
pub fn with_error(message: &mut Message, reason: &str) {
    message.headers.insert(
        X_DELAYD_ERROR,
        Value::LongString(reason.as_bytes().to_vec()),
    );
}

/// Make a message the broker refused fit for the unroutable destination:
/// the properties RabbitMQ checks against the publisher (`user_id` must be
/// the login, `expiration` a number of ms) move into `x-delayd-user-id` and
/// `x-delayd-expiration` headers, so nothing of them is lost.
pub fn strip_checked_properties(message: &mut Message) {
    if let Some(user_id) = message.properties.user_id.take() {
        message
            .headers
            .insert("x-delayd-user-id", Value::LongString(user_id.into_bytes()));
    }
    if let Some(expiration) = message.properties.expiration.take() {
        message.headers.insert(
            "x-delayd-expiration",
            Value::LongString(expiration.into_bytes()),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use delayd_adapters::FieldTable;

    #[test]
    fn delay_is_negated_in_place_and_id_added() {
        let mut m = Message {
            headers: FieldTable(vec![
                ("a".into(), Value::Bool(true)),
                (X_DELAY.into(), Value::LongString(b"5000".to_vec())),
                ("z".into(), Value::I8(1)),
            ]),
            ..Message::default()
        };
        for_delivery(&mut m, MessageId::legacy(42));
        assert_eq!(m.headers.0[1], (X_DELAY.into(), Value::I32(-5000)));
        assert_eq!(
            m.headers.get(X_DELAYD_ID),
            Some(&Value::LongString(b"42".to_vec()))
        );
        assert_eq!(m.headers.len(), 4);
    }

    #[test]
    fn huge_delay_negates_to_i64_and_no_delay_header_is_left_alone() {
        let mut m = Message::default();
        m.headers.insert(X_DELAY, Value::I64(1 << 40));
        for_delivery(&mut m, MessageId::legacy(1));
        assert_eq!(m.headers.get(X_DELAY), Some(&Value::I64(-(1 << 40))));
        let mut plain = Message::default();
        for_delivery(&mut plain, MessageId::legacy(1));
        assert!(plain.headers.get(X_DELAY).is_none());
    }

    #[test]
    fn a_zero_or_negative_delay_stays_as_it_was() {
        for delay in [
            Value::LongString(b"0".to_vec()),
            Value::I32(0),
            Value::I32(-5),
        ] {
            let mut m = Message::default();
            m.headers.insert(X_DELAY, delay.clone());
            for_delivery(&mut m, MessageId::legacy(3));
            assert_eq!(m.headers.get(X_DELAY), Some(&delay));
            assert_eq!(m.headers.len(), 2);
        }
    }

    #[test]
    fn errors_and_checked_properties_become_headers() {
        let mut m = Message::default();
        with_error(&mut m, "no route");
        assert_eq!(
            m.headers.get(X_DELAYD_ERROR),
            Some(&Value::LongString(b"no route".to_vec()))
        );
        m.properties.user_id = Some("alice".into());
        m.properties.expiration = Some("500".into());
        strip_checked_properties(&mut m);
        assert_eq!(m.properties.user_id, None);
        assert_eq!(m.properties.expiration, None);
        assert_eq!(
            m.headers.get("x-delayd-user-id"),
            Some(&Value::LongString(b"alice".to_vec()))
        );
        assert_eq!(
            m.headers.get("x-delayd-expiration"),
            Some(&Value::LongString(b"500".to_vec()))
        );
    }
}
