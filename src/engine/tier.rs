//! The engine's side of the far tier (`crate::far`): spilling messages due
//! past the frontier out of the wheel and the WAL, loading each bucket back
//! as the horizon reaches it, and finding or cancelling a message there.
//!
//! Two locks. `ops` (async) serialises whole operations that move messages
//! between the tiers or cancel them: a spill, a load, a cancel. `store`
//! guards the files and is held, outside the state lock, wherever a
//! message is in neither place it will end in: a reader holding it sees
//! every message either in the wheel or on disk.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::far::{Entry, FarConfig, FarError, FarRecord, FarStore};
use crate::id::MessageId;
use crate::wal::{Record, WalConfig, WalError};
use crate::wheel::Expired;

use super::state::{Slot, State};
use super::{key_hash, EngineError, Inner};

/// `EngineConfig::far`: the far tier's settings.
#[derive(Debug, Clone)]
pub struct FarSettings {
    /// Messages due further ahead than this wait on disk, not in the wheel;
    /// also the width of a bucket.
    pub horizon: Duration,
    /// Routes whose messages always stay in the wheel.
    pub near_only: HashSet<String>,
    /// Off: nothing new goes to the tier, and it is opened only if it
    /// holds something (which still loads in time).
    pub spill: bool,
    /// Most bytes of messages a load reads into memory at once (the next
    /// chunk is read once these are durable in the WAL).
    pub load_chunk_bytes: usize,
}

/// [`FarSettings::load_chunk_bytes`] by default.
pub const LOAD_CHUNK_BYTES: usize = 16 << 20;

/// Bucket hints kept for cancels by id that follow a lookup.
const MAX_HINTS: usize = 4096;

pub(crate) struct Tier {
    ops: tokio::sync::Mutex<()>,
    store: Mutex<FarStore>,
    horizon_ms: u64,
    near_only: HashSet<String>,
    spill: bool,
    load_chunk_bytes: usize,
    /// The most message bytes one load chunk held (tests).
    load_peak: std::sync::atomic::AtomicUsize,
    /// Spilled messages whose WAL Done failed (a full disk), as (id, first
    /// seq of their segment): durable in a bucket and still live in the
    /// WAL. Their Dones are written before the tier does anything else, so
    /// that no cancel is answered while a copy could come back at a
    /// restart (see [`retire_spilled`]).
    unretired: Mutex<Vec<(u64, u64)>>,
    /// Id -> bucket of far messages found lately (by a listing or a lookup
    /// by uid), so that the cancel which follows reads one bucket.
    hints: Mutex<HashMap<u64, u64>>,
    /// Tests only: the next load stops, as a crash would, once its copies
    /// are durable in the WAL and before its bucket is removed.
    #[cfg(test)]
    pub(crate) crash_after_copies: std::sync::atomic::AtomicBool,
    /// Tests only: the next purge page loads what is due between its
    /// listing and its cancels, as a background round could.
    #[cfg(test)]
    pub(crate) load_during_purge: std::sync::atomic::AtomicBool,
}

impl Tier {
    /// Open the tier, or `None` when spilling is off and it holds nothing.
    pub fn open(
        settings: &FarSettings,
        wal: &WalConfig,
        now: u64,
    ) -> Result<Option<Tier>, EngineError> {
        let horizon_ms = (settings.horizon.as_millis() as u64).max(1);
        let dir = wal.dir.join("far");
        if !settings.spill && !wal.fs.is_dir(&dir) {
            return Ok(None);
        }
        let config = FarConfig {
            dir,
            bucket_ms: horizon_ms,
            max_frame_len: crate::wal::frame::MAX_LEN,
            fs: wal.fs.clone(),
        };
        let reach = now.saturating_add(horizon_ms);
        let frontier = reach - reach % horizon_ms + horizon_ms;
        let store = FarStore::open(config, frontier)?;
        Ok(Some(Tier {
            ops: tokio::sync::Mutex::new(()),
            store: Mutex::new(store),
            horizon_ms,
            near_only: settings.near_only.clone(),
            spill: settings.spill,
            load_chunk_bytes: settings.load_chunk_bytes.max(1),
            load_peak: Default::default(),
            hints: Mutex::new(HashMap::new()),
            unretired: Mutex::new(Vec::new()),
            #[cfg(test)]
            crash_after_copies: Default::default(),
            #[cfg(test)]
            load_during_purge: Default::default(),
        }))
    }

    /// May messages of `route` go to the far tier?
    pub fn spills(&self, route: &str) -> bool {
        self.spill && !self.near_only.contains(route)
    }

