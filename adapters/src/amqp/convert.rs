//! Lossless conversion between lapin's wire types and delayd's broker-neutral
//! [`Message`] model.
//!
//! Every AMQP field-table type round-trips with its type intact (a `u8` stays
//! a `u8`, a long string stays a byte string even when it is not UTF-8, a
//! decimal keeps its scale). Two of our [`Value`] variants have no wire type
//! of their own in RabbitMQ's dialect and are mapped explicitly:
//!
//! * [`Value::ShortString`] is sent as a long string (`S`): RabbitMQ reads
//!   the spec's short-string tag `s` as a signed 16-bit integer, so a short
//!   string can never appear in a table it delivers.
//! * [`Value::U64`] is sent as a signed 64-bit integer (`l`), which is how
//!   RabbitMQ treats it; a value above `i64::MAX` cannot be represented and is
//!   refused with [`ConvertError::U64OutOfRange`].
//!
//! lapin keeps tables in a `BTreeMap`, so header order is not preserved
//! through lapin (RabbitMQ does not preserve it either); converting a lapin
//! table yields its keys in sorted order.
//!
//! Going from lapin to our model cannot fail. Going the other way fails only
//! when a value does not fit AMQP's limits (short strings and table keys are
//! at most 255 bytes), which the sink reports as a permanent error.

use lapin::types::{
    AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable as AmqpTable, LongString,
    ShortString,
};
use lapin::BasicProperties;

use crate::message::{FieldTable, Message, Properties, Value};

/// Why a [`Message`] cannot be expressed in AMQP 0-9-1.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConvertError {
    /// A short string (property, table key, exchange or routing key) is over 255 bytes.
    #[error("{what} is {len} bytes long; AMQP short strings hold at most 255")]
    TooLong { what: String, len: usize },
    /// A `u64` header value does not fit the signed 64-bit AMQP type.
    #[error("header value {0} does not fit AMQP's signed 64-bit integer")]
    U64OutOfRange(u64),
}

/// A short string, or [`ConvertError::TooLong`] naming `what` it was.
pub(crate) fn short_string(value: &str, what: &str) -> Result<ShortString, ConvertError> {
    ShortString::try_new(value).map_err(|_| ConvertError::TooLong {
        what: what.to_owned(),
        len: value.len(),
    })
}

// ---------------------------------------------------------------- lapin → ours

/// Converts a lapin value to ours, keeping its type.
pub fn value_from_amqp(value: &AMQPValue) -> Value {
    match value {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(v) => Value::I8(*v),
        AMQPValue::ShortShortUInt(v) => Value::U8(*v),
        AMQPValue::ShortInt(v) => Value::I16(*v),
        AMQPValue::ShortUInt(v) => Value::U16(*v),
        AMQPValue::LongInt(v) => Value::I32(*v),
        AMQPValue::LongUInt(v) => Value::U32(*v),
        AMQPValue::LongLongInt(v) => Value::I64(*v),
        AMQPValue::Float(v) => Value::F32(*v),
        AMQPValue::Double(v) => Value::F64(*v),
        AMQPValue::DecimalValue(d) => Value::Decimal {
            scale: d.scale,
            value: d.value,
        },
        AMQPValue::ShortString(s) => Value::ShortString(s.as_str().to_owned()),
        AMQPValue::LongString(s) => Value::LongString(s.as_bytes().to_vec()),
        AMQPValue::FieldArray(a) => {
            Value::Array(a.as_slice().iter().map(value_from_amqp).collect())
        }
        AMQPValue::Timestamp(t) => Value::Timestamp(*t),
        AMQPValue::FieldTable(t) => Value::Table(table_from_amqp(t)),
        AMQPValue::ByteArray(b) => Value::ByteArray(b.as_slice().to_vec()),
        AMQPValue::Void => Value::Void,
    }
}

