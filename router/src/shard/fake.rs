//! A deterministic stand-in shard for router unit tests (never used outside `cfg(test)`): it checks
//! the calls it gets the way a real shard would and "predicts" the token after `t` to be `t + 1`.
//! Its "KV pool" stores the token id written at each slot (and its swap pool copies them), and every
//! call checks that each sequence's block table still holds, at every computed position the fake
//! wrote for it, the token it wrote there: a wrong block table, a lost or misplaced swap fails the call.
//! With LoRA slots (`with_lora`) it loads adapters (any path but one containing `missing`), and fails a
//! call whose sequences name an adapter it does not hold or more distinct adapters than it has slots, or
//! that unloads an adapter it does not hold. As a draft model (`with_mispredictions`) it may predict
//! `t + 2` after some tokens, so a target's verification rejects some of its proposals.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use futures::{future::BoxFuture, FutureExt};

use super::{pb, ShardClient, ShardError};

pub const FAKE_VOCAB_SIZE: u32 = 32;
pub const FAKE_EOS: u32 = 31;

#[derive(Default)]
struct FakeState {
    /// Sequences the fake holds params for.
    known: HashMap<u64, pb::SamplingParams>,
    num_forwards: usize,
    /// Token id written at each device slot / host slot (absent: never written).
    device_slots: HashMap<usize, u32>,
    host_slots: HashMap<usize, u32>,
    /// Per sequence: the tokens the fake computed for it, by position, since it was last released.
    written: HashMap<u64, HashMap<usize, u32>>,
    /// The most blocks (null entries aside) a decode chunk's block table has named.
    max_decode_blocks: usize,
    /// Loaded LoRA adapters: id -> path.
    adapters: HashMap<u32, String>,
    /// Each known sequence's adapter (0: the base model).
    adapter_of: HashMap<u64, u32>,
    /// The most distinct adapters one call has used.
    max_adapters_per_call: usize,
}

#[derive(Clone)]
pub struct FakeShard {
    num_blocks: u32,
    num_host_blocks: u32,
    block_size: u32,
    /// Every layer's sliding window in tokens (0: full attention). With one, block-table entries out of
    /// the window may be the null block, and only positions in the window are checked.
    window: u32,
    /// LoRA slots (Info's `max_loras`); 0: LoRA off.
    max_loras: u32,
    /// After a token `t` with `t % mispredict_every == mispredict_every - 1` it predicts `t + 2`; 0: never.
    mispredict_every: u32,
    state: Arc<Mutex<FakeState>>,
}

impl FakeShard {
    pub fn new(num_blocks: u32, block_size: u32) -> Self {
        Self {
            num_blocks,
            num_host_blocks: 0,
            block_size,
            window: 0,
            max_loras: 0,
            mispredict_every: 0,
            state: Arc::default(),
        }
    }

    /// A model whose every layer attends through a window of `window` tokens.
    pub fn with_window(mut self, window: u32) -> Self {
        self.window = window;
        self
    }

    /// With a host swap pool of `num_host_blocks` blocks (block 0 included), cheap to copy.
    pub fn with_swap_pool(mut self, num_host_blocks: u32) -> Self {
        self.num_host_blocks = num_host_blocks;
        self
    }

    /// With `max_loras` LoRA slots.
    pub fn with_lora(mut self, max_loras: u32) -> Self {
        self.max_loras = max_loras;
        self
    }

    /// A model that predicts `t + 2` after every token `t` with `t % every == every - 1` (`every` > 0).
    pub fn with_mispredictions(mut self, every: u32) -> Self {
        self.mispredict_every = every;
        self
    }

    /// Forward calls run so far.
    pub fn num_forwards(&self) -> usize {
        self.state.lock().expect("not poisoned").num_forwards
    }

    /// The adapters loaded now, by id.
    pub fn adapters(&self) -> HashMap<u32, String> {
        self.state.lock().expect("not poisoned").adapters.clone()
    }

    /// The most distinct adapters one forward call has used so far.
    pub fn max_adapters_per_call(&self) -> usize {
        self.state.lock().expect("not poisoned").max_adapters_per_call
    }

    /// The most blocks (null entries aside) a decode chunk's block table has named so far.
    pub fn max_decode_blocks(&self) -> usize {
        self.state.lock().expect("not poisoned").max_decode_blocks
    }

