//! The broker-kept store (`[store] kind = "broker"`), RabbitMQ routes: the
//! durable record of a pending message is a record in the route's state
//! streams (see `delayd_adapters::amqp::state` for the streams, the lock
//! and their recovery rules, and docs/broker-store.md).
//!
//! One instance owns a route at a time: the one holding its lock. The
//! others wait (`standby` in `/readyz`). The owner:
//! * on taking the lock, reads the live set back from the streams, arms it
//!   here while it writes it into a fresh generation (the writer holds
//!   every record queued meanwhile until that is done), and then consumes;
//! * on intake, queues the Schedule record after the redelivery check and
//!   before the message can be armed, and acks the delivery only once the
//!   WAL record and the Schedule are both durable;
//! * once a message is delivered, parked or cancelled, appends its Done;
//! * checkpoints when a generation holds more than twice the live set plus
//!   `store.checkpoint_records` records;
//! * on losing the lock (its connection closed, a state write failed),
//!   stops consuming and releases every message it holds here: the next
//!   owner fires them.
//!
//! Engine ids are local; the streams know a message by its identity
//! ([`MessageId`], the `x-delayd-id` it goes out with), so whichever owner
//! restores it sends it under the same id. A message can fire before its engine id is known here (a zero
//! delay): its Done is then remembered and written once the id is.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use delayd_adapters::amqp::state::{
    Candidate, LiveRecord, ReadAhead, Record, StateError, StateNames, StateSession, Waiting,
};
use delayd_adapters::amqp::stream::{CheckpointError, OffsetStore};
use delayd_adapters::amqp::Broker;
use delayd_adapters::BoxFuture;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::engine::{Arrival, Engine, EngineError, Stored, Storing};
use crate::id::MessageId;

use super::departed::{self, Departed, Replay};
use super::owed::Owed;

use super::partitions::PartitionGroup;
use super::warm::{self, Warm};

/// Records appended per publish batch.
const WRITE_BATCH: usize = 1000;

/// How often a former owner looks for Dones it owes (see [`owed`](super::owed)).
const OWED_POLL: Duration = Duration::from_millis(20);

/// How long the intake may take to stop when the lock is lost.
const INTAKE_STOP: Duration = Duration::from_secs(45);

/// How often a standby tries to take the lock.
const LOCK_RETRY: Duration = Duration::from_secs(1);

/// How long registering on the lock queue (a declare and a consume,
/// milliseconds on a healthy cluster) may take before the attempt moves to
/// the next node: a node cut off from the others took connections and left
/// the declare unanswered for two minutes, while no instance stood by.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);

/// How often an owner that found the route's state incomplete looks again.
const MISSING_RETRY: Duration = Duration::from_secs(10);

/// Restored records stored in the WAL per batch.
const RESTORE_BATCH: usize = 4096;

/// Missing generation numbers in a row that end a restore's search for
/// orphaned generations (AMQP cannot list queues, so it probes names
/// downward). A crash leaves them right below the pointer (the two a
/// restore read, or the one a checkpoint copied from), and each restore
/// deletes what the last one left, so they lie together: 4 leaves room for
/// a gap while every restore probes only a handful of names. Orphans an
/// older delayd left further down are not found (delete them by hand).
const ORPHAN_GAP: u64 = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Not known yet: registered on the lock queue (or trying to), no
    /// answer yet.
    Electing = 0,
    /// Another instance owns the route.
    Standby = 1,
    /// This instance took the lock and reads the state back.
    Restoring = 2,
    /// This instance owns the route and consumes it.
    Active = 3,
}

enum Write {
    Schedule {
        id: u128,
        record: Vec<u8>,
        reply: oneshot::Sender<Result<(), String>>,
    },
    Done {
        id: u128,
        record: Vec<u8>,
        /// A cancel's [`Record::Remembered`], appended right after the Done.
        remembered: Option<Vec<u8>>,
        /// Told once the Done is confirmed (a cancel waits for it).
        reply: Option<oneshot::Sender<Result<(), String>>>,
    },
    /// A stream ingress's next offset (see [`StreamOffsets`]).
    Offset {
        queue: String,
        next: i64,
        reply: oneshot::Sender<Result<(), String>>,
    },
}

/// A message's state record key and the identity it goes out under: the
/// same but for a copy (`Record::Copy`), which keeps its sibling's.
#[derive(Debug, Clone, Copy)]
struct StateKey {
    id: u128,
    identity: u128,
}

impl StateKey {
    fn own(id: u128) -> Self {
        Self { id, identity: id }
    }
}

#[derive(Default)]
struct Ids {
    /// Engine id → its state key, for the messages this owner holds.
    by_engine: HashMap<u64, StateKey>,
    /// Engine ids that fired before their store id was recorded.
    early_done: HashSet<u64>,
    /// Messages kept locally from before the route used this store: they
    /// fire from here and have no state record.
    local_only: HashSet<u64>,
}

/// One RabbitMQ route's broker-kept store.
pub struct StreamStore {
    pub(super) route: String,
    pub(super) engine: Engine,
    /// A broker handle of its own: each lock attempt opens a connection.
    broker: Broker,
    names: StateNames,
    ids: Mutex<Ids>,
    /// The current owner session's writer (None unless active).
    writer: Mutex<Option<mpsc::UnboundedSender<Write>>>,
    writer_task: tokio::sync::Mutex<Option<(JoinHandle<()>, Arc<StateSession>)>>,
    phase: AtomicU8,
    /// The last restore found a stream the pointer names missing.
    state_missing: std::sync::atomic::AtomicBool,
    /// Schedules refused once the session ends, one per delivery in hand.
    unwritten: delayd_adapters::log_burst::BurstLog,
    /// `store.checkpoint_records`.
    checkpoint_floor: u64,
    /// The WAL directory, where the route is marked broker-kept (see
    /// `store::mark_mirrored`) once no message of it is local-only.
    wal_dir: std::path::PathBuf,
    /// The partitioned route this route is a partition of, if any.
    group: Option<Arc<PartitionGroup>>,
    /// A stream ingress's next offset per queue, as the last restore read
    /// it from the state streams.
    offsets: Mutex<HashMap<String, i64>>,
    /// The broker endpoint the last lock attempt reached, and the one the
    /// next starts at (after a loss or a timeout, the one after it: the
    /// node may be the cause).
    lock_endpoint: Mutex<(usize, usize)>,
    /// Dones an ended session still owes (see [`owed`](super::owed)).
    owed: Arc<Mutex<Owed>>,
    /// A task writes them.
    writing_owed: AtomicBool,
    /// Whether the session that last won the route's lock still holds it:
    /// connected, and its lease held on this process's clock (see
    /// [`StreamStore::may_fire`]).
    lock_held: Mutex<Option<LockHeld>>,
}

/// [`StreamStore::won_lock`]'s view of the owner session.
type LockHeld = Arc<dyn Fn() -> bool + Send + Sync>;

impl StreamStore {
    pub fn new(
        endpoints: Arc<delayd_adapters::amqp::Endpoints>,
        names: StateNames,
        route: &str,
        engine: Engine,
        checkpoint_floor: u64,
        wal_dir: std::path::PathBuf,
        group: Option<Arc<PartitionGroup>>,
    ) -> anyhow::Result<Arc<Self>> {
        let broker = Broker::with_endpoints(
            endpoints,
            delayd_adapters::amqp::BrokerOptions::named(format!("delayd-state-{route}")),
        );
        Ok(Arc::new(Self {
            route: route.to_owned(),
            engine,
            broker,
            names,
            ids: Mutex::new(Ids::default()),
            writer: Mutex::new(None),
            writer_task: tokio::sync::Mutex::new(None),
            phase: AtomicU8::new(Phase::Electing as u8),
            offsets: Mutex::default(),
            lock_endpoint: Mutex::default(),
            owed: Arc::default(),
            writing_owed: AtomicBool::new(false),
            lock_held: Mutex::new(None),
            state_missing: Default::default(),
            unwritten: Default::default(),
            checkpoint_floor,
            wal_dir,
            group,
        }))
    }

    /// The pointer stream's name.
    pub fn stream(&self) -> &str {
        &self.names.pointer
    }

    pub fn phase(&self) -> Phase {
        match self.phase.load(Ordering::Acquire) {
            0 => Phase::Electing,
            1 => Phase::Standby,
            2 => Phase::Restoring,
            _ => Phase::Active,
        }
    }

    fn set_phase(&self, phase: Phase) {
        self.phase.store(phase as u8, Ordering::Release);
    }

    /// Whether the last restore refused to start the route without a
    /// missing state stream (see `recover`).
    pub fn state_missing(&self) -> bool {
        self.state_missing.load(Ordering::Acquire)
    }

    fn set_state_missing(&self, missing: bool) {
        self.state_missing.store(missing, Ordering::Release);
        metrics::gauge!("delayd_store_state_missing", "route" => self.route.clone())
            .set(if missing { 1.0 } else { 0.0 });
    }

