//! Index of pending messages by their lookup key (the Kafka record key, else
//! the AMQP `message_id`), so one can be cancelled by key, and a Kafka
//! tombstone can cancel the message it names.
//!
//! Keys can be long and the index must not cost RAM per byte of key, so it
//! keeps only a 64-bit hash of (route, key) and the message id: 16 bytes per
//! indexed message plus the hash table's control bytes. Two keys can share a
//! hash, so a lookup returns candidates that the caller verifies against the
//! stored record. Messages without a key are not indexed.
//!
//! Removal needs the hash, which is recomputed from the stored record when it
//! is at hand (delivery, cancel). Where it is not (recovery replays a Done
//! without the message), entries are left stale and [`KeyIndex::retain`]
//! sweeps them; lookups skip ids that are no longer pending anyway.

use std::collections::HashMap;

/// The index hash of `key` on the route with interned id `route`.
pub fn key_hash(route: u16, key: &[u8]) -> u64 {
    let a = crc32c::crc32c_append(crc32c::crc32c(&route.to_le_bytes()), key);
    let b = crc32c::crc32c_append(0x85eb_ca6b ^ key.len() as u32, key);
    ((a as u64) << 32) | b as u64
}

/// hash → ids. Nearly every hash has one id, kept inline in `first`; the
/// rare extra ones (the same key sent twice, or a collision) go to `more`.
#[derive(Debug, Default)]
pub struct KeyIndex {
    first: HashMap<u64, u64>,
    more: HashMap<u64, Vec<u64>>,
    len: usize,
}

impl KeyIndex {
    /// Add `id` under `hash` (no-op if it is already there).
    pub fn insert(&mut self, hash: u64, id: u64) {
        match self.first.get(&hash) {
            None => {
                self.first.insert(hash, id);
            }
            Some(&existing) if existing == id => return,
            Some(_) => {
                let extra = self.more.entry(hash).or_default();
                if extra.contains(&id) {
                    return;
                }
                extra.push(id);
            }
        }
        self.len += 1;
    }

    /// Remove `id` from under `hash`. Returns whether it was there.
    pub fn remove(&mut self, hash: u64, id: u64) -> bool {
        match self.first.get(&hash) {
            None => return false,
            Some(&existing) if existing == id => {
                match self.more.get_mut(&hash).and_then(Vec::pop) {
                    Some(next) => {
                        self.first.insert(hash, next);
                        if self.more.get(&hash).is_some_and(Vec::is_empty) {
                            self.more.remove(&hash);
                        }
                    }
                    None => {
                        self.first.remove(&hash);
                    }
                }
            }
            Some(_) => {
                let Some(extra) = self.more.get_mut(&hash) else {
                    return false;
                };
                let Some(i) = extra.iter().position(|&x| x == id) else {
                    return false;
                };
                extra.swap_remove(i);
                if extra.is_empty() {
                    self.more.remove(&hash);
                }
            }
        }
        self.len -= 1;
        true
    }

    /// Every id filed under `hash` (candidates: verify the key).
    pub fn ids(&self, hash: u64) -> Vec<u64> {
        let mut out: Vec<u64> = self.first.get(&hash).copied().into_iter().collect();
        if let Some(extra) = self.more.get(&hash) {
            out.extend_from_slice(extra);
        }
        out
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Keep only the ids for which `keep` says yes (a sweep of stale
    /// entries). In place: no second table, so RSS does not jump.
    pub fn retain(&mut self, mut keep: impl FnMut(u64) -> bool) {
        let more = &mut self.more;
        for ids in more.values_mut() {
            ids.retain(|&id| keep(id));
        }
        more.retain(|_, ids| !ids.is_empty());
        self.first.retain(|hash, id| {
            if keep(*id) {
                return true;
            }
            // Promote an extra id of the same hash, if one is left.
            let Some(extra) = more.get_mut(hash) else {
                return false;
            };
            let Some(next) = extra.pop() else {
                return false;
            };
            if extra.is_empty() {
                more.remove(hash);
            }
            *id = next;
            true
        });
        self.len = self.first.len() + self.more.values().map(Vec::len).sum::<usize>();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_hash_keeps_every_id() {
        let mut index = KeyIndex::default();
        index.insert(7, 1);
        index.insert(7, 2);
        index.insert(7, 3);
        index.insert(7, 2);
        assert_eq!(index.len(), 3);
        let mut ids = index.ids(7);
        ids.sort();
        assert_eq!(ids, [1, 2, 3]);
        assert!(index.remove(7, 1));
        assert!(!index.remove(7, 1));
        let mut ids = index.ids(7);
        ids.sort();
        assert_eq!(ids, [2, 3]);
        assert!(index.remove(7, 3));
        assert!(index.remove(7, 2));
        assert!(index.ids(7).is_empty());
        assert_eq!(index.len(), 0);
    }

    #[test]
    fn retain_drops_stale_ids() {
        let mut index = KeyIndex::default();
        for id in 0..100 {
            index.insert(id % 10, id);
        }
        index.retain(|id| id % 2 == 0);
        assert_eq!(index.len(), 50);
        assert!(index.ids(3).is_empty());
        assert_eq!(index.ids(4).len(), 10);
        // The first id of a hash goes, an extra one stays and takes its place.
        let mut index = KeyIndex::default();
        index.insert(5, 1);
        index.insert(5, 2);
        index.insert(5, 3);
        index.retain(|id| id != 1);
        let mut ids = index.ids(5);
        ids.sort();
        assert_eq!((ids, index.len()), (vec![2, 3], 2));
        assert!(index.remove(5, 2) && index.remove(5, 3) && index.ids(5).is_empty());
    }

    #[test]
    fn hash_depends_on_route_and_key() {
        assert_ne!(key_hash(0, b"a"), key_hash(1, b"a"));
        assert_ne!(key_hash(0, b"a"), key_hash(0, b"b"));
        assert_eq!(key_hash(3, b"order-1"), key_hash(3, b"order-1"));
    }

    #[test]
    fn an_extra_id_is_removed_alone() {
        let mut index = KeyIndex::default();
        for id in [1, 2, 3, 4] {
            index.insert(9, id);
        }
        index.insert(9, 1);
        assert_eq!(index.len(), 4, "the first id again is no second entry");
        assert!(index.remove(9, 2));
        assert!(!index.remove(9, 2));
        assert!(!index.remove(9, 5), "an id never filed under the hash");
        assert!(!index.remove(8, 1), "a hash never filed");
        let mut ids = index.ids(9);
        ids.sort();
        assert_eq!((ids, index.len()), (vec![1, 3, 4], 3));
    }
}
