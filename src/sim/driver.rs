//! Plays a list of operations against the real engine on a simulated disk
//! and clock, one at a time, checking the model after each.

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::engine::{
    Arrival, BoxFuture, Clock, Dispatch, Engine, EngineConfig, FarSettings, Fired, ManualClock,
    Outcome, Stored,
};
use crate::id::MessageId;
use crate::wal::sim::{PowerLoss, SimFs};
use crate::wal::WalConfig;

use super::model::Model;
use super::ops::{seeded, Loss, Op, Rng, Scope, HORIZONS, ROUTES};
use super::Failure;

const DIR: &str = "/vol/wal";
const T0: u64 = 1_700_000_000_000;
/// Far rounds (or compactions) that may still fail once the disk has room
/// again, before the tier is said not to recover.
const RECOVERY_ROUNDS: u32 = 2;
/// Message bytes a far load reads at once: a few messages, so that loads
/// go chunk by chunk.
const LOAD_CHUNK: usize = 64;
/// Longest message the simulator stores (a key and a body), and with
/// `SIM_LIMITS=1` (a body padded, see [`padding`]).
const MAX_MESSAGE: usize = 16;
const MAX_PADDED: usize = MAX_MESSAGE + 400;
/// Longest a settle may take in real time before the engine is said stuck.
/// The disk reserve (`wal.reserve_bytes`): a few segments' worth.
const RESERVE: usize = 2048;
const SETTLE_LIMIT: Duration = Duration::from_secs(20);

/// What a run did (it broke nothing).
#[derive(Debug, Clone, Default)]
pub struct Report {
    #[allow(dead_code)] // shown by `{:?}` in scripts/sim.sh's replay
    pub seed: u64,
    pub ops: usize,
    pub messages: usize,
    pub fires: u64,
    pub restarts: u32,
    pub faults: u32,
    pub same_id_copies: u64,
    pub other_id_copies: u64,
    /// Of those, copies of messages with no byte-equal twin (see
    /// `Model::lone_other_id_copies`).
    pub lone_other_id_copies: u64,
    /// Messages whose Remembered frame was owed outside the ledger of owed
    /// frames when an engine ended (`Engine::frames_owed`): a restart may
    /// have forgotten them, which the identity checks excuse.
    pub frames_forgotten: u64,
    /// A hash of every operation's outcome and every message handed out:
    /// equal for two runs of one seed.
    pub trace: u64,
}

/// The sink: records what went out, fails publishes when told to, and
/// answers that the route moved (the broker-kept store's release) when
/// told to.
#[derive(Default)]
struct Sink {
    out: Mutex<Vec<Fired>>,
    fail_next: AtomicU32,
    release_next: AtomicU32,
    /// Ids answered "the route moved".
    released: Mutex<HashSet<u128>>,
}

impl Dispatch for Sink {
    fn deliver(&self, fired: Fired) -> BoxFuture<'static, Outcome> {
        let take = |n: &AtomicU32| {
            n.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                .is_ok()
        };
        let outcome = if take(&self.fail_next) {
            Outcome::Retry("simulated publish failure".into())
        } else if take(&self.release_next) {
            // The route's next owner fires it, under its id: it left.
            self.released
                .lock()
                .expect("sink")
                .insert(fired.uid.as_u128());
            self.out.lock().expect("sink").push(fired);
            Outcome::Release("the route moved (simulated)".into())
        } else {
            self.out.lock().expect("sink").push(fired);
            Outcome::Done
        };
        Box::pin(async move { outcome })
    }
}