    fn owed(&self) -> MutexGuard<'_, Owed> {
        self.owed.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn ids(&self) -> MutexGuard<'_, Ids> {
        self.ids.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn send(&self, write: Write) -> bool {
        match &*self.writer.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(tx) => tx.send(write).is_ok(),
            None => false,
        }
    }

    /// Where a stream ingress of this route keeps its next offset: in the
    /// state streams, through this owner's writer.
    pub fn stream_offsets(self: &Arc<Self>) -> Arc<dyn OffsetStore> {
        Arc::new(StreamOffsets {
            store: Arc::downgrade(self),
        })
    }

    /// At start, before anything fires: what the local WAL holds for this
    /// route. If it mirrored the streams (`mirrored`), they hold every one
    /// and the copies are released; if not (the route kept its state
    /// locally until now), they are local-only: they fire from here until
    /// this instance owns the route, which then writes them into the
    /// streams ([`StreamStore::adopt_local`]). The route is marked
    /// broker-kept only once none is local-only, so a restart before that
    /// keeps them again rather than releasing them. Returns how many were
    /// (released, kept).
    pub async fn adopt_cached(&self, mirrored: bool) -> anyhow::Result<(u64, u64)> {
        let ids: Vec<u64> = self
            .engine
            .waiting()
            .iter()
            .filter(|i| *i.route == *self.route)
            .map(|i| i.id)
            .collect();
        if !mirrored {
            let kept = ids.len() as u64;
            self.ids().local_only.extend(ids);
            return Ok((0, kept));
        }
        let mut released = 0;
        for (_, outcome) in super::release_all(&self.engine, ids).await {
            if outcome? {
                released += 1;
            }
        }
        Ok((released, 0))
    }

    /// Store a consumed delivery: its WAL record and its Schedule, both
    /// durable when the future resolves (and the message armed).
    ///
    /// The state record's id is the message's identity `uid`, so whoever
    /// restores it gives it out under the same `x-delayd-id`.
    pub fn store(
        self: &Arc<Self>,
        due_ms: u64,
        uid: MessageId,
        encoded: Vec<u8>,
        arrival: Arrival,
    ) -> BoxFuture<'static, Result<Stored, EngineError>> {
        if self
            .writer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
        {
            // Lost the lock (the intake is stopping): not acked, so the
            // broker gives the delivery to the next owner.
            return Box::pin(async {
                Err(EngineError::Interrupted(
                    "this instance does not own the route",
                ))
            });
        }
        // The delivery's own identity keys its state record, even when the
        // WAL keeps it under another's (a redelivery whose sibling's ack was
        // in doubt: `Stored::Copy`), so two messages are never one key here.
        let store_id = uid.as_u128();
        let message = encoded.clone();
        let (wal, sibling) =
            match self
                .engine
                .begin_store(&self.route, due_ms, uid, encoded, arrival)
            {
                Storing::Duplicate => return Box::pin(async { Ok(Stored::Duplicate) }),
                Storing::New(wal) => (wal, None),
                Storing::Copy(wal, sibling) => (wal, Some(sibling)),
            };
        let record = match sibling {
            None => Record::Schedule {
                id: store_id,
                due_ms,
                message,
            },
            // Goes out under its sibling's identity: a restore elsewhere
            // must publish it so too.
            Some(sibling) => Record::Copy {
                id: store_id,
                identity: sibling.as_u128(),
                due_ms,
                message,
            },
        }
        .encode();
        // Queued before the message can be armed (see the module doc).
        let (reply, written) = oneshot::channel();
        let queued = self.send(Write::Schedule {
            id: store_id,
            record,
            reply,
        });
        let this = self.clone();
        Box::pin(async move {
            let written_here = match wal.await {
                Ok(w) => w,
                Err(e) => {
                    // Not pending here (not acked, or sent to the invalid
                    // destination): its Schedule must not come back.
                    this.write_done(store_id);
                    return Err(e);
                }
            };
            let id = written_here.id;
            let identity = sibling.map_or(store_id, |s| s.as_u128());
            this.bind(
                id,
                StateKey {
                    id: store_id,
                    identity,
                },
            );
            let written = if queued {
                written
                    .await
                    .unwrap_or_else(|_| Err("the state writer stopped".into()))
            } else {
                Err("this instance does not own the route".into())
            };
            if let Err(e) = written {
                // Not acked: the broker gives the delivery to the owner. Its
                // Done is queued (release) before a redelivery waiting for
                // this store may go on (`written_here` dropped), so a
                // Schedule the redelivery writes under the same identity
                // comes after it in the stream.
                if let Some(left_out) = this.unwritten.admit(std::time::Instant::now()) {
                    tracing::warn!(route = %this.route, error = %e, repeats_left_out = left_out, "the state record was not written; the delivery goes back (repeats within 10 s are counted, not logged)");
                }
                let _ = this.engine.release(id).await;
                drop(written_here);
                return Err(EngineError::Interrupted("the state record was not written"));
            }
            metrics::counter!("delayd_store_writes_total", "route" => this.route.clone(), "kind" => "schedule").increment(1);
            Ok(written_here.commit())
        })
    }

    /// Record that engine id `id` is kept under `key` (writing its Done
    /// now if it already fired).
    fn bind(&self, id: u64, key: StateKey) {
        let fired = {
            let mut ids = self.ids();
            if ids.early_done.remove(&id) {
                true
            } else {
                ids.by_engine.insert(id, key);
                false
            }
        };
        if fired {
            self.write_done(key.id);
        }
    }

    /// Mark the route broker-kept in the WAL directory once no message of
    /// it is local-only (see [`StreamStore::adopt_cached`]).
    pub(super) fn mark_if_drained(&self) -> anyhow::Result<()> {
        if self.ids().local_only.is_empty() {
            super::mirrored::add_mirrored(&self.wal_dir, &self.route)?;
        }
        Ok(())
    }

    /// The new owner writes the messages this WAL kept from before the
    /// route used the broker store into its streams; from then on they are
    /// broker-kept like any other.
    async fn adopt_local(&self) -> anyhow::Result<u64> {
        let local: Vec<u64> = self.ids().local_only.iter().copied().collect();
        let mut written = Vec::new();
        for id in local {
            let Some((
                _,
                crate::wal::Record::Schedule {
                    due_ms,
                    uid,
                    message,
                    ..
                },
            )) = self.engine.read(id)?
            else {
                continue; // fired meanwhile
            };
            let uid = MessageId::or_legacy(uid, id).as_u128();
            let record = Record::Schedule {
                id: uid,
                due_ms,
                message,
            }
            .encode();
            let (reply, done) = oneshot::channel();
            if !self.send(Write::Schedule {
                id: uid,
                record,
                reply,
            }) {
                anyhow::bail!("the state writer stopped");
            }
            written.push((id, uid, done));
        }
        let n = written.len() as u64;
        for (id, uid, done) in written {
            done.await
                .unwrap_or_else(|_| Err("the state writer stopped".into()))
                .map_err(|e| anyhow::anyhow!("writing a local message to the state stream: {e}"))?;
            let still_local = self.ids().local_only.remove(&id);
            if still_local {
                self.bind(id, StateKey::own(uid));
            } else {
                // Fired while its Schedule was being written.
                self.write_done(uid);
            }
        }
        self.mark_if_drained()?;
        Ok(n)
    }

    /// Message `id` was delivered, parked or cancelled here.
    pub fn done(&self, id: u64) {
        let store_id = {
            let mut ids = self.ids();
            if ids.local_only.remove(&id) {
                let drained = ids.local_only.is_empty();
                drop(ids);
                if drained {
                    if let Err(e) = self.mark_if_drained() {
                        tracing::error!(route = %self.route, error = %e, "cannot mark the route broker-kept; a restart keeps its WAL copies as local-only");
                    }
                }
                return;
            }
            match ids.by_engine.remove(&id) {
                Some(key) => key.id,
                None => {
                    let mut owed = self.owed();
                    match (owed.left(id), owed.stream().map(str::to_owned)) {
                        // On the wire when the session ended: its Done is
                        // written by the former owner (see `owed`).
                        (Some(store_id), Some(stream)) => {
                            owed.owe(&stream, Record::Done { id: store_id }.encode())
                        }
                        _ => {
                            ids.early_done.insert(id);
                        }
                    }
                    return;
                }
            }
        };
        self.write_done(store_id);
    }

    fn write_done(&self, store_id: u128) {
        self.queue_done(store_id, None, None);
    }

    /// Queue `store_id`'s Done (and a cancel's `remembered` record); false
    /// if there is no writer.
    fn queue_done(
        &self,
        store_id: u128,
        remembered: Option<Departed>,
        reply: Option<oneshot::Sender<Result<(), String>>>,
    ) -> bool {
        let record = Record::Done { id: store_id }.encode();
        let remembered = remembered.map(|d| d.record().encode());
        let queued = self.send(Write::Done {
            id: store_id,
            record: record.clone(),
            remembered: remembered.clone(),
            reply,
        });
        if !queued {
            // The session ended: the former owner writes it (see `owed`).
            let mut owed = self.owed();
            match owed.stream().map(str::to_owned) {
                Some(stream) => {
                    owed.owe(&stream, record);
                    if let Some(r) = remembered {
                        owed.owe(&stream, r);
                    }
                }
                None => {
                    tracing::warn!(route = %self.route, "no state writer for a Done: the message fires again after a restore");
                }
            }
        }
        queued
    }

    /// Message `id`, stored as `message`, was cancelled (its local Done is
    /// durable): resolves once its Done is confirmed in the state stream,
    /// so the cancel is acknowledged only then. A `Remembered` record
    /// follows the Done: a late redelivery of the message to the next owner
    /// must not bring it back (see [`departed`](super::departed)).
    pub fn cancelled(&self, id: u64, message: &[u8]) -> BoxFuture<'static, Result<(), String>> {
        let key = {
            let mut ids = self.ids();
            match ids.by_engine.remove(&id) {
                Some(s) => s,
                None => {
                    drop(ids);
                    // Local-only (no state record), or not bound yet (its
                    // Done is written once it is).
                    self.done(id);
                    return Box::pin(async { Ok(()) });
                }
            }
        };
        let (reply, confirmed) = oneshot::channel();
        // Under its identity, so a restore notes the cancel on the entry its
        // Done leaves (one per identity, see `departed::Newest`).
        let remembered = Departed::of(&self.route, key.identity, message, true);
        if !self.queue_done(key.id, Some(remembered), Some(reply)) {
            return Box::pin(async { Err("this instance no longer owns the route".to_owned()) });
        }
        Box::pin(async move {
            confirmed
                .await
                .unwrap_or_else(|_| Err("the state writer stopped".into()))
        })
    }

    /// Whether due message `id` of this route may be published from here:
    /// only while this instance owns the route and its session holds the
    /// lock's lease at this instant, unless it was stored before the route
    /// kept its state in the broker (only this WAL has it). The next owner
    /// fires once a lease (and its margin) has passed since this one's
    /// last ping came back; an owner that fired past its own lease fired
    /// beside it (the lock model's rule: firing only while
    /// `Lease::held_at`). The phase alone left two windows: a restore,
    /// which fires the soonest-due messages as it arms them and did not
    /// watch the lease, and a stop, which keeps the owner's phase until
    /// `flush` while nothing watches the session; and the phase follows a
    /// lost lease a poll (100 ms) late, past the margin of a 1 s lease.
    pub fn may_fire(&self, id: u64) -> bool {
        (matches!(self.phase(), Phase::Restoring | Phase::Active) && self.holds_lock())
            || self.ids().local_only.contains(&id)
    }

    /// The session that won the lock: [`StreamStore::may_fire`] asks it.
    fn won_lock(&self, held: LockHeld) {
        *self.lock_held.lock().unwrap_or_else(|e| e.into_inner()) = Some(held);
    }

    fn holds_lock(&self) -> bool {
        let held = self
            .lock_held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        held.is_some_and(|held| held())
    }

    pub fn restoring(&self) -> bool {
        self.phase() == Phase::Restoring
    }

    /// Own the route whenever this instance can, until `shutdown`:
    /// restore, then run the intake `start_intake` spawns until the lock is
    /// lost or shutdown. On shutdown the session stays open for the Dones
    /// of in-flight publishes; [`StreamStore::flush`] ends it.
    pub async fn run(
        self: Arc<Self>,
        start_intake: impl Fn(CancellationToken) -> anyhow::Result<JoinHandle<()>>,
        shutdown: CancellationToken,
    ) {
        // Kept across elections: a drain ends the wait on the lock queue
        // (its connection closed) but not what the standby followed.
        let mut warm = Warm::new(&self.route);
        loop {
            self.set_phase(Phase::Electing);
            if let Some(group) = &self.group {
                // Compete for this partition only below this instance's
                // share; meanwhile another instance owns it (or will): a
                // standby, as ready as one waiting on the lock queue.
                if !group.has_room() {
                    self.set_phase(Phase::Standby);
                }
                if group.wait_for_room(&shutdown).await {
                    return;
                }
            }
            let attempt = std::time::Instant::now();
            let elected = tokio::select! {
                s = self.elect(&mut warm) => s,
                _ = shutdown.cancelled() => return,
            };
            let (session, ahead) = match elected {
                Ok((s, ahead)) => {
                    if let Some(group) = &self.group {
                        group.took();
                    }
                    (Arc::new(s), ahead)
                }
                Err(StateError::StoodDown { .. }) => {
                    // Its share is full: nothing of this route is held.
                    warm = Warm::new(&self.route);
                    continue;
                }
                Err(e) => {
                    tracing::warn!(route = %self.route, error = %e, "cannot wait for the route's lock; trying again");
                    // At most one attempt a second, but a wait that lasted
                    // is tried again at once: its node went away (a drain
                    // closes every connection on it), and a standby that
                    // paused here added a second to the hand-over.
                    let pause = LOCK_RETRY.saturating_sub(attempt.elapsed());
                    if sleep_or_stop(pause, &shutdown).await {
                        return;
                    }
                    continue;
                }
            };
            let owner = Arc::downgrade(&session);
            self.won_lock(Arc::new(move || {
                owner.upgrade().is_some_and(|s| s.is_alive())
            }));
            self.set_phase(Phase::Restoring);
            tracing::info!(route = %self.route, "this instance owns the route now; restoring its pending messages");
            let started = std::time::Instant::now();
            let restored = tokio::select! {
                r = self.restore(&session, ahead) => Some(r),
                _ = shutdown.cancelled() => None,
            };
            let (writer, failed) = match restored {
                Some(Ok(w)) => {
                    self.set_state_missing(false);
                    w
                }
                None => {
                    // SIGTERM while restoring: nothing was consumed yet.
                    self.set_phase(Phase::Electing);
                    *self.writer.lock().unwrap_or_else(|e| e.into_inner()) = None;
                    self.lose(session).await;
                    self.left_partition(false);
                    return;
                }
                Some(Err(e)) => {
                    // Nothing restored so far fires here any more.
                    self.set_phase(Phase::Electing);
                    let missing = matches!(e.downcast_ref(), Some(StateError::Missing { .. }));
                    let retry = if missing {
                        self.set_state_missing(true);
                        tracing::error!(route = %self.route, error = %e, "the route's state is incomplete; it is not consumed (not ready) until an operator restores the stream or removes the route's state on purpose");
                        MISSING_RETRY
                    } else {
                        tracing::error!(route = %self.route, error = %e, "cannot restore the route; giving the lock up and trying again");
                        self.move_off_lock_endpoint();
                        LOCK_RETRY
                    };
                    self.lose(session).await;
                    self.left_partition(false);
                    if sleep_or_stop(retry, &shutdown).await {
                        return;
                    }
                    continue;
                }
            };
            tracing::info!(route = %self.route, pending = self.ids().by_engine.len(), elapsed_ms = started.elapsed().as_millis() as u64, "route restored from its state streams; consuming");
            *self.writer_task.lock().await = Some((writer, session.clone()));
            self.set_phase(Phase::Active);
            let intake_stop = CancellationToken::new();
            let intake = match start_intake(intake_stop.clone()) {
                Ok(task) => task,
                Err(e) => {
                    tracing::error!(route = %self.route, error = %e, "cannot start consuming");
                    self.end_session().await;
                    self.left_partition(false);
                    if sleep_or_stop(LOCK_RETRY, &shutdown).await {
                        return;
                    }
                    continue;
                }
            };
            let yield_turn = async {
                match &self.group {
                    Some(group) => group.yield_turn().await,
                    None => std::future::pending().await,
                }
            };
            let mut yielding = false;
            let stopping = tokio::select! {
                _ = shutdown.cancelled() => true,
                _ = session.lost() => false,
                _ = failed.cancelled() => false,
                _ = yield_turn => {
                    yielding = true;
                    false
                }
            };
            if !stopping {
                // The lock is gone: nothing more fires here (see
                // `may_fire`), and /status stops naming this instance the
                // owner, before the intake has wound down.
                self.set_phase(Phase::Electing);
            }
            intake_stop.cancel();
            // Bounded (the intake bounds its own stop too): ownership must
            // be given up even if a broker call never returns.
            let abort = intake.abort_handle();
            let intake_stopped = async {
                if tokio::time::timeout(INTAKE_STOP, intake).await.is_err() {
                    tracing::warn!(route = %self.route, "the intake did not stop in time; abandoning it");
                    abort.abort();
                }
            };
            if stopping {
                intake_stopped.await;
                return; // the runtime calls `flush` once publishes are done
            }
            let session = if yielding {
                // The session still writes: the intake winds down first.
                intake_stopped.await;
                tracing::info!(route = %self.route, "giving this partition to an instance below its share; releasing its messages to the next owner");
                self.end_writing().await
            } else {
                // The lock is lost: what fired owes its Done, written at
                // once, not once the intake has stopped (a stream
                // ingress's stop took 30 s, past the next owner's restore).
                let (session, ()) = tokio::join!(self.end_writing(), intake_stopped);
                tracing::error!(route = %self.route, "lost the route's lock (its connection closed or a state write failed); releasing its messages to the next owner");
                self.move_off_lock_endpoint();
                session
            };
            // Fenced, its session over: handed over once what it owes is
            // written (a partition given up, or a connection lost under it).
            if let Some(session) = session {
                self.lose_handing_over(session, true).await;
            }
            self.left_partition(yielding);
        }
    }

    /// (The endpoint the last lock attempt reached, the one the next
    /// starts at.)
    fn lock_endpoint(&self) -> (usize, usize) {
        *self.lock_endpoint.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next lock attempt starts at the endpoint after the last one's.
    fn move_off_lock_endpoint(&self) {
        let mut at = self.lock_endpoint.lock().unwrap_or_else(|e| e.into_inner());
        at.1 = at.0 + 1;
    }

    /// This partition's lock is no longer held here (see `PartitionGroup`).
    fn left_partition(&self, yielding: bool) {
        if let Some(group) = &self.group {
            group.gave_up(yielding);
        }
    }

    /// Register on the lock queue and wait until this instance is elected;
    /// with the state as read ahead meanwhile.
    async fn elect(
        &self,
        warm: &mut Warm,
    ) -> Result<(StateSession, Option<ReadAhead<Replay>>), StateError> {
        let first = self.lock_endpoint().1;
        let (connection, reached) = self.broker.open_dedicated_from(first).await?;
        *self.lock_endpoint.lock().unwrap_or_else(|e| e.into_inner()) = (reached, reached);
        let registered = tokio::time::timeout(
            REGISTER_TIMEOUT,
            Candidate::register(connection, &self.names),
        )
        .await;
        let Ok(candidate) = registered else {
            // The connection is dropped, which closes it.
            self.move_off_lock_endpoint();
            return Err(StateError::Unanswered {
                what: format!("a registration on the lock queue {}", self.names.lock()),
                timeout: REGISTER_TIMEOUT,
            });
        };
        let candidate = candidate?;
        tracing::info!(route = %self.route, lock = %self.names.lock(), "waiting to own the route (standby while another instance owns it)");
        // Once chosen, the candidate waits out a former owner's lease
        // before it may read as the owner: the state is read ahead, kept
        // up while on standby, and only what was written since is read
        // once owned.
        let chosen = tokio::sync::Notify::new();
        let was_chosen = AtomicBool::new(false);
        let seen = |waiting| match waiting {
            Waiting::Standby => self.set_phase(Phase::Standby),
            Waiting::Chosen => {
                was_chosen.store(true, Ordering::Release);
                chosen.notify_one();
            }
        };
        let election = async {
            match &self.group {
                // Owning its share already, this instance leaves the lock queue.
                Some(group) => {
                    candidate
                        .elected_unless(self.names.ping_every(), seen, group.full())
                        .await
                }
                None => candidate.elected(self.names.ping_every(), seen).await,
            }
        };
        // A standby keeps the state read (see `warm`) until chosen.
        let reading_ahead = async {
            loop {
                tokio::select! {
                    biased;
                    () = chosen.notified() => break,
                    () = tokio::time::sleep(warm::CHECK_EVERY) => {
                        warm.check(|| self.open_observer()).await;
                    }
                }
            }
            warm.finish(|| self.open_observer()).await
        };
        tokio::pin!(election, reading_ahead);
        let mut ahead = None;
        let session = loop {
            tokio::select! {
                elected = &mut election => break elected?,
                read = &mut reading_ahead, if ahead.is_none() => ahead = Some(read),
            }
        };
        let ahead = match ahead {
            Some(read) => read,
            // Still reading: it is let finish. What holds it up (a stream
            // whose leader died electing another) would hold a cold read up
            // as long, and it has a head start; a read that stalls for good
            // fails on its own (`READ_STALL`), and the owner reads cold.
            // Cutting it short at two leases cost a conn-node run 2 s.
            None if was_chosen.load(Ordering::Acquire) => reading_ahead.await,
            None => None,
        };
        Ok((session, ahead))
    }

    /// A session of its own that owns nothing, to read the state ahead
    /// with (see [`StateSession::read_ahead`]).
    async fn open_observer(&self) -> Result<StateSession, StateError> {
        let (connection, _) = self
            .broker
            .open_dedicated_from(self.lock_endpoint().1)
            .await?;
        StateSession::observe(connection, &self.names).await
    }

    /// Read the live set back, arm it here, and write it into a fresh
    /// generation meanwhile; the writer starts on that generation once it
    /// is written, and holds every write queued until then.
    ///
    /// Arming does not wait for the fresh generation (0.3-1.3 s for 60,000
    /// messages on a loaded cluster): what fires meanwhile queues its Done
    /// behind it. If the write fails, the pointer still names the
    /// generation read, and those Dones are owed to the one after it (see
    /// `write_loop`), which the next restore reads last.
    async fn restore(
        self: &Arc<Self>,
        session: &Arc<StateSession>,
        ahead: Option<ReadAhead<Replay>>,
    ) -> Result<(JoinHandle<()>, CancellationToken), anyhow::Error> {
        let ReadBack {
            current,
            live,
            departed,
            offsets,
        } = read_back(session, &self.route, ahead).await?;
        *self.offsets.lock().unwrap_or_else(|e| e.into_inner()) = offsets.clone();
        // Before anything is consumed: a late redelivery of one of them is
        // not a new message.
        for d in &departed {
            self.engine.remember_departed(
                MessageId::from_u128(d.id),
                d.fingerprint,
                d.digest,
                d.cancelled,
            );
        }
        if !departed.is_empty() {
            tracing::info!(route = %self.route, departed = departed.len(), "messages that left the route recently are remembered: a late redelivery of one keeps its id");
        }
        let skipped = session.skipped();
        if skipped > 0 {
            tracing::error!(route = %self.route, skipped, "undecodable records skipped in the route's state streams (not written by delayd)");
            metrics::counter!("delayd_store_records_skipped_total", "route" => self.route.clone())
                .increment(skipped);
        }
        let live = Arc::new(live);
        let carried = departed.len() as u64;
        let fresh = Fresh::after(current);
        let written = tokio::spawn(write_fresh(
            session.clone(),
            self.route.clone(),
            fresh,
            live.clone(),
            departed,
            offsets.clone(),
        ));
        let (tx, rx) = mpsc::unbounded_channel();
        *self.writer.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
        let failed = CancellationToken::new();
        let writer = tokio::spawn(write_loop(
            self.clone(),
            session.clone(),
            (fresh, written),
            offsets,
            (live.iter().map(|r| r.id).collect(), carried),
            rx,
            failed.clone(),
        ));
        let gauge =
            metrics::gauge!("delayd_store_restoring_partitions", "route" => self.route.clone());
        gauge.set(1.0);
        // Soonest due first: those due while the route had no owner fire
        // as soon as they are armed, not after the whole set (60,000
        // messages take about a second to arm).
        let mut by_due: Vec<&LiveRecord> = live.iter().collect();
        by_due.sort_by_key(|r| r.due_ms);
        let result = match self.arm(&by_due).await {
            Ok(()) => self.adopt_local().await.map(|n| {
                if n > 0 {
                    tracing::info!(route = %self.route, written = n, "messages this WAL kept from before the route used the broker store written to its state stream");
                }
            }),
            Err(e) => Err(e.into()),
        };
        gauge.set(0.0);
        if let Err(e) = result {
            *self.writer.lock().unwrap_or_else(|e| e.into_inner()) = None;
            let _ = writer.await;
            // What fired before the failure owes its Done.
            self.start_writing_owed();
            return Err(e);
        }
        Ok((writer, failed))
    }

    /// Store and arm restored messages (not redeliveries: stored whatever
    /// the local WAL had, which was released).
    async fn arm(&self, live: &[&LiveRecord]) -> Result<(), EngineError> {
        for chunk in live.chunks(RESTORE_BATCH) {
            let stored: Vec<_> = chunk
                .iter()
                .map(|r| {
                    // Its identity, not its key: a copy goes out under
                    // its sibling's, as where it was stored.
                    let uid = MessageId::from_u128(r.identity);
                    let s = self
                        .engine
                        .store(&self.route, r.due_ms, uid, r.message.clone(), false);
                    (
                        StateKey {
                            id: r.id,
                            identity: r.identity,
                        },
                        s,
                    )
                })
                .collect();
            let mut n = 0;
            for (key, s) in stored {
                match s.await {
                    Ok(Stored::New(id) | Stored::Copy { id, .. }) => {
                        self.bind(id, key);
                        // The former owner's ack of it may or may not have
                        // reached the broker: a byte-equal redelivery is
                        // that delivery or a twin published on purpose
                        // (taken for it, the twin was lost). It is stored
                        // again under this identity (see `engine::dedup`).
                        self.engine.ack_sending(id);
                        n += 1;
                    }
                    Ok(Stored::Duplicate) => {}
                    Err(EngineError::Wal(crate::wal::WalError::TooLarge { .. })) => {
                        tracing::error!(route = %self.route, "a restored message is larger than wal.max_message_bytes; it stays in the state stream");
                    }
                    Err(e) => return Err(e),
                }
            }
            metrics::counter!("delayd_store_restored_total", "route" => self.route.clone())
                .increment(n);
        }
        Ok(())
    }

    /// Stop writing, release what this owner held, give the lock up, and
    /// write the Dones still owed on a connection of their own.
    async fn end_session(self: &Arc<Self>) {
        if let Some(session) = self.end_writing().await {
            self.lose(session).await;
        }
    }

    /// End the session's writer: what is queued, and every Done from now
    /// on, is owed, and writing what is owed starts. The session, if there
    /// was one, for [`StreamStore::lose`].
    async fn end_writing(self: &Arc<Self>) -> Option<Arc<StateSession>> {
        *self.writer.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let (writer, session) = self.writer_task.lock().await.take()?;
        let _ = writer.await;
        // At once: the next owner reads a lease after the end, and
        // releasing what this owner held can take seconds.
        self.start_writing_owed();
        Some(session)
    }

    /// Start writing what ended sessions owe, unless a task already does.
    fn start_writing_owed(self: &Arc<Self>) {
        if !self.writing_owed.swap(true, Ordering::SeqCst) {
            tokio::spawn(self.clone().write_owed());
        }
    }

    /// Write what ended sessions owe (see [`owed`](super::owed)) until
    /// their time is over, into the streams they wrote to, as an observer:
    /// no lock is needed for a Done.
    async fn write_owed(self: Arc<Self>) {
        loop {
            self.write_owed_until_over().await;
            self.writing_owed.store(false, Ordering::SeqCst);
            // A session that ended while the last round finished found the
            // flag still set: its records are this task's.
            let outstanding = self.owed().outstanding(std::time::Instant::now());
            if !outstanding || self.writing_owed.swap(true, Ordering::SeqCst) {
                return;
            }
        }
    }

    async fn write_owed_until_over(&self) {
        let mut session: Option<StateSession> = None;
        let (mut written, mut unwritten) = (0u64, 0u64);
        loop {
            let (owed, over) = self.owed().take(std::time::Instant::now());
            for (stream, records) in owed {
                let n = records.len() as u64;
                match self.append_owed(&mut session, &stream, &records).await {
                    Ok(()) => {
                        written += n;
                        // As written, not when the round ends: each session
                        // that ends meanwhile extends it.
                        metrics::counter!("delayd_store_dones_after_session_total", "route" => self.route.clone())
                            .increment(n);
                    }
                    Err(e) => {
                        unwritten += n;
                        tracing::debug!(route = %self.route, stream, error = %e, "a former owner's Dones were not written; those messages fire again");
                        // The next round opens another connection.
                        if let Some(s) = session.take() {
                            s.close().await;
                        }
                    }
                }
            }
            let hand_over = self.owed().hand_over_now(std::time::Instant::now());
            if let Some(last_back_sent) = hand_over {
                self.hand_over_lost(&mut session, last_back_sent).await;
            }
            if over {
                break;
            }
            tokio::time::sleep(OWED_POLL).await;
        }
        if let Some(s) = session {
            s.close().await;
        }
        if written + unwritten > 0 {
            tracing::info!(route = %self.route, written, unwritten, "a former owner's Dones written after its session ended");
        }
    }

    /// Hand a lost session's route over (see `Owed::hand_over_now`) on
    /// the session that writes its owed Dones, opened if need be.
    async fn hand_over_lost(
        &self,
        session: &mut Option<StateSession>,
        last_back_sent: std::time::Instant,
    ) {
        let handed = async {
            if session.is_none() {
                *session = Some(self.open_observer().await?);
            }
            let Some(s) = session.as_ref() else {
                unreachable!("opened above")
            };
            s.hand_over_for(last_back_sent).await
        };
        // Bounded by the bound itself: the owed Dones wait behind it.
        let left = (last_back_sent + self.names.lease)
            .saturating_duration_since(std::time::Instant::now());
        let outcome = tokio::time::timeout(left, handed)
            .await
            .unwrap_or(Ok(false));
        self.log_hand_over(
            outcome,
            " from a connection of its own once its Dones were written",
        );
    }

    /// How a hand-over went; `how` says how it was sent.
    fn log_hand_over(&self, outcome: Result<bool, StateError>, how: &str) {
        match outcome {
            Ok(true) => {
                tracing::info!(route = %self.route, "the route handed over to the next owner{how}")
            }
            Ok(false) => {
                tracing::info!(route = %self.route, "the route was not handed over{how}: the lock was no longer held, or not within a lease of its last ping back; the next owner waits out the lease")
            }
            Err(e) => {
                tracing::info!(route = %self.route, error = %e, "the route could not be handed over{how}; the next owner waits out the lease")
            }
        }
    }

    async fn append_owed(
        &self,
        session: &mut Option<StateSession>,
        stream: &str,
        records: &[Vec<u8>],
    ) -> Result<(), StateError> {
        if session.is_none() {
            *session = Some(self.open_observer().await?);
        }
        let Some(s) = session.as_ref() else {
            unreachable!("opened above")
        };
        s.append(stream, records).await.await
    }

    /// Close the session, so that the lock goes to the next owner at once,
    /// then release every message held for the streams. Nothing fires here
    /// meanwhile: the phase is no longer an owner's (see `may_fire`).
    async fn lose(&self, session: Arc<StateSession>) {
        self.lose_handing_over(session, false).await;
    }

    /// [`StreamStore::lose`]; `hand_over`: what writes the session's owed
    /// Dones hands the route over once they are written, if that can still
    /// be done within a lease of its last ping back (see
    /// `write_owed_until_over`). For a session that ended while this
    /// instance fenced itself: a partition given up, a connection closed
    /// under it (a drained node).
    async fn lose_handing_over(&self, session: Arc<StateSession>, hand_over: bool) {
        session.close().await;
        let ids: Vec<u64> = {
            let mut ids = self.ids();
            ids.early_done.clear();
            // Each one may be on the wire: if its publish is confirmed, its
            // Done is owed (see `owed`). Known as leaving before the ids go,
            // or a confirm meanwhile would find neither.
            let mut owed = self.owed();
            let leaving = ids
                .by_engine
                .drain()
                .map(|(id, key)| {
                    owed.leaving(id, key.id);
                    id
                })
                .collect();
            if let Some(sent) = session.last_back_sent().filter(|_| hand_over) {
                owed.may_hand_over(sent, self.names.lease);
            }
            leaving
        };
        let outcomes = super::release_all(&self.engine, ids).await;
        let mut released = 0u64;
        for (id, outcome) in outcomes {
            match outcome {
                Ok(true) => {
                    released += 1;
                    self.owed().left(id); // not published: nothing owed
                }
                Ok(false) => {} // being published (see `owed`)
                Err(e) => {
                    tracing::error!(route = %self.route, id, error = %e, "cannot release a message; it may fire here too")
                }
            }
        }
        if released > 0 {
            tracing::info!(route = %self.route, released, "messages left to the route's next owner");
        }
    }

    /// At shutdown, once in-flight publishes are done: write what is
    /// queued (within `timeout`) and give the lock up, handed over to the
    /// next owner if every write was made (it then need not wait out the
    /// lease: a redeploy of the owner used to leave the route without one
    /// for 5.25 s).
    pub async fn flush(&self, timeout: Duration) {
        // Nothing fires here any more (publishes are done), and the next
        // owner may be told so within milliseconds: /readyz and /status
        // stop naming this instance the owner before that.
        self.set_phase(Phase::Electing);
        *self.writer.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let task = self.writer_task.lock().await.take();
        if let Some((writer, session)) = task {
            match tokio::time::timeout(timeout, writer).await {
                Err(_) => {
                    tracing::warn!(route = %self.route, "state writes still queued at shutdown; those messages fire again after a restore");
                }
                Ok(_) if self.owed().owes_records() => {
                    tracing::info!(route = %self.route, "Dones still owed at shutdown (a state write failed): the route is not handed over, and the next owner waits out the lease (they land meanwhile)");
                }
                // Bounded: past a lease the bound cannot hold anyway, and a
                // connection behind a cut link must not hold the stop up.
                Ok(_) => {
                    let outcome = tokio::time::timeout(self.names.lease, session.hand_over())
                        .await
                        .unwrap_or(Ok(false));
                    self.log_hand_over(outcome, "");
                }
            }
            session.close().await;
        }
    }
}

