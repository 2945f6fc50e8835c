//! Scheduling policy: a pure function from (running sequences, waiting queue, free KV blocks, budgets)
//! to the plan of one iteration. No I/O, no allocator mutation, and no clock of its own: waiting times
//! come in the views, measured by the engine. The engine loop executes plans.
//!
//! The token model (vLLM V1's): every sequence has `num_tokens` (prompt + generated) and
//! `num_computed_tokens` (whose K/V are in the cache). A plan gives each scheduled sequence
//! `num_scheduled_tokens`. Prefill, chunked prefill and decode are derived facts, not code paths: a decode
//! is one scheduled token; a chunk is fewer scheduled tokens than the sequence lacks.

mod budget;
mod preemption;
mod step;

pub use budget::ItlBudget;
pub use preemption::{choose_preemption, Preemption, PreemptionCosts, PreemptionMode};
pub use step::{PreemptionConfig, Scheduler, LOOKUP_WINDOW};

/// A request's id, unique for the router's lifetime; it is also the sequence id the shards see.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// How batches form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchingMode {
    /// Iteration-level scheduling: sequences leave and join at every step.
    Continuous,
    /// Classic static batching, kept as a benchmark baseline: a batch forms when `max_batch_size`
    /// requests wait or the oldest has waited `max_wait_ms`, then runs until all its sequences end; nothing
    /// joins it meanwhile.
    Static { max_wait_ms: u64 },
}

/// How admission claims KV blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvAdmission {
    /// Claim blocks as tokens are scheduled (above the watermark); preempt when running sequences outgrow
    /// the pool. Uses memory best.
    Incremental,
    /// TGI's policy, kept as a benchmark baseline: admit a request only when blocks for its prompt plus
    /// `max_new_tokens` are free beyond what running sequences may still grow into. Never preempts (a
    /// choice of an `n > 1` request that forks off a prompt is the one exception the safety net covers).
    Reserve,
}

/// Budgets of one iteration and the KV geometry the plan is made in.
#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    /// Most tokens computed in one forward pass, over all sequences.
    pub max_batch_tokens: usize,
    /// Most sequences in one forward pass.
    pub max_batch_size: usize,
    /// Tokens per KV block, as the shard reported.
    pub block_size: usize,
    /// Free blocks that admission leaves for running sequences to grow into.
    pub watermark_blocks: usize,
    pub mode: BatchingMode,
    pub kv_admission: KvAdmission,
    /// A waiting request that later arrivals have overtaken this many times (by priority) is admitted
    /// before anything else: the bound that keeps low priorities from starving.
    pub max_times_overtaken: u32,
    /// When every layer of the model attends through a sliding window: the (smallest) window in tokens;
    /// 0 otherwise. Blocks out of every future query's window are released (see `num_dead_blocks`), so a
    /// sequence holds only its window's blocks.
    pub kv_window: usize,
    /// The shards' LoRA slots (Info's `max_loras`): the most distinct adapters the running sequences may
    /// use (see `AdapterSlots`); 0 with LoRA off (every sequence then runs the base model).
    pub max_loras: usize,
    /// With speculative decoding (`SpeculativeConfig::max_step_tokens`): proposals join a step only while
    /// its decodes and proposals stay within this many tokens. 0 with speculation off.
    pub speculative_max_step_tokens: usize,
}

impl SchedulerConfig {
    /// Leading blocks of a sequence whose next query is at `next_position` that no query will read
    /// again: every position `p` in them has `p < next_position - (kv_window - 1)`. 0 without a window.
    pub fn num_dead_blocks(&self, next_position: usize) -> usize {
        if self.kv_window == 0 {
            return 0;
        }
        (next_position + 1).saturating_sub(self.kv_window) / self.block_size
    }

    /// The most blocks a sequence of `num_tokens` tokens holds at once while it decodes: all of them, or
    /// with a window only the window's (at most `ceil((kv_window - 1) / block_size) + 1`).
    fn num_blocks_held(&self, num_tokens: usize) -> usize {
        let num_blocks = num_blocks_for(num_tokens, self.block_size);
        if self.kv_window == 0 {
            return num_blocks;
        }
        num_blocks.min((self.kv_window - 1).div_ceil(self.block_size) + 1)
    }
}

