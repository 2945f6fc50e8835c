//! The iteration loop. Each step: take new requests, drop cancelled and expired ones, ask the scheduler
//! for a plan (`plan.rs` gathers what it sees and applies what it decides to the KV pool), run one forward
//! pass on the shards (the only `.await` on the hot path), then apply the sampled tokens (`outputs.rs`).
//! The loop decides nothing itself: every choice of the step is in the scheduler's `StepPlan`.

use std::{
    collections::HashSet,
    sync::Arc,
    time::{Duration, Instant},
};

use tokenizers::Tokenizer;
use tokio::sync::{mpsc, watch};
use tracing::Instrument;

use super::{
    draft::DraftModel, lifecycle::IDLE_SHARD_CHECK, outbox::Outbox, plan::PrefixHits, queues::Queues,
    request::Sequence, EngineError, EngineStats, NewRequest,
};
use crate::{
    kv::{KvPool, SwapPool},
    kv_events::KvEventPublisher,
    lora::Adapters,
    metrics::{Metrics, Outcome},
    scheduler::{BatchingMode, PreemptionConfig, Scheduler, SchedulerConfig, StepPlan},
    shard::{pb, ShardClient},
    speculative::SpeculativeConfig,
    telemetry,
};

/// The engine's policy settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub scheduler: SchedulerConfig,
    /// Keep running streams' inter-token latency under this many milliseconds (`--target-itl-ms`).
    pub target_itl_ms: Option<f64>,
    /// Fail requests that wait longer than this for admission (`--max-queue-time`).
    pub max_queue_time: Option<Duration>,
    /// Sent again to shards that come back after a failure (`--restart-shards`), to size their new pools.
    pub warmup: pb::WarmupRequest,
    /// Whether the KV pool keeps a prefix cache (`--no-prefix-caching` turns it off).
    pub prefix_caching: bool,
    /// The share of the KV pool session pins may keep (`--max-pinned-kv-fraction`).
    pub max_pinned_kv_fraction: f64,
    /// How preempted sequences give up their blocks (`--preemption-mode`), and the swap pool's size.
    pub preemption: PreemptionConfig,
    /// Speculative decoding (`--speculative`); None = off.
    pub speculative: Option<SpeculativeConfig>,
}

/// The engine task's state: every sequence, the KV pools, and the scheduler that plans each step.
pub struct EngineCore {
    pub(super) shards: Arc<dyn ShardClient>,
    pub(super) tokenizer: Arc<Tokenizer>,
    pub(super) eos_token_ids: HashSet<u32>,
    pub(super) scheduler: Scheduler,
    pub(super) max_queue_time: Option<Duration>,
    pub(super) warmup: pb::WarmupRequest,
    pub(super) prefix_caching: bool,
    pub(super) max_pinned_kv_fraction: f64,
    pub(super) speculative: Option<SpeculativeConfig>,
    /// With `--speculative draft`: the draft model that proposes (else proposals are n-gram lookups).
    pub(super) draft: Option<DraftModel>,
    pub(super) kv: KvPool,
    /// With `--kv-events-endpoint`: where the prefix cache's events go after each step.
    pub(super) kv_events: Option<KvEventPublisher>,
    pub(super) queues: Queues,
    pub(super) swap: SwapPool,
    /// What the shards must do before the next forward pass: drop released sequences, copy blocks.
    pub(super) outbox: Outbox,
    /// The LoRA adapters: each forward call carries the ids of those drained since the last one.
    pub(super) adapters: Adapters,
    pub(super) inbox: mpsc::UnboundedReceiver<NewRequest>,
    pub(super) metrics: Arc<Metrics>,
    /// The engine's state and running totals, published to `stats_tx` by `publish_stats`.
    pub(super) stats: EngineStats,
    /// Where the handles read the stats (`EngineHandle::stats`).
    pub(super) stats_tx: watch::Sender<EngineStats>,
}

impl EngineCore {
    pub fn new(
        shards: Arc<dyn ShardClient>,
        tokenizer: Arc<Tokenizer>,
        eos_token_ids: HashSet<u32>,
        config: EngineConfig,
        kv: KvPool,
        inbox: mpsc::UnboundedReceiver<NewRequest>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let mut core = Self {
            shards,
            tokenizer,
            eos_token_ids,
            scheduler: Scheduler::new(config.scheduler, config.preemption, config.target_itl_ms),
            max_queue_time: config.max_queue_time,
            warmup: config.warmup,
            prefix_caching: config.prefix_caching,
            max_pinned_kv_fraction: config.max_pinned_kv_fraction,
            speculative: config.speculative,
            draft: None,
            kv,
            kv_events: None,
            queues: Queues::default(),
            swap: SwapPool::new(config.preemption.num_host_blocks),
            outbox: Outbox::default(),
            adapters: Adapters::new(0, 0),
            inbox,
            metrics,
            stats: EngineStats::default(),
            stats_tx: watch::Sender::new(EngineStats::default()),
        };
        core.publish_stats();
        core
    }

