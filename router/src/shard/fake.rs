//! A deterministic stand-in shard for router unit tests (never used outside `cfg(test)`): it checks
//! the calls it gets the way a real shard would and "predicts" the token after `t` to be `t + 1`.

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
}

#[derive(Clone)]
pub struct FakeShard {
    num_blocks: u32,
    block_size: u32,
    state: Arc<Mutex<FakeState>>,
}

impl FakeShard {
    pub fn new(num_blocks: u32, block_size: u32) -> Self {
        Self {
            num_blocks,
            block_size,
            state: Arc::default(),
        }
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
        }
        let mut generations = Vec::new();
        for chunk in &request.sequences {
            if let Some(params) = chunk.params.clone() {
                state.known.insert(chunk.id, params);
            }
            if !state.known.contains_key(&chunk.id) {
                return Err(invalid(format!("sequence {} has no params", chunk.id)));
            }
            let end = chunk.num_computed_tokens as usize + chunk.token_ids.len();
            if chunk.block_table.len() * (self.block_size as usize) < end {
                return Err(invalid(format!("sequence {} has too few blocks", chunk.id)));
            }
            if chunk.block_table.iter().any(|&b| b == 0 || b >= self.num_blocks) {
                return Err(invalid(format!("sequence {} names a bad block", chunk.id)));
            }
            if chunk.sample {
                let last = *chunk.token_ids.last().expect("chunks are not empty");
                generations.push(pb::Generation {
                    id: chunk.id,
                    token_id: (last + 1) % FAKE_VOCAB_SIZE,
                    logprob: -0.5,
                    top_logprobs: Vec::new(),
                });
            }
        }
        Ok(pb::ForwardResponse {
            generations,
            forward_time_us: 1,
        })
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
        };
        async move { Ok(info) }.boxed()
    }

    fn health(&self) -> BoxFuture<'_, Result<(), ShardError>> {
        async { Ok(()) }.boxed()
    }

    fn warmup(&self, _: pb::WarmupRequest) -> BoxFuture<'_, Result<pb::WarmupResponse, ShardError>> {
        let num_blocks = self.num_blocks;
        async move { Ok(pb::WarmupResponse { num_blocks }) }.boxed()
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
        self.state.lock().expect("not poisoned").known.clear();
        async { Ok(()) }.boxed()
    }
}
