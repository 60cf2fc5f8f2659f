//! The broker-kept store's RabbitMQ side (`[store] kind = "broker"`): a
//! lock that makes one instance the route's owner, and the streams that
//! hold the route's pending messages.
//!
//! # Ownership
//! Every instance keeps a consumer on the route's lock queue
//! `<prefix><route>.lock` (`x-single-active-consumer`). RabbitMQ delivers
//! to one consumer at a time, and moves to the next only when that one's
//! channel closes (a crash, a lost network after the heartbeat timeout, a
//! stop). Each instance pings the queue every second; the one that receives
//! a ping (anyone's) is the active consumer and owns the route
//! ([`Candidate::elected`]). Every write to the state streams goes over the
//! owner's lock connection ([`StateSession`]), so a write confirmed to one
//! owner was made before the next owner was elected, and the next owner
//! reads it. The route's ingress queue is declared with
//! `x-single-active-consumer` too, so even a former owner whose consumer
//! lingers cannot take deliveries beside the new one.
//!
//! # Streams
//! A stream (`x-queue-type = stream`) is never compacted by the broker, and
//! its retention drops by age or size, not by what is still needed. So the
//! route's state lives in *generations*, each a stream that is deleted
//! whole once a newer one holds everything still live:
//!
//! * `<prefix><route>`: the pointer stream. Its records name the current
//!   generation ([`Record::Generation`]); the last one wins.
//! * `<prefix><route>.<n>`: generation `n`. Records: `Schedule(id, due,
//!   message)` before the ingress delivery is acked, `Done(id)` once the
//!   message is confirmed at its target, parked or cancelled.
//!
//! A checkpoint moves the writes to generation `n + 1` at once, copies the
//! live Schedules of `n` into `n + 1` beside them (each only if no Done of
//! it was appended meanwhile, checked by the one writer, so no copy can
//! land after its Done), then appends `Generation(n + 1)` to the pointer,
//! then deletes `n`. Until the pointer moves, recovery reads `n` then
//! `n + 1`, which gives the same live set.
//!
//! # Reading to the end
//! AMQP has no high watermark. A reader first appends a [`Record::Marker`]
//! with a fresh nonce (confirmed), then reads from the first offset until it
//! meets that marker: everything confirmed before it has been read.
//!
//! # Recovery (on becoming the owner)
//! Read the pointer's last `Generation(n)`, then generation `n` and `n + 1`
//! (declared if missing: a checkpoint may have stopped before its pointer
//! record; a passive check would log a channel error for the usual case):
//! Schedules and Dones applied in order give the live set. Then write a
//! checkpoint into `n + 2`, which ends the older generations. A former
//! owner's records in a deleted generation were all confirmed before the
//! lock changed hands, so they were read.
//!
//! # Space
//! A checkpoint runs when a generation holds more than twice the live set
//! plus a floor of records; the streams then hold at most about three
//! times the live set plus that floor, and a generation is deleted, not
//! aged out: an outage of every instance, however long, loses nothing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use tracing::debug;

use super::connection::AmqpError;
use super::convert::short_string;
use crate::traits::BoxFuture;

/// Errors of the RabbitMQ state streams.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// Connecting or opening a channel failed.
    #[error(transparent)]
    Amqp(#[from] AmqpError),
    /// A protocol operation failed (the connection is then usually gone).
    #[error("{what}: {source}")]
    Protocol {
        what: String,
        #[source]
        source: lapin::Error,
    },
    /// The broker nacked or returned a state record.
    #[error("the broker refused a state record for {stream} ({why})")]
    Refused { stream: String, why: &'static str },
    /// A read made no progress for too long.
    #[error("reading stream {stream} stalled after {records} records")]
    Stalled { stream: String, records: u64 },
    /// A record written by a newer delayd (a format version this one does
    /// not know): refused rather than skipped, since skipping a Schedule
    /// would lose its message.
    #[error("stream {stream}: the record at offset {offset} has format version {version}, newer than this delayd reads ({VERSION}); run the delayd version that wrote it")]
    NewerFormat {
        stream: String,
        offset: i64,
        version: u8,
    },
}

fn protocol(what: impl Into<String>) -> impl FnOnce(lapin::Error) -> StateError {
    let what = what.into();
    move |source| StateError::Protocol { what, source }
}

/// A record of a state stream. Ids are the store's own (see the module
/// doc): the same whichever instance restores the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    Schedule {
        id: u128,
        due_ms: u64,
        message: Vec<u8>,
    },
    Done {
        id: u128,
    },
    /// "Read up to here": see the module doc.
    Marker {
        nonce: u128,
    },
    /// Pointer stream: the current generation.
    Generation {
        generation: u64,
    },
}

