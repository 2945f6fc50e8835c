//! Plan application: what the scheduler sees of the engine's sequences, and the execution of its plan.
//! Victims are suspended as the plan says (swapped out or released for recompute), swapped sequences
//! resume, waiting ones are admitted with the cached prefix the scheduler saw, blocks are allocated, and
//! the sequences' parts of the step's forward call are built.

use std::{collections::HashMap, time::Instant};

use super::{EngineCore, RequestId};
use crate::{
    kv::{CacheActivity, PrefixMatch},
    scheduler::{Preemption, Scheduled, SeqView, StepPlan, LOOKUP_WINDOW},
    shard::pb,
    speculative::ngram_proposal,
};

/// The cached prefix of each waiting request the scheduler's views were built from (those in its look-up
/// window holding no blocks), by id: admission attaches exactly these, so each request is matched once.
/// They stay true until the plan is applied: the prefix cache only changes between the views and the
/// admissions when a victim's blocks enter it, and a step that preempts admits nothing
/// (`check_preemption_excludes_admission`).
pub(super) type PrefixHits = HashMap<RequestId, PrefixMatch>;

impl EngineCore {
    /// Asks the scheduler for the step's plan, with views of every sequence as they are `now`; first,
    /// running sequences let go of the blocks their sliding window has left. Returns the plan and the
    /// prefix hits its views of waiting requests show.
    pub(super) fn plan(&mut self, now: Instant) -> (StepPlan, PrefixHits) {
        self.release_out_of_window();
        self.propose();
        let running: Vec<_> = self
            .queues
            .running
            .iter()
            .map(|seq| seq.view(self.kv.num_freeable(&seq.blocks), now))
            .collect();
        let (waiting, prefix_hits) = self.waiting_views(now);
        // A swapped sequence holds no device blocks: all it needs back is allocated when it resumes.
        let swapped: Vec<_> = self.queues.swapped.iter().map(|seq| seq.view(0, now)).collect();
        let plan = self.scheduler.plan(
            &running,
            &swapped,
            &waiting,
            self.kv.num_available_blocks(),
            self.swap.num_free_blocks() as usize,
        );
        (plan, prefix_hits)
    }

    /// Speculative decoding by n-gram: each decoding sequence's proposal for this step (prompt lookup over
    /// its own tokens); the scheduler decides how much of it the step computes. (A draft model proposes
    /// before the plan: `propose_by_draft`.)
    fn propose(&mut self) {
        let Some(config) = self.speculative.filter(|_| self.draft.is_none()) else {
            return;
        };
        let started = Instant::now();
        for seq in &mut self.queues.running {
            let room = seq.proposal_room().min(config.max_proposed_tokens);
            seq.proposal = ngram_proposal(&seq.token_ids, config.ngram_min, config.ngram_max, room);
        }
        self.metrics
            .spec_decode_proposal_seconds
            .inc_by(started.elapsed().as_secs_f64());
    }

    /// With a sliding window on every layer: each running sequence releases the blocks no future query
    /// of it reads (their entries become the null block 0; the prefix cache keeps them, see `KvPool`). A
    /// sequence whose choices still wait to fork off its prompt keeps its blocks until they do (a choice
    /// restarts a little before the end of the prompt, whose window may reach further back).
    fn release_out_of_window(&mut self) {
        if self.scheduler.config.kv_window == 0 {
            return;
        }
        let mut activity = CacheActivity::default();
        let mut num_released = 0;
        for seq in &mut self.queues.running {
            if !seq.forks.is_empty() {
                continue;
            }
            let num_dead_blocks = self.scheduler.config.num_dead_blocks(seq.num_computed_tokens);
            num_released += self.kv.release_out_of_window(
                seq.cache_salt(),
                &seq.token_ids[..seq.num_computed_tokens],
                &mut seq.blocks,
                num_dead_blocks,
                &mut activity,
            );
        }
        self.count_cache_activity(activity);
        self.metrics.window_released_blocks.inc_by(num_released as u64);
        self.stats.num_window_released_blocks += num_released as u64;
    }

