//! The iteration loop. Each step: take new requests, drop cancelled ones, ask the scheduler for a plan
//! (waiting requests seen with their cached prefixes), apply it to the KV pool, run one forward pass on
//! the shards (the only `.await` on the hot path), then apply the sampled tokens: text, stop checks,
//! events, caching newly computed prompt blocks, and releasing the blocks of finished sequences.

use std::{
    collections::{HashSet, VecDeque},
    sync::Arc,
    time::{Duration, Instant},
};

use tokenizers::Tokenizer;
use tokio::sync::mpsc;
use tracing::Instrument;

use super::{
    request::{Sequence, TokenOutcome},
    swap::{PreemptionConfig, SwapPool},
    EngineError, NewRequest, RequestId,
};
use crate::{
    kv::{CacheActivity, KvPool},
    metrics::{Metrics, Outcome},
    scheduler::{schedule, BatchingMode, ItlBudget, Preemption, SchedulerConfig, SeqView, StepPlan},
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

mod lifecycle;

pub struct EngineCore {
    shards: Arc<dyn ShardClient>,
    tokenizer: Arc<Tokenizer>,
    eos_token_ids: HashSet<u32>,
    config: SchedulerConfig,
    max_queue_time: Option<Duration>,
    warmup: pb::WarmupRequest,
    prefix_caching: bool,
    /// Learns step time per token count and bounds the step's tokens, with `--target-itl-ms`.
    itl_budget: Option<ItlBudget>,
    kv: KvPool,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    /// Sequences preempted by swapping, in the order they were swapped out: admitted, their K/V in the
    /// host swap pool (`host_blocks`), their state kept by the shards; resumed before new admissions.
    swapped: VecDeque<Sequence>,
    swap: SwapPool,
    /// Block copies decided since the last call, sent with the next one (out before in, both before
    /// the forward).
    swap_out: Vec<pb::BlockCopy>,
    swap_in: Vec<pb::BlockCopy>,
    /// Sequences the shards hold state for that are gone since the last call; sent with the next call.
    released_ids: Vec<u64>,
    inbox: mpsc::UnboundedReceiver<NewRequest>,
    metrics: Arc<Metrics>,
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
            config: config.scheduler,
            max_queue_time: config.max_queue_time,
            warmup: config.warmup,
            prefix_caching: config.prefix_caching,
            itl_budget: config.target_itl_ms.map(ItlBudget::new),
            kv,
            waiting: VecDeque::new(),
            running: Vec::new(),
            swapped: VecDeque::new(),
            swap: SwapPool::new(config.preemption),
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
        if self.itl_budget.is_some() {
            self.calibrate().await;
        }
        loop {
            if self.waiting.is_empty() && self.running.is_empty() && self.swapped.is_empty() {
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
            if self.waiting.is_empty() && self.running.is_empty() && self.swapped.is_empty() {
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
        let now = Instant::now();
        let running: Vec<_> = self
            .running
            .iter()
            .map(|seq| seq.view(self.kv.num_freeable(&seq.blocks), now))
            .collect();
        let waiting = self.waiting_views(now);
        // A swapped sequence holds no device blocks: all it needs back is allocated when it resumes.
        let swapped: Vec<_> = self.swapped.iter().map(|seq| seq.view(0, now)).collect();
        let mut config = self.config;
        if let Some(budget) = &self.itl_budget {
            let num_decodes = running
                .iter()
                .filter(|s| s.num_tokens - s.num_computed_tokens == 1)
                .count();
            config.max_batch_tokens = budget.max_tokens(num_decodes + 1, config.max_batch_tokens);
        }
        let plan = schedule(&config, &running, &swapped, &waiting, self.kv.num_available_blocks());
        if plan.scheduled.is_empty() {
            self.idle_step(&plan, &waiting).await;
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
        if let Some(budget) = &mut self.itl_budget {
            budget.observe(plan.num_scheduled_tokens(), elapsed);
        }
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
    async fn idle_step(&mut self, plan: &StepPlan, waiting: &[SeqView]) {
        if !plan.preempted.is_empty() {
            let request = self.apply_plan(plan);
            self.released_ids = request.released_ids;
            self.swap_out = request.swap_out;
            return;
        }
        let is_static = matches!(self.config.mode, BatchingMode::Static { .. });
        if self.running.is_empty()
            && self.swapped.is_empty()
            && !is_static
            && waiting.iter().all(|view| !view.is_deferred)
        {
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

    /// Moves sequences between queues and allocates blocks as the plan says; builds the forward call.
    /// Suspends the plan's victims, each by the mechanism `SwapPool::choose` picks: swapped ones copy the
    /// blocks of their computed tokens to the host and keep everything else; recomputed ones are released
    /// and go back to the front of the waiting queue.
    fn preempt(&mut self, plan: &StepPlan) {
        for &id in &plan.preempted {
            let i = self.running_index(id);
            let mut seq = self.running.remove(i);
            let num_blocks = seq.num_computed_tokens.div_ceil(self.config.block_size);
            let mode = self.swap.choose(num_blocks, seq.num_computed_tokens);
            tracing::info!(request_id = %seq.tag, sequence_id = %id, mode = mode.label(), "preempted: KV pool full");
            self.metrics.preemptions.with_label_values(&[mode.label()]).inc();
            if let Preemption::Swap = mode {
                let (host_blocks, copies) = self
                    .swap
                    .swap_out(&seq.blocks[..num_blocks])
                    .expect("choose picks swap only when the host blocks are free");
                self.metrics.swapped_out_blocks.inc_by(copies.len() as u64);
                self.swap_out.extend(copies);
                seq.host_blocks = host_blocks;
                // The device blocks go back like a finished sequence's (cached, or to their other holders);
                // the sequence keeps its computed tokens and its state on the shards.
                self.cache_computed(&seq);
                self.kv.release(&std::mem::take(&mut seq.blocks));
                self.swapped.push_back(seq);
            } else {
                seq.num_lost_tokens = seq.num_computed_tokens;
                self.release(&mut seq);
                self.waiting.push_front(seq);
            }
        }
    }

    /// Moves sequences between queues and allocates blocks as the plan says; builds the forward call.
    fn apply_plan(&mut self, plan: &StepPlan) -> pb::ForwardRequest {
        // Victims first: their host blocks are taken before resumed sequences free theirs (no resume
        // shares a step with a preemption anyway), so a copy out never lands in a block still to be read.
        self.preempt(plan);
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
            let i = self
                .waiting
                .iter()
                .position(|seq| seq.id == id)
                .expect("admitted requests wait");
            let mut seq = self.waiting.remove(i).expect("index in range");
            seq.waiting_permit = None;
            let is_first_admission = seq.admitted_at.is_none();
            if is_first_admission {
                let now = std::time::Instant::now();
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
        // A request overtaken by later arrivals too often goes first next time (see the scheduler).
        for seq in self.waiting.iter_mut() {
            let overtakers = plan.admitted.iter().filter(|id| **id > seq.id).count() as u32;
            seq.num_times_overtaken += overtakers;
        }
        let mut chunks = Vec::with_capacity(plan.scheduled.len());
        let mut activity = CacheActivity::default();
        for scheduled in &plan.scheduled {
            let i = self.running_index(scheduled.id);
            let blocks = self
                .kv
                .allocate(scheduled.num_new_blocks, &mut activity)
                .expect("the plan fits the free and evictable blocks");
            let seq = &mut self.running[i];
            if !seq.host_blocks.is_empty() {
                // Resumed: its K/V come back into the first of its new blocks, before the forward.
                let host_blocks = std::mem::take(&mut seq.host_blocks);
                let copies = self.swap.swap_in(&host_blocks, &blocks[..host_blocks.len()]);
                self.metrics.swapped_in_blocks.inc_by(copies.len() as u64);
                self.swap_in.extend(copies);
            }
            seq.blocks.extend(blocks);
            let start = seq.num_computed_tokens;
            let num_prompt_tokens = seq
                .num_prompt_tokens
                .saturating_sub(start)
                .min(scheduled.num_scheduled_tokens);
            self.metrics.prompt_tokens_computed.inc_by(num_prompt_tokens as u64);
            chunks.push(seq.chunk(scheduled.num_scheduled_tokens, &self.eos_token_ids));
        }
        self.count_cache_activity(activity);
        pb::ForwardRequest {
            released_ids: std::mem::take(&mut self.released_ids),
            sequences: chunks,
            swap_out: std::mem::take(&mut self.swap_out),
            swap_in: std::mem::take(&mut self.swap_in),
        }
    }

    fn apply_outputs(&mut self, plan: &StepPlan, response: pb::ForwardResponse) {
        let mut activity = CacheActivity::default();
        for scheduled in &plan.scheduled {
            let i = self.running_index(scheduled.id);
            let seq = &mut self.running[i];
            let was_in_prompt = seq.num_computed_tokens < seq.num_prompt_tokens;
            seq.num_computed_tokens += scheduled.num_scheduled_tokens;
            if was_in_prompt {
                // Full prompt blocks enter the cache as soon as they are computed, so requests in flight
                // with the same prefix share them.
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
        for generation in &response.generations {
            let Some(i) = self.running.iter().position(|seq| seq.id.0 == generation.id) else {
                tracing::error!(
                    id = generation.id,
                    "a shard returned a token for a sequence not in the step"
                );
                continue;
            };
            let seq = &mut self.running[i];
            let now = std::time::Instant::now();
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
            let outcome = seq.append_token(&self.tokenizer, &self.eos_token_ids, generation);
            if let TokenOutcome::Finished | TokenOutcome::Failed = outcome {
                let mut seq = self.running.remove(i);
                if let TokenOutcome::Finished = outcome {
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
                } else {
                    self.metrics.count_request(Outcome::Failed);
                }
                self.release(&mut seq);
            }
        }
    }

    /// The prompt of `running[i]` is computed: the choices waiting on it join the running set, sharing
    /// its prompt blocks.
    fn start_forks(&mut self, i: usize) {
        let forks = std::mem::take(&mut self.running[i].forks);
        for new in forks {
            let child = self.running[i].fork(new, self.config.block_size);
            self.kv.attach(&child.blocks);
            self.running.push(child);
        }
    }

    /// Cancels sequences whose clients have gone, wherever they are. Choices waiting on a cancelled
    /// sequence's prompt are not lost: the first of them takes its place in the waiting queue.
    fn drop_cancelled(&mut self) {
        let mut cancelled = Vec::new();
        let mut i = 0;
        while i < self.waiting.len() {
            if self.waiting[i].is_cancelled() {
                cancelled.push(self.waiting.remove(i).expect("index in range"));
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].is_cancelled() {
                cancelled.push(self.running.remove(i));
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.swapped.len() {
            if self.swapped[i].is_cancelled() {
                cancelled.push(self.swapped.remove(i).expect("index in range"));
            } else {
                i += 1;
            }
        }
        for mut seq in cancelled {
            tracing::info!(request_id = %seq.tag, sequence_id = %seq.id, outcome = "cancelled", "client went away");
            self.metrics.count_request(Outcome::Cancelled);
            self.metrics.cancelled_tokens.inc_by(seq.token_ids.len() as u64);
            self.release(&mut seq);
            let mut forks = std::mem::take(&mut seq.forks);
            if !forks.is_empty() {
                let mut heir = forks.remove(0);
                heir.forks = forks;
                self.waiting.push_front(Sequence::new(heir));
            }
        }
    }

    /// Fails requests that have waited for admission longer than `--max-queue-time`.
    fn expire_waiting(&mut self) {
        let Some(limit) = self.max_queue_time else { return };
        let now = Instant::now();
        let mut i = 0;
        while i < self.waiting.len() {
            let seq = &self.waiting[i];
            if seq.admitted_at.is_none() && now - seq.arrived_at > limit {
                let mut seq = self.waiting.remove(i).expect("index in range");
                tracing::info!(request_id = %seq.tag, sequence_id = %seq.id, outcome = "expired", "waited longer than --max-queue-time");
                seq.fail(EngineError::QueueTimeout(limit.as_secs()));
                for _ in 0..=seq.forks.len() {
                    self.metrics.count_request(Outcome::Failed);
                }
                self.release(&mut seq);
            } else {
                i += 1;
            }
        }
    }

    /// Returns a sequence's blocks (device and host) to their pools and tells the shards to drop its state
    /// on the next call.
    fn release(&mut self, seq: &mut Sequence) {
        if seq.is_known_to_shards {
            self.released_ids.push(seq.id.0);
        }
        if !seq.host_blocks.is_empty() {
            let host_blocks = std::mem::take(&mut seq.host_blocks);
            // A copy out not sent yet must not land in blocks someone else may get now.
            self.swap_out.retain(|copy| !host_blocks.contains(&copy.host_block));
            self.swap.release(&host_blocks);
        }
        // Prompt and generated tokens stay cached (the next turn of a chat, a resumed preemption hits).
        self.cache_computed(seq);
        let blocks = seq.reset_kv();
        self.kv.release(&blocks);
    }

    /// Enters a sequence's computed full blocks into the prefix cache.
    fn cache_computed(&mut self, seq: &Sequence) {
        let mut activity = CacheActivity::default();
        let tokens = &seq.token_ids[..seq.num_computed_tokens];
        self.kv.cache(seq.cache_salt(), tokens, &seq.blocks, &mut activity);
        self.count_cache_activity(activity);
    }

    fn count_cache_activity(&self, activity: CacheActivity) {
        self.metrics
            .prefix_cache_inserted_blocks
            .inc_by(activity.num_inserted_blocks as u64);
        self.metrics
            .prefix_cache_evicted_blocks
            .inc_by(activity.num_evicted_blocks as u64);
    }

    /// Views of the waiting requests for the scheduler. A request not yet holding blocks is seen as it
    /// would start: from its cached prefix (the last token always recomputed, for logits), deferred if a
    /// sequence ahead of it is computing more of its prompt right now.
    fn waiting_views(&mut self, now: Instant) -> Vec<SeqView> {
        // Matching is cheap but not free: only requests that could be admitted soon are looked up.
        const NUM_LOOKED_UP: usize = 64;
        let block_size = self.config.block_size;
        let mut views = Vec::with_capacity(self.waiting.len());
        for i in 0..self.waiting.len() {
            let seq = &self.waiting[i];
            let mut view = seq.view(0, now);
            if seq.blocks.is_empty() && i < NUM_LOOKED_UP {
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
                    .chain(self.waiting.iter().take(i));
                view.is_deferred = ahead.into_iter().any(|other| {
                    other.cache_salt() == seq.cache_salt()
                        && common_full_blocks(&other.token_ids[..other.num_prompt_tokens], &seq.token_ids, block_size)
                            > hit.num_tokens
                });
            }
            views.push(view);
        }
        views
    }

    /// A failed forward leaves the shards' state unknown: every running request fails, the shards are
    /// cleared, and waiting requests start afresh.
    async fn fail_all(&mut self, message: String) {
        tracing::error!(%message, "forward pass failed; failing the running requests");
        // Swapped sequences too: the failed call may have carried their copies out.
        let failed: Vec<_> = std::mem::take(&mut self.running)
            .into_iter()
            .chain(std::mem::take(&mut self.swapped))
            .collect();
        for mut seq in failed {
            seq.fail(EngineError::Shard(message.clone()));
            for _ in 0..=seq.forks.len() {
                self.metrics.count_request(Outcome::Failed);
            }
            self.release(&mut seq);
        }
        self.released_ids.clear();
        self.swap_out.clear();
        self.swap_in.clear();
        if let Err(e) = self.shards.clear_cache().await {
            // The shards are gone: nobody knows when (or whether) they come back, so the queued requests
            // fail now rather than hang; requests that arrive later wait for the recovery.
            tracing::error!(error = %e, "the shards do not answer; failing the queue, waiting for them");
            for seq in std::mem::take(&mut self.waiting) {
                seq.fail(EngineError::Shard(message.clone()));
                for _ in 0..=seq.forks.len() {
                    self.metrics.count_request(Outcome::Failed);
                }
            }
            self.publish_stats();
            self.recover().await;
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

    fn running_index(&self, id: RequestId) -> usize {
        self.running
            .iter()
            .position(|seq| seq.id == id)
            .expect("the plan and the shards only name running sequences")
    }

    fn publish_stats(&self) {
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

/// Tokens in the full blocks that two token sequences share from the start.
fn common_full_blocks(a: &[u32], b: &[u32], block_size: usize) -> usize {
    let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    (common / block_size) * block_size
}