const VERSION: u8 = 1;
/// Version bytes above [`VERSION`] up to this are a newer delayd's formats;
/// any other undecodable record is garbage, skipped and counted.
const NEWEST_PLAUSIBLE_VERSION: u8 = 15;
const SCHEDULE: u8 = 1;
const DONE: u8 = 2;
const MARKER: u8 = 3;
const GENERATION: u8 = 4;

impl Record {
    /// Version byte, kind byte, then the fields big endian.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![VERSION];
        match self {
            Record::Schedule {
                id,
                due_ms,
                message,
            } => {
                out.reserve(26 + message.len());
                out.push(SCHEDULE);
                out.extend_from_slice(&id.to_be_bytes());
                out.extend_from_slice(&due_ms.to_be_bytes());
                out.extend_from_slice(message);
            }
            Record::Done { id } => {
                out.push(DONE);
                out.extend_from_slice(&id.to_be_bytes());
            }
            Record::Marker { nonce } => {
                out.push(MARKER);
                out.extend_from_slice(&nonce.to_be_bytes());
            }
            Record::Generation { generation } => {
                out.push(GENERATION);
                out.extend_from_slice(&generation.to_be_bytes());
            }
        }
        out
    }

    /// The record in `bytes`, or `None` if it is not one of ours.
    pub fn decode(bytes: &[u8]) -> Option<Record> {
        let (&version, rest) = bytes.split_first()?;
        let (&kind, rest) = rest.split_first()?;
        if version != VERSION {
            return None;
        }
        let u128_at = |b: &[u8]| Some(u128::from_be_bytes(b.get(..16)?.try_into().ok()?));
        let u64_at = |b: &[u8]| Some(u64::from_be_bytes(b.get(..8)?.try_into().ok()?));
        match kind {
            SCHEDULE => Some(Record::Schedule {
                id: u128_at(rest)?,
                due_ms: u64_at(rest.get(16..)?)?,
                message: rest.get(24..)?.to_vec(),
            }),
            DONE if rest.len() == 16 => Some(Record::Done { id: u128_at(rest)? }),
            MARKER if rest.len() == 16 => Some(Record::Marker {
                nonce: u128_at(rest)?,
            }),
            GENERATION if rest.len() == 8 => Some(Record::Generation {
                generation: u64_at(rest)?,
            }),
            _ => None,
        }
    }
}

/// A pending message read back from a generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveRecord {
    pub id: u128,
    pub due_ms: u64,
    pub message: Vec<u8>,
}

/// The names of one route's lock and streams.
#[derive(Debug, Clone)]
pub struct StateNames {
    /// The pointer stream, `<prefix><route>`.
    pub pointer: String,
}

impl StateNames {
    pub fn new(pointer: impl Into<String>) -> Self {
        Self {
            pointer: pointer.into(),
        }
    }

    /// The exclusive queue whose holder owns the route.
    pub fn lock(&self) -> String {
        format!("{}.lock", self.pointer)
    }

    /// Generation `n`'s stream.
    pub fn generation(&self, n: u64) -> String {
        format!("{}.{n}", self.pointer)
    }
}

/// How long a read may go without a record before it is given up.
const READ_STALL: Duration = Duration::from_secs(30);

/// Records a reader takes before acking (streams need acks for credit).
const READ_PREFETCH: u16 = 2000;

/// An instance that wants to own a route: its consumer on the route's lock
/// queue (`x-single-active-consumer`) waits its turn. See the module doc.
pub struct Candidate {
    connection: Connection,
    lock: Channel,
    consumer: lapin::Consumer,
    names: StateNames,
}