    pub fn store(&self) -> MutexGuard<'_, FarStore> {
        self.store.lock().expect("far store poisoned")
    }

    /// After the WAL's replay: count what the tier holds, set the frontier,
    /// and make every armed message at or past it a spill candidate (those
    /// a crash kept from being retired in the WAL, or written before the
    /// tier existed).
    pub fn adopt(&self, state: &mut State) -> Result<(), EngineError> {
        let store = self.store();
        for (route, n) in store.counts() {
            let r = state.intern(&route).ok_or(EngineError::TooManyRoutes)?;
            state.add_far(r, n as i64);
        }
        state.set_far_from(store.frontier());
        let mut found = Vec::new();
        state.scan_waiting(|e| {
            if e.deadline >= store.frontier() {
                found.push((e.id, e.deadline, e.data.route));
            }
        });
        for (id, deadline, route) in found {
            if self.spills(&state.route_name(route)) {
                state.note_far_candidate(id, deadline);
            }
        }
        Ok(())
    }

    fn note_load_chunk(&self, bytes: usize) {
        self.load_peak.fetch_max(bytes, Ordering::Relaxed);
    }

    /// The most message bytes one load chunk held so far.
    #[cfg(test)]
    pub fn load_peak(&self) -> usize {
        self.load_peak.load(Ordering::Relaxed)
    }

    pub fn hint(&self, id: u64, bucket: u64) {
        let mut hints = self.hints.lock().expect("hints poisoned");
        if hints.len() >= MAX_HINTS {
            hints.clear();
        }
        hints.insert(id, bucket);
    }

    fn hinted(&self, id: u64) -> Option<u64> {
        self.hints.lock().expect("hints poisoned").get(&id).copied()
    }

    /// Take the tier's operation lock (see the module doc).
    pub async fn exclusive(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.ops.lock().await
    }

    /// The far message with id `id`: (bucket, record). Reads the hinted
    /// bucket, else every bucket in order.
    pub fn find_id(
        &self,
        store: &FarStore,
        id: u64,
        key_of: crate::far::KeyOf,
    ) -> Result<Option<(u64, FarRecord)>, EngineError> {
        let hinted = self.hinted(id);
        let buckets = match hinted {
            Some(b) if store.contains_bucket(b) => vec![b],
            _ => store.buckets_from(0),
        };
        for b in buckets {
            let read = store.read_bucket(b, key_of)?;
            if let Some(r) = read.live.into_iter().find(|r| r.id == id) {
                return Ok(Some((b, r)));
            }
        }
        Ok(None)
    }

    /// Whether far message `id` waits in a bucket that a key tombstone
    /// cancels it from (dropped when the bucket loads).
    pub fn is_tombstoned(
        &self,
        store: &FarStore,
        id: u64,
        key_of: crate::far::KeyOf,
    ) -> Result<bool, EngineError> {
        let buckets = match self.hinted(id) {
            Some(b) if store.contains_bucket(b) => vec![b],
            _ => store.buckets_from(0),
        };
        for b in buckets {
            if store
                .read_bucket(b, key_of)?
                .tombstoned
                .iter()
                .any(|r| r.id == id)
            {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The live far messages of `route` whose lookup key is `key`, reading
    /// bucket by bucket (an admin lookup: it costs a read of the tier).
    pub fn find_key(
        &self,
        store: &FarStore,
        route: &str,
        key: &[u8],
        key_of: crate::far::KeyOf,
    ) -> Result<Vec<(u64, MessageId)>, EngineError> {
        let mut found = Vec::new();
        for b in store.buckets_from(0) {
            for r in store.read_bucket(b, key_of)?.live {
                if r.route == route && key_of(&r.message) == Some(key) {
                    self.hint(r.id, b);
                    found.push((r.id, MessageId::or_legacy(r.uid, r.id)));
                }
            }
        }
        Ok(found)
    }

    /// The far message whose identity is `uid`, reading bucket by bucket.
    pub fn find_uid(
        &self,
        store: &FarStore,
        uid: MessageId,
        key_of: crate::far::KeyOf,
    ) -> Result<Option<u64>, EngineError> {
        for b in store.buckets_from(0) {
            let read = store.read_bucket(b, key_of)?;
            if let Some(r) = read
                .live
                .iter()
                .find(|r| MessageId::or_legacy(r.uid, r.id) == uid)
            {
                self.hint(r.id, b);
                return Ok(Some(r.id));
            }
        }
        Ok(None)
    }
}

/// Spill and load every tick until `shutdown`.
pub(crate) async fn run(inner: Arc<Inner>, shutdown: CancellationToken) {
    let Some(tier) = inner.far.as_ref() else {
        return;
    };
    let every = inner
        .config
        .gc_interval
        .min(Duration::from_millis(tier.horizon_ms / 4).max(Duration::from_millis(10)));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.cancelled() => return,
        }
        if let Err(e) = round(&inner).await {
            metrics::counter!("delayd_far_errors_total").increment(1);
            tracing::error!(error = %e, "far tier: spill or load failed; retried next round");
        }
    }
}

