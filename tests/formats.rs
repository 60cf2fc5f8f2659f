//! Every format delayd writes to disk or to a broker, and reads back after an
//! upgrade, pinned by a committed fixture file per version
//! (`tests/fixtures/formats/`):
//!
//! | file | format |
//! |---|---|
//! | `wal/v1.log` | WAL segment version 1 (no salt, no Commit), Schedule type 1, Done |
//! | `wal/v2-type1.log` | WAL segment version 2 (salted, Commit per batch), Schedule type 1 (no uid), Done |
//! | `wal/v2.log` | WAL segment version 2: Schedule type 4 (uid), Done, Commit |
//! | `wal/v3.log` | WAL segment version 3: an Acked frame as well |
//! | `wal/v4.log` | WAL segment version 4 as delayd writes it now: a Remembered frame as well |
//! | `codec/v1.bin` | message codec version 1 (no flags byte) |
//! | `codec/v2.bin` | message codec version 2, every field, every header type, a Kafka offset |
//! | `codec/v2-null-value.bin` | message codec version 2, a Kafka record with a null value |
//! | `kafka-state/v1.bin` | Kafka state value version 1 (due time, message) |
//! | `kafka-state/v2.bin` | Kafka state value version 2 (due time, uid, message) |
//! | `rabbitmq-state/v1-{schedule,done,marker,generation,remembered}.bin` | the RabbitMQ state stream's records, version 1 (`remembered`: a message that left, see docs/broker-store.md) |
//! | `rabbitmq-state/v2-packed.bin` | a RabbitMQ state stream message version 2: a round of version-1 records packed in one message |
//!
//! The tests decode the committed bytes and check every field against
//! values spelled out here, so a change to a format (or to what a reader
//! makes of an old one) fails them. For the versions delayd writes today
//! they also check that today's encoder writes exactly the committed bytes.
//!
//! The files were made once by `write_fixtures` (ignored):
//! `cargo test --test formats -- --ignored write_fixtures` writes the files
//! that are missing and never overwrites one. Old versions are spelled out
//! byte by byte there (today's writers no longer make them); each matches
//! the encoder of its time (`git show ed48bcc:src/wal/frame.rs`,
//! `git show 8382795:adapters/src/codec.rs`). A new format version gets a
//! new file; an old file is never regenerated.

use std::path::{Path, PathBuf};

use delayd::wal::{OnCorruption, RecordRef, Remembered, Wal, WalConfig};
use delayd_adapters::amqp::state::Record as StreamRecord;
use delayd_adapters::kafka::state::{decode_value, encode_value, StateValue};
use delayd_adapters::{decode, encode, FieldTable, Message, Properties, Value};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/formats")
}

fn fixture(name: &str) -> Vec<u8> {
    let path = fixtures().join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("committed fixture {}: {e}", path.display()))
}

// ------------------------------------------------------------ the values

/// A header of every AMQP type, nested ones included.
fn every_header() -> FieldTable {
    FieldTable(vec![
        ("x-delay".into(), Value::I64(-4000)),
        ("bool".into(), Value::Bool(true)),
        ("i8".into(), Value::I8(-8)),
        ("u8".into(), Value::U8(200)),
        ("i16".into(), Value::I16(-1600)),
        ("u16".into(), Value::U16(60_000)),
        ("i32".into(), Value::I32(-320_000)),
        ("u32".into(), Value::U32(4_000_000_000)),
        ("i64".into(), Value::I64(-6_400_000_000)),
        ("u64".into(), Value::U64(18_000_000_000_000_000_000)),
        ("f32".into(), Value::F32(1.5)),
        ("f64".into(), Value::F64(-2.25)),
        (
            "decimal".into(),
            Value::Decimal {
                scale: 2,
                value: 12_345,
            },
        ),
        ("short".into(), Value::ShortString("short string".into())),
        (
            "long".into(),
            Value::LongString(b"not utf-8 \xff\xfe".to_vec()),
        ),
        (
            "array".into(),
            Value::Array(vec![
                Value::I32(1),
                Value::ShortString("two".into()),
                Value::Array(vec![Value::Void]),
            ]),
        ),
        ("timestamp".into(), Value::Timestamp(1_700_000_000)),
        (
            "table".into(),
            Value::Table(FieldTable(vec![
                ("inner".into(), Value::Bool(false)),
                (
                    "deeper".into(),
                    Value::Table(FieldTable(vec![("n".into(), Value::U8(7))])),
                ),
            ])),
        ),
        ("bytes".into(), Value::ByteArray(vec![0, 1, 2, 0xff])),
        ("void".into(), Value::Void),
        // A repeated name keeps both, in order.
        ("x-delay".into(), Value::I64(-4000)),
    ])
}