impl Candidate {
    /// Declare the lock queue and register a consumer on it, on a
    /// connection that then carries every state write if elected.
    pub async fn register(connection: Connection, names: &StateNames) -> Result<Self, StateError> {
        let result = async {
            let lock = connection
                .create_channel()
                .await
                .map_err(protocol("opening the lock channel"))?;
            let queue = short_string(&names.lock(), "lock queue name").map_err(AmqpError::from)?;
            let mut args = FieldTable::default();
            args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
            lock.queue_declare(queue.clone(), QueueDeclareOptions::durable(), args)
                .await
                .map_err(protocol(format!(
                    "declaring the lock queue {}",
                    names.lock()
                )))?;
            let options = BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            };
            let tag = format!("delayd-lock-{:x}", fresh_nonce());
            let consumer = lock
                .basic_consume(
                    queue,
                    short_string(&tag, "consumer tag").map_err(AmqpError::from)?,
                    options,
                    FieldTable::default(),
                )
                .await
                .map_err(protocol(format!(
                    "consuming the lock queue {}",
                    names.lock()
                )))?;
            Ok::<_, StateError>((lock, consumer))
        }
        .await;
        match result {
            Ok((lock, consumer)) => Ok(Self {
                connection,
                lock,
                consumer,
                names: names.clone(),
            }),
            Err(e) => {
                let _ = connection.close(200, "lock failed".into()).await;
                Err(e)
            }
        }
    }

    /// Wait until this candidate's consumer is the active one: every
    /// `every` it publishes a ping into the lock queue, and only the active
    /// consumer receives pings (anyone's). Then it owns the route.
    /// `standby` is called each time a round passes without a ping.
    pub async fn elected(
        mut self,
        every: Duration,
        mut standby: impl FnMut(),
    ) -> Result<StateSession, StateError> {
        match self.wait_for_ping(every, &mut standby).await {
            Ok(()) => self.into_session().await,
            Err(e) => {
                // Not elected: this connection is of no further use.
                self.close().await;
                Err(e)
            }
        }
    }

    async fn wait_for_ping(
        &mut self,
        every: Duration,
        standby: &mut impl FnMut(),
    ) -> Result<(), StateError> {
        let queue = short_string(&self.names.lock(), "lock queue name").map_err(AmqpError::from)?;
        loop {
            self.lock
                .basic_publish(
                    "".into(),
                    queue.clone(),
                    BasicPublishOptions::default(),
                    b"ping",
                    BasicProperties::default(),
                )
                .await
                .map_err(protocol("pinging the lock queue"))?;
            match tokio::time::timeout(every, self.consumer.next()).await {
                Err(_) => standby(), // not active: another instance owns the route
                Ok(Some(Ok(_))) => return Ok(()),
                Ok(Some(Err(e))) => return Err(protocol("waiting on the lock queue")(e)),
                Ok(None) => {
                    return Err(StateError::Refused {
                        stream: self.names.lock(),
                        why: "the lock consumer was cancelled",
                    })
                }
            }
        }
    }

    /// Elected: open the writer channel on the lock connection.
    async fn into_session(self) -> Result<StateSession, StateError> {
        let opened = async {
            let writer = self
                .connection
                .create_channel()
                .await
                .map_err(protocol("opening the state writer channel"))?;
            writer
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .map_err(protocol("confirm.select on the state writer channel"))?;
            Ok::<_, StateError>(writer)
        };
        let writer = match opened.await {
            Ok(w) => w,
            Err(e) => {
                self.close().await;
                return Err(e);
            }
        };
        // The owner keeps receiving the standbys' pings: drop them. If the
        // broker cancels the consumer (the lock queue was deleted), the
        // lock is lost as surely as with the connection.
        let mut consumer = self.consumer;
        let cancelled = Arc::new(AtomicBool::new(false));
        let drain = tokio::spawn({
            let cancelled = cancelled.clone();
            async move {
                while let Some(Ok(_)) = consumer.next().await {}
                cancelled.store(true, Ordering::Release);
            }
        });
        Ok(StateSession {
            connection: self.connection,
            writer,
            names: self.names,
            drain,
            cancelled,
            skipped: AtomicU64::new(0),
        })
    }

    /// Give up waiting.
    pub async fn close(&self) {
        let _ = self.connection.close(200, "delayd stops".into()).await;
    }
}

