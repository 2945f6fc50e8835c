//! Scheduling policy: a pure function from (running sequences, waiting queue, free KV blocks, budgets)
//! to the plan of one iteration. No I/O, no clock, no allocator mutation: the engine loop executes plans.
//!
//! The token model (vLLM V1's): every sequence has `num_tokens` (prompt + generated) and
//! `num_computed_tokens` (whose K/V are in the cache). A plan gives each scheduled sequence
//! `num_scheduled_tokens`. Prefill, chunked prefill and decode are derived facts, not code paths: a decode
//! is one scheduled token; a chunk is fewer scheduled tokens than the sequence lacks.

use crate::engine::RequestId;

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
}

/// What the policy sees of one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqView {
    pub id: RequestId,
    /// Prompt plus generated tokens.
    pub num_tokens: usize,
    /// Tokens whose K/V are already in the cache.
    pub num_computed_tokens: usize,
    /// KV blocks the sequence holds now.
    pub num_blocks: usize,
    /// Of those, the blocks no other sequence holds: what preempting it would free.
    pub num_freeable_blocks: usize,
}

/// One sequence's share of an iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduled {
    pub id: RequestId,
    /// Tokens it computes in this forward pass (1 for a decode step).
    pub num_scheduled_tokens: usize,
    /// Blocks to allocate to it before the forward pass.
    pub num_new_blocks: usize,
}

/// The decision for one iteration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Sequences of the forward pass: running decodes, running prompts mid-prefill, then admitted ones.
    pub scheduled: Vec<Scheduled>,
    /// Waiting sequences admitted this step; always a prefix of the waiting queue, in order.
    pub admitted: Vec<RequestId>,
    /// Running sequences suspended to free their blocks (newest first); they go back to the front of the
    /// waiting queue and recompute their K/V when readmitted.
    pub preempted: Vec<RequestId>,
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

fn num_blocks_for(num_tokens: usize, block_size: usize) -> usize {
    num_tokens.div_ceil(block_size)
}

/// Plans one iteration, first come first served.
///
/// 1. Running sequences get what they lack within the token budget: decodes first (one token each),
///    then sequences mid-prefill (the rest of their prompt). Decodes therefore always run, and a long
///    prompt only ever takes what is left of the budget: it never stalls running streams.
/// 2. If a running sequence needs a block and none is free, the newest running sequence is preempted
///    (it has done the least work, so recomputing it costs least) until the block fits; if the needy
///    sequence is itself the newest, it is the one suspended.
/// 3. Waiting requests are admitted in queue order while the budget, the batch size and the free blocks
///    above the watermark allow; admission stops at the first request that does not fit, so no request is
///    overtaken (no starvation), and none is admitted in a step that had to preempt.
pub fn schedule(
    config: &SchedulerConfig,
    running: &[SeqView],
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

    while let Some((_, seq)) = pending.pop() {
        if plan.scheduled.len() == config.max_batch_size || tokens_left == 0 {
            continue;
        }
        let num_lacking = seq.num_tokens - seq.num_computed_tokens;
        let mut num_tokens;
        loop {
            let capacity = (seq.num_blocks + free_blocks) * config.block_size;
            num_tokens = num_lacking.min(tokens_left);
            if num_lacking > 1 {
                // Mid-prefill: shrink the chunk to the blocks there are rather than evict decodes.
                num_tokens = num_tokens.min(capacity.saturating_sub(seq.num_computed_tokens));
            }
            if num_tokens > 0 && seq.num_computed_tokens + num_tokens <= capacity {
                break;
            }
            let newest = pending
                .iter()
                .enumerate()
                .max_by_key(|(_, (age, _))| *age)
                .map(|(i, _)| i);
            match newest {
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
        plan.scheduled.push(Scheduled {
            id: seq.id,
            num_scheduled_tokens: num_tokens,
            num_new_blocks,
        });
    }

    if !plan.preempted.is_empty() {
        return plan;
    }
    for seq in waiting {
        if plan.scheduled.len() == config.max_batch_size || tokens_left == 0 {
            break;
        }
        let num_tokens = (seq.num_tokens - seq.num_computed_tokens).min(tokens_left);
        let num_new_blocks =
            num_blocks_for(seq.num_computed_tokens + num_tokens, config.block_size).saturating_sub(seq.num_blocks);
        if num_new_blocks + config.watermark_blocks > free_blocks {
            break;
        }
        free_blocks -= num_new_blocks;
        tokens_left -= num_tokens;
        plan.admitted.push(seq.id);
        plan.scheduled.push(Scheduled {
            id: seq.id,
            num_scheduled_tokens: num_tokens,
            num_new_blocks,
        });
    }
    plan
}

#[cfg(test)]
mod tests;
