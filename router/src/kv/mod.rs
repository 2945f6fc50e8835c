//! KV memory owned by the router: which blocks of the shards' KV pools are free and which hold a sequence,
//! the prefix cache of blocks already computed for token prefixes (with the session pins that keep some of
//! them from eviction for a while, and the KV-cache events it records for gateways), and the host swap
//! pool that preempted sequences' K/V are copied to.
//! Plain data structures, no I/O; the scheduler consults them and the engine loop applies its plans to them.

mod block_allocator;
mod events;
mod pins;
mod pool;
mod radix;
mod swap;

pub use block_allocator::BlockAllocator;
pub use events::KvEvent;
pub use pins::PinKey;
pub use pool::{CacheActivity, KvPool, PinOutcome};
pub use radix::{PrefixMatch, RadixCache};
pub use swap::{BlockCopy, SwapPool};

/// The sliding window (tokens) after which a running sequence's blocks are released, from the per-layer
/// windows the shard reports in Info (0 = full attention): the smallest window when every layer has one,
/// else 0 (a full-attention layer reads every position, so no block may go). Mixed models (Gemma 3's
/// local and global layers) therefore keep every block: that saving needs a block table per layer group.
pub fn kv_window(sliding_windows: &[u32]) -> usize {
    // The smallest window is 0 as soon as one layer has none.
    sliding_windows.iter().min().map_or(0, |&window| window as usize)
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_an_all_windowed_model_releases_blocks() {
        assert_eq!(super::kv_window(&[32, 32, 32]), 32);
        assert_eq!(super::kv_window(&[64, 32]), 32, "the smallest window");
        assert_eq!(
            super::kv_window(&[512, 0, 512]),
            0,
            "a full-attention layer keeps every block"
        );
        assert_eq!(super::kv_window(&[]), 0);
    }
}