    /// Views of the waiting requests for the scheduler. A request in the scheduler's look-up window not yet
    /// holding blocks is seen as it would start: from its cached prefix (the last token always recomputed,
    /// for logits), deferred if the scheduler says so; its match is returned with the views.
    fn waiting_views(&mut self, now: Instant) -> (Vec<SeqView>, PrefixHits) {
        let mut views = Vec::with_capacity(self.queues.waiting.len());
        let mut prefix_hits = PrefixHits::new();
        for i in 0..self.queues.waiting.len() {
            let seq = &self.queues.waiting[i];
            let mut view = seq.view(0, now);
            if seq.blocks.is_empty() && i < LOOKUP_WINDOW {
                let hit = self
                    .kv
                    .match_prefix(seq.cache_salt(), &seq.token_ids, seq.token_ids.len() - 1);
                view.num_computed_tokens = hit.num_tokens;
                view.num_blocks = hit.blocks.len();
                view.num_cached_evictable = self.kv.num_evictable_among(&hit.blocks);
                let ahead = self
                    .queues
                    .running
                    .iter()
                    .filter(|r| r.num_computed_tokens < r.num_prompt_tokens)
                    .chain(self.queues.waiting.iter().take(i))
                    .map(|other| (other.cache_salt(), &other.token_ids[..other.num_prompt_tokens]));
                view.is_deferred = self
                    .scheduler
                    .is_deferred(seq.cache_salt(), &seq.token_ids, hit.num_tokens, ahead);
                prefix_hits.insert(seq.id, hit);
            }
            views.push(view);
        }
        (views, prefix_hits)
    }

    /// Moves sequences between queues and allocates blocks as the plan says; returns the sequences' parts
    /// of the forward call (the outbox holds the rest).
    pub(super) fn apply_plan(&mut self, plan: &StepPlan, mut prefix_hits: PrefixHits) -> Vec<pb::SequenceChunk> {
        check_preemption_excludes_admission(plan);
        // Victims first: their host blocks are taken before resumed sequences free theirs (no resume
        // shares a step with a preemption anyway), so a copy out never lands in a block still to be read.
        for &id in &plan.preempted {
            self.preempt(id, plan.swapped_out.contains(&id));
        }
        for &id in &plan.resumed {
            let seq = self.queues.resume(id);
            tracing::debug!(request_id = %seq.tag, sequence_id = %id, "resumed from the swap pool");
        }
        for &id in &plan.admitted {
            self.admit(id, prefix_hits.remove(&id));
        }
        for &(id, num_overtakers) in &plan.overtaken {
            if let Some(seq) = self.queues.waiting.iter_mut().find(|seq| seq.id == id) {
                seq.num_times_overtaken += num_overtakers;
            }
        }
        let mut chunks = Vec::with_capacity(plan.scheduled.len());
        let mut activity = CacheActivity::default();
        for scheduled in &plan.scheduled {
            let i = self.queues.running_index(scheduled.id);
            let blocks = self
                .kv
                .allocate(scheduled.num_new_blocks, &mut activity)
                .expect("the plan fits the free and evictable blocks");
            chunks.push(self.chunk(i, blocks, scheduled));
        }
        self.count_cache_activity(activity);
        chunks
    }

    /// Suspends a running sequence. Swapped, it copies the blocks of its computed tokens to the host and
    /// keeps everything else; else it is released and goes back to the front of the waiting queue.
    fn preempt(&mut self, id: RequestId, is_swapped_out: bool) {
        let i = self.queues.running_index(id);
        let mut seq = self.queues.running.remove(i);
        let mode = if is_swapped_out {
            Preemption::Swap
        } else {
            Preemption::Recompute
        };
        tracing::info!(request_id = %seq.tag, sequence_id = %id, mode = mode.label(), "preempted: KV pool full");
        self.metrics.preemptions.with_label_values(&[mode.label()]).inc();
        if !is_swapped_out {
            seq.num_lost_tokens = seq.num_computed_tokens;
            self.release(&mut seq);
            self.queues.waiting.push_front(seq);
            return;
        }
        // Only the blocks it holds are copied; its null entries (out of the window) stay in its table.
        let num_blocks = seq.num_computed_tokens.div_ceil(self.scheduler.config.block_size);
        let num_null_blocks = seq.num_null_blocks();
        let (host_blocks, copies) = self
            .swap
            .swap_out(&seq.blocks[num_null_blocks..num_blocks])
            .expect("the scheduler swaps only when the host blocks are free");
        self.metrics.swapped_out_blocks.inc_by(copies.len() as u64);
        self.outbox.swap_out(copies);
        if let Some(draft) = &mut self.draft {
            draft.release(id);
        }
        seq.host_blocks = host_blocks;
        // The device blocks go back like a finished sequence's (cached, or to their other holders); the
        // sequence keeps its computed tokens and its state on the shards.
        self.cache_computed(&seq);
        let blocks = std::mem::replace(&mut seq.blocks, vec![0; num_null_blocks]);
        self.kv.release(&blocks);
        self.queues.swapped.push_back(seq);
    }

