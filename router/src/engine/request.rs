//! One sequence's state inside the engine: its tokens, its KV blocks, and its text pipeline
//! (incremental detokenization, then the stop-sequence hold-back).

use std::{collections::HashSet, time::Instant};

use tokenizers::Tokenizer;

use super::{EndEvent, EngineError, EventSender, FinishReason, NewRequest, RequestId, TokenEvent};
use crate::{
    grammar::GrammarMatcher,
    scheduler::SeqView,
    shard::pb,
    telemetry,
    text::{DetokenizeError, IncrementalDetokenizer, StopMatcher},
    validation::{ValidCachePin, ValidRequest},
};

/// The prefix-cache namespace of requests in namespace `salt` (see `Sequence::cache_salt`) running with
/// adapter `adapter_id`: `salt` itself for the base model (0), else a fixed-key hash of both, never 0.
fn adapter_namespace(salt: u64, adapter_id: u32) -> u64 {
    use std::hash::{Hash, Hasher};
    if adapter_id == 0 {
        return salt;
    }
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (salt, adapter_id).hash(&mut hasher);
    hasher.finish().max(1)
}

pub struct Sequence {
    pub id: RequestId,
    /// Prompt followed by the generated tokens.
    pub token_ids: Vec<u32>,
    pub num_prompt_tokens: usize,
    /// Tokens whose K/V are in the blocks below.
    pub num_computed_tokens: usize,
    /// Prompt tokens whose K/V this sequence reused instead of computing (shared with a sibling).
    pub num_cached_tokens: usize,
    /// KV block ids in position order; some may be shared with other sequences. With a sliding window on
    /// every layer, the leading entries out of the window are the null block 0 (released, held nowhere).
    pub blocks: Vec<u32>,
    /// While swapped out: the host swap-pool blocks holding the K/V of its computed tokens, in position
    /// order (its device `blocks` are then empty, or only its null entries out of the window). Empty
    /// otherwise.
    pub host_blocks: Vec<u32>,
    /// Computed tokens it lost to its latest recompute preemption, counted as recomputed at readmission
    /// (less what the prefix cache gives back).
    pub num_lost_tokens: usize,
    /// Whether the shards hold this sequence's sampling params (false again after a release).
    pub is_known_to_shards: bool,
    /// Choices of the same prompt waiting for this sequence's prompt to be computed.
    pub forks: Vec<NewRequest>,
    /// When the request reached the engine.
    pub arrived_at: Instant,
    /// When it was first admitted (it may be admitted again after a preemption).
    pub admitted_at: Option<Instant>,
    /// When its first token was sampled.
    pub first_token_at: Option<Instant>,
    /// When its latest token was sampled.
    pub last_token_at: Option<Instant>,
    /// How often a request that arrived later was admitted while this one waited.
    pub num_times_overtaken: u32,
    /// Holds a place in the bounded waiting queue until the first admission.
    pub waiting_permit: Option<tokio::sync::OwnedSemaphorePermit>,
    /// The HTTP request's id, for the logs.
    pub tag: String,
    /// The HTTP request's `request` span; engine steps link to it.
    pub span: tracing::Span,
    /// From arrival to first admission; `None` once admitted (closing the span).
    pub queue_span: Option<tracing::Span>,
    /// When the request expires; None = never.
    pub deadline: Option<Instant>,
    /// The client fell too far behind the stream and was sent `EngineError::SlowReader`; the next
    /// iteration cancels the sequence.
    pub is_slow_reader: bool,
    /// Speculative decoding: the tokens proposed to follow `token_ids` this step (empty when none); the
    /// step's chunk carries those the scheduler gave room to.
    pub proposal: Vec<u32>,
    /// Speculative decoding: the most tokens it proposes next (`speculative::next_proposal_len`).
    pub max_proposal_len: usize,
    request: ValidRequest,
    events: EventSender,
    /// Under a grammar: where the generated tokens so far stand in it. Each sampled chunk carries the
    /// tokens it allows next; each sampled token advances it.
    grammar: Option<GrammarMatcher>,
    detokenizer: IncrementalDetokenizer,
    stop: StopMatcher,
    generated_text: String,
}

/// What applying a sampled token did to a sequence.
pub enum TokenOutcome {
    Continue,
    /// Generation ended normally; the last event went out.
    Finished,
    /// Its text could not be produced; an error event went out.
    Failed,
}

