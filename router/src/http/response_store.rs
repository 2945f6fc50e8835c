//! The store of `/v1/responses` (`store: true`, the default): a plain bounded map from response id to
//! what a later request needs of it. It is bounded three ways, each a flag: the number of entries, their
//! total size in bytes (as the caller measures each entry) and their age. When an insert would pass a
//! bound, the oldest entries go first; an entry older than the age bound counts as gone the moment it
//! expires (it is dropped on the next call). No I/O and no clock of its own: callers pass `now`.

use std::{
    collections::{BTreeMap, HashMap},
    time::Instant,
};

pub use crate::config::StoreBounds;

struct Entry<T> {
    value: T,
    num_bytes: usize,
    stored_at: Instant,
    /// Its place in insertion order (the key of `order`).
    seq: u64,
}

/// Response id → `T`, oldest evicted first.
pub struct ResponseStore<T> {
    bounds: StoreBounds,
    entries: HashMap<String, Entry<T>>,
    /// Insertion order: sequence number → id; the first is the oldest.
    order: BTreeMap<u64, String>,
    next_seq: u64,
    num_bytes: usize,
}

impl<T> ResponseStore<T> {
    pub fn new(bounds: StoreBounds) -> Self {
        Self {
            bounds,
            entries: HashMap::new(),
            order: BTreeMap::new(),
            next_seq: 0,
            num_bytes: 0,
        }
    }

    pub fn bounds(&self) -> StoreBounds {
        self.bounds
    }

    /// Entries kept now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Bytes kept now, as the entries were measured when stored.
    pub fn num_bytes(&self) -> usize {
        self.num_bytes
    }

    /// Stores `value` (`num_bytes` large) under `id`, replacing any entry of that id, after evicting the
    /// oldest entries until it fits. Returns false, storing nothing, when it cannot fit even alone.
    pub fn insert(&mut self, id: String, value: T, num_bytes: usize, now: Instant) -> bool {
        self.expire(now);
        self.remove(&id);
        if self.bounds.max_entries == 0 || num_bytes > self.bounds.max_bytes {
            return false;
        }
        while self.entries.len() >= self.bounds.max_entries || self.num_bytes + num_bytes > self.bounds.max_bytes {
            self.evict_oldest();
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.order.insert(seq, id.clone());
        self.num_bytes += num_bytes;
        self.entries.insert(
            id,
            Entry {
                value,
                num_bytes,
                stored_at: now,
                seq,
            },
        );
        true
    }

    /// The entry of `id`, unless it was never stored, was removed, or was evicted or expired by `now`.
    pub fn get(&mut self, id: &str, now: Instant) -> Option<&T> {
        self.expire(now);
        self.entries.get(id).map(|entry| &entry.value)
    }

    /// Removes the entry of `id`; returns it if it was there.
    pub fn remove(&mut self, id: &str) -> Option<T> {
        let entry = self.entries.remove(id)?;
        self.order.remove(&entry.seq);
        self.num_bytes -= entry.num_bytes;
        Some(entry.value)
    }

    /// Drops the entries stored more than the age bound before `now` (they are the oldest).
    pub fn expire(&mut self, now: Instant) {
        while let Some((_, id)) = self.order.first_key_value() {
            let stored_at = self.entries[id].stored_at;
            if now.saturating_duration_since(stored_at) < self.bounds.ttl {
                break;
            }
            self.evict_oldest();
        }
    }

    fn evict_oldest(&mut self) {
        let (_, id) = self.order.pop_first().expect("evicting from a non-empty store");
        let entry = self.entries.remove(&id).expect("every ordered id is stored");
        self.num_bytes -= entry.num_bytes;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn store(max_entries: usize, max_bytes: usize, ttl_s: u64) -> ResponseStore<&'static str> {
        ResponseStore::new(StoreBounds {
            max_entries,
            max_bytes,
            ttl: Duration::from_secs(ttl_s),
        })
    }

    fn ids(store: &mut ResponseStore<&'static str>, now: Instant) -> Vec<&'static str> {
        let mut kept: Vec<_> = ["a", "b", "c", "d", "e"]
            .into_iter()
            .filter(|id| store.get(id, now).is_some())
            .collect();
        kept.sort();
        kept
    }

    #[test]
    fn the_count_bound_evicts_the_oldest_first() {
        let now = Instant::now();
        let mut store = store(2, 1000, 60);
        for id in ["a", "b", "c"] {
            assert!(store.insert(id.into(), id, 10, now));
        }
        assert_eq!(ids(&mut store, now), ["b", "c"]);
        assert_eq!((store.len(), store.num_bytes()), (2, 20));
        // Storing an id again makes it the newest.
        assert!(store.insert("b".into(), "b", 10, now));
        assert!(store.insert("d".into(), "d", 10, now));
        assert_eq!(ids(&mut store, now), ["b", "d"]);
    }

    #[test]
    fn the_byte_bound_evicts_until_the_new_entry_fits() {
        let now = Instant::now();
        let mut store = store(10, 100, 60);
        assert!(store.insert("a".into(), "a", 40, now));
        assert!(store.insert("b".into(), "b", 40, now));
        assert!(store.insert("c".into(), "c", 50, now));
        assert_eq!(ids(&mut store, now), ["b", "c"]);
        assert_eq!(store.num_bytes(), 90);
        // Too large even alone: not stored, and nothing evicted for it.
        assert!(!store.insert("d".into(), "d", 101, now));
        assert_eq!(ids(&mut store, now), ["b", "c"]);
        assert!(store.insert("e".into(), "e", 100, now));
        assert_eq!(ids(&mut store, now), ["e"]);
    }

    #[test]
    fn entries_expire_at_the_age_bound() {
        let start = Instant::now();
        let mut store = store(10, 1000, 60);
        assert!(store.insert("a".into(), "a", 1, start));
        assert!(store.insert("b".into(), "b", 1, start + Duration::from_secs(30)));
        assert_eq!(ids(&mut store, start + Duration::from_secs(59)), ["a", "b"]);
        assert_eq!(ids(&mut store, start + Duration::from_secs(60)), ["b"]);
        assert_eq!((store.len(), store.num_bytes()), (1, 1));
        assert!(ids(&mut store, start + Duration::from_secs(90)).is_empty());
        assert_eq!((store.len(), store.num_bytes()), (0, 0));
    }

    #[test]
    fn removed_entries_are_gone_and_a_zero_bound_keeps_nothing() {
        let now = Instant::now();
        let mut store = store(10, 1000, 60);
        assert!(store.insert("a".into(), "a", 5, now));
        assert_eq!(store.remove("a"), Some("a"));
        assert_eq!(store.remove("a"), None);
        assert_eq!((store.len(), store.num_bytes()), (0, 0));
        let mut none = self::store(0, 1000, 60);
        assert!(!none.insert("a".into(), "a", 1, now));
        assert_eq!(none.len(), 0);
    }
}
