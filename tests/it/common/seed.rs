//! Seeded random choices for the crash tests (kill points and the like):
//! the seed is printed, and `DELAYD_TEST_SEED=N` replays a run. Included by
//! path from the crash tests, which need nothing else of `common`.

use std::ops::Range;
use std::time::{SystemTime, UNIX_EPOCH};

pub struct Seed {
    pub seed: u64,
    state: u64,
}

impl Seed {
    /// The seed from `DELAYD_TEST_SEED`, else from the clock; printed with `what`.
    pub fn from_env(what: &str) -> Seed {
        let seed = std::env::var("DELAYD_TEST_SEED")
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or_else(|| {
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .expect("system clock before 1970")
                    .as_nanos() as u64
            });
        println!("{what}: DELAYD_TEST_SEED={seed}");
        Seed { seed, state: seed }
    }

    /// The next number in `range` (splitmix64).
    pub fn draw(&mut self, range: Range<u64>) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        range.start + z % (range.end - range.start).max(1)
    }
}