impl Sequence {
    pub fn new(new: NewRequest) -> Self {
        let NewRequest {
            id,
            request,
            events,
            forks,
            waiting_permit,
            tag,
            span,
            deadline,
        } = new;
        let queue_span = tracing::info_span!(target: telemetry::TARGET, parent: &span, "queue");
        Self {
            id,
            token_ids: request.prompt_ids.clone(),
            num_prompt_tokens: request.prompt_ids.len(),
            num_computed_tokens: 0,
            num_cached_tokens: 0,
            blocks: Vec::new(),
            host_blocks: Vec::new(),
            num_lost_tokens: 0,
            is_known_to_shards: false,
            forks,
            arrived_at: Instant::now(),
            admitted_at: None,
            first_token_at: None,
            last_token_at: None,
            num_times_overtaken: 0,
            waiting_permit,
            tag,
            span,
            queue_span: Some(queue_span),
            deadline,
            is_slow_reader: false,
            proposal: Vec::new(),
            max_proposal_len: usize::MAX,
            detokenizer: IncrementalDetokenizer::new(
                &request.prompt_ids,
                request.skip_special_tokens,
                request.kept_special_tokens.clone(),
            ),
            stop: StopMatcher::new(request.stop_sequences.clone()),
            generated_text: String::new(),
            grammar: request.grammar.as_ref().map(|grammar| grammar.matcher()),
            request,
            events,
        }
    }

    pub fn view(&self, num_freeable_blocks: usize, now: Instant) -> SeqView {
        SeqView {
            id: self.id,
            num_tokens: self.token_ids.len(),
            num_computed_tokens: self.num_computed_tokens,
            num_blocks: self.blocks.len(),
            num_null_blocks: self.num_null_blocks(),
            num_freeable_blocks,
            priority: self.request.priority,
            num_times_overtaken: self.num_times_overtaken,
            waited_ms: (now - self.arrived_at).as_millis() as u64,
            num_cached_evictable: 0,
            is_deferred: false,
            max_num_tokens: self.num_prompt_tokens + self.request.max_new_tokens as usize,
            adapter_id: self.adapter_id(),
            num_proposed_tokens: self.proposal.len(),
        }
    }

    /// Whether its one uncomputed token is the last sampled one.
    pub fn is_decoding(&self) -> bool {
        self.token_ids.len() - self.num_computed_tokens == 1
    }

    /// Whether proposals may be made for it now: it is decoding (its one uncomputed token is the last
    /// sampled), not under a grammar (a proposal could leave it), and has tokens left to generate after
    /// the next one. Returns how many at most.
    pub fn proposal_room(&self) -> usize {
        if !self.is_decoding() || self.grammar.is_some() {
            return 0;
        }
        let num_left = (self.request.max_new_tokens as usize).saturating_sub(self.num_generated_tokens());
        num_left.saturating_sub(1).min(self.max_proposal_len)
    }

    /// The LoRA adapter it runs with (0: the base model).
    pub fn adapter_id(&self) -> u32 {
        self.request.adapter.as_ref().map_or(0, |adapter| adapter.id)
    }

    /// The name of its LoRA adapter; None for the base model.
    pub fn adapter_name(&self) -> Option<&str> {
        self.request.adapter.as_ref().map(|adapter| &*adapter.name)
    }

    /// Leading block-table entries released out of the sliding window (the null block 0).
    pub fn num_null_blocks(&self) -> usize {
        self.blocks.iter().take_while(|&&block| block == 0).count()
    }

    /// The prefix-cache namespace of this request: its `cache_salt`'s (0 when it gave none), and with a
    /// LoRA adapter a namespace of that adapter's own, since an adapter changes every layer's K/V: two
    /// adapters, or an adapter and the base model, never share cached blocks or session pins. Adapter
    /// ids are never reused, so neither does an adapter loaded again under the same name.
    pub fn cache_salt(&self) -> u64 {
        adapter_namespace(self.request.cache_salt, self.adapter_id())
    }

    /// The session pin the request asks for once it finishes.
    pub fn cache_pin(&self) -> Option<&ValidCachePin> {
        self.request.cache_pin.as_ref()
    }

    pub fn num_generated_tokens(&self) -> usize {
        self.token_ids.len() - self.num_prompt_tokens
    }

    /// The client has gone (its receiver was dropped), or was cut off for reading too slowly.
    pub fn is_cancelled(&self) -> bool {
        self.events.is_closed() || self.is_slow_reader
    }

    /// The request's `timeout` (the deadline's distance from its submission), for error messages.
    pub fn timeout_s(&self) -> f64 {
        self.request.timeout.map_or(0.0, |timeout| timeout.as_secs_f64())
    }

