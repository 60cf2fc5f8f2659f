//! A deterministic simulator of the engine, in the way of FoundationDB's
//! simulation and TigerBeetle's VOPR (tests only; `scripts/sim.sh`).
//!
//! One seed draws a list of operations ([`ops`]) and the driver
//! ([`driver`]) plays them, one at a time, against the real engine: the
//! WAL, the wheel, the far tier, redelivery detection, cancel by id and by
//! key, purge, compaction, spill and load, kill, power loss and restart.
//! Underneath are a [`ManualClock`](crate::engine::ManualClock) and
//! [`SimFs`](crate::wal::sim::SimFs), which forgets what was never synced
//! and can fill up, fail an fsync, or freeze between any two writes. The
//! broker is a model too: it redelivers what was not acked, and acks that
//! were in doubt at a crash.
//!
//! After every operation the engine is left to settle (everything due at
//! the clock's now handed to the sink) and a reference model ([`model`])
//! checks what came out: nothing early, nothing unknown, the bytes as
//! stored, nothing after an answered cancel. At the end, with the faults
//! gone and the clock past every due time, every acknowledged message that
//! was not cancelled must have fired under one of its own ids.
//!
//! Operations run one after another and every wait is for a condition, so
//! the same seed gives the same run: the trace hash in the [`Report`] is
//! checked by a test. A failure names its seed and the shortest list of
//! operations that still fails ([`shrink`]).

mod driver;
mod model;
mod ops;
#[cfg(test)]
mod tests;

pub use driver::Report;
pub use ops::Op;

/// A run that broke a guarantee.
#[derive(Debug, Clone)]
pub struct Failure {
    pub seed: u64,
    /// Index of the operation after which it was seen (`ops.len()`: at the end).
    pub step: usize,
    pub what: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "seed {} step {}: {}", self.seed, self.step, self.what)
    }
}

/// Operations drawn per seed.
pub const OPS_PER_SEED: usize = 120;

/// What a run may do beyond the default draw (each also turned on for
/// every run by its variable: `SIM_SOCKET=1`, `SIM_RELEASE=1`,
/// `SIM_LIMITS=1`, `SIM_ACKS=1`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Mode {
    /// Deliveries may wait unread in the process's socket.
    pub socket: bool,
    /// The route may move away while a message is published (the
    /// broker-kept store's `Outcome::Release`); a redelivery of a message
    /// released must keep its id.
    pub release: bool,
    /// Starts may come with other limits: segment size, largest message,
    /// compaction threshold, far load chunk, which route spills.
    pub limits: bool,
    /// An ack in doubt may be confirmed later, while the process lives
    /// (the broker's answer came after other work): its record's mark is
    /// then written late, perhaps after a compaction copied the record.
    pub late_acks: bool,
    /// Segments of a record or three (`SIM_SMALL=1`).
    pub small_segments: bool,
}

/// Play `ops` with randomness from `seed`.
pub fn run(seed: u64, ops: &[Op]) -> Result<Report, Failure> {
    run_in(seed, ops, Mode::default())
}

/// [`run`] with deliveries that may wait unread in the process's socket
/// (what `SIM_SOCKET=1` turns on for every run).
pub fn run_with_socket(seed: u64, ops: &[Op]) -> Result<Report, Failure> {
    let mode = Mode {
        socket: true,
        ..Mode::default()
    };
    run_in(seed, ops, mode)
}

/// [`run`] in `mode`.
pub fn run_in(seed: u64, ops: &[Op], mode: Mode) -> Result<Report, Failure> {
    run_on(driver::Sim::new(seed), ops, mode)
}

/// [`run_in`] with the ledger of owed frames at its default size at every
/// start: a run found before the simulator drew its size.
pub fn run_with_default_ledger(seed: u64, ops: &[Op], mode: Mode) -> Result<Report, Failure> {
    run_on(driver::Sim::new(seed).with_default_ledger(), ops, mode)
}

fn run_on(mut sim: driver::Sim, ops: &[Op], mode: Mode) -> Result<Report, Failure> {
    if mode.socket {
        sim = sim.with_socket();
    }
    if mode.release {
        sim = sim.with_release();
    }
    if mode.limits {
        sim = sim.with_limits();
    }
    if mode.late_acks {
        sim = sim.with_late_acks();
    }
    if mode.small_segments {
        sim = sim.with_small_segments();
    }
    block_on(sim.play(ops))
}

fn block_on<T>(run: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
        .block_on(run)
}

/// Draw the operations of `seed` and play them.
pub fn run_seed(seed: u64) -> Result<Report, Failure> {
    run(seed, &ops::draw(seed, OPS_PER_SEED))
}

/// The shortest list of operations found that still fails (delta
/// debugging: drop chunks, halving their size, while the run still fails).
pub fn shrink(seed: u64, ops: Vec<Op>) -> Vec<Op> {
    shrink_in(seed, ops, Mode::default())
}

/// [`shrink`] in `mode`.
pub fn shrink_in(seed: u64, mut ops: Vec<Op>, mode: Mode) -> Vec<Op> {
    let mut chunk = ops.len() / 2;
    while chunk >= 1 {
        let mut start = 0;
        while start < ops.len() {
            let mut fewer = ops.clone();
            fewer.drain(start..(start + chunk).min(ops.len()));
            if run_in(seed, &fewer, mode).is_err() {
                ops = fewer;
            } else {
                start += chunk;
            }
        }
        chunk /= 2;
    }
    ops
}

/// Run seeds `from..from + count` in `mode`; the first failure, shrunk.
pub fn run_seeds_in(from: u64, count: u64, mode: Mode) -> Result<Vec<Report>, (Failure, Vec<Op>)> {
    let mut reports = Vec::new();
    for seed in from..from + count {
        let ops = ops::draw(seed, OPS_PER_SEED);
        match run_in(seed, &ops, mode) {
            Ok(r) => reports.push(r),
            Err(f) => {
                let ops = shrink_in(seed, ops, mode);
                let f = run_in(seed, &ops, mode).err().unwrap_or(f);
                return Err((f, ops));
            }
        }
    }
    Ok(reports)
}
