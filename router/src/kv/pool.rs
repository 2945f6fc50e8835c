//! The KV pool as the engine uses it: the block allocator and, with prefix caching on, the radix cache
//! of computed blocks, kept consistent with each other.
//!
//! Ownership: a block is free (on the allocator's free list) or held. Its holders are the sequences
//! whose block tables name it and, at most once, the prefix cache. A cached block that no sequence holds
//! (reference count 1) is *evictable*: it still serves prefix hits, and it is evicted, least recently
//! used first, only when an allocation finds the free list short. So "available" = free + evictable.
//!
//! Sliding windows: when every layer of the model attends through a window of `W` tokens, a sequence's
//! block whose every position is out of the next query's window (its last position `p` has
//! `p < next_position - (W - 1)`) is never read again. [`KvPool::release_out_of_window`] lets go of such
//! blocks and their block-table entries become the null block 0 (the shards never read them: every
//! attention path skips keys out of the window). The policy for the prefix cache: before letting go, the
//! sequence enters its full blocks into the cache, so the cache's own reference keeps them alive
//! (evictable, like any cached block nobody holds) and a later prompt with the same prefix still hits. A
//! cached path is always a complete chain from the root: an insertion stops at the first null entry whose
//! block the cache no longer has (evicted meanwhile), so a hit never includes a released block.
//!
//! Session pins ([`KvPool::pin`]): a finished sequence of an agent session may pin its cached prefix under
//! a key until a deadline, so the next turn hits it even after other traffic churned the cache. A pin adds
//! no allocator reference: pinned blocks are cached blocks that eviction skips, and they count as
//! available. When blocks are needed they come, in this order, from the free list, from unpinned cached
//! blocks nobody holds (LRU), from pinned ones (the pin that lapses first goes first, whole), and only then
//! does the scheduler preempt (it sees pinned blocks as available, so it never preempts for them). Pinned
//! blocks are at most `max_pinned_blocks` (`--max-pinned-kv-fraction` of the pool): a new pin beyond it
//! releases the oldest pins; a prefix longer than the whole bound pins its first `max_pinned_blocks`.
//! Expired pins are released by [`KvPool::expire_pins`], which the engine calls every iteration and when
//! the earliest deadline passes while idle.

use std::time::Instant;

use super::{
    pins::{PinKey, PinTable},
    BlockAllocator, KvEvent, PrefixMatch, RadixCache,
};

/// What one operation did to the cache, for the metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CacheActivity {
    pub num_inserted_blocks: usize,
    pub num_evicted_blocks: usize,
    /// Session pins released because an allocation needed their blocks.
    pub num_pins_released_under_pressure: usize,
}

/// What [`KvPool::pin`] did, for the metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PinOutcome {
    /// Blocks the new pin keeps (0: nothing was pinned).
    pub num_blocks: usize,
    /// Older pins released to keep the pinned blocks within the bound.
    pub num_released_for_bound: usize,
}

pub struct KvPool {
    allocator: BlockAllocator,
    cache: Option<RadixCache>,
    pins: PinTable,
    /// The most blocks pins may keep at once (distinct blocks); 0 turns pins off.
    max_pinned_blocks: usize,
}

impl KvPool {
    /// `num_blocks` as Warmup reported (the null block included); `prefix_caching` turns the cache on.
    /// Session pins are off until [`with_max_pinned_fraction`](Self::with_max_pinned_fraction).
    pub fn new(num_blocks: u32, block_size: usize, prefix_caching: bool) -> Self {
        Self {
            allocator: BlockAllocator::new(num_blocks),
            cache: prefix_caching.then(|| RadixCache::new(block_size)),
            pins: PinTable::default(),
            max_pinned_blocks: 0,
        }
    }

    /// Lets session pins keep up to `fraction` (in [0, 1]) of the usable blocks.
    pub fn with_max_pinned_fraction(mut self, fraction: f64) -> Self {
        self.max_pinned_blocks = (f64::from(self.num_usable_blocks()) * fraction) as usize;
        self
    }

    /// Records the prefix cache's KV-cache events from now on (see [`RadixCache::record_events`]); without a
    /// prefix cache there are none.
    pub fn record_events(&mut self) {
        if let Some(cache) = self.cache.as_mut() {
            cache.record_events();
        }
    }