    /// Sequences whose state the fake still holds (they were never released).
    pub fn num_known(&self) -> usize {
        self.state.lock().expect("not poisoned").known.len()
    }

    fn run(&self, request: pb::ForwardRequest) -> Result<pb::ForwardResponse, ShardError> {
        let mut state = self.state.lock().expect("not poisoned");
        state.num_forwards += 1;
        let invalid = |message: String| ShardError::Rpc { rank: 0, message };
        for id in &request.released_ids {
            state.known.remove(id);
            state.written.remove(id);
            state.adapter_of.remove(id);
        }
        for id in &request.unloaded_adapter_ids {
            if state.adapters.remove(id).is_none() {
                return Err(invalid(format!("unloads adapter {id}, which is not loaded")));
            }
        }
        let block_size = self.block_size as usize;
        for (copies, is_out) in [(&request.swap_out, true), (&request.swap_in, false)] {
            for copy in copies {
                if copy.device_block == 0 || copy.device_block >= self.num_blocks {
                    return Err(invalid(format!("swap names device block {}", copy.device_block)));
                }
                if copy.host_block == 0 || copy.host_block >= self.num_host_blocks {
                    return Err(invalid(format!("swap names host block {}", copy.host_block)));
                }
                for offset in 0..block_size {
                    let device = copy.device_block as usize * block_size + offset;
                    let host = copy.host_block as usize * block_size + offset;
                    let (from, to) = if is_out { (device, host) } else { (host, device) };
                    let state = &mut *state;
                    let (source, target) = if is_out {
                        (&state.device_slots, &mut state.host_slots)
                    } else {
                        (&state.host_slots, &mut state.device_slots)
                    };
                    match source.get(&from).copied() {
                        Some(token) => target.insert(to, token),
                        None => target.remove(&to),
                    };
                }
            }
        }
        let mut generations = Vec::new();
        let mut adapters_used = std::collections::HashSet::new();
        for chunk in &request.sequences {
            if chunk.params.is_none() && chunk.adapter_id != 0 {
                return Err(invalid(format!(
                    "sequence {}: adapter_id sent without params",
                    chunk.id
                )));
            }
            if let Some(params) = chunk.params.clone() {
                state.known.insert(chunk.id, params);
                state.adapter_of.insert(chunk.id, chunk.adapter_id);
            }
            let adapter = state.adapter_of.get(&chunk.id).copied().unwrap_or(0);
            if adapter != 0 {
                if !state.adapters.contains_key(&adapter) {
                    return Err(invalid(format!(
                        "sequence {} names adapter {adapter}, not loaded",
                        chunk.id
                    )));
                }
                adapters_used.insert(adapter);
            }
            if !state.known.contains_key(&chunk.id) {
                return Err(invalid(format!("sequence {} has no params", chunk.id)));
            }
            let end = chunk.num_computed_tokens as usize + chunk.token_ids.len();
            if chunk.block_table.len() * (self.block_size as usize) < end {
                return Err(invalid(format!("sequence {} has too few blocks", chunk.id)));
            }
            let start = chunk.num_computed_tokens as usize;
            // The first position a query of this chunk reads.
            let first_read = match self.window {
                0 => 0,
                window => (start + 1).saturating_sub(window as usize),
            };
            let num_unread_blocks = first_read / block_size;
            let is_bad = |(i, &b): (usize, &u32)| (b == 0 && i >= num_unread_blocks) || b >= self.num_blocks;
            if chunk.block_table.iter().enumerate().any(is_bad) {
                return Err(invalid(format!("sequence {} names a bad block", chunk.id)));
            }
            if chunk.token_ids.len() == 1 {
                let num_blocks = chunk.block_table.iter().filter(|&&b| b != 0).count();
                state.max_decode_blocks = state.max_decode_blocks.max(num_blocks);
            }
            let slot = |p: usize| chunk.block_table[p / block_size] as usize * block_size + p % block_size;
            let written = state.written.entry(chunk.id).or_default().clone();
            for (&p, &token) in &written {
                if (first_read..start).contains(&p) && state.device_slots.get(&slot(p)) != Some(&token) {
                    return Err(invalid(format!("sequence {} lost its K/V at position {p}", chunk.id)));
                }
            }
            for (k, &token) in chunk.token_ids.iter().enumerate() {
                state.device_slots.insert(slot(start + k), token);
                state
                    .written
                    .get_mut(&chunk.id)
                    .expect("entry made above")
                    .insert(start + k, token);
            }
            let num_speculative = chunk.num_speculative_tokens as usize;
            if num_speculative > 0 && (!chunk.sample || num_speculative >= chunk.token_ids.len()) {
                return Err(invalid(format!(
                    "sequence {} has a bad num_speculative_tokens",
                    chunk.id
                )));
            }
            if chunk.sample {
                // One token per sampled position: the chunk's last, and each proposal's.
                let sampled = &chunk.token_ids[chunk.token_ids.len() - 1 - num_speculative..];
                generations.extend(sampled.iter().map(|&token| pb::Generation {
                    id: chunk.id,
                    token_id: (token + self.step_after(token)) % FAKE_VOCAB_SIZE,
                    logprob: -0.5,
                    top_logprobs: Vec::new(),
                }));
            }
        }
        if adapters_used.len() > self.max_loras as usize {
            return Err(invalid(format!(
                "the call uses {} adapters, more than its {} slots",
                adapters_used.len(),
                self.max_loras
            )));
        }
        state.max_adapters_per_call = state.max_adapters_per_call.max(adapters_used.len());
        Ok(pb::ForwardResponse {
            generations,
            forward_time_us: 1,
        })
    }
}

