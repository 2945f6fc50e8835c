//! Output application: after a forward pass, the scheduled sequences advance (newly computed prompt
//! blocks enter the prefix cache, choices waiting on a prompt start), and each sampled token is appended:
//! text, stop checks, events, latency metrics, and the release of sequences that finished. A sequence that
//! verified proposals (speculative decoding) gets one token per verified position: its proposals are kept
//! while each equals the token sampled at its position, and the blocks of the rejected rest go back.

use std::time::Instant;

use super::{
    request::{Sequence, TokenOutcome},
    EngineCore,
};
use crate::{kv::CacheActivity, metrics::Outcome, scheduler::StepPlan, shard::pb, speculative::next_proposal_len};

impl EngineCore {
    pub(super) fn apply_outputs(&mut self, plan: &StepPlan, response: pb::ForwardResponse) {
        self.advance(plan);
        // A sequence's tokens are consecutive: one per position it sampled at.
        for generations in response.generations.chunk_by(|a, b| a.id == b.id) {
            let id = generations[0].id;
            let Some(i) = self.queues.running.iter().position(|seq| seq.id.0 == id) else {
                tracing::error!(id, "a shard returned a token for a sequence not in the step");
                continue;
            };
            self.append_generated(i, generations);
        }
    }

    /// Appends the tokens `running[i]` sampled: the first, then while the proposal the step verified
    /// agrees with what was sampled before, the next (its proposed token's K/V are then computed). The
    /// blocks past its computed tokens (rejected proposals') go back to the pool.
    fn append_generated(&mut self, i: usize, generations: &[pb::Generation]) {
        let proposal = std::mem::take(&mut self.queues.running[i].proposal);
        if generations.len() != proposal.len() + 1 {
            tracing::error!(
                id = generations[0].id,
                tokens = generations.len(),
                proposed = proposal.len(),
                "a shard returned a token count that does not match the positions sampled; keeping the first"
            );
        }
        let mut num_accepted = 0;
        for (j, generation) in generations.iter().enumerate() {
            if !self.append_token(i, generation) {
                break;
            }
            if proposal.get(j) != Some(&generation.token_id) || j + 1 == generations.len() {
                break;
            }
            num_accepted += 1;
            self.queues.running[i].num_computed_tokens += 1;
        }
        if !proposal.is_empty() {
            self.metrics.spec_decode_drafts.inc();
            self.metrics.spec_decode_draft_tokens.inc_by(proposal.len() as u64);
            self.metrics.spec_decode_accepted_tokens.inc_by(num_accepted as u64);
        }
        let Some(seq) = self.queues.running.get_mut(i).filter(|seq| seq.id.0 == generations[0].id) else {
            return; // it finished
        };
        if let Some(config) = self.speculative {
            if !proposal.is_empty() {
                seq.max_proposal_len = next_proposal_len(proposal.len(), num_accepted, config.max_proposed_tokens);
            }
        }
        let num_kept = seq.num_computed_tokens.div_ceil(self.scheduler.config.block_size);
        if seq.blocks.len() > num_kept {
            let rejected = seq.blocks.split_off(num_kept);
            self.kv.release(&rejected);
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
            // Proposals count once accepted (`append_generated`).
            seq.num_computed_tokens += scheduled.num_scheduled_tokens - scheduled.num_speculative_tokens;
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

    /// Appends a sampled token to `running[i]`; a sequence that finished or failed leaves (false).
    fn append_token(&mut self, i: usize, generation: &pb::Generation) -> bool {
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
                false
            }
            TokenOutcome::Failed => {
                let mut seq = self.queues.running.remove(i);
                self.metrics.count_request(Outcome::Failed);
                self.release(&mut seq);
                false
            }
            TokenOutcome::Continue => true,
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
