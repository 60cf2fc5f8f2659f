//! Hand-off: a stopping instance gives its pending messages back to the
//! route's own ingress, for another instance to fire on time.
//!
//! The message handed back is the one delayd consumed, plus:
//! - `x-deliver-at`: its original due time in epoch ms (what any delayd, and
//!   a delay-mode route, reads as the absolute due time);
//! - `x-delayd-handoff`: a marker telling the receiving delayd to take that
//!   due time whatever the route's mode (a retry route must not count another
//!   attempt, a TTL route must not restart the TTL), and to restore the
//!   message before storing it;
//! - `x-delayd-handoff-id`: the message's identity, which the receiving
//!   delayd keeps (the copy is the same message, not a new one);
//! - `x-delayd-handoff-deliver-at`: the message's own `x-deliver-at`, when it
//!   had one;
//! - delivery mode 2 (persistent), so the broker keeps it as durably as the
//!   WAL did; the original mode is kept in `x-delayd-handoff-delivery-mode`.
//!
//! [`receive`] undoes all of it, so the message that finally fires is byte
//! for byte the one first consumed.

use delayd_adapters::{Message, Value};

use super::delay::X_DELIVER_AT;
use crate::id::MessageId;

pub const X_DELAYD_HANDOFF: &str = "x-delayd-handoff";
const HANDOFF_ID: &str = "x-delayd-handoff-id";
const SAVED_DELIVER_AT: &str = "x-delayd-handoff-deliver-at";
const SAVED_DELIVERY_MODE: &str = "x-delayd-handoff-delivery-mode";

/// What a hand-off copy carries besides the original message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandedOff {
    pub due_ms: u64,
    /// `None` for a copy from a delayd that did not send identities.
    pub uid: Option<MessageId>,
}

/// Turn a stored message into its hand-off copy, due at `due_ms`, keeping
/// its identity `uid`.
pub fn prepare(message: &mut Message, due_ms: u64, uid: MessageId) {
    let headers = &mut message.headers;
    // Its own x-deliver-at (the last, if repeated) is renamed where it stands,
    // so the header order comes back unchanged.
    if let Some((name, _)) = headers.0.iter_mut().rev().find(|(k, _)| k == X_DELIVER_AT) {
        *name = SAVED_DELIVER_AT.to_owned();
    }
    // Appended (not replacing anything), and so the last of their names:
    // `receive` takes exactly these back.
    let due = Value::I64(due_ms.min(i64::MAX as u64) as i64);
    headers.0.push((X_DELIVER_AT.to_owned(), due));
    headers
        .0
        .push((X_DELAYD_HANDOFF.to_owned(), Value::Bool(true)));
    headers.0.push((
        HANDOFF_ID.to_owned(),
        Value::LongString(uid.to_string().into_bytes()),
    ));
    if message.properties.delivery_mode != Some(2) {
        let mode = message.properties.delivery_mode.map_or(0, i64::from);
        headers.insert(SAVED_DELIVERY_MODE, Value::I64(mode));
        message.properties.delivery_mode = Some(2);
    }
}

/// If `message` is a hand-off copy, restore the original and return the due
/// time it carries. `None` for any other message (left untouched), and for
/// a marked one whose due time cannot be read (the route then plans it as
/// usual: from its own headers, never earlier than they say).
pub fn receive(message: &mut Message) -> Option<HandedOff> {
    message.headers.get(X_DELAYD_HANDOFF)?;
    let ours = message
        .headers
        .0
        .iter()
        .rposition(|(k, _)| k == X_DELIVER_AT)?;
    // Kafka carries header values as text.
    let due = match &message.headers.0[ours].1 {
        Value::I64(ms) => u64::try_from(*ms).ok()?,
        Value::LongString(text) => std::str::from_utf8(text).ok()?.trim().parse().ok()?,
        Value::ShortString(text) => text.trim().parse().ok()?,
        _ => return None,
    };
    let headers = &mut message.headers;
    headers.0.remove(ours);
    headers.remove(X_DELAYD_HANDOFF);
    let uid = headers
        .remove(HANDOFF_ID)
        .and_then(|v| v.as_text().and_then(|t| t.parse().ok()));
    if let Some((name, _)) = headers.0.iter_mut().find(|(k, _)| k == SAVED_DELIVER_AT) {
        *name = X_DELIVER_AT.to_owned();
    }
    match headers.remove(SAVED_DELIVERY_MODE) {
        Some(Value::I64(mode)) => {
            message.properties.delivery_mode = u8::try_from(mode).ok().filter(|m| *m != 0);
        }
        Some(_) => {
            // Text from Kafka, where there is no delivery mode to restore.
            message.properties.delivery_mode = None;
        }
        None => {}
    }
    Some(HandedOff { due_ms: due, uid })
}

