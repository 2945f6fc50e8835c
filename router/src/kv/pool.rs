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

use super::{BlockAllocator, PrefixMatch, RadixCache};

/// What one operation did to the cache, for the metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CacheActivity {
    pub num_inserted_blocks: usize,
    pub num_evicted_blocks: usize,
}

pub struct KvPool {
    allocator: BlockAllocator,
    cache: Option<RadixCache>,
}

impl KvPool {
    /// `num_blocks` as Warmup reported (the null block included); `prefix_caching` turns the cache on.
    pub fn new(num_blocks: u32, block_size: usize, prefix_caching: bool) -> Self {
        Self {
            allocator: BlockAllocator::new(num_blocks),
            cache: prefix_caching.then(|| RadixCache::new(block_size)),
        }
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

    /// Blocks an allocation can get now: free ones plus evictable cached ones. O(1).
    pub fn num_available_blocks(&self) -> usize {
        let num_evictable = self.cache.as_ref().map_or(0, RadixCache::num_evictable);
        self.allocator.num_free_blocks() as usize + num_evictable
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

    /// Takes `num_blocks` blocks, evicting least recently used cached blocks when the free list is short.
    pub fn allocate(&mut self, num_blocks: usize, activity: &mut CacheActivity) -> Option<Vec<u32>> {
        let num_free = self.allocator.num_free_blocks() as usize;
        if num_free < num_blocks {
            if let Some(cache) = self.cache.as_mut() {
                let evicted = cache.evict(num_blocks - num_free);
                self.allocator
                    .free(&evicted)
                    .expect("the cache held the blocks it evicted");
                activity.num_evicted_blocks += evicted.len();
            }
        }
        self.allocator.allocate(num_blocks as u32)
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
    /// sequence exactly when the allocator counts a holder besides the cache.
    pub fn check_invariants(&self) {
        self.allocator.check_invariants();
        if let Some(cache) = &self.cache {
            cache.check_invariants();
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

#[cfg(test)]
mod tests {
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