fn every_property() -> Properties {
    Properties {
        content_type: Some("application/json".into()),
        content_encoding: Some("gzip".into()),
        delivery_mode: Some(2),
        priority: Some(9),
        correlation_id: Some("corr-1".into()),
        reply_to: Some("replies".into()),
        expiration: Some("60000".into()),
        message_id: Some("order-7".into()),
        timestamp: Some(1_700_000_000),
        kind: Some("order.created".into()),
        user_id: Some("guest".into()),
        app_id: Some("shop".into()),
        cluster_id: Some("eu-1".into()),
    }
}

/// Codec version 2 with every field set (a Kafka offset included).
fn full_message() -> Message {
    Message {
        body: b"{\"order\":7}\x00\xff".to_vec(),
        headers: every_header(),
        properties: every_property(),
        source: "orders.delayed".into(),
        routing_key: "eu.orders.created".into(),
        key: Some(b"order-7".to_vec()),
        partition: Some(3),
        offset: Some(42),
        timestamp_ms: Some(1_700_000_000_123),
        null_value: false,
    }
}

/// What a version 1 encoding can hold: everything but the flags (no
/// offset, no null value).
fn v1_message() -> Message {
    Message {
        offset: None,
        ..full_message()
    }
}

/// A Kafka record whose value is null, with its offset.
fn null_value_message() -> Message {
    Message {
        body: Vec::new(),
        headers: FieldTable(vec![(
            "x-delay".into(),
            Value::LongString(b"5000".to_vec()),
        )]),
        properties: Properties::default(),
        source: "orders.delay".into(),
        routing_key: String::new(),
        key: Some(b"cancel-me".to_vec()),
        partition: Some(0),
        offset: Some(7),
        timestamp_ms: Some(1_700_000_000_000),
        null_value: true,
    }
}

/// The message a state record carries (a Kafka record).
fn state_message() -> Message {
    Message {
        body: b"payload".to_vec(),
        headers: FieldTable(vec![(
            "x-delay".into(),
            Value::LongString(b"4000".to_vec()),
        )]),
        source: "orders.delay".into(),
        key: Some(b"k1".to_vec()),
        partition: Some(2),
        offset: Some(1234),
        timestamp_ms: Some(1_700_000_000_456),
        ..Message::default()
    }
}

const DUE_MS: u64 = 1_700_000_004_456;
const UID: u128 = 0x8000_0000_0000_00a1_0000_0000_0000_0001;

// --------------------------------------------------------- message codec

/// Compare field by field first, so a failure names the field.
fn assert_message(got: &Message, want: &Message) {
    assert_eq!(got.body, want.body, "body");
    assert_eq!(got.source, want.source, "source");
    assert_eq!(got.routing_key, want.routing_key, "routing_key");
    assert_eq!(got.key, want.key, "key");
    assert_eq!(got.partition, want.partition, "partition");
    assert_eq!(got.offset, want.offset, "offset");
    assert_eq!(got.timestamp_ms, want.timestamp_ms, "timestamp_ms");
    assert_eq!(got.null_value, want.null_value, "null_value");
    assert_eq!(got.properties, want.properties, "properties");
    assert_eq!(got.headers.len(), want.headers.len(), "header count");
    for ((gk, gv), (wk, wv)) in got.headers.iter().zip(want.headers.iter()) {
        assert_eq!((gk, gv), (wk, wv), "header {wk}");
    }
    assert_eq!(got, want);
}

#[test]
fn codec_version_1_fixture_decodes() {
    let bytes = fixture("codec/v1.bin");
    assert_eq!(bytes[0], 1, "version byte");
    assert_message(&decode(&bytes).unwrap(), &v1_message());
    assert_eq!(
        delayd_adapters::lookup_key(&bytes),
        Some(&b"order-7"[..]),
        "the cancel key read straight from the bytes"
    );
}