/// One spill, then every load that is due.
pub(crate) async fn round(inner: &Arc<Inner>) -> Result<(), EngineError> {
    let done = async {
        spill(inner).await?;
        load_due(inner).await?;
        Ok(())
    }
    .await;
    if let Err(e) = &done {
        inner.on_failure(e);
    }
    publish_gauges(inner);
    done
}

pub(crate) fn publish_gauges(inner: &Inner) {
    if let Some(tier) = inner.far.as_ref() {
        let Ok(store) = tier.store.try_lock() else {
            return;
        };
        metrics::gauge!("delayd_far_bytes").set(store.bytes() as f64);
        metrics::gauge!("delayd_far_buckets").set(store.bucket_count() as f64);
        drop(store);
        metrics::gauge!("delayd_far_messages").set(inner.state().far_pending() as f64);
    }
}

/// Records read back and written per append: bounds a spill's memory
/// (a few tens of MB with small messages) whatever the intake rate.
const SPILL_CHUNK: usize = 32 * 1024;

/// Move the waiting spill candidates into their buckets, then retire them
/// in the WAL. Returns how many moved.
pub(crate) async fn spill(inner: &Arc<Inner>) -> Result<usize, EngineError> {
    let Some(tier) = inner.far.as_ref() else {
        return Ok(0);
    };
    let _op = tier.exclusive().await;
    // No compaction may move what is being spilled (nor free its segment).
    let _gc = inner.compacting.lock().await;
    let worker = inner.clone();
    let (spilled, failed) = tokio::task::spawn_blocking(move || {
        retire_spilled(&worker)?;
        // A spill frees WAL space only once whole segments are dead: on a
        // full disk it waits for the reserve, as the intake does.
        if !worker.wal.has_room()? {
            return Ok((Vec::new(), None));
        }
        Ok::<_, EngineError>(write_spill(&worker))
    })
    .await
    .map_err(|_| EngineError::WriterGone)??;
    // Durable in the bucket and counted there: retire the WAL's copy. A
    // crash before this is durable spills it again (kept once per id).
    // One the engine no longer remembers (its ack was confirmed) gets its
    // ack's mark again in its Done's batch, which lasts as long as its
    // Schedule (garbage collection keeps the Done's segment for it; a
    // compaction copy's own mark follows the copy). A restart that read
    // the Schedule back without one took it for a record in doubt, which
    // a later cancel of its load's copy (under another id) did not cover;
    // a twin's redelivery was then stored under its identity and fired
    // after that cancel (sim seed 9117519).
    let mut marks = ack_marks(inner, spilled.iter().map(|e| e.id));
    let mut dones = Vec::with_capacity(spilled.len());
    let mut not_retired = Vec::new();
    let mut done_failed = None;
    for e in &spilled {
        let marks = marks.remove(&e.id).unwrap_or_default();
        match inner.wal.append_done_with_marks(e.id, e.data.pos, marks) {
            Ok(rx) => dones.push((e, rx)),
            Err(err) => {
                not_retired.push(e);
                done_failed.get_or_insert(EngineError::from(err));
            }
        }
    }
    for (e, rx) in dones {
        let written = match rx.await {
            Ok(Ok(_)) => continue,
            Ok(Err(err)) => EngineError::from(err),
            Err(_) => EngineError::WriterGone,
        };
        not_retired.push(e);
        done_failed.get_or_insert(written);
    }
    if !not_retired.is_empty() {
        let mut unretired = tier.unretired.lock().expect("unretired poisoned");
        for e in not_retired {
            if let Some(first_seq) = inner.wal.segment_first_seq(e.data.pos.segment) {
                unretired.push((e.id, first_seq));
            }
        }
    }
    metrics::counter!("delayd_far_spilled_total").increment(spilled.len() as u64);
    match failed.or(done_failed) {
        Some(e) => Err(e),
        None => Ok(spilled.len()),
    }
}

