//! Speculative decoding with a draft model (`--speculative draft`): a smaller model with the target's
//! tokenizer, on a shard of its own, decodes each decoding sequence's next few tokens greedily before the
//! step is planned; they are the sequence's proposal, which the target's forward verifies as any other.
//!
//! The router owns the draft's KV memory as it owns the target's, in a pool of its own (`BlockAllocator`,
//! no prefix cache). A sequence's draft state is its draft blocks and `num_computed_tokens`, the tokens
//! whose draft K/V they hold. Proposing for k tokens takes k calls to the draft shard, batched over the
//! sequences: the first computes what the draft has not seen of each sequence (all of it the first time)
//! and samples the first draft token, each next one feeds the previous draft token. Before each proposal
//! the draft state rolls back to the target's computed tokens: the draft K/V of accepted proposals stay
//! valid (they equal the tokens that were kept), those of rejected ones are dropped with their blocks.
//!
//! Draft tokens are greedy whatever the request samples with: a proposal is a point mass, so the engine's
//! acceptance (keep a proposal while it equals the token sampled at its position) stays exact.
//! A draft shard that fails fails no request: the step goes without proposals, the draft state is
//! forgotten (the shard is told to drop it), and the draft rests for `RETRY_AFTER`.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use super::{EngineCore, RequestId};
use crate::{
    kv::BlockAllocator,
    shard::{pb, ShardClient, ShardError},
};

/// How long the draft rests after a failed call before it proposes again (a dead draft shard must not
/// cost every step a failed call).
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The draft model: its shard, its KV pool, and each sequence's draft state.
pub struct DraftModel {
    shard: Arc<dyn ShardClient>,
    blocks: BlockAllocator,
    block_size: usize,
    /// The draft shard's Warmup bounds: tokens and sequences in one call.
    max_batch_tokens: usize,
    max_batch_size: usize,
    sequences: HashMap<RequestId, DraftSequence>,
    /// Sequences the draft shard holds state for that have gone since its last call.
    released_ids: Vec<u64>,
    /// After a failure: no draft call before then.
    resting_until: Option<Instant>,
}

/// A sequence's draft K/V: its blocks in the draft pool, and how many of its tokens they hold.
#[derive(Debug, Default)]
struct DraftSequence {
    blocks: Vec<u32>,
    num_computed_tokens: usize,
}

/// A sequence to propose for: its tokens (the last one sampled, not computed yet) and how many tokens
/// it may propose.
pub(super) struct DraftInput<'a> {
    pub(super) id: RequestId,
    pub(super) token_ids: &'a [u32],
    pub(super) num_prompt_tokens: usize,
    pub(super) num_proposed_tokens: usize,
}

impl DraftModel {
    /// A draft over `shard`, whose Warmup gave it `num_blocks` blocks (block 0, the null block, included)
    /// of `block_size` tokens for calls of at most `max_batch_tokens` tokens and `max_batch_size`
    /// sequences.
    pub fn new(
        shard: Arc<dyn ShardClient>,
        num_blocks: u32,
        block_size: usize,
        max_batch_tokens: usize,
        max_batch_size: usize,
    ) -> Self {
        Self {
            shard,
            blocks: BlockAllocator::new(num_blocks),
            block_size,
            max_batch_tokens,
            max_batch_size,
            sequences: HashMap::new(),
            released_ids: Vec::new(),
            resting_until: None,
        }
    }

    pub fn num_usable_blocks(&self) -> u32 {
        self.blocks.num_usable_blocks()
    }

    pub fn num_free_blocks(&self) -> u32 {
        self.blocks.num_free_blocks()
    }

    /// Forgets a sequence's draft state (it finished, was cancelled or preempted): its blocks go back and
    /// the draft shard drops its state with the next call.
    pub(super) fn release(&mut self, id: RequestId) {
        if let Some(seq) = self.sequences.remove(&id) {
            self.free(&seq.blocks);
            self.released_ids.push(id.0);
        }
    }

    /// Rolls a sequence's draft state back to the `num_computed_tokens` the target holds for it; the blocks
    /// past them go back.
    pub(super) fn roll_back(&mut self, id: RequestId, num_computed_tokens: usize) {
        let Some(seq) = self.sequences.get_mut(&id) else { return };
        seq.num_computed_tokens = seq.num_computed_tokens.min(num_computed_tokens);
        let num_kept = seq.num_computed_tokens.div_ceil(self.block_size);
        if seq.blocks.len() > num_kept {
            let freed = seq.blocks.split_off(num_kept);
            self.free(&freed);
        }
    }

    fn free(&mut self, blocks: &[u32]) {
        self.blocks
            .free(blocks)
            .expect("a draft sequence holds only blocks the draft pool handed out");
    }