    /// The KV-cache events since the last call, in order.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.cache.as_mut().map(RadixCache::take_events).unwrap_or_default()
    }

    /// Events that bring a subscriber to the prefix cache's state now (see [`RadixCache::snapshot_events`]).
    pub fn snapshot_events(&self) -> Vec<KvEvent> {
        self.cache.as_ref().map(RadixCache::snapshot_events).unwrap_or_default()
    }

    /// The most blocks pins may keep at once (0 without a prefix cache).
    pub fn max_pinned_blocks(&self) -> usize {
        if self.cache.is_some() {
            self.max_pinned_blocks
        } else {
            0
        }
    }

    /// Blocks kept by at least one pin.
    pub fn num_pinned_blocks(&self) -> usize {
        self.cache.as_ref().map_or(0, RadixCache::num_pinned_blocks)
    }

    pub fn num_pins(&self) -> usize {
        self.pins.num_pins()
    }

    /// When the first pin lapses, if any does.
    pub fn next_pin_deadline(&self) -> Option<Instant> {
        self.pins.next_deadline()
    }

    pub fn num_usable_blocks(&self) -> u32 {
        self.allocator.num_usable_blocks()
    }

    pub fn num_free_blocks(&self) -> u32 {
        self.allocator.num_free_blocks()
    }

    pub fn num_cached_blocks(&self) -> usize {
        self.cache.as_ref().map_or(0, RadixCache::num_cached_blocks)
    }

    /// Blocks an allocation can get now: free ones plus cached ones no sequence needs (pinned ones
    /// included: an allocation releases pins before it fails). O(1).
    pub fn num_available_blocks(&self) -> usize {
        let num_reclaimable = self.cache.as_ref().map_or(0, RadixCache::num_reclaimable);
        self.allocator.num_free_blocks() as usize + num_reclaimable
    }

    /// The longest cached prefix of `tokens` in full blocks, at most `max_tokens` long. Nothing is held:
    /// `attach` the blocks to use them.
    pub fn match_prefix(&mut self, salt: u64, tokens: &[u32], max_tokens: usize) -> PrefixMatch {
        let Some(cache) = self.cache.as_mut() else {
            return PrefixMatch::default();
        };
        let block_size = cache.block_size();
        let limit = (max_tokens.min(tokens.len()) / block_size) * block_size;
        cache.match_prefix(salt, &tokens[..limit])
    }

    /// Of these cached blocks, how many are evictable now: attaching them makes that many blocks
    /// unavailable to allocations.
    pub fn num_evictable_among(&self, blocks: &[u32]) -> usize {
        blocks.iter().filter(|&&b| self.allocator.ref_count(b) == 1).count()
    }

    /// Adds a holder to blocks already in use (a prefix hit, or a sibling's shared prompt).
    pub fn attach(&mut self, blocks: &[u32]) {
        self.allocator
            .share(blocks)
            .expect("attached blocks are cached or held by a sibling");
        if let Some(cache) = self.cache.as_mut() {
            for &block in blocks {
                cache.set_held(block, true);
            }
        }
    }

    /// Takes `num_blocks` blocks, evicting least recently used cached blocks when the free list is short,
    /// and when those are not enough, releasing pins (the one that lapses first first) and evicting again.
    pub fn allocate(&mut self, num_blocks: usize, activity: &mut CacheActivity) -> Option<Vec<u32>> {
        if let Some(cache) = self.cache.as_mut() {
            loop {
                let num_free = self.allocator.num_free_blocks() as usize;
                if num_free >= num_blocks {
                    break;
                }
                let evicted = cache.evict(num_blocks - num_free);
                self.allocator
                    .free(&evicted)
                    .expect("the cache held the blocks it evicted");
                activity.num_evicted_blocks += evicted.len();
                if self.allocator.num_free_blocks() as usize >= num_blocks {
                    break;
                }
                let Some(pin) = self.pins.take_soonest() else { break };
                unpin(cache, &pin.blocks);
                activity.num_pins_released_under_pressure += 1;
            }
        }
        self.allocator.allocate(num_blocks as u32)
    }

    /// Pins the cached prefix of `tokens` under `key` until `deadline`, replacing the key's earlier pin
    /// (blocks both name stay kept). Call it after the sequence's blocks entered the cache. Within the
    /// bound: a prefix longer than it pins its first `max_pinned_blocks`, and older pins are released
    /// until the pinned blocks fit. A prefix without a full cached block pins nothing and leaves the key's
    /// earlier pin as it is. Without a prefix cache, or with pins off, nothing is pinned.
    pub fn pin(&mut self, key: PinKey, tokens: &[u32], deadline: Instant) -> PinOutcome {
        let max_pinned_blocks = self.max_pinned_blocks();
        let Some(cache) = self.cache.as_mut().filter(|_| max_pinned_blocks > 0) else {
            return PinOutcome::default();
        };
        let mut blocks = cache.match_prefix(key.salt, tokens).blocks;
        blocks.truncate(max_pinned_blocks);
        for &block in &blocks {
            cache.change_pins(block, 1);
        }
        let mut outcome = PinOutcome {
            num_blocks: blocks.len(),
            num_released_for_bound: 0,
        };
        let replaced = if blocks.is_empty() {
            None
        } else {
            self.pins.insert(key.clone(), blocks, deadline)
        };
        if let Some(replaced) = replaced {
            unpin(cache, &replaced.blocks);
        }
        while cache.num_pinned_blocks() > max_pinned_blocks {
            let oldest = self
                .pins
                .take_oldest_except(&key)
                .expect("the new pin alone fits the bound");
            unpin(cache, &oldest.blocks);
            outcome.num_released_for_bound += 1;
        }
        outcome
    }

    /// Releases every pin whose deadline is `now` or earlier; returns how many.
    pub fn expire_pins(&mut self, now: Instant) -> usize {
        let expired = self.pins.take_expired(now);
        if let Some(cache) = self.cache.as_mut() {
            for pin in &expired {
                unpin(cache, &pin.blocks);
            }
        }
        expired.len()
    }

    /// Drops a sequence's hold on its blocks; null entries (released out of a sliding window) hold nothing
    /// and are skipped.
    pub fn release(&mut self, blocks: &[u32]) {
        let blocks: Vec<u32> = blocks.iter().copied().filter(|&b| b != 0).collect();
        self.allocator
            .free(&blocks)
            .expect("a sequence only holds blocks it was given");
        if let Some(cache) = self.cache.as_mut() {
            for &block in &blocks {
                if self.allocator.ref_count(block) == 1 {
                    cache.set_held(block, false);
                }
            }
        }
    }

    /// Enters the full blocks of `tokens` (held in `blocks`) into the cache, so later requests with this
    /// prefix reuse them. Blocks of a prefix already cached under other ids are left as they are.
    pub fn cache(&mut self, salt: u64, tokens: &[u32], blocks: &[u32], activity: &mut CacheActivity) {
        let Some(cache) = self.cache.as_mut() else { return };
        let num_full_blocks = (tokens.len() / cache.block_size()).min(blocks.len());
        let num_tokens = num_full_blocks * cache.block_size();
        let added = cache.insert(salt, &tokens[..num_tokens], &blocks[..num_full_blocks]);
        self.allocator.share(&added).expect("a sequence caches blocks it holds");
        activity.num_inserted_blocks += added.len();
    }

    /// Lets go of a sequence's first `num_dead_blocks` blocks, out of every future query's sliding window:
    /// their full blocks (`tokens` are the sequence's computed tokens) enter the prefix cache first, then
    /// the sequence's hold is dropped and their entries become the null block 0. Entries already null are
    /// skipped. Returns how many blocks the sequence let go of.
    pub fn release_out_of_window(
        &mut self,
        salt: u64,
        tokens: &[u32],
        blocks: &mut [u32],
        num_dead_blocks: usize,
        activity: &mut CacheActivity,
    ) -> usize {
        let num_dead_blocks = num_dead_blocks.min(blocks.len());
        let dead = &mut blocks[..num_dead_blocks];
        if dead.iter().all(|&b| b == 0) {
            return 0;
        }
        if let Some(block_size) = self.cache.as_ref().map(RadixCache::block_size) {
            let num_tokens = (num_dead_blocks * block_size).min(tokens.len());
            self.cache(salt, &tokens[..num_tokens], dead, activity);
        }
        let num_released = dead.iter().filter(|&&b| b != 0).count();
        self.release(dead); // skips the entries already null
        dead.fill(0);
        num_released
    }

    /// How many of a sequence's blocks would become available if it let go of them: those it alone holds,
    /// and those only the cache holds besides it (they become evictable).
    pub fn num_freeable(&self, blocks: &[u32]) -> usize {
        blocks
            .iter()
            .filter(|&&b| {
                let count = self.allocator.ref_count(b);
                count == 1 || (count == 2 && self.cache.as_ref().is_some_and(|c| c.contains_block(b)))
            })
            .count()
    }

    /// Panics if the allocator or the cache is inconsistent, or they disagree: a cached block is held by a
    /// sequence exactly when the allocator counts a holder besides the cache; every pinned block is cached
    /// and the pinned blocks fit the bound.
    pub fn check_invariants(&self) {
        self.allocator.check_invariants();
        if let Some(cache) = &self.cache {
            cache.check_invariants();
            let mut pinned: Vec<u32> = self.pins.iter().flat_map(|pin| pin.blocks.iter().copied()).collect();
            assert!(
                pinned.iter().all(|&b| cache.contains_block(b)),
                "a pinned block left the cache"
            );
            pinned.sort_unstable();
            pinned.dedup();
            assert_eq!(pinned.len(), cache.num_pinned_blocks(), "pinned blocks miscounted");
            assert!(pinned.len() <= self.max_pinned_blocks, "pins beyond the bound");
            for block in 1..=self.allocator.num_usable_blocks() {
                if let Some(is_held) = cache.is_held(block) {
                    assert_eq!(
                        is_held,
                        self.allocator.ref_count(block) > 1,
                        "block {block}: hold out of sync"
                    );
                }
            }
        }
    }
}