/// One owner's connection: its lock consumer is the active one, and every
/// state write goes over it. When it closes, ownership is gone (see the
/// module doc).
pub struct StateSession {
    connection: Connection,
    /// Confirm-mode channel for every write, in order.
    writer: Channel,
    names: StateNames,
    /// Reads (and drops) the pings that reach the owner.
    drain: tokio::task::JoinHandle<()>,
    /// Set once the owner's lock consumer is gone.
    cancelled: Arc<AtomicBool>,
    /// Undecodable records skipped by reads so far (see [`StateSession::read_all`]).
    skipped: AtomicU64,
}

impl std::fmt::Debug for StateSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateSession")
            .field("pointer", &self.names.pointer)
            .finish_non_exhaustive()
    }
}

impl StateSession {
    /// A session that owns nothing (`delayd store inspect`): it only
    /// reads, and its only writes are read markers, which recovery skips.
    pub async fn observe(connection: Connection, names: &StateNames) -> Result<Self, StateError> {
        let writer = connection
            .create_channel()
            .await
            .map_err(protocol("opening a channel"))?;
        writer
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(protocol("confirm.select"))?;
        Ok(StateSession {
            connection,
            writer,
            names: names.clone(),
            drain: tokio::spawn(async {}),
            cancelled: Arc::new(AtomicBool::new(false)),
            skipped: AtomicU64::new(0),
        })
    }

    /// Undecodable records the reads of this session skipped.
    pub fn skipped(&self) -> u64 {
        self.skipped.load(Ordering::Relaxed)
    }

    pub fn names(&self) -> &StateNames {
        &self.names
    }

    /// Whether the lock (the connection) is still held.
    pub fn is_alive(&self) -> bool {
        self.connection.status().connected()
            && self.writer.status().connected()
            && !self.cancelled.load(Ordering::Acquire)
    }

    /// Resolves once the lock is lost.
    pub async fn lost(&self) {
        while self.is_alive() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Give the lock up.
    pub async fn close(&self) {
        self.drain.abort();
        if self.connection.status().connected() {
            let close = self
                .connection
                .close(200, "delayd releases the route".into());
            if tokio::time::timeout(Duration::from_secs(2), close)
                .await
                .is_err()
            {
                debug!("the broker did not answer connection.close in time");
            }
        }
    }

    /// Declare stream `name` (idempotent).
    pub async fn declare_stream(&self, name: &str) -> Result<(), StateError> {
        let channel = self.channel().await?;
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(LongString::from("stream")),
        );
        let result = channel
            .queue_declare(
                short_string(name, "stream name").map_err(AmqpError::from)?,
                QueueDeclareOptions::durable(),
                args,
            )
            .await
            .map_err(protocol(format!("declaring stream {name}")));
        let _ = channel.close(200, "OK".into()).await;
        result.map(drop)
    }

    /// Delete stream `name` (a missing one is fine: `queue.delete` is
    /// idempotent in RabbitMQ since 3.2).
    pub async fn delete(&self, name: &str) -> Result<(), StateError> {
        let channel = self.channel().await?;
        let result = channel
            .queue_delete(
                short_string(name, "stream name").map_err(AmqpError::from)?,
                QueueDeleteOptions::default(),
            )
            .await
            .map_err(protocol(format!("deleting stream {name}")));
        let _ = channel.close(200, "OK".into()).await;
        result.map(drop)
    }

    async fn channel(&self) -> Result<Channel, StateError> {
        self.connection
            .create_channel()
            .await
            .map_err(protocol("opening a channel on the state connection"))
    }