/// What the policy sees of one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqView {
    pub id: RequestId,
    /// Prompt plus generated tokens.
    pub num_tokens: usize,
    /// Tokens whose K/V are already in the cache.
    pub num_computed_tokens: usize,
    /// Entries of its block table now: blocks it holds, plus `num_null_blocks`.
    pub num_blocks: usize,
    /// Leading block-table entries released out of the sliding window (the null block 0): they take
    /// table positions but hold no block. 0 without a window.
    pub num_null_blocks: usize,
    /// Of those, the blocks no other sequence holds: what preempting it would free.
    pub num_freeable_blocks: usize,
    /// Lower runs first; 0 is the default.
    pub priority: i32,
    /// How often a request that arrived later was admitted while this one waited.
    pub num_times_overtaken: u32,
    /// How long it has waited since arrival, in milliseconds of the engine's clock.
    pub waited_ms: u64,
    /// Waiting only: of the cached prefix blocks it would reuse (counted in `num_blocks`), those no one
    /// holds now; admitting it takes them out of the evictable pool, so they cost like new blocks.
    pub num_cached_evictable: usize,
    /// Waiting only: another sequence is computing a longer part of its prompt right now; it waits for
    /// those blocks to be cached instead of computing them a second time.
    pub is_deferred: bool,
    /// The most tokens it can reach: prompt plus `max_new_tokens` (what `KvAdmission::Reserve` reserves).
    pub max_num_tokens: usize,
    /// The LoRA adapter it runs with (0: the base model).
    pub adapter_id: u32,
    /// Running and decoding only, with speculative decoding: the tokens proposed for it this step (it
    /// computes them too, where the step has room, and the shards verify them).
    pub num_proposed_tokens: usize,
}

/// One sequence's share of an iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduled {
    pub id: RequestId,
    /// Tokens it computes in this forward pass (1 for a decode step), `num_speculative_tokens` included.
    pub num_scheduled_tokens: usize,
    /// Of those, proposed tokens to verify (speculative decoding): the first of its proposals. 0 otherwise.
    pub num_speculative_tokens: usize,
    /// Blocks to allocate to it before the forward pass.
    pub num_new_blocks: usize,
}

/// The decision for one iteration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Sequences of the forward pass: running decodes, running prompts mid-prefill, then admitted ones.
    pub scheduled: Vec<Scheduled>,
    /// Waiting sequences admitted this step, in admission order.
    pub admitted: Vec<RequestId>,
    /// Running sequences suspended to free their blocks, in preemption order. Those in `swapped_out` wait
    /// in the swapped queue with their K/V in host memory; the others go back to the front of the waiting
    /// queue and recompute their K/V when readmitted.
    pub preempted: Vec<RequestId>,
    /// The victims of `preempted` whose K/V are copied to the host swap pool (`choose_preemption` decided,
    /// victim by victim).
    pub swapped_out: Vec<RequestId>,
    /// Swapped sequences resumed this step, oldest first. Each is also in `scheduled`, where its
    /// `num_new_blocks` counts every device block it gets: the first ones receive its swapped-in K/V.
    pub resumed: Vec<RequestId>,
    /// Waiting requests held back because a sequence ahead computes a longer part of their prompt.
    pub deferred: Vec<RequestId>,
    /// Waiting requests that stay waiting while later arrivals were admitted: (request, number of those).
    pub overtaken: Vec<(RequestId, u32)>,
}

impl StepPlan {
    /// True when every scheduled sequence computes exactly one token.
    pub fn is_decode_only(&self) -> bool {
        self.scheduled.iter().all(|s| s.num_scheduled_tokens == 1)
    }

    pub fn num_scheduled_tokens(&self) -> usize {
        self.scheduled.iter().map(|s| s.num_scheduled_tokens).sum()
    }
}