/// Removes one pin from each of `blocks`.
fn unpin(cache: &mut RadixCache, blocks: &[u32]) {
    for &block in blocks {
        cache.change_pins(block, -1);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_released_prompt_is_hit_then_evicted_only_when_needed() {
        let mut pool = KvPool::new(5, 2, true); // 4 usable blocks of 2 tokens
        let mut activity = CacheActivity::default();
        let tokens = [1, 2, 3, 4, 5];
        let blocks = pool.allocate(3, &mut activity).expect("free");
        pool.cache(0, &tokens, &blocks, &mut activity);
        assert_eq!(activity.num_inserted_blocks, 2, "the partial last block is not cached");
        pool.release(&blocks);
        assert_eq!(pool.num_free_blocks(), 2);
        assert_eq!(
            pool.num_available_blocks(),
            4,
            "cached blocks nobody holds are available"
        );
        let hit = pool.match_prefix(0, &[1, 2, 3, 4, 9], 4);
        assert_eq!(hit.blocks, blocks[..2]);
        assert_eq!(
            pool.match_prefix(0, &tokens, 3).num_tokens,
            2,
            "capped below max_tokens"
        );
        assert_eq!(
            pool.match_prefix(7, &tokens, 5).num_tokens,
            0,
            "another salt sees nothing"
        );
        assert_eq!(pool.num_evictable_among(&hit.blocks), 2);
        pool.attach(&hit.blocks);
        assert_eq!(pool.num_available_blocks(), 2);
        assert_eq!(
            pool.num_freeable(&hit.blocks),
            2,
            "they become evictable again when released"
        );
        // Allocating everything that is left evicts nothing the hit holds.
        let rest = pool.allocate(2, &mut activity).expect("free");
        assert_eq!(activity.num_evicted_blocks, 0);
        assert!(pool.allocate(1, &mut activity).is_none());
        pool.release(&hit.blocks);
        let evicting = pool.allocate(2, &mut activity).expect("evicts the cached prompt");
        assert_eq!(activity.num_evicted_blocks, 2);
        pool.release(&rest);
        pool.release(&evicting);
        pool.check_invariants();
        assert_eq!(pool.num_free_blocks(), 4);
    }

    #[test]
    fn events_say_blocks_left_the_cache_before_an_allocation_reuses_them() {
        let mut pool = KvPool::new(4, 2, true); // 3 usable blocks of 2 tokens
        pool.record_events();
        let mut activity = CacheActivity::default();
        let blocks = pool.allocate(3, &mut activity).expect("free");
        pool.cache(0, &[1, 2, 3, 4, 5, 6], &blocks, &mut activity);
        pool.release(&blocks);
        let events = pool.take_events();
        let [KvEvent::AllCleared, KvEvent::Stored { block_hashes, .. }] = &events[..] else {
            panic!("cleared, then the sequence's blocks stored: {events:?}");
        };
        let reused = pool.allocate(2, &mut activity).expect("evicts");
        let mut expected = blocks[1..].to_vec();
        let mut got = reused.clone();
        expected.sort_unstable();
        got.sort_unstable();
        assert_eq!(got, expected, "the two leaves of the chain are evicted and reused");
        assert_eq!(
            pool.take_events(),
            vec![KvEvent::Removed {
                block_hashes: vec![block_hashes[2], block_hashes[1]]
            }]
        );
        pool.release(&reused);
        pool.check_invariants();

        let mut uncached = KvPool::new(4, 2, false);
        uncached.record_events();
        let blocks = uncached.allocate(3, &mut activity).expect("free");
        uncached.cache(0, &[1, 2, 3, 4, 5, 6], &blocks, &mut activity);
        assert_eq!(uncached.take_events(), vec![], "no prefix cache, no events");
        assert_eq!(uncached.snapshot_events(), vec![]);
    }

    fn pin_key(name: &str) -> PinKey {
        PinKey {
            salt: 0,
            key: name.into(),
        }
    }

    /// Runs a sequence of `tokens` on fresh blocks, caches it and releases it, as a finished request does.
    fn finish(pool: &mut KvPool, tokens: &[u32]) -> Vec<u32> {
        let mut activity = CacheActivity::default();
        let blocks = pool.allocate(tokens.len().div_ceil(2), &mut activity).expect("room");
        pool.cache(0, tokens, &blocks, &mut activity);
        pool.release(&blocks);
        blocks
    }

    #[test]
    fn a_pin_keeps_its_prefix_through_churn_until_it_expires() {
        let now = Instant::now();
        let mut pool = KvPool::new(9, 2, true).with_max_pinned_fraction(0.5); // 8 blocks, 4 pinnable
        let session = finish(&mut pool, &[1, 2, 3, 4, 5]);
        let outcome = pool.pin(pin_key("s"), &[1, 2, 3, 4, 5], now + Duration::from_secs(10));
        assert_eq!(outcome.num_blocks, 2, "the partial block is not cached, so not pinned");
        assert_eq!((pool.num_pins(), pool.num_pinned_blocks()), (1, 2));
        assert_eq!(
            pool.num_available_blocks(),
            8,
            "pinned blocks are available, as a last resort"
        );
        // Other traffic churns every unpinned block, twice over: the pinned prefix stays.
        let mut activity = CacheActivity::default();
        for round in 0..2 {
            let other: Vec<u32> = (0..12).map(|t| 100 + round * 20 + t).collect();
            finish(&mut pool, &other);
            pool.check_invariants();
        }
        assert_eq!(pool.match_prefix(0, &[1, 2, 3, 4, 5], 5).blocks, session[..2]);
        assert_eq!(pool.expire_pins(now + Duration::from_secs(9)), 0);
        assert_eq!(pool.next_pin_deadline(), Some(now + Duration::from_secs(10)));
        assert_eq!(pool.expire_pins(now + Duration::from_secs(10)), 1);
        assert_eq!((pool.num_pins(), pool.num_pinned_blocks()), (0, 0));
        let taken = pool.allocate(8, &mut activity).expect("everything is evictable again");
        assert_eq!(activity.num_pins_released_under_pressure, 0);
        pool.release(&taken);
        pool.check_invariants();
    }

    #[test]
    fn the_next_turn_replaces_the_pin_and_shared_blocks_stay_kept() {
        let now = Instant::now();
        let mut pool = KvPool::new(17, 2, true).with_max_pinned_fraction(0.5);
        finish(&mut pool, &[1, 2, 3, 4]);
        pool.pin(pin_key("s"), &[1, 2, 3, 4], now + Duration::from_secs(10));
        let turn2 = finish(&mut pool, &[1, 2, 3, 4, 5, 6, 7, 8]);
        pool.pin(pin_key("s"), &[1, 2, 3, 4, 5, 6, 7, 8], now + Duration::from_secs(20));
        assert_eq!((pool.num_pins(), pool.num_pinned_blocks()), (1, 4));
        assert_eq!(pool.next_pin_deadline(), Some(now + Duration::from_secs(20)));
        // Another salt's pin of the same key is another pin.
        let salted = PinKey {
            salt: 3,
            key: "s".into(),
        };
        assert_eq!(
            pool.pin(salted, &[1, 2, 3, 4], now).num_blocks,
            0,
            "nothing cached under salt 3"
        );
        let mut activity = CacheActivity::default();
        let taken = pool.allocate(12, &mut activity).expect("the unpinned blocks");
        assert_eq!(activity.num_pins_released_under_pressure, 0);
        let hit = pool.match_prefix(0, &[1, 2, 3, 4, 5, 6, 7, 8], 8);
        assert_eq!(hit.num_tokens, 8);
        assert_eq!(hit.blocks.len(), 4);
        assert!(hit.blocks[2..] == turn2[2..], "the second turn's own blocks");
        pool.release(&taken);
        pool.check_invariants();
    }

    #[test]
    fn pins_beyond_the_bound_release_the_oldest_and_a_long_prefix_is_cut() {
        let now = Instant::now();
        let deadline = now + Duration::from_secs(10);
        let mut pool = KvPool::new(21, 2, true).with_max_pinned_fraction(0.25); // 20 blocks, 5 pinnable
        assert_eq!(pool.max_pinned_blocks(), 5);
        finish(&mut pool, &[1, 1, 2, 2]);
        finish(&mut pool, &[3, 3, 4, 4]);
        finish(&mut pool, &[5, 5, 6, 6, 7, 7]);
        assert_eq!(
            pool.pin(pin_key("a"), &[1, 1, 2, 2], deadline).num_released_for_bound,
            0
        );
        assert_eq!(
            pool.pin(pin_key("b"), &[3, 3, 4, 4], deadline).num_released_for_bound,
            0
        );
        let outcome = pool.pin(pin_key("c"), &[5, 5, 6, 6, 7, 7], deadline);
        assert_eq!(outcome.num_released_for_bound, 1, "a, the oldest, goes");
        assert_eq!((pool.num_pins(), pool.num_pinned_blocks()), (2, 5));
        let long: Vec<u32> = (0..16).collect();
        let blocks = finish(&mut pool, &long);
        let outcome = pool.pin(pin_key("d"), &long, deadline);
        assert_eq!(outcome.num_blocks, 5, "cut to the bound");
        assert_eq!(outcome.num_released_for_bound, 2);
        assert_eq!(pool.num_pinned_blocks(), 5);
        pool.check_invariants();
        let mut activity = CacheActivity::default();
        let taken = pool.allocate(15, &mut activity).expect("the unpinned blocks");
        assert_eq!(pool.match_prefix(0, &long, 16).blocks, blocks[..5]);
        pool.release(&taken);
        // Without a prefix cache nothing is pinned.
        let mut uncached = KvPool::new(21, 2, false).with_max_pinned_fraction(0.25);
        assert_eq!(uncached.max_pinned_blocks(), 0);
        assert_eq!(uncached.pin(pin_key("a"), &[1, 1], deadline), PinOutcome::default());
    }

    #[test]
    fn under_pressure_unpinned_blocks_go_first_then_the_pin_that_lapses_first() {
        let now = Instant::now();
        let mut pool = KvPool::new(11, 2, true).with_max_pinned_fraction(0.5); // 10 blocks, 5 pinnable
        finish(&mut pool, &[1, 1, 2, 2]);
        finish(&mut pool, &[3, 3, 4, 4]);
        finish(&mut pool, &[9, 9, 8, 8]);
        pool.pin(pin_key("late"), &[1, 1, 2, 2], now + Duration::from_secs(20));
        pool.pin(pin_key("soon"), &[3, 3, 4, 4], now + Duration::from_secs(10));
        let mut activity = CacheActivity::default();
        let first = pool.allocate(6, &mut activity).expect("free and unpinned blocks");
        assert_eq!(
            (activity.num_evicted_blocks, activity.num_pins_released_under_pressure),
            (2, 0)
        );
        let second = pool
            .allocate(1, &mut activity)
            .expect("a pinned block, its pin released");
        assert_eq!(activity.num_pins_released_under_pressure, 1);
        assert_eq!(pool.num_pins(), 1);
        assert_eq!(
            pool.match_prefix(0, &[3, 3, 4, 4], 4).num_tokens,
            2,
            "soon's tail was evicted"
        );
        assert_eq!(pool.match_prefix(0, &[1, 1, 2, 2], 4).num_tokens, 4, "late is whole");
        assert_eq!(pool.num_available_blocks(), 3);
        let third = pool.allocate(3, &mut activity).expect("the rest");
        assert_eq!(activity.num_pins_released_under_pressure, 2);
        assert!(pool.allocate(1, &mut activity).is_none());
        for blocks in [first, second, third] {
            pool.release(&blocks);
        }
        pool.check_invariants();
        assert_eq!(pool.num_available_blocks(), 10);
    }

    /// A sequence of `num_tokens` tokens decoded one by one with a window of `window` tokens on blocks of
    /// 2, releasing out of the window before each step as the engine does; returns its block table.
    fn decode_windowed(pool: &mut KvPool, tokens: &[u32], window: usize, max_held: usize) -> Vec<u32> {
        let block_size = 2;
        let mut activity = CacheActivity::default();
        let mut blocks: Vec<u32> = Vec::new();
        for next in 0..tokens.len() {
            let num_dead = (next + 1).saturating_sub(window) / block_size;
            pool.release_out_of_window(0, &tokens[..next], &mut blocks, num_dead, &mut activity);
            if blocks.len() * block_size <= next {
                blocks.extend(pool.allocate(1, &mut activity).expect("room"));
            }
            let num_held = blocks.iter().filter(|&&b| b != 0).count();
            assert!(num_held <= max_held, "{num_held} blocks held at position {next}");
            assert!(blocks[..num_dead].iter().all(|&b| b == 0));
            pool.check_invariants();
        }
        blocks
    }

    #[test]
    fn a_windowed_sequence_holds_its_window_and_the_cache_keeps_whole_chains() {
        // Window 5 on blocks of 2: at most ceil(5 / 2) + 1 = 4 blocks held at once.
        let mut pool = KvPool::new(41, 2, true);
        let tokens: Vec<u32> = (0..60).collect();
        let blocks = decode_windowed(&mut pool, &tokens, 5, 4);
        let mut activity = CacheActivity::default();
        pool.cache(0, &tokens, &blocks, &mut activity);
        pool.release(&blocks);
        pool.check_invariants();
        // Every released block went to the cache first: the whole path hits, as a chain of real blocks.
        let hit = pool.match_prefix(0, &tokens, 60);
        assert_eq!(hit.num_tokens, 60);
        assert!(!hit.blocks.contains(&0));
        assert_eq!(pool.num_available_blocks(), 40);
        // Under pressure the cache evicts the chain's tail first; a later windowed run over the same
        // tokens re-inserts only what hangs off a complete chain, never a null entry.
        let other: Vec<u32> = (100..140).collect();
        let blocks = decode_windowed(&mut pool, &other, 5, 4);
        pool.release(&blocks);
        let taken = pool.allocate(30, &mut activity).expect("evicts");
        let hit = pool.match_prefix(0, &tokens, 60);
        assert!(!hit.blocks.contains(&0));
        pool.release(&taken);
        let blocks = decode_windowed(&mut pool, &tokens, 5, 4);
        pool.cache(0, &tokens, &blocks, &mut activity);
        pool.release(&blocks);
        pool.check_invariants();
        let hit = pool.match_prefix(0, &tokens, 60);
        assert!(!hit.blocks.contains(&0));
        assert_eq!(hit.blocks.len() * 2, hit.num_tokens);
        assert_eq!(pool.num_available_blocks(), 40);
    }

    #[test]
    fn without_prefix_caching_released_blocks_are_free_at_once() {
        let mut pool = KvPool::new(41, 2, false);
        let tokens: Vec<u32> = (0..60).collect();
        let blocks = decode_windowed(&mut pool, &tokens, 4, 3);
        assert_eq!(
            pool.num_free_blocks() as usize,
            40 - blocks.iter().filter(|&&b| b != 0).count()
        );
        pool.release(&blocks);
        assert_eq!(pool.num_free_blocks(), 40);
    }

    #[test]
    fn without_prefix_caching_nothing_is_cached() {
        let mut pool = KvPool::new(5, 2, false);
        let mut activity = CacheActivity::default();
        let blocks = pool.allocate(2, &mut activity).expect("free");
        pool.cache(0, &[1, 2, 3, 4], &blocks, &mut activity);
        pool.release(&blocks);
        assert_eq!(pool.match_prefix(0, &[1, 2, 3, 4], 4).num_tokens, 0);
        assert_eq!(pool.num_free_blocks(), 4);
    }
}