    /// Queue `records` on `stream`, in order and after everything queued
    /// before; the returned future resolves once the broker confirmed them
    /// all. Callers must not interleave calls (the store has one writer).
    pub async fn append(
        &self,
        stream: &str,
        records: &[Vec<u8>],
    ) -> BoxFuture<'static, Result<(), StateError>> {
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let key = match short_string(stream, "stream name") {
            Ok(k) => k,
            Err(e) => {
                let e = StateError::Amqp(e.into());
                return Box::pin(async move { Err(e) });
            }
        };
        // Polled together, in order (see the sink): frames are queued on
        // the first poll, so the order on the wire is the order here.
        let sends = records.iter().map(|body| {
            self.writer.basic_publish(
                "".into(),
                key.clone(),
                options,
                body,
                BasicProperties::default().with_delivery_mode(2),
            )
        });
        let sent = super::sink::join_in_order(sends).await;
        let stream = stream.to_owned();
        Box::pin(async move {
            let mut confirms = Vec::with_capacity(sent.len());
            for s in sent {
                confirms.push(s.map_err(protocol(format!("publishing to stream {stream}")))?);
            }
            for confirm in confirms {
                match confirm
                    .await
                    .map_err(protocol(format!("confirm from stream {stream}")))?
                {
                    Confirmation::Ack(None) => {}
                    Confirmation::Ack(Some(_)) => {
                        return Err(StateError::Refused {
                            stream,
                            why: "returned: the stream does not exist",
                        })
                    }
                    Confirmation::Nack(_) => {
                        return Err(StateError::Refused {
                            stream,
                            why: "nacked",
                        })
                    }
                    Confirmation::NotRequested => {
                        return Err(StateError::Refused {
                            stream,
                            why: "the channel is not in confirm mode",
                        })
                    }
                }
            }
            Ok(())
        })
    }

    /// Append a marker to `stream` and read the stream from its first
    /// record up to that marker, handing each record to `each`. Returns how
    /// many records were read.
    pub async fn read_all(
        &self,
        stream: &str,
        mut each: impl FnMut(Record) -> Result<(), StateError>,
    ) -> Result<u64, StateError> {
        let nonce = fresh_nonce();
        self.append(stream, &[Record::Marker { nonce }.encode()])
            .await
            .await?;
        let channel = self.channel().await?;
        let result = async {
            channel
                .basic_qos(READ_PREFETCH, BasicQosOptions { global: false })
                .await
                .map_err(protocol("basic.qos for a stream read"))?;
            let mut args = FieldTable::default();
            args.insert(
                "x-stream-offset".into(),
                AMQPValue::LongString(LongString::from("first")),
            );
            let tag = format!("delayd-state-read-{nonce:x}");
            let mut consumer = channel
                .basic_consume(
                    short_string(stream, "stream name").map_err(AmqpError::from)?,
                    short_string(&tag, "consumer tag").map_err(AmqpError::from)?,
                    BasicConsumeOptions::default(),
                    args,
                )
                .await
                .map_err(protocol(format!("reading stream {stream}")))?;
            let mut read = 0u64;
            let mut unacked = 0u32;
            loop {
                let next = tokio::time::timeout(READ_STALL, consumer.next()).await;
                let delivery = match next {
                    Err(_) | Ok(None) => {
                        return Err(StateError::Stalled {
                            stream: stream.to_owned(),
                            records: read,
                        })
                    }
                    Ok(Some(d)) => d.map_err(protocol(format!("reading stream {stream}")))?,
                };
                unacked += 1;
                if unacked >= u32::from(READ_PREFETCH) / 2 {
                    delivery
                        .ack(BasicAckOptions { multiple: true })
                        .await
                        .map_err(protocol("acking a stream read"))?;
                    unacked = 0;
                }
                let offset = stream_offset(&delivery.properties);
                let Some(record) = Record::decode(&delivery.data) else {
                    match delivery.data.first() {
                        Some(&version @ 2..=NEWEST_PLAUSIBLE_VERSION) => {
                            return Err(StateError::NewerFormat {
                                stream: stream.to_owned(),
                                offset,
                                version,
                            })
                        }
                        _ => {
                            // Not ours (stream names are predictable): one
                            // such record must not wedge the route for good.
                            tracing::error!(
                                stream,
                                offset,
                                bytes = delivery.data.len(),
                                "skipping an undecodable record in a state stream"
                            );
                            self.skipped.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                    }
                };
                if record == (Record::Marker { nonce }) {
                    let _ = channel
                        .basic_cancel(
                            short_string(&tag, "consumer tag").map_err(AmqpError::from)?,
                            BasicCancelOptions::default(),
                        )
                        .await;
                    return Ok(read);
                }
                read += 1;
                each(record)?;
            }
        }
        .await;
        let _ = channel.close(200, "OK".into()).await;
        result
    }

    /// The live Schedules of generation stream `stream`, in stream order
    /// (Schedules applied, Dones removing them), added to `live`.
    pub async fn read_live(
        &self,
        stream: &str,
        live: &mut HashMap<u128, LiveRecord>,
        order: &mut Vec<u128>,
    ) -> Result<u64, StateError> {
        self.read_all(stream, |record| {
            match record {
                Record::Schedule {
                    id,
                    due_ms,
                    message,
                } => {
                    if live
                        .insert(
                            id,
                            LiveRecord {
                                id,
                                due_ms,
                                message,
                            },
                        )
                        .is_none()
                    {
                        order.push(id);
                    }
                }
                Record::Done { id } => {
                    live.remove(&id);
                }
                Record::Marker { .. } | Record::Generation { .. } => {}
            }
            Ok(())
        })
        .await
    }

    /// The generation the pointer stream names last (`None`: no state yet).
    pub async fn current_generation(&self) -> Result<Option<u64>, StateError> {
        self.declare_stream(&self.names.pointer).await?;
        let mut last = None;
        self.read_all(&self.names.pointer.clone(), |record| {
            if let Record::Generation { generation } = record {
                last = Some(generation);
            }
            Ok(())
        })
        .await?;
        Ok(last)
    }
}