/// The ack marks a spilled record's Done carries: its own for one the
/// engine no longer remembers (see [`spill`]).
fn ack_marks(inner: &Inner, ids: impl Iterator<Item = u64>) -> HashMap<u64, Vec<u64>> {
    let state = inner.state();
    ids.filter(|&id| !state.unconfirmed.contains(id))
        .map(|id| (id, vec![id]))
        .collect()
}

/// Write the WAL Dones of spilled messages that a full disk kept from
/// being written (blocking: call it from a blocking task, with the tier's
/// operation lock held). Until they are durable a restart would arm a
/// message the tier also holds, beside any cancel made there meanwhile.
pub(crate) fn retire_spilled(inner: &Inner) -> Result<(), EngineError> {
    let Some(tier) = inner.far.as_ref() else {
        return Ok(());
    };
    let mut unretired = tier.unretired.lock().expect("unretired poisoned");
    if unretired.is_empty() {
        return Ok(());
    }
    // A segment collected meanwhile took the WAL's copy with it.
    unretired.retain(|&(_, first_seq)| inner.wal.segment_exists(first_seq));
    // With their ack marks, as a spill's own Dones have them: without, a
    // restart read the record back in doubt, outside a cancel made through
    // its load's copy
    // (`tier_tests::a_spill_retired_after_a_full_disk_keeps_its_acks_mark`).
    let mut marks = ack_marks(inner, unretired.iter().map(|&(id, _)| id));
    let mut replies = Vec::with_capacity(unretired.len());
    for &(id, first_seq) in unretired.iter() {
        let marks = marks.remove(&id).unwrap_or_default();
        replies.push(inner.wal.append_done_naming(id, first_seq, marks)?);
    }
    for rx in replies {
        rx.blocking_recv().map_err(|_| EngineError::WriterGone)??;
    }
    unretired.clear();
    Ok(())
}

/// [`retire_spilled`] under the tier's operation lock, from async code.
/// Before an answer that reads the far tier for what is pending (a purge;
/// a cancel by key's [`tombstone`] does the same): a spilled message whose WAL Done a full disk refused
/// is in both, and the far tier may have dropped it already (a key
/// tombstone written before it was spilled). Answered from the far tier's
/// view alone, the purge said nothing was left, and a crash brought the
/// WAL's copy back to fire (sim seed 476,040).
pub(crate) async fn retire_spilled_now(inner: &Arc<Inner>) -> Result<(), EngineError> {
    let Some(tier) = inner.far.as_ref() else {
        return Ok(());
    };
    let _op = tier.exclusive().await;
    let worker = inner.clone();
    tokio::task::spawn_blocking(move || retire_spilled(&worker))
        .await
        .map_err(|_| EngineError::WriterGone)?
}

/// Under the store lock: take the candidates out of the wheel, and append
/// them chunk by chunk. Returns those now durable in the tier, and the
/// error that put the rest back into the wheel, if one did.
fn write_spill(inner: &Inner) -> (Vec<Expired<Slot>>, Option<EngineError>) {
    let tier = inner.far.as_ref().expect("spill without a far tier");
    let mut store = tier.store();
    let taken = inner.state().take_spillable();
    let mut spilled = Vec::with_capacity(taken.len());
    for (i, chunk) in taken.chunks(SPILL_CHUNK).enumerate() {
        match spill_chunk(inner, &mut store, chunk) {
            Ok(true) => spilled.extend_from_slice(chunk),
            Ok(false) => {
                inner.state().unspill(&taken[i * SPILL_CHUNK..]);
                return (spilled, None);
            }
            Err(e) => {
                inner.state().unspill(&taken[i * SPILL_CHUNK..]);
                return (spilled, Some(e));
            }
        }
    }
    (spilled, None)
}

