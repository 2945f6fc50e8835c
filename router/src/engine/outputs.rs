//! Output application: after a forward pass, the scheduled sequences advance (newly computed prompt
//! blocks enter the prefix cache, choices waiting on a prompt start), and each sampled token is appended:
//! text, stop checks, events, latency metrics, and the release of sequences that finished.

use std::time::Instant;

use super::{
    request::{Sequence, TokenOutcome},
    EngineCore,
};
use crate::{kv::CacheActivity, metrics::Outcome, scheduler::StepPlan, shard::pb};

impl EngineCore {
    pub(super) fn apply_outputs(&mut self, plan: &StepPlan, response: pb::ForwardResponse) {
        self.advance(plan);
        for generation in &response.generations {
            let Some(i) = self.queues.running.iter().position(|seq| seq.id.0 == generation.id) else {
                tracing::error!(
                    id = generation.id,
                    "a shard returned a token for a sequence not in the step"
                );
                continue;
            };
            self.append_token(i, generation);
        }
    }

    /// Counts the scheduled tokens as computed. Full prompt blocks enter the cache as soon as they are
    /// computed, so requests in flight with the same prefix share them.
    fn advance(&mut self, plan: &StepPlan) {
        let mut activity = CacheActivity::default();
        for scheduled in &plan.scheduled {
            let i = self.queues.running_index(scheduled.id);
            let seq = &mut self.queues.running[i];
            let was_in_prompt = seq.num_computed_tokens < seq.num_prompt_tokens;
            seq.num_computed_tokens += scheduled.num_scheduled_tokens;
            if was_in_prompt {
                let num_tokens = seq.num_computed_tokens.min(seq.num_prompt_tokens);
                self.kv.cache(
                    seq.cache_salt(),
                    &seq.token_ids[..num_tokens],
                    &seq.blocks,
                    &mut activity,
                );
            }
            if seq.num_computed_tokens >= seq.num_prompt_tokens && !seq.forks.is_empty() {
                self.start_forks(i);
            }
        }
    }

    /// Appends a sampled token to `running[i]`; a sequence that finished or failed leaves.
    fn append_token(&mut self, i: usize, generation: &pb::Generation) {
        let seq = &mut self.queues.running[i];
        let now = Instant::now();
        if seq.first_token_at.is_none() {
            seq.first_token_at = Some(now);
        }
        match seq.last_token_at {
            None => self
                .metrics
                .time_to_first_token
                .observe((now - seq.arrived_at).as_secs_f64()),
            Some(last) => self.metrics.inter_token_latency.observe((now - last).as_secs_f64()),
        }
        seq.last_token_at = Some(now);
        self.metrics.generated_tokens.inc();
        match seq.append_token(&self.tokenizer, &self.eos_token_ids, generation) {
            TokenOutcome::Finished => {
                let mut seq = self.queues.running.remove(i);
                self.count_success(&seq, now);
                self.pin_prefix(&seq, now);
                self.release(&mut seq);
            }
            TokenOutcome::Failed => {
                let mut seq = self.queues.running.remove(i);
                self.metrics.count_request(Outcome::Failed);
                self.release(&mut seq);
            }
            TokenOutcome::Continue => {}
        }
    }

    fn count_success(&self, seq: &Sequence, now: Instant) {
        self.metrics.count_request(Outcome::Success);
        self.metrics
            .end_to_end_latency
            .observe((now - seq.arrived_at).as_secs_f64());
        let ms = |t: Option<Instant>| t.map_or(0.0, |t| (t - seq.arrived_at).as_secs_f64() * 1e3);
        tracing::info!(
            request_id = %seq.tag,
            sequence_id = %seq.id,
            outcome = "success",
            prompt_tokens = seq.num_prompt_tokens,
            cached_tokens = seq.num_cached_tokens,
            generated_tokens = seq.num_generated_tokens(),
            queue_ms = ms(seq.admitted_at),
            ttft_ms = ms(seq.first_token_at),
            e2e_ms = ms(Some(now)),
            "request finished"
        );
    }

    /// The prompt of `running[i]` is computed: the choices waiting on it join the running set, sharing
    /// its prompt blocks.
    fn start_forks(&mut self, i: usize) {
        let forks = std::mem::take(&mut self.queues.running[i].forks);
        for new in forks {
            let child = self.queues.running[i].fork(new, self.scheduler.config.block_size);
            self.kv.attach(&child.blocks);
            self.queues.running.push(child);
        }
    }
}
