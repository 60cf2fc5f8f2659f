//! The broker-kept store's RabbitMQ side (`[store] kind = "broker"`): a
//! lock that makes one instance the route's owner, and the streams that
//! hold the route's pending messages.
//!
//! # Ownership
//! Every instance keeps a consumer on the route's lock queue
//! `<prefix><route>.lock` (a quorum queue with `x-single-active-consumer`).
//! RabbitMQ delivers to one consumer at a time, and moves to the next when
//! that one's channel closes (a crash, a lost network after the heartbeat
//! timeout, a stop), when the queue is deleted or its node restarts (the
//! consumer is cancelled), or, on a quorum queue, when the consumer's node
//! is suspected down (without a word to the old consumer). Each instance
//! pings the queue every second (a fifth of the lease if that is less); the one that receives a ping (anyone's)
//! is the active consumer and owns the route ([`Candidate::elected`]).
//!
//! The lock can thus move while the old owner's connection stays up, so
//! the owner holds it as a lease ([`Lease`]): it counts the lock lost when
//! its consumer is cancelled or none of its own pings sent within its lease
//! (`store.lease`, [`LOCK_LEASE`] by default) came back, then closes its
//! connection at once, and it checks the lease before every
//! write and again once the write is confirmed (a write confirmed after the
//! lease ran out does not count: its delivery is not acked). A new owner
//! waits the lease and a margin after its election, with the turn its own
//! throughout (its own pings come back in order and on time:
//! `Candidate::watch_unbroken`), and checks that its own ping still
//! reaches it, before it reads anything. `state/lock_model.rs` checks the
//! protocol against a model of the broker's single active consumer. Every write to
//! the state streams goes over the owner's lock connection
//! ([`StateSession`]), so a write that counts was made before the next
//! owner reads, and the next owner reads it. The route's ingress queue is
//! declared with `x-single-active-consumer` too, so even a former owner
//! whose consumer lingers cannot take deliveries beside the new one.
//!
//! # Streams
//! A stream (`x-queue-type = stream`) is never compacted by the broker, and
//! its retention drops by age or size, not by what is still needed. So the
//! route's state lives in *generations*, each a stream that is deleted
//! whole once a newer one holds everything still live:
//!
//! * `<prefix><route>` and `<prefix><route>.pointer`: the pointer streams.
//!   Their records name the current generation ([`Record::Generation`]);
//!   every one goes to both, the highest wins (generations only grow), so
//!   one of them deleted loses nothing. Each is rotated (deleted and given
//!   the current generation again, while the other holds it) once it holds
//!   [`POINTER_ROTATE`] records.
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
//! Read the pointers' highest `Generation(n)`, then generation `n` (which
//! must exist: if it was deleted, recovery refuses rather than start the
//! route without its messages) and `n + 1` (declared if missing: a
//! checkpoint may have stopped before its pointer record):
//! Schedules and Dones applied in order give the live set. Then write a
//! checkpoint into `n + 2`, which ends the older generations (the owner
//! also deletes those below `n` that a crash left, see
//! `delete_orphans` in delayd's `runtime::store::rabbitmq`). A former
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
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::protocol::AMQPSoftError;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use tracing::debug;

use super::connection::AmqpError;
use super::convert::short_string;
use super::packed::PACKED_VERSION;
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
    /// This instance no longer holds the route's lock: nothing more may be
    /// written for it (a write now could land in a generation the next
    /// owner has already read).
    #[error("the lock on {lock} is lost")]
    LockLost { lock: String },
    /// A state stream that the pointer names does not exist: its records
    /// are gone, and restoring without them would start the route empty.
    #[error("state stream {stream} is missing: the pointer names generation {generation}, but the stream was deleted; refusing to start the route without its pending messages (see docs/broker-store.md, \"A missing state stream\")")]
    Missing { stream: String, generation: u64 },
    /// A candidate left the lock queue on purpose (it owns its share of a
    /// partitioned route's partitions already).
    #[error("stood down from the lock on {lock}")]
    StoodDown { lock: String },
    /// The broker did not confirm a state write in time.
    #[error("the broker did not confirm a write to {stream} within {timeout:?}")]
    TimedOut { stream: String, timeout: Duration },
    /// The broker did not answer a request in time (a node cut off from
    /// the rest of its cluster takes connections and never answers a
    /// declare).
    #[error("the broker did not answer {what} within {timeout:?}")]
    Unanswered { what: String, timeout: Duration },
    /// A read made no progress for too long.
    #[error("reading stream {stream} stalled after {records} records")]
    Stalled { stream: String, records: u64 },
    /// A record written by a newer delayd (a format version this one does
    /// not know): refused rather than skipped, since skipping a Schedule
    /// would lose its message.
    #[error("stream {stream}: the record at offset {offset} has format version {version}, in a form this delayd does not read (it writes version {VERSION} records, packed as version {PACKED_VERSION}); run the delayd version that wrote it")]
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
    /// A Schedule whose message goes out under `identity`, not under its
    /// key `id`: a redelivery stored again under a sibling's identity (its
    /// ack was in doubt), keyed by its own so that a twin is never one key
    /// with its sibling. Written with version byte 3, so that a delayd that
    /// does not know it refuses the stream rather than skip a Schedule.
    Copy {
        id: u128,
        identity: u128,
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
    /// A stream ingress (`queue`) is durable in the state up to `next`
    /// (exclusive): a new owner reads it from there.
    Offset {
        queue: String,
        next: i64,
    },
    /// A message that left (delivered, parked or cancelled) recently: what
    /// a new owner needs to know a late redelivery of it (see
    /// delayd's `runtime::store::departed`). `fingerprint` and `digest` are
    /// the engine's (of the route and the encoded message). Written after
    /// the message's Done, which alone decides that it left: a delayd that
    /// does not know this record skips it.
    Remembered {
        id: u128,
        fingerprint: u64,
        digest: [u8; 32],
        cancelled: bool,
    },
}

const VERSION: u8 = 1;
/// The version byte of a [`Record::Copy`] (2 begins a packed message:
/// `super::packed::PACKED_VERSION`).
const COPY_VERSION: u8 = 3;
/// Version bytes above [`VERSION`] up to this are a newer delayd's formats;
/// any other undecodable record is garbage, skipped and counted.
const NEWEST_PLAUSIBLE_VERSION: u8 = 15;
const SCHEDULE: u8 = 1;
const DONE: u8 = 2;
const MARKER: u8 = 3;
const GENERATION: u8 = 4;
const OFFSET: u8 = 5;
const REMEMBERED: u8 = 6;

impl Record {
    /// Version byte, kind byte, then the fields big endian.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![VERSION];
        match self {
            Record::Copy {
                id,
                identity,
                due_ms,
                message,
            } => {
                out[0] = COPY_VERSION;
                out.reserve(42 + message.len());
                out.push(SCHEDULE);
                out.extend_from_slice(&id.to_be_bytes());
                out.extend_from_slice(&identity.to_be_bytes());
                out.extend_from_slice(&due_ms.to_be_bytes());
                out.extend_from_slice(message);
            }
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
            Record::Offset { queue, next } => {
                out.push(OFFSET);
                out.extend_from_slice(&next.to_be_bytes());
                out.extend_from_slice(queue.as_bytes());
            }
            Record::Remembered {
                id,
                fingerprint,
                digest,
                cancelled,
            } => {
                out.push(REMEMBERED);
                out.extend_from_slice(&id.to_be_bytes());
                out.extend_from_slice(&fingerprint.to_be_bytes());
                out.extend_from_slice(digest);
                out.push(u8::from(*cancelled));
            }
        }
        out
    }

    /// The record in `bytes`, or `None` if it is not one of ours.
    pub fn decode(bytes: &[u8]) -> Option<Record> {
        let (&version, rest) = bytes.split_first()?;
        let (&kind, rest) = rest.split_first()?;
        let u128_at = |b: &[u8]| Some(u128::from_be_bytes(b.get(..16)?.try_into().ok()?));
        let u64_at = |b: &[u8]| Some(u64::from_be_bytes(b.get(..8)?.try_into().ok()?));
        if version == COPY_VERSION && kind == SCHEDULE {
            return Some(Record::Copy {
                id: u128_at(rest)?,
                identity: u128_at(rest.get(16..)?)?,
                due_ms: u64_at(rest.get(32..)?)?,
                message: rest.get(40..)?.to_vec(),
            });
        }
        if version != VERSION {
            return None;
        }
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
            OFFSET => Some(Record::Offset {
                next: u64_at(rest)? as i64,
                queue: String::from_utf8(rest.get(8..)?.to_vec()).ok()?,
            }),
            REMEMBERED if rest.len() == 57 && rest[56] <= 1 => Some(Record::Remembered {
                id: u128_at(rest)?,
                fingerprint: u64_at(rest.get(16..)?)?,
                digest: rest.get(24..56)?.try_into().ok()?,
                cancelled: rest[56] == 1,
            }),
            _ => None,
        }
    }
}

