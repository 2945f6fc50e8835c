//! The iteration loop. Each step: take new requests, drop cancelled and expired ones, ask the scheduler
//! for a plan (`plan.rs` gathers what it sees and applies what it decides to the KV pool), run one forward
//! pass on the shards (the only `.await` on the hot path), then apply the sampled tokens (`outputs.rs`).
//! The loop decides nothing itself: every choice of the step is in the scheduler's `StepPlan`.

use std::{
    collections::{HashSet, VecDeque},
    sync::Arc,
    time::{Duration, Instant},
};

use tokenizers::Tokenizer;
use tokio::sync::mpsc;
use tracing::Instrument;

use super::{request::Sequence, EngineError, NewRequest, RequestId};
use crate::{
    kv::{KvPool, SwapPool},
    metrics::{Metrics, Outcome},
    scheduler::{BatchingMode, PreemptionConfig, Scheduler, SchedulerConfig, StepPlan},
    shard::{pb, ShardClient},
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
    /// How preempted sequences give up their blocks (`--preemption-mode`), and the swap pool's size.
    pub preemption: PreemptionConfig,
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
    pub(super) kv: KvPool,
    pub(super) waiting: VecDeque<Sequence>,
    pub(super) running: Vec<Sequence>,
    /// Sequences preempted by swapping, in the order they were swapped out: admitted, their K/V in the
    /// host swap pool (`host_blocks`), their state kept by the shards; resumed before new admissions.
    pub(super) swapped: VecDeque<Sequence>,
    pub(super) swap: SwapPool,
    /// Block copies decided since the last call, sent with the next one (out before in, both before
    /// the forward).
    pub(super) swap_out: Vec<pb::BlockCopy>,
    pub(super) swap_in: Vec<pb::BlockCopy>,
    /// Sequences the shards hold state for that are gone since the last call; sent with the next call.
    pub(super) released_ids: Vec<u64>,
    pub(super) inbox: mpsc::UnboundedReceiver<NewRequest>,
    pub(super) metrics: Arc<Metrics>,
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
        let core = Self {
            shards,
            tokenizer,
            eos_token_ids,
            scheduler: Scheduler::new(config.scheduler, config.preemption, config.target_itl_ms),
            max_queue_time: config.max_queue_time,
            warmup: config.warmup,
            prefix_caching: config.prefix_caching,
            kv,
            waiting: VecDeque::new(),
            running: Vec::new(),
            swapped: VecDeque::new(),
            swap: SwapPool::new(config.preemption.num_host_blocks),
            swap_out: Vec::new(),
            swap_in: Vec::new(),
            released_ids: Vec::new(),
            inbox,
            metrics,
        };
        core.publish_stats();
        core
    }

    /// Runs until every `EngineHandle` is dropped.
    pub async fn run(mut self) {
        if self.scheduler.has_itl_budget() {
            self.calibrate().await;
        }
        loop {
            if self.is_idle() {
                match self.inbox.recv().await {
                    Some(new) => self.waiting.push_back(Sequence::new(new)),
                    None => return,
                }
            }
            while let Ok(new) = self.inbox.try_recv() {
                self.waiting.push_back(Sequence::new(new));
            }
            self.drop_cancelled();
            self.expire_waiting();
            self.expire_deadlines();
            if self.is_idle() {
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

    fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.swapped.is_empty()
    }

    async fn step(&mut self) {
        let now = Instant::now();
        let plan = self.plan(now);
        if plan.scheduled.is_empty() {
            self.idle_step(&plan).await;
            return;
        }
        let is_decode = plan.is_decode_only();
        let request = self.apply_plan(&plan);
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
    /// for something to change instead of spinning.
    async fn idle_step(&mut self, plan: &StepPlan) {
        if !plan.preempted.is_empty() {
            let request = self.apply_plan(plan);
            self.released_ids = request.released_ids;
            self.swap_out = request.swap_out;
            return;
        }
        let is_static = matches!(self.scheduler.config.mode, BatchingMode::Static { .. });
        if self.running.is_empty() && self.swapped.is_empty() && !is_static && plan.deferred.is_empty() {
            // The whole pool is available and still the first request does not fit: it never will
            // (validation prevents this; the guard keeps such a request from waiting forever).
            if let Some(seq) = self.waiting.pop_front() {
                seq.fail(EngineError::Shard("the request does not fit the KV pool".into()));
                self.metrics.count_request(Outcome::Failed);
            }
            return;
        }
        tokio::select! {
            new = self.inbox.recv() => {
                if let Some(new) = new {
                    self.waiting.push_back(Sequence::new(new));
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
                let seq = &self.running[self.running_index(scheduled.id)];
                telemetry::link_request(&span, &seq.span, scheduled.num_scheduled_tokens);
            }
        }
        span
    }

    pub(super) fn running_index(&self, id: RequestId) -> usize {
        self.running
            .iter()
            .position(|seq| seq.id == id)
            .expect("the plan and the shards only name running sequences")
    }

    pub(super) fn publish_stats(&self) {
        let metrics = &self.metrics;
        metrics.kv_blocks_total.set(i64::from(self.kv.num_usable_blocks()));
        metrics.kv_blocks_free.set(i64::from(self.kv.num_free_blocks()));
        let num_available = self.kv.num_available_blocks() as i64;
        metrics
            .kv_blocks_cached_idle
            .set(num_available - i64::from(self.kv.num_free_blocks()));
        metrics.prefix_cache_blocks.set(self.kv.num_cached_blocks() as i64);
        metrics.queue_depth.set(self.waiting.len() as i64);
        metrics.running_sequences.set(self.running.len() as i64);
        metrics.swapped_sequences.set(self.swapped.len() as i64);
        metrics.swap_blocks_total.set(i64::from(self.swap.num_usable_blocks()));
        metrics.swap_blocks_free.set(i64::from(self.swap.num_free_blocks()));
    }
}
