//! The prefix cache: a radix tree over token ids at KV-block granularity (SGLang's RadixAttention, TGI v3's
//! radix allocator), so a request whose prompt starts like an earlier one skips the prefill of those blocks.
//!
//! Each edge is exactly one full block of `block_size` token ids and each node is one KV block, the one whose
//! K/V were computed for the tokens on the path from the root to it. Partial blocks are never cached.
//!
//! ```text
//!   salt 0 ──[a b]── #7 ──[c d]── #3 ──[e f]── #9     "a b c d e f" and "a b c d g h" share #7 and #3
//!                                  └───[g h]── #4
//!   salt 5 ──[a b]── #12                            another salt never shares: separate subtrees
//! ```
//!
//! Ownership, with [`BlockAllocator`](super::BlockAllocator) reference counts:
//! - the cache is one holder of every block it contains: the caller shares (rc+1) exactly the ids
//!   [`RadixCache::insert`] returns, and frees exactly the ids [`RadixCache::evict`] returns;
//! - a sequence using cached blocks (after [`RadixCache::match_prefix`] and a share) is another holder.
//!   The cache never reads the allocator: the caller says through [`RadixCache::set_held`] whenever a
//!   cached block gains its first holder besides the cache or loses its last one (blocks enter the cache
//!   held, by the sequence that inserts them). Only blocks nobody else holds are evicted.
//!
//! Eviction is LRU over leaves: a node goes only after all its descendants, because a child's K/V are
//! only meaningful after its parent's. A held block is therefore *needed*, and so are its ancestors.
//! Besides sequences, session pins (`KvPool::pin`) may keep cached blocks: a pinned block is *kept*, and
//! so are its ancestors, but nobody reads it, so dropping the pin makes it evictable again. The tree keeps,
//! per node, how many of its children are needed and how many kept, so the number of evictable blocks
//! (neither) and of reclaimable ones (not needed: evictable once the pins go) is known at every step in
//! O(1), and a change of hold or pin costs O(1) (O(depth) at worst). The LRU clock is logical (one tick per
//! match or insert), never the wall clock.

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap},
    sync::Arc,
};

use super::events::{block_hash, KvEvent};

/// Index of a node in the arena.
type NodeId = usize;

/// The longest cached prefix of a token sequence, in full blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// The cached blocks, in order: `blocks[i]` holds the K/V of tokens `[i * block_size, (i + 1) * block_size)`.
    /// The cache does not add a holder for them: a caller that uses them shares them with the allocator.
    pub blocks: Vec<u32>,
    /// Tokens covered by `blocks`: always `blocks.len() * block_size`, possibly every token of the query.
    pub num_tokens: usize,
}

#[derive(Debug, Clone)]
struct Node {
    /// The block's token ids (exactly `block_size` of them); the same allocation keys the parent's map.
    tokens: Arc<[u32]>,
    /// The KV block holding these tokens' K/V; unique across the whole tree.
    block: u32,
    /// The block's name in KV-cache events: [`block_hash`] of its parent's (or its salt) and its tokens.
    hash: u64,
    /// The namespace of the subtree the node belongs to.
    salt: u64,
    /// `None` for a child of the salt's root.
    parent: Option<NodeId>,
    children: HashMap<Arc<[u32]>, NodeId>,
    /// Logical time of the last match or insert that went through this node; an ancestor's is never older.
    last_access: u64,
    /// A sequence holds the block (besides the cache).
    is_held: bool,
    /// Session pins on the block (see `KvPool::pin`); they hold no allocator reference.
    num_pins: u32,
    /// Children that are needed (see [`Mark::Needed`]).
    num_needed_children: u32,
    /// Children that are kept (see [`Mark::Kept`]).
    num_kept_children: u32,
}

/// What the tree counts per node and in total, each computed from the node's own state and its
/// children's marks alone, so the two propagate independently.
#[derive(Debug, Clone, Copy)]
enum Mark {
    /// A sequence holds the block, or a descendant (whose K/V need it): it must stay.
    Needed,
    /// Held or pinned, or a descendant is: eviction skips it. Needed implies kept.
    Kept,
}

impl Node {
    fn has(&self, mark: Mark) -> bool {
        match mark {
            Mark::Needed => self.is_held || self.num_needed_children > 0,
            Mark::Kept => self.is_held || self.num_pins > 0 || self.num_kept_children > 0,
        }
    }

    fn num_children_with(&mut self, mark: Mark) -> &mut u32 {
        match mark {
            Mark::Needed => &mut self.num_needed_children,
            Mark::Kept => &mut self.num_kept_children,
        }
    }
}

/// A radix tree of cached KV blocks keyed by token ids, namespaced by salt. See the module docs for the
/// ownership contract with the block allocator.
#[derive(Debug, Clone)]
pub struct RadixCache {
    block_size: usize,
    /// The arena; `None` slots are listed in `free_slots` for reuse.
    nodes: Vec<Option<Node>>,
    free_slots: Vec<NodeId>,
    /// The children of each salt's (implicit, blockless) root. A salt with no cached block has no entry.
    roots: HashMap<u64, HashMap<Arc<[u32]>, NodeId>>,
    /// Which node holds each block id (indexed by block id; grown on demand).
    node_of_block: Vec<Option<NodeId>>,
    /// Live nodes, i.e. cached blocks.
    num_cached_blocks: usize,
    /// Nodes that are needed (see [`Mark::Needed`]).
    num_needed: usize,
    /// Nodes that are kept (see [`Mark::Kept`]).
    num_kept: usize,
    /// Nodes with at least one session pin.
    num_pinned: usize,
    /// Eviction candidates `(last_access, node)`, oldest first. Lazily invalidated: an entry counts only
    /// while its node is alive, is a leaf and still has that `last_access`. Every live leaf has a valid
    /// entry; stale entries are dropped when popped or when the heap is rebuilt.
    candidates: BinaryHeap<Reverse<(u64, NodeId)>>,
    /// The logical LRU clock: advanced by every match and insert.
    clock: u64,
    /// The KV-cache events since the last [`take_events`](Self::take_events); None: not recorded.
    events: Option<Vec<KvEvent>>,
}