    /// Moves an admitted request to the running set; a request holding no blocks takes its cached prefix:
    /// `hit`, the one the scheduler saw.
    fn admit(&mut self, id: RequestId, hit: Option<PrefixMatch>) {
        let mut seq = self.queues.take_waiting(id);
        seq.waiting_permit = None;
        let is_first_admission = seq.admitted_at.is_none();
        if is_first_admission {
            let now = Instant::now();
            self.metrics.queue_time.observe((now - seq.arrived_at).as_secs_f64());
            seq.admitted_at = Some(now);
            seq.queue_span = None;
        }
        if seq.blocks.is_empty() {
            // Beyond the look-up window the scheduler saw the request without a cached prefix; it is
            // matched now, once.
            let hit = hit.unwrap_or_else(|| {
                self.kv
                    .match_prefix(seq.cache_salt(), &seq.token_ids, seq.token_ids.len() - 1)
            });
            self.kv.attach(&hit.blocks);
            seq.blocks = hit.blocks;
            seq.num_computed_tokens = hit.num_tokens;
            let num_recomputed = std::mem::take(&mut seq.num_lost_tokens).saturating_sub(hit.num_tokens);
            self.metrics.recomputed_tokens.inc_by(num_recomputed as u64);
            if is_first_admission {
                seq.num_cached_tokens = hit.num_tokens.min(seq.num_prompt_tokens);
                self.metrics
                    .prefix_cache_queried_tokens
                    .inc_by(seq.num_prompt_tokens as u64);
                self.metrics
                    .prefix_cache_hit_tokens
                    .inc_by(seq.num_cached_tokens as u64);
            }
        }
        self.queues.running.push(seq);
    }

    /// Gives `running[i]` its new `blocks` (a resumed sequence's K/V come back into the first of them,
    /// before the forward) and returns its share of the forward call.
    fn chunk(&mut self, i: usize, blocks: Vec<u32>, scheduled: &Scheduled) -> pb::SequenceChunk {
        let num_tokens = scheduled.num_scheduled_tokens - scheduled.num_speculative_tokens;
        let seq = &mut self.queues.running[i];
        if !seq.host_blocks.is_empty() {
            let host_blocks = std::mem::take(&mut seq.host_blocks);
            let copies = self.swap.swap_in(&host_blocks, &blocks[..host_blocks.len()]);
            self.metrics.swapped_in_blocks.inc_by(copies.len() as u64);
            self.outbox.swap_in(copies);
        }
        seq.blocks.extend(blocks);
        let num_prompt_tokens = seq
            .num_prompt_tokens
            .saturating_sub(seq.num_computed_tokens)
            .min(num_tokens);
        self.metrics.prompt_tokens_computed.inc_by(num_prompt_tokens as u64);
        self.stats.num_prompt_tokens_computed += num_prompt_tokens as u64;
        seq.chunk(
            num_tokens,
            scheduled.num_speculative_tokens,
            &self.eos_token_ids,
            &self.metrics.grammar_mask_seconds,
        )
    }
}

/// A step that preempts admits and resumes nothing (`scheduler::schedule`). The engine relies on it: the
/// prefix hits of the scheduler's views would be stale once victims' blocks entered the cache, and a
/// resumed sequence's copies in could read host blocks a victim's copies out are about to fill.
fn check_preemption_excludes_admission(plan: &StepPlan) {
    assert!(
        plan.preempted.is_empty() || (plan.admitted.is_empty() && plan.resumed.is_empty()),
        "a step that preempts {:?} also admits {:?} and resumes {:?}",
        plan.preempted,
        plan.admitted,
        plan.resumed
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_may_preempt_or_admit() {
        let preempting = StepPlan {
            preempted: vec![RequestId(1)],
            ..Default::default()
        };
        check_preemption_excludes_admission(&preempting);
        let admitting = StepPlan {
            admitted: vec![RequestId(2)],
            resumed: vec![RequestId(3)],
            ..Default::default()
        };
        check_preemption_excludes_admission(&admitting);
    }

    #[test]
    #[should_panic(expected = "a step that preempts [RequestId(1)] also admits [RequestId(2)]")]
    fn a_step_that_preempts_and_admits_is_a_bug() {
        check_preemption_excludes_admission(&StepPlan {
            preempted: vec![RequestId(1)],
            admitted: vec![RequestId(2)],
            ..Default::default()
        });
    }

    #[test]
    #[should_panic(expected = "and resumes [RequestId(3)]")]
    fn a_step_that_preempts_and_resumes_is_a_bug() {
        check_preemption_excludes_admission(&StepPlan {
            preempted: vec![RequestId(1)],
            resumed: vec![RequestId(3)],
            ..Default::default()
        });
    }
}
