//! Stored bytes of messages due soon, kept in memory so that firing them
//! needs no read from the WAL (a blocking call on another thread).
//!
//! Only a cache: the WAL stays the truth. A body is offered once its
//! Schedule is durable and taken when the message fires the first time; a
//! retry, a restart or a message over the budget reads the WAL as before.

use std::collections::HashMap;

/// Messages due within this of being stored are kept.
pub const HORIZON_MS: u64 = 10_000;
/// At most this many bytes of bodies are kept at once.
pub const BUDGET_BYTES: usize = 16 << 20;

#[derive(Default)]
pub struct Bodies {
    kept: HashMap<u64, (u64, Vec<u8>)>,
    bytes: usize,
}

impl Bodies {
    /// Whether a message due at `due_ms` stored at `now_ms` is worth a copy.
    pub fn wanted(due_ms: u64, now_ms: u64, len: usize) -> bool {
        due_ms <= now_ms.saturating_add(HORIZON_MS) && len <= BUDGET_BYTES / 64
    }

    /// Keep `id`'s due time and bytes if the budget allows.
    pub fn offer(&mut self, id: u64, due_ms: u64, message: Vec<u8>) {
        if self.bytes + message.len() > BUDGET_BYTES {
            return;
        }
        self.bytes += message.len();
        if let Some((_, old)) = self.kept.insert(id, (due_ms, message)) {
            self.bytes -= old.len();
        }
    }

    /// The due time and bytes of `id`, if kept; it is kept no longer.
    pub fn take(&mut self, id: u64) -> Option<(u64, Vec<u8>)> {
        let (due_ms, message) = self.kept.remove(&id)?;
        self.bytes -= message.len();
        Some((due_ms, message))
    }

    #[cfg(test)]
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_is_due_soon_and_small_is_wanted() {
        assert!(Bodies::wanted(1_000 + HORIZON_MS, 1_000, 256));
        assert!(!Bodies::wanted(1_001 + HORIZON_MS, 1_000, 256));
        assert!(Bodies::wanted(0, 1_000, BUDGET_BYTES / 64));
        assert!(!Bodies::wanted(0, 1_000, BUDGET_BYTES / 64 + 1));
    }

    #[test]
    fn the_budget_bounds_what_is_kept_and_taking_frees_it() {
        let mut bodies = Bodies::default();
        let size = BUDGET_BYTES / 4;
        for id in 0..5 {
            bodies.offer(id, 7, vec![id as u8; size]);
        }
        assert_eq!(bodies.bytes(), BUDGET_BYTES);
        assert_eq!(bodies.take(4), None, "over the budget");
        assert_eq!(bodies.take(1), Some((7, vec![1; size])));
        assert_eq!(bodies.take(1), None, "taken once");
        assert_eq!(bodies.bytes(), BUDGET_BYTES - size);
        bodies.offer(9, 8, vec![9; size]);
        assert_eq!(bodies.bytes(), BUDGET_BYTES);
    }

    #[test]
    fn a_body_offered_twice_is_counted_once() {
        let mut bodies = Bodies::default();
        bodies.offer(1, 7, vec![1; 100]);
        bodies.offer(1, 7, vec![1; 10]);
        assert_eq!(bodies.bytes(), 10);
        assert_eq!(bodies.take(1), Some((7, vec![1; 10])));
        assert_eq!(bodies.bytes(), 0);
    }
}