/// Converts a lapin field table to ours (keys in lapin's sorted order).
pub fn table_from_amqp(table: &AmqpTable) -> FieldTable {
    FieldTable(
        table
            .inner()
            .iter()
            .map(|(k, v)| (k.as_str().to_owned(), value_from_amqp(v)))
            .collect(),
    )
}

fn opt_string(value: &Option<ShortString>) -> Option<String> {
    value.as_ref().map(|s| s.as_str().to_owned())
}

/// Splits lapin properties into our [`Properties`] and headers.
pub fn properties_from_amqp(props: &BasicProperties) -> (Properties, FieldTable) {
    let properties = Properties {
        content_type: opt_string(props.content_type()),
        content_encoding: opt_string(props.content_encoding()),
        delivery_mode: *props.delivery_mode(),
        priority: *props.priority(),
        correlation_id: opt_string(props.correlation_id()),
        reply_to: opt_string(props.reply_to()),
        expiration: opt_string(props.expiration()),
        message_id: opt_string(props.message_id()),
        timestamp: *props.timestamp(),
        kind: opt_string(props.kind()),
        user_id: opt_string(props.user_id()),
        app_id: opt_string(props.app_id()),
        cluster_id: opt_string(props.cluster_id()),
    };
    let headers = props
        .headers()
        .as_ref()
        .map(table_from_amqp)
        .unwrap_or_default();
    (properties, headers)
}

/// Headers a broker adds to a *delivery*, not to the message: a quorum
/// queue's counts of how often it handed the message out (RabbitMQ 4).
/// They differ between two deliveries of one message, so a redelivery kept
/// with them would not be recognised as one (it would be stored twice, under
/// two ids), and the target queue would get a count that is not its own.
pub const BROKER_DELIVERY_HEADERS: [&str; 2] = ["x-delivery-count", "x-acquired-count"];

/// Builds a [`Message`] from a consumed lapin delivery, taking its body
/// without copying, and without [`BROKER_DELIVERY_HEADERS`]. The exchange
/// it was published to becomes [`Message::source`].
pub fn message_from_delivery(delivery: &mut lapin::message::Delivery) -> Message {
    let (properties, mut headers) = properties_from_amqp(&delivery.properties);
    for header in BROKER_DELIVERY_HEADERS {
        headers.remove(header);
    }
    Message {
        body: std::mem::take(&mut delivery.data),
        headers,
        properties,
        source: delivery.exchange.as_str().to_owned(),
        routing_key: delivery.routing_key.as_str().to_owned(),
        key: None,
        partition: None,
        offset: None,
        timestamp_ms: None,
        null_value: false,
    }
}

// ---------------------------------------------------------------- ours → lapin

/// Converts one of our values to lapin's (see the module docs for the two
/// variants without a wire type of their own).
pub fn value_to_amqp(value: &Value) -> Result<AMQPValue, ConvertError> {
    Ok(match value {
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::I8(v) => AMQPValue::ShortShortInt(*v),
        Value::U8(v) => AMQPValue::ShortShortUInt(*v),
        Value::I16(v) => AMQPValue::ShortInt(*v),
        Value::U16(v) => AMQPValue::ShortUInt(*v),
        Value::I32(v) => AMQPValue::LongInt(*v),
        Value::U32(v) => AMQPValue::LongUInt(*v),
        Value::I64(v) => AMQPValue::LongLongInt(*v),
        Value::U64(v) => {
            AMQPValue::LongLongInt(i64::try_from(*v).map_err(|_| ConvertError::U64OutOfRange(*v))?)
        }
        Value::F32(v) => AMQPValue::Float(*v),
        Value::F64(v) => AMQPValue::Double(*v),
        Value::Decimal { scale, value } => AMQPValue::DecimalValue(DecimalValue {
            scale: *scale,
            value: *value,
        }),
        Value::ShortString(s) => AMQPValue::LongString(LongString::from(s.as_bytes())),
        Value::LongString(b) => AMQPValue::LongString(LongString::from(b.as_slice())),
        Value::Array(items) => AMQPValue::FieldArray(FieldArray::from(
            items
                .iter()
                .map(value_to_amqp)
                .collect::<Result<Vec<_>, _>>()?,
        )),
        Value::Timestamp(t) => AMQPValue::Timestamp(*t),
        Value::Table(t) => AMQPValue::FieldTable(table_to_amqp(t)?),
        Value::ByteArray(b) => AMQPValue::ByteArray(ByteArray::from(b.as_slice())),
        Value::Void => AMQPValue::Void,
    })
}