#[test]
fn codec_version_2_fixtures_decode_and_are_what_delayd_writes() {
    let full = fixture("codec/v2.bin");
    assert_eq!(&full[..2], &[2, 0b10], "version, flags: an offset follows");
    assert_message(&decode(&full).unwrap(), &full_message());
    assert_eq!(encode(&full_message()), full, "today's encoder");
    assert_eq!(delayd_adapters::lookup_key(&full), Some(&b"order-7"[..]));

    let null = fixture("codec/v2-null-value.bin");
    assert_eq!(&null[..2], &[2, 0b11], "version, flags: null value, offset");
    assert_message(&decode(&null).unwrap(), &null_value_message());
    assert_eq!(encode(&null_value_message()), null, "today's encoder");
}

// ------------------------------------------------------ Kafka state value

#[test]
fn kafka_state_value_version_1_fixture_decodes() {
    let bytes = fixture("kafka-state/v1.bin");
    let value = decode_value(&bytes).expect("a version 1 value");
    assert_eq!(value.due_ms, DUE_MS);
    assert_eq!(value.uid, None, "version 1 has no identity");
    assert_message(&decode(value.encoded).unwrap(), &state_message());
}

#[test]
fn kafka_state_value_version_2_fixture_decodes_and_is_what_delayd_writes() {
    let bytes = fixture("kafka-state/v2.bin");
    let value = decode_value(&bytes).expect("a version 2 value");
    assert_eq!(value.due_ms, DUE_MS);
    assert_eq!(value.uid, Some(UID));
    assert_message(&decode(value.encoded).unwrap(), &state_message());
    let encoded = encode(&state_message());
    assert_eq!(
        value,
        StateValue {
            due_ms: DUE_MS,
            uid: Some(UID),
            encoded: &encoded
        }
    );
    assert_eq!(
        encode_value(DUE_MS, UID, &encoded),
        bytes,
        "today's encoder"
    );
}

// ----------------------------------------------- RabbitMQ state stream

