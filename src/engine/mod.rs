//! The engine: owns the WAL and the timing wheel.
//!
//! `schedule` appends a Schedule record, waits for group commit, then arms the
//! message in the wheel. The dispatcher sleeps until the next deadline, reads
//! due messages back from the WAL and hands them to a [`Dispatch`] with a
//! bounded number in flight; a Done is written when it confirms, and a failure
//! re-arms the message with back-off without holding up anything else. A
//! background task deletes dead segments and compacts sparse ones.
//!
//! Restart: the WAL is replayed into a fresh wheel. Messages that fell due
//! while delayd was down fire at `overdue_rate` per second, not all at once.

mod clock;
mod compact;
mod dedup;
mod dispatch;
mod keys;
mod pressure;
mod purge;
mod ready;
mod state;
mod summary;
mod tier;

pub use clock::{Clock, ManualClock, SystemClock};
pub use dedup::{digest, fingerprint, Arrival};
use dedup::{AckState, Candidate};
pub use dispatch::{Dispatch, Fired, Outcome};
pub use keys::key_hash;
pub use pressure::{Admission, Pressure};
pub use purge::PurgeCount;
pub use state::Phase;
pub use summary::DueSummary;
pub use tier::{FarSettings, LOAD_CHUNK_BYTES};

use std::collections::BinaryHeap;
use std::future::Future;

use futures_util::future::Either;
use futures_util::FutureExt;
use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(test)]
use std::sync::Mutex as StdMutex;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{oneshot, Notify};
use tokio_util::sync::CancellationToken;

use crate::far::{FarError, FarRecord};
use crate::id::MessageId;
use crate::wal::{
    Appended, Claimed, Record, RecordRef, RecoveryReport, SizeLimit, SpaceReport, Wal, WalConfig,
    WalError, WalPos,
};
use crate::wheel::Expired;

use self::state::{Slot, State};

/// Resolves once a queued WAL append is durable.
type AppendReceiver = oneshot::Receiver<Result<Appended, WalError>>;

/// A Schedule queued for the WAL: route id, key-index hash, durability.
type Queued = (
    u16,
    Option<u64>,
    oneshot::Receiver<Result<Claimed, WalError>>,
);

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub wal: WalConfig,
    /// Most messages being published at once.
    pub max_in_flight: usize,
    /// Most bytes of stored messages being published at once (read back,
    /// decoded, handed to a broker). One message bigger than this goes out
    /// alone.
    pub max_bytes_in_flight: usize,
    /// Messages per second for those already overdue when delayd started.
    pub overdue_rate: u32,
    /// First retry delay after a failed publish; doubles up to `retry_max`.
    pub retry_initial: Duration,
    pub retry_max: Duration,
    /// How many unconfirmed fingerprints to keep for redelivery detection.
    pub dedup_window: usize,
    /// How often dead segments are deleted and sparse ones compacted.
    pub gc_interval: Duration,
    /// Backpressure: most pending messages (0 = no limit). See [`Engine::admit`].
    pub max_pending: u64,
    /// Backpressure: most WAL bytes on disk (0 = no limit).
    pub max_disk: u64,
    /// The lookup key (AMQP `message_id`, Kafka key) of a stored message,
    /// for cancel by key. The engine stores opaque bytes: the runtime says
    /// how to read a key out of them (default: no keys).
    pub key_of: KeyOf,
    /// The far tier: messages due beyond its horizon wait on disk, not in
    /// the wheel (`None`: every pending message is in the wheel).
    pub far: Option<FarSettings>,
    /// Run compaction and the far tier's rounds on their own, every
    /// `gc_interval` (false: the caller drives them with
    /// [`Engine::compact_now`] and [`Engine::far_round`], as tests and the
    /// simulator do, so that no round races theirs).
    pub background_rounds: bool,
    /// Each route's share of the dispatcher's batches (`weight`; routes
    /// not named here have 1). See `engine::ready`.
    pub route_weights: std::collections::HashMap<String, u32>,
}

/// Reads the lookup key out of a stored message's bytes.
pub type KeyOf = fn(&[u8]) -> Option<&[u8]>;

/// A boxed future, as a [`Dispatch`] returns.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>>;

fn no_key(_: &[u8]) -> Option<&[u8]> {
    None
}