/// Read one chunk's records from the WAL and append them to their buckets.
/// `Ok(false)`: not spilled, as the checkpoint would outgrow what the disk
/// reserve can hold (below).
fn spill_chunk(
    inner: &Inner,
    store: &mut FarStore,
    chunk: &[Expired<Slot>],
) -> Result<bool, EngineError> {
    let mut records = Vec::with_capacity(chunk.len());
    for e in chunk {
        match inner.wal.read(e.data.pos)? {
            Record::Schedule {
                id,
                uid,
                route,
                message,
                ..
            } if id == e.id => records.push(FarRecord {
                id,
                due_ms: e.deadline,
                uid,
                route,
                message,
            }),
            _ => {
                return Err(EngineError::Interrupted(
                    "a spill found another record at a message's WAL position",
                ))
            }
        }
    }
    // Every load rewrites the checkpoint, and on a full disk only the
    // reserve's room is there for it: a checkpoint larger than the reserve
    // (at its widest) could never be written again there, and the tier
    // could neither load nor empty (seed 44778). Such messages stay in the
    // wheel, their records in the WAL.
    let reserve = inner.wal.reserve_size();
    let checkpoint = store.checkpoint_bytes_after(&records)? as u64;
    if reserve > 0 && checkpoint > reserve {
        tracing::warn!(
            checkpoint,
            reserve,
            "not spilling to the far tier: its checkpoint would outgrow the disk reserve (raise wal.reserve_bytes); the messages wait in memory"
        );
        return Ok(false);
    }
    store.append(&records)?;
    // Their key-index entries go with them (a sweep would keep them: they
    // are still pending, just not in the wheel).
    let key_of = inner.config.key_of;
    let mut state = inner.state();
    for (e, r) in chunk.iter().zip(&records) {
        if let Some(key) = key_of(&r.message) {
            state.unindex_key(key_hash(e.data.route, key), e.id);
        }
    }
    Ok(true)
}

/// Load every bucket the horizon has reached. Returns how many messages.
pub(crate) async fn load_due(inner: &Arc<Inner>) -> Result<usize, EngineError> {
    let Some(tier) = inner.far.as_ref() else {
        return Ok(0);
    };
    let mut loaded = 0;
    loop {
        let reach = inner.clock.now_ms().saturating_add(tier.horizon_ms);
        let from = inner.state().far_from();
        if from > reach {
            return Ok(loaded);
        }
        let _op = tier.exclusive().await;
        let _gc = inner.compacting.lock().await;
        loaded += load_one(inner, tier, from, reach).await?;
    }
}

/// Load every bucket, whatever its due time: the switch to the
/// broker-kept store, whose routes know messages by the ids they have now
/// (a later load would arm them under new ones). Returns how many.
pub(crate) async fn load_all(inner: &Arc<Inner>) -> Result<usize, EngineError> {
    let Some(tier) = inner.far.as_ref() else {
        return Ok(0);
    };
    let mut loaded = 0;
    loop {
        let Some(last) = tier.store().buckets_from(0).last().copied() else {
            return Ok(loaded);
        };
        let _op = tier.exclusive().await;
        let _gc = inner.compacting.lock().await;
        let from = inner.state().far_from();
        loaded += load_one(inner, tier, from, last).await?;
    }
}