/// What a read of the state streams applies each record to, in stream
/// order.
pub trait ApplyRecord {
    fn apply(&mut self, record: Record);
}

impl ApplyRecord for LiveSet {
    fn apply(&mut self, record: Record) {
        LiveSet::apply(self, record);
    }
}

/// A generation read before its reader owned the route
/// ([`StateSession::read_ahead`]).
#[derive(Debug, Clone)]
pub struct ReadAhead<S> {
    /// The generation read.
    pub generation: u64,
    /// The offset after the read's marker: where [`StateSession::catch_up`]
    /// goes on.
    resume_at: i64,
    pub state: S,
    /// Records read.
    pub read: u64,
}

/// A pending message read back from a generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveRecord {
    /// The record's key: what its Done names.
    pub id: u128,
    /// The identity it goes out under: `id`, but for a [`Record::Copy`].
    pub identity: u128,
    pub due_ms: u64,
    pub message: Vec<u8>,
}

impl LiveRecord {
    /// The record that writes it again (a restore's, a checkpoint's copy).
    pub fn record(&self) -> Record {
        if self.identity == self.id {
            Record::Schedule {
                id: self.id,
                due_ms: self.due_ms,
                message: self.message.clone(),
            }
        } else {
            Record::Copy {
                id: self.id,
                identity: self.identity,
                due_ms: self.due_ms,
                message: self.message.clone(),
            }
        }
    }
}

/// A generation's records applied in stream order: the live Schedules
/// (a Done removes its Schedule) and the highest [`Record::Offset`] of each
/// stream ingress.
#[derive(Debug, Default, Clone)]
pub struct LiveSet {
    live: HashMap<u128, LiveRecord>,
    /// Ids in the order first written.
    order: Vec<u128>,
    offsets: HashMap<String, i64>,
    /// The live records' message bytes.
    bytes: usize,
}

impl LiveSet {
    /// Apply one record; a Done returns the Schedule it ended.
    pub fn apply(&mut self, record: Record) -> Option<LiveRecord> {
        match record {
            Record::Schedule {
                id,
                due_ms,
                message,
            } => self.schedule(LiveRecord {
                id,
                identity: id,
                due_ms,
                message,
            }),
            Record::Copy {
                id,
                identity,
                due_ms,
                message,
            } => self.schedule(LiveRecord {
                id,
                identity,
                due_ms,
                message,
            }),
            Record::Done { id } => {
                let ended = self.live.remove(&id);
                if let Some(ended) = &ended {
                    self.bytes -= ended.message.len();
                }
                ended
            }
            Record::Offset { queue, next } => {
                let at = self.offsets.entry(queue).or_insert(next);
                *at = (*at).max(next);
                None
            }
            Record::Marker { .. } | Record::Generation { .. } | Record::Remembered { .. } => None,
        }
    }

    fn schedule(&mut self, record: LiveRecord) -> Option<LiveRecord> {
        let id = record.id;
        self.bytes += record.message.len();
        match self.live.insert(id, record) {
            Some(replaced) => self.bytes -= replaced.message.len(),
            None => self.order.push(id),
        }
        None
    }

    /// The live records' message bytes: what holding the set costs.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The live records, in no particular order.
    pub fn live(&self) -> impl Iterator<Item = &LiveRecord> {
        self.live.values()
    }

    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// The live records in the order first written, and the offsets.
    pub fn finish(mut self) -> (Vec<LiveRecord>, HashMap<String, i64>) {
        let live = self
            .order
            .iter()
            .filter_map(|id| self.live.remove(id))
            .collect();
        (live, self.offsets)
    }
}

/// The names of one route's lock and streams, and how streams are created
/// and written.
#[derive(Debug, Clone)]
pub struct StateNames {
    /// The pointer stream, `<prefix><route>`.
    pub pointer: String,
    /// Replicas of each stream delayd creates (`x-initial-cluster-size`);
    /// `None`: RabbitMQ's default, every node of the cluster.
    pub replicas: Option<u16>,
    /// How long a write may wait for the broker (see [`APPEND_TIMEOUT`]).
    pub append_timeout: Duration,
    /// The owner's lease on the lock (see [`LOCK_LEASE`]).
    pub lease: Duration,
}

impl StateNames {
    pub fn new(pointer: impl Into<String>) -> Self {
        Self {
            pointer: pointer.into(),
            replicas: None,
            append_timeout: APPEND_TIMEOUT,
            lease: LOCK_LEASE,
        }
    }

    /// The owner holds the lock for `lease` past the last ping that reached
    /// it; a lock queue declared from now on gives a consumer on a lost
    /// node up after `lease` too.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// What a new owner waits beyond the lease before it reads: a clock
    /// drift allowance (see [`Lease::renew_from`] for why no transit time).
    pub fn margin(&self) -> Duration {
        self.lease / LEASE_MARGIN_DIVISOR
    }

    /// How often to ping the lock queue.
    pub fn ping_every(&self) -> Duration {
        PING_EVERY.min(self.lease / 5)
    }

    /// How often a chosen candidate pings itself while it waits out the
    /// lease (see `Candidate::watch_unbroken`).
    pub fn wait_ping_every(&self) -> Duration {
        (self.lease / 20).max(Duration::from_millis(5))
    }

    /// How late a chosen candidate's ping may come back before its wait
    /// starts over. With [`Self::wait_ping_every`] it stays under the lock
    /// queue's disconnected timeout ([`Self::disconnected_timeout`]), so the
    /// turn cannot move away from a waiting candidate unnoticed.
    pub fn wait_ping_late(&self) -> Duration {
        self.lease / 8
    }

    /// After how long the lock queue gives up a consumer on a lost node.
    pub fn disconnected_timeout(&self) -> Duration {
        self.lease / LOCK_TAKEOVER_DIVISOR
    }

    /// Writes wait at most `timeout` for the broker.
    pub fn with_append_timeout(mut self, timeout: Duration) -> Self {
        self.append_timeout = timeout;
        self
    }

    /// Streams created from now on get `replicas` replicas.
    pub fn with_replicas(mut self, replicas: Option<u16>) -> Self {
        self.replicas = replicas;
        self
    }

    /// The exclusive queue whose holder owns the route.
    pub fn lock(&self) -> String {
        format!("{}.lock", self.pointer)
    }

    /// The pointer's copy: every `Generation` record goes to both, so that
    /// one of them deleted (by hand, or while it is being rotated) loses
    /// nothing.
    pub fn pointer_copy(&self) -> String {
        format!("{}.pointer", self.pointer)
    }

    /// Both pointer streams.
    pub fn pointers(&self) -> [String; 2] {
        [self.pointer.clone(), self.pointer_copy()]
    }

    /// Generation `n`'s stream.
    pub fn generation(&self, n: u64) -> String {
        format!("{}.{n}", self.pointer)
    }
}

/// How often a write waiting for its confirm looks at the lease.
const LOST_POLL: Duration = Duration::from_millis(20);

/// How long a read may go without a record before it is given up.
const READ_STALL: Duration = Duration::from_secs(30);

/// Records a reader takes before acking (streams need acks for credit).
const READ_PREFETCH: u16 = 2000;

/// How long an owner may go without a ping before it counts its lock as
/// lost, by default (`store.lease`, [`StateNames::with_lease`]). A quorum
/// lock queue can move its active consumer without telling the old one (a
/// consumer suspected down), so the owner checks that pings still reach it,
/// and a new owner waits this long plus a margin ([`StateNames::margin`])
/// before it reads anything: by then the former owner has stopped writing.
pub const LOCK_LEASE: Duration = Duration::from_secs(5);

/// A new owner waits the lease and a twentieth of it: two monotonic clocks
/// run at rates that differ by parts per million (500 at most while NTP
/// slews one), and a twentieth is 50,000. No transit time is needed: an
/// owner's lease runs from when its ping was sent ([`Lease::renew_from`]).
const LEASE_MARGIN_DIVISOR: u32 = 20;

/// How often an owner and its candidates ping the lock queue, at most; a
/// fifth of the lease if that is less, so a late ping or two never ends it.
const PING_EVERY: Duration = Duration::from_secs(1);