impl EngineConfig {
    pub fn new(wal: WalConfig) -> Self {
        Self {
            wal,
            max_in_flight: 1024,
            max_bytes_in_flight: 64 << 20,
            overdue_rate: 5000,
            retry_initial: Duration::from_millis(200),
            retry_max: Duration::from_secs(30),
            dedup_window: 100_000,
            gc_interval: Duration::from_secs(1),
            max_pending: 0,
            max_disk: 0,
            key_of: no_key,
            far: None,
            background_rounds: true,
            route_weights: Default::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Wal(#[from] WalError),
    #[error(transparent)]
    Far(#[from] FarError),
    #[error("the WAL writer went away")]
    WriterGone,
    #[error("too many routes (at most 65536)")]
    TooManyRoutes,
    #[error("message {0} is being published and can no longer be cancelled")]
    InFlight(u64),
    #[error("interrupted: {0}")]
    Interrupted(&'static str),
    /// Cancelled here (its Done is durable), but the broker-kept store did
    /// not confirm its record's removal: a restore could bring it back.
    #[error("cancelled here, but its record in the broker-kept store was not removed ({0}); a restore may bring it back: cancel it again")]
    StoreCancel(String),
}

impl EngineError {
    /// A failed fsync, or the log already stopped for one: the process
    /// must stop (see [`Inner::on_failure`]).
    pub fn is_fatal(&self) -> bool {
        match self {
            EngineError::Wal(e) | EngineError::Far(FarError::Io(e)) => e.is_fatal(),
            _ => false,
        }
    }

    /// A write failed with ENOSPC.
    pub fn is_disk_full(&self) -> bool {
        matches!(
            self,
            EngineError::Wal(WalError::DiskFull(_))
                | EngineError::Far(FarError::Io(WalError::DiskFull(_)))
        )
    }
}

/// Outcome of storing a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// Durable, armed, with this id.
    New(u64),
    /// Durable, armed, with this id, under identity `uid` (not the one the
    /// caller gave): a redelivery equal to a stored message whose ack was
    /// in doubt, stored again under that message's identity (see
    /// [`dedup`]): a same-id duplicate if it was that message, its twin
    /// kept if not.
    Copy { id: u64, uid: MessageId },
    /// A redelivery of a message already stored: nothing new was written.
    Duplicate,
}

impl Stored {
    /// The new record's id, if one was written.
    pub fn id(self) -> Option<u64> {
        match self {
            Stored::New(id) | Stored::Copy { id, .. } => Some(id),
            Stored::Duplicate => None,
        }
    }
}

/// Told of a cancelled message: its route, id and stored bytes (see
/// [`Engine::on_cancel`]). Resolves once the cancel is durable in the
/// broker-kept store too.
pub type CancelHook =
    Arc<dyn Fn(&str, u64, &[u8]) -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// A message taken out of the wheel, its Done queued (or out of the far
/// tier, its cancel already durable there).
struct Retired {
    id: u64,
    done: Option<AppendReceiver>,
    route: Arc<str>,
    /// Its stored bytes, when they could be read.
    message: Option<Vec<u8>>,
    /// Where it waited in the wheel, and its key-index hash: armed again
    /// if its Done fails.
    was: Option<(Expired<Slot>, Option<u64>)>,
    /// A cancel's marks for other records of its identity, each kept by a
    /// Done naming its own Schedule's segment: durable before the cancel
    /// is answered.
    kept_marks: Vec<AppendReceiver>,
}

impl Retired {
    /// Wait for the Done to be durable; then, for a cancel, tell the
    /// engine's cancel hook and wait for its store write: a cancel is
    /// acknowledged only once it is durable everywhere the message is kept.
    /// A Done that fails (a full disk) puts the message back: the cancel
    /// fails and the message fires as if it had not been asked for.
    async fn settle(
        mut self,
        inner: &Inner,
        cancel_hook: Option<&CancelHook>,
    ) -> Result<(), EngineError> {
        self.written(inner).await?;
        if let (Some(hook), Some(message)) = (cancel_hook, &self.message) {
            hook(&self.route, self.id, message)
                .await
                .map_err(EngineError::StoreCancel)?;
        }
        Ok(())
    }
}

impl Retired {
    /// Wait for the Done to be durable (at once if it was, or there is
    /// none). One that fails puts the message back in the wheel.
    async fn written(&mut self, inner: &Inner) -> Result<(), EngineError> {
        let Some(done) = self.done.take() else {
            return Ok(());
        };
        let written = match done.await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(EngineError::from(e)),
            Err(_) => Err(EngineError::WriterGone),
        };
        if let Err(e) = written {
            if let Some((entry, hash)) = self.was.take() {
                inner.rearm_retired(entry, hash);
            }
            return Err(e);
        }
        // Retired for good now: a mark that failed only makes the cancel's
        // answer an error (it may have taken effect).
        for mark in std::mem::take(&mut self.kept_marks) {
            mark.await.map_err(|_| EngineError::WriterGone)??;
        }
        Ok(())
    }
}

/// [`Engine::begin_store`]: a duplicate, or a new record on its way.
pub enum Storing<F> {
    Duplicate,
    New(F),
    /// Stored under this identity, a sibling's, not the caller's (see
    /// [`Stored::Copy`]): known before the record is written, for a store
    /// that must say so in its own record.
    Copy(F, MessageId),
}

/// A record durable in the WAL and armed, whose store may not be complete
/// yet: a broker-kept store still writes its own record. Until
/// [`Written::commit`] a redelivery of the same bytes waits (see
/// [`Engine::wait_for_original`]) rather than being called a duplicate of a
/// store that may still fail. Dropped uncommitted (the store failed), the
/// redelivery is stored in its own right.
#[must_use = "commit the store once it is complete"]
pub struct Written {
    pub id: u64,
    /// The identity it was stored under, if not the caller's: see
    /// [`Stored::Copy`].
    pub copy_of: Option<MessageId>,
    fp: u64,
    pos: WalPos,
    /// The source session its delivery came on (see [`Arrival`]).
    session: u64,
    /// The identity it was stored under.
    uid: MessageId,
    writing: WritingGuard,
}

impl Written {
    /// The store is complete: until the source ack is confirmed, a
    /// redelivery of it is a duplicate.
    pub fn commit(self) -> Stored {
        self.writing.engine.state().unconfirmed.add(
            self.id,
            self.uid.as_u128(),
            self.fp,
            self.pos,
            self.session,
            AckState::Unsent,
        );
        match self.copy_of {
            Some(uid) => Stored::Copy { id: self.id, uid },
            None => Stored::New(self.id),
        }
    }
}

/// [`Engine::store`] once the original of a redelivery is written.
type BoxedStore = std::pin::Pin<Box<dyn Future<Output = Result<Stored, EngineError>> + Send>>;

/// A store's outcome once its write (if any) is durable and armed.
fn stored<F>(storing: Storing<F>) -> impl Future<Output = Result<Stored, EngineError>> + Send
where
    F: Future<Output = Result<Written, EngineError>> + Send,
{
    match storing {
        Storing::Duplicate => Either::Left(std::future::ready(Ok(Stored::Duplicate))),
        Storing::New(written) | Storing::Copy(written, _) => {
            Either::Right(written.map(|w| Ok(w?.commit())))
        }
    }
}

/// A store being written (see [`dedup::Writing`]); ends on drop, whether
/// it became durable, failed or was abandoned.
struct WritingGuard {
    engine: Engine,
    fp: u64,
}

impl WritingGuard {
    fn begin(engine: &Engine, fp: u64) -> Self {
        engine.state().writing.begin(fp);
        Self {
            engine: engine.clone(),
            fp,
        }
    }
}

impl Drop for WritingGuard {
    fn drop(&mut self) {
        let wake = self.engine.state().writing.end(self.fp);
        if wake {
            self.engine.inner.written.notify_waiters();
        }
    }
}

/// A redelivery waiting in [`Engine::wait_for_original`]; counted so that
/// ends of writes wake anyone only when someone waits.
struct WritingWaiter {
    engine: Engine,
}

impl WritingWaiter {
    fn new(engine: &Engine) -> Self {
        engine.state().writing.add_waiter();
        Self {
            engine: engine.clone(),
        }
    }
}

impl Drop for WritingWaiter {
    fn drop(&mut self) {
        self.engine.state().writing.remove_waiter();
    }
}

/// A pending message, for listing.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PendingInfo {
    pub id: u64,
    pub route: Arc<str>,
    /// When it fires next (its due time, or the next retry after a failure).
    pub due_ms: u64,
    pub phase: Phase,
    #[serde(skip)]
    pub at: Location,
}

/// Where a pending message's record is.
#[derive(Debug, Clone)]
pub enum Location {
    Wal(WalPos),
    /// In the far tier: the record as read from its bucket.
    Far(Arc<FarRecord>),
}

impl Location {
    /// Its WAL position, if it is in the WAL.
    pub fn wal(&self) -> Option<WalPos> {
        match self {
            Location::Wal(pos) => Some(*pos),
            Location::Far(_) => None,
        }
    }
}

/// Filter and page for [`Engine::list`]. Results are ordered by (due, id);
/// `after` is the (due, id) of the last item of the previous page.
#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    pub route: Option<String>,
    pub due_from: Option<u64>,
    pub due_to: Option<u64>,
    pub after: Option<(u64, u64)>,
    pub limit: usize,
}

/// Slab nodes of the wheel examined per lock hold while listing (well
/// under a millisecond).
const LIST_CHUNK: usize = 1 << 13;

/// Between two chunks of a walk the lock is let go this long: the std mutex
/// is not fair, and without a pause the walking thread takes it straight
/// back while the dispatcher, woken, is still being scheduled.
const LIST_PAUSE: Duration = Duration::from_micros(20);

/// The `limit` smallest (due, id) keys a listing has been offered so far.
struct Page<'q> {
    query: &'q ListQuery,
    route: Option<u16>,
    limit: usize,
    /// A bounded max-heap: the largest kept key is on top.
    heap: BinaryHeap<PageItem>,
    /// Ids in `heap`: a message seen waiting and then publishing (it fired
    /// mid-walk) is kept once.
    ids: std::collections::HashSet<u64>,
}

/// A listed message: ordered by (due, id) alone.
struct PageItem {
    due: u64,
    id: u64,
    phase: Phase,
    src: PageSrc,
}

enum PageSrc {
    Wheel(Slot),
    Far(Arc<FarRecord>),
}

impl PartialEq for PageItem {
    fn eq(&self, other: &Self) -> bool {
        (self.due, self.id) == (other.due, other.id)
    }
}

impl Eq for PageItem {}

impl PartialOrd for PageItem {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for PageItem {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.due, self.id).cmp(&(other.due, other.id))
    }
}

impl<'q> Page<'q> {
    fn new(query: &'q ListQuery, route: Option<u16>) -> Self {
        Self {
            query,
            route,
            limit: query.limit.max(1),
            heap: BinaryHeap::new(),
            ids: std::collections::HashSet::new(),
        }
    }

    /// Consider one message; false once `(due, id)` is past everything the
    /// page can still take (so an ordered source can stop).
    fn offer(&mut self, id: u64, due: u64, slot: Slot, phase: Phase) -> bool {
        let wanted = self.route.is_none_or(|r| r == slot.route);
        self.offer_item(
            wanted,
            PageItem {
                due,
                id,
                phase,
                src: PageSrc::Wheel(slot),
            },
        )
    }

    /// [`Page::offer`] for a message in the far tier.
    fn offer_far(&mut self, record: FarRecord) -> bool {
        let wanted = self
            .query
            .route
            .as_deref()
            .is_none_or(|r| r == record.route);
        let item = PageItem {
            due: record.due_ms,
            id: record.id,
            phase: Phase::Waiting,
            src: PageSrc::Far(Arc::new(record)),
        };
        self.offer_item(wanted, item)
    }

    fn offer_item(&mut self, wanted: bool, item: PageItem) -> bool {
        let (due, id) = (item.due, item.id);
        let q = self.query;
        if q.due_from.is_some_and(|f| due < f)
            || q.due_to.is_some_and(|t| due > t)
            || q.after.is_some_and(|a| (due, id) <= a)
        {
            return true;
        }
        let full = self.heap.len() >= self.limit;
        if full
            && self
                .heap
                .peek()
                .is_some_and(|top| (due, id) >= (top.due, top.id))
        {
            return false;
        }
        if !wanted || !self.ids.insert(id) {
            return true;
        }
        if full {
            if let Some(top) = self.heap.pop() {
                self.ids.remove(&top.id);
            }
        }
        self.heap.push(item);
        true
    }

    /// Is the page full with nothing due after `due`? (Then a source
    /// ordered by due can be skipped from `due` on.)
    fn closed_before(&self, due: u64) -> bool {
        self.heap.len() >= self.limit && self.heap.peek().is_some_and(|top| top.due < due)
    }

    fn finish(self, state: &State) -> Vec<PendingInfo> {
        let mut rows = self.heap.into_vec();
        rows.sort();
        rows.into_iter()
            .map(|item| {
                let (route, at) = match item.src {
                    PageSrc::Wheel(slot) => (state.route_name(slot.route), Location::Wal(slot.pos)),
                    PageSrc::Far(record) => {
                        (Arc::from(record.route.as_str()), Location::Far(record))
                    }
                };
                PendingInfo {
                    id: item.id,
                    route,
                    due_ms: item.due,
                    phase: item.phase,
                    at,
                }
            })
            .collect()
    }
}