/// Converts our table to lapin's. A key that appears twice keeps its last value.
pub fn table_to_amqp(table: &FieldTable) -> Result<AmqpTable, ConvertError> {
    let mut out = AmqpTable::default();
    for (key, value) in table.iter() {
        out.insert(short_string(key, "header name")?, value_to_amqp(value)?);
    }
    Ok(out)
}

/// Builds lapin properties from ours plus the headers. An empty header table
/// is sent as no table at all.
pub fn properties_to_amqp(
    properties: &Properties,
    headers: &FieldTable,
) -> Result<BasicProperties, ConvertError> {
    fn set(
        props: BasicProperties,
        value: &Option<String>,
        what: &str,
        with: fn(BasicProperties, ShortString) -> BasicProperties,
    ) -> Result<BasicProperties, ConvertError> {
        Ok(match value {
            Some(v) => with(props, short_string(v, what)?),
            None => props,
        })
    }

    let p = properties;
    let mut props = BasicProperties::default();
    props = set(
        props,
        &p.content_type,
        "content_type",
        BasicProperties::with_content_type,
    )?;
    props = set(
        props,
        &p.content_encoding,
        "content_encoding",
        BasicProperties::with_content_encoding,
    )?;
    if let Some(mode) = p.delivery_mode {
        props = props.with_delivery_mode(mode);
    }
    if let Some(priority) = p.priority {
        props = props.with_priority(priority);
    }
    props = set(
        props,
        &p.correlation_id,
        "correlation_id",
        BasicProperties::with_correlation_id,
    )?;
    props = set(
        props,
        &p.reply_to,
        "reply_to",
        BasicProperties::with_reply_to,
    )?;
    props = set(
        props,
        &p.expiration,
        "expiration",
        BasicProperties::with_expiration,
    )?;
    props = set(
        props,
        &p.message_id,
        "message_id",
        BasicProperties::with_message_id,
    )?;
    if let Some(ts) = p.timestamp {
        props = props.with_timestamp(ts);
    }
    props = set(props, &p.kind, "type", BasicProperties::with_type)?;
    props = set(props, &p.user_id, "user_id", BasicProperties::with_user_id)?;
    props = set(props, &p.app_id, "app_id", BasicProperties::with_app_id)?;
    props = set(
        props,
        &p.cluster_id,
        "cluster_id",
        BasicProperties::with_cluster_id,
    )?;
    if !headers.is_empty() {
        props = props.with_headers(table_to_amqp(headers)?);
    }
    Ok(props)
}