/// Load the bucket at the frontier `from` (or, if there is none, move the
/// frontier over the empty stretch up to the next bucket or past `reach`).
async fn load_one(
    inner: &Arc<Inner>,
    tier: &Tier,
    from: u64,
    reach: u64,
) -> Result<usize, EngineError> {
    let width = tier.store().bucket_ms();
    {
        let mut store = tier.store();
        if !store.contains_bucket(from) {
            let past_reach = reach - reach % width + width;
            let to = store
                .first_bucket()
                .map_or(past_reach, |b| b.min(past_reach));
            let to = to.max(from + width);
            store.advance_frontier(to);
            inner.state().set_far_from(to);
            return Ok(0);
        }
    }
    let key_of = inner.config.key_of;
    let worker = inner.clone();
    // Every copy gets an id above any assigned so far.
    let after_id = inner
        .state()
        .max_id()
        .max(inner.wal.next_id().saturating_sub(1));
    // The bucket's index: its live records without their bytes.
    let (mut index, tombstoned, resumed, marks) = tokio::task::spawn_blocking(move || {
        let tier = worker.far.as_ref().expect("far tier");
        let mut store = tier.store();
        let resumed = on_reserve(&worker, || store.begin_load(from, after_id))?;
        let reader = store.reader(from)?.ok_or(EngineError::Interrupted(
            "a far bucket went while it was loaded",
        ))?;
        let index = reader.index(key_of)?;
        let tombstoned = index
            .tombstoned
            .iter()
            .map(|e| reader.read(e).map(|r| r.route))
            .collect::<Result<Vec<String>, _>>()?;
        // Cancelled by key: marked so for redelivery detection, as a
        // cancel by id is (the tombstone may be pruned once the bucket is
        // gone).
        let mut marks = None;
        for e in &index.tombstoned {
            marks = Some(worker.mark_cancelled_now(e.id, e.uid)?);
        }
        Ok::<_, EngineError>((index, tombstoned, resumed, marks))
    })
    .await
    .map_err(|_| EngineError::WriterGone)??;
    if let Some(marks) = marks {
        marks.await.map_err(|_| EngineError::WriterGone)??;
    }
    if let Some(after_id) = resumed {
        skip_copied(inner, &mut index.live, from, from + width, after_id)?;
    }

    // Back into the WAL, under new ids: the ids they had are retired there
    // (the spill's Done, which compaction may copy past a record with the
    // same id). Their identity (uid, the x-delayd-id) is kept. One still in
    // the wheel (spilled twice, then armed again from the WAL) stays as is.
    // A chunk of records at a time, each durable before the next is read:
    // a load holds at most `load_chunk_bytes` of messages, whatever the
    // bucket holds.
    let mut placed = Vec::with_capacity(index.live.len());
    let mut failed = None;
    let mut left = &index.live[..];
    while !left.is_empty() && failed.is_none() {
        let worker = inner.clone();
        let wanted = left.to_vec();
        let limit = tier.load_chunk_bytes;
        let chunk = tokio::task::spawn_blocking(move || {
            let tier = worker.far.as_ref().expect("far tier");
            let store = tier.store();
            let reader = store.reader(from)?.ok_or(EngineError::Interrupted(
                "a far bucket went while it was loaded",
            ))?;
            let mut chunk = Vec::new();
            let mut bytes = 0;
            for entry in &wanted {
                let record = reader.read(entry)?;
                bytes += record.message.len();
                chunk.push(record);
                if bytes >= limit {
                    break;
                }
            }
            tier.note_load_chunk(bytes);
            Ok::<_, EngineError>(chunk)
        })
        .await
        .map_err(|_| EngineError::WriterGone)??;
        left = &left[chunk.len()..];
        let mut copies = Vec::with_capacity(chunk.len());
        for r in chunk {
            let (route, key) = {
                let mut state = inner.state();
                if state.is_pending(r.id) {
                    continue;
                }
                let route = state.intern(&r.route).ok_or(EngineError::TooManyRoutes)?;
                (route, key_of(&r.message).map(|k| key_hash(route, k)))
            };
            let rx = inner
                .wal
                .append_returning(r.due_ms, r.uid, &r.route, r.message)?;
            copies.push((r.id, r.due_ms, route, key, rx));
        }
        for (arrival, due, route, key, rx) in copies {
            match rx
                .await
                .map_err(|_| EngineError::WriterGone)
                .and_then(|r| Ok(r?))
            {
                Ok(appended) => {
                    // Its source's ack was settled long ago: no redelivery
                    // after a restart is this copy.
                    let _ = inner.wal.append_acked(appended.id, None);
                    placed.push(Rearm {
                        due,
                        arrival,
                        id: appended.id,
                        slot: Slot {
                            pos: appended.pos,
                            route,
                        },
                        key,
                    });
                }
                Err(e) => failed = Some(e),
            }
        }
    }
    #[cfg(test)]
    if tier.crash_after_copies.swap(false, Ordering::AcqRel) {
        return Err(EngineError::Interrupted("test: crashed after the copies"));
    }
    if let Some(e) = failed {
        // What was copied is durable: arm it (the bucket stays, and the
        // next try skips these).
        arm_sorted(inner, placed, Vec::new());
        return Err(e);
    }

    let n = placed.len();
    let worker = inner.clone();
    // Remove the bucket and arm its messages under the store lock: a
    // reader sees each either on disk or in the wheel.
    tokio::task::spawn_blocking(move || -> Result<(), EngineError> {
        let tier = worker.far.as_ref().expect("far tier");
        let mut store = tier.store();
        let counts = match on_reserve(&worker, || store.remove_bucket(from, from + width)) {
            Ok(c) => c,
            Err(e) => {
                drop(store);
                arm_sorted(&worker, placed, Vec::new());
                return Err(e.into());
            }
        };
        let mut state = worker.state();
        let candidates = state.take_candidates_in(from, from + width);
        for (route, count) in counts {
            if let Some(r) = state.route_id(&route) {
                state.add_far(r, -(count as i64));
            }
        }
        state.set_far_from(from + width);
        drop(state);
        arm_sorted(&worker, placed, candidates);
        Ok(())
    })
    .await
    .map_err(|_| EngineError::WriterGone)??;

    for route in tombstoned {
        metrics::counter!("delayd_cancelled_total", "route" => route).increment(1);
    }
    metrics::counter!("delayd_far_loaded_total").increment(n as u64);
    tracing::debug!(bucket = from, messages = n, "loaded a far bucket");
    Ok(n)
}