async fn sleep_or_stop(wait: Duration, stop: &CancellationToken) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(wait) => false,
        _ = stop.cancelled() => true,
    }
}

/// Read the live set from the generation the pointer names (and the next
/// one, left by a checkpoint that did not finish).
///
/// The generation the pointer names must exist: it is declared before the
/// pointer names it and deleted only after the pointer has moved on. If it
/// is missing, its records are gone (deleted by hand): restoring without
/// them would start the route empty and report it ready, so recovery
/// refuses ([`StateError::Missing`]).
///
/// `ahead`, the generation as read before this instance owned the route,
/// saves reading it again when it is still the current one: only what was
/// written to it since is read.
async fn read_back(
    session: &StateSession,
    route: &str,
    ahead: Option<ReadAhead<Replay>>,
) -> Result<ReadBack, StateError> {
    let names = session.names().clone();
    let started = std::time::Instant::now();
    let (current, disagreed) = session.current_generation().await?;
    if disagreed {
        tracing::warn!(route, pointers = ?names.pointers(), generation = ?current, "the route's two pointer streams disagreed (one was deleted, or a restart cut a write between them); both are written again");
        metrics::counter!("delayd_store_pointer_repairs_total", "route" => route.to_owned())
            .increment(1);
    }
    let mut replay = Replay::new(route, departed::KEPT);
    let mut read = 0;
    let mut read_before = 0;
    if let Some(g) = current {
        let stream = names.generation(g);
        if !session.exists(&stream).await? {
            return Err(StateError::Missing {
                stream,
                generation: g,
            });
        }
        match ahead.filter(|a| a.generation == g) {
            Some(ahead) => {
                read_before = ahead.read;
                let (caught_up, total) = session.catch_up(ahead).await?;
                replay = caught_up;
                read += total;
            }
            None => read += replay.read(session, &stream).await?,
        }
        // g + 1 is declared if missing (a checkpoint may have stopped
        // before it was made): it is where Dones go if the fresh
        // generation cannot be written (see `Fresh`), and both are deleted
        // once it is.
        let next = names.generation(g + 1);
        session.declare_stream(&next).await?;
        read += replay.read(session, &next).await?;
    }
    let (live, departed, offsets) = replay.finish();
    tracing::debug!(
        generation = ?current,
        read,
        read_before,
        live = live.len(),
        departed = departed.len(),
        read_ms = started.elapsed().as_millis() as u64,
        "state streams read back"
    );
    Ok(ReadBack {
        current,
        live,
        departed,
        offsets,
    })
}