/// A chosen candidate's pings to itself while it waits out the lease
/// (`Candidate::watch_unbroken`; the lock model drives this same code).
/// Sent in sequence, they must come back in order and on time: one that
/// comes back out of order went to another consumer, and one that is late
/// may be held while the turn moves away.
pub(crate) struct WaitPings {
    nonce: [u8; 8],
    late: Duration,
    next_seq: u64,
    /// Sent and not back yet: (sequence, sent at).
    outstanding: std::collections::VecDeque<(u64, Instant)>,
}

impl WaitPings {
    pub(crate) fn new(nonce: u64, late: Duration) -> Self {
        Self {
            nonce: nonce.to_be_bytes(),
            late,
            next_seq: 0,
            outstanding: Default::default(),
        }
    }

    /// The next ping's body, sent at `at`.
    pub(crate) fn send(&mut self, at: Instant) -> [u8; 16] {
        let mut body = [0u8; 16];
        body[..8].copy_from_slice(&self.nonce);
        body[8..].copy_from_slice(&self.next_seq.to_be_bytes());
        self.outstanding.push_back((self.next_seq, at));
        self.next_seq += 1;
        body
    }

    /// A delivery came: false if it is one of these pings out of order.
    /// Anything else (another instance's ping) changes nothing.
    pub(crate) fn arrived(&mut self, body: &[u8]) -> bool {
        if body.len() != 16 || body[..8] != self.nonce {
            return true;
        }
        let seq = u64::from_be_bytes(body[8..].try_into().expect("8 bytes"));
        self.outstanding.pop_front().is_some_and(|(s, _)| s == seq)
    }

    /// Whether a ping is later than allowed at `now`.
    pub(crate) fn late_at(&self, now: Instant) -> bool {
        self.outstanding
            .front()
            .is_some_and(|&(_, sent)| now.saturating_duration_since(sent) > self.late)
    }

    /// When the oldest ping not back turns late.
    pub(crate) fn late_from(&self) -> Option<Instant> {
        self.outstanding
            .front()
            .map(|&(_, sent)| sent + self.late + Duration::from_millis(1))
    }
}

/// How long a state write may wait for the broker's confirm by default
/// (`store.write_timeout`): a broker that blocks publishers (a resource
/// alarm) must not keep an owner restoring, or writing, for ever.
pub const APPEND_TIMEOUT: Duration = Duration::from_secs(30);

/// Records a pointer stream may hold before it is rotated (emptied and
/// given the current generation again): it would otherwise grow by a record
/// per checkpoint and per read marker, and it is read in full at every
/// election.
pub const POINTER_ROTATE: u64 = 1000;

/// What a candidate saw while it waited ([`Candidate::elected`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waiting {
    /// A round without a ping: another instance owns the route.
    Standby,
    /// A ping came: the lock is this candidate's, and it now waits out a
    /// former owner's lease before it reads (time to read ahead:
    /// [`StateSession::read_ahead`]).
    Chosen,
}