/// The lapin properties to publish `message` with.
pub fn message_properties(message: &Message) -> Result<BasicProperties, ConvertError> {
    properties_to_amqp(&message.properties, &message.headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_value() -> Vec<(String, Value)> {
        let nested = FieldTable(vec![
            ("inner-i32".into(), Value::I32(-7)),
            (
                "inner-table".into(),
                Value::Table(FieldTable(vec![("deep".into(), Value::Bool(false))])),
            ),
        ]);
        vec![
            ("bool".into(), Value::Bool(true)),
            ("i8".into(), Value::I8(-8)),
            ("u8".into(), Value::U8(200)),
            ("i16".into(), Value::I16(-16_000)),
            ("u16".into(), Value::U16(60_000)),
            ("i32".into(), Value::I32(-2_000_000_000)),
            ("u32".into(), Value::U32(4_000_000_000)),
            ("i64".into(), Value::I64(i64::MIN)),
            ("f32".into(), Value::F32(1.5)),
            ("f64".into(), Value::F64(-2.25e300)),
            (
                "decimal".into(),
                Value::Decimal {
                    scale: 3,
                    value: 123_456,
                },
            ),
            (
                "long-utf8".into(),
                Value::LongString("héllo".as_bytes().to_vec()),
            ),
            (
                "long-binary".into(),
                Value::LongString(vec![0xff, 0x00, 0xc3, 0x28]),
            ),
            (
                "array".into(),
                Value::Array(vec![
                    Value::I32(1),
                    Value::LongString(b"two".to_vec()),
                    Value::Array(vec![Value::Void]),
                    Value::Table(nested.clone()),
                ]),
            ),
            ("timestamp".into(), Value::Timestamp(1_700_000_000)),
            ("table".into(), Value::Table(nested)),
            ("bytes".into(), Value::ByteArray(vec![1, 2, 3, 0xfe])),
            ("void".into(), Value::Void),
            ("empty-array".into(), Value::Array(vec![])),
            ("empty-table".into(), Value::Table(FieldTable::new())),
        ]
    }

    fn sorted(mut table: FieldTable) -> FieldTable {
        table.0.sort_by(|a, b| a.0.cmp(&b.0));
        for (_, v) in &mut table.0 {
            if let Value::Table(t) = v {
                *t = sorted(std::mem::take(t));
            }
        }
        table
    }

    #[test]
    fn every_value_type_round_trips() {
        for (name, value) in every_value() {
            let amqp = value_to_amqp(&value).unwrap();
            let back = value_from_amqp(&amqp);
            // Nested tables come back in sorted key order.
            let expected = match value {
                Value::Table(t) => Value::Table(sorted(t)),
                Value::Array(items) => Value::Array(
                    items
                        .into_iter()
                        .map(|v| match v {
                            Value::Table(t) => Value::Table(sorted(t)),
                            v => v,
                        })
                        .collect(),
                ),
                v => v,
            };
            assert_eq!(back, expected, "{name}");
        }
    }

    #[test]
    fn value_types_map_to_the_matching_amqp_types() {
        assert_eq!(
            value_to_amqp(&Value::U8(1)).unwrap(),
            AMQPValue::ShortShortUInt(1)
        );
        assert_eq!(
            value_to_amqp(&Value::I16(1)).unwrap(),
            AMQPValue::ShortInt(1)
        );
        assert_eq!(
            value_to_amqp(&Value::U32(1)).unwrap(),
            AMQPValue::LongUInt(1)
        );
        assert_eq!(
            value_to_amqp(&Value::Timestamp(5)).unwrap(),
            AMQPValue::Timestamp(5)
        );
        assert_eq!(
            value_to_amqp(&Value::ByteArray(vec![9])).unwrap(),
            AMQPValue::ByteArray(ByteArray::from(vec![9]))
        );
    }

    #[test]
    fn whole_table_round_trips_in_sorted_order() {
        let table = FieldTable(every_value());
        let amqp = table_to_amqp(&table).unwrap();
        assert_eq!(table_from_amqp(&amqp), sorted(table));
    }

    #[test]
    fn short_string_goes_out_as_long_string() {
        let amqp = value_to_amqp(&Value::ShortString("abc".into())).unwrap();
        assert_eq!(amqp, AMQPValue::LongString("abc".into()));
        assert_eq!(value_from_amqp(&amqp), Value::LongString(b"abc".to_vec()));
        // A short string lapin hands us (never from RabbitMQ) keeps its type.
        assert_eq!(
            value_from_amqp(&AMQPValue::ShortString("x".into())),
            Value::ShortString("x".into())
        );
    }

    #[test]
    fn u64_fits_or_is_refused() {
        assert_eq!(
            value_to_amqp(&Value::U64(42)).unwrap(),
            AMQPValue::LongLongInt(42)
        );
        assert_eq!(
            value_to_amqp(&Value::U64(u64::MAX)),
            Err(ConvertError::U64OutOfRange(u64::MAX))
        );
    }

    #[test]
    fn long_keys_and_properties_are_refused() {
        let long = "k".repeat(256);
        let table = FieldTable(vec![(long.clone(), Value::Void)]);
        assert!(matches!(
            table_to_amqp(&table),
            Err(ConvertError::TooLong { .. })
        ));
        let props = Properties {
            message_id: Some(long),
            ..Properties::default()
        };
        let err = properties_to_amqp(&props, &FieldTable::new()).unwrap_err();
        assert_eq!(
            err,
            ConvertError::TooLong {
                what: "message_id".into(),
                len: 256
            }
        );
    }

    fn all_properties() -> Properties {
        Properties {
            content_type: Some("application/json".into()),
            content_encoding: Some("gzip".into()),
            delivery_mode: Some(2),
            priority: Some(7),
            correlation_id: Some("corr-1".into()),
            reply_to: Some("replies".into()),
            expiration: Some("60000".into()),
            message_id: Some("msg-1".into()),
            timestamp: Some(1_700_000_123),
            kind: Some("order.created".into()),
            user_id: Some("guest".into()),
            app_id: Some("shop".into()),
            cluster_id: Some("c1".into()),
        }
    }

    #[test]
    fn every_property_round_trips() {
        let headers = FieldTable(every_value());
        let amqp = properties_to_amqp(&all_properties(), &headers).unwrap();
        let (props, back) = properties_from_amqp(&amqp);
        assert_eq!(props, all_properties());
        assert_eq!(back, sorted(headers));
    }

    #[test]
    fn absent_properties_stay_absent() {
        let amqp = properties_to_amqp(&Properties::default(), &FieldTable::new()).unwrap();
        assert_eq!(amqp, BasicProperties::default());
        let (props, headers) = properties_from_amqp(&BasicProperties::default());
        assert_eq!(props, Properties::default());
        assert!(headers.is_empty());
    }

    #[test]
    fn delivery_becomes_message() {
        let mut delivery = lapin::message::Delivery::mock(
            1,
            "orders.delayed".into(),
            "eu.created".into(),
            true,
            b"payload".to_vec(),
        );
        delivery.properties = properties_to_amqp(
            &all_properties(),
            &FieldTable(vec![("x-delay".into(), Value::I32(5000))]),
        )
        .unwrap();
        let message = message_from_delivery(&mut delivery);
        assert_eq!(message.body, b"payload");
        assert_eq!(message.source, "orders.delayed");
        assert_eq!(message.routing_key, "eu.created");
        assert_eq!(message.properties, all_properties());
        assert_eq!(message.headers.get("x-delay"), Some(&Value::I32(5000)));
        assert_eq!(message.key, None);
        let again = message_properties(&message).unwrap();
        assert_eq!(again, delivery.properties);
    }

    /// A quorum queue's redelivery carries counts the first delivery did
    /// not: without them, both give the same message (so a redelivery is
    /// recognised, and the target gets the bytes the producer sent).
    #[test]
    fn broker_delivery_counts_are_not_part_of_the_message() {
        let deliver = |headers: Vec<(String, Value)>| {
            let mut delivery = lapin::message::Delivery::mock(
                1,
                "orders.delayed".into(),
                "k".into(),
                true,
                b"payload".to_vec(),
            );
            delivery.properties =
                properties_to_amqp(&all_properties(), &FieldTable(headers)).unwrap();
            message_from_delivery(&mut delivery)
        };
        let delay = ("x-delay".to_owned(), Value::I32(5000));
        let first = deliver(vec![delay.clone()]);
        let again = deliver(vec![
            delay,
            ("x-acquired-count".into(), Value::I64(2)),
            ("x-delivery-count".into(), Value::I64(1)),
        ]);
        assert_eq!(first, again);
        assert_eq!(again.headers.len(), 1);
    }
}