/// What [`read_back`] read from generation `current`.
struct ReadBack {
    current: Option<u64>,
    live: Vec<LiveRecord>,
    /// The newest messages that left, oldest first (see [`departed`]).
    departed: Vec<Departed>,
    offsets: HashMap<String, i64>,
}

/// The generation a restore writes the live set read back into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fresh {
    generation: u64,
    /// The generation read (the pointer named it), if there was one.
    read: Option<u64>,
}

impl Fresh {
    /// Two above the generation read: the next one may hold a checkpoint's
    /// start, read too.
    fn after(read: Option<u64>) -> Self {
        Fresh {
            generation: read.map_or(0, |g| g + 2),
            read,
        }
    }

    /// Where the Dones of what fired go if the fresh generation's write
    /// failed: `pointed`, the pointer had moved to it. Before that, the
    /// next restore reads the generation read and then the one after it,
    /// and a Done appended last to that one follows its Schedule, wherever
    /// the Schedule is; the fresh one is written again from scratch.
    fn owed_to_after_failure(&self, pointed: bool) -> u64 {
        match (pointed, self.read) {
            (false, Some(g)) => g + 1,
            _ => self.generation,
        }
    }
}

/// Why a fresh generation was not finished.
#[derive(Debug)]
struct FreshFailed {
    error: StateError,
    /// The pointer had moved to it (only the deletes after failed).
    pointed: bool,
}

