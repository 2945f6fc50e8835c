//! The host side of swap preemption: which blocks of the shards' host swap pools are free, and the block
//! copies that move a sequence's K/V out of the device pool and back. The shards hold the tensors and run
//! the copies (in the next forward call, before the forward); the scheduler decides which sequence swaps,
//! the engine asks for its copies here.
//!
//! A swapped-out sequence is self-contained: every block covering its computed tokens is copied to its own
//! host block, even blocks it shares with the prefix cache or a sibling (those stay on the device for their
//! other holders, released normally). It is restored into fresh device blocks, so it never depends on what
//! happened to the device pool meanwhile.

use super::BlockAllocator;

/// One block's copy between the device pool and the host swap pool (the direction is the caller's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub device_block: u32,
    pub host_block: u32,
}

pub struct SwapPool {
    /// Host block ids; like the device allocator, id 0 is never handed out.
    allocator: BlockAllocator,
}

impl SwapPool {
    /// A pool of `num_host_blocks` host blocks, as Warmup reported (the unused block 0 included); 0 = no
    /// swap pool.
    pub fn new(num_host_blocks: u32) -> Self {
        Self {
            allocator: BlockAllocator::new(num_host_blocks.max(1)),
        }
    }

    pub fn num_usable_blocks(&self) -> u32 {
        self.allocator.num_usable_blocks()
    }

    pub fn num_free_blocks(&self) -> u32 {
        self.allocator.num_free_blocks()
    }

    /// Takes a host block for each device block and returns them with the copies that fill them; `None`
    /// (nothing taken) when the pool is short.
    pub fn swap_out(&mut self, device_blocks: &[u32]) -> Option<(Vec<u32>, Vec<BlockCopy>)> {
        let host_blocks = self.allocator.allocate(device_blocks.len() as u32)?;
        let copies = copies(device_blocks, &host_blocks);
        Some((host_blocks, copies))
    }

    /// The copies restoring `host_blocks` into `device_blocks`; the host blocks are free again afterwards
    /// (the copies run before anything in a later call could overwrite them).
    pub fn swap_in(&mut self, host_blocks: &[u32], device_blocks: &[u32]) -> Vec<BlockCopy> {
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

fn copies(device_blocks: &[u32], host_blocks: &[u32]) -> Vec<BlockCopy> {
    debug_assert_eq!(device_blocks.len(), host_blocks.len());
    device_blocks
        .iter()
        .zip(host_blocks)
        .map(|(&device_block, &host_block)| BlockCopy {
            device_block,
            host_block,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_go_out_and_come_back_and_the_pool_is_whole() {
        let mut swap = SwapPool::new(5); // 4 usable host blocks
        let (host, out) = swap.swap_out(&[7, 3, 9]).expect("room");
        assert_eq!(out.len(), 3);
        assert!(out.iter().zip(&host).all(|(c, &h)| c.host_block == h && h != 0));
        assert_eq!(swap.num_free_blocks(), 1);
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
    fn without_a_swap_pool_there_is_no_host_block() {
        let swap = SwapPool::new(0);
        assert_eq!(swap.num_usable_blocks(), 0);
        assert_eq!(swap.num_free_blocks(), 0);
    }
}
