//! The engine before and after serving normally: step-time calibration for `--target-itl-ms` at start,
//! and recovery when the shards come back after a failure (`--restart-shards`).

use std::time::{Duration, Instant};

use super::{EngineCore, RequestId};
use crate::{
    kv::{CacheActivity, KvPool, SwapPool},
    scheduler::{PreemptionConfig, PreemptionCosts, PreemptionMode},
    shard::{pb, ShardError},
};

/// How often an idle engine asks the shards whether they restarted.
pub const IDLE_SHARD_CHECK: Duration = Duration::from_secs(1);

/// The preemption settings for `mode` given the shards' Warmup answer.
pub fn preemption_config(mode: PreemptionMode, warmup: &pb::WarmupResponse) -> PreemptionConfig {
    PreemptionConfig {
        mode,
        num_host_blocks: warmup.num_host_blocks,
        costs: PreemptionCosts {
            swap_seconds_per_block: f64::from(warmup.swap_seconds_per_block),
            prefill_seconds_per_token: f64::from(warmup.prefill_seconds_per_token),
        },
    }
}

impl EngineCore {
    /// Teaches the ITL budget the step time at a few token counts with synthetic forward passes, before
    /// any request arrives. The budget keeps learning from every real step afterwards.
    pub(super) async fn calibrate(&mut self) {
        const SIZES: [usize; 5] = [1, 8, 32, 128, 512];
        let block_size = self.scheduler.config.block_size;
        for (k, &num_tokens) in SIZES.iter().chain(SIZES.iter()).enumerate() {
            let num_tokens = num_tokens.min(self.scheduler.config.max_batch_tokens);
            let mut activity = CacheActivity::default();
            let Some(blocks) = self.kv.allocate(num_tokens.div_ceil(block_size), &mut activity) else {
                break;
            };
            let id = u64::MAX - k as u64;
            let request = self.outbox.take_request(vec![pb::SequenceChunk {
                id,
                token_ids: vec![0; num_tokens],
                num_computed_tokens: 0,
                block_table: blocks.clone(),
                sample: true,
                params: Some(pb::SamplingParams::default()),
                cached_token_ids: Vec::new(),
                allowed_token_bitmask: Vec::new(),
                adapter_id: 0,
                num_speculative_tokens: 0,
            }]);
            let started = Instant::now();
            let result = self.shards.forward(request, num_tokens == 1).await;
            self.kv.release(&blocks);
            self.outbox.release(RequestId(id));
            match result {
                Ok(_) => self.scheduler.observe_step(num_tokens, started.elapsed().as_secs_f64()),
                Err(e) => {
                    tracing::warn!(error = %e, "step-time calibration failed; the ITL budget learns while serving");
                    break;
                }
            }
        }
        tracing::info!(
            max_step_tokens = self.scheduler.max_step_tokens(),
            "calibrated the step token budget for --target-itl-ms"
        );
    }

    /// Loads the LoRA adapters again on shards that restarted (they hold none), under their ids: the ready
    /// ones and those still draining.
    async fn reload_adapters(&self) -> Result<(), ShardError> {
        for adapter in self.adapters.take_loaded() {
            let request = pb::LoadAdapterRequest {
                adapter_id: adapter.id,
                path: adapter.path,
            };
            self.shards.load_adapter(request).await?;
        }
        Ok(())
    }

    /// Shards that restarted (`--restart-shards`) answer health checks but hold no pool until they are
    /// warmed up: found while idle or after a failed forward, they are recovered at once, so `/ready` and
    /// the next request do not wait for a request to fail first. A shard that does not answer is left to
    /// the failing forward's path (`fail_all`).
    pub(super) async fn recover_restarted_shards(&mut self) {
        if let Ok(false) = self.shards.health().await {
            tracing::warn!("the shards restarted; warming them up again");
            self.recover().await;
        }
    }

    /// Waits until the shards answer again (the launcher restarts them with `--restart-shards`), warms
    /// them up and starts over with a fresh KV pool: their new pools hold nothing, so neither may the
    /// allocator or the prefix cache. Requests that arrive meanwhile are served afterwards.
    pub(super) async fn recover(&mut self) {
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            if self.shards.health().await.is_err() {
                continue;
            }
            match self.shards.warmup(self.warmup).await {
                Ok(warmup) => {
                    if let Err(e) = self.reload_adapters().await {
                        tracing::warn!(error = %e, "loading the LoRA adapters after a shard restart failed; retrying");
                        continue;
                    }
                    for seq in self.queues.waiting.iter_mut() {
                        let blocks = seq.reset_kv();
                        debug_assert!(blocks.is_empty(), "waiting sequences hold no blocks");
                    }
                    self.kv = KvPool::new(warmup.num_blocks, self.scheduler.config.block_size, self.prefix_caching)
                        .with_max_pinned_fraction(self.max_pinned_kv_fraction);
                    if self.kv_events.is_some() {
                        // Subscribers learn that the old pool's blocks are gone (`AllBlocksCleared`).
                        self.kv.record_events();
                    }
                    self.scheduler.preemption = preemption_config(self.scheduler.preemption.mode, &warmup);
                    self.swap = SwapPool::new(warmup.num_host_blocks);
                    tracing::info!(blocks = warmup.num_blocks, "the shards are back; serving again");
                    return;
                }
                Err(e) => tracing::warn!(error = %e, "warmup after a shard restart failed; retrying"),
            }
        }
    }
}