/// The `x-stream-offset` header of a stream delivery (-1 if missing).
fn stream_offset(properties: &BasicProperties) -> i64 {
    properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("x-stream-offset"))
        .and_then(|v| match v {
            AMQPValue::LongLongInt(o) => Some(*o),
            AMQPValue::LongInt(o) => Some(i64::from(*o)),
            _ => None,
        })
        .unwrap_or(-1)
}

/// A value no other reader or instance will draw.
pub fn fresh_nonce() -> u128 {
    use std::hash::{BuildHasher, Hasher};
    let mut high = std::collections::hash_map::RandomState::new().build_hasher();
    high.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    high.write_u32(std::process::id());
    let mut low = std::collections::hash_map::RandomState::new().build_hasher();
    low.write_u64(high.finish());
    (u128::from(high.finish()) << 64) | u128::from(low.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_garbage_is_refused() {
        let records = [
            Record::Schedule {
                id: u128::MAX - 7,
                due_ms: 1_700_000_000_123,
                message: b"\x00body\xff".to_vec(),
            },
            Record::Schedule {
                id: 1,
                due_ms: 0,
                message: Vec::new(),
            },
            Record::Done { id: 42 << 64 | 9 },
            Record::Marker { nonce: 5 },
            Record::Generation { generation: 17 },
        ];
        for record in records {
            assert_eq!(Record::decode(&record.encode()), Some(record.clone()));
        }
        assert_eq!(Record::decode(b""), None);
        assert_eq!(Record::decode(&[2, DONE]), None, "unknown version");
        assert_eq!(Record::decode(&[VERSION, DONE, 1, 2]), None, "short Done");
        assert_eq!(Record::decode(&[VERSION, 9]), None, "unknown kind");
        assert_eq!(
            Record::decode(&[VERSION, SCHEDULE, 0, 0]),
            None,
            "short Schedule"
        );
    }

    #[test]
    fn nonces_differ() {
        let a: std::collections::HashSet<u128> = (0..1000).map(|_| fresh_nonce()).collect();
        assert_eq!(a.len(), 1000);
    }

    #[test]
    fn names_derive_from_the_pointer() {
        let n = StateNames::new("delayd.state.orders");
        assert_eq!(n.lock(), "delayd.state.orders.lock");
        assert_eq!(n.generation(3), "delayd.state.orders.3");
    }
}
