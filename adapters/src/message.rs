//! The broker-neutral message: what delayd stores and republishes.
//!
//! It mirrors the AMQP 0-9-1 content model (every field-table value type, all
//! basic properties) and also carries the Kafka record parts (key, partition,
//! timestamp). Header order is kept as received so that a republished message
//! is the same, field for field, as the one that came in.

/// A typed header value: every AMQP 0-9-1 field type RabbitMQ understands.
/// Kafka header values are byte strings and map to [`Value::LongString`].
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Bool(bool),
    I8(i8),
    U8(u8),
    I16(i16),
    U16(u16),
    I32(i32),
    U32(u32),
    I64(i64),
    /// AMQP has no unsigned 64-bit table type in RabbitMQ's dialect, but lapin does.
    U64(u64),
    F32(f32),
    F64(f64),
    Decimal {
        scale: u8,
        value: u32,
    },
    ShortString(String),
    /// AMQP long strings are byte strings: they need not be UTF-8.
    LongString(Vec<u8>),
    Array(Vec<Value>),
    /// Seconds since the Unix epoch (AMQP timestamp).
    Timestamp(u64),
    Table(FieldTable),
    ByteArray(Vec<u8>),
    Void,
}

impl Value {
    /// The value as JSON, the one rendering of a header value wherever one
    /// is shown as JSON (the admin API, a Kafka header holding an array or a
    /// table): numbers and booleans as such, text as strings, bytes that are
    /// not UTF-8 as `{"hex": ...}`, a decimal as `{"scale", "value"}`, a
    /// timestamp as its epoch seconds, void as null.
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        match self {
            Value::Bool(b) => J::from(*b),
            Value::I8(x) => J::from(*x),
            Value::U8(x) => J::from(*x),
            Value::I16(x) => J::from(*x),
            Value::U16(x) => J::from(*x),
            Value::I32(x) => J::from(*x),
            Value::U32(x) => J::from(*x),
            Value::I64(x) => J::from(*x),
            Value::U64(x) => J::from(*x),
            Value::F32(x) => J::from(*x),
            Value::F64(x) => J::from(*x),
            Value::Decimal { scale, value } => {
                let mut o = serde_json::Map::new();
                o.insert("scale".into(), J::from(*scale));
                o.insert("value".into(), J::from(*value));
                J::Object(o)
            }
            Value::ShortString(s) => J::from(s.as_str()),
            Value::LongString(b) | Value::ByteArray(b) => match std::str::from_utf8(b) {
                Ok(s) => J::from(s),
                Err(_) => {
                    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
                    let mut o = serde_json::Map::new();
                    o.insert("hex".into(), J::from(hex));
                    J::Object(o)
                }
            },
            Value::Array(items) => J::Array(items.iter().map(Value::to_json).collect()),
            Value::Timestamp(t) => J::from(*t),
            Value::Table(t) => t.to_json(),
            Value::Void => J::Null,
        }
    }

    /// The value as UTF-8 text, for string-like values.
    pub fn as_text(&self) -> Option<&str> {
        match self {
            Value::ShortString(s) => Some(s),
            Value::LongString(b) | Value::ByteArray(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }
}

/// An ordered field table: header order is preserved on the way through.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FieldTable(pub Vec<(String, Value)>);

impl FieldTable {
    pub fn new() -> Self {
        Self(Vec::new())
    }

    /// The table as a JSON object (see [`Value::to_json`]); a repeated name
    /// keeps its last value.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::Value::Object(
            self.0
                .iter()
                .map(|(k, v)| (k.clone(), v.to_json()))
                .collect(),
        )
    }

    /// The value of `key`. Kafka allows a name more than once: the last one
    /// wins, as Java's `Headers.lastHeader()` reads it.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.0.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Replace the value [`get`](Self::get) reads in place (keeping its
    /// position), or append it.
    pub fn insert(&mut self, key: impl Into<String>, value: Value) {
        let key = key.into();
        match self.0.iter_mut().rev().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => self.0.push((key, value)),
        }
    }

    /// Remove every value of `key`; returns the one [`get`](Self::get) read.
    pub fn remove(&mut self, key: &str) -> Option<Value> {
        let index = self.0.iter().rposition(|(k, _)| k == key)?;
        let last = self.0.remove(index).1;
        self.0.retain(|(k, _)| k != key);
        Some(last)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }
}

/// AMQP basic properties (all optional). Headers live in [`Message::headers`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Properties {
    pub content_type: Option<String>,
    pub content_encoding: Option<String>,
    pub delivery_mode: Option<u8>,
    pub priority: Option<u8>,
    pub correlation_id: Option<String>,
    pub reply_to: Option<String>,
    pub expiration: Option<String>,
    pub message_id: Option<String>,
    pub timestamp: Option<u64>,
    pub kind: Option<String>,
    pub user_id: Option<String>,
    pub app_id: Option<String>,
    pub cluster_id: Option<String>,
}

/// A message as delayd stores it and republishes it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Message {
    pub body: Vec<u8>,
    pub headers: FieldTable,
    pub properties: Properties,
    /// Where it came from: the AMQP exchange, or the Kafka topic.
    pub source: String,
    /// The AMQP routing key it was published with (empty for Kafka).
    pub routing_key: String,
    /// Kafka record key (or `None`).
    pub key: Option<Vec<u8>>,
    /// Kafka partition it was read from.
    pub partition: Option<i32>,
    /// Kafka offset it was read from. With `source` (the topic) and
    /// `partition` it names the record exactly, so two records with equal
    /// content are never mistaken for a redelivery of one another. Never
    /// republished.
    pub offset: Option<i64>,
    /// Kafka record timestamp, epoch ms.
    pub timestamp_ms: Option<i64>,
    /// Kafka: the record's value is null (a tombstone), not merely empty.
    /// `body` is then empty.
    pub null_value: bool,
}

impl Message {
    /// What the message can be cancelled by: the Kafka key when set, else the
    /// AMQP `message_id` (see [`crate::codec::lookup_key`]).
    pub fn lookup_key(&self) -> Option<&[u8]> {
        self.key
            .as_deref()
            .or(self.properties.message_id.as_deref().map(str::as_bytes))
    }

    /// A message with just a body, for tests and the load generator.
    pub fn with_body(body: impl Into<Vec<u8>>) -> Self {
        Self {
            body: body.into(),
            ..Self::default()
        }
    }
}