/// The distinct LoRA adapters of the running set, bounded by `SchedulerConfig::max_loras`. A sequence
/// joins the running set (admitted, or resumed from the swap pool) only if its adapter already runs or a
/// slot is left; every forward call computes a subset of the running set, so none uses more adapters
/// than the shards have slots. The base model (0) takes no slot.
struct AdapterSlots {
    max_loras: usize,
    held: Vec<u32>,
}

impl AdapterSlots {
    fn new(max_loras: usize, running: &[SeqView]) -> Self {
        let mut held: Vec<u32> = running.iter().map(|seq| seq.adapter_id).filter(|&id| id != 0).collect();
        held.sort_unstable();
        held.dedup();
        debug_assert!(held.len() <= max_loras, "the running set keeps within the slots");
        Self { max_loras, held }
    }

    /// Whether a sequence with `adapter_id` may join the running set.
    fn fits(&self, adapter_id: u32) -> bool {
        adapter_id == 0 || self.held.contains(&adapter_id) || self.held.len() < self.max_loras
    }

    /// Counts `adapter_id` as running (after `fits` said yes).
    fn take(&mut self, adapter_id: u32) {
        if adapter_id != 0 && !self.held.contains(&adapter_id) {
            self.held.push(adapter_id);
        }
    }
}

fn num_blocks_for(num_tokens: usize, block_size: usize) -> usize {
    num_tokens.div_ceil(block_size)
}

/// The order in which waiting requests may be admitted: starving ones (overtaken too often) first in
/// arrival order; then by priority (lower first); within a level, the longest cached prefix first
/// (cache-aware: admit hits while their blocks are still cached), then arrival order. `waiting` is in
/// arrival order, with `num_computed_tokens` the cached prefix a waiting request would start from.
pub fn admission_order(waiting: &[SeqView], max_times_overtaken: u32) -> Vec<usize> {
    let mut order: Vec<usize> = (0..waiting.len()).collect();
    order.sort_by_key(|&i| {
        let seq = &waiting[i];
        let is_starving = seq.num_times_overtaken >= max_times_overtaken;
        let cached = if is_starving { 0 } else { seq.num_computed_tokens };
        (
            !is_starving,
            if is_starving { 0 } else { seq.priority },
            std::cmp::Reverse(cached),
            i,
        )
    });
    order
}

