//! KV memory owned by the router: which blocks of the shards' KV pools are free and which hold a sequence,
//! and the prefix cache of blocks already computed for token prefixes.
//! Plain data structures, no I/O; the scheduler consults them and the engine loop applies its plans to them.

mod block_allocator;
mod pool;
mod radix;

pub use block_allocator::BlockAllocator;
pub use pool::{CacheActivity, KvPool};
pub use radix::{PrefixMatch, RadixCache};
