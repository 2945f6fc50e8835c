//! KV memory owned by the router: which blocks of the shards' KV pools are free and which hold a sequence.
//! Plain data structures, no I/O; the scheduler consults them and the engine loop applies its plans to them.

mod block_allocator;

pub use block_allocator::BlockAllocator;
