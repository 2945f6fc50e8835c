//! What the prefix cache tells the world about its blocks: vLLM's KV-cache events (`BlockStored`,
//! `BlockRemoved`, `AllBlocksCleared`), recorded by [`RadixCache`](super::RadixCache) as it changes, so a
//! gateway's indexer (llm-d's) knows exactly which prefixes this replica holds. Plain data: the engine
//! drains them after each step and `kv_events` puts them on the wire.
//!
//! A block is named by its hash ([`block_hash`]): a chain over its namespace, its ancestors' tokens and its
//! own, so equal prefixes have equal hashes and a hash names one block of the tree. Never 0: llm-d reads a
//! parent hash of 0 as "no parent".

use std::hash::{DefaultHasher, Hash, Hasher};

/// One change to the set of cached blocks, in the order it happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks entered the cache: a chain in path order, each the child of the one before it, the first the
    /// child of `parent_block_hash` (None: the first block of a prompt).
    Stored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        /// The blocks' token ids, `block_size` per block, in order.
        token_ids: Vec<u32>,
        /// The prefix-cache namespace (`cache_salt` and LoRA adapter; 0 = shared) the chain belongs to.
        namespace: u64,
    },
    /// Blocks left the cache (evicted: their KV blocks are about to be reused), leaves before parents.
    Removed { block_hashes: Vec<u64> },
    /// Every cached block is gone: the recording starts (at start, and with the fresh pool after the
    /// shards restarted), so subscribers forget whatever an earlier cache held.
    AllCleared,
}

/// The hash of the block holding `tokens` whose parent block has hash `parent` (for a first block: the
/// namespace). SipHash with fixed keys: the same for the same input within one build, which is all
/// subscribers need (they only compare hashes this router sent).
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut hasher = DefaultHasher::new();
    (parent, tokens).hash(&mut hasher);
    hasher.finish().max(1)
}