/// Write the live set read back into `fresh`, point at it, and delete the
/// generations read and orphans below them.
async fn write_fresh(
    session: Arc<StateSession>,
    route: String,
    fresh: Fresh,
    live: Arc<Vec<LiveRecord>>,
    departed: Vec<Departed>,
    offsets: HashMap<String, i64>,
) -> Result<(), FreshFailed> {
    let started = std::time::Instant::now();
    let not_pointed = |error| FreshFailed {
        error,
        pointed: false,
    };
    write_generation(&session, fresh.generation, &live, &departed, &offsets)
        .await
        .map_err(not_pointed)?;
    let written_ms = started.elapsed().as_millis() as u64;
    if let Some(g) = fresh.read {
        let names = session.names();
        for n in [g, g + 1] {
            session
                .delete(&names.generation(n))
                .await
                .map_err(|error| FreshFailed {
                    error,
                    pointed: true,
                })?;
        }
        // Only below g: fresh (g + 2) and the next one the writer
        // prepares are above it.
        delete_orphans(&session, &route, g).await;
    }
    tracing::debug!(
        route,
        generation = fresh.generation,
        live = live.len(),
        departed = departed.len(),
        written_ms,
        deleted_ms = started.elapsed().as_millis() as u64,
        "fresh generation written"
    );
    Ok(())
}