/// Handle to the engine. Cheap to clone.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    config: EngineConfig,
    wal: Wal,
    state: Mutex<State>,
    clock: Arc<dyn Clock>,
    /// Wakes the dispatcher when an earlier deadline arrives.
    wake: Notify,
    /// Wakes redeliveries waiting for their original to be written
    /// (see [`Engine::wait_for_original`]).
    written: Notify,
    /// The deadline the dispatcher sleeps until (u64::MAX when idle).
    planned_wake: AtomicU64,
    /// Messages due at or before this (the start time) are rate limited.
    overdue_until: u64,
    /// Held for a whole round of GC and compaction: two compactions of one
    /// segment at once would each copy a message, and the second, finding
    /// it moved by the first, would retire it by id (a lost message).
    compacting: tokio::sync::Mutex<()>,
    /// Dones recovery found missing, as (id, first seq of the segment to
    /// name): written before anything is collected (see `compact::once`).
    missing_dones: Mutex<Vec<(u64, u64)>>,
    /// See [`Engine::on_cancel`].
    cancel_hook: std::sync::OnceLock<CancelHook>,
    /// The far tier, when configured (see `tier`).
    far: Option<tier::Tier>,
    /// Tests only: where the dispatcher waits once, after planning an idle
    /// round and before sleeping (see `dispatch::Dispatcher::run`).
    #[cfg(test)]
    idle_gate: StdMutex<Option<Arc<IdleGate>>>,
}

/// Tests only: holds the dispatcher between planning its sleep and sleeping.
#[cfg(test)]
#[derive(Default)]
pub(crate) struct IdleGate {
    pub reached: std::sync::atomic::AtomicBool,
    pub open: StdMutex<()>,
}

/// Copies retired only by Dones that name their original's segment.
///
/// A cancel (or delivery) that lands while compaction copies its message
/// writes a Done naming the original's segment, and compaction then retires
/// the copy with a second Done naming the copy's. Killed between the two,
/// the log holds a copy whose only Done outlives nothing but the original:
/// once the original's segment and that Done were collected, the copy would
/// come back. Returns the Done each such copy still needs.
fn missing_dones(wal: &Wal, retired_copies: Vec<(u64, u32, u64)>) -> Vec<(u64, u64)> {
    let mut needed: std::collections::BTreeMap<u64, Option<u64>> = Default::default();
    for (id, copy, named) in retired_copies {
        let Some(copy_seq) = wal.segment_first_seq(copy) else {
            continue;
        };
        let entry = needed.entry(id).or_insert(Some(copy_seq));
        if named == copy_seq {
            *entry = None; // its own Done was written
        }
    }
    needed
        .into_iter()
        .filter_map(|(id, copy_seq)| copy_seq.map(|seq| (id, seq)))
        .collect()
}

impl Engine {
    /// Open the WAL, rebuild the wheel from it, and return the engine.
    pub fn open(
        config: EngineConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<(Engine, RecoveryReport), EngineError> {
        let now = clock.now_ms();
        let mut state = State::new(now, config.dedup_window);
        state.set_weights(config.route_weights.clone());
        let mut recent = dedup::Recent::new(config.dedup_window);
        // Frames owed at the last stop: the replay applies later marks to them.
        if config.dedup_window > 0 {
            recent.expect_owed(&Wal::read_owed_frames(&config.wal)?);
        }
        let mut too_many_routes = false;
        let mut superseded = Vec::new();
        // Messages whose live Schedule is a compaction copy with the
        // original still on disk: id -> the copy's segment; and the Dones
        // that retired them: (id, the segment each names).
        let mut copied = std::collections::HashMap::new();
        let mut retired_copies = Vec::new();
        // A Done that retires a Schedule in another segment than the one it
        // names (a compaction copy's original, or an original whose copy's
        // segment is gone): (the Done's segment, the Schedule's). The Done
        // must outlive that segment, or the Schedule comes back.
        let mut done_keeps = Vec::new();
        // An ack's mark and the segment its record is read back from, if
        // another: (the mark's segment, the record's).
        let mut mark_keeps = Vec::new();
        let (wal, report) = Wal::open(config.wal.clone(), |record, pos| match record {
            RecordRef::Schedule {
                id,
                due_ms,
                uid,
                route,
                message,
                ..
            } => {
                let Some(route_id) = state.intern(route) else {
                    too_many_routes = true;
                    return;
                };
                let replaced = state.arm(
                    id,
                    due_ms,
                    Slot {
                        pos,
                        route: route_id,
                    },
                );
                // A compaction copy whose original is still on disk (the
                // compaction was cut short before removing its segment).
                if let Some(old) = replaced.filter(|o| o.pos.segment != pos.segment) {
                    superseded.push((pos.segment, old.pos.segment));
                    copied.insert(id, pos.segment);
                }
                if let Some(key) = (config.key_of)(message) {
                    state.index_key(key_hash(route_id, key), id);
                }
                if config.dedup_window > 0 {
                    let uid = MessageId::or_legacy(uid, id).as_u128();
                    recent.push(id, uid, fingerprint(route, message), pos);
                }
            }
            RecordRef::Done { id, segment, .. } => {
                recent.retire(id);
                if let Some((slot, _, _)) = state.locate(id) {
                    done_keeps.push((pos.segment, slot.pos.segment, segment));
                }
                state.disarm(id);
                if let Some(&copy) = copied.get(&id) {
                    retired_copies.push((id, copy, segment));
                }
            }
            RecordRef::Acked { id, .. } => {
                if let Some(record) = recent.mark(id).filter(|&s| s != pos.segment) {
                    mark_keeps.push((pos.segment, id, record));
                }
            }
            RecordRef::Remembered { remembered, .. } => recent.push_remembered(&remembered, pos),
        })?;
        if too_many_routes {
            return Err(EngineError::TooManyRoutes);
        }
        recent.push_owed();
        for (copy, original) in superseded.iter().copied() {
            wal.keep_after(copy, original);
        }
        for (mark, marked, record) in mark_keeps {
            wal.keep_mark(mark, marked, record);
        }
        for (done, schedule, named) in done_keeps {
            if wal.segment_first_seq(schedule) != Some(named) {
                wal.keep_after(done, schedule);
            }
        }
        let missing_dones = missing_dones(&wal, retired_copies);
        // Done records removed messages without naming their key.
        state.sweep_keys();
        wal.set_live_counts(state.armed_positions());
        let far = match &config.far {
            Some(settings) => {
                let tier = tier::Tier::open(settings, &config.wal, now)?;
                if let Some(tier) = &tier {
                    tier.adopt(&mut state)?;
                    // Its checkpoint as it stands must be writable again on
                    // a full disk, whatever the reserve would be made at now.
                    let checkpoint = tier.store().checkpoint_bytes_after(&[])?;
                    wal.keep_reserve_at_least(checkpoint as u64);
                }
                tier
            }
            None => None,
        };
        // A Done read back is a departure only if the far tier cannot hold
        // the message either, under any id read under its identity: a
        // spilled one waits there (perhaps as a load's copy spilled again),
        // and a cancel of it must cover every record of it.
        let far_min_id = far.as_ref().map_or(u64::MAX, |t| t.store().min_id());
        // Their acks may have been sent before the restart, or not.
        for r in recent.unacked() {
            state.unconfirmed.restore(&r);
            if r.cancelled {
                state.unconfirmed.cancel(r.id);
            }
            if r.surely_left || (r.left && r.newest < far_min_id) {
                state.unconfirmed.left(r.id);
            }
        }
        let engine = Engine {
            inner: Arc::new(Inner {
                config,
                wal,
                state: Mutex::new(state),
                clock,
                wake: Notify::new(),
                written: Notify::new(),
                planned_wake: AtomicU64::new(u64::MAX),
                overdue_until: now,
                compacting: tokio::sync::Mutex::new(()),
                missing_dones: Mutex::new(missing_dones),
                cancel_hook: std::sync::OnceLock::new(),
                far,
                #[cfg(test)]
                idle_gate: StdMutex::new(None),
            }),
        };
        engine.publish_gauges();
        Ok((engine, report))
    }

    pub fn wal(&self) -> &Wal {
        &self.inner.wal
    }

    pub fn now_ms(&self) -> u64 {
        self.inner.clock.now_ms()
    }

    /// Store a message durably and arm it. Returns its id.
    ///
    /// The record is queued for the WAL before this returns, so calls made in
    /// order get increasing ids; messages due at the same millisecond fire in
    /// id order.
    ///
    /// The message gets a new identity ([`MessageId::mint`]).
    pub fn schedule(
        &self,
        route: &str,
        due_ms: u64,
        message: Vec<u8>,
    ) -> impl Future<Output = Result<u64, EngineError>> + Send + 'static {
        let scheduled = self.schedule_at(
            route,
            due_ms,
            MessageId::mint(),
            message,
            SizeLimit::Applies,
        );
        async move { Ok(scheduled.await?.0) }
    }

