//! The pool of KV block ids. The shards hold the tensors; the router decides which ids are in use.
//!
//! Block 0 is the null block: the shards reserve it (padding slots, health checks), so it is never handed
//! out. The usable pool is therefore `num_blocks - 1` blocks, where `num_blocks` is Warmup's answer.

use thiserror::Error;

/// Errors from returning blocks the allocator did not hand out; they mean a bug in the caller.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BlockError {
    #[error("block {0} is outside the pool")]
    OutOfRange(u32),
    #[error("block {0} was freed twice")]
    DoubleFree(u32),
}

/// A free list over block ids `1..num_blocks`, with an ownership bit per block to catch double frees.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    num_blocks: u32,
    free: Vec<u32>,
    is_used: Vec<bool>,
}

impl BlockAllocator {
    /// A pool of `num_blocks` blocks, block 0 (the null block) included and never allocated.
    pub fn new(num_blocks: u32) -> Self {
        // Pop from the end: hand out low ids first, which keeps small test pools easy to read.
        let free: Vec<u32> = (1..num_blocks).rev().collect();
        let mut is_used = vec![false; num_blocks as usize];
        if let Some(null) = is_used.first_mut() {
            *null = true;
        }
        Self {
            num_blocks,
            free,
            is_used,
        }
    }

    /// Blocks a sequence can ever use: the pool minus the null block.
    pub fn num_usable_blocks(&self) -> u32 {
        self.num_blocks.saturating_sub(1)
    }

    pub fn num_free_blocks(&self) -> u32 {
        self.free.len() as u32
    }

    pub fn can_allocate(&self, num_blocks: u32) -> bool {
        num_blocks <= self.num_free_blocks()
    }

    /// Takes `num_blocks` free blocks, or none at all when fewer are free.
    pub fn allocate(&mut self, num_blocks: u32) -> Option<Vec<u32>> {
        if !self.can_allocate(num_blocks) {
            return None;
        }
        let blocks = self.free.split_off(self.free.len() - num_blocks as usize);
        for &block in &blocks {
            self.is_used[block as usize] = true;
        }
        Some(blocks)
    }

    /// Returns blocks to the pool. Fails, changing nothing, if any block is not currently in use.
    pub fn free(&mut self, blocks: &[u32]) -> Result<(), BlockError> {
        for (i, &block) in blocks.iter().enumerate() {
            if block == 0 || block >= self.num_blocks {
                return Err(BlockError::OutOfRange(block));
            }
            if !self.is_used[block as usize] || blocks[..i].contains(&block) {
                return Err(BlockError::DoubleFree(block));
            }
        }
        for &block in blocks {
            self.is_used[block as usize] = false;
            self.free.push(block);
        }
        Ok(())
    }

    /// Panics if the free list and the ownership bits disagree. Called after every step in debug builds.
    pub fn check_invariants(&self) {
        let mut seen = vec![false; self.num_blocks as usize];
        for &block in &self.free {
            assert!(
                block != 0 && block < self.num_blocks,
                "free block {block} out of range"
            );
            assert!(
                !seen[block as usize],
                "block {block} is on the free list twice"
            );
            assert!(
                !self.is_used[block as usize],
                "free block {block} is marked used"
            );
            seen[block as usize] = true;
        }
        let num_marked_used = self.is_used.iter().filter(|&&used| used).count() as u32;
        assert_eq!(
            num_marked_used,
            self.num_blocks - self.num_free_blocks(),
            "used + free != total"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    #[test]
    fn never_hands_out_the_null_block() {
        let mut allocator = BlockAllocator::new(4);
        assert_eq!(allocator.num_usable_blocks(), 3);
        let blocks = allocator.allocate(3).expect("three blocks are free");
        assert!(!blocks.contains(&0));
        assert_eq!(allocator.allocate(1), None);
        assert_eq!(allocator.free(&[0]), Err(BlockError::OutOfRange(0)));
    }

    #[test]
    fn allocation_is_all_or_nothing() {
        let mut allocator = BlockAllocator::new(5);
        assert_eq!(allocator.allocate(5), None);
        assert_eq!(allocator.num_free_blocks(), 4);
    }

    #[test]
    fn double_free_is_refused_without_side_effects() {
        let mut allocator = BlockAllocator::new(8);
        let blocks = allocator.allocate(2).expect("free");
        allocator.free(&blocks).expect("first free");
        assert_eq!(
            allocator.free(&blocks),
            Err(BlockError::DoubleFree(blocks[0]))
        );
        let more = allocator.allocate(1).expect("free");
        assert_eq!(
            allocator.free(&[more[0], more[0]]),
            Err(BlockError::DoubleFree(more[0]))
        );
        allocator.check_invariants();
        assert_eq!(
            (allocator.num_usable_blocks() - allocator.num_free_blocks()),
            1
        );
    }

    #[test]
    fn random_allocate_free_keeps_invariants() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut allocator = BlockAllocator::new(64);
        let mut owned: Vec<Vec<u32>> = Vec::new();
        for _ in 0..20_000 {
            if rng.random_bool(0.55) {
                let n = rng.random_range(0..6);
                if let Some(blocks) = allocator.allocate(n) {
                    owned.push(blocks);
                }
            } else if !owned.is_empty() {
                let i = rng.random_range(0..owned.len());
                let blocks = owned.swap_remove(i);
                allocator.free(&blocks).expect("owned blocks free cleanly");
            }
            allocator.check_invariants();
            let num_owned: usize = owned.iter().map(Vec::len).sum();
            assert_eq!(
                num_owned as u32,
                (allocator.num_usable_blocks() - allocator.num_free_blocks())
            );
        }
    }
}