    fn sampling_params(&self, eos_token_ids: &HashSet<u32>) -> pb::SamplingParams {
        let request = &self.request;
        let sampling = &request.sampling;
        let mut stop_token_ids = request.stop_token_ids.clone();
        if !request.ignore_eos {
            stop_token_ids.extend(eos_token_ids);
        }
        pb::SamplingParams {
            do_sample: sampling.do_sample,
            temperature: sampling.temperature,
            top_k: sampling.top_k,
            top_p: sampling.top_p,
            seed: sampling.seed,
            repetition_penalty: sampling.repetition_penalty,
            frequency_penalty: sampling.frequency_penalty,
            presence_penalty: sampling.presence_penalty,
            logit_bias: sampling.logit_bias.clone().into_iter().collect(),
            min_p: sampling.min_p,
            typical_p: sampling.typical_p,
            top_n_logprobs: request.top_n_tokens,
            num_prompt_tokens: self.num_prompt_tokens as u32,
            min_new_tokens: request.min_new_tokens,
            stop_token_ids,
        }
    }

    /// This sequence's part of a forward call computing `num_tokens` of its tokens, then the first
    /// `num_speculative_tokens` of its proposal (kept as the proposal to verify, the rest dropped); the
    /// time its grammar mask takes is added to `mask_seconds`.
    pub fn chunk(
        &mut self,
        num_tokens: usize,
        num_speculative_tokens: usize,
        eos_token_ids: &HashSet<u32>,
        mask_seconds: &prometheus::Counter,
    ) -> pb::SequenceChunk {
        let start = self.num_computed_tokens;
        let end = start + num_tokens;
        self.proposal.truncate(num_speculative_tokens);
        debug_assert_eq!(
            self.proposal.len(),
            num_speculative_tokens,
            "the plan verifies what was proposed"
        );
        let is_first_call = !self.is_known_to_shards;
        let params = is_first_call.then(|| self.sampling_params(eos_token_ids));
        // A penalty needs the whole history; tokens whose K/V were reused never reached the shard.
        let cached_token_ids = if is_first_call && self.request.sampling.has_penalty() {
            self.token_ids[..start].to_vec()
        } else {
            Vec::new()
        };
        self.is_known_to_shards = true;
        let sample = end == self.token_ids.len();
        pb::SequenceChunk {
            id: self.id.0,
            token_ids: [&self.token_ids[start..end], &self.proposal[..]].concat(),
            num_computed_tokens: start as u32,
            block_table: self.blocks.clone(),
            sample,
            params,
            cached_token_ids,
            // With `params` only, as the contract says; the shard keeps it with them.
            adapter_id: if is_first_call { self.adapter_id() } else { 0 },
            num_speculative_tokens: num_speculative_tokens as u32,
            allowed_token_bitmask: if sample && self.grammar.is_some() {
                let started = Instant::now();
                let mask = self.allowed_tokens(eos_token_ids);
                mask_seconds.inc_by(started.elapsed().as_secs_f64());
                mask
            } else {
                Vec::new()
            },
        }
    }

    /// The grammar's mask for the next token (empty without a grammar). Should the grammar fail, only
    /// EOS is allowed: the output ends rather than leave the grammar.
    fn allowed_tokens(&mut self, eos_token_ids: &HashSet<u32>) -> Vec<u32> {
        let Some(grammar) = &mut self.grammar else {
            return Vec::new();
        };
        grammar.allowed_tokens().unwrap_or_else(|error| {
            tracing::warn!(request_id = %self.tag, %error, "grammar failed; ending the sequence");
            let num_words = eos_token_ids.iter().max().map_or(0, |&max| max as usize / 32 + 1);
            let mut mask = vec![0u32; num_words];
            for &id in eos_token_ids {
                mask[id as usize / 32] |= 1 << (id % 32);
            }
            mask
        })
    }

    /// A new choice of this sequence's prompt that shares every full block before the last prompt
    /// token; it computes the rest itself (at least the last prompt token, for its own logits). The
    /// caller registers the child's shared blocks with the allocator.
    pub fn fork(&self, new: NewRequest, block_size: usize) -> Sequence {
        let mut child = Sequence::new(new);
        debug_assert_eq!(child.token_ids, self.token_ids[..self.num_prompt_tokens]);
        let num_shared_blocks = (self.num_prompt_tokens - 1) / block_size;
        child.blocks = self.blocks[..num_shared_blocks].to_vec();
        debug_assert!(
            !child.blocks.contains(&0),
            "a sequence with forks releases nothing out of its window"
        );
        child.num_computed_tokens = num_shared_blocks * block_size;
        child.num_cached_tokens = child.num_computed_tokens;
        child.queue_span = None; // a choice starts with its parent's prompt, without queueing
        child
    }