impl RadixCache {
    /// An empty cache whose edges are blocks of `block_size` tokens (the shards' KV block size).
    pub fn new(block_size: usize) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        Self {
            block_size,
            nodes: Vec::new(),
            free_slots: Vec::new(),
            roots: HashMap::new(),
            node_of_block: Vec::new(),
            num_cached_blocks: 0,
            num_needed: 0,
            num_kept: 0,
            num_pinned: 0,
            candidates: BinaryHeap::new(),
            clock: 0,
            events: None,
        }
    }

    /// Records KV-cache events from now on, starting with [`KvEvent::AllCleared`] (call it on an empty
    /// cache: subscribers then forget whatever an earlier cache held).
    pub fn record_events(&mut self) {
        debug_assert_eq!(self.num_cached_blocks, 0, "recording starts from an empty cache");
        self.events = Some(vec![KvEvent::AllCleared]);
    }

    /// The events recorded since the last call, in order (none when not recording).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Events that bring a subscriber that missed some to the cache's state now: [`KvEvent::AllCleared`],
    /// then one [`KvEvent::Stored`] per cached block, every parent before its children. O(n).
    pub fn snapshot_events(&self) -> Vec<KvEvent> {
        let mut events = vec![KvEvent::AllCleared];
        let mut stack: Vec<NodeId> = self.roots.values().flat_map(|children| children.values().copied()).collect();
        while let Some(id) = stack.pop() {
            let node = self.node(id);
            events.push(KvEvent::Stored {
                block_hashes: vec![node.hash],
                parent_block_hash: node.parent.map(|parent| self.node(parent).hash),
                token_ids: node.tokens.to_vec(),
                namespace: node.salt,
            });
            stack.extend(node.children.values().copied());
        }
        events
    }

    /// Tokens per block, i.e. per edge of the tree.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The longest prefix of `tokens` whose full blocks are cached under `salt` (empty if none, and the
    /// trailing partial block never matches). It may cover all of `tokens`; a caller that needs logits for
    /// the last token must recompute at least that token. Marks the matched blocks as recently used.
    /// Adds no holder: share the blocks with the allocator before the next `evict` if they are to be used.
    pub fn match_prefix(&mut self, salt: u64, tokens: &[u32]) -> PrefixMatch {
        self.clock += 1;
        let now = self.clock;
        let mut blocks = Vec::new();
        let mut parent = None;
        for chunk in tokens.chunks_exact(self.block_size) {
            let Some(id) = self.child(salt, parent, chunk) else {
                break;
            };
            let node = self.node_mut(id);
            node.last_access = now;
            blocks.push(node.block);
            parent = Some(id);
        }
        if let Some(last) = parent {
            self.push_if_leaf(last);
        }
        PrefixMatch {
            num_tokens: blocks.len() * self.block_size,
            blocks,
        }
    }

    /// Registers the full blocks of a sequence: `tokens.len() / block_size` of them, `blocks[i]` holding
    /// tokens `[i * block_size, (i + 1) * block_size)` (extra entries of `blocks`, such as a partial last
    /// block, are ignored). Where the tree already has a node for a block's tokens it is kept, whatever its
    /// block id (another sequence computed the same prefix first); elsewhere a node is created for the
    /// given block, held (the inserting sequence holds it). Returns the ids newly added, in path order: the
    /// caller shares exactly those with the allocator. Inserting a path already cached adds nothing. A
    /// block already cached at another place (a caller bug) is never cached twice: insertion stops there.
    /// A null entry (block 0: released out of a sliding window) stops it too, unless the tree already has
    /// that block's node: a cached path is always a complete chain from the root.
    /// Marks the whole path as recently used.
    ///
    /// Panics if `blocks` has fewer than `tokens.len() / block_size` entries.
    pub fn insert(&mut self, salt: u64, tokens: &[u32], blocks: &[u32]) -> Vec<u32> {
        let num_full_blocks = tokens.len() / self.block_size;
        assert!(
            blocks.len() >= num_full_blocks,
            "{num_full_blocks} full blocks of tokens but only {} block ids",
            blocks.len()
        );
        self.clock += 1;
        let now = self.clock;
        let mut added = Vec::new();
        let mut parent = None;
        // The event: new nodes have no children, so once one is added the rest of the path is new too, and
        // the added blocks form one chain below the first one's parent.
        let mut block_hashes = Vec::new();
        let mut parent_block_hash = None;
        let mut first_added = 0;
        for (i, (chunk, &block)) in tokens.chunks_exact(self.block_size).zip(blocks).enumerate() {
            let id = match self.child(salt, parent, chunk) {
                Some(id) => {
                    self.node_mut(id).last_access = now;
                    id
                }
                // The null block (an entry a windowed sequence released) ends the chain: what follows
                // cannot be reached from the root through blocks that hold their K/V.
                None if block == 0 || self.contains_block(block) => break,
                None => {
                    if added.is_empty() {
                        first_added = i;
                        parent_block_hash = parent.map(|parent| self.node(parent).hash);
                    }
                    added.push(block);
                    let id = self.add_node(salt, parent, chunk, block, now);
                    block_hashes.push(self.node(id).hash);
                    id
                }
            };
            parent = Some(id);
        }
        if let Some(last) = parent {
            self.push_if_leaf(last);
        }
        if let (Some(events), false) = (self.events.as_mut(), added.is_empty()) {
            let added_tokens = first_added * self.block_size..(first_added + added.len()) * self.block_size;
            events.push(KvEvent::Stored {
                block_hashes,
                parent_block_hash,
                token_ids: tokens[added_tokens].to_vec(),
                namespace: salt,
            });
        }
        added
    }

    /// Removes up to `num_blocks` blocks, least recently used first, among leaves nobody holds or pins.
    /// Evicting a leaf can make its parent a leaf, which is then a candidate in the same call; a held or
    /// pinned block keeps its ancestors cached. Returns the evicted ids (fewer than asked when nothing else
    /// is evictable): the caller frees exactly those. Cost: O((evicted + skipped) log n), where skipped
    /// counts the held or pinned leaves found on the way.
    pub fn evict(&mut self, num_blocks: usize) -> Vec<u32> {
        let mut evicted = Vec::new();
        let mut removed_hashes = Vec::new();
        let mut skipped = Vec::new();
        while evicted.len() < num_blocks {
            let Some(Reverse((stamp, id))) = self.candidates.pop() else {
                break;
            };
            if !self.is_candidate(stamp, id) {
                continue;
            }
            let node = self.node(id);
            if node.has(Mark::Kept) {
                skipped.push(Reverse((stamp, id)));
                continue;
            }
            evicted.push(node.block);
            removed_hashes.push(node.hash);
            if let Some(parent) = self.remove_leaf(id) {
                self.push_if_leaf(parent);
            }
        }
        if let (Some(events), false) = (self.events.as_mut(), removed_hashes.is_empty()) {
            events.push(KvEvent::Removed {
                block_hashes: removed_hashes,
            });
        }
        // A node may have been pushed twice (it became a leaf again after a child came and went).
        skipped.sort_unstable();
        skipped.dedup();
        self.candidates.extend(skipped);
        self.compact_candidates();
        evicted
    }

    /// How many blocks [`evict`](Self::evict) could free right now: those neither held nor pinned nor an
    /// ancestor of such a block. O(1).
    pub fn num_evictable(&self) -> usize {
        self.num_cached_blocks - self.num_kept
    }

    /// How many blocks [`evict`](Self::evict) could free once every pin is removed: those neither held nor
    /// an ancestor of a held one. O(1).
    pub fn num_reclaimable(&self) -> usize {
        self.num_cached_blocks - self.num_needed
    }

    /// Blocks with at least one session pin. O(1).
    pub fn num_pinned_blocks(&self) -> usize {
        self.num_pinned
    }

    /// Adds (`delta` = 1) or removes (`delta` = -1) one session pin on the cached `block`: eviction skips a
    /// pinned block and its ancestors. Nothing happens for a block the cache does not hold. O(1), or
    /// O(depth) when the change keeps or frees a chain of ancestors.
    ///
    /// Panics when removing a pin the block does not have (a caller bug).
    pub fn change_pins(&mut self, block: u32, delta: i32) {
        let Some(id) = self.node_id(block) else { return };
        let node = self.node_mut(id);
        let was_kept = node.has(Mark::Kept);
        let was_pinned = node.num_pins > 0;
        node.num_pins = node
            .num_pins
            .checked_add_signed(delta)
            .expect("a block loses only pins it has");
        let is_pinned = node.num_pins > 0;
        self.num_pinned = self.num_pinned + usize::from(is_pinned) - usize::from(was_pinned);
        self.propagate(id, Mark::Kept, was_kept);
    }

    /// Blocks the cache holds (one allocator reference each).
    pub fn num_cached_blocks(&self) -> usize {
        self.num_cached_blocks
    }

    /// Whether the cache holds `block`. O(1).
    pub fn contains_block(&self, block: u32) -> bool {
        self.node_id(block).is_some()
    }

    /// Whether a sequence holds the cached `block` (`None` when it is not cached).
    pub fn is_held(&self, block: u32) -> Option<bool> {
        self.node_id(block).map(|id| self.node(id).is_held)
    }

    /// Records whether a sequence (besides the cache) holds `block`; nothing happens for a block the cache
    /// does not hold. O(1), or O(depth) when the change pins or unpins a chain of ancestors.
    pub fn set_held(&mut self, block: u32, held: bool) {
        let Some(id) = self.node_id(block) else { return };
        let node = self.node_mut(id);
        let (was_needed, was_kept) = (node.has(Mark::Needed), node.has(Mark::Kept));
        node.is_held = held;
        self.propagate(id, Mark::Needed, was_needed);
        self.propagate(id, Mark::Kept, was_kept);
    }

    /// Panics if the tree is inconsistent: a block cached twice, parent/child links or the block index
    /// disagreeing, an edge of the wrong length, counts off, or a leaf missing from the eviction candidates.
    /// O(n log n); for tests and debug builds.
    pub fn check_invariants(&self) {
        let (mut num_live, mut num_needed, mut num_kept, mut num_pinned) = (0, 0, 0, 0);
        for (id, slot) in self.nodes.iter().enumerate() {
            let Some(node) = slot else { continue };
            num_live += 1;
            assert_eq!(
                node.tokens.len(),
                self.block_size,
                "node {id}: edge of the wrong length"
            );
            assert_eq!(
                self.node_id(node.block),
                Some(id),
                "node {id}: block {} indexed elsewhere (cached twice?)",
                node.block
            );
            for (mark, counted) in [
                (Mark::Needed, node.num_needed_children),
                (Mark::Kept, node.num_kept_children),
            ] {
                let num_children = node.children.values().filter(|&&c| self.node(c).has(mark)).count();
                assert_eq!(
                    counted as usize, num_children,
                    "node {id}: {mark:?} children miscounted"
                );
            }
            assert!(
                !node.has(Mark::Needed) || node.has(Mark::Kept),
                "node {id}: needed but not kept"
            );
            num_needed += usize::from(node.has(Mark::Needed));
            num_kept += usize::from(node.has(Mark::Kept));
            num_pinned += usize::from(node.num_pins > 0);
            assert!(node.last_access <= self.clock, "node {id}: stamp from the future");
            let siblings = match node.parent {
                Some(parent) => {
                    let parent_node = self.nodes.get(parent).and_then(Option::as_ref);
                    let parent_node = parent_node.unwrap_or_else(|| panic!("node {id}: dead parent {parent}"));
                    assert_eq!(parent_node.salt, node.salt, "node {id}: salt differs from its parent's");
                    assert!(
                        parent_node.last_access >= node.last_access,
                        "node {id}: newer than its parent"
                    );
                    &parent_node.children
                }
                None => &self.roots[&node.salt],
            };
            assert_eq!(
                siblings.get(&node.tokens[..]),
                Some(&id),
                "node {id}: parent does not link it"
            );
            for (tokens, &child) in &node.children {
                let child_node = self.nodes.get(child).and_then(Option::as_ref);
                let child_node = child_node.unwrap_or_else(|| panic!("node {id}: dead child {child}"));
                assert_eq!(
                    child_node.parent,
                    Some(id),
                    "node {id}: child {child} names another parent"
                );
                assert_eq!(
                    child_node.tokens, *tokens,
                    "node {id}: child {child} under the wrong key"
                );
            }
        }
        for (salt, children) in &self.roots {
            assert!(!children.is_empty(), "salt {salt}: empty root kept");
            for (tokens, &child) in children {
                let child_node = self.nodes.get(child).and_then(Option::as_ref);
                let child_node = child_node.unwrap_or_else(|| panic!("salt {salt}: dead child {child}"));
                assert_eq!(child_node.parent, None, "salt {salt}: child {child} has a parent");
                assert_eq!(child_node.salt, *salt, "salt {salt}: child {child} of another salt");
                assert_eq!(
                    child_node.tokens, *tokens,
                    "salt {salt}: child {child} under the wrong key"
                );
            }
        }
        assert_eq!(num_live, self.num_cached_blocks, "cached blocks miscounted");
        let num_indexed = self.node_of_block.iter().flatten().count();
        assert_eq!(num_live, num_indexed, "block index and nodes disagree");
        assert_eq!(num_needed, self.num_needed, "needed nodes miscounted");
        assert_eq!(num_kept, self.num_kept, "kept nodes miscounted");
        assert_eq!(num_pinned, self.num_pinned, "pinned nodes miscounted");
        let mut free_slots = self.free_slots.clone();
        free_slots.sort_unstable();
        free_slots.dedup();
        assert_eq!(free_slots.len(), self.free_slots.len(), "a free slot listed twice");
        assert!(
            free_slots.iter().all(|&slot| self.nodes[slot].is_none()),
            "a live slot on the free list"
        );
        assert_eq!(
            num_live + free_slots.len(),
            self.nodes.len(),
            "slots neither live nor free"
        );
        let mut candidates: Vec<(u64, NodeId)> = self.candidates.iter().map(|&Reverse(entry)| entry).collect();
        candidates.sort_unstable();
        for (id, slot) in self.nodes.iter().enumerate() {
            if let Some(node) = slot.as_ref().filter(|node| node.children.is_empty()) {
                assert!(
                    candidates.binary_search(&(node.last_access, id)).is_ok(),
                    "leaf {id} is not an eviction candidate"
                );
            }
        }
    }

    fn node_id(&self, block: u32) -> Option<NodeId> {
        self.node_of_block.get(block as usize).copied().flatten()
    }

    /// After `id`'s own hold, pins or marked children changed: if that changed whether it has `mark`,
    /// count it and tell its parent, and so on up while the mark keeps changing.
    fn propagate(&mut self, mut id: NodeId, mark: Mark, mut had_mark: bool) {
        loop {
            let node = self.node(id);
            let has_mark = node.has(mark);
            if has_mark == had_mark {
                return;
            }
            let parent = node.parent;
            let total = match mark {
                Mark::Needed => &mut self.num_needed,
                Mark::Kept => &mut self.num_kept,
            };
            if has_mark {
                *total += 1;
            } else {
                *total -= 1;
            }
            let Some(parent) = parent else { return };
            let parent_node = self.node_mut(parent);
            had_mark = parent_node.has(mark);
            let num_children = parent_node.num_children_with(mark);
            if has_mark {
                *num_children += 1;
            } else {
                *num_children -= 1;
            }
            id = parent;
        }
    }

    fn node(&self, id: NodeId) -> &Node {
        self.nodes[id].as_ref().expect("tree links point at live nodes")
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes[id].as_mut().expect("tree links point at live nodes")
    }

    fn child(&self, salt: u64, parent: Option<NodeId>, tokens: &[u32]) -> Option<NodeId> {
        match parent {
            Some(parent) => self.node(parent).children.get(tokens).copied(),
            None => self.roots.get(&salt)?.get(tokens).copied(),
        }
    }

    fn add_node(&mut self, salt: u64, parent: Option<NodeId>, tokens: &[u32], block: u32, now: u64) -> NodeId {
        let hash = block_hash(parent.map_or(salt, |parent| self.node(parent).hash), tokens);
        let tokens: Arc<[u32]> = tokens.into();
        let node = Node {
            tokens: tokens.clone(),
            block,
            hash,
            salt,
            parent,
            children: HashMap::new(),
            last_access: now,
            is_held: true,
            num_pins: 0,
            num_needed_children: 0,
            num_kept_children: 0,
        };
        let id = match self.free_slots.pop() {
            Some(id) => {
                self.nodes[id] = Some(node);
                id
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        };
        let siblings = match parent {
            Some(parent) => &mut self.node_mut(parent).children,
            None => self.roots.entry(salt).or_default(),
        };
        siblings.insert(tokens, id);
        let index = block as usize;
        if index >= self.node_of_block.len() {
            self.node_of_block.resize(index + 1, None);
        }
        self.node_of_block[index] = Some(id);
        self.num_cached_blocks += 1;
        self.propagate(id, Mark::Needed, false);
        self.propagate(id, Mark::Kept, false);
        id
    }

    /// Unlinks a leaf and frees its slot; returns its parent.
    fn remove_leaf(&mut self, id: NodeId) -> Option<NodeId> {
        let node = self.nodes[id].take().expect("evicting a live node");
        debug_assert!(!node.has(Mark::Kept), "evicting a kept node");
        self.free_slots.push(id);
        self.node_of_block[node.block as usize] = None;
        self.num_cached_blocks -= 1;
        match node.parent {
            Some(parent) => {
                self.node_mut(parent).children.remove(&node.tokens[..]);
            }
            None => {
                let siblings = self.roots.get_mut(&node.salt).expect("a root child's salt has a root");
                siblings.remove(&node.tokens[..]);
                if siblings.is_empty() {
                    self.roots.remove(&node.salt);
                }
            }
        }
        node.parent
    }

    fn is_candidate(&self, stamp: u64, id: NodeId) -> bool {
        matches!(self.nodes.get(id), Some(Some(node)) if node.last_access == stamp && node.children.is_empty())
    }

    fn push_if_leaf(&mut self, id: NodeId) {
        let node = self.node(id);
        if node.children.is_empty() {
            self.candidates.push(Reverse((node.last_access, id)));
            self.compact_candidates();
        }
    }

    /// Rebuilds the candidate heap from the live leaves once stale entries outnumber live nodes, so its size
    /// stays O(n) however many matches touch the same leaves. Amortized O(1) per push.
    fn compact_candidates(&mut self) {
        if self.candidates.len() <= 2 * self.num_cached_blocks + 16 {
            return;
        }
        self.candidates = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(id, slot)| {
                let node = slot.as_ref()?;
                node.children.is_empty().then_some(Reverse((node.last_access, id)))
            })
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use rand::{rngs::StdRng, Rng, SeedableRng};

    use super::*;
    use crate::kv::BlockAllocator;

    /// The cache as a subscriber of its events rebuilds it: block hash -> (parent hash, tokens, namespace).
    type Subscriber = HashMap<u64, (Option<u64>, Vec<u32>, u64)>;

    /// Applies one event as a subscriber would, checking it is consistent with what came before.
    fn follow(subscriber: &mut Subscriber, event: KvEvent, block_size: usize) {
        match event {
            KvEvent::Stored {
                block_hashes,
                parent_block_hash,
                token_ids,
                namespace,
            } => {
                assert_eq!(token_ids.len(), block_hashes.len() * block_size);
                assert!(!block_hashes.is_empty());
                let mut parent = parent_block_hash;
                if let Some(parent) = parent {
                    assert_eq!(subscriber[&parent].2, namespace, "a chain below another namespace");
                }
                for (hash, tokens) in block_hashes.into_iter().zip(token_ids.chunks(block_size)) {
                    assert!(parent.is_none_or(|parent| subscriber.contains_key(&parent)), "unknown parent");
                    assert!(subscriber.insert(hash, (parent, tokens.to_vec(), namespace)).is_none(), "stored twice");
                    parent = Some(hash);
                }
            }
            KvEvent::Removed { block_hashes } => {
                for hash in block_hashes {
                    assert!(subscriber.remove(&hash).is_some(), "removed a block never stored");
                    assert!(
                        subscriber.values().all(|(parent, ..)| *parent != Some(hash)),
                        "removed before its children"
                    );
                }
            }
            KvEvent::AllCleared => subscriber.clear(),
        }
    }

    /// A subscriber's block: its namespace and its whole prefix (its ancestors' tokens, then its own).
    fn prefix(subscriber: &Subscriber, mut hash: u64) -> (u64, Vec<u32>) {
        let mut chunks = Vec::new();
        let namespace = subscriber[&hash].2;
        loop {
            let (parent, tokens, _) = &subscriber[&hash];
            chunks.push(tokens.clone());
            match parent {
                Some(parent) => hash = *parent,
                None => break,
            }
        }
        (namespace, chunks.into_iter().rev().flatten().collect())
    }

    fn followed(events: Vec<KvEvent>, block_size: usize) -> Subscriber {
        let mut subscriber = Subscriber::new();
        for event in events {
            follow(&mut subscriber, event, block_size);
        }
        subscriber
    }

    #[test]
    fn stored_events_chain_new_blocks_below_their_cached_parent() {
        let mut cache = RadixCache::new(2);
        cache.record_events();
        assert_eq!(cache.take_events(), vec![KvEvent::AllCleared]);
        assert_eq!(cache.take_events(), vec![], "taken");
        // Three full blocks: the partial fourth is not cached.
        cache.insert(0, &[1, 2, 3, 4, 5, 6, 7], &[10, 11, 12, 13]);
        let (h1, h2, h3) = (
            block_hash(0, &[1, 2]),
            block_hash(block_hash(0, &[1, 2]), &[3, 4]),
            block_hash(block_hash(block_hash(0, &[1, 2]), &[3, 4]), &[5, 6]),
        );
        let stored = |block_hashes: Vec<u64>, parent_block_hash, token_ids: Vec<u32>, namespace| KvEvent::Stored {
            block_hashes,
            parent_block_hash,
            token_ids,
            namespace,
        };
        assert_eq!(
            cache.take_events(),
            vec![stored(vec![h1, h2, h3], None, vec![1, 2, 3, 4, 5, 6], 0)]
        );
        // A branch: only the new blocks, below the last cached one; a path already cached says nothing.
        cache.insert(0, &[1, 2, 3, 4, 8, 8, 9, 9], &[20, 21, 22, 23]);
        cache.insert(0, &[1, 2, 3, 4], &[20, 21]);
        let h4 = block_hash(h2, &[8, 8]);
        assert_eq!(
            cache.take_events(),
            vec![stored(vec![h4, block_hash(h4, &[9, 9])], Some(h2), vec![8, 8, 9, 9], 0)]
        );
        // Another namespace: other hashes for the same tokens.
        cache.insert(5, &[1, 2], &[40]);
        assert_eq!(cache.take_events(), vec![stored(vec![block_hash(5, &[1, 2])], None, vec![1, 2], 5)]);
        assert_ne!(block_hash(5, &[1, 2]), h1);
        // A window-released (null) entry stops the chain.
        cache.insert(7, &[1, 2, 3, 4], &[0, 41]);
        assert_eq!(cache.take_events(), vec![]);
        cache.check_invariants();
    }

    #[test]
    fn eviction_removes_leaves_before_parents_and_the_snapshot_rebuilds_the_tree() {
        let mut cache = RadixCache::new(2);
        cache.record_events();
        cache.insert(0, &[1, 1, 2, 2, 3, 3], &[10, 11, 12]);
        cache.insert(0, &[1, 1, 4, 4], &[10, 20]);
        cache.insert(3, &[1, 1], &[30]);
        let_go(&mut cache, &[10, 11, 12, 20, 30]);
        let mut subscriber = followed(cache.take_events(), 2);
        assert_eq!(subscriber.len(), 5);
        assert_eq!(followed(cache.snapshot_events(), 2), subscriber);
        let evicted = cache.evict(3);
        assert_eq!(evicted, vec![12, 11, 20], "LRU leaves, a parent once its child is gone");
        let events = cache.take_events();
        let KvEvent::Removed { block_hashes } = &events[..] else {
            panic!("one Removed event: {events:?}")
        };
        let h11 = block_hash(0, &[1, 1]);
        let h22 = block_hash(h11, &[2, 2]);
        assert_eq!(
            block_hashes,
            &[block_hash(h22, &[3, 3]), h22, block_hash(h11, &[4, 4])]
        );
        for event in events {
            follow(&mut subscriber, event, 2);
        }
        assert_eq!(subscriber.len(), 2);
        assert_eq!(followed(cache.snapshot_events(), 2), subscriber);
        cache.check_invariants();
    }

    /// The sequences holding `blocks` let go of them.
    fn let_go(cache: &mut RadixCache, blocks: &[u32]) {
        for &block in blocks {
            cache.set_held(block, false);
        }
    }

    #[test]
    fn match_after_insert_returns_the_full_blocks() {
        let mut cache = RadixCache::new(2);
        assert_eq!(cache.block_size(), 2);
        assert_eq!(cache.insert(0, &[1, 2, 3, 4, 5], &[10, 11, 12]), vec![10, 11]);
        let hit = cache.match_prefix(0, &[1, 2, 3, 4, 5, 6]);
        assert_eq!(
            hit,
            PrefixMatch {
                blocks: vec![10, 11],
                num_tokens: 4
            }
        );
        assert_eq!(cache.match_prefix(0, &[1, 2, 3, 4]).num_tokens, 4);
        assert_eq!(cache.match_prefix(0, &[1, 2, 9, 9]).blocks, vec![10]);
        assert_eq!(cache.match_prefix(0, &[1, 2, 3]).blocks, vec![10]);
        assert_eq!(cache.match_prefix(0, &[1]), PrefixMatch::default());
        assert_eq!(cache.match_prefix(0, &[]), PrefixMatch::default());
        assert_eq!(cache.match_prefix(0, &[2, 1, 3, 4]), PrefixMatch::default());
        cache.check_invariants();
    }

    #[test]
    fn partial_last_block_is_never_cached() {
        let mut cache = RadixCache::new(4);
        assert_eq!(cache.insert(0, &[1, 2, 3, 4, 5, 6], &[10, 11]), vec![10]);
        assert!(!cache.contains_block(11));
        assert_eq!(cache.num_cached_blocks(), 1);
        assert_eq!(cache.insert(0, &[1, 2, 3], &[12]), Vec::<u32>::new());
        assert_eq!(cache.match_prefix(0, &[1, 2, 3, 4, 5, 6]).blocks, vec![10]);
        cache.check_invariants();
    }

    #[test]
    fn salts_are_isolated() {
        let mut cache = RadixCache::new(2);
        assert_eq!(cache.insert(0, &[1, 2, 3, 4], &[10, 11]), vec![10, 11]);
        assert_eq!(cache.match_prefix(7, &[1, 2, 3, 4]), PrefixMatch::default());
        assert_eq!(cache.insert(7, &[1, 2], &[20]), vec![20]);
        assert_eq!(cache.match_prefix(0, &[1, 2, 3, 4]).blocks, vec![10, 11]);
        assert_eq!(cache.match_prefix(7, &[1, 2, 3, 4]).blocks, vec![20]);
        let_go(&mut cache, &[20]);
        assert_eq!(cache.evict(1), vec![20]);
        assert_eq!(cache.match_prefix(7, &[1, 2]), PrefixMatch::default());
        assert_eq!(cache.match_prefix(0, &[1, 2]).blocks, vec![10]);
        cache.check_invariants();
    }

    #[test]
    fn duplicate_insert_keeps_the_first_block_and_adds_nothing() {
        let mut cache = RadixCache::new(2);
        assert_eq!(cache.insert(0, &[1, 2, 3, 4], &[10, 11]), vec![10, 11]);
        assert_eq!(cache.insert(0, &[1, 2, 3, 4], &[10, 11]), Vec::<u32>::new());
        assert_eq!(cache.insert(0, &[1, 2, 3, 4], &[20, 21]), Vec::<u32>::new());
        assert!(!cache.contains_block(20) && !cache.contains_block(21));
        // A longer sequence that computed the same prefix in its own blocks extends the existing path.
        assert_eq!(cache.insert(0, &[1, 2, 3, 4, 5, 6], &[20, 21, 22]), vec![22]);
        assert_eq!(cache.match_prefix(0, &[1, 2, 3, 4, 5, 6]).blocks, vec![10, 11, 22]);
        assert_eq!(cache.num_cached_blocks(), 3);
        cache.check_invariants();
    }

    #[test]
    fn a_block_cached_elsewhere_is_never_cached_twice() {
        let mut cache = RadixCache::new(2);
        assert_eq!(cache.insert(0, &[1, 2], &[10]), vec![10]);
        assert_eq!(cache.insert(0, &[3, 4, 5, 6], &[10, 11]), Vec::<u32>::new());
        assert_eq!(cache.insert(0, &[1, 2, 3, 4, 5, 6], &[10, 11, 10]), vec![11]);
        assert_eq!(cache.num_cached_blocks(), 2);
        cache.check_invariants();
    }

    #[test]
    fn eviction_is_least_recently_used_first() {
        let mut cache = RadixCache::new(2);
        cache.insert(0, &[1, 1], &[10]);
        cache.insert(0, &[2, 2], &[11]);
        cache.insert(0, &[3, 3], &[12]);
        cache.match_prefix(0, &[1, 1, 9]);
        let_go(&mut cache, &[10, 11, 12]);
        assert_eq!(cache.evict(1), vec![11]);
        assert_eq!(cache.evict(1), vec![12]);
        assert_eq!(cache.evict(5), vec![10]);
        assert_eq!(cache.num_cached_blocks(), 0);
        assert_eq!(cache.evict(1), Vec::<u32>::new());
        cache.check_invariants();
    }

    #[test]
    fn leaves_go_before_their_ancestors() {
        let mut cache = RadixCache::new(2);
        cache.insert(0, &[1, 1, 2, 2, 3, 3], &[10, 11, 12]);
        assert_eq!(cache.evict(9), Vec::<u32>::new(), "held blocks stay");
        let_go(&mut cache, &[10, 11, 12]);
        assert_eq!(cache.evict(1), vec![12]);
        assert_eq!(cache.evict(0), Vec::<u32>::new());
        assert_eq!(cache.evict(9), vec![11, 10]);
        cache.check_invariants();
    }

    #[test]
    fn evicting_a_leaf_exposes_its_parent_in_the_same_call() {
        let mut cache = RadixCache::new(2);
        cache.insert(0, &[1, 1, 2, 2, 3, 3], &[10, 11, 12]);
        cache.insert(0, &[4, 4], &[20]);
        let_go(&mut cache, &[10, 11, 12, 20]);
        // 11 is older than 20, so it goes as soon as its child 12 is gone.
        assert_eq!(cache.evict(2), vec![12, 11]);
        assert_eq!(cache.evict(1), vec![10]);
        assert_eq!(cache.match_prefix(0, &[4, 4]).blocks, vec![20]);
        cache.check_invariants();
    }

    #[test]
    fn blocks_in_use_are_never_evicted_nor_their_ancestors() {
        let mut cache = RadixCache::new(2);
        cache.insert(0, &[1, 1, 2, 2], &[10, 11]);
        cache.insert(0, &[1, 1, 3, 3], &[10, 12]);
        cache.insert(0, &[4, 4], &[20]);
        assert_eq!(cache.num_evictable(), 0, "blocks enter held");
        let_go(&mut cache, &[10, 12, 20]);
        assert_eq!(cache.num_evictable(), 2, "10 is needed by its held child 11");
        let mut evicted = cache.evict(10);
        evicted.sort_unstable();
        assert_eq!(evicted, vec![12, 20]);
        assert!(cache.contains_block(10) && cache.contains_block(11));
        assert_eq!(cache.num_evictable(), 0);
        assert_eq!(cache.evict(10), Vec::<u32>::new());
        // Once its sequence lets go, the leaf and then its parent are evictable again.
        let_go(&mut cache, &[11]);
        assert_eq!(cache.num_evictable(), 2);
        cache.check_invariants();
        assert_eq!(cache.evict(10), vec![11, 10]);
        cache.check_invariants();
    }

    #[test]
    fn a_pinned_block_and_its_ancestors_stay_until_the_pin_goes() {
        let mut cache = RadixCache::new(2);
        cache.insert(0, &[1, 1, 2, 2, 3, 3], &[10, 11, 12]);
        cache.insert(0, &[4, 4], &[20]);
        let_go(&mut cache, &[10, 11, 12, 20]);
        cache.change_pins(11, 1);
        cache.change_pins(11, 1);
        assert_eq!(cache.num_pinned_blocks(), 1);
        assert_eq!(cache.num_evictable(), 2, "12 and 20; 10 is kept by its pinned child");
        assert_eq!(cache.num_reclaimable(), 4, "pins only keep: every block could go");
        let mut evicted = cache.evict(9);
        evicted.sort_unstable();
        assert_eq!(evicted, vec![12, 20]);
        // A sequence holding the pinned block makes it needed; pins and holds count apart.
        cache.set_held(11, true);
        assert_eq!(cache.num_reclaimable(), 0);
        cache.change_pins(11, -1);
        cache.change_pins(11, -1);
        assert_eq!(cache.num_pinned_blocks(), 0);
        assert_eq!(cache.evict(9), Vec::<u32>::new(), "still held");
        let_go(&mut cache, &[11]);
        cache.check_invariants();
        assert_eq!(cache.evict(9), vec![11, 10]);
        cache.check_invariants();
    }

    #[test]
    fn candidate_heap_stays_bounded_under_repeated_matches() {
        let mut cache = RadixCache::new(2);
        cache.insert(0, &[1, 1, 2, 2], &[10, 11]);
        cache.insert(0, &[3, 3], &[12]);
        let_go(&mut cache, &[10, 11, 12]);
        for _ in 0..10_000 {
            cache.match_prefix(0, &[1, 1, 2, 2]);
            cache.match_prefix(0, &[3, 3]);
        }
        assert!(cache.candidates.len() <= 2 * cache.num_cached_blocks() + 17);
        cache.check_invariants();
        assert_eq!(cache.evict(3), vec![11, 10, 12]);
    }

    /// One sequence of the randomized test: its tokens, the blocks it holds (one allocator reference each,
    /// the last maybe partial) and its salt.
    struct Sequence {
        salt: u64,
        tokens: Vec<u32>,
        blocks: Vec<u32>,
    }

    /// The randomized test's world: a real allocator, the cache, the sequences, and a shadow record of what
    /// each block holds (salt and the whole token prefix its K/V were computed for).
    struct World {
        block_size: usize,
        allocator: BlockAllocator,
        cache: RadixCache,
        sequences: Vec<Sequence>,
        contents: HashMap<u32, (u64, Vec<u32>)>,
        /// Session pins: the cached blocks of each, a chain from a root.
        pins: Vec<Vec<u32>>,
        /// How often the interesting cases happened, so the test proves it reached them.
        stats: Stats,
        /// The cache as its events describe it.
        subscriber: Subscriber,
    }

    #[derive(Debug, Default)]
    struct Stats {
        num_events_followed: usize,
        num_hit_tokens: usize,
        num_evicted_to_allocate: usize,
        num_allocation_failures: usize,
        num_kept_other_block: usize,
        num_pinned_blocks: usize,
    }

    impl World {
        /// Adds a holder to blocks in use and tells the cache, as the engine's pool does.
        fn share(&mut self, blocks: &[u32]) {
            self.allocator.share(blocks).expect("blocks in use");
            for &block in blocks {
                self.cache.set_held(block, true);
            }
        }

        /// Drops a holder of each block and tells the cache of those only it holds now.
        fn free(&mut self, blocks: &[u32]) {
            self.allocator.free(blocks).expect("blocks held");
            for &block in blocks {
                if self.allocator.ref_count(block) == 1 {
                    self.cache.set_held(block, false);
                }
            }
        }

        /// The evictable blocks counted the slow way, from the allocator's reference counts and the
        /// world's pins: the cached blocks none of whose descendants (themselves included) a sequence
        /// holds or, with `count_pins`, a pin names.
        fn num_evictable_by_ref_counts(&self, count_pins: bool) -> usize {
            let nodes = &self.cache.nodes;
            let pinned: HashSet<u32> = self.pins.iter().flatten().copied().collect();
            let mut is_kept = vec![false; nodes.len()];
            for (id, slot) in nodes.iter().enumerate() {
                let Some(node) = slot else { continue };
                let is_pinned = count_pins && pinned.contains(&node.block);
                let mut current = (self.allocator.ref_count(node.block) > 1 || is_pinned).then_some(id);
                while let Some(c) = current.filter(|&c| !is_kept[c]) {
                    is_kept[c] = true;
                    current = nodes[c].as_ref().and_then(|n| n.parent);
                }
            }
            nodes
                .iter()
                .zip(&is_kept)
                .filter(|(slot, &kept)| slot.is_some() && !kept)
                .count()
        }

        /// Pins the cached prefix of `tokens`, as `KvPool::pin` does.
        fn pin(&mut self, salt: u64, tokens: &[u32]) {
            let hit = self.cache.match_prefix(salt, tokens);
            for &block in &hit.blocks {
                self.cache.change_pins(block, 1);
            }
            self.stats.num_pinned_blocks += hit.blocks.len();
            self.pins.push(hit.blocks);
        }

        fn unpin(&mut self, pin: usize) {
            for block in self.pins.swap_remove(pin) {
                self.cache.change_pins(block, -1);
            }
        }

        /// Allocates `num_blocks`, evicting unreferenced cached blocks first when the pool is short, as the
        /// engine does.
        fn allocate(&mut self, num_blocks: usize) -> Option<Vec<u32>> {
            let num_free = self.allocator.num_free_blocks() as usize;
            if num_free < num_blocks {
                let evicted = self.cache.evict(num_blocks - num_free);
                self.allocator
                    .free(&evicted)
                    .expect("the cache held the evicted blocks");
                self.stats.num_evicted_to_allocate += evicted.len();
                for block in &evicted {
                    self.contents.remove(block);
                }
            }
            let blocks = self.allocator.allocate(num_blocks as u32);
            self.stats.num_allocation_failures += usize::from(blocks.is_none());
            blocks
        }

        /// Records what block `i` of `sequence` holds now that its tokens are computed.
        fn write_contents(&mut self, sequence: usize, i: usize) {
            let Sequence { salt, tokens, blocks } = &self.sequences[sequence];
            let end = tokens.len().min((i + 1) * self.block_size);
            self.contents.insert(blocks[i], (*salt, tokens[..end].to_vec()));
        }

        fn check_match(&self, salt: u64, tokens: &[u32], hit: &PrefixMatch) {
            assert_eq!(hit.num_tokens, hit.blocks.len() * self.block_size);
            assert!(hit.num_tokens <= tokens.len());
            for (i, block) in hit.blocks.iter().enumerate() {
                let expected = (salt, tokens[..(i + 1) * self.block_size].to_vec());
                assert_eq!(
                    self.contents.get(block),
                    Some(&expected),
                    "block {block} holds other tokens"
                );
            }
        }

        /// A new request: reuse its cached prefix, allocate the rest (evicting if needed), compute it.
        fn admit(&mut self, salt: u64, tokens: Vec<u32>) {
            let hit = self.cache.match_prefix(salt, &tokens);
            self.check_match(salt, &tokens, &hit);
            self.stats.num_hit_tokens += hit.num_tokens;
            self.share(&hit.blocks);
            let num_blocks = tokens.len().div_ceil(self.block_size);
            let num_matched = hit.blocks.len();
            let Some(new_blocks) = self.allocate(num_blocks - num_matched) else {
                self.free(&hit.blocks);
                return;
            };
            let mut blocks = hit.blocks;
            blocks.extend(new_blocks);
            self.sequences.push(Sequence { salt, tokens, blocks });
            for i in num_matched..num_blocks {
                self.write_contents(self.sequences.len() - 1, i);
            }
        }

        /// Decode: one more token, in a new block when the last one is full.
        fn append(&mut self, sequence: usize, token: u32) {
            let needs_block = self.sequences[sequence].tokens.len().is_multiple_of(self.block_size);
            if needs_block {
                let Some(block) = self.allocate(1) else { return };
                self.sequences[sequence].blocks.extend(block);
            }
            self.sequences[sequence].tokens.push(token);
            let last = self.sequences[sequence].blocks.len() - 1;
            assert!(
                !self.cache.contains_block(self.sequences[sequence].blocks[last]),
                "writing a cached block"
            );
            self.write_contents(sequence, last);
        }

        /// Registers a sequence's first `num_tokens` tokens (those computed so far) with the cache.
        fn insert(&mut self, sequence: usize, num_tokens: usize) {
            let Sequence { salt, tokens, blocks } = &self.sequences[sequence];
            let (salt, tokens) = (*salt, &tokens[..num_tokens]);
            let added = self.cache.insert(salt, tokens, blocks);
            assert!(added.iter().all(|block| blocks.contains(block)));
            self.allocator.share(&added).expect("the sequence holds them");
            let hit = self.cache.match_prefix(salt, tokens);
            assert_eq!(hit.num_tokens, num_tokens / self.block_size * self.block_size);
            self.check_match(salt, tokens, &hit);
            if hit.blocks.iter().zip(blocks).any(|(cached, own)| cached != own) {
                self.stats.num_kept_other_block += 1;
            }
        }

        fn release(&mut self, sequence: usize) {
            let sequence = self.sequences.swap_remove(sequence);
            self.free(&sequence.blocks);
            for block in sequence.blocks {
                if self.allocator.ref_count(block) == 0 {
                    self.contents.remove(&block);
                }
            }
        }

        fn evict(&mut self, num_blocks: usize) {
            let evicted = self.cache.evict(num_blocks);
            assert!(evicted.len() <= num_blocks);
            for &block in &evicted {
                assert_eq!(self.allocator.ref_count(block), 1, "evicted block {block} is in use");
                assert!(!self.cache.contains_block(block));
                self.contents.remove(&block);
            }
            self.allocator.free(&evicted).expect("the cache held them");
        }

        /// Follows the cache's events: what they describe is exactly what the cache holds, each block with
        /// its namespace and whole prefix; every `snapshot_every` calls, its snapshot describes the same.
        fn follow_events(&mut self, snapshot_every: usize) {
            for event in self.cache.take_events() {
                follow(&mut self.subscriber, event, self.block_size);
            }
            let described: HashSet<(u64, Vec<u32>)> =
                self.subscriber.keys().map(|&hash| prefix(&self.subscriber, hash)).collect();
            assert_eq!(described.len(), self.subscriber.len(), "one prefix under two hashes");
            let cached: HashSet<(u64, Vec<u32>)> = (1..=self.allocator.num_usable_blocks())
                .filter(|&block| self.cache.contains_block(block))
                .map(|block| self.contents[&block].clone())
                .collect();
            assert_eq!(described, cached);
            self.stats.num_events_followed += 1;
            if self.stats.num_events_followed.is_multiple_of(snapshot_every) {
                assert_eq!(followed(self.cache.snapshot_events(), self.block_size), self.subscriber);
            }
        }

        fn check(&self) {
            self.allocator.check_invariants();
            self.cache.check_invariants();
            let mut holders: HashMap<u32, u32> = HashMap::new();
            for sequence in &self.sequences {
                let distinct: HashSet<u32> = sequence.blocks.iter().copied().collect();
                assert_eq!(distinct.len(), sequence.blocks.len(), "a sequence holds a block twice");
                assert_eq!(sequence.blocks.len(), sequence.tokens.len().div_ceil(self.block_size));
                for &block in &sequence.blocks {
                    *holders.entry(block).or_default() += 1;
                }
            }
            let (mut num_free, mut num_cached_only, mut num_in_use) = (0, 0, 0);
            for block in 1..=self.allocator.num_usable_blocks() {
                let is_cached = self.cache.contains_block(block);
                let num_holders = holders.get(&block).copied().unwrap_or(0) + u32::from(is_cached);
                assert_eq!(
                    self.allocator.ref_count(block),
                    num_holders,
                    "block {block}: holders disagree"
                );
                match (num_holders, is_cached) {
                    (0, _) => num_free += 1,
                    (1, true) => num_cached_only += 1,
                    _ => num_in_use += 1,
                }
                assert_eq!(
                    num_holders > 0,
                    self.contents.contains_key(&block),
                    "block {block}: shadow stale"
                );
            }
            assert_eq!(num_free, self.allocator.num_free_blocks());
            assert_eq!(
                num_free + num_cached_only + num_in_use,
                self.allocator.num_usable_blocks()
            );
            let num_evictable = self.cache.num_evictable();
            assert_eq!(num_evictable, self.num_evictable_by_ref_counts(true));
            assert_eq!(self.cache.num_reclaimable(), self.num_evictable_by_ref_counts(false));
            let pinned: HashSet<u32> = self.pins.iter().flatten().copied().collect();
            assert_eq!(self.cache.num_pinned_blocks(), pinned.len());
            assert!(num_evictable <= num_cached_only as usize);
            assert_eq!(self.cache.clone().evict(usize::MAX).len(), num_evictable);
            for block in 1..=self.allocator.num_usable_blocks() {
                if let Some(is_held) = self.cache.is_held(block) {
                    assert_eq!(
                        is_held,
                        self.allocator.ref_count(block) > 1,
                        "block {block}: hold out of sync"
                    );
                }
            }
        }
    }

    fn run_random_operations(seed: u64, block_size: usize, num_operations: usize) {
        const VOCAB: u32 = 3;
        const MAX_BLOCKS_PER_SEQUENCE: usize = 6;
        let mut rng = StdRng::seed_from_u64(seed);
        let mut recent: Vec<Vec<u32>> = Vec::new();
        let mut world = World {
            block_size,
            allocator: BlockAllocator::new(33),
            cache: RadixCache::new(block_size),
            sequences: Vec::new(),
            contents: HashMap::new(),
            pins: Vec::new(),
            stats: Stats::default(),
            subscriber: Subscriber::new(),
        };
        world.cache.record_events();
        for _ in 0..num_operations {
            let roll = rng.random_range(0..100);
            let salt = u64::from(rng.random_range(0..10) == 0);
            let num_sequences = world.sequences.len();
            if roll < 25 || num_sequences == 0 {
                // Half the requests continue an earlier one (a multi-turn chat, a shared system prompt).
                let max_num_tokens = MAX_BLOCKS_PER_SEQUENCE * block_size;
                let mut tokens = match rng.random_bool(0.5) {
                    true if !recent.is_empty() => {
                        let earlier: &Vec<u32> = &recent[rng.random_range(0..recent.len())];
                        earlier[..rng.random_range(0..=earlier.len())].to_vec()
                    }
                    _ => Vec::new(),
                };
                let num_tokens = rng.random_range(tokens.len()..=max_num_tokens.max(tokens.len()));
                tokens.extend((tokens.len()..num_tokens).map(|_| rng.random_range(0..VOCAB)));
                recent.truncate(7);
                recent.insert(0, tokens.clone());
                world.admit(salt, tokens);
            } else if roll < 50 {
                let sequence = rng.random_range(0..num_sequences);
                if world.sequences[sequence].tokens.len() < (MAX_BLOCKS_PER_SEQUENCE + 2) * block_size {
                    world.append(sequence, rng.random_range(0..VOCAB));
                }
            } else if roll < 65 {
                let sequence = rng.random_range(0..num_sequences);
                let num_tokens = rng.random_range(0..=world.sequences[sequence].tokens.len());
                world.insert(sequence, num_tokens);
            } else if roll < 71 && !recent.is_empty() {
                let tokens = recent[rng.random_range(0..recent.len())].clone();
                world.pin(salt, &tokens);
            } else if roll < 73 && !world.pins.is_empty() {
                let pin = rng.random_range(0..world.pins.len());
                world.unpin(pin);
            } else if roll < 75 {
                let num_tokens = rng.random_range(0..=MAX_BLOCKS_PER_SEQUENCE * block_size);
                let tokens: Vec<u32> = (0..num_tokens).map(|_| rng.random_range(0..VOCAB)).collect();
                let hit = world.cache.match_prefix(salt, &tokens);
                world.check_match(salt, &tokens, &hit);
            } else if roll < 92 {
                let sequence = rng.random_range(0..num_sequences);
                if rng.random_bool(0.7) {
                    let num_tokens = world.sequences[sequence].tokens.len();
                    world.insert(sequence, num_tokens);
                }
                world.release(sequence);
            } else {
                world.evict(rng.random_range(0..4));
            }
            world.check();
            world.follow_events(1000);
        }
        let stats = &world.stats;
        assert!(
            stats.num_hit_tokens > 0
                && stats.num_evicted_to_allocate > 0
                && stats.num_allocation_failures > 0
                && stats.num_kept_other_block > 0
                && stats.num_pinned_blocks > 0,
            "the operations should reach every case: {stats:?}"
        );
        eprintln!("block_size {block_size}: {stats:?}");
        while !world.sequences.is_empty() {
            world.release(0);
        }
        world.evict(usize::MAX);
        assert_eq!(
            world.cache.num_cached_blocks(),
            world.pins.iter().flatten().collect::<HashSet<_>>().len(),
            "pinned chains stay"
        );
        while !world.pins.is_empty() {
            world.unpin(0);
        }
        world.evict(usize::MAX);
        world.check();
        assert_eq!(world.cache.num_cached_blocks(), 0);
        assert_eq!(world.allocator.num_free_blocks(), world.allocator.num_usable_blocks());
    }

    #[test]
    fn random_insert_match_release_evict_keeps_invariants() {
        for (seed, block_size, num_operations) in [(1, 2, 34_000), (2, 3, 33_000), (3, 4, 33_000)] {
            run_random_operations(seed, block_size, num_operations);
        }
    }
}
