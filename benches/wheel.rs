//! Steady-state throughput of the timing wheel with 1M and 10M pending entries.
//!
//! Each iteration inserts one entry due in 30..90 minutes (uniform, mean one hour) and
//! advances time by 1/N of an hour, popping whatever expired: one entry on average, so
//! about N stay pending. The wheel is pre-filled with N entries whose remaining times
//! follow that steady state (uniform up to 30 minutes, then linearly thinning out to 90).
//! One element = one insert plus one expiry.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use delayd::wheel::{Expired, TimingWheel};

/// 12 bytes, like delayd's WAL position.
#[derive(Debug, Clone, Copy)]
struct Pos {
    _seg: u32,
    _off: u32,
    _route: u16,
}

const HOUR_MS: u64 = 3_600_000;

/// xorshift64*: deterministic and cheap enough not to dominate the measurement.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// A remaining time under steady state: density 1 on [0, 30) min, then falling linearly
/// to 0 at 90 min (the chance that a 30..90 min delay is still running); equal halves.
fn steady_remaining(rng: &mut Rng) -> u64 {
    let half = HOUR_MS / 2;
    let r = rng.next();
    if r & 1 == 0 {
        (r >> 1) % half
    } else {
        let u = (r >> 11) as f64 / (1u64 << 53) as f64;
        half + (2.0 * half as f64 * (1.0 - u.sqrt())) as u64
    }
}

struct Steady {
    wheel: TimingWheel<Pos>,
    rng: Rng,
    pending: u64,
    next_id: u64,
    now: u64,
    /// Each step advances `HOUR_MS / pending` ms: `step_ms` plus `step_frac / pending`.
    step_ms: u64,
    step_frac: u64,
    /// Sub-millisecond remainder of time advanced, in units of 1/pending ms.
    frac: u64,
    out: Vec<Expired<Pos>>,
}

impl Steady {
    fn new(pending: u64) -> Self {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let mut wheel = TimingWheel::with_capacity(0, pending as usize);
        for id in 0..pending {
            let pos = Pos {
                _seg: id as u32,
                _off: 0,
                _route: 0,
            };
            let deadline = 1 + steady_remaining(&mut rng);
            wheel.insert(id, deadline, pos).expect("fresh id");
        }
        Steady {
            wheel,
            rng,
            pending,
            next_id: pending,
            now: 0,
            step_ms: HOUR_MS / pending,
            step_frac: HOUR_MS % pending,
            frac: 0,
            out: Vec::with_capacity(1024),
        }
    }

    fn step(&mut self) {
        let delay = HOUR_MS / 2 + self.rng.next() % HOUR_MS;
        let pos = Pos {
            _seg: self.next_id as u32,
            _off: 1,
            _route: 2,
        };
        self.wheel
            .insert(self.next_id, self.now + delay, pos)
            .expect("fresh id");
        self.next_id += 1;
        // Advance by HOUR_MS / pending exactly, without a division per step (it would
        // be a noticeable share of the time measured).
        self.now += self.step_ms;
        self.frac += self.step_frac;
        if self.frac >= self.pending {
            self.frac -= self.pending;
            self.now += 1;
        }
        self.wheel.poll_expired(self.now, usize::MAX, &mut self.out);
        black_box(&self.out);
        self.out.clear();
    }

    fn report(&self, when: &str) {
        let bytes = self.wheel.heap_bytes();
        eprintln!(
            "{} pending, {when}: heap {:.1} MiB, {:.1} bytes/entry",
            self.wheel.len(),
            bytes as f64 / (1 << 20) as f64,
            bytes as f64 / self.wheel.len() as f64
        );
    }
}

fn steady_state(c: &mut Criterion) {
    let mut group = c.benchmark_group("wheel_insert_expire");
    group.throughput(Throughput::Elements(1));
    for pending in [1_000_000u64, 10_000_000] {
        if pending >= 10_000_000 {
            group
                .sample_size(10)
                .warm_up_time(Duration::from_secs(1))
                .measurement_time(Duration::from_secs(5));
        }
        let setup = Instant::now();
        let mut state = Steady::new(pending);
        eprintln!("setup of {pending} entries took {:?}", setup.elapsed());
        state.report("after pre-fill");
        group.bench_function(BenchmarkId::from_parameter(pending), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    state.step();
                }
                start.elapsed()
            })
        });
        state.report("after steady state");
    }
    group.finish();
}

criterion_group!(benches, steady_state);
criterion_main!(benches);
