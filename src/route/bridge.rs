//! Cross-broker routes: how a message from RabbitMQ becomes a Kafka record
//! and back. Applied only when a route's source and target differ in kind.
//!
//! RabbitMQ → Kafka:
//! * key: the AMQP `message_id` when set, else the routing key when not
//!   empty, else none (records are then spread over partitions);
//! * each basic property set becomes a header `amqp.<property>` (text);
//! * typed AMQP headers are written as text by the Kafka adapter (numbers in
//!   decimal, booleans `true`/`false`, tables and arrays as JSON).
//!
//! Kafka → RabbitMQ:
//! * routing key: `to.routing_key` when set, else the Kafka key when it is
//!   UTF-8 of at most 255 bytes, else empty;
//! * `amqp.<property>` headers become basic properties again (removed from
//!   the headers); other headers stay, as byte strings;
//! * `delivery_mode` defaults to 2 (persistent) when not given.

use delayd_adapters::{Message, Properties, Value};

const PREFIX: &str = "amqp.";
const PERSISTENT: u8 = 2;

pub fn amqp_to_kafka(m: &mut Message) {
    if m.key.is_none() {
        m.key = m
            .properties
            .message_id
            .clone()
            .or_else(|| (!m.routing_key.is_empty()).then(|| m.routing_key.clone()))
            .map(String::into_bytes);
    }
    let p = std::mem::take(&mut m.properties);
    let mut put = |name: &str, value: Option<String>| {
        if let Some(v) = value {
            m.headers
                .0
                .push((format!("{PREFIX}{name}"), Value::LongString(v.into_bytes())));
        }
    };
    put("content_type", p.content_type);
    put("content_encoding", p.content_encoding);
    put("delivery_mode", p.delivery_mode.map(|v| v.to_string()));
    put("priority", p.priority.map(|v| v.to_string()));
    put("correlation_id", p.correlation_id);
    put("reply_to", p.reply_to);
    put("expiration", p.expiration);
    put("message_id", p.message_id);
    put("timestamp", p.timestamp.map(|v| v.to_string()));
    put("type", p.kind);
    put("user_id", p.user_id);
    put("app_id", p.app_id);
    put("cluster_id", p.cluster_id);
}

pub fn kafka_to_amqp(m: &mut Message) {
    if m.routing_key.is_empty() {
        if let Some(key) = m.key.as_deref() {
            if key.len() <= 255 {
                if let Ok(text) = std::str::from_utf8(key) {
                    m.routing_key = text.to_owned();
                }
            }
        }
    }
    let mut p = Properties::default();
    m.headers.0.retain(|(name, value)| {
        let Some(prop) = name.strip_prefix(PREFIX) else {
            return true;
        };
        let Some(text) = value.as_text() else {
            return true;
        };
        !set_property(&mut p, prop, text)
    });
    if p.delivery_mode.is_none() {
        p.delivery_mode = Some(PERSISTENT);
    }
    m.properties = p;
}

