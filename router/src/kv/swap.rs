//! The host side of swap preemption: which blocks of the shards' host swap pools are free, and the block
//! copies that move a sequence's K/V out of the device pool and back. The shards hold the tensors and run
//! the copies (in the next forward call, before the forward); the engine decides them here.
//!
//! A swapped-out sequence is self-contained: every block covering its computed tokens is copied to its own
//! host block, even blocks it shares with the prefix cache or a sibling (those stay on the device for their
//! other holders, released normally). It is restored into fresh device blocks, so it never depends on what
//! happened to the device pool meanwhile.

use crate::{
    kv::BlockAllocator,
    scheduler::{choose_preemption, Preemption, PreemptionCosts, PreemptionMode},
    shard::pb,
};

/// How preemption works, with what the shards measured at warmup.
#[derive(Debug, Clone, Copy)]
pub struct PreemptionConfig {
    pub mode: PreemptionMode,
    /// Host blocks of the swap pool, as Warmup reported (the unused block 0 included); 0 = no swap pool.
    pub num_host_blocks: u32,
    pub costs: PreemptionCosts,
}

impl PreemptionConfig {
    /// The settings for `mode` given the shards' Warmup answer.
    pub fn from_warmup(mode: PreemptionMode, warmup: &pb::WarmupResponse) -> Self {
        Self {
            mode,
            num_host_blocks: warmup.num_host_blocks,
            costs: PreemptionCosts {
                swap_seconds_per_block: f64::from(warmup.swap_seconds_per_block),
                prefill_seconds_per_token: f64::from(warmup.prefill_seconds_per_token),
            },
        }
    }
}

pub struct SwapPool {
    config: PreemptionConfig,
    /// Host block ids; like the device allocator, id 0 is never handed out.
    allocator: BlockAllocator,
}

impl SwapPool {
    pub fn new(config: PreemptionConfig) -> Self {
        Self {
            allocator: BlockAllocator::new(config.num_host_blocks.max(1)),
            config,
        }
    }

    pub fn mode(&self) -> PreemptionMode {
        self.config.mode
    }

    pub fn num_usable_blocks(&self) -> u32 {
        self.allocator.num_usable_blocks()
    }

    pub fn num_free_blocks(&self) -> u32 {
        self.allocator.num_free_blocks()
    }

    /// The mechanism for a victim whose computed tokens fill `num_blocks` blocks (see `choose_preemption`).
    pub fn choose(&self, num_blocks: usize, num_computed_tokens: usize) -> Preemption {
        choose_preemption(
            self.config.mode,
            self.config.costs,
            num_blocks,
            num_computed_tokens,
            self.allocator.num_free_blocks() as usize,
        )
    }

    /// Takes a host block for each device block and returns them with the copies that fill them; `None`
    /// (nothing taken) when the pool is short.
    pub fn swap_out(&mut self, device_blocks: &[u32]) -> Option<(Vec<u32>, Vec<pb::BlockCopy>)> {
        let host_blocks = self.allocator.allocate(device_blocks.len() as u32)?;
        let copies = copies(device_blocks, &host_blocks);
        Some((host_blocks, copies))
    }

    /// The copies restoring `host_blocks` into `device_blocks`; the host blocks are free again afterwards
    /// (the copies run before anything in a later call could overwrite them).
    pub fn swap_in(&mut self, host_blocks: &[u32], device_blocks: &[u32]) -> Vec<pb::BlockCopy> {
        self.release(host_blocks);
        copies(device_blocks, host_blocks)
    }

    /// Returns host blocks whose sequence is gone (cancelled or failed while swapped out).
    pub fn release(&mut self, host_blocks: &[u32]) {
        self.allocator
            .free(host_blocks)
            .expect("a swapped sequence only holds host blocks it was given");
    }

    pub fn check_invariants(&self) {
        self.allocator.check_invariants();
    }
}

fn copies(device_blocks: &[u32], host_blocks: &[u32]) -> Vec<pb::BlockCopy> {
    debug_assert_eq!(device_blocks.len(), host_blocks.len());
    device_blocks
        .iter()
        .zip(host_blocks)
        .map(|(&device_block, &host_block)| pb::BlockCopy {
            device_block,
            host_block,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(num_host_blocks: u32, mode: PreemptionMode) -> SwapPool {
        SwapPool::new(PreemptionConfig {
            mode,
            num_host_blocks,
            costs: PreemptionCosts::default(),
        })
    }

    #[test]
    fn blocks_go_out_and_come_back_and_the_pool_is_whole() {
        let mut swap = pool(5, PreemptionMode::Swap); // 4 usable host blocks
        assert_eq!(swap.choose(3, 12), Preemption::Swap);
        let (host, out) = swap.swap_out(&[7, 3, 9]).expect("room");
        assert_eq!(out.len(), 3);
        assert!(out.iter().zip(&host).all(|(c, &h)| c.host_block == h && h != 0));
        assert_eq!(swap.choose(2, 8), Preemption::Recompute, "only one host block left");
        assert!(swap.swap_out(&[1, 2]).is_none());
        let back = swap.swap_in(&host, &[11, 12, 13]);
        assert_eq!(
            back.iter().map(|c| (c.device_block, c.host_block)).collect::<Vec<_>>(),
            vec![(11, host[0]), (12, host[1]), (13, host[2])]
        );
        swap.check_invariants();
        assert_eq!(swap.num_free_blocks(), 4);
    }

    #[test]
    fn without_a_swap_pool_everything_is_recomputed() {
        let swap = pool(0, PreemptionMode::Swap);
        assert_eq!(swap.num_usable_blocks(), 0);
        assert_eq!(swap.choose(1, 4), Preemption::Recompute);
    }
}