fn stream_records() -> [(&'static str, StreamRecord); 5] {
    [
        (
            "rabbitmq-state/v1-schedule.bin",
            StreamRecord::Schedule {
                id: UID,
                due_ms: DUE_MS,
                message: encode(&full_message()),
            },
        ),
        ("rabbitmq-state/v1-done.bin", StreamRecord::Done { id: UID }),
        (
            "rabbitmq-state/v1-marker.bin",
            StreamRecord::Marker {
                nonce: 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210,
            },
        ),
        (
            "rabbitmq-state/v1-generation.bin",
            StreamRecord::Generation { generation: 17 },
        ),
        (
            "rabbitmq-state/v1-remembered.bin",
            StreamRecord::Remembered {
                id: UID,
                fingerprint: 0x0123_4567_0000_00bf,
                digest: *b"0123456789abcdef0123456789abcdef",
                cancelled: true,
            },
        ),
    ]
}

#[test]
fn rabbitmq_state_stream_record_fixtures_decode_and_are_what_delayd_writes() {
    for (name, want) in stream_records() {
        let bytes = fixture(name);
        assert_eq!(bytes[0], 1, "{name}: version byte");
        let got = StreamRecord::decode(&bytes).unwrap_or_else(|| panic!("{name} decodes"));
        match (&got, &want) {
            (
                StreamRecord::Schedule {
                    id,
                    due_ms,
                    message,
                },
                StreamRecord::Schedule { .. },
            ) => {
                assert_eq!(*id, UID, "{name}: id");
                assert_eq!(*due_ms, DUE_MS, "{name}: due_ms");
                assert_message(&decode(message).unwrap(), &full_message());
            }
            (StreamRecord::Done { id }, StreamRecord::Done { .. }) => {
                assert_eq!(*id, UID, "{name}: id")
            }
            (StreamRecord::Marker { nonce }, StreamRecord::Marker { nonce: want }) => {
                assert_eq!(nonce, want, "{name}: nonce")
            }
            (StreamRecord::Generation { generation }, StreamRecord::Generation { .. }) => {
                assert_eq!(*generation, 17, "{name}: generation")
            }
            (
                StreamRecord::Remembered {
                    id,
                    fingerprint,
                    digest,
                    cancelled,
                },
                StreamRecord::Remembered { .. },
            ) => {
                assert_eq!(*id, UID, "{name}: id");
                assert_eq!(*fingerprint, 0x0123_4567_0000_00bf, "{name}: fingerprint");
                assert_eq!(
                    digest, b"0123456789abcdef0123456789abcdef",
                    "{name}: digest"
                );
                assert!(*cancelled, "{name}: cancelled");
            }
            _ => panic!("{name}: decoded as {got:?}"),
        }
        assert_eq!(got, want, "{name}");
        assert_eq!(want.encode(), bytes, "{name}: today's encoder");
    }
}

/// The records `rabbitmq-state/v2-packed.bin` packs, and the packed bytes
/// today's writer makes of them.
fn packed_records() -> (Vec<StreamRecord>, Vec<u8>) {
    let records: Vec<StreamRecord> = stream_records()
        .into_iter()
        .filter(|(name, _)| name.contains("schedule") || name.contains("done"))
        .map(|(_, r)| r)
        .collect();
    let encoded: Vec<Vec<u8>> = records.iter().map(StreamRecord::encode).collect();
    let mut messages = delayd_adapters::amqp::packed::pack(&encoded);
    assert_eq!(messages.len(), 1);
    (records, messages.remove(0))
}

#[test]
fn rabbitmq_state_stream_packed_fixture_unpacks_and_is_what_delayd_writes() {
    let bytes = fixture("rabbitmq-state/v2-packed.bin");
    assert_eq!(&bytes[..2], &[2, 1], "version and kind bytes");
    let (want, today) = packed_records();
    let got: Vec<StreamRecord> = delayd_adapters::amqp::packed::unpack(&bytes)
        .expect("unpacks")
        .into_iter()
        .map(|r| StreamRecord::decode(r).expect("a version-1 record"))
        .collect();
    assert_eq!(got, want);
    assert_eq!(today, bytes, "today's writer");
}

// -------------------------------------------------------------- the WAL

/// A record as recovery replays it.
#[derive(Debug, PartialEq, Eq)]
enum Replayed {
    Schedule {
        seq: u64,
        id: u64,
        due_ms: u64,
        uid: u128,
        route: String,
        message: Vec<u8>,
    },
    Done {
        seq: u64,
        id: u64,
        segment: u64,
    },
    Acked {
        seq: u64,
        id: u64,
    },
    Remembered {
        seq: u64,
        remembered: Remembered,
    },
}

/// Recover a WAL whose only segment is the fixture `name` (its first seq
/// is 1), refusing any corruption; the records replayed, in order.
fn replay(name: &str) -> Vec<Replayed> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(SEGMENT), fixture(name)).unwrap();
    let config = WalConfig {
        on_corruption: OnCorruption::Refuse,
        ..WalConfig::new(dir.path())
    };
    let mut out = Vec::new();
    let (wal, report) = Wal::open(config, |record, _| {
        out.push(match record {
            RecordRef::Schedule {
                seq,
                id,
                due_ms,
                uid,
                route,
                message,
            } => Replayed::Schedule {
                seq,
                id,
                due_ms,
                uid,
                route: route.to_owned(),
                message: message.to_vec(),
            },
            RecordRef::Done { seq, id, segment } => Replayed::Done { seq, id, segment },
            RecordRef::Acked { seq, id } => Replayed::Acked { seq, id },
            RecordRef::Remembered { seq, remembered } => Replayed::Remembered { seq, remembered },
        })
    })
    .unwrap_or_else(|e| panic!("{name}: {e}"));
    assert!(report.corruptions.is_empty(), "{name}");
    assert_eq!(report.truncated_bytes, 0, "{name}");
    assert_eq!(report.segments, 1, "{name}");
    wal.close().unwrap();
    out
}

const SEGMENT: &str = "wal-00000000000000000001.log";
const FIRST: &[u8] = b"first message \x00\xff";
const SECOND: &[u8] = b"second";

/// The fixtures' first message, as replayed: WAL sequence `seq`, engine id
/// `id`, identity `uid` (0 before identities existed).
fn first(seq: u64, id: u64, uid: u128) -> Replayed {
    Replayed::Schedule {
        seq,
        id,
        due_ms: DUE_MS,
        uid,
        route: "orders".into(),
        message: FIRST.to_vec(),
    }
}

/// The fixtures' second message (another route, due a millisecond later).
fn second(seq: u64, id: u64, uid: u128) -> Replayed {
    Replayed::Schedule {
        seq,
        id,
        due_ms: DUE_MS + 1,
        uid,
        route: "r2".into(),
        message: SECOND.to_vec(),
    }
}