/// A stream named like a generation below the recovered one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Below {
    Missing,
    /// A generation of this route that no pointer names any more.
    Orphan,
    /// Another route's pointer: `<prefix><route>.<n>` is also the pointer
    /// of a route named `<route>.<n>` (partition n of a partitioned route
    /// `<route>`, say).
    Foreign,
}

/// The generations below `below` whose streams exist, lowest first, found
/// by probing downward until [`ORPHAN_GAP`] numbers in a row are missing,
/// generation 0 is passed, or a stream turns out to be another route's.
async fn find_orphans<F, Fut>(below: u64, mut probe: F) -> Result<Vec<u64>, StateError>
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = Result<Below, StateError>>,
{
    let mut found = Vec::new();
    let mut missing = 0;
    for n in (0..below).rev() {
        if missing == ORPHAN_GAP {
            break;
        }
        match probe(n).await? {
            Below::Missing => missing += 1,
            Below::Orphan => {
                missing = 0;
                found.push(n);
            }
            Below::Foreign => break,
        }
    }
    // Lowest first: a restore cut short leaves the highest, which the next
    // one reaches first.
    found.reverse();
    Ok(found)
}

/// What generation `n`'s name holds.
async fn probe_below(session: &StateSession, route: &str, n: u64) -> Result<Below, StateError> {
    let stream = session.names().generation(n);
    if !session.exists(&stream).await? {
        return Ok(Below::Missing);
    }
    // A route's pointer has a lock queue and a pointer copy beside it; a
    // generation never has either.
    let other = StateNames::new(stream);
    for companion in [other.lock(), other.pointer_copy()] {
        if session.exists(&companion).await? {
            tracing::warn!(route, stream = %other.pointer, %companion, "a stream named like an older generation of this route belongs to another route; it is left alone, and no older generation is looked for");
            return Ok(Below::Foreign);
        }
    }
    Ok(Below::Orphan)
}

/// Delete the route's generations below `below` (the one recovery read,
/// deleted just before with the next one): a crash after a pointer move
/// and before the deletes that follow it (here, or in a checkpoint) leaves
/// streams that no pointer names and nothing else would ever delete. Best
/// effort: a failure is logged, and the next restore looks again.
async fn delete_orphans(session: &StateSession, route: &str, below: u64) {
    let orphans = match find_orphans(below, |n| probe_below(session, route, n)).await {
        Ok(found) => found,
        Err(e) => {
            tracing::warn!(route, error = %e, "cannot look for orphaned generation streams; the next restore looks again");
            return;
        }
    };
    for n in orphans {
        let stream = session.names().generation(n);
        if let Err(e) = session.delete(&stream).await {
            tracing::warn!(route, %stream, error = %e, "cannot delete an orphaned generation stream; the next restore tries again");
            return;
        }
        tracing::info!(route, %stream, "orphaned generation stream deleted (a crash had left it after the pointer moved past it)");
        metrics::counter!("delayd_store_orphans_deleted_total", "route" => route.to_owned())
            .increment(1);
    }
}

/// Write `live` and `departed` into generation `n` (emptied first), then
/// point at it.
async fn write_generation(
    session: &StateSession,
    n: u64,
    live: &[LiveRecord],
    departed: &[Departed],
    offsets: &HashMap<String, i64>,
) -> Result<(), StateError> {
    let names = session.names().clone();
    let stream = names.generation(n);
    session.delete(&stream).await?;
    session.declare_stream(&stream).await?;
    let mut confirms = Vec::new();
    if !offsets.is_empty() {
        confirms.push(session.append(&stream, &offset_records(offsets)).await);
    }
    for chunk in departed.chunks(WRITE_BATCH) {
        let records: Vec<Vec<u8>> = chunk.iter().map(|d| d.record().encode()).collect();
        confirms.push(session.append(&stream, &records).await);
    }
    for chunk in live.chunks(WRITE_BATCH) {
        let records: Vec<Vec<u8>> = chunk.iter().map(|r| r.record().encode()).collect();
        confirms.push(session.append(&stream, &records).await);
    }
    for confirm in confirms {
        confirm.await?;
    }
    session.point_at(n).await
}

