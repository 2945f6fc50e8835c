//! The engine: one tokio task (`EngineCore`) owns every mutable serving state — the `Queues` of
//! sequences (waiting, running, swapped), the KV pools, the `Outbox` of work for the shards' next call —
//! and runs the iteration loop; the scheduler decides, the engine executes. Handlers talk to it through
//! an `EngineHandle`: submit a `ValidRequest`, receive a stream of `TokenEvent`s, read the `EngineStats`
//! it publishes.
//!
//! By job: `event_loop.rs` (the loop and one step), `plan.rs` (what the scheduler sees, and applying its
//! plan), `outputs.rs` (applying a forward pass's tokens), `release.rs` (cancellation, expiry, failure,
//! and releasing a sequence), `lifecycle.rs` (calibration at start, recovery after the shards fail),
//! `request.rs` (one sequence's state and text), `draft.rs` (proposals from a draft model); the parts: `queues.rs`, `outbox.rs`, `stats.rs`.

mod draft;
mod event_loop;
mod lifecycle;
mod outbox;
mod outputs;
mod plan;
mod queues;
mod release;
mod request;
mod stats;
mod watch;

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Instant,
};

use serde::Serialize;
use thiserror::Error;
use tokio::sync::mpsc;
use utoipa::ToSchema;

pub use self::draft::DraftModel;
pub use self::event_loop::{EngineConfig, EngineCore};
pub use self::lifecycle::preemption_config;
pub use self::stats::EngineStats;
pub use self::watch::{spawn, EngineTask};
use crate::{lora::Adapters, metrics::Metrics, scheduler::RequestId, shard::ShardClient, validation::ValidRequest};

/// Why generation ended (the API shows it as is).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_new_tokens` reached.
    Length,
    /// The model produced an end-of-sequence token (or one of the request's `stop_token_ids`).
    EosToken,
    /// A stop sequence matched.
    StopSequence,
}

#[derive(Debug, Clone, Error)]
pub enum EngineError {
    #[error("the model shards failed: {0}")]
    Shard(String),
    #[error("turning tokens into text failed: {0}")]
    Detokenize(String),
    #[error("the engine is shutting down")]
    Closed,
    #[error("the engine stopped")]
    Stopped,
    #[error("the request waited {0} s in the queue, more than --max-queue-time")]
    QueueTimeout(u64),
    #[error("the request ran past its {0} s deadline (`timeout` or --request-timeout)")]
    Deadline(f64),
    #[error("the client fell more than {0} tokens behind the stream (--max-unread-tokens); cancelled")]
    SlowReader(usize),
}

/// One generated token and the text it released.
#[derive(Debug, Clone)]
pub struct TokenEvent {
    pub token_id: u32,
    /// Text safe to show now (never half a character, never a possible stop-sequence prefix).
    pub text: String,
    pub logprob: f32,
    pub is_special: bool,
    /// The most likely alternatives (token id, logprob), most likely first; as many as asked for.
    pub top_logprobs: Vec<(u32, f32)>,
    /// Set on the last event of the request.
    pub end: Option<EndEvent>,
}

/// How a request ended.
#[derive(Debug, Clone)]
pub struct EndEvent {
    pub finish_reason: FinishReason,
    /// All text released, i.e. the concatenation of every event's `text`.
    pub generated_text: String,
    pub num_generated_tokens: u32,
    pub num_prompt_tokens: u32,
    /// Prompt tokens whose K/V were reused rather than computed for this request.
    pub num_cached_tokens: u32,
    /// With `FinishReason::StopSequence`: the stop string that matched (Anthropic's `stop_sequence`).
    pub stop_sequence: Option<String>,
}

/// A request's events, bounded: `--max-unread-tokens` token events plus one slot kept for the error that
/// ends the request. The engine only ever `try_send`s: a client that does not keep up is cut off, never
/// waited for (`Sequence::send_token`).
pub type EventSender = mpsc::Sender<Result<TokenEvent, EngineError>>;
pub type EventReceiver = mpsc::Receiver<Result<TokenEvent, EngineError>>;

/// A validated request on its way into the engine.
pub struct NewRequest {
    pub id: RequestId,
    pub request: ValidRequest,
    pub events: EventSender,
    /// Further choices of the same prompt (`n > 1`): they start once this request's prompt is computed,
    /// sharing its KV blocks.
    pub forks: Vec<NewRequest>,
    /// A place in the bounded waiting queue (`--max-waiting-requests`), given back at admission.
    pub waiting_permit: Option<tokio::sync::OwnedSemaphorePermit>,
    /// The HTTP request's id (`x-request-id`), for the logs.
    pub tag: String,
    /// The HTTP request's `request` span, which step spans link to (disabled when not tracing).
    pub span: tracing::Span,
    /// When the request expires (`ValidRequest::timeout` after it was submitted); None = never.
    pub deadline: Option<Instant>,
}

