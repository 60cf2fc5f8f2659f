//! Compact, versioned binary encoding of a [`Message`], used as the payload of
//! a WAL `Schedule` record. It keeps every value's AMQP type, so a message
//! decodes to exactly what was encoded.
//!
//! Layout (all integers little-endian, `bytes` = u32 length + bytes,
//! `opt` = one byte 0/1 then the value):
//! `version:u8=2 | flags:u8 | [offset:i64 when flag bit 1] | source:bytes |
//!  routing_key:bytes | key:opt bytes |
//!  partition:opt i32 | timestamp_ms:opt i64 | 13 properties (opt each) |
//!  headers:table | body:bytes`, where a table is `count:u32` then
//! `name:bytes, value` pairs and a value is a one-byte tag then its data.
//! Flags: bit 0 = the Kafka value is null; bit 1 = a Kafka offset follows
//! (records written before it existed have no offset). Version 1 (no flags
//! byte) is still read, so a WAL written by an older delayd recovers.

use crate::message::{FieldTable, Message, Properties, Value};

const VERSION: u8 = 2;
const FLAG_NULL_VALUE: u8 = 1;
const FLAG_OFFSET: u8 = 2;
/// Nesting deeper than this is refused rather than risking the stack.
const MAX_DEPTH: usize = 64;

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum CodecError {
    #[error("encoded message ends early")]
    Truncated,
    #[error("unknown encoding version {0}")]
    Version(u8),
    #[error("unknown value tag {0}")]
    Tag(u8),
    #[error("string is not UTF-8")]
    Utf8,
    #[error("headers nested deeper than {MAX_DEPTH}")]
    TooDeep,
    #[error("{0} trailing bytes after message")]
    Trailing(usize),
}

pub fn encode(message: &Message) -> Vec<u8> {
    let mut out = Vec::with_capacity(message.body.len() + 128);
    out.push(VERSION);
    let mut flags = 0;
    if message.null_value {
        flags |= FLAG_NULL_VALUE;
    }
    if message.offset.is_some() {
        flags |= FLAG_OFFSET;
    }
    out.push(flags);
    if let Some(offset) = message.offset {
        out.extend_from_slice(&offset.to_le_bytes());
    }
    put_bytes(&mut out, message.source.as_bytes());
    put_bytes(&mut out, message.routing_key.as_bytes());
    put_opt(&mut out, message.key.as_deref(), put_bytes);
    put_opt(&mut out, message.partition, |o, p| {
        o.extend_from_slice(&p.to_le_bytes())
    });
    put_opt(&mut out, message.timestamp_ms, |o, t| {
        o.extend_from_slice(&t.to_le_bytes())
    });
    put_properties(&mut out, &message.properties);
    put_table(&mut out, &message.headers);
    put_bytes(&mut out, &message.body);
    out
}

/// Whether [`decode`] will read `headers` back: it refuses containers
/// (arrays, tables) nested deeper than [`MAX_DEPTH`]. Check this before
/// storing a message, since [`encode`] writes any depth.
pub fn check_nesting(headers: &FieldTable) -> Result<(), CodecError> {
    fn value(v: &Value, depth: usize) -> Result<(), CodecError> {
        match v {
            Value::Array(items) => nested(items.iter(), depth),
            Value::Table(t) => nested(t.0.iter().map(|(_, v)| v), depth),
            _ => Ok(()),
        }
    }
    // Same rule as `Reader::value`: a container at `depth` needs `depth < MAX_DEPTH`.
    fn nested<'a>(
        mut children: impl Iterator<Item = &'a Value>,
        depth: usize,
    ) -> Result<(), CodecError> {
        if depth >= MAX_DEPTH {
            return Err(CodecError::TooDeep);
        }
        children.try_for_each(|c| value(c, depth + 1))
    }
    headers.0.iter().try_for_each(|(_, v)| value(v, 0))
}