    /// [`Engine::schedule`] with a given identity, resolving with the
    /// record's id and position.
    fn schedule_at(
        &self,
        route: &str,
        due_ms: u64,
        uid: MessageId,
        message: Vec<u8>,
        limit: SizeLimit,
    ) -> impl Future<Output = Result<(u64, WalPos), EngineError>> + Send + 'static {
        let spills = self.inner.far.as_ref().is_some_and(|t| t.spills(route));
        let queued = self.queue_schedule(route, due_ms, uid, message, limit);
        let engine = self.clone();
        async move {
            let (route_id, key, appended) = queued?;
            let Claimed { appended, claim } =
                appended.await.map_err(|_| EngineError::WriterGone)??;
            let slot = Slot {
                pos: appended.pos,
                route: route_id,
            };
            {
                let mut state = engine.state();
                state.arm(appended.id, due_ms, slot);
                if spills {
                    state.note_far_candidate(appended.id, due_ms);
                }

                if let Some(hash) = key {
                    state.index_key(hash, appended.id);
                }
            }
            // Armed: later messages may go out now (see `wal::claims`).
            drop(claim);
            if due_ms < engine.inner.planned_wake.load(Ordering::Acquire) {
                engine.inner.wake.notify_one();
            }
            Ok((appended.id, appended.pos))
        }
    }

    fn queue_schedule(
        &self,
        route: &str,
        due_ms: u64,
        uid: MessageId,
        message: Vec<u8>,
        limit: SizeLimit,
    ) -> Result<Queued, EngineError> {
        let route_id = self
            .state()
            .intern(route)
            .ok_or(EngineError::TooManyRoutes)?;
        let key = (self.inner.config.key_of)(&message).map(|k| key_hash(route_id, k));
        let appended =
            self.inner
                .wal
                .append_schedule_claimed(due_ms, uid.as_u128(), route, message, limit)?;
        Ok((route_id, key, appended))
    }

    /// Store a consumed delivery. A redelivered one (`arrival`: a `bool`,
    /// or an [`Arrival`] that names its source session) whose bytes equal a
    /// stored message whose ack is unconfirmed, stored from an earlier
    /// session, is reported as a duplicate and not stored again, or, when
    /// that ack was in doubt, stored again under that message's identity
    /// ([`Stored::Copy`]). Call [`Engine::ack_sending`] before sending the
    /// source ack and [`Engine::confirm_ack`] with the id once it succeeded. Like [`Engine::schedule`], the record is queued
    /// before this returns.
    ///
    /// A redelivery whose original may still be being written (see
    /// [`Engine::wait_for_original`]) is queued only after that write.
    ///
    /// `uid` is the message's identity, stored with it (see [`crate::id`]).
    pub fn store(
        &self,
        route: &str,
        due_ms: u64,
        uid: MessageId,
        message: Vec<u8>,
        arrival: impl Into<Arrival>,
    ) -> impl Future<Output = Result<Stored, EngineError>> + Send + 'static {
        let arrival = arrival.into();
        // Combinators, not an async block: the store future is kept for
        // every delivery in hand, and an async block held the write's
        // future twice (captured, then awaited): 1,152 bytes, now 352.
        match self.wait_for_original(route, &message, arrival.redelivered) {
            None => Either::Left(stored(
                self.begin_store(route, due_ms, uid, message, arrival),
            )),
            Some(wait) => {
                // Rare (a redelivery racing its original's write): boxed.
                let (engine, route) = (self.clone(), route.to_owned());
                let after: BoxedStore = Box::pin(async move {
                    wait.await;
                    stored(engine.begin_store(&route, due_ms, uid, message, arrival)).await
                });
                Either::Right(after)
            }
        }
    }

    /// For a redelivery: `Some` while a store of the same bytes is being
    /// written, resolving once none is. The original of a redelivery is
    /// remembered only once durable; if its connection died before that,
    /// the broker's copy can arrive first, and compared at once it would be
    /// stored a second time. Await it before [`Engine::begin_store`].
    pub fn wait_for_original(
        &self,
        route: &str,
        message: &[u8],
        redelivered: bool,
    ) -> Option<impl Future<Output = ()> + Send + 'static> {
        if !redelivered {
            return None;
        }
        let fp = fingerprint(route, message);
        if !self.state().writing.contains(fp) {
            return None;
        }
        let engine = self.clone();
        Some(async move {
            let _waiter = WritingWaiter::new(&engine);
            loop {
                let notified = engine.inner.written.notified();
                tokio::pin!(notified);
                // Registered before looking, so an end in between still wakes it.
                notified.as_mut().enable();
                if !engine.state().writing.contains(fp) {
                    return;
                }
                notified.await;
            }
        })
    }

    /// [`Engine::store`], saying at once whether the delivery is a
    /// duplicate. A new record is queued for the WAL before this returns and
    /// is armed only once the returned future has resolved, so whatever a
    /// caller does between the two (the broker-kept store queues its state
    /// record) happens before the message can fire.
    pub fn begin_store(
        &self,
        route: &str,
        due_ms: u64,
        uid: MessageId,
        message: Vec<u8>,
        arrival: impl Into<Arrival>,
    ) -> Storing<impl Future<Output = Result<Written, EngineError>> + Send + 'static> {
        let Arrival {
            redelivered,
            session,
        } = arrival.into();
        let fp = fingerprint(route, &message);
        let mut copy_of = None;
        // The record a copy is stored for: matched again if the store fails.
        let mut taken = None;
        if redelivered {
            match self.take_stored_copy(route, fp, &message, session) {
                Some(Candidate {
                    ack: AckState::InDoubt,
                    cancelled: false,
                    uid: stored_uid,
                    id,
                    ..
                }) if session > 0
                    && (dedup::is_departed(id) || !self.cancelled_by_key(id, route, &message)) =>
                {
                    tracing::info!(
                        route,
                        id,
                        uid = %MessageId::from_u128(stored_uid),
                        "a redelivery equals a stored message whose ack is in doubt; storing it again under that message's id (a same-id duplicate if it is that message, its twin kept if not)"
                    );
                    metrics::counter!("delayd_redeliveries_in_doubt_total", "route" => route.to_owned())
                        .increment(1);
                    copy_of = Some(MessageId::from_u128(stored_uid));
                    taken = Some(id);
                }
                Some(Candidate { id, .. }) => {
                    self.state().unconfirmed.rebind(id, session);
                    metrics::counter!("delayd_redeliveries_deduplicated_total", "route" => route.to_owned())
                        .increment(1);
                    return Storing::Duplicate;
                }
                None => {}
            }
        }
        let uid = copy_of.unwrap_or(uid);
        let writing = WritingGuard::begin(self, fp);
        let limit = match copy_of {
            Some(_) => SizeLimit::Waived,
            None => SizeLimit::Applies,
        };
        let scheduled = self.schedule_at(route, due_ms, uid, message, limit);
        let engine = self.clone();
        let written = async move {
            let (id, pos) = match scheduled.await {
                Ok(stored) => stored,
                Err(e) => {
                    // Not stored: the broker redelivers it again, and that
                    // redelivery must match the record again (sim seed 5:
                    // a full disk, and the next one was stored as new).
                    if let Some(taken) = taken {
                        engine.state().unconfirmed.unconsume(taken);
                    }
                    return Err(e);
                }
            };
            if let Some(taken) = taken.filter(|&t| !dedup::is_departed(t)) {
                engine.settle_taken(taken).await;
            }
            Ok(Written {
                id,
                copy_of,
                fp,
                pos,
                session,
                uid,
                writing,
            })
        };
        match copy_of {
            Some(sibling) => Storing::Copy(written, sibling),
            None => Storing::New(written),
        }
    }

    /// Record `taken` matched a redelivery that is now stored as its copy:
    /// settled, and marked so durably before the copy is answered, so a
    /// restart does not offer it to another redelivery. The copy, under the same
    /// identity and bytes, stands for it (one redelivery per record). Left
    /// a candidate, a record that stayed pending while the copy fired could
    /// be cancelled later, and a twin published after that cancel was then
    /// taken for it and dropped (sim seed 9,242,409). If the mark fails,
    /// the record is in doubt after a restart, as before.
    async fn settle_taken(&self, taken: u64) {
        // Settled first: a compaction from now on moves the mark on (or
        // writes one after its copy).
        let keeps = {
            let mut state = self.state();
            state.unconfirmed.settle(taken);
            state.unconfirmed.read_back_from(taken)
        };
        let marked = match self
            .inner
            .wal
            .append_acked_now(taken | dedup::MATCHED_MARK, keeps)
        {
            Ok(rx) => rx
                .await
                .map_err(|_| EngineError::WriterGone)
                .and_then(|r| Ok(r?)),
            Err(e) => Err(e.into()),
        };
        if let Err(e) = marked {
            tracing::debug!(id = taken, error = %e, "cannot mark a record its redelivery's copy stands for");
        }
    }

    /// Is `message`, redelivered on source session `session`, byte-equal to
    /// a stored record whose ack is unconfirmed, from an earlier session?
    /// If so, that record is taken (it matches one redelivery at a time,
    /// see [`dedup::Unconfirmed::rebind`] and `settle`). The
    /// comparison reads the stored bytes: the fingerprint only picks
    /// candidates, and a hash match alone would drop a message never stored.
    fn take_stored_copy(
        &self,
        route: &str,
        fp: u64,
        message: &[u8],
        session: u64,
    ) -> Option<Candidate> {
        let candidates = {
            let state = self.state();
            let mut candidates = state.unconfirmed.candidates(fp, session);
            // One still pending here before any other (a stable sort keeps
            // the rest in `candidates`' order): a redelivery repeats a live
            // record if there is one. After a restart a Done read back does
            // not say whether its record fired or waits in the far tier, so
            // the flags alone did not tell (sim seed 5232 with sockets: a
            // twin's redelivery was taken for a fired record of a cancelled
            // identity, not for its own, and fired after the cancel).
            candidates.sort_by_key(|c| c.cancelled || !state.is_pending(c.id));
            candidates
        };
        for candidate in candidates {
            let id = candidate.id;
            let same = match candidate.evidence {
                // Its segment is gone; the digest was taken before.
                dedup::Evidence::Digest(digest) => digest == dedup::digest(route, message),
                dedup::Evidence::At(written_at) => {
                    // Where it is now (compaction may have moved it), else
                    // where it was written (it may have fired since).
                    let pos = self
                        .state()
                        .locate(id)
                        .map_or(written_at, |(s, _, _)| s.pos);
                    match self.inner.wal.read(pos) {
                        Ok(Record::Schedule {
                            id: stored_id,
                            route: stored_route,
                            message: stored,
                            ..
                        }) => stored_id == id && stored_route == route && stored == message,
                        _ => false,
                    }
                }
            };
            if same {
                self.state().unconfirmed.consume(id);
                return Some(candidate);
            }
        }
        None
    }

    /// Whether message `id` waits in the far tier cancelled by a key
    /// tombstone (dropped when its bucket loads, and marked cancelled then).
    /// A record that fired before the cancel is not: its twin is kept.
    fn cancelled_by_key(&self, id: u64, route: &str, message: &[u8]) -> bool {
        let Some(tier) = self.inner.far.as_ref() else {
            return false;
        };
        let key_of = self.inner.config.key_of;
        let store = tier.store();
        if !store.key_cancels(id, route, key_of(message)) || self.is_pending(id) {
            return false;
        }
        // Unreadable: taken as cancelled (a same-id copy is then not made;
        // the redelivery is answered a duplicate, as before copies).
        tier.is_tombstoned(&store, id, key_of).unwrap_or(true)
    }

    /// A message that left under another owner of its route (see
    /// `runtime::store::departed`), by its identity, [`fingerprint`] and
    /// [`digest`]: a redelivery equal to it is stored again under `uid` (a
    /// same-id copy, or its twin kept), or, if it was `cancelled`, not at
    /// all. Evicted like any remembered record (`dedup_window`).
    pub fn remember_departed(
        &self,
        uid: MessageId,
        fingerprint: u64,
        digest: [u8; 32],
        cancelled: bool,
    ) {
        self.state()
            .unconfirmed
            .add_departed(uid.as_u128(), fingerprint, digest, cancelled);
    }

    /// Whether a record of identity `uid` is one a byte-equal redelivery
    /// may repeat (its ack in doubt, or confirmed moments ago): the
    /// simulator's check that a restart reads settled records back settled.
    pub fn has_candidate(&self, uid: MessageId) -> bool {
        self.state().unconfirmed.has_candidate(uid.as_u128())
    }

    /// Messages whose segment went before a full disk let their
    /// Remembered frame be written (see `compact::settle_remembered`), and
    /// which the ledger of owed frames does not hold (past its size, or no
    /// ledger): a restart now would forget them, and store a late
    /// redelivery of one under a new id.
    pub fn frames_owed(&self) -> Vec<MessageId> {
        let held = self.inner.wal.owed_frames_held();
        self.state()
            .unconfirmed
            .frames_owed()
            .into_iter()
            .filter(|(id, _)| !held.contains(id))
            .map(|(_, uid)| MessageId::from_u128(uid))
            .collect()
    }

    /// Is message `id` pending here (waiting or being published)?
    pub fn is_pending(&self, id: u64) -> bool {
        self.state().is_pending(id)
    }

    /// The source ack of stored message `id` is about to be sent: until it
    /// is confirmed ([`Engine::confirm_ack`]) or known unsent
    /// ([`Engine::ack_not_sent`]), a byte-equal redelivery may be its twin.
    pub fn ack_sending(&self, id: u64) {
        self.state().unconfirmed.ack_sent(id);
    }

    /// The source ack of stored message `id` was certainly not sent (its
    /// channel was closed): the broker will redeliver it.
    pub fn ack_not_sent(&self, id: u64) {
        self.state().unconfirmed.ack_unsent(id);
    }

    /// The source ack of stored message `id` reached the broker: marked in
    /// the WAL so that a restart forgets it (else a twin published on
    /// purpose and redelivered after the restart was taken for it, and
    /// lost; issue #37). Here a queue delivery stays in doubt a while (a
    /// classic queue's node can die and forget the ack; see [`dedup`]).
    pub fn confirm_ack(&self, id: u64) {
        // Where a restart reads it back (a compaction copy's segment,
        // perhaps): the mark outlives that segment.
        let keeps = {
            let mut state = self.state();
            let keeps = state.unconfirmed.read_back_from(id);
            state.unconfirmed.confirm(id).then_some(keeps)
        };
        if let Some(keeps) = keeps {
            if let Err(e) = self.inner.wal.append_acked(id, keeps) {
                tracing::debug!(id, error = %e, "cannot mark the ack in the WAL");
            }
        }
    }

    /// Cancel a pending message: it never fires. `Ok(false)` if unknown.
    /// Resolves once its Done record is durable, so a crash right after
    /// cannot bring it back.
    pub async fn cancel(&self, id: u64) -> Result<bool, EngineError> {
        // Its identity, for the other copy a load cut short may have left.
        let uid = match self.inner.far.as_ref() {
            Some(tier) if tier.store().loading().is_some() => match self.read(id)? {
                Some((_, Record::Schedule { uid, .. })) => Some(uid),
                _ => None,
            },
            _ => None,
        };
        let Some(retired) = self.retire(id, "cancelled").await? else {
            return Ok(false);
        };
        retired
            .settle(&self.inner, self.inner.cancel_hook.get())
            .await?;
        if let Some(uid) = uid {
            self.cancel_copies(id, uid).await?;
        }
        Ok(true)
    }

    /// Cancel every pending record kept under identity `uid`; how many.
    /// After a cancel by id: a redelivery stored again under its message's
    /// identity (its ack was in doubt, [`Stored::Copy`]) is that message as
    /// far as a cancel goes, or it would fire.
    pub async fn cancel_all_of(&self, uid: MessageId) -> Result<usize, EngineError> {
        let mut cancelled = 0;
        loop {
            let engine = self.clone();
            let found = tokio::task::spawn_blocking(move || engine.find_by_uid(uid))
                .await
                .map_err(|_| EngineError::WriterGone)??;
            match found {
                Some(id) if self.cancel(id).await? => cancelled += 1,
                _ => return Ok(cancelled),
            }
        }
    }

    /// A load cut short (a crash, a failed append) leaves each message of
    /// its bucket twice until the bucket loads again: the copy armed under
    /// a new id, the original in the bucket. A cancel of either takes the
    /// other too, or the other would fire.
    async fn cancel_copies(&self, cancelled: u64, uid: u128) -> Result<(), EngineError> {
        let Some(tier) = self.inner.far.as_ref() else {
            return Ok(());
        };
        let _op = tier.exclusive().await;
        let engine = self.clone();
        let near =
            tokio::task::spawn_blocking(move || tier::cancel_copies(&engine.inner, cancelled, uid))
                .await
                .map_err(|_| EngineError::WriterGone)?
                .inspect_err(|e| self.inner.on_failure(e))?;
        for id in near {
            if let Some(retired) = self.retire_queued(id, "cancelled")? {
                retired
                    .settle(&self.inner, self.inner.cancel_hook.get())
                    .await?;
            }
        }
        Ok(())
    }

    /// Take a message out for good because it was handed to another
    /// instance (its copy is safe in the broker): Done, as for a cancel.
    pub async fn retire_handed_off(&self, id: u64) -> Result<bool, EngineError> {
        let Some(retired) = self.retire(id, "handed_off").await? else {
            return Ok(false);
        };
        retired.settle(&self.inner, None).await?;
        Ok(true)
    }

    /// Take a message out because another instance now owns it (the
    /// broker-kept store gave its partition away; the state topic keeps
    /// it): Done locally. Redelivery detection still knows it, as a message
    /// that lives on elsewhere (not one that left: a cancel of a copy of it
    /// restored here covers it too): a delivery of it the broker hands back
    /// later (its ack was in doubt when the route moved, and the route has
    /// come back here since) is then a same-id copy, or nothing if it was
    /// cancelled, not a new message under a new id. A restore stores its
    /// copy whatever is remembered. `Ok(false)` if unknown; in flight, it is
    /// released when its publish comes back ([`Outcome::Release`]).
    pub async fn release(&self, id: u64) -> Result<bool, EngineError> {
        let queued = self.retire(id, "released").await;
        let retired = match queued {
            Ok(Some(retired)) => retired,
            Ok(None) | Err(EngineError::InFlight(_)) => return Ok(false),
            Err(e) => return Err(e),
        };
        retired.settle(&self.inner, None).await?;
        Ok(true)
    }

    /// Every message waiting to fire (not those being published), in (due,
    /// id) order. The wheel is walked a chunk per lock hold.
    ///
    /// Far messages are included, read from their buckets: all of them in
    /// memory at once (a hand-off or a switch of store takes everything).
    pub fn waiting(&self) -> Vec<PendingInfo> {
        let mut out = Vec::new();
        // Held throughout: nothing moves between the tiers meanwhile.
        let far = self.inner.far.as_ref().map(|t| t.store());
        let mut from = Some(0);
        while let Some(start) = from {
            let state = self.state();
            from = state.scan_armed(start, LIST_CHUNK, |e| {
                out.push(PendingInfo {
                    id: e.id,
                    route: state.route_name(e.data.route),
                    due_ms: e.deadline,
                    phase: Phase::Waiting,
                    at: Location::Wal(e.data.pos),
                });
            });
            drop(state);
            if from.is_some() {
                std::thread::sleep(LIST_PAUSE);
            }
        }
        let state = self.state();
        for (&(due, id), &slot) in state.waiting_aside(None, (0, 0)).flatten() {
            out.push(PendingInfo {
                id,
                route: state.route_name(slot.route),
                due_ms: due,
                phase: Phase::Waiting,
                at: Location::Wal(slot.pos),
            });
        }
        drop(state);
        if let Some(store) = far {
            for bucket in store.buckets_from(0) {
                match store.read_bucket(bucket, self.inner.config.key_of) {
                    Ok(read) => out.extend(read.live.into_iter().map(far_info)),
                    Err(e) => {
                        tracing::error!(bucket, error = %e, "cannot read a far bucket; its messages are not listed")
                    }
                }
            }
        }
        out.sort_by_key(|p| (p.due_ms, p.id));
        out.dedup_by_key(|p| p.id);
        out
    }

    fn cancel_queued(&self, id: u64) -> Result<Option<Retired>, EngineError> {
        self.retire_queued(id, "cancelled")
    }

    /// Take `id` out wherever it waits: the wheel (its Done queued), else
    /// the far tier (its cancel durable there). Counted in
    /// `delayd_{why}_total`.
    async fn retire(&self, id: u64, why: &'static str) -> Result<Option<Retired>, EngineError> {
        let engine = self.clone();
        let near = tokio::task::spawn_blocking(move || engine.retire_queued(id, why))
            .await
            .map_err(|_| EngineError::WriterGone)??;
        let mut near = near;
        if let Some(retired) = near.as_mut() {
            if let Some((entry, _)) = retired.was.as_ref() {
                let (deadline, pos) = (entry.deadline, entry.data.pos);
                self.retire_far_copy(retired, deadline, pos).await?;
            }
        }
        if near.is_some() || self.inner.far.is_none() {
            return Ok(near);
        }
        // Nothing moves between the tiers until both were looked at again.
        let _op = match self.inner.far.as_ref() {
            Some(tier) => Some(tier.exclusive().await),
            None => None,
        };
        let engine = self.clone();
        // Reads the stored record (key index): blocking file I/O.
        let inner = self.inner.clone();
        let retired = tokio::task::spawn_blocking(move || {
            if let Some(retired) = engine.retire_queued(id, why)? {
                return Ok(Some(retired));
            }
            // The cancel's mark is durable before the bucket's cancel is
            // written (no Done follows here). Marked first, a failed cancel
            // leaves a message that may still fire; marked after, it left
            // one cancelled without a mark, whose redelivery a restart
            // stored again and fired (seed 9398).
            let marked = |record: &FarRecord| match why {
                "cancelled" => engine.inner.mark_cancelled_durably(id, record.uid),
                _ => Ok(()),
            };
            let Some(record) = tier::cancel(&engine.inner, id, marked)? else {
                return Ok(None);
            };
            metrics::counter!(format!("delayd_{why}_total"), "route" => record.route.clone())
                .increment(1);
            Ok(Some(Retired {
                id,
                done: None,
                route: Arc::from(record.route.as_str()),
                message: Some(record.message),
                was: None,
                kept_marks: Vec::new(),
            }))
        })
        .await
        .map_err(|_| EngineError::WriterGone)?;
        if let Err(e) = &retired {
            inner.on_failure(e);
        }
        retired
    }

    /// A message spilled, then armed again from the WAL because the spill's
    /// Done did not last (a crash, a full disk, a restart with spilling
    /// off), is in its bucket too, under the same id: a cancel there as
    /// well, or that copy would load and fire. The bucket is the one of its
    /// stored due time: the wheel's deadline may be a retry's since (seed
    /// 6063), and a spill never takes a message waiting for a retry.
    ///
    /// Only once its WAL Done is durable, and with the tier's operations
    /// held from before that wait (no load takes the copy meanwhile): a
    /// Done that failed puts the message back in the wheel, and its bucket
    /// copy had been cancelled already, so its next spill there (kept once
    /// per id) was taken for cancelled, and the message was gone from both
    /// tiers, though its cancel had failed (sim seed 9118903).
    async fn retire_far_copy(
        &self,
        retired: &mut Retired,
        deadline: u64,
        pos: WalPos,
    ) -> Result<(), EngineError> {
        let id = retired.id;
        let Some(tier) = self.inner.far.as_ref() else {
            return Ok(());
        };
        if tier.store().bucket_count() == 0 {
            return Ok(());
        }
        let _op = tier.exclusive().await;
        retired.written(&self.inner).await?;
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || {
            let stored = match inner.wal.read(pos)? {
                Record::Schedule {
                    id: found, due_ms, ..
                } if found == id => Some(due_ms),
                _ => None,
            };
            tier::cancel_in_bucket(&inner, id, deadline)?;
            match stored {
                Some(due) if due != deadline => tier::cancel_in_bucket(&inner, id, due),
                _ => Ok(()),
            }
        })
        .await
        .map_err(|_| EngineError::WriterGone)?
        .inspect_err(|e| self.inner.on_failure(e))
    }

    /// The stored record a listing or [`Engine::waiting`] pointed at: read
    /// from the WAL (`None` if it moved or left meanwhile), or the far
    /// tier's copy.
    pub fn record_of(&self, info: &PendingInfo) -> Result<Option<Record>, EngineError> {
        match &info.at {
            Location::Wal(pos) => match self.inner.wal.read(*pos)? {
                r @ Record::Schedule { id, .. } if id == info.id => Ok(Some(r)),
                _ => Ok(None),
            },
            Location::Far(r) => Ok(Some(far_record(r))),
        }
    }

    /// Disarm `id` and queue its Done, counting it in `delayd_{why}_total`.
    fn retire_queued(&self, id: u64, why: &'static str) -> Result<Option<Retired>, EngineError> {
        // The stored record (its key hash, the cancel hook), read outside the lock.
        let stored = self.stored_of(id);
        let hash = stored.as_ref().and_then(|(route, _, message)| {
            (self.inner.config.key_of)(message).map(|k| key_hash(*route, k))
        });
        let uid = stored.as_ref().map(|(_, uid, _)| *uid);
        let mut state = self.state();
        if state.is_in_flight(id) {
            return Err(EngineError::InFlight(id));
        }
        let Some(entry) = state.disarm(id) else {
            return Ok(None);
        };
        if let Some(hash) = hash {
            state.unindex_key(hash, id);
        }
        // A cancel's marks go in the Done's batch, so in its segment: a mark
        // written apart (lazily) could land in a segment of its own, which
        // garbage collection deleted while the Schedule stayed, and a
        // restart read that back in doubt and not cancelled (seed 339).
        // Another record of its identity (a load's original, a copy stored
        // for a redelivery) has its mark kept by a Done naming its own
        // Schedule's segment, as a far cancel's are: that Schedule may
        // outlive this one's segment and the Done's, and a restart that
        // read it back without its mark took it in doubt and not cancelled
        // (`tier_tests::a_cancel_through_a_loaded_copy_holds_for_the_original_after_a_restart`).
        let mut marks = Vec::new();
        let mut kept_marks = Vec::new();
        let mut failed = None;
        if why == "cancelled" {
            for marked in state.unconfirmed.cancel_all(id, uid) {
                let mark = marked | dedup::CANCELLED_MARK;
                // Its own mark goes with its Done.
                let at = match marked == id {
                    true => None,
                    false => state.cancel_mark_kept_by(marked),
                };
                match at.map(|segment| {
                    self.inner
                        .wal
                        .append_marks_kept_by(marked, segment, vec![mark])
                }) {
                    Some(Ok(Some(rx))) => kept_marks.push(rx),
                    Some(Err(e)) => {
                        failed = Some(e);
                        break;
                    }
                    // Its segment is gone: it goes with the Done.
                    Some(Ok(None)) | None => marks.push(mark),
                }
            }
        }
        if let Some(e) = failed {
            drop(state);
            self.inner.rearm_retired(entry, hash);
            return Err(e.into());
        }
        // Written under the lock so it is ordered before any compaction copy.
        let done = match self
            .inner
            .wal
            .append_retiring_done(id, entry.data.pos, marks)
        {
            Ok(done) => done,
            Err(e) => {
                drop(state);
                self.inner.rearm_retired(entry, hash);
                return Err(e.into());
            }
        };
        let route = state.route_name(entry.data.route);
        metrics::counter!(format!("delayd_{why}_total"), "route" => route.to_string()).increment(1);
        Ok(Some(Retired {
            id,
            done: Some(done),
            route,
            message: stored.map(|(_, _, m)| m),
            was: Some((entry, hash)),
            kept_marks,
        }))
    }

    /// Set once: told of every message cancelled (by id or by key), with
    /// its route and stored bytes, once its Done is durable. The
    /// broker-kept store removes its state record there, and the cancel
    /// resolves once that is durable.
    pub fn on_cancel(&self, hook: CancelHook) {
        if self.inner.cancel_hook.set(hook).is_err() {
            tracing::warn!("a cancel hook was already set; the new one is ignored");
        }
    }

    /// Pending messages on `route` whose lookup key (Kafka key, else AMQP
    /// `message_id`) is `key`, in memory and in the far tier (read whole),
    /// taken while nothing moves between the two.
    pub async fn lookup_key(&self, route: &str, key: &[u8]) -> Result<Vec<u64>, EngineError> {
        let _op = match self.inner.far.as_ref() {
            Some(tier) => Some(tier.exclusive().await),
            None => None,
        };
        let engine = self.clone();
        let (route, key) = (route.to_owned(), key.to_vec());
        tokio::task::spawn_blocking(move || {
            let mut ids: Vec<u64> = engine
                .far_ids_for_key(&route, &key)?
                .into_iter()
                .map(|(id, _)| id)
                .collect();
            ids.extend(engine.find_by_key(&route, &key)?);
            ids.sort_unstable();
            ids.dedup();
            Ok(ids)
        })
        .await
        .map_err(|_| EngineError::WriterGone)?
    }

    /// The far tier's live messages on `route` with lookup key `key`: their
    /// ids and identities.
    fn far_ids_for_key(
        &self,
        route: &str,
        key: &[u8],
    ) -> Result<Vec<(u64, MessageId)>, EngineError> {
        match self.inner.far.as_ref() {
            Some(tier) => tier.find_key(&tier.store(), route, key, self.inner.config.key_of),
            None => Ok(Vec::new()),
        }
    }

    /// Pending messages in memory on `route` whose lookup key (Kafka key,
    /// else AMQP `message_id`) is `key`, verified against their stored
    /// records. The far tier's are not among them: [`Engine::lookup_key`].
    pub fn find_by_key(&self, route: &str, key: &[u8]) -> Result<Vec<u64>, EngineError> {
        let candidates = {
            let state = self.state();
            let Some(route_id) = state.route_id(route) else {
                return Ok(Vec::new());
            };
            state.ids_for_key(key_hash(route_id, key))
        };
        let mut found = Vec::new();
        for id in candidates {
            if let Some((info, Record::Schedule { message, .. })) = self.read(id)? {
                if &*info.route == route && (self.inner.config.key_of)(&message) == Some(key) {
                    found.push(id);
                }
            }
        }
        found.sort_unstable();
        Ok(found)
    }

    /// Cancel every pending message on `route` with lookup key `key` (AMQP
    /// `message_id`, or Kafka key: a tombstone cancels this way). Returns the
    /// ids cancelled, once their Done records (or, for the far tier's, the
    /// key tombstone that drops them as their bucket loads) are durable;
    /// none is not an error. If every match is already being published,
    /// that is [`EngineError::InFlight`].
    pub async fn cancel_by_key(&self, route: &str, key: &[u8]) -> Result<Vec<u64>, EngineError> {
        let _op = match self.inner.far.as_ref() {
            Some(tier) => Some(tier.exclusive().await),
            None => None,
        };
        let engine = self.clone();
        let (route, key) = (route.to_owned(), key.to_vec());
        let (far, queued) = tokio::task::spawn_blocking(move || {
            // Far messages stored before now obey it as their bucket loads.
            let far = engine.far_ids_for_key(&route, &key)?;
            // Marked, durably, before the tombstone cancels them, as a
            // cancel by id marks a far message (seed 9398: cancelled
            // without a mark, one's redelivery after a restart was taken
            // for its Schedule read back in doubt, and fired).
            for &(id, uid) in &far {
                engine.inner.mark_cancelled_durably(id, uid.as_u128())?;
            }
            tier::tombstone(&engine.inner, &route, &key)?;
            let far: Vec<u64> = far.into_iter().map(|(id, _)| id).collect();
            let mut queued = Vec::new();
            let mut in_flight = None;
            for id in engine.find_by_key(&route, &key)? {
                match engine.cancel_queued(id) {
                    Ok(Some(done)) => queued.push((id, done)),
                    Ok(None) => {}
                    Err(EngineError::InFlight(id)) => in_flight = Some(id),
                    Err(e) => return Err(e),
                }
            }
            match in_flight {
                Some(id) if queued.is_empty() && far.is_empty() => Err(EngineError::InFlight(id)),
                _ => Ok((far, queued)),
            }
        })
        .await
        .map_err(|_| EngineError::WriterGone)?
        .inspect_err(|e| self.inner.on_failure(e))?;
        // Each settled, even after one failed: a failed Done puts its
        // message back (see `Retired::settle`).
        let mut cancelled = far;
        let mut failed = None;
        for (id, retired) in queued {
            match retired
                .settle(&self.inner, self.inner.cancel_hook.get())
                .await
            {
                Ok(()) => cancelled.push(id),
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        match failed {
            Some(e) => Err(e),
            None => {
                cancelled.sort_unstable();
                Ok(cancelled)
            }
        }
    }

    /// A pending message's route id, identity and stored bytes.
    fn stored_of(&self, id: u64) -> Option<(u16, u128, Vec<u8>)> {
        let (route, pos) = {
            let state = self.state();
            let (slot, _, _) = state.locate(id)?;
            (slot.route, slot.pos)
        };
        match self.inner.wal.read(pos) {
            Ok(Record::Schedule { uid, message, .. }) => {
                Some((route, MessageId::or_legacy(uid, id).as_u128(), message))
            }
            // Moved by compaction meanwhile: the sweep removes its key later.
            _ => None,
        }
    }

    /// The id here of the pending message whose identity is `uid`. A
    /// legacy id is the id itself; any other is looked for by reading every
    /// pending record (an admin lookup: no index costs RAM per message).
    pub fn find_by_uid(&self, uid: MessageId) -> Result<Option<u64>, EngineError> {
        // Held throughout: nothing moves between the tiers meanwhile.
        let far = self.inner.far.as_ref().map(|t| (t, t.store()));
        let key_of = self.inner.config.key_of;
        if uid.is_legacy() {
            let id = uid.as_u128() as u64;
            if self.is_pending(id) {
                return Ok(Some(id));
            }
            return match &far {
                Some((tier, store)) => Ok(tier.find_id(store, id, key_of)?.map(|(_, r)| r.id)),
                None => Ok(None),
            };
        }
        let everything = ListQuery {
            limit: usize::MAX,
            ..ListQuery::default()
        };
        let mut page = Page::new(&everything, None);
        self.offer_near(&mut page);
        let all = page.finish(&self.state());
        for info in all {
            match self.record_of(&info) {
                Ok(Some(Record::Schedule {
                    id, uid: stored, ..
                })) if MessageId::or_legacy(stored, id) == uid => {
                    return Ok(Some(id));
                }
                // Fired or moved by compaction meanwhile: not this one.
                _ => {}
            }
        }
        match &far {
            Some((tier, store)) => tier.find_uid(store, uid, key_of),
            None => Ok(None),
        }
    }

    /// The stored record of a pending message: (route, due, encoded message).
    pub fn read(&self, id: u64) -> Result<Option<(PendingInfo, Record)>, EngineError> {
        let far = self.inner.far.as_ref().map(|t| (t, t.store()));
        let found = {
            let state = self.state();
            state.locate(id).map(|(slot, deadline, phase)| PendingInfo {
                id,
                route: state.route_name(slot.route),
                due_ms: deadline,
                phase,
                at: Location::Wal(slot.pos),
            })
        };
        if let Some(info) = found {
            let Location::Wal(pos) = info.at else {
                unreachable!("located in the wheel")
            };
            let record = self.inner.wal.read(pos)?;
            return Ok(Some((info, record)));
        }
        let Some((tier, store)) = far else {
            return Ok(None);
        };
        let Some((_, record)) = tier.find_id(&store, id, self.inner.config.key_of)? else {
            return Ok(None);
        };
        let full = far_record(&record);
        Ok(Some((far_info(record), full)))
    }

    /// Pending messages in (due, id) order after `query.after`, at most
    /// `query.limit`. The wheel is walked a chunk of slab nodes per lock
    /// hold, so paging through millions of pending messages never keeps the
    /// dispatcher waiting long; the ordered side sets (held, blocked) are
    /// read by range. A message that moves between them during the walk
    /// (it fires, say) is listed once.
    pub fn list(&self, query: &ListQuery) -> Vec<PendingInfo> {
        let route = match &query.route {
            Some(name) => match self.state().route_id(name) {
                Some(r) => Some(r),
                None => return Vec::new(),
            },
            None => None,
        };
        // Held throughout: nothing moves between the tiers meanwhile.
        let far = self.inner.far.as_ref().map(|t| (t, t.store()));
        let mut page = Page::new(query, route);
        self.offer_near(&mut page);
        if let Some((tier, store)) = &far {
            let lower = query
                .after
                .map_or(0, |a| a.0)
                .max(query.due_from.unwrap_or(0));
            'buckets: for bucket in store.buckets_from(lower) {
                if page.closed_before(bucket) || query.due_to.is_some_and(|t| bucket > t) {
                    break;
                }
                let read = match store.read_bucket(bucket, self.inner.config.key_of) {
                    Ok(read) => read,
                    Err(e) => {
                        tracing::error!(bucket, error = %e, "cannot read a far bucket; its messages are not listed");
                        continue;
                    }
                };
                for record in read.live {
                    if query.due_to.is_some_and(|t| record.due_ms > t) {
                        break 'buckets;
                    }
                    tier.hint(record.id, bucket);
                    if !page.offer_far(record) {
                        break 'buckets;
                    }
                }
            }
        }
        page.finish(&self.state())
    }

    /// Offer `page` every message in the wheel, the side sets and in flight.
    fn offer_near(&self, page: &mut Page<'_>) {
        let query = page.query;
        let route = page.route;
        let mut from = Some(0);
        while let Some(start) = from {
            let state = self.state();
            from = state.scan_armed(start, LIST_CHUNK, |e| {
                page.offer(e.id, e.deadline, e.data, Phase::Waiting);
            });
            drop(state);
            if from.is_some() {
                std::thread::sleep(LIST_PAUSE);
            }
        }
        let state = self.state();
        let after = query.after.unwrap_or((0, 0));
        let lower = after.max((query.due_from.unwrap_or(0), 0));
        for range in state.waiting_aside(route, lower) {
            let ordered = range.take_while(|((due, _), _)| query.due_to.is_none_or(|t| *due <= t));
            for (&(due, id), &slot) in ordered {
                if !page.offer(id, due, slot, Phase::Waiting) {
                    break;
                }
            }
        }
        for (id, f) in state.flights() {
            page.offer(id, f.deadline, f.slot, Phase::Publishing);
        }
    }

    /// Pending messages per route, O(routes).
    pub fn counts(&self) -> Vec<(Arc<str>, u64)> {
        self.state().counts_by_route()
    }

    pub fn pending(&self) -> u64 {
        self.state().pending()
    }

    pub fn space(&self) -> SpaceReport {
        self.inner.wal.space()
    }

    /// Fire due messages into `dispatch` until `shutdown`, then wait up to
    /// `grace` for in-flight publishes. Also runs segment GC and compaction.
    pub async fn run(
        &self,
        dispatch: Arc<dyn Dispatch>,
        shutdown: CancellationToken,
        grace: Duration,
    ) {
        let rounds = self.inner.config.background_rounds.then(|| {
            (
                tokio::spawn(compact::run(self.inner.clone(), shutdown.clone())),
                tokio::spawn(tier::run(self.inner.clone(), shutdown.clone())),
            )
        });
        dispatch::run(self.inner.clone(), dispatch, shutdown, grace).await;
        if let Some((gc, far)) = rounds {
            let _ = gc.await;
            let _ = far.await;
        }
    }

    /// Make the dispatcher look at the clock again (after a clock change).
    pub fn wake(&self) {
        self.inner.wake.notify_one();
    }

    /// Flush and stop the WAL writer.
    pub async fn close(&self) -> Result<(), EngineError> {
        let wal = self.inner.wal.clone();
        tokio::task::spawn_blocking(move || wal.close())
            .await
            .map_err(|_| EngineError::WriterGone)??;
        Ok(())
    }

    /// One round of the far tier: spill, then load what the horizon
    /// reached (also run periodically by `run`).
    pub async fn far_round(&self) -> Result<(), EngineError> {
        tier::round(&self.inner).await
    }

    /// Load the whole far tier into the wheel now (see [`tier::load_all`]).
    /// Returns how many messages.
    pub async fn load_all_far(&self) -> Result<usize, EngineError> {
        tier::load_all(&self.inner).await
    }

    /// Messages in the far tier.
    pub fn far_pending(&self) -> u64 {
        self.state().far_pending()
    }

    /// Bytes on disk in the far tier.
    pub fn far_bytes(&self) -> u64 {
        self.inner.far.as_ref().map_or(0, |t| t.store().bytes())
    }

    /// One round of segment GC and compaction (also run periodically by `run`).
    pub async fn compact_now(&self) -> Result<(), EngineError> {
        compact::once(&self.inner).await
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.state()
    }

    /// Set the pending and WAL gauges from the current state (the
    /// dispatcher does so about once a second; `/metrics` just before
    /// rendering, so a scrape never shows a stale pending count).
    pub fn publish_gauges(&self) {
        self.inner.publish_gauges();
    }
}