    /// Appends a sampled token, releases the text it completes, and decides whether generation ends.
    pub fn append_token(
        &mut self,
        tokenizer: &Tokenizer,
        eos_token_ids: &HashSet<u32>,
        generation: &pb::Generation,
    ) -> TokenOutcome {
        let token_id = generation.token_id;
        self.token_ids.push(token_id);
        if let Some(grammar) = &mut self.grammar {
            if let Err(error) = grammar.accept(token_id) {
                tracing::warn!(request_id = %self.tag, %error, "grammar refused a sampled token");
            }
        }
        let mut finish = None;
        let mut stopped = None;
        let piece = match self.detokenizer.push(tokenizer, token_id) {
            Ok(piece) => piece,
            Err(e) => return self.fail_text(e),
        };
        let mut outcome = self.stop.push(&piece);
        let is_end_token = (!self.request.ignore_eos && eos_token_ids.contains(&token_id))
            || self.request.stop_token_ids.contains(&token_id);
        if outcome.stopped.is_some() {
            stopped = outcome.stopped;
            finish = Some(FinishReason::StopSequence);
        } else if is_end_token {
            finish = Some(FinishReason::EosToken);
        } else if self.num_generated_tokens() >= self.request.max_new_tokens as usize {
            finish = Some(FinishReason::Length);
        }
        if matches!(finish, Some(FinishReason::EosToken | FinishReason::Length)) {
            // Release what was held back: the detokenizer's tail, then the stop matcher's.
            let tail = match self.detokenizer.flush(tokenizer) {
                Ok(tail) => tail,
                Err(e) => return self.fail_text(e),
            };
            let last = self.stop.push(&tail);
            outcome.text.push_str(&last.text);
            if last.stopped.is_some() {
                stopped = last.stopped;
                finish = Some(FinishReason::StopSequence);
            } else {
                outcome.text.push_str(&self.stop.flush());
            }
        }
        self.generated_text.push_str(&outcome.text);
        let end = finish.map(|finish_reason| EndEvent {
            finish_reason,
            generated_text: self.generated_text.clone(),
            num_generated_tokens: self.num_generated_tokens() as u32,
            num_prompt_tokens: self.num_prompt_tokens as u32,
            num_cached_tokens: self.num_cached_tokens as u32,
            stop_sequence: stopped.map(|index| self.request.stop_sequences[index].clone()),
        });
        let is_finished = end.is_some();
        let is_special = tokenizer
            .id_to_token(token_id)
            .is_some_and(|token| tokenizer.get_added_vocabulary().is_special_token(&token));
        self.send_token(TokenEvent {
            token_id,
            text: outcome.text,
            logprob: generation.logprob,
            is_special,
            top_logprobs: generation
                .top_logprobs
                .iter()
                .map(|t| (t.token_id, t.logprob))
                .collect(),
            end,
        });
        if self.is_slow_reader {
            // Cut off, finished or not: the next iteration cancels it before planning.
            TokenOutcome::Continue
        } else if is_finished {
            TokenOutcome::Finished
        } else {
            TokenOutcome::Continue
        }
    }

    fn fail_text(&self, error: DetokenizeError) -> TokenOutcome {
        self.fail(EngineError::Detokenize(error.to_string()));
        TokenOutcome::Failed
    }

    /// Sends a token event, unless the client already leaves `--max-unread-tokens` events unread: then it
    /// gets `EngineError::SlowReader` in the slot kept for it and is marked for cancellation. Never waits.
    /// (A send to a client that has gone fails; the next iteration cancels the sequence.)
    fn send_token(&mut self, event: TokenEvent) {
        let max_unread_tokens = self.events.max_capacity() - 1;
        let num_unread = self.events.max_capacity() - self.events.capacity();
        if num_unread >= max_unread_tokens {
            self.is_slow_reader = true;
            let _ = self.events.try_send(Err(EngineError::SlowReader(max_unread_tokens)));
        } else {
            let _ = self.events.try_send(Ok(event));
        }
    }

    /// Ends the request (and the choices waiting on it) with an error event. There is room for it: token
    /// events never take a channel's last slot.
    pub fn fail(&self, error: EngineError) {
        let _ = self.events.try_send(Err(error.clone()));
        for fork in &self.forks {
            let _ = fork.events.try_send(Err(error.clone()));
        }
    }

    /// Forgets the sequence's K/V (after a preemption or at the end): returns the blocks it held.
    pub fn reset_kv(&mut self) -> Vec<u32> {
        self.num_computed_tokens = 0;
        self.is_known_to_shards = false;
        std::mem::take(&mut self.blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::adapter_namespace;

    #[test]
    fn each_adapter_has_a_cache_namespace_of_its_own_in_each_salt() {
        let salted = 0x5eed;
        let namespaces = [
            adapter_namespace(0, 0),
            adapter_namespace(0, 1),
            adapter_namespace(0, 2),
            adapter_namespace(salted, 0),
            adapter_namespace(salted, 1),
            adapter_namespace(salted, 2),
        ];
        assert_eq!(namespaces[0], 0, "the base model keeps the shared namespace");
        assert_eq!(namespaces[3], salted, "and its salts'");
        for (i, a) in namespaces.iter().enumerate() {
            for b in &namespaces[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }
}
