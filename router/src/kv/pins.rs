//! The table of session pins: which cached blocks each session key keeps from eviction, and until when.
//! Plain bookkeeping; [`KvPool`](super::KvPool) applies it to the prefix cache (`RadixCache::change_pins`)
//! and decides when pins go (expiry, the bound on pinned blocks, memory pressure).
//!
//! A pin is a chain of cached blocks from a root of the radix tree (a finished sequence's cached prefix),
//! keyed by the session key and the request's prefix-cache salt, so salts stay isolated. One key has at
//! most one pin: the next turn's longer prefix replaces the previous one.

use std::{collections::HashMap, time::Instant};

/// What a pin is found by: the request's session key within its prefix-cache namespace.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PinKey {
    /// The request's `cache_salt` namespace (0 = the shared one).
    pub salt: u64,
    /// The session key the client gave (`prompt_cache_key`, ...).
    pub key: String,
}

/// One pin: the cached blocks it keeps, in path order, and when it lapses.
#[derive(Debug, Clone)]
pub struct Pin {
    pub blocks: Vec<u32>,
    pub deadline: Instant,
    /// When it was made, as a count of pins made before it: the oldest pin has the smallest.
    order: u64,
}

/// Every pin, by key.
#[derive(Debug, Default, Clone)]
pub struct PinTable {
    pins: HashMap<PinKey, Pin>,
    num_made: u64,
}

impl PinTable {
    pub fn num_pins(&self) -> usize {
        self.pins.len()
    }

    /// Makes the pin of `key`; returns the pin it replaces, whose blocks the caller unpins (after pinning
    /// the new ones, so blocks both name stay kept throughout).
    pub fn insert(&mut self, key: PinKey, blocks: Vec<u32>, deadline: Instant) -> Option<Pin> {
        let order = self.num_made;
        self.num_made += 1;
        self.pins.insert(
            key,
            Pin {
                blocks,
                deadline,
                order,
            },
        )
    }

    /// Takes the oldest pin other than `keep`'s.
    pub fn take_oldest_except(&mut self, keep: &PinKey) -> Option<Pin> {
        let key = self
            .pins
            .iter()
            .filter(|(key, _)| *key != keep)
            .min_by_key(|(_, pin)| pin.order)?
            .0
            .clone();
        self.pins.remove(&key)
    }

    /// Takes the pin that lapses first (the oldest among equals): the first to go under memory pressure.
    pub fn take_soonest(&mut self) -> Option<Pin> {
        let key = self
            .pins
            .iter()
            .min_by_key(|(_, pin)| (pin.deadline, pin.order))?
            .0
            .clone();
        self.pins.remove(&key)
    }

    /// Takes every pin whose deadline is `now` or earlier.
    pub fn take_expired(&mut self, now: Instant) -> Vec<Pin> {
        let expired: Vec<PinKey> = self
            .pins
            .iter()
            .filter(|(_, pin)| pin.deadline <= now)
            .map(|(key, _)| key.clone())
            .collect();
        expired.iter().filter_map(|key| self.pins.remove(key)).collect()
    }

    /// The earliest deadline of any pin.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.pins.values().map(|pin| pin.deadline).min()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Pin> {
        self.pins.values()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn key(name: &str) -> PinKey {
        PinKey {
            salt: 0,
            key: name.into(),
        }
    }

    #[test]
    fn pins_go_oldest_first_for_the_bound_and_soonest_first_under_pressure() {
        let now = Instant::now();
        let mut table = PinTable::default();
        table.insert(key("a"), vec![1], now + Duration::from_secs(30));
        table.insert(key("b"), vec![2], now + Duration::from_secs(10));
        table.insert(key("c"), vec![3], now + Duration::from_secs(20));
        assert_eq!(table.next_deadline(), Some(now + Duration::from_secs(10)));
        let replaced = table.insert(key("a"), vec![1, 4], now + Duration::from_secs(40));
        assert_eq!(replaced.map(|pin| pin.blocks), Some(vec![1]));
        assert_eq!(table.num_pins(), 3, "one pin per key");
        // "a" was made again last: "b" is now the oldest.
        assert_eq!(table.take_oldest_except(&key("c")).map(|pin| pin.blocks), Some(vec![2]));
        assert_eq!(table.take_soonest().map(|pin| pin.blocks), Some(vec![3]));
        assert!(table.take_expired(now + Duration::from_secs(39)).is_empty());
        assert_eq!(table.take_oldest_except(&key("a")).map(|pin| pin.blocks), None);
        let expired = table.take_expired(now + Duration::from_secs(40));
        assert_eq!(expired.len(), 1);
        assert_eq!(table.num_pins(), 0);
        assert_eq!(table.next_deadline(), None);
    }

    #[test]
    fn salts_keep_keys_apart() {
        let now = Instant::now();
        let mut table = PinTable::default();
        table.insert(key("a"), vec![1], now);
        let salted = PinKey {
            salt: 7,
            key: "a".into(),
        };
        assert!(table.insert(salted.clone(), vec![2], now).is_none());
        assert_eq!(table.num_pins(), 2);
        assert_eq!(table.take_oldest_except(&salted).map(|pin| pin.blocks), Some(vec![1]));
    }
}