/// A load's checkpoint write frees space (its bucket goes): on a full
/// disk it gets the disk reserve's room and tries once more, as the WAL's
/// Dones do. Without the retry its failure released the reserve to the
/// fired messages' Dones, which took the room, and the load never fit
/// again (sim seed 9104734).
fn on_reserve<T>(
    inner: &Inner,
    mut write: impl FnMut() -> Result<T, FarError>,
) -> Result<T, FarError> {
    match write() {
        Err(FarError::Io(WalError::DiskFull(_))) if inner.wal.release_reserve() => write(),
        written => written,
    }
}

/// A load of this bucket began before and did not finish: some records
/// may have a copy already, under an id above `after_id` and with the same
/// identity and due time, live in the WAL (armed) or spilled back into the
/// bucket. Drop the originals of those from `live`, so each loads once.
fn skip_copied(
    inner: &Inner,
    live: &mut Vec<Entry>,
    from: u64,
    to: u64,
    after_id: u64,
) -> Result<(), EngineError> {
    // Judged by each copy's stored due time (below): its deadline in the
    // wheel may be a retry's.
    let mut armed = Vec::new();
    inner.state().scan_waiting(|e| {
        if e.id > after_id {
            armed.push((e.id, e.data.pos));
        }
    });
    let mut copied: HashSet<(u128, u64)> = live
        .iter()
        .filter(|r| r.id > after_id)
        .map(|r| (r.uid, r.due_ms))
        .collect();
    for (id, pos) in armed {
        if let Record::Schedule {
            id: found,
            uid,
            due_ms,
            ..
        } = inner.wal.read(pos)?
        {
            if found == id && (from..to).contains(&due_ms) {
                copied.insert((uid, due_ms));
            }
        }
    }
    let before = live.len();
    live.retain(|r| r.id > after_id || !copied.contains(&(r.uid, r.due_ms)));
    tracing::info!(
        bucket = from,
        skipped = before - live.len(),
        "a far bucket's earlier load did not finish; its records already copied load once"
    );
    Ok(())
}

/// A message to arm as a load ends: `arrival` orders equal due times (the
/// id it was first stored under; a loaded message's `id` is a new one).
struct Rearm {
    due: u64,
    arrival: u64,
    id: u64,
    slot: Slot,
    key: Option<u64>,
}

/// Arm loaded messages and the candidates that share their bucket in (due,
/// arrival) order, so that equal due times fire in arrival order across both.
fn arm_sorted(inner: &Inner, loaded: Vec<Rearm>, candidates: Vec<Expired<Slot>>) {
    let mut all = loaded;
    all.extend(candidates.into_iter().map(|e| Rearm {
        due: e.deadline,
        arrival: e.id,
        id: e.id,
        slot: e.data,
        key: None,
    }));
    all.sort_by_key(|a| (a.due, a.arrival));
    let earliest = all.first().map(|a| a.due);
    {
        let mut state = inner.state();
        for a in all {
            if a.arrival != a.id {
                state.unconfirmed.pending_again(a.arrival);
            }
            state.arm(a.id, a.due, a.slot);
            if let Some(hash) = a.key {
                state.index_key(hash, a.id);
            }
        }
    }
    if earliest.is_some_and(|d| d < inner.planned_wake.load(Ordering::Acquire)) {
        inner.wake.notify_one();
    }
}

/// Cancel far message `id` (its bucket gets a Done). Call with the ops
/// lock held, after the wheel was tried. The record, if it was there.
pub(crate) fn cancel(
    inner: &Inner,
    id: u64,
    before: impl FnOnce(&FarRecord) -> Result<(), EngineError>,
) -> Result<Option<FarRecord>, EngineError> {
    let Some(tier) = inner.far.as_ref() else {
        return Ok(None);
    };
    retire_spilled(inner)?;
    let mut store = tier.store();
    let Some((bucket, record)) = tier.find_id(&store, id, inner.config.key_of)? else {
        return Ok(None);
    };
    before(&record)?;
    store.cancel(bucket, id, &record.route)?;
    drop(store);
    let mut state = inner.state();
    if let Some(r) = state.route_id(&record.route) {
        state.add_far(r, -1);
    }
    Ok(Some(record))
}