/// Plans one iteration.
///
/// 1. Running sequences get what they lack within the token budget: decodes first (one token each),
///    then sequences mid-prefill (the rest of their prompt). Decodes therefore always run, and a long
///    prompt only ever takes what is left of the budget: it never stalls running streams. A decode with
///    proposed tokens (speculative decoding) computes them too, oldest sequences first, while the decodes
///    and proposals stay within `speculative_max_step_tokens`, the budget allows and free blocks remain:
///    proposals count in the token budget, and never cause a preemption.
/// 2. If a running sequence needs a block and none is free, a victim is preempted until the block fits:
///    the lowest priority first (it matters least), and among equals the one with the fewest computed
///    tokens (its suspension throws away the least work). A sequence that is itself the only candidate
///    left suspends itself.
///    Why this order: a preempted sequence loses its place in the batch for a while, so the least
///    important sequences should pay first; among equals, recomputing costs about its computed tokens
///    (and even a swap copies blocks in proportion to them), so the youngest in work is the cheapest to
///    suspend, and the oldest streams keep going. Age (the later arrival first) breaks the remaining ties.
/// 3. Swapped sequences (`swapped`, in the order they were swapped out) resume before anything new is
///    admitted, each as soon as its blocks fit above the watermark; while the oldest cannot resume,
///    nothing is admitted, so new arrivals never take the memory a swapped sequence waits for.
/// 4. Waiting requests are admitted in `admission_order` while the budget, the batch size and the free
///    blocks above the watermark allow; admission stops at the first request that does not fit (so no
///    request is passed by one that merely fits better), and none is admitted (or resumed) in a step that
///    had to preempt. A deferred request is skipped (it waits for a prefix another sequence is computing).
///    With `KvAdmission::Reserve`, a request needs blocks for its `max_num_tokens` beyond what running
///    sequences may still grow into (no watermark: they can never run short). In static mode nothing joins
///    a running batch.
/// 5. LoRA: the running set uses at most `max_loras` distinct adapters (`AdapterSlots`). A swapped or
///    waiting sequence whose adapter would exceed them is passed over, not waited for: later sequences
///    (of the base model, or of adapters that run) may still join, since its slot only frees once every
///    running sequence of some adapter ends. To make sure that happens, once a sequence is passed over
///    that way while it has a claim to go first (swapped; or waiting and overtaken too often), only
///    base-model requests are admitted until it joins.
pub fn schedule(
    config: &SchedulerConfig,
    running: &[SeqView],
    swapped: &[SeqView],
    waiting: &[SeqView],
    num_free_blocks: usize,
) -> StepPlan {
    let mut plan = StepPlan::default();
    let mut tokens_left = config.max_batch_tokens;
    let mut free_blocks = num_free_blocks;
    // Running sequences not yet planned or preempted, in serving order: decodes first, then sequences
    // mid-prefill, each group oldest first. `running` is oldest first, so its index is the age rank.
    let mut pending: Vec<(usize, SeqView)> = running.iter().copied().enumerate().collect();
    pending.sort_by_key(|(age, seq)| (seq.num_tokens - seq.num_computed_tokens > 1, *age));
    pending.reverse();
    // Proposals (speculative decoding) share what the decodes leave of the speculative step budget, the
    // oldest sequences first.
    let num_decodes = running
        .iter()
        .filter(|seq| seq.num_tokens - seq.num_computed_tokens == 1)
        .count();
    let mut proposals_left = config.speculative_max_step_tokens.saturating_sub(num_decodes);

    while let Some((_, seq)) = pending.pop() {
        if plan.scheduled.len() == config.max_batch_size || tokens_left == 0 {
            continue;
        }
        let num_lacking = seq.num_tokens - seq.num_computed_tokens;
        let mut num_tokens;
        let mut num_speculative_tokens = 0;
        loop {
            let capacity = (seq.num_blocks + free_blocks) * config.block_size;
            num_tokens = num_lacking.min(tokens_left);
            if num_lacking > 1 {
                // Mid-prefill: shrink the chunk to the blocks there are rather than evict decodes.
                num_tokens = num_tokens.min(capacity.saturating_sub(seq.num_computed_tokens));
            } else if num_tokens == 1 {
                // Proposals ride along where the budgets and the free blocks allow; never at the price of
                // a preemption.
                let room = capacity.saturating_sub(seq.num_computed_tokens + 1);
                num_speculative_tokens = seq
                    .num_proposed_tokens
                    .min(proposals_left)
                    .min(tokens_left - 1)
                    .min(room);
                num_tokens += num_speculative_tokens;
            }
            if num_tokens > 0 && seq.num_computed_tokens + num_tokens <= capacity {
                break;
            }
            let victim = pending
                .iter()
                .enumerate()
                .max_by_key(|(_, (age, v))| (v.priority, std::cmp::Reverse(v.num_computed_tokens), *age))
                .map(|(i, _)| i);
            match victim {
                Some(i) => {
                    let (_, victim) = pending.remove(i);
                    free_blocks += victim.num_freeable_blocks;
                    plan.preempted.push(victim.id);
                }
                None => break,
            }
        }
        let num_new_blocks =
            num_blocks_for(seq.num_computed_tokens + num_tokens, config.block_size).saturating_sub(seq.num_blocks);
        if num_tokens == 0 || num_new_blocks > free_blocks {
            free_blocks += seq.num_freeable_blocks;
            plan.preempted.push(seq.id);
            continue;
        }
        free_blocks -= num_new_blocks;
        tokens_left -= num_tokens;
        proposals_left -= num_speculative_tokens;
        plan.scheduled.push(Scheduled {
            id: seq.id,
            num_scheduled_tokens: num_tokens,
            num_speculative_tokens,
            num_new_blocks,
        });
    }

    if !plan.preempted.is_empty() {
        return plan;
    }
    let mut adapter_slots = AdapterSlots::new(config.max_loras, running);
    // Set once a sequence with a claim to go first waits for an adapter slot (see 5. above).
    let mut is_base_only = false;
    for seq in swapped {
        if plan.scheduled.len() == config.max_batch_size || tokens_left == 0 {
            return plan;
        }
        let num_tokens = (seq.num_tokens - seq.num_computed_tokens).min(tokens_left);
        // A swapped sequence holds no device block; its table keeps only its null entries.
        let num_new_blocks =
            num_blocks_for(seq.num_computed_tokens + num_tokens, config.block_size).saturating_sub(seq.num_blocks);
        if num_new_blocks + config.watermark_blocks > free_blocks {
            return plan;
        }
        if !adapter_slots.fits(seq.adapter_id) {
            is_base_only = true;
            continue;
        }
        adapter_slots.take(seq.adapter_id);
        free_blocks -= num_new_blocks;
        tokens_left -= num_tokens;
        plan.resumed.push(seq.id);
        plan.scheduled.push(Scheduled {
            id: seq.id,
            num_scheduled_tokens: num_tokens,
            num_speculative_tokens: 0,
            num_new_blocks,
        });
    }
    if let BatchingMode::Static { max_wait_ms } = config.mode {
        let is_batch_ready =
            waiting.len() >= config.max_batch_size || waiting.iter().any(|w| w.waited_ms >= max_wait_ms);
        if !running.is_empty() || !is_batch_ready {
            return plan;
        }
    }
    let mut watermark_blocks = config.watermark_blocks;
    if config.kv_admission == KvAdmission::Reserve {
        // Blocks running sequences may still need up to their max_new_tokens are not free to admit with.
        let num_reserved: usize = running
            .iter()
            .map(|seq| {
                let num_planned = plan
                    .scheduled
                    .iter()
                    .find(|s| s.id == seq.id)
                    .map_or(0, |s| s.num_new_blocks);
                let num_held = seq.num_blocks - seq.num_null_blocks + num_planned;
                config.num_blocks_held(seq.max_num_tokens).saturating_sub(num_held)
            })
            .sum();
        free_blocks = free_blocks.saturating_sub(num_reserved);
        watermark_blocks = 0;
    }
    for i in admission_order(waiting, config.max_times_overtaken) {
        let seq = &waiting[i];
        if plan.scheduled.len() == config.max_batch_size || tokens_left == 0 {
            break;
        }
        if seq.is_deferred || (is_base_only && seq.adapter_id != 0) {
            continue;
        }
        if !adapter_slots.fits(seq.adapter_id) {
            // Passed over, not waited for: admission goes on with the requests behind it.
            is_base_only |= seq.num_times_overtaken >= config.max_times_overtaken;
            continue;
        }
        let num_tokens = (seq.num_tokens - seq.num_computed_tokens).min(tokens_left);
        let num_new_blocks =
            num_blocks_for(seq.num_computed_tokens + num_tokens, config.block_size).saturating_sub(seq.num_blocks);
        let num_claimed_blocks = match config.kv_admission {
            KvAdmission::Incremental => num_new_blocks,
            KvAdmission::Reserve => config
                .num_blocks_held(seq.max_num_tokens)
                .saturating_sub(seq.num_blocks - seq.num_null_blocks)
                .max(num_new_blocks),
        } + seq.num_cached_evictable;
        if num_claimed_blocks + watermark_blocks > free_blocks {
            break;
        }
        adapter_slots.take(seq.adapter_id);
        free_blocks -= num_claimed_blocks;
        tokens_left -= num_tokens;
        plan.admitted.push(seq.id);
        plan.scheduled.push(Scheduled {
            id: seq.id,
            num_scheduled_tokens: num_tokens,
            num_speculative_tokens: 0,
            num_new_blocks,
        });
    }
    plan
}

#[cfg(test)]
mod tests;
