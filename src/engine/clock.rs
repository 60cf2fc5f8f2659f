//! Wall-clock time for the engine, behind a trait so tests can step it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch. Due times are wall-clock times, so the
/// engine reads the wall clock; it never fires a message while this is
/// below the message's due time, even if the clock steps backwards.
pub trait Clock: Send + Sync + 'static {
    fn now_ms(&self) -> u64;

    /// How long until `deadline_ms` (zero once reached), for a sleep.
    fn until(&self, deadline_ms: u64) -> Duration {
        Duration::from_millis(deadline_ms.saturating_sub(self.now_ms()))
    }
}

#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }

    /// Counted below the millisecond: a sleep for it ends just after the
    /// deadline, not up to a millisecond past it (whole milliseconds from
    /// `now_ms` would drop the part of the current one already gone).
    fn until(&self, deadline_ms: u64) -> Duration {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Duration::from_millis(deadline_ms).saturating_sub(now)
    }
}

/// A clock that moves only when told to (tests).
#[derive(Debug, Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    pub fn new(now_ms: u64) -> Self {
        Self(AtomicU64::new(now_ms))
    }

    pub fn set(&self, now_ms: u64) {
        self.0.store(now_ms, Ordering::SeqCst);
    }

    pub fn advance(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

impl<C: Clock> Clock for std::sync::Arc<C> {
    fn now_ms(&self) -> u64 {
        (**self).now_ms()
    }

    fn until(&self, deadline_ms: u64) -> Duration {
        (**self).until(deadline_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_system_clock_counts_below_the_millisecond() {
        let clock = SystemClock;
        let now = clock.now_ms();
        // Some of the current millisecond is gone: less than 5 ms remain
        // until now + 5, and not a whole number of milliseconds (counting
        // whole milliseconds from `now_ms` gives exactly 5, or 4 at a tick;
        // a nanosecond clock lands on a whole millisecond once in a million).
        let left = clock.until(now + 5);
        assert!(left < Duration::from_millis(5), "{left:?}");
        assert_ne!(left.subsec_nanos() % 1_000_000, 0, "{left:?}");
        assert_eq!(clock.until(now), Duration::ZERO);
        assert_eq!(clock.until(now.saturating_sub(10)), Duration::ZERO);
    }

    #[test]
    fn a_manual_clock_counts_whole_milliseconds() {
        let clock = ManualClock::new(1000);
        assert_eq!(clock.until(1250), Duration::from_millis(250));
        assert_eq!(clock.until(999), Duration::ZERO);
    }
}