/// The owner's single writer: appends Schedules and Dones in the order
/// they were queued, and runs checkpoints beside them. Any failure ends the
/// session (`failed`): the next owner, perhaps this instance again,
/// restores.
///
/// A checkpoint does not stop the writes: they move to generation `g + 1`
/// at once, while a reader reads `g` back and hands its live Schedules to
/// this loop, which appends each to `g + 1` only if it is still live here
/// (no Done appended since). A Done queued after that check is appended
/// after the copy, so no copy can land after its Done. Until the pointer
/// moves, recovery reads `g` and then `g + 1`, which gives the same live
/// set.
async fn write_loop(
    store: Arc<StreamStore>,
    session: Arc<StateSession>,
    (fresh, written): (Fresh, JoinHandle<Result<(), FreshFailed>>),
    offsets: HashMap<String, i64>,
    (live, carried): (HashSet<u128>, u64),
    mut rx: mpsc::UnboundedReceiver<Write>,
    failed: CancellationToken,
) {
    let names = session.names().clone();
    // Until the fresh generation is written, a Done the session cannot
    // take is owed where its write's failure would leave it.
    store
        .owed()
        .writing(names.generation(fresh.owed_to_after_failure(false)));
    let unwritten = match written.await {
        Ok(Ok(())) => None,
        Ok(Err(FreshFailed { error, pointed })) => {
            tracing::error!(route = %store.route, %error, pointed, "cannot write the restored messages into a fresh generation; ending this owner's session");
            Some(fresh.owed_to_after_failure(pointed))
        }
        Err(error) => {
            tracing::error!(route = %store.route, %error, "the fresh generation's write stopped; ending this owner's session");
            Some(fresh.owed_to_after_failure(false))
        }
    };
    let (owed_to, finishing) = match unwritten {
        Some(n) => {
            failed.cancel();
            (names.generation(n), None)
        }
        None => {
            let mut writer = Writer {
                route: store.route.clone(),
                owed: store.owed.clone(),
                next: Some(prepare(session.clone(), fresh.generation + 1)),
                session,
                generation: fresh.generation,
                in_generation: live.len() as u64 + carried,
                live,
                carried,
                offsets,
                confirming: Vec::new(),
                finishing: None,
                failed,
                floor: store.checkpoint_floor,
            };
            writer.owed().writing(names.generation(writer.generation));
            if let Err(e) = writer.run(&mut rx).await {
                tracing::error!(route = %writer.route, error = %e, "a state write failed; ending this owner's session");
                writer.failed.cancel();
            }
            for task in writer.confirming.drain(..) {
                let _ = task.await;
            }
            (names.generation(writer.generation), writer.finishing.take())
        }
    };
    // What is still queued, and whatever comes once the channel is closed
    // (`StreamStore::queue_done`), is owed: the former owner writes its
    // Dones after the session (see `owed`).
    let until = std::time::Instant::now() + names.lease;
    store.owed().ended(owed_to.clone(), until);
    rx.close();
    while let Ok(write) = rx.try_recv() {
        if let Write::Done {
            record, remembered, ..
        } = write
        {
            let mut owed = store.owed();
            owed.owe(&owed_to, record);
            if let Some(r) = remembered {
                owed.owe(&owed_to, r);
            }
        }
    }
    if let Some(task) = finishing {
        let _ = task.await;
    }
}

/// Empty (delete) and declare generation `n`'s stream, off the writer's
/// path: stream creation takes the broker a while.
fn prepare(session: Arc<StateSession>, n: u64) -> JoinHandle<Result<(), StateError>> {
    tokio::spawn(async move {
        let stream = session.names().generation(n);
        session.delete(&stream).await?;
        session.declare_stream(&stream).await
    })
}

/// A checkpoint being copied: what the old generation holds arrives from
/// its reader.
struct Copying {
    from: u64,
    records: mpsc::Receiver<Result<Copied, StateError>>,
}

/// Part of a checkpoint's copy.
enum Copied {
    /// The old generation's newest departed messages (sent first).
    Departed(Vec<Departed>),
    /// Some of its live Schedules.
    Live(Vec<LiveRecord>),
}

struct Writer {
    route: String,
    /// Where Dones whose append failed go (see `owed`).
    owed: Arc<Mutex<Owed>>,
    session: Arc<StateSession>,
    generation: u64,
    /// Records appended to `generation` so far.
    in_generation: u64,
    /// Store ids whose Schedule is appended and whose Done is not.
    live: HashSet<u128>,
    /// `Remembered` records the last checkpoint (or the restore) carried
    /// into `generation`: they count as live for the next checkpoint's
    /// trigger, or a carry alone would start the next one.
    carried: u64,
    /// The highest next offset appended per stream ingress: a checkpoint
    /// carries it into the new generation first.
    offsets: HashMap<String, i64>,
    confirming: Vec<JoinHandle<()>>,
    /// The next generation's stream being prepared.
    next: Option<JoinHandle<Result<(), StateError>>>,
    /// The last checkpoint's pointer move and deletion.
    finishing: Option<JoinHandle<()>>,
    failed: CancellationToken,
    floor: u64,
}

impl Writer {
    fn owed(&self) -> MutexGuard<'_, Owed> {
        self.owed.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn run(&mut self, rx: &mut mpsc::UnboundedReceiver<Write>) -> Result<(), StateError> {
        let mut copying: Option<Copying> = None;
        loop {
            if self.failed.is_cancelled() {
                return Ok(());
            }
            let chunk = tokio::select! {
                write = rx.recv() => match write {
                    Some(first) => {
                        self.append_writes(first, rx).await;
                        None
                    }
                    None => return Ok(()),
                },
                chunk = async { copying.as_mut()?.records.recv().await }, if copying.is_some() => {
                    Some(chunk)
                }
            };
            match chunk {
                Some(Some(Ok(Copied::Live(records)))) => self.append_copies(records).await,
                Some(Some(Ok(Copied::Departed(departed)))) => {
                    self.carried = departed.len() as u64;
                    let records = departed.iter().map(|d| d.record().encode()).collect();
                    self.append(records, Vec::new(), ("checkpoint", 0), Vec::new())
                        .await;
                }
                Some(Some(Err(e))) => return Err(e),
                Some(None) => {
                    // The old generation is copied: point at the new one.
                    let from = copying.take().map_or(self.generation, |c| c.from);
                    self.finish_checkpoint(from);
                }
                None => {}
            }
            let kept = 2 * self.live.len() as u64 + self.carried + self.floor;
            if copying.is_none() && self.in_generation > kept {
                copying = self.start_checkpoint().await?;
            }
        }
    }

    /// Append `first` and whatever else is queued, up to a batch.
    async fn append_writes(&mut self, first: Write, rx: &mut mpsc::UnboundedReceiver<Write>) {
        let mut batch = vec![first];
        while batch.len() < WRITE_BATCH {
            match rx.try_recv() {
                Ok(w) => batch.push(w),
                Err(_) => break,
            }
        }
        let mut records = Vec::with_capacity(batch.len());
        let mut replies = Vec::new();
        let mut dones = 0u64;
        // Kept until confirmed: owed if the append fails.
        let mut done_records = Vec::new();
        for write in batch {
            match write {
                Write::Schedule { id, record, reply } => {
                    self.live.insert(id);
                    records.push(record);
                    replies.push(reply);
                }
                Write::Done {
                    id,
                    record,
                    remembered,
                    reply,
                } => {
                    self.live.remove(&id);
                    done_records.push(record.clone());
                    done_records.extend(remembered.clone());
                    records.push(record);
                    records.extend(remembered);
                    replies.extend(reply);
                    dones += 1;
                }
                Write::Offset { queue, next, reply } => {
                    records.push(
                        Record::Offset {
                            queue: queue.clone(),
                            next,
                        }
                        .encode(),
                    );
                    let at = self.offsets.entry(queue).or_insert(next);
                    *at = (*at).max(next);
                    replies.push(reply);
                }
            }
        }
        self.append(records, replies, ("done", dones), done_records)
            .await;
    }

    /// Append the still-live ones of a checkpoint's copies, and a
    /// `Remembered` record for each of the others: its Done, appended to the
    /// new generation since the checkpoint began, follows a Schedule that
    /// goes with the old one.
    async fn append_copies(&mut self, copies: Vec<LiveRecord>) {
        let records: Vec<Vec<u8>> = copies
            .into_iter()
            .map(|r| {
                if self.live.contains(&r.id) {
                    r.record()
                } else {
                    Departed::of(&self.route, r.identity, &r.message, false).record()
                }
                .encode()
            })
            .collect();
        if !records.is_empty() {
            let n = records.len() as u64;
            self.append(records, Vec::new(), ("checkpoint", n), Vec::new())
                .await;
        }
    }