    /// The draft tokens of each input, in order (empty for those that get none this step: no room in the
    /// draft pool or the call, a long catch-up still under way, or a failed draft shard).
    pub(super) async fn propose(&mut self, inputs: &[DraftInput<'_>]) -> Vec<Vec<u32>> {
        let mut proposals = vec![Vec::new(); inputs.len()];
        if self.resting_until.is_some_and(|until| Instant::now() < until) {
            return proposals;
        }
        self.resting_until = None;
        if let Err(error) = self.decode_ahead(inputs, &mut proposals).await {
            tracing::warn!(%error, "the draft model's shard failed: no proposals for {RETRY_AFTER:?}");
            for (id, seq) in std::mem::take(&mut self.sequences) {
                self.free(&seq.blocks);
                self.released_ids.push(id.0);
            }
            proposals.iter_mut().for_each(Vec::clear);
            self.resting_until = Some(Instant::now() + RETRY_AFTER);
        }
        proposals
    }

    /// The draft calls: the first catches each sequence up and samples its first draft token, each next
    /// one feeds every still unfinished proposal its latest token.
    async fn decode_ahead(&mut self, inputs: &[DraftInput<'_>], proposals: &mut [Vec<u32>]) -> Result<(), ShardError> {
        let mut chunks = Vec::new();
        // Inputs proposing this step: index and number of tokens.
        let mut proposing = Vec::new();
        let mut num_tokens_left = self.max_batch_tokens;
        for (n, input) in inputs.iter().enumerate() {
            if chunks.len() == self.max_batch_size || num_tokens_left == 0 {
                break;
            }
            let is_new = !self.sequences.contains_key(&input.id);
            let seq = self.sequences.entry(input.id).or_default();
            let start = seq.num_computed_tokens;
            let num_tokens = (input.token_ids.len() - start).min(num_tokens_left);
            let is_caught_up = start + num_tokens == input.token_ids.len();
            let num_proposed = if is_caught_up { input.num_proposed_tokens } else { 0 };
            // K/V for every token fed: the catch-up, then each draft token but the last.
            let end = start + num_tokens + num_proposed.saturating_sub(1);
            let num_new_blocks = end.div_ceil(self.block_size).saturating_sub(seq.blocks.len());
            let Some(blocks) = self.blocks.allocate(num_new_blocks as u32) else {
                if is_new {
                    self.sequences.remove(&input.id);
                }
                continue;
            };
            seq.blocks.extend(blocks);
            seq.num_computed_tokens = start + num_tokens;
            num_tokens_left -= num_tokens;
            chunks.push(pb::SequenceChunk {
                id: input.id.0,
                token_ids: input.token_ids[start..start + num_tokens].to_vec(),
                num_computed_tokens: start as u32,
                block_table: seq.blocks.clone(),
                sample: is_caught_up,
                params: is_new.then(|| greedy_params(input.num_prompt_tokens)),
                ..Default::default()
            });
            if num_proposed > 0 {
                proposing.push((n, num_proposed));
            }
        }
        while !chunks.is_empty() {
            let is_decode = chunks.iter().all(|chunk| chunk.token_ids.len() == 1);
            let request = pb::ForwardRequest {
                released_ids: std::mem::take(&mut self.released_ids),
                sequences: chunks,
                ..Default::default()
            };
            let released_ids = request.released_ids.clone();
            let response = match self.shard.forward(request, is_decode).await {
                Ok(response) => response,
                Err(error) => {
                    self.released_ids.extend(released_ids);
                    return Err(error);
                }
            };
            let mut has_token = vec![false; inputs.len()];
            for generation in &response.generations {
                if let Some(&(n, _)) = proposing.iter().find(|(n, _)| inputs[*n].id.0 == generation.id) {
                    proposals[n].push(generation.token_id);
                    has_token[n] = true;
                }
            }
            proposing.retain(|&(n, num_proposed)| has_token[n] && proposals[n].len() < num_proposed);
            chunks = proposing
                .iter()
                .map(|&(n, _)| {
                    let seq = self
                        .sequences
                        .get_mut(&inputs[n].id)
                        .expect("a proposing sequence has draft state");
                    let chunk = pb::SequenceChunk {
                        id: inputs[n].id.0,
                        token_ids: vec![*proposals[n].last().expect("a token was just drafted")],
                        num_computed_tokens: seq.num_computed_tokens as u32,
                        block_table: seq.blocks.clone(),
                        sample: true,
                        ..Default::default()
                    };
                    seq.num_computed_tokens += 1;
                    chunk
                })
                .collect();
        }
        Ok(())
    }
}

/// Argmax: the draft's proposals are point masses (see the module's comment).
fn greedy_params(num_prompt_tokens: usize) -> pb::SamplingParams {
    pb::SamplingParams {
        do_sample: false,
        temperature: 1.0,
        top_p: 1.0,
        num_prompt_tokens: num_prompt_tokens as u32,
        ..Default::default()
    }
}

impl EngineCore {
    /// Speculative decoding with a draft model: each decoding sequence's proposal for this step, drafted
    /// before the plan (the scheduler decides how much of it the step computes). The draft state of every
    /// running sequence first rolls back to what the target has computed (the previous step's
    /// verification).
    pub(super) async fn propose_by_draft(&mut self) {
        let (Some(config), Some(draft)) = (self.speculative, self.draft.as_mut()) else {
            return;
        };
        let started = Instant::now();
        let mut inputs = Vec::new();
        let mut proposers = Vec::new();
        // Drafting costs forwards: only as many tokens as the scheduler could give room to (the proposal
        // budget of `scheduler::schedule`, oldest sequences first), none at all once the decodes fill it.
        let num_decodes = self.queues.running.iter().filter(|seq| seq.is_decoding()).count();
        let mut budget = config.max_step_tokens.saturating_sub(num_decodes);
        for (i, seq) in self.queues.running.iter().enumerate() {
            draft.roll_back(seq.id, seq.num_computed_tokens);
            let room = seq.proposal_room().min(config.max_proposed_tokens).min(budget);
            budget -= room;
            if room > 0 {
                inputs.push(DraftInput {
                    id: seq.id,
                    token_ids: &seq.token_ids,
                    num_prompt_tokens: seq.num_prompt_tokens,
                    num_proposed_tokens: room,
                });
                proposers.push(i);
            }
        }
        let proposals = if inputs.is_empty() {
            Vec::new()
        } else {
            draft.propose(&inputs).await
        };
        drop(inputs);
        for seq in &mut self.queues.running {
            seq.proposal.clear();
        }
        for (i, proposal) in proposers.into_iter().zip(proposals) {
            self.queues.running[i].proposal = proposal;
        }
        self.metrics
            .spec_decode_proposal_seconds
            .inc_by(started.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::fake::FakeShard;

    fn input(token_ids: &[u32], num_proposed_tokens: usize) -> DraftInput<'_> {
        DraftInput {
            id: RequestId(7),
            token_ids,
            num_prompt_tokens: 3,
            num_proposed_tokens,
        }
    }

    #[tokio::test]
    async fn drafts_one_call_per_token_and_rolls_back_to_what_the_target_kept() {
        // The fake predicts t + 1 after t, and checks every block table holds what it computed.
        let shard = FakeShard::new(9, 4);
        let mut draft = DraftModel::new(Arc::new(shard.clone()), 9, 4, 16, 4);
        assert_eq!(draft.propose(&[input(&[1, 2, 3, 4, 5], 3)]).await, [vec![6, 7, 8]]);
        assert_eq!(
            shard.num_forwards(),
            3,
            "the catch-up drafts the first token, then one call each"
        );
        assert_eq!(
            draft.num_free_blocks(),
            8 - 2,
            "K/V of the 5 tokens and 2 draft tokens fed back"
        );
        // The target kept 6 and 7, then sampled 9: the draft K/V of 1..=7 stay, and only 9 is fed.
        draft.roll_back(RequestId(7), 7);
        assert_eq!(
            draft.propose(&[input(&[1, 2, 3, 4, 5, 6, 7, 9], 2)]).await,
            [vec![10, 11]]
        );
        assert_eq!(shard.num_forwards(), 5);
        assert_eq!(draft.num_free_blocks(), 8 - 3);
        draft.roll_back(RequestId(7), 3);
        assert_eq!(draft.num_free_blocks(), 8 - 1, "blocks past the kept tokens go back");
        draft.release(RequestId(7));
        assert_eq!(draft.num_free_blocks(), 8);
        assert_eq!(shard.num_known(), 1, "the shard drops the sequence with the next call");
        assert_eq!(draft.propose(&[]).await, Vec::<Vec<u32>>::new());
    }

    #[tokio::test]
    async fn a_full_draft_pool_or_call_leaves_a_sequence_without_a_proposal() {
        let shard = FakeShard::new(3, 4);
        let mut draft = DraftModel::new(Arc::new(shard.clone()), 3, 4, 6, 4);
        let tokens = [1, 2, 3, 4, 5, 6, 7];
        // A call computes 6 tokens at most: the catch-up takes two.
        assert_eq!(draft.propose(&[input(&tokens, 4)]).await, [Vec::<u32>::new()]);
        assert_eq!((shard.num_forwards(), draft.num_free_blocks()), (1, 0));
        // 2 usable blocks: the 7 tokens and 3 draft tokens fed back do not fit; what is computed stays.
        assert_eq!(draft.propose(&[input(&tokens, 4)]).await, [Vec::<u32>::new()]);
        assert_eq!((shard.num_forwards(), draft.num_free_blocks()), (1, 0));
        assert_eq!(draft.propose(&[input(&tokens, 1)]).await, [vec![8]]);
        assert_eq!(shard.num_forwards(), 2);
    }
}