impl Inner {
    /// A far message was cancelled (by id, or by a key tombstone as its
    /// bucket loads): a redelivery that repeats it (or any record under its
    /// identity) must not bring it back (see [`dedup`]). The returned
    /// receiver answers once the marks are durable.
    fn mark_cancelled_now(&self, id: u64, uid: u128) -> Result<AppendReceiver, EngineError> {
        let mut state = self.state();
        let ids = state.unconfirmed.cancel_all(id, Some(uid));
        let mut last = None;
        for marked in ids {
            let mark = marked | dedup::CANCELLED_MARK;
            // With a Done naming its Schedule's segment (or its Remembered
            // frame's), so the mark is not collected while a restart may
            // read that record back. A plain mark went with its segment
            // while the older frame stayed, before the frame saying
            // "cancelled" was written (sim seeds 9210116, 9222575).
            let kept = match state.cancel_mark_kept_by(marked) {
                Some(segment) => self.wal.append_marks_kept_by(marked, segment, vec![mark])?,
                None => None,
            };
            last = Some(match kept {
                Some(rx) => rx,
                None => self.wal.append_acked_now(mark, None)?,
            });
        }
        Ok(last.expect("cancel_all names the id itself"))
    }

    /// [`Inner::mark_cancelled_now`], waiting until the marks are durable
    /// (from a blocking task).
    fn mark_cancelled_durably(&self, id: u64, uid: u128) -> Result<(), EngineError> {
        self.mark_cancelled_now(id, uid)?
            .blocking_recv()
            .map_err(|_| EngineError::WriterGone)??;
        Ok(())
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("engine state poisoned")
    }