pub fn decode(bytes: &[u8]) -> Result<Message, CodecError> {
    let mut r = Reader { buf: bytes };
    let version = r.u8()?;
    let flags = match version {
        1 => 0,
        VERSION => r.u8()?,
        other => return Err(CodecError::Version(other)),
    };
    let offset = match flags & FLAG_OFFSET {
        0 => None,
        _ => Some(i64::from_le_bytes(r.array()?)),
    };
    let source = r.string()?;
    let routing_key = r.string()?;
    let key = r.opt(|r| r.bytes().map(<[u8]>::to_vec))?;
    let partition = r.opt(|r| Ok(i32::from_le_bytes(r.array()?)))?;
    let timestamp_ms = r.opt(|r| Ok(i64::from_le_bytes(r.array()?)))?;
    let properties = r.properties()?;
    let headers = r.table(0)?;
    let body = r.bytes()?.to_vec();
    if !r.buf.is_empty() {
        return Err(CodecError::Trailing(r.buf.len()));
    }
    Ok(Message {
        body,
        headers,
        properties,
        source,
        routing_key,
        key,
        partition,
        offset,
        timestamp_ms,
        null_value: flags & FLAG_NULL_VALUE != 0,
    })
}

/// The message's lookup key straight from its encoding, without decoding the
/// rest: the Kafka record key when it has one, else the AMQP `message_id`
/// property. `None` when it has neither (or the bytes are malformed). The
/// engine indexes pending messages by it so they can be cancelled by key.
pub fn lookup_key(bytes: &[u8]) -> Option<&[u8]> {
    let mut r = Reader { buf: bytes };
    match r.u8().ok()? {
        1 => {}
        VERSION => {
            if r.u8().ok()? & FLAG_OFFSET != 0 {
                r.take(8).ok()?;
            }
        }
        _ => return None,
    }
    r.bytes().ok()?; // source
    r.bytes().ok()?; // routing key
    if let Some(key) = r.opt(|r| r.bytes()).ok()? {
        return Some(key);
    }
    r.opt(|r| r.take(4)).ok()?; // partition
    r.opt(|r| r.take(8)).ok()?; // timestamp
    for _ in 0..2 {
        r.opt(|r| r.bytes()).ok()?; // content type, content encoding
    }
    for _ in 0..2 {
        r.opt(|r| r.take(1)).ok()?; // delivery mode, priority
    }
    for _ in 0..3 {
        r.opt(|r| r.bytes()).ok()?; // correlation id, reply to, expiration
    }
    r.opt(|r| r.bytes()).ok()?
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

fn put_opt<T>(out: &mut Vec<u8>, v: Option<T>, f: impl FnOnce(&mut Vec<u8>, T)) {
    match v {
        None => out.push(0),
        Some(v) => {
            out.push(1);
            f(out, v);
        }
    }
}

fn put_str_opt(out: &mut Vec<u8>, v: &Option<String>) {
    put_opt(out, v.as_deref(), |o, s| put_bytes(o, s.as_bytes()));
}

fn put_properties(out: &mut Vec<u8>, p: &Properties) {
    put_str_opt(out, &p.content_type);
    put_str_opt(out, &p.content_encoding);
    put_opt(out, p.delivery_mode, |o, v| o.push(v));
    put_opt(out, p.priority, |o, v| o.push(v));
    put_str_opt(out, &p.correlation_id);
    put_str_opt(out, &p.reply_to);
    put_str_opt(out, &p.expiration);
    put_str_opt(out, &p.message_id);
    put_opt(out, p.timestamp, |o, v| {
        o.extend_from_slice(&v.to_le_bytes())
    });
    put_str_opt(out, &p.kind);
    put_str_opt(out, &p.user_id);
    put_str_opt(out, &p.app_id);
    put_str_opt(out, &p.cluster_id);
}

fn put_table(out: &mut Vec<u8>, t: &FieldTable) {
    out.extend_from_slice(&(t.0.len() as u32).to_le_bytes());
    for (k, v) in &t.0 {
        put_bytes(out, k.as_bytes());
        put_value(out, v);
    }
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::Bool(b) => out.extend_from_slice(&[b't', *b as u8]),
        Value::I8(x) => out.extend_from_slice(&[b'b', *x as u8]),
        Value::U8(x) => out.extend_from_slice(&[b'B', *x]),
        Value::I16(x) => {
            out.push(b's');
            out.extend_from_slice(&x.to_le_bytes())
        }
        Value::U16(x) => {
            out.push(b'u');
            out.extend_from_slice(&x.to_le_bytes())
        }
        Value::I32(x) => {
            out.push(b'I');
            out.extend_from_slice(&x.to_le_bytes())
        }
        Value::U32(x) => {
            out.push(b'i');
            out.extend_from_slice(&x.to_le_bytes())
        }
        Value::I64(x) => {
            out.push(b'l');
            out.extend_from_slice(&x.to_le_bytes())
        }
        Value::U64(x) => {
            out.push(b'L');
            out.extend_from_slice(&x.to_le_bytes())
        }
        Value::F32(x) => {
            out.push(b'f');
            out.extend_from_slice(&x.to_bits().to_le_bytes())
        }
        Value::F64(x) => {
            out.push(b'd');
            out.extend_from_slice(&x.to_bits().to_le_bytes())
        }
        Value::Decimal { scale, value } => {
            out.extend_from_slice(&[b'D', *scale]);
            out.extend_from_slice(&value.to_le_bytes())
        }
        Value::ShortString(s) => {
            out.push(b'S');
            put_bytes(out, s.as_bytes())
        }
        Value::LongString(b) => {
            out.push(b'X');
            put_bytes(out, b)
        }
        Value::Array(items) => {
            out.push(b'A');
            out.extend_from_slice(&(items.len() as u32).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
        Value::Timestamp(t) => {
            out.push(b'T');
            out.extend_from_slice(&t.to_le_bytes())
        }
        Value::Table(t) => {
            out.push(b'F');
            put_table(out, t)
        }
        Value::ByteArray(b) => {
            out.push(b'x');
            put_bytes(out, b)
        }
        Value::Void => out.push(b'V'),
    }
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CodecError> {
        if self.buf.len() < n {
            return Err(CodecError::Truncated);
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], CodecError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, CodecError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, CodecError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn bytes(&mut self) -> Result<&'a [u8], CodecError> {
        let n = self.u32()? as usize;
        self.take(n)
    }

    fn string(&mut self) -> Result<String, CodecError> {
        let b = self.bytes()?;
        String::from_utf8(b.to_vec()).map_err(|_| CodecError::Utf8)
    }

    fn opt<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<T, CodecError>,
    ) -> Result<Option<T>, CodecError> {
        match self.u8()? {
            0 => Ok(None),
            1 => f(self).map(Some),
            t => Err(CodecError::Tag(t)),
        }
    }

    fn str_opt(&mut self) -> Result<Option<String>, CodecError> {
        self.opt(|r| r.string())
    }

    fn properties(&mut self) -> Result<Properties, CodecError> {
        Ok(Properties {
            content_type: self.str_opt()?,
            content_encoding: self.str_opt()?,
            delivery_mode: self.opt(|r| r.u8())?,
            priority: self.opt(|r| r.u8())?,
            correlation_id: self.str_opt()?,
            reply_to: self.str_opt()?,
            expiration: self.str_opt()?,
            message_id: self.str_opt()?,
            timestamp: self.opt(|r| Ok(u64::from_le_bytes(r.array()?)))?,
            kind: self.str_opt()?,
            user_id: self.str_opt()?,
            app_id: self.str_opt()?,
            cluster_id: self.str_opt()?,
        })
    }

    fn table(&mut self, depth: usize) -> Result<FieldTable, CodecError> {
        if depth > MAX_DEPTH {
            return Err(CodecError::TooDeep);
        }
        let n = self.u32()? as usize;
        // Each entry takes at least 5 bytes: never trust `n` for the allocation.
        let mut entries = Vec::with_capacity(n.min(self.buf.len() / 5));
        for _ in 0..n {
            let k = self.string()?;
            let v = self.value(depth)?;
            entries.push((k, v));
        }
        Ok(FieldTable(entries))
    }

    fn value(&mut self, depth: usize) -> Result<Value, CodecError> {
        Ok(match self.u8()? {
            b't' => Value::Bool(self.u8()? != 0),
            b'b' => Value::I8(self.u8()? as i8),
            b'B' => Value::U8(self.u8()?),
            b's' => Value::I16(i16::from_le_bytes(self.array()?)),
            b'u' => Value::U16(u16::from_le_bytes(self.array()?)),
            b'I' => Value::I32(i32::from_le_bytes(self.array()?)),
            b'i' => Value::U32(self.u32()?),
            b'l' => Value::I64(i64::from_le_bytes(self.array()?)),
            b'L' => Value::U64(u64::from_le_bytes(self.array()?)),
            b'f' => Value::F32(f32::from_bits(self.u32()?)),
            b'd' => Value::F64(f64::from_bits(u64::from_le_bytes(self.array()?))),
            b'D' => Value::Decimal {
                scale: self.u8()?,
                value: self.u32()?,
            },
            b'S' => Value::ShortString(self.string()?),
            b'X' => Value::LongString(self.bytes()?.to_vec()),
            b'A' => {
                if depth >= MAX_DEPTH {
                    return Err(CodecError::TooDeep);
                }
                let n = self.u32()? as usize;
                let mut items = Vec::with_capacity(n.min(self.buf.len()));
                for _ in 0..n {
                    items.push(self.value(depth + 1)?);
                }
                Value::Array(items)
            }
            b'T' => Value::Timestamp(u64::from_le_bytes(self.array()?)),
            b'F' => Value::Table(self.table(depth + 1)?),
            b'x' => Value::ByteArray(self.bytes()?.to_vec()),
            b'V' => Value::Void,
            t => return Err(CodecError::Tag(t)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn value_strategy() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            any::<bool>().prop_map(Value::Bool),
            any::<i8>().prop_map(Value::I8),
            any::<u8>().prop_map(Value::U8),
            any::<i16>().prop_map(Value::I16),
            any::<u16>().prop_map(Value::U16),
            any::<i32>().prop_map(Value::I32),
            any::<u32>().prop_map(Value::U32),
            any::<i64>().prop_map(Value::I64),
            any::<u64>().prop_map(Value::U64),
            // Every bit pattern but NaN (NaN != NaN would fail the equality).
            any::<u32>().prop_filter_map("NaN", |b| {
                let f = f32::from_bits(b);
                (!f.is_nan()).then_some(Value::F32(f))
            }),
            any::<u64>().prop_filter_map("NaN", |b| {
                let f = f64::from_bits(b);
                (!f.is_nan()).then_some(Value::F64(f))
            }),
            (any::<u8>(), any::<u32>()).prop_map(|(scale, value)| Value::Decimal { scale, value }),
            ".{0,8}".prop_map(Value::ShortString),
            proptest::collection::vec(any::<u8>(), 0..16).prop_map(Value::LongString),
            any::<u64>().prop_map(Value::Timestamp),
            proptest::collection::vec(any::<u8>(), 0..16).prop_map(Value::ByteArray),
            Just(Value::Void),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::vec(("[a-z-]{1,6}", inner), 0..4)
                    .prop_map(|v| Value::Table(FieldTable(v))),
            ]
        })
    }

    fn text() -> impl Strategy<Value = Option<String>> {
        proptest::option::of(".{0,12}")
    }

    fn properties_strategy() -> impl Strategy<Value = Properties> {
        (
            (text(), text(), proptest::option::of(any::<u8>())),
            (proptest::option::of(any::<u8>()), text(), text(), text()),
            (text(), proptest::option::of(any::<u64>()), text()),
            (text(), text(), text()),
        )
            .prop_map(
                |(
                    (content_type, content_encoding, delivery_mode),
                    (priority, correlation_id, reply_to, expiration),
                    (message_id, timestamp, kind),
                    (user_id, app_id, cluster_id),
                )| Properties {
                    content_type,
                    content_encoding,
                    delivery_mode,
                    priority,
                    correlation_id,
                    reply_to,
                    expiration,
                    message_id,
                    timestamp,
                    kind,
                    user_id,
                    app_id,
                    cluster_id,
                },
            )
    }

    fn message_strategy() -> impl Strategy<Value = Message> {
        (
            proptest::collection::vec(any::<u8>(), 0..64),
            // Repeated names too (Kafka allows them).
            proptest::collection::vec(("[a-z-]{1,3}", value_strategy()), 0..6),
            properties_strategy(),
            (".{0,10}", ".{0,10}"),
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..8)),
            proptest::option::of(any::<i32>()),
            any::<bool>(),
            proptest::option::of(any::<i64>()),
            proptest::option::of(any::<i64>()),
        )
            .prop_map(
                |(
                    body,
                    headers,
                    properties,
                    (source, routing_key),
                    key,
                    partition,
                    null_value,
                    offset,
                    timestamp_ms,
                )| Message {
                    body,
                    headers: FieldTable(headers),
                    properties,
                    source,
                    routing_key,
                    key,
                    partition,
                    offset,
                    timestamp_ms,
                    null_value,
                },
            )
    }

    proptest! {
        #[test]
        fn round_trips(m in message_strategy()) {
            // Field by field against what was encoded, not the encoder
            // against itself.
            let back = decode(&encode(&m)).unwrap();
            prop_assert_eq!(back, m);
        }

        /// NaN headers (left out of `round_trips`, where NaN != NaN) come
        /// back with the very bits they had: sign, quiet or signalling, payload.
        #[test]
        fn nan_headers_round_trip_bit_for_bit(
            sign32 in any::<bool>(), payload32 in 1u32..=0x007F_FFFF,
            sign64 in any::<bool>(), payload64 in 1u64..=0x000F_FFFF_FFFF_FFFF,
        ) {
            let bits32 = (u32::from(sign32) << 31) | 0x7F80_0000 | payload32;
            let bits64 = (u64::from(sign64) << 63) | 0x7FF0_0000_0000_0000 | payload64;
            let m = Message {
                headers: FieldTable(vec![
                    ("f".into(), Value::F32(f32::from_bits(bits32))),
                    ("d".into(), Value::F64(f64::from_bits(bits64))),
                ]),
                ..Message::default()
            };
            let back = decode(&encode(&m)).unwrap();
            match (back.headers.get("f"), back.headers.get("d")) {
                (Some(Value::F32(f)), Some(Value::F64(d))) => {
                    prop_assert!(f.is_nan() && d.is_nan());
                    prop_assert_eq!((f.to_bits(), d.to_bits()), (bits32, bits64));
                }
                other => prop_assert!(false, "decoded {:?}", other),
            }
        }

        #[test]
        fn truncated_input_is_an_error_not_a_panic(m in message_strategy(), cut in 0usize..1000) {
            let bytes = encode(&m);
            let cut = cut % bytes.len();
            prop_assert!(decode(&bytes[..cut]).is_err());
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&bytes);
            let _ = lookup_key(&bytes);
        }

        #[test]
        fn lookup_key_matches_the_decoded_message(m in message_strategy(), reply_to in proptest::option::of(".{0,6}")) {
            let m = Message { properties: Properties { reply_to, ..m.properties.clone() }, ..m };
            let bytes = encode(&m);
            prop_assert_eq!(lookup_key(&bytes), m.lookup_key());
        }
    }

    /// Today's fields through the version 1 branch of the decoder; the
    /// committed bytes of version 1 (and 2) are pinned in the workspace's
    /// `tests/formats.rs` (`tests/fixtures/formats/codec/`).
    #[test]
    fn version_1_without_flags_still_decodes() {
        let m = Message {
            key: Some(b"k".to_vec()),
            ..Message::with_body(&b"old"[..])
        };
        let mut v1 = encode(&m);
        v1.remove(1); // the flags byte
        v1[0] = 1;
        assert_eq!(decode(&v1).unwrap(), m);
    }

    #[test]
    fn null_value_round_trips() {
        let m = Message {
            null_value: true,
            key: Some(b"order-1".to_vec()),
            ..Message::default()
        };
        assert!(decode(&encode(&m)).unwrap().null_value);
    }

    #[test]
    fn deep_nesting_is_refused() {
        let mut v = Value::Void;
        for _ in 0..(MAX_DEPTH + 5) {
            v = Value::Array(vec![v]);
        }
        let m = Message {
            headers: FieldTable(vec![("deep".into(), v)]),
            ..Message::default()
        };
        assert_eq!(decode(&encode(&m)), Err(CodecError::TooDeep));
    }

    #[test]
    fn check_nesting_agrees_with_decode() {
        for levels in [MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1] {
            for table in [false, true] {
                let mut v = Value::Void;
                for _ in 0..levels {
                    v = match table {
                        true => Value::Table(FieldTable(vec![("t".into(), v)])),
                        false => Value::Array(vec![v]),
                    };
                }
                let m = Message {
                    headers: FieldTable(vec![("deep".into(), v)]),
                    ..Message::default()
                };
                assert_eq!(
                    check_nesting(&m.headers).is_ok(),
                    decode(&encode(&m)).is_ok(),
                    "{levels} levels, table: {table}"
                );
            }
        }
    }
}