struct Node {
    engine: Engine,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

/// A delivery the broker still holds: (message, redelivered).
type Held = (usize, bool);

/// A group of byte-equal messages: a route and the bytes.
type Group = (&'static str, Vec<u8>);

/// What the driver knows of the acks of each [`Group`], for
/// [`Sim::check_copy_of_settled`]. Sound rather than complete: a group
/// counts as settled only while nothing could have cost a mark.
#[derive(Debug, Default)]
struct AckBook {
    /// Groups with a store whose ack was confirmed in this fault epoch.
    confirmed: HashSet<Group>,
    /// Groups with a store whose ack may not be confirmed (in doubt, a
    /// failed store, a duplicate the record now stands for, a release),
    /// or confirmed before a fault: never settled.
    unsettled: HashSet<Group>,
    /// Groups a clean stop made settled on disk.
    settled: HashSet<Group>,
    /// Groups with stores whose ack was sent and may still be confirmed
    /// (`SIM_ACKS=1`): how many. Unsettled until then; for good if the
    /// process ends or the channel closes first.
    doubt: HashMap<Group, u32>,
}

impl AckBook {
    /// A disk fault (a full disk, a failed sync, a crash at a write): a
    /// mark written since may be lost, and a failed write may cost one
    /// written before (a compaction or a collection under the fault).
    fn fault(&mut self) {
        self.unsettled.extend(self.confirmed.drain());
        self.unsettled.extend(self.settled.drain());
    }

    /// A kill or a power cut: marks written since the last clean stop may
    /// be lost (lazy, or not yet synced); the ones that stop flushed stay,
    /// since the engine writes a moved mark before its old segment goes.
    fn kill(&mut self) {
        self.unsettled.extend(self.confirmed.drain());
        self.doubt_ends();
    }

    /// The acks still in doubt will never be confirmed to this process.
    fn doubt_ends(&mut self) {
        self.unsettled.extend(self.doubt.drain().map(|(g, _)| g));
    }

    /// A store's ack was sent, and may be confirmed later.
    fn sent(&mut self, group: Group) {
        *self.doubt.entry(group).or_default() += 1;
    }

    /// An ack [`Self::sent`] was confirmed.
    fn confirmed_late(&mut self, group: Group) {
        if let Some(n) = self.doubt.get_mut(&group) {
            *n -= 1;
            if *n == 0 {
                self.doubt.remove(&group);
            }
        }
        self.confirmed_now(group);
    }

    /// A store of `group` had its ack confirmed. This process keeps it
    /// in doubt a while (`dedup::CONFIRMED_KEPT`): not settled until the
    /// next clean stop.
    fn confirmed_now(&mut self, group: Group) {
        self.settled.remove(&group);
        self.confirmed.insert(group);
    }

    /// A clean stop flushed every mark.
    fn clean_stop(&mut self) {
        self.doubt_ends();
        let settled: Vec<Group> = self
            .confirmed
            .drain()
            .filter(|g| !self.unsettled.contains(g))
            .collect();
        self.settled.extend(settled);
    }

    fn is_settled(&self, group: &Group) -> bool {
        self.settled.contains(group)
            && !self.unsettled.contains(group)
            && !self.doubt.contains_key(group)
    }
}

pub struct Sim {
    seed: u64,
    rng: Rng,
    fs: SimFs,
    clock: Arc<ManualClock>,
    horizon: u64,
    node: Option<Node>,
    sink: Arc<Sink>,
    model: Model,
    /// Deliveries the broker holds, to deliver again.
    broker: VecDeque<Held>,
    /// Deliveries sent to the running process and not read yet (its
    /// prefetch): read at the next redelivery op, or back to the broker,
    /// marked redelivered, when the process ends.
    socket: Vec<usize>,
    /// Whether deliveries may wait in the socket (`SIM_SOCKET=1`; off in
    /// the test command's fixed budget, whose seeds keep their runs).
    socket_on: bool,
    /// Whether the route may move away (`SIM_RELEASE=1`, off like
    /// `socket_on`): half the publish failures drawn are then answers
    /// that the route's next owner has the message (`Outcome::Release`),
    /// and a redelivery of a message this process released must keep its
    /// id.
    release_on: bool,
    /// Whether a start may come with other limits (`SIM_LIMITS=1`, off
    /// like `socket_on`): segment size, largest message, compaction
    /// threshold, far load chunk, which route spills (see [`Limits`]);
    /// one body in four is padded past the lower message limit.
    limits_on: bool,
    /// Whether an ack in doubt may be confirmed later (`SIM_ACKS=1`, off
    /// like `socket_on`), at a clock step, drawn from a stream of its own.
    late_acks_on: bool,
    late_acks_rng: Rng,
    /// `SIM_SMALL=1`: every start's segments this small (a record or
    /// three each), whatever other limits it draws, so that frames a
    /// compaction moves land in segments of their own, which garbage
    /// collection can take apart from what they must outlive.
    small_segments: Option<u64>,
    /// Stores whose ack was sent and not confirmed: (message, engine id).
    sent_acks: Vec<(usize, u64)>,
    limits: Limits,
    /// Draws of [`Limits`], from a stream of their own.
    limits_rng: Rng,
    /// The ledger's room for owed frames (`WalConfig::owed_frames`), drawn
    /// with new limits from a stream of its own (so that the other draws,
    /// and the seeds found before it, stay as they were): a small one
    /// overflows, and a change remakes the ledger at a start.
    owed_frames: usize,
    owed_rng: Rng,
    /// No draws of `owed_frames`: a run found before they existed.
    owed_frames_fixed: bool,
    /// Stored deliveries whose ack is in doubt: (message, whether it was
    /// sent; one never sent is certainly redelivered after a crash).
    in_doubt: Vec<(usize, bool)>,
    /// Every engine id a store answered: they are WAL seqs, never reused
    /// (a reused one collides with what the far tier or a tombstone holds).
    ids: HashSet<u64>,
    /// `ROUTES[1]` never spills (`FarSettings::near_only`).
    near_only: bool,
    /// A full disk of scope `Both` is one that filled up: as large as what
    /// is on it, the reserve and a little slack ([`SimFs::set_capacity`]),
    /// and it stays that large to the end, which must still empty it.
    /// Otherwise it refuses every write ([`SimFs::set_full`]).
    fills_up: bool,
    /// The disk filled up (see `fills_up`) and has not had room since.
    filled_up: bool,
    /// The latest the clock has been: a message due by then may have been
    /// handed out, failed, and wait for a retry at a time the model does
    /// not know (and a listing shows, and a purge matches, that time).
    clock_high: u64,
    full: Option<Scope>,
    sync_fault: bool,
    /// Failed syncs the last check saw (see `after_op`).
    failed_syncs: u64,
    /// Remembered frames the engines that ended so far still owed.
    remembered_dropped: std::collections::HashSet<u128>,
    /// What is known of the acks of each group of byte-equal messages
    /// (see [`Sim::check_copy_of_settled`]).
    acks: AckBook,
    /// Far rounds and compactions failed since the disk had room again.
    failed_since_space: u32,
    next_uid: u64,
    /// The source's channel session: a new one at every start.
    session: u64,
    /// Message -> (the id it was released under, the process then): see
    /// `release_on`.
    released: HashMap<usize, (u128, u32)>,
    /// Id -> the process that stored it (counted by `report.restarts`).
    stored_in: std::collections::HashMap<u128, u32>,
    /// Draws the operations do not carry (deliveries in the dead process's
    /// socket, redeliveries' acks in doubt), from a stream of their own so
    /// that the operations of a seed stay what they were.
    aside: Rng,
    step: usize,
    trace: std::collections::hash_map::DefaultHasher,
    report: Report,
}

/// Limits a start takes (`SIM_LIMITS=1` draws others at restarts).
#[derive(Debug, Clone, Copy)]
struct Limits {
    segment_bytes: u64,
    max_message_bytes: u32,
    compact_below: f64,
    load_chunk: usize,
}

impl Default for Limits {
    /// Small segments, compacted eagerly: many rotations and copies (a
    /// Done moved past a record is how a load that kept an old id loses a
    /// message). A far load reads a few messages at once, so that loads
    /// go chunk by chunk.
    fn default() -> Self {
        Limits {
            segment_bytes: 1024,
            max_message_bytes: 16 << 20,
            compact_below: 0.8,
            load_chunk: LOAD_CHUNK,
        }
    }
}

impl Limits {
    fn draw(rng: &mut Rng) -> Self {
        Limits {
            segment_bytes: [512, 1024, 4096][rng.below(3) as usize],
            // Below a padded message, a quarter of the time.
            max_message_bytes: match rng.below(4) {
                0 => 300,
                _ => 16 << 20,
            },
            compact_below: [0.5, 0.8][rng.below(2) as usize],
            load_chunk: [LOAD_CHUNK, 1024][rng.below(2) as usize],
        }
    }
}

/// A seed's small segment size (`SIM_SMALL=1`), from a stream of its own
/// so that the other draws stay as they were.
fn small_segment_bytes(seed: u64) -> u64 {
    [160, 256, 384][seeded(seed ^ 0x05a1_15e6).below(3) as usize]
}

/// With `SIM_LIMITS=1`: one body in four padded to 200-399 more bytes.
fn padding(body: u16) -> usize {
    match body % 4 {
        0 => 200 + (usize::from(body) * 7) % 200,
        _ => 0,
    }
}

fn sim_key(message: &[u8]) -> Option<&[u8]> {
    let end = message.iter().position(|&b| b == b'|')?;
    (end > 0).then(|| &message[..end])
}

impl Sim {
    pub fn new(seed: u64) -> Self {
        let mut rng = seeded(seed.wrapping_mul(31).wrapping_add(7));
        let horizon = HORIZONS[rng.below(HORIZONS.len() as u64) as usize];
        // Half the seeds keep one route out of the far tier: its records
        // stay in their segments, so a segment a spill retired from can
        // outlive the spill's Done, which compaction then copies.
        let near_only = rng.chance(50);
        // From the seed, not the draw: the seeds that do not fill up run
        // as they did before the capacity model.
        let fills_up = seeded(seed ^ 0x5eed_f111).chance(50);
        Sim {
            seed,
            rng,
            near_only,
            fills_up,
            filled_up: false,
            fs: SimFs::with_dir(DIR),
            clock: Arc::new(ManualClock::new(T0)),
            horizon,
            node: None,
            sink: Arc::default(),
            model: Model::default(),
            broker: VecDeque::new(),
            socket: Vec::new(),
            socket_on: std::env::var_os("SIM_SOCKET").is_some_and(|v| v == "1"),
            release_on: std::env::var_os("SIM_RELEASE").is_some_and(|v| v == "1"),
            limits_on: std::env::var_os("SIM_LIMITS").is_some_and(|v| v == "1"),
            late_acks_on: std::env::var_os("SIM_ACKS").is_some_and(|v| v == "1"),
            late_acks_rng: seeded(seed ^ 0x1a7e_ac25),
            small_segments: std::env::var_os("SIM_SMALL")
                .is_some_and(|v| v == "1")
                .then(|| small_segment_bytes(seed)),
            sent_acks: Vec::new(),
            limits: Limits::default(),
            limits_rng: seeded(seed ^ 0x0111_1175),
            owed_frames: crate::wal::ledger::DEFAULT_FRAMES,
            owed_rng: seeded(seed ^ 0x0ed_f4a3e5),
            owed_frames_fixed: false,
            in_doubt: Vec::new(),
            ids: HashSet::new(),
            clock_high: T0,
            full: None,
            sync_fault: false,
            failed_since_space: 0,
            failed_syncs: 0,
            remembered_dropped: Default::default(),
            acks: AckBook::default(),
            next_uid: 0,
            session: 0,
            released: Default::default(),
            stored_in: Default::default(),
            aside: seeded(seed ^ 0x5e55_10a5),
            step: 0,
            trace: Default::default(),
            report: Report {
                seed,
                ..Report::default()
            },
        }
    }

    /// Deliveries may wait unread in the socket (see `socket_on`).
    pub fn with_socket(mut self) -> Self {
        self.socket_on = true;
        self
    }

    /// The route may move away (see `release_on`).
    pub fn with_release(mut self) -> Self {
        self.release_on = true;
        self
    }

    /// Starts may come with other limits (see `limits_on`).
    pub fn with_limits(mut self) -> Self {
        self.limits_on = true;
        self
    }

    pub fn with_late_acks(mut self) -> Self {
        self.late_acks_on = true;
        self
    }

    /// Small segments at every start (see `small_segments`).
    pub fn with_small_segments(mut self) -> Self {
        self.small_segments = Some(small_segment_bytes(self.report.seed));
        self
    }

    /// The ledger of owed frames keeps its default size at every start.
    pub fn with_default_ledger(mut self) -> Self {
        self.owed_frames_fixed = true;
        self
    }

    /// With `limits_on`, half the starts after the first take new limits,
    /// as a redeploy with a changed config would.
    fn maybe_change_limits(&mut self) {
        if !self.limits_on || !self.limits_rng.chance(50) {
            return;
        }
        self.limits = Limits::draw(&mut self.limits_rng);
        self.near_only = self.limits_rng.chance(50);
        if !self.owed_frames_fixed {
            self.owed_frames =
                [1, 2, crate::wal::ledger::DEFAULT_FRAMES][self.owed_rng.below(3) as usize];
        }
        let (limits, near_only) = (self.limits, self.near_only);
        self.note(("limits", format!("{limits:?}"), near_only, self.owed_frames));
    }

    fn fail(&self, what: impl Into<String>) -> Failure {
        Failure {
            seed: self.seed,
            step: self.step,
            what: what.into(),
        }
    }

    fn note(&mut self, event: impl Hash + std::fmt::Debug) {
        if std::env::var_os("SIM_TRACE").is_some() {
            eprintln!("trace {} {event:?}", self.step);
        }
        event.hash(&mut self.trace);
    }

    /// Shown with `SIM_TRACE` but not hashed: engine ids (WAL seqs) depend
    /// on when the dispatcher's Dones were appended, within one operation.
    fn show(&self, event: impl std::fmt::Debug) {
        if std::env::var_os("SIM_TRACE").is_some() {
            eprintln!("trace {}   {event:?}", self.step);
        }
    }

    /// With `SIM_TRACE`: the files on the simulated disk before each step
    /// and each drain round.
    fn trace_disk(&self, op: &dyn std::fmt::Debug) {
        if std::env::var_os("SIM_TRACE").is_none() {
            return;
        }
        use crate::wal::fs::FileSystem;
        let dir = Path::new(DIR);
        let files: Vec<_> = [dir.to_path_buf(), dir.join("far")]
            .iter()
            .flat_map(|d| self.fs.list(d).unwrap_or_default())
            .map(|p| {
                let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
                (name.unwrap_or_default(), self.fs.file_len(&p))
            })
            .collect();
        eprintln!(
            "trace {} {op:?} on {} bytes: {files:?}",
            self.step,
            self.fs.used_bytes()
        );
    }

    /// A failure under a fault, hashed without its text: which of two
    /// errors a crash surfaces first (the I/O error, or "the WAL is
    /// stopped") depends on the writer thread's timing.
    fn note_error(&mut self, what: &'static str, e: &dyn std::fmt::Display) {
        self.note(what);
        self.show(e.to_string());
    }

    fn faulty(&self) -> bool {
        self.full.is_some() || self.filled_up || self.sync_fault || self.fs.is_frozen()
    }

    fn near_only_routes(&self) -> HashSet<String> {
        match self.near_only {
            true => HashSet::from([ROUTES[1].to_owned()]),
            false => HashSet::new(),
        }
    }

    fn config(&self) -> EngineConfig {
        let mut wal = WalConfig::new(DIR);
        wal.fs = Arc::new(self.fs.clone());
        wal.segment_bytes = self.small_segments.unwrap_or(self.limits.segment_bytes);
        wal.compact_below = self.limits.compact_below;
        wal.max_message_bytes = self.limits.max_message_bytes;
        wal.lazy_done_wait = Duration::ZERO;
        wal.reserve_bytes = RESERVE as u64;
        wal.owed_frames = self.owed_frames;
        // One record per batch: which records share a group commit depends
        // on threads' timing, and the frames it adds (a Commit per batch)
        // would move every later seq, segment and compaction.
        wal.max_batch_bytes = 1;
        let far = (self.horizon > 0).then(|| FarSettings {
            horizon: Duration::from_millis(self.horizon),
            near_only: self.near_only_routes(),
            spill: true,
            load_chunk_bytes: self.limits.load_chunk,
        });
        EngineConfig {
            max_in_flight: 64,
            overdue_rate: 0,
            retry_initial: Duration::from_millis(100),
            retry_max: Duration::from_millis(2_000),
            dedup_window: 1_000,
            gc_interval: Duration::from_secs(3600),
            key_of: sim_key,
            far: far.or_else(|| {
                // Spilling off: what the tier holds still loads.
                Some(FarSettings {
                    horizon: Duration::from_millis(HORIZONS[1]),
                    near_only: HashSet::new(),
                    spill: false,
                    load_chunk_bytes: self.limits.load_chunk,
                })
            }),
            background_rounds: false,
            ..EngineConfig::new(wal)
        }
    }

    /// Start the engine if it is down; `Ok(false)` if it cannot start
    /// while a fault lasts.
    async fn ensure_started(&mut self) -> Result<bool, Failure> {
        if self.node.is_some() {
            return Ok(true);
        }
        // The last process's tasks let go of the directory lock as they
        // wind down.
        let started = Instant::now();
        let opened = loop {
            match Engine::open(self.config(), self.clock.clone()) {
                Err(crate::engine::EngineError::Wal(crate::wal::WalError::Locked { .. }))
                    if started.elapsed() < SETTLE_LIMIT =>
                {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                other => break other,
            }
        };
        match opened {
            Ok((engine, report)) => {
                if !report.corruptions.is_empty() {
                    return Err(self.fail(format!(
                        "recovery found corruption: {:?}",
                        report.corruptions
                    )));
                }
                let shutdown = CancellationToken::new();
                let task = {
                    let engine = engine.clone();
                    let sink: Arc<dyn Dispatch> = self.sink.clone();
                    let shutdown = shutdown.clone();
                    tokio::spawn(
                        async move { engine.run(sink, shutdown, Duration::from_secs(1)).await },
                    )
                };
                self.node = Some(Node {
                    engine,
                    shutdown,
                    task,
                });
                self.report.restarts += 1;
                self.session += 1;
                self.note(("start", self.horizon));
                Ok(true)
            }
            Err(e) if self.faulty() => {
                // A start that failed is a process that exited.
                self.failed_syncs = self.fs.failed_syncs();
                self.note_error("start refused under a fault", &e);
                Ok(false)
            }
            Err(e) => Err(self.fail(format!("cannot start: {e}"))),
        }
    }

    fn engine(&self) -> Option<Engine> {
        self.node.as_ref().map(|n| n.engine.clone())
    }

    /// The process ends as `loss` says; what was in doubt is settled by
    /// the broker.
    async fn kill(&mut self, loss: Loss) {
        let power = match loss {
            Loss::Process => PowerLoss::ProcessCrash,
            Loss::Unsynced => PowerLoss::DropUnsynced,
            Loss::Torn => PowerLoss::Torn {
                seed: self.rng.next(),
            },
        };
        // The disk first: nothing the old process still does reaches it.
        self.fs = self.fs.power_loss(power);
        self.acks.kill();
        self.sent_acks.clear();
        if let Some(node) = self.node.take() {
            self.remembered_dropped
                .extend(node.engine.frames_owed().iter().map(|id| id.as_u128()));
            node.shutdown.cancel();
            node.task.abort();
            let _ = node.task.await;
        }
        self.sync_fault = false;
        // The process a failed sync belonged to is gone.
        self.failed_syncs = self.fs.failed_syncs();
        // An ack never sent is certainly redelivered; one sent, perhaps.
        for (msg, sent) in std::mem::take(&mut self.in_doubt) {
            let coin = self.rng.chance(50);
            if !sent || coin {
                self.broker.push_back((msg, true));
            }
        }
        // Deliveries the broker had sent to the dead process, unread in its
        // socket, come back marked redelivered.
        self.requeue_socket();
        self.note(("kill", format!("{loss:?}")));
    }

    /// The route moves away (release mode): the source's channel closes
    /// while the process lives on. The deliveries whose ack was in doubt
    /// come back to the broker, marked redelivered (one never sent
    /// certainly, one sent perhaps), and so does what was unread; the next
    /// channel is a new session.
    fn channel_closed(&mut self) {
        self.acks.doubt_ends();
        self.sent_acks.clear();
        for (msg, sent) in std::mem::take(&mut self.in_doubt) {
            if !sent || self.aside.chance(50) {
                self.broker.push_back((msg, true));
            }
        }
        self.requeue_socket();
        self.session += 1;
        self.note(("channel closed", self.session));
    }

    /// The process ended: what it had not read goes back to the broker,
    /// marked redelivered.
    fn requeue_socket(&mut self) {
        for msg in std::mem::take(&mut self.socket) {
            self.broker.push_back((msg, true));
        }
    }

    async fn stop_cleanly(&mut self) {
        self.requeue_socket();
        // The stop flushes the lazy marks, unless a fault is in the way.
        if !self.faulty() && !self.fs.crash_armed() {
            self.acks.clean_stop();
        }
        if let Some(node) = self.node.take() {
            self.remembered_dropped
                .extend(node.engine.frames_owed().iter().map(|id| id.as_u128()));
            node.shutdown.cancel();
            let _ = node.task.await;
            let _ = node.engine.close().await;
        }
        self.failed_syncs = self.fs.failed_syncs();
        // A clean stop gets its acks through.
        self.in_doubt.clear();
        self.sent_acks.clear();
    }

    /// The broker confirms the oldest ack in doubt that was sent: its
    /// record's mark is written now (late, perhaps after a compaction
    /// copied it), and the delivery is redelivered no more.
    fn confirm_late_ack(&mut self) {
        let Some(engine) = self.engine() else {
            return;
        };
        if self.sent_acks.is_empty() {
            return;
        }
        let (msg, id) = self.sent_acks.remove(0);
        if let Some(at) = self.in_doubt.iter().position(|&(m, sent)| m == msg && sent) {
            self.in_doubt.remove(at);
        }
        engine.confirm_ack(id);
        let m = &self.model.msgs[msg];
        let group = (m.route, m.bytes.clone());
        if self.faulty() || self.fs.crash_armed() {
            // Its mark, written now, may fail (and is not written again).
            self.acks.unsettled.insert(group.clone());
        }
        self.acks.confirmed_late(group);
        self.note(("ack confirmed late", msg));
    }

    /// A redelivery of `msg` was stored as a copy under `kept`, the id of
    /// a byte-equal message: that message's record must be in doubt. Not
    /// if every store of the group had its ack confirmed and a clean stop
    /// since made the marks durable: a restart reads them back settled.
    /// (A compaction copy written without its mark came back in doubt,
    /// 2026-12-07.)
    fn check_copy_of_settled(
        &mut self,
        msg: usize,
        kept: u128,
        group: &Group,
    ) -> Result<(), Failure> {
        let own = self.model.owners(kept).contains(&msg);
        if !own && self.acks.is_settled(group) {
            return Err(self.fail(format!(
                "message {msg} was stored as a copy under {kept:#x}, a byte-equal message whose \
                 ack was confirmed and marked durably (a clean stop since, no disk fault)"
            )));
        }
        Ok(())
    }

    /// After a restart (clean, or after a kill): no record of a settled group (see
    /// [`AckBook`]) is read back in doubt. The same rule as
    /// [`Sim::check_copy_of_settled`], without waiting for a twin to show
    /// it.
    fn check_settled_read_back(&mut self) -> Result<(), Failure> {
        let Some(engine) = self.engine() else {
            return Ok(());
        };
        let in_doubt = self.model.msgs.iter().enumerate().find_map(|(i, m)| {
            let group = (m.route, m.bytes.clone());
            if !self.acks.is_settled(&group) {
                return None;
            }
            m.uids
                .iter()
                .find(|&&uid| engine.has_candidate(MessageId::from_u128(uid)))
                .map(|&uid| (i, uid))
        });
        match in_doubt {
            Some((i, uid)) => Err(self.fail(format!(
                "message {i} (id {uid:#x}) was read back in doubt at a restart, though every \
                 store of its bytes had its ack confirmed and marked durably"
            ))),
            None => Ok(()),
        }
    }

    fn uid(&mut self) -> MessageId {
        self.next_uid += 1;
        MessageId::from_u128((u128::from(self.seed) << 64) | u128::from(self.next_uid))
    }

    /// Hand `msg` to the engine as the broker would.
    async fn deliver(
        &mut self,
        msg: usize,
        redelivered: bool,
        ack_in_doubt: bool,
    ) -> Result<(), Failure> {
        let Some(engine) = self.engine() else {
            self.broker.push_back((msg, redelivered));
            return Ok(());
        };
        let uid = self.uid();
        let m = &self.model.msgs[msg];
        let (route, due, bytes) = (m.route, m.due, m.bytes.clone());
        let bytes_len = bytes.len();
        // May reach the disk even if the store fails.
        self.model.stored(msg, uid.as_u128(), self.session);
        let arrival = Arrival {
            redelivered,
            session: self.session,
        };
        let group = (route, bytes.clone());
        match engine.store(route, due, uid, bytes, arrival).await {
            Ok(stored @ (Stored::New(id) | Stored::Copy { id, .. })) => {
                if !self.ids.insert(id) {
                    return Err(self.fail(format!("engine id {id} was handed out twice")));
                }
                if let (Stored::New(_), true) = (stored, redelivered) {
                    self.check_not_forgotten(msg)?;
                }
                let kept = match stored {
                    Stored::Copy { uid, .. } => uid,
                    _ => uid,
                };
                self.stored_in
                    .entry(kept.as_u128())
                    .or_insert(self.report.restarts);
                if let Stored::Copy { uid: kept, .. } = stored {
                    self.check_copy_of_settled(msg, kept.as_u128(), &group)?;
                    self.model
                        .stored_as(msg, uid.as_u128(), kept.as_u128(), self.session);
                    self.show(("copy of", kept.as_u128(), "engine id", id));
                }
                self.model.msgs[msg].acked = true;
                if ack_in_doubt {
                    // Sent, or not yet (half of them, drawing nothing).
                    let sent = id % 2 == 0;
                    if sent {
                        engine.ack_sending(id);
                        self.sent_acks.push((msg, id));
                        self.acks.sent(group);
                    } else {
                        self.acks.unsettled.insert(group);
                    }
                    self.in_doubt.push((msg, sent));
                } else {
                    engine.ack_sending(id);
                    engine.confirm_ack(id);
                    self.acks.confirmed_now(group);
                }
                self.note(("stored", msg, redelivered));
            }
            Ok(Stored::Duplicate) => {
                // The record it matched stands for this delivery now.
                self.acks.unsettled.insert(group);
                self.model.msgs[msg].acked = true;
                self.model.msgs[msg].duplicate_on.push(self.session);
                self.model.msgs[msg].stored_on.remove(&uid.as_u128());
                if ack_in_doubt {
                    // A duplicate is acked like any delivery, and that ack
                    // can be lost too (drawing nothing).
                    let sent = (msg as u64 + self.session).is_multiple_of(2);
                    self.in_doubt.push((msg, sent));
                }
                self.note(("duplicate", msg));
            }
            Err(crate::engine::EngineError::Wal(crate::wal::WalError::TooLarge { .. })) => {
                // Refused for good: the intake sends it to the invalid
                // destination. A copy stored under a larger limit is still
                // owed (`acked` stays as it was).
                if bytes_len <= self.limits.max_message_bytes as usize {
                    return Err(self.fail(format!(
                        "a message of {bytes_len} bytes was refused under a limit of {}",
                        self.limits.max_message_bytes
                    )));
                }
                self.note(("refused as too large", msg));
            }
            Err(e) => {
                if !self.faulty() {
                    return Err(self.fail(format!("a store failed with no fault: {e}")));
                }
                self.model.msgs[msg].failed_store = true;
                // It may be on disk, unmarked, under a sibling's id.
                self.acks.unsettled.insert(group);
                self.broker.push_back((msg, true));
                self.note(("store failed", msg));
            }
        }
        Ok(())
    }

    pub async fn play(mut self, ops: &[Op]) -> Result<Report, Failure> {
        self.ensure_started().await?;
        for (step, op) in ops.iter().enumerate() {
            self.step = step;
            self.trace_disk(op);
            self.apply(op).await?;
            self.after_op().await?;
        }
        self.step = ops.len();
        self.finish().await?;
        self.report.ops = ops.len();
        self.report.messages = self.model.msgs.len();
        self.report.fires = self.model.fires;
        (self.report.same_id_copies, self.report.other_id_copies) = self.model.duplicates();
        self.check_one_identity()?;
        self.report.trace = self.trace.finish();
        Ok(self.report)
    }

    /// A message with no byte-equal twin fires under one id. The one way
    /// allowed around it: an engine ended while a full disk still kept it
    /// from writing a Remembered frame that the ledger of owed frames did
    /// not hold either (`Engine::frames_owed`: past the ledger's size, or
    /// no ledger), so a restart forgot a message that had left, and its
    /// late redelivery was stored as new. The same goes for a message whose cancel was
    /// answered: it never fires, under any id, but for that way.
    fn check_one_identity(&mut self) -> Result<(), Failure> {
        let lone = self.model.lone_other_id_copies();
        self.report.frames_forgotten = self.remembered_dropped.len() as u64;
        self.report.lone_other_id_copies = lone
            .iter()
            .map(|&i| self.model.msgs[i].fired.len() as u64 - 1)
            .sum();
        let forgotten = |i: &usize| {
            self.model.msgs[*i]
                .uids
                .iter()
                .any(|uid| self.remembered_dropped.contains(uid))
        };
        if let Some(i) = lone.into_iter().find(|i| !forgotten(i)) {
            let m = &self.model.msgs[i];
            return Err(self.fail(format!(
                "message {i} ({} due {}, no byte-equal twin) fired under {} ids: {:?}",
                m.route,
                m.due,
                m.fired.len(),
                m.fired
            )));
        }
        let after_cancel = self.model.fired_after_their_cancel();
        if let Some(i) = after_cancel.into_iter().find(|i| !forgotten(i)) {
            let m = &self.model.msgs[i];
            return Err(self.fail(format!(
                "message {i} ({} due {}, no byte-equal twin) fired under {:?} after a cancel of its ids {:?} was answered",
                m.route,
                m.due,
                m.fired,
                m.cancel_answered.as_deref().unwrap_or_default()
            )));
        }
        Ok(())
    }

    async fn apply(&mut self, op: &Op) -> Result<(), Failure> {
        let was_down = self.node.is_none();
        if !matches!(op, Op::Kill { .. } | Op::Restart { .. }) && !self.ensure_started().await? {
            // Down until a fault clears: faults and the clock still move.
            if !matches!(
                op,
                Op::DiskSpace | Op::DiskFull { .. } | Op::Clock { .. } | Op::Deliver { .. }
            ) {
                return Ok(());
            }
        }
        if was_down && self.node.is_some() {
            // Started just now: what fell due meanwhile goes out first.
            self.settle().await?;
            self.check_fired()?;
        }
        match *op {
            Op::Deliver {
                route,
                key,
                body,
                delay_ms,
                twin,
                ack_in_doubt,
            } => {
                let route = ROUTES[route as usize % ROUTES.len()];
                let due = self.clock.now_ms() + delay_ms;
                let earlier: Vec<usize> = (0..self.model.msgs.len())
                    .filter(|&i| self.model.msgs[i].route == route)
                    .collect();
                let (key, bytes) = match twin {
                    Some(pick) if !earlier.is_empty() => {
                        let m = &self.model.msgs[earlier[pick as usize % earlier.len()]];
                        (m.key, m.bytes.clone())
                    }
                    _ => {
                        let key = (key > 0).then_some(key);
                        let k = key.map_or(String::new(), |k| format!("k{k}"));
                        let pad = if self.limits_on { padding(body) } else { 0 };
                        let bytes = format!("{k}|body-{body}{}", "~".repeat(pad));
                        (key, bytes.into_bytes())
                    }
                };
                let msg = self.model.add(route, key, bytes, due);
                if self.socket_on && self.node.is_some() && self.aside.chance(10) {
                    // Not read yet: a crash now sends it back redelivered.
                    self.socket.push(msg);
                } else {
                    self.deliver(msg, false, ack_in_doubt).await?;
                }
            }
            Op::Redeliver => {
                for msg in std::mem::take(&mut self.socket) {
                    self.deliver(msg, false, false).await?;
                }
                if let Some((msg, redelivered)) = self.broker.pop_front() {
                    // Its ack may be in flight when the next crash comes.
                    let ack_in_doubt = self.aside.chance(30);
                    self.deliver(msg, redelivered, ack_in_doubt).await?;
                }
            }
            Op::Cancel { pick } => self.cancel(pick).await?,
            Op::CancelKey { route, key } => {
                let Some(engine) = self.engine() else {
                    return Ok(());
                };
                let route = ROUTES[route as usize % ROUTES.len()];
                let k = format!("k{key}");
                match engine.cancel_by_key(route, k.as_bytes()).await {
                    Ok(ids) => {
                        self.model
                            .cancel_where(|m| m.route == route && m.key == Some(key));
                        self.note(("cancel key", route, key, ids.len()));
                    }
                    Err(e) if self.faulty() => {
                        self.model
                            .maybe_cancel_where(|m| m.route == route && m.key == Some(key));
                        self.note_error("cancel key failed", &e);
                    }
                    Err(e) => {
                        return Err(self.fail(format!("cancel by key failed with no fault: {e}")))
                    }
                }
            }
            Op::Purge {
                route,
                from_ms,
                width_ms,
            } => {
                let Some(engine) = self.engine() else {
                    return Ok(());
                };
                let route = ROUTES[route as usize % ROUTES.len()];
                let from = self.clock.now_ms() + from_ms;
                let to = from + width_ms;
                let high = self.clock_high;
                match engine.purge(route, Some(from), Some(to), false).await {
                    Ok(count) => {
                        self.model.cancel_where(|m| {
                            m.route == route && (from..=to).contains(&m.due) && m.due > high
                        });
                        // Matched by a retry's time, or not.
                        self.model
                            .maybe_cancel_where(|m| m.route == route && m.due <= high);
                        self.note(("purge", count.purged, count.in_flight));
                    }
                    Err(e) if self.faulty() => {
                        self.model.maybe_cancel_where(|m| {
                            m.route == route && ((from..=to).contains(&m.due) || m.due <= high)
                        });
                        self.note_error("purge failed", &e);
                    }
                    Err(e) => return Err(self.fail(format!("purge failed with no fault: {e}"))),
                }
            }
            Op::Clock { ms } => {
                if self.late_acks_on && self.late_acks_rng.chance(40) {
                    self.confirm_late_ack();
                }
                let now = self.clock.now_ms();
                self.clock.set(now.saturating_add_signed(ms));
                self.clock_high = self.clock_high.max(self.clock.now_ms());
                if let Some(engine) = self.engine() {
                    engine.wake();
                }
                self.note(("clock", ms));
            }
            Op::FarRound => {
                if let Some(engine) = self.engine() {
                    let outcome = engine.far_round().await.map_err(|e| e.to_string());
                    self.round_outcome("far round", outcome)?;
                }
            }
            Op::Compact => {
                if let Some(engine) = self.engine() {
                    let outcome = engine.compact_now().await.map_err(|e| e.to_string());
                    self.round_outcome("compaction", outcome)?;
                }
            }
            Op::PublishFails { n } => {
                if self.release_on && self.aside.chance(50) {
                    self.sink
                        .release_next
                        .store(u32::from(n), Ordering::Release);
                    self.channel_closed();
                } else {
                    self.sink.fail_next.store(u32::from(n), Ordering::Release);
                }
            }
            Op::Kill { loss } => {
                self.kill(loss).await;
                self.maybe_change_limits();
                if self.ensure_started().await? {
                    self.check_settled_read_back()?;
                }
            }
            Op::Restart { horizon } => {
                self.stop_cleanly().await;
                self.horizon = HORIZONS[horizon as usize % HORIZONS.len()];
                self.maybe_change_limits();
                if self.ensure_started().await? {
                    self.check_settled_read_back()?;
                }
            }
            Op::CrashAfter { n } => {
                self.fs.crash_after(u64::from(n));
                self.acks.fault();
                self.report.faults += 1;
            }
            Op::DiskFull { scope: Scope::Both } if self.fills_up => {
                // Sized as if the reserve were on it, whether or not it is
                // now: else the filler would have taken the reserve's room.
                let reserve = self.fs.file_len(&Path::new(DIR).join("reserve"));
                let slack = self.rng.below(3 * RESERVE as u64) as usize;
                let size = self.fs.used_bytes() - reserve + RESERVE + slack;
                self.fs.set_capacity(Some(size));
                self.filled_up = true;
                self.acks.fault();
                self.report.faults += 1;
                self.note(("fills up", slack));
            }
            Op::DiskFull { scope } => {
                let dirs = match scope {
                    Scope::Wal => vec![wal_files()],
                    Scope::Far => vec![PathBuf::from(DIR).join("far")],
                    Scope::Both => vec![PathBuf::from(DIR)],
                };
                self.fs.set_full(dirs);
                self.full = Some(scope);
                self.acks.fault();
                self.report.faults += 1;
                self.note(("full", format!("{scope:?}")));
            }
            Op::DiskSpace => {
                let filled_up = std::mem::take(&mut self.filled_up);
                if self.full.take().is_some() || filled_up {
                    self.fs.set_full(Vec::new());
                    self.fs.set_capacity(None);
                    self.failed_since_space = 0;
                    self.note("space");
                }
            }
            Op::SyncFails => {
                self.fs.fail_next_sync();
                self.sync_fault = true;
                self.acks.fault();
                self.report.faults += 1;
            }
        }
        Ok(())
    }

    /// A far round or a compaction: it may fail under a fault, and must
    /// succeed again within [`RECOVERY_ROUNDS`] once the fault is gone.
    fn round_outcome(&mut self, what: &str, outcome: Result<(), String>) -> Result<(), Failure> {
        match outcome {
            Ok(()) => {
                self.failed_since_space = 0;
                self.note((what, "ok"));
            }
            Err(e) if self.faulty() => {
                self.note((what, "failed under a fault"));
                self.show(e);
            }
            Err(e) => {
                self.failed_since_space += 1;
                if self.failed_since_space > RECOVERY_ROUNDS {
                    return Err(self.fail(format!(
                        "{what} still fails {} rounds after the disk had room again: {e}",
                        self.failed_since_space
                    )));
                }
                self.note((what, "failed after a fault"));
                self.show(e);
            }
        }
        Ok(())
    }

    async fn cancel(&mut self, pick: u32) -> Result<(), Failure> {
        let Some(engine) = self.engine() else {
            return Ok(());
        };
        let uids: Vec<u128> = self
            .model
            .msgs
            .iter()
            .flat_map(|m| m.uids.clone())
            .collect();
        if uids.is_empty() {
            return Ok(());
        }
        let uid = uids[pick as usize % uids.len()];
        let found = match engine.find_by_uid(MessageId::from_u128(uid)) {
            Ok(found) => found,
            Err(e) if self.faulty() => {
                self.note_error("lookup failed", &e);
                return Ok(());
            }
            Err(e) => return Err(self.fail(format!("lookup by id failed with no fault: {e}"))),
        };
        let Some(id) = found else {
            self.note(("cancel: not pending", uid));
            return Ok(());
        };
        let cancelled = match engine.cancel(id).await {
            // And any other record under that identity (see
            // `Engine::cancel_all_of`).
            Ok(true) => engine
                .cancel_all_of(MessageId::from_u128(uid))
                .await
                .map(|_| true),
            other => other,
        };
        match cancelled {
            Ok(true) => {
                self.model.cancel_uid(uid);
                self.note(("cancelled", uid));
                self.show(("engine id", id));
            }
            // Nothing was in flight or fired in between: the lookup just
            // found it pending, so it must be cancellable.
            Ok(false) => {
                return Err(self.fail(format!(
                    "a cancel of id {uid:032x} said unknown right after its lookup found it pending"
                )))
            }
            Err(e) if self.faulty() => {
                self.model.maybe_cancel_uid(uid);
                self.note_error("cancel failed", &e);
            }
            Err(e) => return Err(self.fail(format!("cancel failed with no fault: {e}"))),
        }
        Ok(())
    }

    /// After each operation: the engine settles (everything due at the
    /// clock's now handed out) and what it handed out is checked; a process
    /// whose disk froze or whose log stopped dies and restarts, and settles
    /// again.
    async fn after_op(&mut self) -> Result<(), Failure> {
        for _ in 0..8 {
            self.check_limits()?;
            if !self.check_alive().await? {
                continue;
            }
            self.settle().await?;
            self.check_fired()?;
            if self.check_alive().await? {
                return Ok(());
            }
        }
        Err(self.fail("the engine kept failing after restarts with no fault left"))
    }

    /// What the engine may never do whatever the faults: hold more than a
    /// chunk in a load, read corrupt frames in the far tier.
    fn check_limits(&self) -> Result<(), Failure> {
        // A load holds one chunk of messages at a time (and the last one
        // read may pass the limit).
        let peak = self.engine().map_or(0, |e| e.far_load_peak());
        let (chunk, longest) = match self.limits_on {
            true => (LOAD_CHUNK.max(self.limits.load_chunk), MAX_PADDED),
            false => (LOAD_CHUNK, MAX_MESSAGE),
        };
        if peak >= chunk + longest {
            return Err(self.fail(format!(
                "a far load held {peak} bytes of messages at once (chunks of {chunk})"
            )));
        }
        let corrupt = self.engine().map_or(0, |e| e.far_corrupt_frames());
        if corrupt > 0 {
            return Err(self.fail(format!("the far tier read {corrupt} corrupt frames")));
        }
        Ok(())
    }

    /// `Ok(false)` if the process had to die (its disk froze, its log
    /// stopped) and was restarted.
    async fn check_alive(&mut self) -> Result<bool, Failure> {
        let stopped =
            |node: &Option<Node>| node.as_ref().is_some_and(|n| n.engine.wal().is_stopped());
        let mut halted = stopped(&self.node);
        // An fsync failed: its pages may be gone while reads still see
        // them, so the process must stop (it never retries an fsync).
        if self.fs.failed_syncs() > self.failed_syncs && self.node.is_some() && !halted {
            // The WAL's writer thread stops the log just after its fsync
            // failed, and may not have yet: it has once it answered every
            // record sent to it (seed 1230 read the latch in between).
            let started = Instant::now();
            while !halted && started.elapsed() < SETTLE_LIMIT {
                let idle = self.engine().is_none_or(|e| e.wal().is_idle());
                halted = stopped(&self.node);
                if idle {
                    break;
                }
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
            if !halted {
                return Err(self.fail("an fsync failed and the engine carried on"));
            }
        }
        if self.fs.is_frozen() || halted {
            let loss = if self.rng.chance(50) {
                Loss::Torn
            } else {
                Loss::Unsynced
            };
            self.kill(loss).await;
            self.ensure_started().await?;
            return Ok(false);
        }
        Ok(true)
    }

    /// Wait until nothing due at the clock's now waits or is in flight.
    async fn settle(&mut self) -> Result<(), Failure> {
        let Some(engine) = self.engine() else {
            return Ok(());
        };
        engine.wake();
        let started = Instant::now();
        while !engine.settled() {
            if engine.wal().is_stopped() || self.fs.is_frozen() {
                return Ok(());
            }
            if started.elapsed() > SETTLE_LIMIT {
                return Err(self.fail("the engine did not hand out what was due within 20 s"));
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        Ok(())
    }

    fn check_fired(&mut self) -> Result<(), Failure> {
        let mut out = std::mem::take(&mut *self.sink.out.lock().expect("sink"));
        out.sort_by_key(|f| (f.uid.as_u128(), f.fired_ms));
        let released: HashSet<u128> =
            std::mem::take(&mut *self.sink.released.lock().expect("sink"));
        for f in &out {
            self.note(("fired", f.uid.as_u128(), f.fired_ms));
            self.show(("engine id", f.id));
            if let Err(what) = self.model.fired(f) {
                return Err(self.fail(what));
            }
            let uid = f.uid.as_u128();
            if released.contains(&uid) {
                for m in self.model.owners(uid) {
                    self.released.insert(m, (uid, self.report.restarts));
                    let msg = &self.model.msgs[m];
                    self.acks.unsettled.insert((msg.route, msg.bytes.clone()));
                }
            }
        }
        Ok(())
    }

    /// A redelivery of `msg` was stored under a new id: it must not be a
    /// message this process stored and released (the route moved; its next
    /// owner fires it under its id), which stays known to redelivery
    /// detection, unless a byte-equal message could have taken its record.
    /// (Across a restart it may be forgotten: an open hole, see
    /// docs/testing.md, "Open: copies under another id after a restart".)
    fn check_not_forgotten(&self, msg: usize) -> Result<(), Failure> {
        let Some(&(uid, process)) = self.released.get(&msg) else {
            return Ok(());
        };
        let now = self.report.restarts;
        if self.stored_in.get(&uid) != Some(&process) || process != now {
            return Ok(());
        }
        let m = &self.model.msgs[msg];
        let twins = self
            .model
            .msgs
            .iter()
            .enumerate()
            .any(|(j, t)| j != msg && t.route == m.route && t.bytes == m.bytes);
        if !twins {
            return Err(self.fail(format!(
                "message {msg}, released under id {uid:x} by this process, was redelivered and stored under a new id"
            )));
        }
        Ok(())
    }

    /// The faults go, the broker delivers what it holds, and the clock
    /// passes every due time: then everything owed must have fired, and
    /// nothing may come back after a restart.
    async fn finish(&mut self) -> Result<(), Failure> {
        self.fs.set_full(Vec::new());
        self.fs.cancel_crash();
        if self.fs.is_frozen() || self.sync_fault {
            self.kill(Loss::Unsynced).await;
        }
        self.full = None;
        if std::mem::take(&mut self.filled_up) {
            // The disk stays as small as it became: what was taken in must
            // still all leave, with no more room than the reserve's.
            self.failed_since_space = 0;
            self.ensure_started().await?;
            self.drain("on a disk full of its own files").await?;
            self.fs.set_capacity(None);
        }
        self.full = None;
        self.failed_since_space = 0;
        self.ensure_started().await?;
        for msg in std::mem::take(&mut self.socket) {
            self.deliver(msg, false, false).await?;
        }
        while let Some((msg, redelivered)) = self.broker.pop_front() {
            self.deliver(msg, redelivered, false).await?;
            self.after_op().await?;
        }
        self.drain("after every due time passed").await?;
        self.model.check_complete().map_err(|w| self.fail(w))?;
        // A clean restart brings nothing back.
        self.stop_cleanly().await;
        self.ensure_started().await?;
        self.settle().await?;
        self.check_fired()?;
        let back = self.engine().map_or(0, |e| e.pending());
        if back > 0 {
            return Err(self.fail(format!("{back} messages came back after a clean restart")));
        }
        self.stop_cleanly().await;
        Ok(())
    }

    /// Past every due time at once (a load takes every bucket the horizon
    /// reached), then on by the longest back-off until nothing is left.
    async fn drain(&mut self, when: &str) -> Result<(), Failure> {
        let last_due = self.model.msgs.iter().map(|m| m.due).max().unwrap_or(0);
        for _ in 0..50 {
            let engine = self.engine().ok_or_else(|| self.fail("down at the end"))?;
            let now = self.clock.now_ms();
            self.clock.set(now.max(last_due) + 3_000);
            // What the wheel holds fires before the round loads: a round
            // racing the engine's own firing made runs differ by timing.
            self.settle().await?;
            self.trace_disk(&("drain round", when));
            let outcome = engine.far_round().await.map_err(|e| e.to_string());
            self.round_outcome("far round", outcome)?;
            let outcome = engine.compact_now().await.map_err(|e| e.to_string());
            self.round_outcome("compaction", outcome)?;
            self.after_op().await?;
            if engine.pending() == 0 {
                return Ok(());
            }
        }
        let left = self.engine().map_or(0, |e| e.pending());
        Err(self.fail(format!("{left} messages still pending {when}")))
    }
}

/// The WAL's own files (segments sit in the WAL directory itself; the far
/// tier in its `far` subdirectory is spared by a full `Wal` scope).
fn wal_files() -> PathBuf {
    Path::new(DIR).join("wal-")
}