    /// A failed fsync anywhere (the far tier's included) stops the log, as
    /// the WAL's own does: the runtime exits, and nothing retries an fsync
    /// whose pages the kernel may have dropped. A full disk (the far
    /// tier's: the WAL's writer sees its own) releases the disk reserve to
    /// the writes that free space.
    fn on_failure(&self, e: &EngineError) {
        if e.is_disk_full() {
            self.wal.release_reserve();
        }
        if e.is_fatal() && !self.wal.is_stopped() {
            tracing::error!(error = %e, "stopping the log");
            self.wal.halt().stop(e);
        }
    }

    /// A message whose Done failed waits again where it waited: live in
    /// its segment, armed, and in the key index.
    fn rearm_retired(&self, entry: Expired<Slot>, hash: Option<u64>) {
        // Its Schedule counts as live again already: the WAL undid the
        // count when the Done failed (or never took it).
        let mut state = self.state();
        state.arm(entry.id, entry.deadline, entry.data);
        if let Some(hash) = hash {
            state.index_key(hash, entry.id);
        }
        drop(state);
        self.wake.notify_one();
    }

    fn publish_gauges(&self) {
        // Per route only: the total is `sum(delayd_pending_messages)`.
        for (route, n) in self.state().counts_by_route() {
            metrics::gauge!("delayd_pending_messages", "route" => route.to_string()).set(n as f64);
        }
        let space = self.wal.space();
        metrics::gauge!("delayd_wal_bytes").set(space.bytes as f64);
        metrics::gauge!("delayd_wal_live_bytes").set(space.live_bytes as f64);
        metrics::gauge!("delayd_wal_segments").set(space.segments as f64);
        tier::publish_gauges(self);
    }

