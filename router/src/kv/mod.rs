//! KV memory owned by the router: which blocks of the shards' KV pools are free and which hold a sequence,
//! the prefix cache of blocks already computed for token prefixes, and the host swap pool that preempted
//! sequences' K/V are copied to.
//! Plain data structures, no I/O; the scheduler consults them and the engine loop applies its plans to them.

mod block_allocator;
mod pool;
mod radix;
mod swap;

pub use block_allocator::BlockAllocator;
pub use pool::{CacheActivity, KvPool};
pub use radix::{PrefixMatch, RadixCache};
pub use swap::{BlockCopy, SwapPool};