#[test]
fn wal_segment_version_1_fixture_replays() {
    let bytes = fixture("wal/v1.log");
    assert_eq!(&bytes[..16], b"DELAYDWL\x01\x00\x00\x00\x00\x00\x00\x00");
    assert_eq!(
        replay("wal/v1.log"),
        vec![
            first(1, 1, 0),
            second(2, 2, 0),
            Replayed::Done {
                seq: 3,
                id: 1,
                segment: 1
            },
        ]
    );
}

#[test]
fn wal_segment_version_2_with_type_1_schedules_fixture_replays() {
    let bytes = fixture("wal/v2-type1.log");
    assert_eq!(&bytes[..12], b"DELAYDWL\x02\x00\x00\x00");
    assert_eq!(
        replay("wal/v2-type1.log"),
        vec![
            first(1, 1, 0),
            second(2, 2, 0),
            // seq 3: the first batch's Commit.
            Replayed::Done {
                seq: 4,
                id: 1,
                segment: 1
            },
        ]
    );
}

#[test]
fn wal_segment_version_2_fixture_replays() {
    let bytes = fixture("wal/v2.log");
    assert_eq!(&bytes[..12], b"DELAYDWL\x02\x00\x00\x00");
    assert_eq!(
        replay("wal/v2.log"),
        vec![
            first(1, 1, UID),
            // Each append waited for its batch: a Commit after each.
            second(3, 3, UID + 1),
            Replayed::Done {
                seq: 5,
                id: 1,
                segment: 1
            },
        ]
    );
}

#[test]
fn wal_segment_version_3_fixture_replays() {
    let bytes = fixture("wal/v3.log");
    assert_eq!(&bytes[..12], b"DELAYDWL\x03\x00\x00\x00");
    assert_eq!(
        replay("wal/v3.log"),
        vec![
            first(1, 1, UID),
            second(3, 3, UID + 1),
            // The first message's ack was confirmed: the lazy mark waited
            // for the Done's batch (seq 7 is its Commit).
            Replayed::Acked { seq: 5, id: 1 },
            Replayed::Done {
                seq: 6,
                id: 1,
                segment: 1
            },
        ]
    );
}

/// What the version 4 fixture remembers of the first message.
fn remembered_first() -> Remembered {
    Remembered {
        id: 1,
        uid: UID,
        fp: 0x0123_4567_89ab_cdef,
        digest: [0xd1; 32],
        flags: 3,
    }
}

#[test]
fn wal_segment_version_4_fixture_replays() {
    let bytes = fixture("wal/v4.log");
    assert_eq!(&bytes[..12], b"DELAYDWL\x04\x00\x00\x00");
    assert_eq!(
        replay("wal/v4.log"),
        vec![
            first(1, 1, UID),
            second(3, 3, UID + 1),
            Replayed::Acked { seq: 5, id: 1 },
            Replayed::Done {
                seq: 6,
                id: 1,
                segment: 1
            },
            // What redelivery detection remembers of the first message once
            // its Schedule's segment goes: cancelled (1) and left (2).
            Replayed::Remembered {
                seq: 8,
                remembered: remembered_first(),
            },
        ]
    );
}

// --------------------------------------------------------- the generator