/// Cancel those of `ids` still live in bucket `start`, their Dones in one
/// append: a purge's far messages, a bucket read once however many it
/// cancels. Returns the records cancelled; an id missing was loaded (or
/// cancelled) since it was listed. Call with the ops lock held, from a
/// blocking task.
pub(crate) fn cancel_listed(
    inner: &Inner,
    start: u64,
    ids: &HashSet<u64>,
    before: impl FnOnce(&[FarRecord]) -> Result<(), EngineError>,
) -> Result<Vec<FarRecord>, EngineError> {
    let Some(tier) = inner.far.as_ref() else {
        return Ok(Vec::new());
    };
    retire_spilled(inner)?;
    let mut store = tier.store();
    let found: Vec<FarRecord> = match store.reader(start)? {
        Some(reader) => {
            let index = reader.index(inner.config.key_of)?;
            index
                .live
                .iter()
                .filter(|e| ids.contains(&e.id))
                .map(|e| reader.read(e))
                .collect::<Result<_, _>>()?
        }
        None => Vec::new(),
    };
    before(&found)?;
    let cancels: Vec<(u64, &str)> = found.iter().map(|r| (r.id, r.route.as_str())).collect();
    store.cancel_many(start, &cancels)?;
    drop(store);
    let mut state = inner.state();
    for r in &found {
        if let Some(route) = state.route_id(&r.route) {
            state.add_far(route, -1);
        }
    }
    Ok(found)
}

/// The other copies of the message with identity `uid` (other than
/// `cancelled`) that a load cut short left: the bucket's original is
/// cancelled here; the ids of copies armed in the wheel are returned, for
/// the caller to retire. Nothing without a load cut short. Call with the
/// ops lock held, from a blocking task.
pub(crate) fn cancel_copies(
    inner: &Inner,
    cancelled: u64,
    uid: u128,
) -> Result<Vec<u64>, EngineError> {
    let Some(tier) = inner.far.as_ref() else {
        return Ok(Vec::new());
    };
    let mut store = tier.store();
    let Some((bucket, after_id)) = store.loading() else {
        return Ok(Vec::new());
    };
    let width = store.bucket_ms();
    let originals: Vec<FarRecord> = match store.reader(bucket)? {
        Some(reader) => {
            let index = reader.index(inner.config.key_of)?;
            index
                .live
                .iter()
                .filter(|e| e.uid == uid && e.id != cancelled)
                .map(|e| reader.read(e))
                .collect::<Result<_, _>>()?
        }
        None => Vec::new(),
    };
    for r in originals {
        store.cancel(bucket, r.id, &r.route)?;
        let mut state = inner.state();
        if let Some(route) = state.route_id(&r.route) {
            state.add_far(route, -1);
        }
    }
    drop(store);
    // Judged by the copy's stored due time: its deadline in the wheel may
    // be a retry's.
    let mut armed = Vec::new();
    inner.state().scan_waiting(|e| {
        if e.id > after_id && e.id != cancelled {
            armed.push((e.id, e.data.pos));
        }
    });
    let mut copies = Vec::new();
    for (id, pos) in armed {
        if let Record::Schedule {
            id: found,
            uid: copy_uid,
            due_ms,
            ..
        } = inner.wal.read(pos)?
        {
            if found == id && copy_uid == uid && (bucket..bucket + width).contains(&due_ms) {
                copies.push(id);
            }
        }
    }
    Ok(copies)
}

/// Cancel the copy of message `id` (due at `due`) its bucket may hold. Call
/// with the ops lock held, from a blocking task.
pub(crate) fn cancel_in_bucket(inner: &Inner, id: u64, due: u64) -> Result<(), EngineError> {
    let Some(tier) = inner.far.as_ref() else {
        return Ok(());
    };
    let mut store = tier.store();
    let bucket = store.bucket_of(due);
    let found = match store.reader(bucket)? {
        Some(reader) => {
            let index = reader.index(inner.config.key_of)?;
            match index.live.iter().find(|e| e.id == id) {
                Some(e) => Some(reader.read(e)?),
                None => None,
            }
        }
        None => None,
    };
    if let Some(record) = found {
        store.cancel(bucket, id, &record.route)?;
        drop(store);
        let mut state = inner.state();
        if let Some(r) = state.route_id(&record.route) {
            state.add_far(r, -1);
        }
    }
    Ok(())
}

/// A cancel by key reaches far messages stored before it when their bucket
/// is read. Call with the ops lock held.
pub(crate) fn tombstone(inner: &Inner, route: &str, key: &[u8]) -> Result<(), EngineError> {
    let Some(tier) = inner.far.as_ref() else {
        return Ok(());
    };
    retire_spilled(inner)?;
    // Every message stored before now, those only the far tier holds
    // included (a restart arms none of them: `max_id` may be below theirs).
    let before_id = inner.wal.next_id().max(inner.state().max_id() + 1);
    tier.store().add_tombstone(route, key, before_id)?;
    Ok(())
}
