//! The operations a seed draws, and how often each comes up.

/// splitmix64: the simulator's only source of randomness.
pub type Rng = delayd_adapters::split_mix::SplitMix64;

/// The simulator's generator for `seed`.
pub fn seeded(seed: u64) -> Rng {
    delayd_adapters::split_mix::SplitMix64(seed ^ 0x005e_ed0f_de1a_7d00)
}

/// Where a full disk is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Wal,
    Far,
    Both,
}

/// How a process ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    /// kill -9: the kernel keeps every write.
    Process,
    /// Power loss: what was not synced is gone.
    Unsynced,
    /// Power loss: a random part of what was not synced survives.
    Torn,
}

/// One step of a run. Messages are picked by index modulo how many exist
/// when the step runs, so any sub-list is a valid run (for shrinking).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// A producer publishes a message; delayd takes it in. `twin`: the
    /// same bytes as an earlier message of the route, on purpose.
    /// `ack_in_doubt`: the ack was sent but not confirmed when the next
    /// crash comes (it may be lost, and the broker redelivers).
    Deliver {
        route: u8,
        key: u8,
        body: u16,
        delay_ms: u64,
        twin: Option<u32>,
        ack_in_doubt: bool,
    },
    /// The broker redelivers the oldest delivery it still holds.
    Redeliver,
    /// Cancel one id of a message by its `x-delayd-id`.
    Cancel {
        pick: u32,
    },
    /// Cancel by lookup key on a route.
    CancelKey {
        route: u8,
        key: u8,
    },
    /// Purge a route's messages due within `[now + from, now + from + width]`.
    Purge {
        route: u8,
        from_ms: u64,
        width_ms: u64,
    },
    /// Move the clock (backwards when negative).
    Clock {
        ms: i64,
    },
    FarRound,
    Compact,
    /// The next `n` publishes fail (retried with back-off).
    PublishFails {
        n: u8,
    },
    Kill {
        loss: Loss,
    },
    /// A clean stop, and a start with another far horizon (index into
    /// [`HORIZONS`]).
    Restart {
        horizon: u8,
    },
    /// The power goes just before the `n`th disk-changing call from now.
    CrashAfter {
        n: u16,
    },
    DiskFull {
        scope: Scope,
    },
    DiskSpace,
    /// The next fsync fails with EIO.
    SyncFails,
}

/// Far horizons a restart may pick (0: no spilling).
pub const HORIZONS: [u64; 4] = [0, 1_000, 10_000, 60_000];

pub const ROUTES: [&str; 2] = ["orders", "push"];

/// Each kind of operation's share of a draw, in thousandths, in the order
/// `draw_one` tells them apart.
const WEIGHTS: [u64; 15] = [
    330, 70, 45, 25, 15, 155, 100, 50, 25, 45, 20, 35, 30, 40, 15,
];
/// Kinds a seed always draws at their share: deliveries, the clock, far
/// rounds.
const ALWAYS: [usize; 3] = [0, 5, 6];

/// Draw `len` operations for `seed`.
///
/// Swarm testing (Groce et al., 2012): most seeds draw every kind at its
/// share, but one in three leaves some kinds out and draws others three
/// times as often, so that long runs of a few kinds happen (loads,
/// compactions and restarts close together: how a load that kept a
/// message's old id loses it).
pub fn draw(seed: u64, len: usize) -> Vec<Op> {
    let mut rng = seeded(seed);
    let mut weights = WEIGHTS;
    if rng.below(3) == 0 {
        for (kind, w) in weights.iter_mut().enumerate() {
            if !ALWAYS.contains(&kind) {
                *w *= [0, 1, 3][rng.below(3) as usize];
            }
        }
    }
    let total: u64 = weights.iter().sum();
    (0..len)
        .map(|_| {
            // The roll, moved into the fixed table's range of its kind.
            let mut roll = rng.below(total);
            let mut base = 0;
            for (kind, &w) in weights.iter().enumerate() {
                if roll < w {
                    let offset = roll * WEIGHTS[kind] / w;
                    return draw_one(&mut rng, base + offset);
                }
                roll -= w;
                base += WEIGHTS[kind];
            }
            unreachable!("a roll below the total falls in some kind")
        })
        .collect()
}

fn draw_one(rng: &mut Rng, roll: u64) -> Op {
    match roll {
        0..=329 => Op::Deliver {
            route: rng.below(2) as u8,
            key: rng.below(4) as u8,
            body: rng.below(1000) as u16,
            delay_ms: draw_delay(rng),
            twin: rng.chance(15).then(|| rng.next() as u32),
            ack_in_doubt: rng.chance(30),
        },
        330..=399 => Op::Redeliver,
        400..=444 => Op::Cancel {
            pick: rng.next() as u32,
        },
        445..=469 => Op::CancelKey {
            route: rng.below(2) as u8,
            key: 1 + rng.below(3) as u8,
        },
        470..=484 => Op::Purge {
            route: rng.below(2) as u8,
            from_ms: rng.below(120_000),
            width_ms: rng.below(60_000),
        },
        485..=639 => Op::Clock {
            ms: match rng.below(10) {
                0 => -(rng.below(5_000) as i64),
                1..=5 => rng.below(2_000) as i64,
                6..=8 => rng.below(30_000) as i64,
                _ => rng.below(300_000) as i64,
            },
        },
        640..=739 => Op::FarRound,
        740..=789 => Op::Compact,
        790..=814 => Op::PublishFails {
            n: 1 + rng.below(4) as u8,
        },
        815..=859 => Op::Kill {
            loss: match rng.below(3) {
                0 => Loss::Process,
                1 => Loss::Unsynced,
                _ => Loss::Torn,
            },
        },
        860..=879 => Op::Restart {
            horizon: rng.below(HORIZONS.len() as u64) as u8,
        },
        880..=914 => Op::CrashAfter {
            n: 1 + rng.below(12) as u16,
        },
        915..=944 => Op::DiskFull {
            scope: match rng.below(3) {
                0 => Scope::Wal,
                1 => Scope::Far,
                _ => Scope::Both,
            },
        },
        945..=984 => Op::DiskSpace,
        _ => Op::SyncFails,
    }
}

/// Mostly near, some past the far horizon, a few due at once.
fn draw_delay(rng: &mut Rng) -> u64 {
    match rng.below(10) {
        0 => 0,
        1..=3 => rng.below(3_000),
        4..=6 => rng.below(40_000),
        7..=8 => rng.below(400_000),
        _ => rng.below(4 * 3_600_000),
    }
}