/// Sets the property named `name`; false (header kept) if unknown or unparsable.
fn set_property(p: &mut Properties, name: &str, text: &str) -> bool {
    let s = || Some(text.to_owned());
    match name {
        "content_type" => p.content_type = s(),
        "content_encoding" => p.content_encoding = s(),
        "correlation_id" => p.correlation_id = s(),
        "reply_to" => p.reply_to = s(),
        "expiration" => p.expiration = s(),
        "message_id" => p.message_id = s(),
        "type" => p.kind = s(),
        "user_id" => p.user_id = s(),
        "app_id" => p.app_id = s(),
        "cluster_id" => p.cluster_id = s(),
        "delivery_mode" => match text.parse() {
            Ok(v) => p.delivery_mode = Some(v),
            Err(_) => return false,
        },
        "priority" => match text.parse() {
            Ok(v) => p.priority = Some(v),
            Err(_) => return false,
        },
        "timestamp" => match text.parse() {
            Ok(v) => p.timestamp = Some(v),
            Err(_) => return false,
        },
        _ => return false,
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn amqp_message() -> Message {
        let mut m = Message::with_body(&b"{}"[..]);
        m.routing_key = "order.created".into();
        m.properties = Properties {
            content_type: Some("application/json".into()),
            delivery_mode: Some(2),
            priority: Some(5),
            message_id: Some("order-42".into()),
            timestamp: Some(1_700_000_000),
            kind: Some("created".into()),
            ..Properties::default()
        };
        m.headers
            .insert("x-tenant", Value::LongString(b"acme".to_vec()));
        m
    }

    #[test]
    fn amqp_round_trips_through_kafka() {
        let original = amqp_message();
        let mut m = original.clone();
        amqp_to_kafka(&mut m);
        assert_eq!(m.key.as_deref(), Some(&b"order-42"[..]));
        assert_eq!(m.properties, Properties::default());
        assert_eq!(
            m.headers.get("amqp.priority").and_then(Value::as_text),
            Some("5")
        );
        // The Kafka leg drops the routing key; it comes back from the key.
        m.routing_key.clear();
        kafka_to_amqp(&mut m);
        assert_eq!(m.properties, original.properties);
        assert_eq!(m.headers, original.headers);
        assert_eq!(m.routing_key, "order-42");
    }

    #[test]
    fn routing_key_is_the_kafka_key_without_a_message_id() {
        let mut m = amqp_message();
        m.properties.message_id = None;
        amqp_to_kafka(&mut m);
        assert_eq!(m.key.as_deref(), Some(&b"order.created"[..]));
    }

    #[test]
    fn kafka_records_become_persistent_amqp_messages() {
        let mut m = Message::with_body(&b"v"[..]);
        m.key = Some(vec![0xff, 0xfe]);
        m.headers
            .insert("amqp.priority", Value::LongString(b"high".to_vec()));
        kafka_to_amqp(&mut m);
        assert_eq!(m.routing_key, "", "a non-UTF-8 key is not a routing key");
        assert_eq!(m.properties.delivery_mode, Some(2));
        assert!(
            m.headers.get("amqp.priority").is_some(),
            "an unparsable property stays a header"
        );
    }

    #[test]
    fn every_property_round_trips_through_kafka_headers() {
        let properties = Properties {
            content_type: Some("text/plain".into()),
            content_encoding: Some("gzip".into()),
            delivery_mode: Some(1),
            priority: Some(9),
            correlation_id: Some("corr".into()),
            reply_to: Some("replies".into()),
            expiration: Some("60000".into()),
            message_id: Some("id-1".into()),
            timestamp: Some(1_700_000_001),
            kind: Some("kind".into()),
            user_id: Some("guest".into()),
            app_id: Some("app".into()),
            cluster_id: Some("cluster".into()),
        };
        let mut m = Message::with_body(&b"x"[..]);
        m.properties = properties.clone();
        amqp_to_kafka(&mut m);
        assert_eq!(m.headers.len(), 13);
        assert_eq!(
            m.headers.get("amqp.reply_to").and_then(Value::as_text),
            Some("replies")
        );
        kafka_to_amqp(&mut m);
        assert_eq!(m.properties, properties);
        assert!(m.headers.0.is_empty(), "{:?}", m.headers);
    }

    #[test]
    fn without_message_id_or_routing_key_a_record_has_no_key() {
        let mut m = Message::with_body(&b"x"[..]);
        amqp_to_kafka(&mut m);
        assert_eq!(m.key, None);
        // A key already set is kept.
        let mut keyed = amqp_message();
        keyed.key = Some(b"mine".to_vec());
        amqp_to_kafka(&mut keyed);
        assert_eq!(keyed.key.as_deref(), Some(&b"mine"[..]));
    }

    #[test]
    fn a_kafka_key_of_at_most_255_bytes_is_the_routing_key() {
        for (len, routed) in [(255, true), (256, false)] {
            let mut m = Message::with_body(&b"v"[..]);
            m.key = Some(vec![b'k'; len]);
            kafka_to_amqp(&mut m);
            assert_eq!(m.routing_key.len(), if routed { len } else { 0 }, "{len}");
        }
        // A routing key set by the route wins over the record's key.
        let mut m = Message::with_body(&b"v"[..]);
        m.key = Some(b"key".to_vec());
        m.routing_key = "set".into();
        kafka_to_amqp(&mut m);
        assert_eq!(m.routing_key, "set");
    }
}