#[cfg(test)]
mod tests {
    use super::*;
    use delayd_adapters::FieldTable;

    fn uid() -> MessageId {
        "8000000000000000000000000000002a".parse().unwrap()
    }

    fn original() -> Message {
        let mut m = Message::with_body(&b"body"[..]);
        m.headers = FieldTable(vec![
            ("x-delay".into(), Value::I32(5000)),
            ("app".into(), Value::LongString(b"v".to_vec())),
        ]);
        m.properties.delivery_mode = Some(1);
        m
    }

    #[test]
    fn a_handed_off_message_comes_back_byte_equal_with_its_due_time() {
        let with_own = {
            let mut m = original();
            m.headers
                .0
                .insert(0, (X_DELIVER_AT.into(), Value::I64(123)));
            m.properties.delivery_mode = None;
            m
        };
        for before in [original(), with_own] {
            let mut m = before.clone();
            prepare(&mut m, 1_700_000_000_123, uid());
            assert_eq!(m.properties.delivery_mode, Some(2));
            assert_eq!(
                m.headers.get(X_DELIVER_AT),
                Some(&Value::I64(1_700_000_000_123))
            );
            assert_eq!(
                receive(&mut m),
                Some(HandedOff {
                    due_ms: 1_700_000_000_123,
                    uid: Some(uid())
                })
            );
            assert_eq!(
                delayd_adapters::encode(&m),
                delayd_adapters::encode(&before)
            );
        }
    }

    #[test]
    fn a_copy_through_kafka_headers_keeps_its_due_time() {
        let mut m = original();
        m.properties.delivery_mode = None;
        prepare(&mut m, 42_000, uid());
        // What a Kafka round trip makes of the values.
        for (_, value) in m.headers.0.iter_mut() {
            if let Value::I64(n) = value {
                *value = Value::LongString(n.to_string().into_bytes());
            } else if let Value::Bool(b) = value {
                *value = Value::LongString(b.to_string().into_bytes());
            }
        }
        m.properties.delivery_mode = None;
        assert_eq!(
            receive(&mut m),
            Some(HandedOff {
                due_ms: 42_000,
                uid: Some(uid())
            })
        );
        assert!(m.headers.get(X_DELIVER_AT).is_none());
        assert!(m.headers.get(X_DELAYD_HANDOFF).is_none());
    }

    #[test]
    fn a_marked_message_without_a_readable_due_time_is_planned_as_usual() {
        let mut m = original();
        m.headers.insert(X_DELAYD_HANDOFF, Value::Bool(true));
        m.headers
            .insert(X_DELIVER_AT, Value::LongString(b"soon".to_vec()));
        let before = m.clone();
        assert_eq!(receive(&mut m), None);
        assert_eq!(
            delayd_adapters::encode(&m),
            delayd_adapters::encode(&before)
        );
    }

    #[test]
    fn other_messages_are_left_alone() {
        let mut m = original();
        m.headers.insert(X_DELIVER_AT, Value::I64(5));
        let before = m.clone();
        assert_eq!(receive(&mut m), None);
        assert_eq!(
            delayd_adapters::encode(&m),
            delayd_adapters::encode(&before)
        );
    }

    #[test]
    fn a_due_time_in_a_short_string_is_read() {
        let mut m = original();
        prepare(&mut m, 7_000, uid());
        let due = m
            .headers
            .0
            .iter_mut()
            .rev()
            .find(|(k, _)| k == X_DELIVER_AT)
            .expect("x-deliver-at");
        due.1 = Value::ShortString(" 7000 ".into());
        assert_eq!(receive(&mut m).map(|h| h.due_ms), Some(7_000));
        assert_eq!(m.properties.delivery_mode, Some(1));
        assert!(m.headers.get(X_DELIVER_AT).is_none());
    }

    #[test]
    fn a_persistent_message_needs_no_saved_mode() {
        let mut m = original();
        m.properties.delivery_mode = Some(2);
        let before = m.clone();
        prepare(&mut m, 1, uid());
        assert!(m.headers.get(SAVED_DELIVERY_MODE).is_none());
        assert_eq!(receive(&mut m).map(|h| h.due_ms), Some(1));
        assert_eq!(
            delayd_adapters::encode(&m),
            delayd_adapters::encode(&before)
        );
    }
}
