//! Plan application: what the scheduler sees of the engine's sequences, and the execution of its plan.
//! Victims are suspended as the plan says (swapped out or released for recompute), swapped sequences
//! resume, waiting ones are admitted with their cached prefix, blocks are allocated, and the step's
//! forward call is built.

use std::time::Instant;

use super::{EngineCore, RequestId};
use crate::{
    kv::{BlockCopy, CacheActivity},
    scheduler::{Preemption, SeqView, StepPlan, LOOKUP_WINDOW},
    shard::pb,
};

impl EngineCore {
    /// Asks the scheduler for the step's plan, with views of every sequence as they are `now`; first,
    /// running sequences let go of the blocks their sliding window has left.
    pub(super) fn plan(&mut self, now: Instant) -> StepPlan {
        self.release_out_of_window();
        let running: Vec<_> = self
            .running
            .iter()
            .map(|seq| seq.view(self.kv.num_freeable(&seq.blocks), now))
            .collect();
        let waiting = self.waiting_views(now);
        // A swapped sequence holds no device blocks: all it needs back is allocated when it resumes.
        let swapped: Vec<_> = self.swapped.iter().map(|seq| seq.view(0, now)).collect();
        self.scheduler.plan(
            &running,
            &swapped,
            &waiting,
            self.kv.num_available_blocks(),
            self.swap.num_free_blocks() as usize,
        )
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
        for seq in &mut self.running {
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
    }

    /// Views of the waiting requests for the scheduler. A request in the scheduler's look-up window not yet
    /// holding blocks is seen as it would start: from its cached prefix (the last token always recomputed,
    /// for logits), deferred if the scheduler says so.
    fn waiting_views(&mut self, now: Instant) -> Vec<SeqView> {
        let mut views = Vec::with_capacity(self.waiting.len());
        for i in 0..self.waiting.len() {
            let seq = &self.waiting[i];
            let mut view = seq.view(0, now);
            if seq.blocks.is_empty() && i < LOOKUP_WINDOW {
                let hit = self
                    .kv
                    .match_prefix(seq.cache_salt(), &seq.token_ids, seq.token_ids.len() - 1);
                view.num_computed_tokens = hit.num_tokens;
                view.num_blocks = hit.blocks.len();
                view.num_cached_evictable = self.kv.num_evictable_among(&hit.blocks);
                let ahead = self
                    .running
                    .iter()
                    .filter(|r| r.num_computed_tokens < r.num_prompt_tokens)
                    .chain(self.waiting.iter().take(i))
                    .map(|other| (other.cache_salt(), &other.token_ids[..other.num_prompt_tokens]));
                view.is_deferred = self
                    .scheduler
                    .is_deferred(seq.cache_salt(), &seq.token_ids, hit.num_tokens, ahead);
            }
            views.push(view);
        }
        views
    }

    /// Moves sequences between queues and allocates blocks as the plan says; builds the forward call.
    pub(super) fn apply_plan(&mut self, plan: &StepPlan) -> pb::ForwardRequest {
        // Victims first: their host blocks are taken before resumed sequences free theirs (no resume
        // shares a step with a preemption anyway), so a copy out never lands in a block still to be read.
        for &id in &plan.preempted {
            self.preempt(id, plan.swapped_out.contains(&id));
        }
        for &id in &plan.resumed {
            let i = self
                .swapped
                .iter()
                .position(|seq| seq.id == id)
                .expect("resumed sequences are swapped");
            let seq = self.swapped.remove(i).expect("index in range");
            tracing::debug!(request_id = %seq.tag, sequence_id = %id, "resumed from the swap pool");
            self.running.push(seq);
        }
        for &id in &plan.admitted {
            self.admit(id);
        }
        for &(id, num_overtakers) in &plan.overtaken {
            if let Some(seq) = self.waiting.iter_mut().find(|seq| seq.id == id) {
                seq.num_times_overtaken += num_overtakers;
            }
        }
        let mut chunks = Vec::with_capacity(plan.scheduled.len());
        let mut activity = CacheActivity::default();
        for scheduled in &plan.scheduled {
            let i = self.running_index(scheduled.id);
            let blocks = self
                .kv
                .allocate(scheduled.num_new_blocks, &mut activity)
                .expect("the plan fits the free and evictable blocks");
            chunks.push(self.chunk(i, blocks, scheduled.num_scheduled_tokens));
        }
        self.count_cache_activity(activity);
        pb::ForwardRequest {
            released_ids: std::mem::take(&mut self.released_ids),
            sequences: chunks,
            swap_out: std::mem::take(&mut self.swap_out),
            swap_in: std::mem::take(&mut self.swap_in),
        }
    }

    /// Suspends a running sequence. Swapped, it copies the blocks of its computed tokens to the host and
    /// keeps everything else; else it is released and goes back to the front of the waiting queue.
    fn preempt(&mut self, id: RequestId, is_swapped_out: bool) {
        let i = self.running_index(id);
        let mut seq = self.running.remove(i);
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
            self.waiting.push_front(seq);
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
        self.swap_out.extend(copies.into_iter().map(to_pb));
        seq.host_blocks = host_blocks;
        // The device blocks go back like a finished sequence's (cached, or to their other holders); the
        // sequence keeps its computed tokens and its state on the shards.
        self.cache_computed(&seq);
        let blocks = std::mem::replace(&mut seq.blocks, vec![0; num_null_blocks]);
        self.kv.release(&blocks);
        self.swapped.push_back(seq);
    }

    /// Moves an admitted request to the running set; a request holding no blocks takes its cached prefix.
    fn admit(&mut self, id: RequestId) {
        let i = self
            .waiting
            .iter()
            .position(|seq| seq.id == id)
            .expect("admitted requests wait");
        let mut seq = self.waiting.remove(i).expect("index in range");
        seq.waiting_permit = None;
        let is_first_admission = seq.admitted_at.is_none();
        if is_first_admission {
            let now = Instant::now();
            self.metrics.queue_time.observe((now - seq.arrived_at).as_secs_f64());
            seq.admitted_at = Some(now);
            seq.queue_span = None;
        }
        if seq.blocks.is_empty() {
            // The same match the scheduler saw: nothing changed the cache since.
            let hit = self
                .kv
                .match_prefix(seq.cache_salt(), &seq.token_ids, seq.token_ids.len() - 1);
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
        self.running.push(seq);
    }

    /// Gives `running[i]` its new `blocks` (a resumed sequence's K/V come back into the first of them,
    /// before the forward) and returns its share of the forward call.
    fn chunk(&mut self, i: usize, blocks: Vec<u32>, num_scheduled_tokens: usize) -> pb::SequenceChunk {
        let seq = &mut self.running[i];
        if !seq.host_blocks.is_empty() {
            let host_blocks = std::mem::take(&mut seq.host_blocks);
            let copies = self.swap.swap_in(&host_blocks, &blocks[..host_blocks.len()]);
            self.metrics.swapped_in_blocks.inc_by(copies.len() as u64);
            self.swap_in.extend(copies.into_iter().map(to_pb));
        }
        seq.blocks.extend(blocks);
        let num_prompt_tokens = seq
            .num_prompt_tokens
            .saturating_sub(seq.num_computed_tokens)
            .min(num_scheduled_tokens);
        self.metrics.prompt_tokens_computed.inc_by(num_prompt_tokens as u64);
        seq.chunk(
            num_scheduled_tokens,
            &self.eos_token_ids,
            &self.metrics.grammar_mask_seconds,
        )
    }
}

fn to_pb(copy: BlockCopy) -> pb::BlockCopy {
    pb::BlockCopy {
        device_block: copy.device_block,
        host_block: copy.host_block,
    }
}