/// The handlers' side of the engine: cheap to clone.
#[derive(Clone)]
pub struct EngineHandle {
    inbox: mpsc::UnboundedSender<NewRequest>,
    next_id: Arc<AtomicU64>,
    /// For health checks and LoRA loads only; the engine task alone drives forward passes.
    shards: Arc<dyn ShardClient>,
    pub metrics: Arc<Metrics>,
    /// The LoRA adapters requests may name; the engine tells the shards when one has drained.
    pub adapters: Adapters,
    /// `--max-unread-tokens`: the token events each request's channel holds.
    max_unread_tokens: usize,
    /// What the engine last published about its state (`EngineCore::stats`).
    stats: tokio::sync::watch::Receiver<EngineStats>,
}

impl EngineHandle {
    pub fn new(
        inbox: mpsc::UnboundedSender<NewRequest>,
        shards: Arc<dyn ShardClient>,
        metrics: Arc<Metrics>,
        adapters: Adapters,
        max_unread_tokens: usize,
        stats: tokio::sync::watch::Receiver<EngineStats>,
    ) -> Self {
        Self {
            inbox,
            next_id: Arc::new(AtomicU64::new(1)),
            shards,
            metrics,
            adapters,
            max_unread_tokens,
            stats,
        }
    }

    /// The shards, for the calls made outside the engine loop (health checks, loading LoRA adapters).
    pub fn shards(&self) -> Arc<dyn ShardClient> {
        self.shards.clone()
    }

    /// The engine's state as of its latest step (or idle moment).
    pub fn stats(&self) -> EngineStats {
        *self.stats.borrow()
    }

    /// Whether the engine task still runs (it owns the inbox's receiving end).
    pub fn is_running(&self) -> bool {
        !self.inbox.is_closed()
    }

    /// Whether the engine can serve: its task runs and every shard answers a health check within 2 s,
    /// warmed up. The error names the reason.
    pub async fn health(&self) -> Result<(), EngineError> {
        if !self.is_running() {
            return Err(EngineError::Stopped);
        }
        match tokio::time::timeout(std::time::Duration::from_secs(2), self.shards.health()).await {
            Err(_) => Err(EngineError::Shard(
                "the shards did not answer a health check within 2 s".into(),
            )),
            Ok(Err(e)) => Err(EngineError::Shard(e.to_string())),
            Ok(Ok(false)) => Err(EngineError::Shard(
                "the shards restarted and are not warmed up yet".into(),
            )),
            Ok(Ok(true)) => Ok(()),
        }
    }

    /// Queues `n` choices of the same prompt; choice i samples with seed `seed + i`. Call it in the HTTP
    /// request's span: the engine links its work to the current span. The prompt is
    /// computed once and its KV blocks shared. Dropping a receiver cancels that choice: the engine
    /// notices within one iteration, tells the shards, and frees its blocks; so does reading too slowly
    /// (see `EventSender`) or running past `request.timeout`.
    pub fn submit_n(
        &self,
        request: ValidRequest,
        n: u32,
        waiting_permit: Option<tokio::sync::OwnedSemaphorePermit>,
        tag: String,
    ) -> Result<Vec<EventReceiver>, EngineError> {
        let mut receivers = Vec::with_capacity(n as usize);
        let deadline = request.timeout.map(|timeout| Instant::now() + timeout);
        let mut choices: Vec<NewRequest> = (0..n.max(1))
            .map(|i| {
                let (events, receiver) = mpsc::channel(self.max_unread_tokens + 1);
                receivers.push(receiver);
                let mut request = request.clone();
                request.sampling.seed = request.sampling.seed.wrapping_add(u64::from(i));
                NewRequest {
                    id: RequestId(self.next_id.fetch_add(1, Ordering::Relaxed)),
                    request,
                    events,
                    forks: Vec::new(),
                    waiting_permit: None,
                    tag: if n > 1 { format!("{tag}/{i}") } else { tag.clone() },
                    span: tracing::Span::current(),
                    deadline,
                }
            })
            .collect();
        let mut first = choices.remove(0);
        first.forks = choices;
        first.waiting_permit = waiting_permit;
        self.inbox.send(first).map_err(|_| EngineError::Closed)?;
        Ok(receivers)
    }
}