impl FakeShard {
    /// What the fake adds to `token` to predict the next one.
    fn step_after(&self, token: u32) -> u32 {
        let every = self.mispredict_every;
        if every > 0 && token % every == every - 1 {
            2
        } else {
            1
        }
    }
}

impl ShardClient for FakeShard {
    fn info(&self) -> BoxFuture<'_, Result<pb::InfoResponse, ShardError>> {
        let info = pb::InfoResponse {
            model_type: "fake".into(),
            dtype: "float32".into(),
            device: "cpu".into(),
            block_size: self.block_size,
            vocab_size: FAKE_VOCAB_SIZE,
            eos_token_ids: vec![FAKE_EOS],
            max_position_embeddings: 1024,
            world_size: 1,
            architecture: "FakeForCausalLM".into(),
            sliding_windows: vec![self.window, self.window],
            max_loras: self.max_loras,
            max_lora_rank: 16,
        };
        async move { Ok(info) }.boxed()
    }

    fn health(&self) -> BoxFuture<'_, Result<bool, ShardError>> {
        async { Ok(true) }.boxed()
    }

    fn warmup(&self, _: pb::WarmupRequest) -> BoxFuture<'_, Result<pb::WarmupResponse, ShardError>> {
        let response = pb::WarmupResponse {
            num_blocks: self.num_blocks,
            num_host_blocks: self.num_host_blocks,
            swap_seconds_per_block: 1e-6,
            prefill_seconds_per_token: 1e-4,
            ..Default::default()
        };
        async move { Ok(response) }.boxed()
    }

    fn forward(
        &self,
        request: pb::ForwardRequest,
        _is_decode: bool,
    ) -> BoxFuture<'_, Result<pb::ForwardResponse, ShardError>> {
        let result = self.run(request);
        async move {
            // Yield like a real call would, so other tasks (handlers) interleave with the engine.
            tokio::task::yield_now().await;
            result
        }
        .boxed()
    }

    fn clear_cache(&self) -> BoxFuture<'_, Result<(), ShardError>> {
        let mut state = self.state.lock().expect("not poisoned");
        state.known.clear();
        state.written.clear();
        state.adapter_of.clear();
        async { Ok(()) }.boxed()
    }

    fn load_adapter(
        &self,
        request: pb::LoadAdapterRequest,
    ) -> BoxFuture<'_, Result<pb::LoadAdapterResponse, ShardError>> {
        let mut state = self.state.lock().expect("not poisoned");
        let result = if self.max_loras == 0 {
            Err(ShardError::Refused {
                rank: 0,
                message: "LoRA is off: start the shard with --max-loras".into(),
            })
        } else if request.path.contains("missing") {
            Err(ShardError::Refused {
                rank: 0,
                message: format!("{} has no adapter_config.json", request.path),
            })
        } else {
            assert!(
                state.adapters.insert(request.adapter_id, request.path).is_none(),
                "adapter ids are never reused"
            );
            Ok(pb::LoadAdapterResponse {
                rank: 8,
                target_modules: vec!["q_proj".into(), "v_proj".into()],
            })
        };
        async move { result }.boxed()
    }
}