/// Writes the fixture files that are missing; never overwrites one.
#[test]
#[ignore = "writes tests/fixtures/formats; run once for a new format version"]
fn write_fixtures() {
    let write = |name: &str, bytes: Vec<u8>| {
        let path = fixtures().join(name);
        if path.exists() {
            println!("kept {}", path.display());
            return;
        }
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, bytes).unwrap();
        println!("wrote {}", path.display());
    };

    // Codec version 1: version 2's layout without the flags byte (the
    // field encoders are unchanged since 8382795).
    let mut v1 = encode(&v1_message());
    assert_eq!(v1[1], 0, "no flags");
    v1.remove(1);
    v1[0] = 1;
    write("codec/v1.bin", v1);
    write("codec/v2.bin", encode(&full_message()));
    write("codec/v2-null-value.bin", encode(&null_value_message()));

    // Kafka state value version 1: version, due (big endian), message.
    let message = encode(&state_message());
    write(
        "kafka-state/v1.bin",
        [&[1u8][..], &DUE_MS.to_be_bytes(), &message].concat(),
    );
    write("kafka-state/v2.bin", encode_value(DUE_MS, UID, &message));

    write("rabbitmq-state/v2-packed.bin", packed_records().1);
    for (name, record) in stream_records() {
        write(name, record.encode());
    }

    // WAL version 1: unsalted frames, Schedule type 1, no Commit.
    let mut seg = b"DELAYDWL".to_vec();
    seg.extend_from_slice(&1u32.to_le_bytes());
    seg.extend_from_slice(&0u32.to_le_bytes());
    put_schedule_v1(&mut seg, None, 1, 1, DUE_MS, "orders", FIRST);
    put_schedule_v1(&mut seg, None, 2, 2, DUE_MS + 1, "r2", SECOND);
    put_frame(
        &mut seg,
        None,
        2,
        3,
        &[1u64.to_le_bytes(), 1u64.to_le_bytes()].concat(),
    );
    write("wal/v1.log", seg);

    // WAL version 2 before uids: salted frames, Schedule type 1, Commits.
    let salt: u32 = 0x5eed_0001;
    let mut seg = b"DELAYDWL".to_vec();
    seg.extend_from_slice(&2u32.to_le_bytes());
    seg.extend_from_slice(&salt.to_le_bytes());
    put_schedule_v1(&mut seg, Some(salt), 1, 1, DUE_MS, "orders", FIRST);
    put_schedule_v1(&mut seg, Some(salt), 2, 2, DUE_MS + 1, "r2", SECOND);
    put_frame(&mut seg, Some(salt), 3, 3, &1u64.to_le_bytes()); // Commit of 1..=2
    let done = [1u64.to_le_bytes(), 1u64.to_le_bytes()].concat();
    put_frame(&mut seg, Some(salt), 2, 4, &done);
    put_frame(&mut seg, Some(salt), 3, 5, &4u64.to_le_bytes()); // Commit of 4
    write("wal/v2-type1.log", seg);

    // WAL version 2 (wal/v2.log) was what the writer wrote until version
    // 3 (Acked frames): the same as version 3 below without the Acked.

    // WAL version 3 (wal/v3.log) was what the writer wrote until version
    // 4 (Remembered frames): the same as version 4 below without the
    // Remembered frame.

    // WAL version 4 today: what the writer writes.
    let dir = tempfile::tempdir().unwrap();
    let (wal, _) = Wal::open(WalConfig::new(dir.path()), |_, _| {}).unwrap();
    let append = |due, uid, route: &str, message: &[u8]| {
        wal.append_schedule(due, uid, route, message.to_vec())
            .unwrap()
            .blocking_recv()
            .unwrap()
            .unwrap()
    };
    let first = append(DUE_MS, UID, "orders", FIRST);
    append(DUE_MS + 1, UID + 1, "r2", SECOND);
    wal.append_acked(first.id, None).unwrap();
    wal.append_done(first.id, first.pos)
        .unwrap()
        .blocking_recv()
        .unwrap()
        .unwrap();
    wal.append_remembered(remembered_first())
        .unwrap()
        .blocking_recv()
        .unwrap()
        .unwrap();
    wal.close().unwrap();
    write(
        "wal/v4.log",
        std::fs::read(dir.path().join(SEGMENT)).unwrap(),
    );
}

/// A WAL frame: `len u32 | crc u32 | type | seq u64 | payload`, the CRC32C
/// over (the salt, if any), `len` and the rest.
fn put_frame(out: &mut Vec<u8>, salt: Option<u32>, kind: u8, seq: u64, payload: &[u8]) {
    let len = (9 + payload.len()) as u32;
    let mut rest = vec![kind];
    rest.extend_from_slice(&seq.to_le_bytes());
    rest.extend_from_slice(payload);
    let start = match salt {
        Some(s) => crc32c::crc32c_append(crc32c::crc32c(&s.to_le_bytes()), &len.to_le_bytes()),
        None => crc32c::crc32c(&len.to_le_bytes()),
    };
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c_append(start, &rest).to_le_bytes());
    out.extend_from_slice(&rest);
}

/// A type 1 Schedule: `id u64 | due_ms u64 | route_len u16 | route | message`.
fn put_schedule_v1(
    out: &mut Vec<u8>,
    salt: Option<u32>,
    seq: u64,
    id: u64,
    due_ms: u64,
    route: &str,
    message: &[u8],
) {
    let mut payload = id.to_le_bytes().to_vec();
    payload.extend_from_slice(&due_ms.to_le_bytes());
    payload.extend_from_slice(&(route.len() as u16).to_le_bytes());
    payload.extend_from_slice(route.as_bytes());
    payload.extend_from_slice(message);
    put_frame(out, salt, 1, seq, &payload);
}