    /// Bytes on disk: the WAL's and the far tier's (for `max_disk`).
    fn disk_bytes(&self) -> u64 {
        let far = self.far.as_ref().map_or(0, |t| t.store().bytes());
        self.wal.space().bytes + far
    }
}

/// A far record as a listing shows it.
fn far_info(record: FarRecord) -> PendingInfo {
    PendingInfo {
        id: record.id,
        route: Arc::from(record.route.as_str()),
        due_ms: record.due_ms,
        phase: Phase::Waiting,
        at: Location::Far(Arc::new(record)),
    }
}

/// A far record as the WAL would give it back.
fn far_record(r: &FarRecord) -> Record {
    Record::Schedule {
        seq: r.id,
        id: r.id,
        due_ms: r.due_ms,
        uid: r.uid,
        route: r.route.clone(),
        message: r.message.clone(),
    }
}

/// Tests and the simulator: whether the dispatcher is done for now.
#[cfg(test)]
impl Engine {
    /// The most message bytes one far load chunk held so far.
    pub(crate) fn far_load_peak(&self) -> usize {
        self.inner.far.as_ref().map_or(0, |t| t.load_peak())
    }

    /// Bad frames the far tier met in its buckets.
    pub(crate) fn far_corrupt_frames(&self) -> u64 {
        self.inner
            .far
            .as_ref()
            .map_or(0, |t| t.store().corrupt_frames())
    }

    /// Nothing due at the clock's now is waiting or being published.
    pub(crate) fn settled(&self) -> bool {
        let now = self.now_ms();
        let state = self.state();
        state.next_deadline().is_none_or(|d| d > now)
            && state.flights().next().is_none()
            && self.inner.wal.is_idle()
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tier_tests;