    /// Serves the LoRA adapters of `adapters` (the same registry the HTTP handlers resolve names in).
    pub fn with_adapters(mut self, adapters: Adapters) -> Self {
        self.adapters = adapters;
        self.publish_stats();
        self
    }

    /// Proposes with `draft` (`--speculative draft`) rather than by n-gram lookup.
    pub fn with_draft(mut self, draft: DraftModel) -> Self {
        self.draft = Some(draft);
        self.publish_stats();
        self
    }

    /// Publishes the prefix cache's KV-cache events through `publisher` (`--kv-events-endpoint`).
    pub fn with_kv_events(mut self, publisher: KvEventPublisher) -> Self {
        self.kv.record_events();
        self.kv_events = Some(publisher);
        self
    }

    /// The engine's stats as it publishes them (after every step and when idle), for the handles.
    pub fn stats(&self) -> watch::Receiver<EngineStats> {
        self.stats_tx.subscribe()
    }

    /// Runs until every `EngineHandle` is dropped.
    pub async fn run(mut self) {
        if self.scheduler.has_itl_budget() {
            self.calibrate().await;
        }
        loop {
            // The last step's changes to the prefix cache (at the first iteration: that it starts empty).
            self.publish_kv_events();
            if self.queues.is_empty() {
                // Idle: wait for a request, or for the first session pin to lapse (its blocks then count
                // as idle cache again in the published stats), checking the shards now and then.
                let next_pin_deadline = self.kv.next_pin_deadline();
                let pin_lapses = async move {
                    match next_pin_deadline {
                        Some(deadline) => tokio::time::sleep_until(deadline.into()).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    new = self.inbox.recv() => match new {
                        Some(new) => self.queues.waiting.push_back(Sequence::new(new)),
                        None => return,
                    },
                    () = pin_lapses => {}
                    () = tokio::time::sleep(IDLE_SHARD_CHECK) => self.recover_restarted_shards().await,
                }
            }
            while let Ok(new) = self.inbox.try_recv() {
                self.queues.waiting.push_back(Sequence::new(new));
            }
            self.expire_pins();
            self.drop_cancelled();
            self.expire_waiting();
            self.expire_deadlines();
            if self.queues.is_empty() {
                self.publish_stats();
                continue;
            }
            self.step().await;
            if cfg!(debug_assertions) {
                self.kv.check_invariants();
                self.swap.check_invariants();
            }
            self.publish_stats();
        }
    }

    async fn step(&mut self) {
        self.propose_by_draft().await;
        let now = Instant::now();
        let (plan, prefix_hits) = self.plan(now);
        if plan.scheduled.is_empty() {
            self.idle_step(&plan, prefix_hits).await;
            return;
        }
        let is_decode = plan.is_decode_only();
        let chunks = self.apply_plan(&plan, prefix_hits);
        // After this step's releases: an adapter whose last sequence just left is freed with this call.
        self.outbox.unload_adapters(self.adapters.take_unloaded());
        let request = self.outbox.take_request(chunks);
        let step_span = self.step_span(&plan, is_decode);
        let started = Instant::now();
        let planning = started - now;
        let result = self
            .shards
            .forward(request, is_decode)
            .instrument(step_span.clone())
            .await;
        if let Err(e) = &result {
            telemetry::set_error(&step_span, e.to_string());
        }
        tracing::debug!(
            sequences = plan.scheduled.len(),
            tokens = plan.num_scheduled_tokens(),
            elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
            "step"
        );
        let elapsed = started.elapsed().as_secs_f64();
        self.metrics.step_tokens.observe(plan.num_scheduled_tokens() as f64);
        self.metrics.step_duration.observe(elapsed);
        self.scheduler.observe_step(plan.num_scheduled_tokens(), elapsed);
        match result {
            Ok(response) => {
                self.metrics.mark_progress();
                self.stats.last_progress = Instant::now();
                self.metrics
                    .model_forward_seconds
                    .inc_by(response.forward_time_us as f64 / 1e6);
                let applying = Instant::now();
                self.apply_outputs(&plan, response);
                self.metrics
                    .engine_planning_seconds
                    .inc_by((planning + applying.elapsed()).as_secs_f64());
            }
            Err(e) => self.fail_all(e.to_string()).await,
        }
    }

    /// A plan with nothing to compute: a static batch still filling, requests waiting for blocks or for a
    /// prefix another sequence computes, or only preemptions. Applies the preemptions, then waits briefly
    /// for something to change instead of spinning. The preemptions' shard work stays in the outbox for
    /// the next call.
    async fn idle_step(&mut self, plan: &StepPlan, prefix_hits: PrefixHits) {
        if !plan.preempted.is_empty() {
            let chunks = self.apply_plan(plan, prefix_hits);
            debug_assert!(chunks.is_empty(), "the plan computes nothing");
            return;
        }
        let is_static = matches!(self.scheduler.config.mode, BatchingMode::Static { .. });
        if self.queues.running.is_empty() && self.queues.swapped.is_empty() && !is_static && plan.deferred.is_empty() {
            // The whole pool is available and still the first request does not fit: it never will
            // (validation prevents this; the guard keeps such a request from waiting forever).
            if let Some(seq) = self.queues.waiting.pop_front() {
                seq.fail(EngineError::Shard("the request does not fit the KV pool".into()));
                self.metrics.count_request(Outcome::Failed);
            }
            return;
        }
        tokio::select! {
            new = self.inbox.recv() => {
                if let Some(new) = new {
                    self.queues.waiting.push_back(Sequence::new(new));
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(5)) => {}
        }
    }

    /// The `step` span of a forward pass: a trace root linked to the `request` span of every sequence it
    /// computes (see `telemetry`); the shards' `forward` spans become its children.
    fn step_span(&self, plan: &StepPlan, is_decode: bool) -> tracing::Span {
        let span = tracing::info_span!(
            target: telemetry::TARGET,
            parent: None,
            "step",
            kind = if is_decode { "decode" } else { "prefill" },
            // As i64: OpenTelemetry has no unsigned integers (u64 fields would arrive as strings).
            tokens = plan.num_scheduled_tokens() as i64,
            sequences = plan.scheduled.len() as i64,
        );
        if !span.is_disabled() {
            for scheduled in &plan.scheduled {
                let seq = &self.queues.running[self.queues.running_index(scheduled.id)];
                telemetry::link_request(&span, &seq.span, scheduled.num_scheduled_tokens);
            }
        }
        span
    }

    /// Hands the prefix cache's events since the last call to the publisher, if any; never waits.
    fn publish_kv_events(&mut self) {
        if let Some(publisher) = &mut self.kv_events {
            let kv = &mut self.kv;
            publisher.publish(kv.take_events(), || kv.snapshot_events());
        }
    }

    /// Takes the state of the pools and queues into the stats, publishes them, and sets the gauges from
    /// them.
    pub(super) fn publish_stats(&mut self) {
        let stats = &mut self.stats;
        stats.num_usable_blocks = self.kv.num_usable_blocks();
        stats.num_free_blocks = self.kv.num_free_blocks();
        stats.num_cached_idle_blocks = self.kv.num_available_blocks() as u32 - self.kv.num_free_blocks();
        stats.num_prefix_cache_blocks = self.kv.num_cached_blocks() as u32;
        stats.num_pins = self.kv.num_pins() as u32;
        stats.num_pinned_blocks = self.kv.num_pinned_blocks() as u32;
        stats.max_pinned_blocks = self.kv.max_pinned_blocks() as u32;
        stats.num_waiting = self.queues.waiting.len();
        stats.num_running = self.queues.running.len();
        stats.num_swapped = self.queues.swapped.len();
        stats.num_usable_host_blocks = self.swap.num_usable_blocks();
        stats.num_free_host_blocks = self.swap.num_free_blocks();
        stats.num_usable_draft_blocks = self.draft.as_ref().map_or(0, DraftModel::num_usable_blocks);
        stats.num_free_draft_blocks = self.draft.as_ref().map_or(0, DraftModel::num_free_blocks);
        self.stats_tx.send_replace(*stats);
        let metrics = &self.metrics;
        metrics.kv_blocks_total.set(i64::from(stats.num_usable_blocks));
        metrics.kv_blocks_free.set(i64::from(stats.num_free_blocks));
        metrics.kv_cache_usage.set(stats.kv_cache_usage());
        metrics.set_kv_cache_config(self.scheduler.config.block_size, stats.num_usable_blocks);
        metrics
            .kv_blocks_cached_idle
            .set(i64::from(stats.num_cached_idle_blocks));
        metrics
            .prefix_cache_blocks
            .set(i64::from(stats.num_prefix_cache_blocks));
        metrics.kv_pins.set(i64::from(stats.num_pins));
        metrics.kv_pinned_blocks.set(i64::from(stats.num_pinned_blocks));
        metrics.queue_depth.set(stats.num_waiting as i64);
        metrics.running_sequences.set(stats.num_running as i64);
        metrics.swapped_sequences.set(stats.num_swapped as i64);
        metrics.swap_blocks_total.set(i64::from(stats.num_usable_host_blocks));
        metrics.swap_blocks_free.set(i64::from(stats.num_free_host_blocks));
        self.publish_lora_info();
    }

    /// Sets `rill_lora_requests_info` from the adapters of the running sequences and of those waiting for
    /// admission or in the swap pool (they hold no adapter slot).
    fn publish_lora_info(&self) {
        let names = |seqs: &mut dyn Iterator<Item = &Sequence>| {
            let names: std::collections::BTreeSet<&str> = seqs.filter_map(Sequence::adapter_name).collect();
            names.into_iter().collect::<Vec<_>>().join(",")
        };
        let queues = &self.queues;
        let running = names(&mut queues.running.iter());
        let waiting = names(&mut queues.waiting.iter().chain(&queues.swapped));
        self.metrics
            .set_lora_info(&running, &waiting, self.scheduler.config.max_loras as u32);
    }
}
