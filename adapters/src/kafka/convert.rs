//! Kafka record ⇄ [`Message`].
//!
//! In: the value becomes the body (a null value sets [`Message::null_value`]),
//! the key, partition and timestamp are kept, and every header becomes a
//! [`Value::LongString`] of its bytes ([`Value::Void`] for a null header), in
//! record order, duplicates included ([`FieldTable::get`] reads the last one,
//! as Java's `Headers.lastHeader()` does).
//!
//! Out: a header's [`Value`] is written as bytes. Byte strings go as they are,
//! so a record that came from Kafka leaves with the same bytes. Typed AMQP
//! values (from a RabbitMQ → Kafka route) are written as text: integers and
//! floats in decimal, booleans as `true`/`false`, timestamps as epoch seconds,
//! decimals as `value`e-`scale`, arrays and tables as JSON, void as a null
//! header.

use rdkafka::message::{Header, Headers, OwnedHeaders};
use rdkafka::Message as _;

use crate::message::{FieldTable, Message, Value};

/// A consumed record as a [`Message`]; `topic` is kept as its source.
pub fn message_from_record(record: &rdkafka::message::BorrowedMessage<'_>) -> Message {
    let mut headers = FieldTable::new();
    if let Some(h) = record.headers() {
        for header in h.iter() {
            let value = match header.value {
                Some(bytes) => Value::LongString(bytes.to_vec()),
                None => Value::Void,
            };
            // Kafka allows repeated names; keep every one, in order.
            headers.0.push((header.key.to_owned(), value));
        }
    }
    Message {
        body: record.payload().map(<[u8]>::to_vec).unwrap_or_default(),
        headers,
        source: record.topic().to_owned(),
        key: record.key().map(<[u8]>::to_vec),
        partition: Some(record.partition()),
        offset: Some(record.offset()),
        timestamp_ms: record.timestamp().to_millis(),
        null_value: record.payload().is_none(),
        ..Message::default()
    }
}

/// The record headers for a message.
pub fn record_headers(message: &Message) -> OwnedHeaders {
    let mut out = OwnedHeaders::new_with_capacity(message.headers.len());
    for (name, value) in message.headers.iter() {
        let bytes = header_bytes(value);
        out = out.insert(Header {
            key: name,
            value: bytes.as_deref(),
        });
    }
    out
}

/// A header value as Kafka bytes (`None` is a null header).
pub fn header_bytes(value: &Value) -> Option<Vec<u8>> {
    Some(match value {
        Value::LongString(b) | Value::ByteArray(b) => b.clone(),
        Value::ShortString(s) => s.as_bytes().to_vec(),
        Value::Void => return None,
        other => text(other).into_bytes(),
    })
}

/// Text for a typed value; arrays and tables as JSON ([`Value::to_json`]).
fn text(value: &Value) -> String {
    match value {
        Value::Bool(b) => b.to_string(),
        Value::I8(n) => n.to_string(),
        Value::U8(n) => n.to_string(),
        Value::I16(n) => n.to_string(),
        Value::U16(n) => n.to_string(),
        Value::I32(n) => n.to_string(),
        Value::U32(n) => n.to_string(),
        Value::I64(n) => n.to_string(),
        Value::U64(n) => n.to_string(),
        Value::F32(n) => n.to_string(),
        Value::F64(n) => n.to_string(),
        Value::Decimal { scale, value } => format!("{value}e-{scale}"),
        Value::Timestamp(secs) => secs.to_string(),
        Value::ShortString(s) => s.clone(),
        Value::LongString(b) | Value::ByteArray(b) => String::from_utf8_lossy(b).into_owned(),
        Value::Void => String::new(),
        Value::Array(_) | Value::Table(_) => value.to_json().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_pass_through_and_types_become_text() {
        assert_eq!(
            header_bytes(&Value::LongString(vec![0, 255])),
            Some(vec![0, 255])
        );
        assert_eq!(header_bytes(&Value::Void), None);
        assert_eq!(header_bytes(&Value::I32(-5000)), Some(b"-5000".to_vec()));
        assert_eq!(header_bytes(&Value::Bool(true)), Some(b"true".to_vec()));
        assert_eq!(
            header_bytes(&Value::Decimal {
                scale: 2,
                value: 1234
            }),
            Some(b"1234e-2".to_vec())
        );
    }

    #[test]
    fn nested_values_become_json() {
        let table = Value::Table(FieldTable(vec![
            ("a".into(), Value::I64(1)),
            ("b\"".into(), Value::LongString(b"x\ny".to_vec())),
            (
                "c".into(),
                Value::Array(vec![Value::Void, Value::Bool(false)]),
            ),
        ]));
        assert_eq!(
            header_bytes(&table).unwrap(),
            br#"{"a":1,"b\"":"x\ny","c":[null,false]}"#.to_vec()
        );
    }
}