    async fn append(
        &mut self,
        records: Vec<Vec<u8>>,
        replies: Vec<oneshot::Sender<Result<(), String>>>,
        (kind, counted): (&'static str, u64),
        dones: Vec<Vec<u8>>,
    ) {
        let stream = self.session.names().generation(self.generation);
        let confirm = self.session.append(&stream, &records).await;
        self.in_generation += records.len() as u64;
        let failed = self.failed.clone();
        let owed = self.owed.clone();
        let route = self.route.clone();
        let total = records.len() as u64;
        self.confirming.retain(|t| !t.is_finished());
        self.confirming.push(tokio::spawn(async move {
            let result = confirm.await.map_err(|e| e.to_string());
            match &result {
                Ok(()) => {
                    if counted > 0 {
                        metrics::counter!("delayd_store_writes_total", "route" => route.clone(), "kind" => kind).increment(counted);
                    }
                }
                Err(e) => {
                    metrics::counter!("delayd_store_write_failures_total", "route" => route.clone()).increment(total);
                    // Every write in flight fails with the connection: the
                    // first one says it.
                    if !failed.is_cancelled() {
                        tracing::error!(route = %route, error = %e, "a state write failed; ending this owner's session");
                    }
                    failed.cancel();
                    // Written or not: the former owner writes them again.
                    let mut owed = owed.lock().unwrap_or_else(|e| e.into_inner());
                    for record in dones {
                        owed.owe(&stream, record);
                    }
                }
            }
            for reply in replies {
                let _ = reply.send(result.clone());
            }
        }));
    }

    /// Move the writes to the next generation (once its stream is ready
    /// and the last checkpoint finished) and start reading the old one
    /// back. No wait for confirms: the reader's end marker goes over the
    /// same channel after every append to the old generation, so it reads
    /// them all.
    async fn start_checkpoint(&mut self) -> Result<Option<Copying>, StateError> {
        if self.finishing.as_ref().is_some_and(|t| !t.is_finished())
            || self.next.as_ref().is_some_and(|t| !t.is_finished())
        {
            return Ok(None); // checked again after the next write
        }
        if let Some(prepared) = self.next.take() {
            prepared.await.map_err(|_| StateError::Refused {
                stream: self.session.names().generation(self.generation + 1),
                why: "preparing the stream panicked",
            })??;
        }
        let from = self.generation;
        let to = from + 1;
        let names = self.session.names().clone();
        self.generation = to;
        let stream = self.session.names().generation(to);
        self.owed().writing(stream);
        self.in_generation = 0;
        self.next = Some(prepare(self.session.clone(), to + 1));
        let (tx, records) = mpsc::channel(4);
        let session = self.session.clone();
        let route = self.route.clone();
        tokio::spawn(async move {
            let mut replay = Replay::new(&route, departed::KEPT);
            let read = replay.read(&session, &names.generation(from)).await;
            if let Err(e) = read {
                let _ = tx.send(Err(e)).await;
                return;
            }
            let (live, departed, _) = replay.finish();
            if tx.send(Ok(Copied::Departed(departed))).await.is_err() {
                return;
            }
            let mut live = live.into_iter().peekable();
            while live.peek().is_some() {
                let chunk = live.by_ref().take(WRITE_BATCH).collect();
                if tx.send(Ok(Copied::Live(chunk))).await.is_err() {
                    return;
                }
            }
        });
        // The stream ingresses' offsets first: the old generation, which
        // holds them, goes once the pointer moves.
        let offsets = offset_records(&self.offsets);
        if !offsets.is_empty() {
            self.append(offsets, Vec::new(), ("checkpoint", 0), Vec::new())
                .await;
        }
        tracing::debug!(route = %self.route, from, to, "state checkpoint started");
        Ok(Some(Copying { from, records }))
    }

    /// Once every append so far is confirmed, point at the current
    /// generation and delete the one copied from (off the writer's path).
    fn finish_checkpoint(&mut self, from: u64) {
        let confirming: Vec<_> = self.confirming.drain(..).collect();
        let (session, failed, route) = (
            self.session.clone(),
            self.failed.clone(),
            self.route.clone(),
        );
        let (generation, live) = (self.generation, self.live.len());
        self.finishing = Some(tokio::spawn(async move {
            for task in confirming {
                let _ = task.await;
            }
            if failed.is_cancelled() {
                return;
            }
            let names = session.names().clone();
            let moved = async {
                session.point_at(generation).await?;
                session.delete(&names.generation(from)).await
            };
            match moved.await {
                Ok(()) => {
                    tracing::info!(route = %route, generation, live, "state checkpoint written; the older generation is deleted")
                }
                Err(e) => {
                    tracing::error!(route = %route, error = %e, "state checkpoint failed; ending this owner's session");
                    failed.cancel();
                }
            }
        }));
    }
}

/// One [`Record::Offset`] per stream ingress.
fn offset_records(offsets: &HashMap<String, i64>) -> Vec<Vec<u8>> {
    offsets
        .iter()
        .map(|(queue, &next)| {
            Record::Offset {
                queue: queue.clone(),
                next,
            }
            .encode()
        })
        .collect()
}

/// A stream ingress's next offset kept in the route's state streams: read
/// back by the restore that made this instance the owner, written through
/// the owner's writer (a write after the lock is lost fails, and the
/// deliveries it covers are not acked). A new owner reads the stream from
/// there; what the last one stored beyond it is read again under the same
/// identity (it follows from the offset), so at most it fires twice under
/// one id.
#[derive(Debug)]
struct StreamOffsets {
    store: std::sync::Weak<StreamStore>,
}

impl OffsetStore for StreamOffsets {
    fn load(&self, queue: &str) -> Result<Option<i64>, CheckpointError> {
        let Some(store) = self.store.upgrade() else {
            return Ok(None);
        };
        let offsets = store.offsets.lock().unwrap_or_else(|e| e.into_inner());
        Ok(offsets.get(queue).copied())
    }

    fn save(&self, queue: &str, next: i64) -> Result<(), CheckpointError> {
        let failed = |reason: &str| CheckpointError::State {
            queue: queue.to_owned(),
            reason: reason.to_owned(),
        };
        let store = self
            .store
            .upgrade()
            .ok_or_else(|| failed("the route's store is gone"))?;
        let (reply, confirmed) = oneshot::channel();
        let write = Write::Offset {
            queue: queue.to_owned(),
            next,
            reply,
        };
        if !store.send(write) {
            return Err(failed("this instance does not own the route"));
        }
        drop(store);
        match confirmed.blocking_recv() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(reason)) => Err(failed(&reason)),
            Err(_) => Err(failed("the owner's writer stopped")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An owner fires only while its lease is held, restoring or active:
    /// a restore that outlived the lease (its pings stalled) went on firing
    /// what it armed, beside the next owner.
    #[tokio::test]
    async fn an_owner_fires_nothing_past_its_lease_restoring_or_active() {
        let dir = tempfile::tempdir().unwrap();
        let config = crate::engine::EngineConfig::new(crate::wal::WalConfig::new(dir.path()));
        let (engine, _) = Engine::open(config, Arc::new(crate::engine::SystemClock)).unwrap();
        let endpoints = delayd_adapters::amqp::Endpoints::new(
            &delayd_adapters::amqp::AmqpSettings::url("amqp://127.0.0.1:1/%2f"),
        )
        .unwrap();
        let store = StreamStore::new(
            Arc::new(endpoints),
            StateNames::new("delayd.state.r"),
            "r",
            engine,
            100,
            dir.path().to_owned(),
            None,
        )
        .unwrap();
        let held = Arc::new(AtomicBool::new(true));
        store.won_lock({
            let held = held.clone();
            Arc::new(move || held.load(Ordering::SeqCst))
        });
        for phase in [Phase::Restoring, Phase::Active] {
            store.set_phase(phase);
            held.store(true, Ordering::SeqCst);
            assert!(store.may_fire(1), "{phase:?}: the owner may fire");
            held.store(false, Ordering::SeqCst);
            assert!(!store.may_fire(1), "{phase:?}: fired past its lease");
        }
        store.set_phase(Phase::Standby);
        held.store(true, Ordering::SeqCst);
        assert!(!store.may_fire(1), "a standby fires nothing");
    }

    #[test]
    fn a_failed_fresh_generation_leaves_its_dones_where_the_next_restore_reads_them_last() {
        let fresh = Fresh::after(Some(7));
        assert_eq!(fresh.generation, 9);
        // The pointer still names 7: the next restore reads 7, then 8.
        assert_eq!(fresh.owed_to_after_failure(false), 8);
        // It names 9 (only the deletes failed): the next restore reads 9.
        assert_eq!(fresh.owed_to_after_failure(true), 9);
        // A route never written: nothing was read, and nothing fired.
        let first = Fresh::after(None);
        assert_eq!(first.generation, 0);
        assert_eq!(first.owed_to_after_failure(false), 0);
    }

    /// `find_orphans(below)` over these existing generation streams and
    /// other routes' pointers: (what it found, the numbers it probed).
    async fn search(below: u64, streams: &[u64], foreign: &[u64]) -> (Vec<u64>, Vec<u64>) {
        let mut probed = Vec::new();
        let found = find_orphans(below, |n| {
            probed.push(n);
            let answer = if foreign.contains(&n) {
                Below::Foreign
            } else if streams.contains(&n) {
                Below::Orphan
            } else {
                Below::Missing
            };
            std::future::ready(Ok(answer))
        })
        .await
        .expect("no probe fails");
        (found, probed)
    }

    #[tokio::test]
    async fn orphans_right_below_are_found_lowest_first() {
        let (found, probed) = search(6, &[4, 5, 6, 7], &[]).await;
        assert_eq!(found, [4, 5]);
        assert_eq!(probed, [5, 4, 3, 2, 1, 0]);
    }

    #[tokio::test]
    async fn nothing_at_or_above_the_recovered_generation_nor_below_0_is_probed() {
        let (found, probed) = search(2, &[0, 1, 2, 3, 4], &[]).await;
        assert_eq!(found, [0, 1]);
        assert_eq!(probed, [1, 0]);
        assert_eq!(search(0, &[0, 1], &[]).await, (vec![], vec![]));
    }

    #[tokio::test]
    async fn the_search_ends_after_a_gap_of_missing_generations() {
        let (found, probed) = search(20, &[19, 17, 12, 3], &[]).await;
        assert_eq!(found, [17, 19]);
        assert_eq!(probed, [19, 18, 17, 16, 15, 14, 13]);
        // With none at all, a restore probes only ORPHAN_GAP names.
        assert_eq!(search(1000, &[], &[]).await.1.len() as u64, ORPHAN_GAP);
    }

    #[tokio::test]
    async fn another_routes_pointer_is_left_alone_and_ends_the_search() {
        let (found, probed) = search(10, &[9, 8, 7, 6], &[8]).await;
        assert_eq!(found, [9]);
        assert_eq!(probed, [9, 8]);
    }
}
