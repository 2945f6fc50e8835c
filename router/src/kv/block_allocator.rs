//! The pool of KV block ids. The shards hold the tensors; the router decides which ids are in use.
//!
//! Block 0 is the null block: the shards reserve it (padding slots, health checks), so it is never handed
//! out. The usable pool is therefore `num_blocks - 1` blocks, where `num_blocks` is Warmup's answer.
//!
//! Blocks are reference counted: sequences that share a prefix (the choices of an `n > 1` request) hold
//! the same full blocks, and a block returns to the free list when its last holder lets go.

use thiserror::Error;

/// Errors from returning blocks the allocator did not hand out; they mean a bug in the caller.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BlockError {
    #[error("block {0} is outside the pool")]
    OutOfRange(u32),
    #[error("block {0} is not in use")]
    NotInUse(u32),
}

/// A free list over block ids `1..num_blocks`, with a reference count per block.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    num_blocks: u32,
    free: Vec<u32>,
    /// Holders of each block; 0 exactly when the block is on the free list (the null block aside).
    ref_counts: Vec<u32>,
}

impl BlockAllocator {
    /// A pool of `num_blocks` blocks, block 0 (the null block) included and never allocated.
    pub fn new(num_blocks: u32) -> Self {
        // Pop from the end: hand out low ids first, which keeps small test pools easy to read.
        let free: Vec<u32> = (1..num_blocks).rev().collect();
        Self {
            num_blocks,
            free,
            ref_counts: vec![0; num_blocks as usize],
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

    /// Takes `num_blocks` free blocks (each with one holder), or none at all when fewer are free.
    pub fn allocate(&mut self, num_blocks: u32) -> Option<Vec<u32>> {
        if !self.can_allocate(num_blocks) {
            return None;
        }
        let blocks = self.free.split_off(self.free.len() - num_blocks as usize);
        for &block in &blocks {
            self.ref_counts[block as usize] = 1;
        }
        Some(blocks)
    }

    fn check_in_use(&self, blocks: &[u32]) -> Result<(), BlockError> {
        for &block in blocks {
            if block == 0 || block >= self.num_blocks {
                return Err(BlockError::OutOfRange(block));
            }
            if self.ref_counts[block as usize] == 0 {
                return Err(BlockError::NotInUse(block));
            }
        }
        Ok(())
    }

    /// Adds a holder to blocks already in use. Fails, changing nothing, if any is not in use.
    pub fn share(&mut self, blocks: &[u32]) -> Result<(), BlockError> {
        self.check_in_use(blocks)?;
        for &block in blocks {
            self.ref_counts[block as usize] += 1;
        }
        Ok(())
    }

    /// Drops one holder of each block; blocks left without holders return to the pool. Fails, changing
    /// nothing, if any block is not in use (a block may appear more than once if held that many times).
    pub fn free(&mut self, blocks: &[u32]) -> Result<(), BlockError> {
        self.check_in_use(blocks)?;
        for (i, &block) in blocks.iter().enumerate() {
            let times = blocks[..=i].iter().filter(|&&b| b == block).count() as u32;
            if times > self.ref_counts[block as usize] {
                return Err(BlockError::NotInUse(block));
            }
        }
        for &block in blocks {
            let count = &mut self.ref_counts[block as usize];
            *count -= 1;
            if *count == 0 {
                self.free.push(block);
            }
        }
        Ok(())
    }

    /// Holders of `block`: 0 for a free block, the null block, or an id outside the pool.
    pub fn ref_count(&self, block: u32) -> u32 {
        self.ref_counts.get(block as usize).copied().unwrap_or(0)
    }

    /// Panics if the free list and the reference counts disagree. Called after every step in debug builds.
    pub fn check_invariants(&self) {
        let mut seen = vec![false; self.num_blocks as usize];
        for &block in &self.free {
            assert!(block != 0 && block < self.num_blocks, "free block {block} out of range");
            assert!(!seen[block as usize], "block {block} is on the free list twice");
            assert_eq!(self.ref_counts[block as usize], 0, "free block {block} has holders");
            seen[block as usize] = true;
        }
        assert_eq!(
            self.ref_counts.first().copied().unwrap_or(0),
            0,
            "the null block has holders"
        );
        let num_held = self.ref_counts.iter().filter(|&&count| count > 0).count() as u32;
        assert_eq!(
            num_held + self.num_free_blocks(),
            self.num_usable_blocks(),
            "used + free != total"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn num_used(allocator: &BlockAllocator) -> u32 {
        allocator.num_usable_blocks() - allocator.num_free_blocks()
    }

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
        assert_eq!(allocator.free(&blocks), Err(BlockError::NotInUse(blocks[0])));
        let more = allocator.allocate(1).expect("free");
        assert_eq!(allocator.free(&[more[0], more[0]]), Err(BlockError::NotInUse(more[0])));
        allocator.check_invariants();
        assert_eq!(num_used(&allocator), 1);
    }

    #[test]
    fn shared_blocks_return_when_the_last_holder_lets_go() {
        let mut allocator = BlockAllocator::new(8);
        let blocks = allocator.allocate(3).expect("free");
        allocator.share(&blocks[..2]).expect("in use");
        assert_eq!(
            blocks.iter().map(|&b| allocator.ref_count(b)).collect::<Vec<_>>(),
            vec![2, 2, 1]
        );
        allocator.free(&blocks).expect("parent lets go");
        assert_eq!(num_used(&allocator), 2);
        allocator.free(&blocks[..2]).expect("child lets go");
        assert_eq!(num_used(&allocator), 0);
        assert_eq!(allocator.share(&blocks[..1]), Err(BlockError::NotInUse(blocks[0])));
        allocator.check_invariants();
    }

    #[test]
    fn random_allocate_share_free_keeps_invariants() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut allocator = BlockAllocator::new(64);
        let mut owned: Vec<Vec<u32>> = Vec::new();
        for _ in 0..20_000 {
            let roll = rng.random_range(0..100);
            if roll < 45 {
                let n = rng.random_range(0..6);
                if let Some(blocks) = allocator.allocate(n) {
                    owned.push(blocks);
                }
            } else if roll < 60 && !owned.is_empty() {
                let i = rng.random_range(0..owned.len());
                let prefix = owned[i][..rng.random_range(0..=owned[i].len())].to_vec();
                allocator.share(&prefix).expect("owned blocks are in use");
                owned.push(prefix);
            } else if !owned.is_empty() {
                let i = rng.random_range(0..owned.len());
                let blocks = owned.swap_remove(i);
                allocator.free(&blocks).expect("owned blocks free cleanly");
            }
            allocator.check_invariants();
            let mut distinct: Vec<u32> = owned.iter().flatten().copied().collect();
            distinct.sort_unstable();
            distinct.dedup();
            assert_eq!(distinct.len() as u32, num_used(&allocator));
        }
    }
}