/// How a chosen candidate's wait ended (`Candidate::watch_unbroken`).
enum Waited {
    /// Waited out, the turn its own throughout.
    Over,
    /// The former owner handed the route over (see [`handover`]).
    HandedOver,
    /// The turn may have moved away: the wait starts over.
    Broken,
}

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
            let lock = declare_lock_queue(&connection, lock, &queue, names.lease).await?;
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
    ///
    /// Once a ping arrives, it waits out the lease (a former owner
    /// whose consumer was moved without a cancel stops writing by then) and
    /// checks that its own ping still reaches it before it owns anything.
    pub async fn elected(
        mut self,
        every: Duration,
        mut seen: impl FnMut(Waiting),
    ) -> Result<StateSession, StateError> {
        match self.wait_elected(every, &mut seen).await {
            Ok(held_from) => self.into_session(every, held_from).await,
            Err(e) => {
                // Not elected: this connection is of no further use.
                self.close().await;
                Err(e)
            }
        }
    }

    /// [`Candidate::elected`], unless `stand_down` resolves first: then the
    /// candidate leaves the lock queue (its connection closed) and this
    /// returns [`StateError::StoodDown`].
    pub async fn elected_unless(
        mut self,
        every: Duration,
        mut seen: impl FnMut(Waiting),
        stand_down: impl std::future::Future<Output = ()>,
    ) -> Result<StateSession, StateError> {
        let waited = tokio::select! {
            w = self.wait_elected(every, &mut seen) => Some(w),
            _ = stand_down => None,
        };
        match waited {
            Some(Ok(held_from)) => self.into_session(every, held_from).await,
            Some(Err(e)) => {
                self.close().await;
                Err(e)
            }
            None => {
                self.close().await;
                Err(StateError::StoodDown {
                    lock: self.names.lock(),
                })
            }
        }
    }

    /// Returns when this candidate's own ping, the one that proved it
    /// active, was first sent: its lease runs from there.
    async fn wait_elected(
        &mut self,
        every: Duration,
        seen: &mut impl FnMut(Waiting),
    ) -> Result<std::time::Instant, StateError> {
        loop {
            let Some((_, first)) = self.wait_for_ping(every, seen, None).await? else {
                continue; // not returned without `own`
            };
            seen(Waiting::Chosen);
            let deadline = tokio::time::Instant::now() + self.names.lease + self.names.margin();
            let mut handover = handover::Seen::default();
            handover.committed(&first);
            match self.watch_unbroken(deadline, &mut handover).await? {
                Waited::Over => {}
                Waited::HandedOver => {
                    tracing::info!(lock = %self.names.lock(), "the former owner stopped and handed the route over: not waiting out its lease");
                }
                Waited::Broken => {
                    tracing::debug!(lock = %self.names.lock(), "a ping of this candidate's wait came back late or not at all: the turn may have moved away and back; waiting again");
                    continue;
                }
            }
            let nonce = fresh_nonce().to_be_bytes();
            if let Some((sent, _)) = self.wait_for_ping(every, seen, Some(&nonce)).await? {
                return Ok(sent);
            }
        }
    }

    /// Wait until `deadline` while the turn stays this candidate's: true if
    /// it did, false if the wait must start over.
    ///
    /// The lease is waited out from the candidate's first ping, but the
    /// single active consumer can move away from a candidate whose node
    /// drops out, and back, without a word. An owner that had the turn in
    /// between may still hold its lease when this wait ends: the lock
    /// model (`state/lock_model.rs`) found two owners that way. So the
    /// candidate pings itself every [`StateNames::wait_ping_every`]
    /// throughout, and a ping of its own that comes back out of order or
    /// later than [`StateNames::wait_ping_late`] ends the wait: the turn
    /// moves only after the lock queue's disconnected timeout, longer than
    /// the two, so it cannot move away unnoticed.
    ///
    /// It fails as soon as the lock consumer does: a drained node closes a
    /// standby's connection just as the route comes to it, and a plain sleep
    /// noticed that only at the next ping, a lease later. Other pings that
    /// arrive meanwhile are older than the one the wait ends with, and
    /// would be passed over anyway.
    ///
    /// A former owner that stopped on purpose ends the wait early with a
    /// `Handover` and its `Commit` (see [`handover`]).
    async fn watch_unbroken(
        &mut self,
        deadline: tokio::time::Instant,
        handover: &mut handover::Seen,
    ) -> Result<Waited, StateError> {
        let queue = short_string(&self.names.lock(), "lock queue name").map_err(AmqpError::from)?;
        let every = self.names.wait_ping_every();
        let mut pings = WaitPings::new(fresh_nonce() as u64, self.names.wait_ping_late());
        let mut next_ping = tokio::time::Instant::now();
        loop {
            let now = tokio::time::Instant::now();
            if pings.late_at(now.into_std()) {
                return Ok(Waited::Broken);
            }
            if now >= deadline {
                return Ok(Waited::Over);
            }
            if now >= next_ping {
                let body = pings.send(now.into_std());
                self.lock
                    .basic_publish(
                        "".into(),
                        queue.clone(),
                        BasicPublishOptions::default(),
                        &body,
                        BasicProperties::default(),
                    )
                    .await
                    .map_err(protocol("pinging the lock queue"))?;
                next_ping = now + every;
            }
            let mut wake = deadline.min(next_ping);
            if let Some(late) = pings.late_from() {
                wake = wake.min(tokio::time::Instant::from_std(late));
            }
            match tokio::time::timeout_at(wake, self.consumer.next()).await {
                Err(_) => {}
                Ok(Some(Ok(d))) => {
                    if handover.committed(&d.data) {
                        return Ok(Waited::HandedOver);
                    }
                    if !pings.arrived(&d.data) {
                        return Ok(Waited::Broken);
                    }
                }
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

    /// Ping until a ping reaches this consumer (`own`: until that ping,
    /// within two rounds). Returns when the ping that came was first sent
    /// (`own`), or when the round began, with what came; None if `own` did
    /// not come.
    async fn wait_for_ping(
        &mut self,
        every: Duration,
        seen: &mut impl FnMut(Waiting),
        own: Option<&[u8]>,
    ) -> Result<Option<(std::time::Instant, Vec<u8>)>, StateError> {
        let queue = short_string(&self.names.lock(), "lock queue name").map_err(AmqpError::from)?;
        let mut rounds = 0;
        let mut first_sent = None;
        loop {
            let body = own.unwrap_or(b"ping");
            let sent = *first_sent.get_or_insert_with(std::time::Instant::now);
            self.lock
                .basic_publish(
                    "".into(),
                    queue.clone(),
                    BasicPublishOptions::default(),
                    body,
                    BasicProperties::default(),
                )
                .await
                .map_err(protocol("pinging the lock queue"))?;
            let deadline = tokio::time::Instant::now() + every;
            loop {
                match tokio::time::timeout_at(deadline, self.consumer.next()).await {
                    Err(_) => break, // no ping this round
                    Ok(Some(Ok(d))) => match own {
                        None => return Ok(Some((sent, d.data))),
                        Some(own) if d.data == own => return Ok(Some((sent, d.data))),
                        Some(_) => {} // an older ping, or a standby's
                    },
                    Ok(Some(Err(e))) => return Err(protocol("waiting on the lock queue")(e)),
                    Ok(None) => {
                        return Err(StateError::Refused {
                            stream: self.names.lock(),
                            why: "the lock consumer was cancelled",
                        })
                    }
                }
            }
            rounds += 1;
            if own.is_some() && rounds >= 2 {
                return Ok(None); // the lock moved on while this one waited
            }
            seen(Waiting::Standby); // not active: another instance owns the route
        }
    }

    /// Elected: open the writer channel on the lock connection. The lease
    /// is held from `held_from`, when the ping that proved it was sent.
    async fn into_session(
        self,
        every: Duration,
        held_from: std::time::Instant,
    ) -> Result<StateSession, StateError> {
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
        let connection = Arc::new(self.connection);
        let lease = Arc::new(Lease::new(self.names.lease, held_from));
        let queue = short_string(&self.names.lock(), "lock queue name").map_err(AmqpError::from)?;
        let lock = Some((self.lock.clone(), self.consumer.tag()));
        let drain = tokio::spawn(hold(
            lease.clone(),
            connection.clone(),
            self.lock,
            self.consumer,
            queue,
            every,
        ));
        Ok(StateSession {
            connection,
            writer,
            names: self.names,
            drain,
            lease,
            lock,
            skipped: AtomicU64::new(0),
            pointer_records: Mutex::new([0; 2]),
        })
    }

    /// Give up waiting.
    pub async fn close(&self) {
        let _ = self.connection.close(200, "delayd stops".into()).await;
    }
}

/// The instances that share a partitioned route: each holds one consumer
/// on a quorum queue nothing is ever published to, and the queue's consumer
/// count is how many there are. A consumer on a lost node goes after
/// [`LOCK_LEASE`], like a lock's.
pub struct Presence {
    connection: Connection,
    channel: Channel,
    _consumer: lapin::Consumer,
    queue: lapin::types::ShortString,
}

impl Presence {
    pub async fn join(connection: Connection, queue: &str) -> Result<Self, StateError> {
        let joined = async {
            let channel = connection
                .create_channel()
                .await
                .map_err(protocol("opening the presence channel"))?;
            let name = short_string(queue, "presence queue name").map_err(AmqpError::from)?;
            channel
                .queue_declare(
                    name.clone(),
                    QueueDeclareOptions::durable(),
                    quorum_leased(LOCK_LEASE),
                )
                .await
                .map_err(protocol(format!("declaring the presence queue {queue}")))?;
            let tag = format!("delayd-member-{:x}", fresh_nonce());
            let consumer = channel
                .basic_consume(
                    name.clone(),
                    short_string(&tag, "consumer tag").map_err(AmqpError::from)?,
                    BasicConsumeOptions {
                        no_ack: true,
                        ..BasicConsumeOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(protocol(format!("consuming the presence queue {queue}")))?;
            Ok::<_, StateError>((channel, consumer, name))
        }
        .await;
        match joined {
            Ok((channel, consumer, queue)) => Ok(Self {
                connection,
                channel,
                _consumer: consumer,
                queue,
            }),
            Err(e) => {
                let _ = connection.close(200, "presence failed".into()).await;
                Err(e)
            }
        }
    }

    /// How many instances are present (this one included).
    pub async fn count(&self) -> Result<u32, StateError> {
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let queue = self
            .channel
            .queue_declare(self.queue.clone(), passive, FieldTable::default())
            .await
            .map_err(protocol(format!("counting the members of {}", self.queue)))?;
        Ok(queue.consumer_count())
    }

    pub fn is_alive(&self) -> bool {
        self.connection.status().connected() && self.channel.status().connected()
    }

    pub async fn leave(&self) {
        let _ = self.connection.close(200, "delayd stops".into()).await;
    }
}

/// The arguments of a quorum queue whose consumers on a lost node are
/// given up after `timeout` (RabbitMQ 4's default is 60 s). A presence queue
/// keeps [`LOCK_LEASE`]: its count is no lock, and redeclaring it with
/// another timeout would fail.
fn quorum_leased(timeout: Duration) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    args.insert(
        "x-consumer-disconnected-timeout".into(),
        AMQPValue::LongLongInt(timeout.as_millis() as i64),
    );
    args
}

/// A lock queue gives a consumer on a lost node up after a quarter of the
/// lease. It is time without an owner after a node dies, and it was the
/// whole lease until 2026-11-30. Safety rests on it in one way only: it
/// must be longer than a chosen candidate's ping interval and lateness
/// ([`StateNames::wait_ping_every`], [`StateNames::wait_ping_late`]), so that
/// the turn cannot move away from a waiting candidate unnoticed (a longer
/// timeout, as an older delayd declared, is safe). RabbitMQ suspects a node
/// only when its distribution link drops (a closed connection, or
/// `net_ticktime`, 60 s), which a healthy node does not do for a quarter of
/// a second.
const LOCK_TAKEOVER_DIVISOR: u32 = 4;

/// The route's lock queue: a quorum queue, which outlives the loss of a
/// node, with `x-single-active-consumer`, and a consumer on a lost node
/// given up after a quarter of the lease ([`LOCK_TAKEOVER_DIVISOR`]) rather
/// than RabbitMQ 4's 60 s.
fn lock_queue_arguments(lease: Duration) -> FieldTable {
    let mut args = quorum_leased(lease / LOCK_TAKEOVER_DIVISOR);
    args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    args
}

/// Declare the route's lock queue ([`lock_queue_arguments`]). One declared
/// otherwise (by an older delayd: classic, without the timeout, or with
/// another; or under another `store.lease`) is used as it is, with a
/// warning: redeclaring it with other arguments fails.
async fn declare_lock_queue(
    connection: &Connection,
    channel: Channel,
    queue: &lapin::types::ShortString,
    lease: Duration,
) -> Result<Channel, StateError> {
    let args = lock_queue_arguments(lease);
    let declared = channel
        .queue_declare(queue.clone(), QueueDeclareOptions::durable(), args)
        .await
        .map_err(protocol(format!("declaring the lock queue {queue}")));
    let Err(inequivalent) = declared else {
        return Ok(channel);
    };
    // PRECONDITION_FAILED closed the channel; does the queue exist?
    let channel = connection
        .create_channel()
        .await
        .map_err(protocol("opening the lock channel"))?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    match channel
        .queue_declare(queue.clone(), passive, FieldTable::default())
        .await
    {
        Ok(_) => {
            tracing::warn!(lock = %queue, lease_ms = lease.as_millis() as u64, "the route's lock queue exists with other arguments (an older delayd declared it classic, or quorum without x-consumer-disconnected-timeout, or with the whole lease as that timeout as delayd did before 2026-11-30, or store.lease was another): a classic one is unavailable while its node is down, and the lock moves off a lost node only after the x-consumer-disconnected-timeout it was declared with (RabbitMQ's default: 60 s); delete it while no delayd runs to have it declared again");
            Ok(channel)
        }
        Err(_) => Err(inequivalent),
    }
}

/// What an owner knows of its lock: when a ping last reached it, and
/// whether it has given the lock up. Writes are allowed only while it is
/// held (see [`LOCK_LEASE`]).
#[derive(Debug)]
pub struct Lease {
    started: Instant,
    /// Milliseconds after `started` at which the last ping that came back
    /// was sent.
    last_ping_ms: AtomicU64,
    lost: AtomicBool,
    lease: Duration,
    /// Marks this owner's own pings, the only ones that renew it.
    nonce: [u8; 8],
}

impl Lease {
    /// Held from `held_from`: when the ping that proved the lock was sent.
    fn new(lease: Duration, held_from: Instant) -> Self {
        Self {
            started: held_from,
            last_ping_ms: AtomicU64::new(0),
            lost: AtomicBool::new(false),
            lease,
            nonce: (fresh_nonce() as u64).to_be_bytes(),
        }
    }

    /// A ping of this owner's, stamped with when it is sent.
    fn ping(&self) -> [u8; 16] {
        self.ping_at(Instant::now())
    }

    fn ping_at(&self, now: Instant) -> [u8; 16] {
        let mut body = [0; 16];
        body[..8].copy_from_slice(&self.nonce);
        let ms = now.saturating_duration_since(self.started).as_millis() as u64;
        body[8..].copy_from_slice(&ms.to_be_bytes());
        body
    }

    /// A ping came back: renew from when it was *sent*, not when it
    /// arrived. Only the active consumer receives pings, so the broker
    /// handed the lock over after it delivered this one, and this one was
    /// sent before it was delivered: a lease counted from the send runs out
    /// no later than the lease after the hand-over, however long the ping
    /// then took to arrive (a queue behind a stalled link, a paused
    /// process). That is what lets the next owner wait only a drift margin
    /// beyond the lease (docs/broker-store.md). A ping of another instance
    /// renews nothing: its send time is not on this clock.
    fn renew_from(&self, ping: &[u8]) {
        if ping.len() != 16 || ping[..8] != self.nonce {
            return;
        }
        let sent_ms = u64::from_be_bytes(ping[8..].try_into().expect("8 bytes"));
        self.last_ping_ms.fetch_max(sent_ms, Ordering::AcqRel);
    }

    /// Renew as of now (an observer, which owns nothing).
    fn renew_now(&self) {
        self.renew_from(&self.ping());
    }

    fn lose(&self) {
        self.lost.store(true, Ordering::Release);
    }

    /// When the last own ping that came back was sent (the lease's start
    /// if none has).
    fn last_back_sent(&self) -> Instant {
        self.started + Duration::from_millis(self.last_ping_ms.load(Ordering::Acquire))
    }

    /// Held: not given up, and a ping that came back was sent within the
    /// lease. Read at every write, so a process that was paused past its
    /// lease finds out before it writes, not after.
    pub fn held(&self) -> bool {
        self.held_at(Instant::now())
    }

    /// Returns once the lease is no longer held.
    async fn until_lost(&self) {
        while self.held() {
            tokio::time::sleep(LOST_POLL).await;
        }
    }

    fn held_at(&self, now: Instant) -> bool {
        let since = (now.saturating_duration_since(self.started).as_millis() as u64)
            .saturating_sub(self.last_ping_ms.load(Ordering::Acquire));
        !self.lost.load(Ordering::Acquire) && since <= self.lease.as_millis() as u64
    }
}

/// The owner's side of its lock, until it is lost: ping the lock queue
/// every `every` (only the active consumer receives pings, anyone's), and
/// renew the lease by the own pings that come back. The lock is lost when
/// the broker cancels the consumer (the lock queue was deleted, its node
/// restarted), the channel closes, or no own ping sent within the lease
/// came back (the consumer was moved without a word). Then the connection
/// is closed at once: every state write goes over it, so none can follow.
async fn hold(
    lease: Arc<Lease>,
    connection: Arc<Connection>,
    lock: Channel,
    mut consumer: lapin::Consumer,
    queue: lapin::types::ShortString,
    every: Duration,
) {
    let mut tick = tokio::time::interval(every);
    let why = loop {
        tokio::select! {
            _ = tick.tick() => {
                if !lease.held() {
                    break "no ping reached this instance for the lock's lease";
                }
                let body = lease.ping();
                let ping = lock.basic_publish(
                    "".into(),
                    queue.clone(),
                    BasicPublishOptions::default(),
                    &body,
                    BasicProperties::default(),
                );
                if ping.await.is_err() {
                    break "the lock channel closed";
                }
            }
            next = consumer.next() => match next {
                Some(Ok(delivery)) => lease.renew_from(&delivery.data),
                Some(Err(_)) => break "the lock channel closed",
                None => break "the broker cancelled the lock consumer (the lock queue was deleted or its node restarted)",
            }
        }
    };
    lease.lose();
    tracing::error!(lock = %queue, why, "the route's lock is lost; closing its connection so that nothing more is written");
    let close = connection.close(200, "delayd lost the route's lock".into());
    let _ = tokio::time::timeout(Duration::from_secs(2), close).await;
}

/// One owner's connection: its lock consumer is the active one, and every
/// state write goes over it. When it closes, ownership is gone (see the
/// module doc).
pub struct StateSession {
    connection: Arc<Connection>,
    /// Confirm-mode channel for every write, in order.
    writer: Channel,
    names: StateNames,
    /// Holds the lock: pings, and closes the connection once it is lost.
    drain: tokio::task::JoinHandle<()>,
    lease: Arc<Lease>,
    /// The lock channel and its consumer's tag (an owner's; an observer
    /// has none), for a hand-over ([`StateSession::hand_over`]).
    lock: Option<(Channel, lapin::types::ShortString)>,
    /// Undecodable records skipped by reads so far (see [`StateSession::read_all`]).
    skipped: AtomicU64,
    /// Records in each pointer stream (as read, plus appended since), for
    /// their rotation.
    pointer_records: Mutex<[u64; 2]>,
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
        // Never expires: an observer writes only read markers.
        let lease = Arc::new(Lease::new(names.lease, std::time::Instant::now()));
        let every = names.ping_every();
        let drain = tokio::spawn({
            let lease = lease.clone();
            async move {
                loop {
                    lease.renew_now();
                    tokio::time::sleep(every).await;
                }
            }
        });
        Ok(StateSession {
            connection: Arc::new(connection),
            writer,
            names: names.clone(),
            drain,
            lease,
            lock: None,
            skipped: AtomicU64::new(0),
            pointer_records: Mutex::new([0; 2]),
        })
    }

    /// Undecodable records the reads of this session skipped.
    pub fn skipped(&self) -> u64 {
        self.skipped.load(Ordering::Relaxed)
    }

    pub fn names(&self) -> &StateNames {
        &self.names
    }

    /// Whether the lock (the connection, and its lease) is still held.
    pub fn is_alive(&self) -> bool {
        self.connection.status().connected()
            && self.writer.status().connected()
            && self.lease.held()
    }

    fn lock_lost(&self) -> StateError {
        StateError::LockLost {
            lock: self.names.lock(),
        }
    }

    /// Resolves once the lock is lost.
    pub async fn lost(&self) {
        while self.is_alive() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A planned stop: fence this owner (nothing more is written), give
    /// its lock consumer up and leave a `Handover` in the lock queue, then
    /// its `Commit` if the bound holds (see [`handover`]), so that the next
    /// owner need not wait out the lease. True if committed. The caller
    /// closes the session after it, committed or not.
    ///
    /// Call it once nothing more is owed: every Done written. A message
    /// whose Done comes after it fires again at the next owner, which no
    /// longer waits a lease before it reads.
    pub async fn hand_over(&self) -> Result<bool, StateError> {
        let Some((lock, tag)) = &self.lock else {
            return Ok(false);
        };
        self.drain.abort();
        let held = self.lease.held();
        self.lease.lose();
        if !held {
            return Ok(false);
        }
        let last_back_sent = self.lease.last_back_sent();
        lock.basic_cancel(tag.clone(), BasicCancelOptions::default())
            .await
            .map_err(protocol("giving up the lock consumer"))?;
        self.hand_over_for(last_back_sent).await
    }

    /// When the last own ping of this owner's lease that came back was
    /// sent; None for an observer. A session lost with its connection (a
    /// drain, a node stopped) can still be handed over from another
    /// session ([`StateSession::hand_over_for`]) within a lease of it.
    pub fn last_back_sent(&self) -> Option<Instant> {
        self.lock.as_ref().map(|_| self.lease.last_back_sent())
    }

    /// Leave a `Handover` in the lock queue for an owner that has stopped
    /// (fenced, its consumer gone with its connection or cancelled), and
    /// its `Commit` if the confirm comes within a lease of
    /// `last_back_sent` (see [`handover`]). On any session: a former
    /// owner's lost connection is replaced by an observer's. True if
    /// committed.
    pub async fn hand_over_for(&self, last_back_sent: Instant) -> Result<bool, StateError> {
        let nonce = fresh_nonce();
        if !self.note(handover::Note::Handover(nonce)).await? {
            return Ok(false);
        }
        if !handover::may_commit(last_back_sent, Instant::now(), self.names.lease) {
            debug!(lock = %self.names.lock(), "the hand-over was confirmed too late to commit; the next owner waits out the lease");
            return Ok(false);
        }
        self.note(handover::Note::Commit(nonce)).await
    }

    /// Publish `note` into the lock queue: true once confirmed (within
    /// the lease).
    async fn note(&self, note: handover::Note) -> Result<bool, StateError> {
        let queue = short_string(&self.names.lock(), "lock queue name").map_err(AmqpError::from)?;
        let confirm = async {
            self.writer
                .basic_publish(
                    "".into(),
                    queue,
                    BasicPublishOptions::default(),
                    &note.encode(),
                    BasicProperties::default(),
                )
                .await?
                .await
        };
        match tokio::time::timeout(self.names.lease, confirm).await {
            Ok(Ok(Confirmation::Ack(_))) => Ok(true),
            Ok(Ok(_)) | Err(_) => Ok(false),
            Ok(Err(e)) => Err(protocol("publishing a hand-over note")(e)),
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

    /// Declare stream `name` (idempotent), a missing one with
    /// [`StateNames::replicas`]. RabbitMQ refuses to redeclare a stream
    /// with another `x-initial-cluster-size` than it was created with (or
    /// without): such a stream, created before the setting changed, is used
    /// as it is.
    pub async fn declare_stream(&self, name: &str) -> Result<(), StateError> {
        let queue = short_string(name, "stream name").map_err(AmqpError::from)?;
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(LongString::from("stream")),
        );
        if let Some(replicas) = self.names.replicas {
            args.insert(
                "x-initial-cluster-size".into(),
                AMQPValue::LongInt(i32::from(replicas)),
            );
        }
        let channel = self.channel().await?;
        let declared = channel
            .queue_declare(queue.clone(), QueueDeclareOptions::durable(), args)
            .await;
        let _ = channel.close(200, "OK".into()).await;
        let Err(inequivalent) = declared else {
            return Ok(());
        };
        // PRECONDITION_FAILED closed that channel; does the stream exist?
        let channel = self.channel().await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let exists = channel
            .queue_declare(queue, passive, FieldTable::default())
            .await;
        let _ = channel.close(200, "OK".into()).await;
        match exists {
            Ok(_) => Ok(()),
            Err(_) => Err(protocol(format!("declaring stream {name}"))(inequivalent)),
        }
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
        if !self.lease.held() {
            return Err(self.lock_lost());
        }
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
        if !self.lease.held() {
            let e = self.lock_lost();
            return Box::pin(async move { Err(e) });
        }
        let key = match short_string(stream, "stream name") {
            Ok(k) => k,
            Err(e) => {
                let e = StateError::Amqp(e.into());
                return Box::pin(async move { Err(e) });
            }
        };
        // A round's records in few messages (see `super::packed`).
        let messages = super::packed::pack(records);
        // Polled together, in order (see the sink): frames are queued on
        // the first poll, so the order on the wire is the order here.
        let sends = messages.iter().map(|body| {
            self.writer.basic_publish(
                "".into(),
                key.clone(),
                options,
                body,
                BasicProperties::default().with_delivery_mode(2),
            )
        });
        let timeout = self.names.append_timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let timed_out = move |stream: &str| StateError::TimedOut {
            stream: stream.to_owned(),
            timeout,
        };
        // A blocked connection is not read by the broker: once the socket's
        // buffers are full, even sending waits.
        let sent = match tokio::time::timeout_at(deadline, super::sink::join_in_order(sends)).await
        {
            Ok(sent) => sent,
            Err(_) => {
                let e = timed_out(stream);
                return Box::pin(async move { Err(e) });
            }
        };
        let stream = stream.to_owned();
        let (lease, lock) = (self.lease.clone(), self.names.lock());
        Box::pin(async move {
            let mut confirms = Vec::with_capacity(sent.len());
            for s in sent {
                confirms.push(s.map_err(protocol(format!("publishing to stream {stream}")))?);
            }
            for confirm in confirms {
                let confirmed = tokio::select! {
                    confirmed = tokio::time::timeout_at(deadline, confirm) => {
                        confirmed.map_err(|_| timed_out(&stream))?
                    }
                    // A confirm can hang on the connection the lock's loss
                    // closed. The write would not count anyway (below), and
                    // waiting out the write timeout held a former owner's
                    // Dones 30 s, past the next owner's restore, which fired
                    // those messages again.
                    () = lease.until_lost() => return Err(StateError::LockLost { lock }),
                };
                match confirmed.map_err(protocol(format!("confirm from stream {stream}")))? {
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
            // Confirmed, but perhaps after the lock moved on: the next owner
            // may have read that stream already, so the write does not count.
            if !lease.held() {
                return Err(StateError::LockLost { lock });
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
        each: impl FnMut(Record) -> Result<(), StateError>,
    ) -> Result<u64, StateError> {
        Ok(self.read_from(stream, None, each).await?.0)
    }

    /// [`StateSession::read_all`] from offset `from` (None: the first
    /// record). Returns how many records were read and the offset of the
    /// marker that ended the read (-1 if the broker did not say).
    async fn read_from(
        &self,
        stream: &str,
        from: Option<i64>,
        mut each: impl FnMut(Record) -> Result<(), StateError>,
    ) -> Result<(u64, i64), StateError> {
        let nonce = fresh_nonce();
        self.append(stream, &[Record::Marker { nonce }.encode()])
            .await
            .await?;
        let tag = format!("delayd-state-read-{nonce:x}");
        let (channel, mut consumer) = self.consume_from(stream, from, &tag).await?;
        let result = async {
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
                ack_for_credit(&delivery, &mut unacked).await?;
                let offset = stream_offset(&delivery.properties);
                let records = records_in(stream, offset, &delivery.data, |bytes| {
                    self.skip(stream, offset, bytes)
                })?;
                for record in records {
                    if record == (Record::Marker { nonce }) {
                        let _ = channel
                            .basic_cancel(
                                short_string(&tag, "consumer tag").map_err(AmqpError::from)?,
                                BasicCancelOptions::default(),
                            )
                            .await;
                        return Ok((read, offset));
                    }
                    read += 1;
                    each(record)?;
                }
            }
        }
        .await;
        let _ = channel.close(200, "OK".into()).await;
        result
    }

    /// A stream message that is not ours (stream names are predictable):
    /// one such record must not wedge the route for good.
    fn skip(&self, stream: &str, offset: i64, bytes: usize) {
        log_skip(stream, offset, bytes);
        self.skipped.fetch_add(1, Ordering::Relaxed);
    }

    /// Apply generation stream `stream`'s records to `set`, in stream
    /// order; returns how many were read.
    pub async fn read_into(&self, stream: &str, set: &mut LiveSet) -> Result<u64, StateError> {
        self.read_all(stream, |record| {
            set.apply(record);
            Ok(())
        })
        .await
    }

    /// Read the route's current generation into `state` before owning the
    /// route: what a candidate does on an observer session while it waits
    /// out the former owner's lease, so that once elected it reads only
    /// what was written since ([`StateSession::catch_up`]). None when
    /// there is nothing to read ahead: no state yet, or a checkpoint is
    /// moving the writes to the next generation (read cold instead).
    pub async fn read_ahead<S: ApplyRecord>(
        &self,
        mut state: S,
    ) -> Result<Option<ReadAhead<S>>, StateError> {
        let (Some(generation), _) = self.current_generation().await? else {
            return Ok(None);
        };
        let stream = self.names.generation(generation);
        if !self.exists(&stream).await? {
            return Ok(None);
        }
        let (read, marker) = self
            .read_from(&stream, None, |record| {
                state.apply(record);
                Ok(())
            })
            .await?;
        // Checked after the read: a checkpoint that starts later sends no
        // write to `generation` after its first one to the next, so what
        // is appended to `generation` past the marker comes before every
        // record of the next one, the order a cold read applies them in.
        // (The next generation exists, empty, as soon as an owner's writer
        // has prepared it: what counts is whether it holds a record.)
        let next = self.names.generation(generation + 1);
        if marker < 0 || (self.exists(&next).await? && self.holds_records(&next).await?) {
            return Ok(None);
        }
        Ok(Some(ReadAhead {
            generation,
            resume_at: marker + 1,
            state,
            read,
        }))
    }

    /// Follow `ahead`'s generation from where it was read up to, applying
    /// each record as the owner writes it: what a warm standby does while
    /// another instance owns the route. It writes nothing (no read
    /// markers), so an idle route's streams do not grow. What it holds is
    /// always a prefix of the generation, whole stream messages applied,
    /// which [`StateSession::catch_up`] completes. It ends when the
    /// generation is deleted (a checkpoint or a restore finished: read the
    /// pointers again) or the connection fails. If it cannot start, `ahead`
    /// comes back with the error: what it holds is still a prefix.
    pub async fn follow<S: ApplyRecord + Send + 'static>(
        &self,
        ahead: ReadAhead<S>,
    ) -> Result<Following<S>, (StateError, ReadAhead<S>)> {
        let stream = self.names.generation(ahead.generation);
        let tag = format!("delayd-state-follow-{:x}", fresh_nonce());
        match self
            .consume_from(&stream, Some(ahead.resume_at), &tag)
            .await
        {
            Ok((channel, consumer)) => {
                let held = Arc::new(Mutex::new(Some(ahead)));
                let task = tokio::spawn(apply_as_written(channel, consumer, stream, held.clone()));
                Ok(Following { held, task })
            }
            Err(error) => Err((error, ahead)),
        }
    }

    /// A consumer (`tag`) of `stream` from offset `from` (None: the first
    /// record), on a channel of its own.
    async fn consume_from(
        &self,
        stream: &str,
        from: Option<i64>,
        tag: &str,
    ) -> Result<(Channel, lapin::Consumer), StateError> {
        let channel = self.channel().await?;
        let consumer = async {
            channel
                .basic_qos(READ_PREFETCH, BasicQosOptions { global: false })
                .await
                .map_err(protocol("basic.qos for a stream read"))?;
            let mut args = FieldTable::default();
            args.insert(
                "x-stream-offset".into(),
                match from {
                    Some(offset) => AMQPValue::LongLongInt(offset),
                    None => AMQPValue::LongString(LongString::from("first")),
                },
            );
            channel
                .basic_consume(
                    short_string(stream, "stream name").map_err(AmqpError::from)?,
                    short_string(tag, "consumer tag").map_err(AmqpError::from)?,
                    BasicConsumeOptions::default(),
                    args,
                )
                .await
                .map_err(protocol(format!("reading stream {stream}")))
        }
        .await;
        match consumer {
            Ok(consumer) => Ok((channel, consumer)),
            Err(e) => {
                let _ = channel.close(200, "OK".into()).await;
                Err(e)
            }
        }
    }

    /// Whether `stream` holds a record other than read markers.
    async fn holds_records(&self, stream: &str) -> Result<bool, StateError> {
        let mut holds = false;
        self.read_all(stream, |record| {
            holds |= !matches!(record, Record::Marker { .. });
            Ok(())
        })
        .await?;
        Ok(holds)
    }

    /// Apply to `ahead`'s state what its generation got after it was read
    /// ahead. The caller has checked that the generation is still the
    /// current one. Returns the state and the records read in all.
    pub async fn catch_up<S: ApplyRecord>(
        &self,
        ahead: ReadAhead<S>,
    ) -> Result<(S, u64), StateError> {
        let ReadAhead {
            generation,
            resume_at,
            mut state,
            read,
        } = ahead;
        let stream = self.names.generation(generation);
        let (more, _) = self
            .read_from(&stream, Some(resume_at), |record| {
                state.apply(record);
                Ok(())
            })
            .await?;
        Ok((state, read + more))
    }

    /// The current generation: the highest that either pointer stream
    /// names (`None`: no state yet), and whether the two disagreed (one was
    /// deleted, or a write to both was cut between them; the next
    /// [`StateSession::point_at`] writes both again). Generations only
    /// grow, so the highest is the latest whichever stream holds it, and a
    /// stale pointer from a former owner cannot move it back.
    pub async fn current_generation(&self) -> Result<(Option<u64>, bool), StateError> {
        let mut found = [None; 2];
        for (i, stream) in self.names.pointers().iter().enumerate() {
            self.declare_stream(stream).await?;
            let mut last = None;
            let read = self
                .read_all(stream, |record| {
                    if let Record::Generation { generation } = record {
                        last = last.max(Some(generation));
                    }
                    Ok(())
                })
                .await?;
            self.pointer_records
                .lock()
                .unwrap_or_else(|e| e.into_inner())[i] = read + 1;
            found[i] = last;
        }
        Ok((found[0].max(found[1]), found[0] != found[1]))
    }

    /// Point both pointer streams at `generation`, one after the other, and
    /// rotate one of them if it holds more than [`POINTER_ROTATE`] records:
    /// deleted and given `generation` again, while the other one holds it.
    pub async fn point_at(&self, generation: u64) -> Result<(), StateError> {
        let record = Record::Generation { generation }.encode();
        let pointers = self.names.pointers();
        for stream in &pointers {
            self.append(stream, std::slice::from_ref(&record))
                .await
                .await?;
        }
        let rotate = {
            let mut counts = self
                .pointer_records
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            counts.iter_mut().for_each(|n| *n += 1);
            counts.iter().position(|&n| n > POINTER_ROTATE)
        };
        if let Some(i) = rotate {
            let stream = &pointers[i];
            self.delete(stream).await?;
            self.declare_stream(stream).await?;
            self.append(stream, &[record]).await.await?;
            self.pointer_records
                .lock()
                .unwrap_or_else(|e| e.into_inner())[i] = 1;
            debug!(stream, generation, "pointer stream rotated");
        }
        Ok(())
    }

    /// Whether queue or stream `name` exists (a passive declare, on a
    /// channel of its own: a missing one closes it).
    pub async fn exists(&self, name: &str) -> Result<bool, StateError> {
        let channel = self.channel().await?;
        let result = channel
            .queue_declare(
                short_string(name, "stream name").map_err(AmqpError::from)?,
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await;
        match result {
            Ok(_) => {
                let _ = channel.close(200, "OK".into()).await;
                Ok(true)
            }
            Err(e) if super::topology::is_soft_error(&e, AMQPSoftError::NOTFOUND) => Ok(false),
            Err(e) => Err(protocol(format!("checking whether {name} exists"))(e)),
        }
    }
}

/// The `x-stream-offset` header of a stream delivery (-1 if missing).
/// A generation a standby follows ([`StateSession::follow`]).
pub struct Following<S> {
    /// Taken by [`Following::stop`]; the follower stops once it is gone.
    held: Arc<Mutex<Option<ReadAhead<S>>>>,
    task: tokio::task::JoinHandle<Result<(), StateError>>,
}

impl<S> Following<S> {
    /// Whether the follower stopped: its generation was deleted, or its
    /// connection failed (what it applied stays a prefix).
    pub fn ended(&self) -> bool {
        self.task.is_finished()
    }

    /// Look at what is held so far.
    pub fn with<R>(&self, f: impl FnOnce(&ReadAhead<S>) -> R) -> Option<R> {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(f)
    }

    /// Stop following: what was applied, as a read-ahead.
    pub fn stop(self) -> Option<ReadAhead<S>> {
        self.task.abort();
        self.held.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl<S> Drop for Following<S> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The follower's loop: each stream message's records applied under the
/// lock, and the resume offset moved past it, together.
async fn apply_as_written<S: ApplyRecord>(
    channel: Channel,
    mut consumer: lapin::Consumer,
    stream: String,
    held: Arc<Mutex<Option<ReadAhead<S>>>>,
) -> Result<(), StateError> {
    let result = async {
        let mut unacked = 0u32;
        // None: the broker cancelled the consumer (the stream was deleted)
        // or the channel closed.
        while let Some(delivery) = consumer.next().await {
            let delivery = delivery.map_err(protocol(format!("following stream {stream}")))?;
            ack_for_credit(&delivery, &mut unacked).await?;
            let offset = stream_offset(&delivery.properties);
            if offset < 0 {
                // Without offsets, what is held cannot be resumed from.
                return Err(StateError::Refused {
                    stream: stream.clone(),
                    why: "a stream delivery without x-stream-offset",
                });
            }
            let records = records_in(&stream, offset, &delivery.data, |bytes| {
                log_skip(&stream, offset, bytes)
            })?;
            let mut held = held.lock().unwrap_or_else(|e| e.into_inner());
            let Some(ahead) = held.as_mut() else {
                return Ok(());
            };
            for record in records {
                ahead.read += 1;
                ahead.state.apply(record);
            }
            ahead.resume_at = offset + 1;
        }
        Ok(())
    }
    .await;
    let _ = channel.close(200, "OK".into()).await;
    result
}

/// A stream consumer gets more only once it acks: ack what was read, in
/// bulk, every half prefetch.
async fn ack_for_credit(
    delivery: &lapin::message::Delivery,
    unacked: &mut u32,
) -> Result<(), StateError> {
    *unacked += 1;
    if *unacked >= u32::from(READ_PREFETCH) / 2 {
        delivery
            .ack(BasicAckOptions { multiple: true })
            .await
            .map_err(protocol("acking a stream read"))?;
        *unacked = 0;
    }
    Ok(())
}

/// The records of one state stream message, in order. What does not decode
/// is handed to `skip` (its length) and left out, unless it claims a newer
/// format: then the read stops (it may be a Schedule).
fn records_in(
    stream: &str,
    offset: i64,
    data: &[u8],
    mut skip: impl FnMut(usize),
) -> Result<Vec<Record>, StateError> {
    let Some(packed) = super::packed::unpack(data) else {
        skip(data.len());
        return Ok(Vec::new());
    };
    let mut records = Vec::new();
    for bytes in packed {
        match Record::decode(bytes) {
            Some(record) => records.push(record),
            None => match bytes.first() {
                Some(&version @ 2..=NEWEST_PLAUSIBLE_VERSION) => {
                    return Err(StateError::NewerFormat {
                        stream: stream.to_owned(),
                        offset,
                        version,
                    })
                }
                _ => skip(bytes.len()),
            },
        }
    }
    Ok(records)
}

fn log_skip(stream: &str, offset: i64, bytes: usize) {
    tracing::error!(
        stream,
        offset,
        bytes,
        "skipping an undecodable record in a state stream"
    );
}

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

mod handover;
#[cfg(test)]
mod lock_model;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waiting_candidates_pings_must_come_back_in_order_and_on_time() {
        let t0 = Instant::now();
        let late = Duration::from_millis(125);
        let mut pings = WaitPings::new(7, late);
        let (a, b) = (pings.send(t0), pings.send(t0 + Duration::from_millis(50)));
        assert!(
            pings.arrived(b"ping"),
            "another instance's ping changes nothing"
        );
        assert!(pings.arrived(&a));
        assert!(
            !pings.late_at(t0 + Duration::from_millis(170)),
            "b is 120 ms out"
        );
        assert!(
            pings.late_at(t0 + Duration::from_millis(180)),
            "b is 130 ms out"
        );
        assert!(pings
            .late_from()
            .is_some_and(|t| t > t0 + Duration::from_millis(175)));
        assert!(pings.arrived(&b));
        assert!(pings.late_from().is_none());
        let (_c, d) = (pings.send(t0), pings.send(t0));
        assert!(!pings.arrived(&d), "c went to another consumer");
    }

    #[test]
    fn the_turn_cannot_leave_a_waiting_candidate_before_its_pings_are_late() {
        for secs in [1, 2, 5, 30, 60] {
            let names = StateNames::new("p").with_lease(Duration::from_secs(secs));
            assert!(
                names.wait_ping_every() + names.wait_ping_late() < names.disconnected_timeout(),
                "lease {secs} s"
            );
        }
    }

    #[test]
    fn a_shorter_lease_pings_more_often_and_waits_a_shorter_margin() {
        let default = StateNames::new("r");
        assert_eq!(default.lease, LOCK_LEASE);
        assert_eq!(default.ping_every(), Duration::from_secs(1));
        assert_eq!(default.margin(), Duration::from_millis(250));
        let short = StateNames::new("r").with_lease(Duration::from_secs(1));
        assert_eq!(short.ping_every(), Duration::from_millis(200));
        assert_eq!(short.margin(), Duration::from_millis(50));
    }

    #[test]
    fn a_lock_queue_gives_a_lost_consumer_up_after_a_quarter_of_the_lease() {
        let args = lock_queue_arguments(Duration::from_secs(1));
        let args = args.inner();
        assert_eq!(
            args.get("x-consumer-disconnected-timeout"),
            Some(&AMQPValue::LongLongInt(250))
        );
        assert_eq!(
            args.get("x-single-active-consumer"),
            Some(&AMQPValue::Boolean(true))
        );
        assert_eq!(
            args.get("x-queue-type"),
            Some(&AMQPValue::LongString(LongString::from("quorum")))
        );
    }

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
            Record::Offset {
                queue: "delayd.orders.3".into(),
                next: 1 << 40,
            },
            Record::Offset {
                queue: String::new(),
                next: 0,
            },
            Record::Remembered {
                id: 3 << 100 | 5,
                fingerprint: u64::MAX - 1,
                digest: [0xa5; 32],
                cancelled: true,
            },
            Record::Remembered {
                id: 0,
                fingerprint: 0,
                digest: [0; 32],
                cancelled: false,
            },
        ];
        for record in records {
            assert_eq!(Record::decode(&record.encode()), Some(record.clone()));
        }
        let copy = Record::Copy {
            id: 5,
            identity: u128::MAX - 1,
            due_ms: 9,
            message: b"copy".to_vec(),
        };
        let bytes = copy.encode();
        assert_eq!(bytes[0], COPY_VERSION, "an older delayd refuses it");
        assert_eq!(
            super::super::packed::unpack(&bytes),
            Some(vec![&bytes[..]]),
            "taken for a packed message"
        );
        assert_eq!(Record::decode(&bytes), Some(copy));
        assert_eq!(Record::decode(b""), None);
        assert_eq!(Record::decode(&[2, DONE]), None, "unknown version");
        assert_eq!(Record::decode(&[VERSION, DONE, 1, 2]), None, "short Done");
        assert_eq!(Record::decode(&[VERSION, 9]), None, "unknown kind");
        let mut remembered = Record::Remembered {
            id: 1,
            fingerprint: 2,
            digest: [3; 32],
            cancelled: false,
        }
        .encode();
        *remembered.last_mut().unwrap() = 2;
        assert_eq!(Record::decode(&remembered), None, "a flag byte not 0 or 1");
        remembered.pop();
        assert_eq!(Record::decode(&remembered), None, "short Remembered");
        assert_eq!(
            Record::decode(&[VERSION, SCHEDULE, 0, 0]),
            None,
            "short Schedule"
        );
    }

    #[test]
    fn a_lease_runs_out_without_pings_and_once_lost_stays_lost() {
        let lease = Lease::new(Duration::from_millis(50), Instant::now());
        assert!(lease.held(), "a fresh lease");
        std::thread::sleep(Duration::from_millis(80));
        assert!(!lease.held(), "no ping for longer than the lease");
        lease.renew_now();
        assert!(lease.held(), "a ping renews it");
        lease.lose();
        lease.renew_now();
        assert!(
            !lease.held(),
            "given up: a late ping does not bring it back"
        );
    }

    /// The next owner waits only a drift margin past the lease, counted
    /// from the hand-over; a ping that reached the former owner late must
    /// not stretch its lease past that (a lease counted from arrival did).
    #[test]
    fn a_ping_that_arrives_late_renews_the_lease_only_from_when_it_was_sent() {
        let t0 = Instant::now();
        let lease = Lease::new(Duration::from_millis(1000), t0);
        let ping = lease.ping();
        let sent_by = t0.elapsed().as_millis() as u64;
        std::thread::sleep(Duration::from_millis(30)); // in transit
        lease.renew_from(&ping);
        let sent_ms = u64::from_be_bytes(ping[8..].try_into().unwrap());
        assert!(sent_ms <= sent_by, "stamped when sent: {sent_ms} ms");
        let expiry = t0 + Duration::from_millis(sent_ms + 1000);
        assert!(lease.held_at(expiry));
        assert!(
            !lease.held_at(expiry + Duration::from_millis(1)),
            "held past the lease counted from the ping's send"
        );
    }

    #[test]
    fn only_the_owners_own_pings_renew_its_lease() {
        let t0 = Instant::now();
        let lease = Lease::new(Duration::from_millis(100), t0);
        let other = Lease::new(Duration::from_millis(100), t0);
        std::thread::sleep(Duration::from_millis(20));
        let late = t0 + Duration::from_millis(110); // the own ping below is sent at 20 ms or later
        lease.renew_from(b"ping"); // a standby's
        lease.renew_from(&other.ping()); // another owner's, on another clock
        assert!(!lease.held_at(late), "renewed by a ping not its own");
        lease.renew_from(&lease.ping());
        assert!(lease.held_at(late), "its own ping renews it");
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
