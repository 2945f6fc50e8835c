//! Wiring: from the flags, the connected shards and the model's files to a running engine task and the
//! HTTP app in front of it. The binary (`main.rs`) and the HTTP tests (against the fake shard) both
//! build the router here, so what the tests serve is what the binary serves.

use std::{
    path::PathBuf,
    sync::{atomic::AtomicBool, Arc},
};

use anyhow::Context;
use tokenizers::Tokenizer;
use tokio::sync::{mpsc, Semaphore};

use super::{app, response_store::ResponseStore, AppState};
use crate::{
    api::MemoryInfo,
    chat_template::ChatTemplate,
    config::{Config, Scheduling},
    engine::{self, preemption_config, DraftModel, EngineConfig, EngineCore, EngineHandle, EngineTask},
    grammar::GrammarCompiler,
    kv::{self, KvPool},
    kv_events::KvEventPublisher,
    lora::Adapters,
    metrics::Metrics,
    scheduler::{BatchingMode, SchedulerConfig},
    shard::{pb, ShardClient},
    text::tool_calls::ToolCallFormat,
    validation::Validator,
};

/// The scheduler's starvation bound: a request overtaken this often by later, higher-priority arrivals is
/// admitted first.
const MAX_TIMES_OVERTAKEN: u32 = 32;

/// What the router reads from the model's folder.
pub struct ModelFiles {
    /// The model's tokenizer (validation, detokenization).
    pub tokenizer: Arc<Tokenizer>,
    /// The file `tokenizer` came from: constrained decoding builds its token trie from it. None: requests
    /// with a grammar are refused (422).
    pub tokenizer_path: Option<PathBuf>,
    /// The model's chat template; None: `/v1/chat/completions` answers 422.
    pub chat_template: Option<Arc<ChatTemplate>>,
}

/// The router, wired and started.
pub struct Server {
    /// The HTTP application, to serve.
    pub app: axum::Router,
    /// The state its handlers share (draining on shutdown sets its flag).
    pub state: AppState,
    /// The engine task, already running; serving ends if it does.
    pub engine: EngineTask,
}

/// The KV pool's sizes, once the shards' Warmup answered.
struct Pool {
    block_size: usize,
    num_usable_blocks: usize,
    /// Blocks admission leaves for running sequences to grow into.
    watermark_blocks: usize,
}

/// Asks the shards for their Info and Warmup, sizes the KV pool, starts the engine task and builds the
/// HTTP app. The token limits are lowered to the model's positions where they exceed them (logged).
/// `draft_shard`: the draft model's shard, with `--speculative draft`.
pub async fn build(
    config: &Config,
    shards: Arc<dyn ShardClient>,
    draft_shard: Option<Arc<dyn ShardClient>>,
    model: ModelFiles,
) -> anyhow::Result<Server> {
    let shard_info = shards.info().await.context("shard Info failed")?;
    tracing::info!(?shard_info, "shard info");
    let mut limits = config.limits.clone();
    if let Some(change) = limits.fit_to_model(shard_info.max_position_embeddings) {
        tracing::warn!("{change}");
    }
    let adapters = load_adapters(config, &*shards, &shard_info).await?;
    tracing::info!("warming up: sizing the KV pool");
    let warmup_request = pb::WarmupRequest {
        max_batch_tokens: config.batch.max_batch_tokens,
        max_batch_size: config.batch.max_batch_size,
        max_total_kv_tokens: config.batch.max_batch_total_tokens,
        swap_space_bytes: config.batch.swap_space_bytes,
        max_speculative_tokens: config.batch.speculative.map_or(0, |spec| {
            spec.max_step_tokens.min(config.batch.max_batch_tokens as usize) as u32
        }),
    };
    let warmup = shards.warmup(warmup_request).await.context("shard Warmup failed")?;
    let draft = match draft_shard {
        // After the target's Warmup: a draft pool sized from memory sees what the target's left.
        Some(shard) => Some(draft_model(config, shard, &shard_info, &warmup_request).await?),
        None => None,
    };
    let block_size = shard_info.block_size as usize;
    let kv = KvPool::new(warmup.num_blocks, block_size, config.batch.prefix_caching)
        .with_max_pinned_fraction(config.batch.max_pinned_kv_fraction);
    let num_usable_blocks = kv.num_usable_blocks() as usize;
    anyhow::ensure!(num_usable_blocks > 0, "the shards' KV pool has no usable block");
    // Admission leaves 1% of the pool (at least one block) for running sequences to grow into.
    let pool = Pool {
        block_size,
        num_usable_blocks,
        watermark_blocks: (num_usable_blocks / 100).max(1).min(num_usable_blocks - 1),
    };
    log_pool(config, &pool, &warmup);
    let kv_window = kv::kv_window(&shard_info.sliding_windows);
    if kv_window > 0 {
        tracing::info!(
            kv_window,
            "every layer attends through a sliding window: blocks the window has left are released"
        );
    }
    let engine_config = engine_config(config, &pool, kv_window, &shard_info, warmup_request, &warmup);
    let metrics = Arc::new(Metrics::new());
    let (inbox_tx, inbox_rx) = mpsc::unbounded_channel();
    let eos_token_ids = shard_info.eos_token_ids.iter().copied().collect();
    let core = EngineCore::new(
        shards.clone(),
        model.tokenizer.clone(),
        eos_token_ids,
        engine_config,
        kv,
        inbox_rx,
        metrics.clone(),
    )
    .with_adapters(adapters.clone());
    let core = match draft {
        Some(draft) => core.with_draft(draft),
        None => core,
    };
    let core = match &config.kv_events {
        Some(kv_events) => {
            let publisher = KvEventPublisher::start(kv_events, block_size, metrics.kv_events_dropped.clone()).await?;
            core.with_kv_events(publisher)
        }
        None => core,
    };
    let handle = EngineHandle::new(
        inbox_tx,
        shards,
        metrics,
        adapters,
        limits.max_unread_tokens,
        core.stats(),
    );
    let engine = engine::spawn(core);
    let state = app_state(config, limits, handle, model, &pool, shard_info, &warmup)?;
    Ok(Server {
        app: app(state.clone()),
        state,
        engine,
    })
}

/// The LoRA adapters of `--lora-adapters`, loaded on the shards. LoRA flags need shards with LoRA slots;
/// an adapter a shard refuses stops the start, with the shard's reason.
async fn load_adapters(config: &Config, shards: &dyn ShardClient, info: &pb::InfoResponse) -> anyhow::Result<Adapters> {
    let adapters = Adapters::new(info.max_loras, info.max_lora_rank);
    if !config.lora.is_wanted() {
        return Ok(adapters);
    }
    anyhow::ensure!(
        info.max_loras > 0,
        "--lora-adapters and --enable-lora-loading need LoRA slots on the shards: start them with --max-loras N \
         (their Info reports max_loras = 0)"
    );
    for (name, path) in &config.lora.adapters {
        let path = path.display().to_string();
        let adapter = super::lora::load_adapter(&adapters, shards, name, &path, &config.served_model_name).await?;
        tracing::info!(name, path, id = adapter.id, rank = adapter.rank, targets = ?adapter.target_modules, "LoRA adapter loaded");
    }
    tracing::info!(
        max_loras = info.max_loras,
        max_lora_rank = info.max_lora_rank,
        runtime_loading = config.lora.is_loading_enabled,
        "LoRA adapters ready"
    );
    Ok(adapters)
}

/// The draft model (`--speculative draft`) on `shard`: its vocabulary must be the target's (`target`), and
/// its Warmup sizes its own KV pool for calls like the target's (`target_warmup`: the same batch bounds,
/// and `--max-batch-total-tokens` when set, else its memory left), without a swap pool (a preempted
/// sequence's draft K/V are dropped, not swapped).
async fn draft_model(
    config: &Config,
    shard: Arc<dyn ShardClient>,
    target: &pb::InfoResponse,
    target_warmup: &pb::WarmupRequest,
) -> anyhow::Result<DraftModel> {
    anyhow::ensure!(
        config.batch.speculative.is_some(),
        "a draft model's shard needs --speculative draft"
    );
    let info = shard.info().await.context("the draft model's shard: Info failed")?;
    tracing::info!(?info, "draft shard info");
    anyhow::ensure!(
        info.vocab_size == target.vocab_size,
        "the draft model's vocabulary ({}) differs from the target's ({}): a draft model must share the \
         target's tokenizer",
        info.vocab_size,
        target.vocab_size
    );
    let warmup = shard
        .warmup(pb::WarmupRequest {
            swap_space_bytes: Some(0),
            max_speculative_tokens: 0,
            ..*target_warmup
        })
        .await
        .context("the draft model's shard: Warmup failed")?;
    anyhow::ensure!(warmup.num_blocks > 1, "the draft model's KV pool has no usable block");
    tracing::info!(
        blocks = warmup.num_blocks - 1,
        block_size = info.block_size,
        reason = warmup.kv_pool_reason,
        "draft model's KV pool ready"
    );
    Ok(DraftModel::new(
        shard,
        warmup.num_blocks,
        info.block_size as usize,
        target_warmup.max_batch_tokens as usize,
        target_warmup.max_batch_size as usize,
    ))
}

fn log_pool(config: &Config, pool: &Pool, warmup: &pb::WarmupResponse) {
    tracing::info!(
        blocks = pool.num_usable_blocks,
        block_size = pool.block_size,
        kv_tokens = pool.num_usable_blocks * pool.block_size,
        prefix_caching = config.batch.prefix_caching,
        preemption_mode = ?config.batch.preemption_mode,
        kv_admission = ?config.batch.kv_admission,
        swap_blocks = warmup.num_host_blocks.saturating_sub(1),
        swap_us_per_block = f64::from(warmup.swap_seconds_per_block) * 1e6,
        prefill_us_per_token = f64::from(warmup.prefill_seconds_per_token) * 1e6,
        "KV pool ready"
    );
}

fn engine_config(
    config: &Config,
    pool: &Pool,
    kv_window: usize,
    shard_info: &pb::InfoResponse,
    warmup_request: pb::WarmupRequest,
    warmup: &pb::WarmupResponse,
) -> EngineConfig {
    let batch = &config.batch;
    EngineConfig {
        scheduler: SchedulerConfig {
            max_batch_tokens: batch.max_batch_tokens as usize,
            max_batch_size: batch.max_batch_size as usize,
            block_size: pool.block_size,
            watermark_blocks: pool.watermark_blocks,
            mode: match batch.scheduling {
                Scheduling::Continuous => BatchingMode::Continuous,
                Scheduling::Static => BatchingMode::Static {
                    max_wait_ms: batch.static_batch_wait_ms,
                },
            },
            kv_admission: batch.kv_admission,
            max_times_overtaken: MAX_TIMES_OVERTAKEN,
            kv_window,
            max_loras: shard_info.max_loras as usize,
            speculative_max_step_tokens: batch.speculative.map_or(0, |spec| spec.max_step_tokens),
        },
        speculative: batch.speculative,
        target_itl_ms: batch.target_itl_ms,
        max_queue_time: batch.max_queue_time,
        warmup: warmup_request,
        prefix_caching: batch.prefix_caching,
        max_pinned_kv_fraction: batch.max_pinned_kv_fraction,
        preemption: preemption_config(batch.preemption_mode, warmup),
    }
}

/// What the handlers share: the engine's handle, the validator (with constrained decoding when the
/// tokenizer's file is known), the chat template and its tool-call format, the limits.
fn app_state(
    config: &Config,
    limits: crate::config::LimitsConfig,
    engine: EngineHandle,
    model: ModelFiles,
    pool: &Pool,
    shard_info: pb::InfoResponse,
    warmup: &pb::WarmupResponse,
) -> anyhow::Result<AppState> {
    // A single sequence may use the whole pool except the admission watermark.
    let max_kv_tokens = (pool.num_usable_blocks - pool.watermark_blocks) * pool.block_size;
    let mut validator = Validator::new(model.tokenizer, limits.clone(), shard_info.vocab_size, max_kv_tokens);
    if let Some(path) = &model.tokenizer_path {
        // Constrained decoding: the token trie of the tokenizer, built once.
        let grammar = GrammarCompiler::new(path, &shard_info.eos_token_ids, shard_info.vocab_size)
            .context("cannot build the grammar compiler's token trie")?
            .with_metrics(engine.metrics.grammar_compile_seconds.clone())
            .with_timeout(config.grammar_compile_timeout);
        validator = validator.with_grammar(grammar);
    }
    let chat_template = model.chat_template;
    if chat_template.is_none() {
        tracing::warn!("the model has no chat template: /v1/chat/completions will answer 422");
    }
    // Tool calls: the flag's format, else the one the template shows; Hermes for templates that show
    // none (tools are then described the Hermes way, `chat_template`).
    let tool_call_format = config.tool_call_parser.unwrap_or_else(|| {
        chat_template
            .as_deref()
            .filter(|template| template.renders_tools())
            .and_then(|template| ToolCallFormat::detect(template.source()))
            .unwrap_or(ToolCallFormat::Hermes)
    });
    tracing::info!(?tool_call_format, reasoning_format = ?config.reasoning_parser, "chat answers");
    Ok(AppState {
        engine,
        validator,
        admission: Arc::new(Semaphore::new(limits.max_concurrent_requests as usize)),
        waiting: Arc::new(Semaphore::new(limits.max_waiting_requests as usize)),
        draining: Arc::new(AtomicBool::new(false)),
        api_key: config.api_key.as_deref().map(Arc::from),
        max_body_bytes: config.max_body_bytes,
        cors_allow_origins: config.cors_allow_origins.clone(),
        log_prompts: config.log_prompts,
        chat_template,
        tool_call_format,
        reasoning_format: config.reasoning_parser,
        model_id: config.model_id.display().to_string(),
        served_model_name: config.served_model_name.clone(),
        started_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default(),
        shard_info,
        memory: MemoryInfo {
            kv_pool_bytes: u64::from(warmup.num_blocks) * warmup.bytes_per_block,
            kv_pool_reason: warmup.kv_pool_reason.clone(),
            swap_pool_bytes: u64::from(warmup.num_host_blocks) * warmup.bytes_per_block,
            swap_pool_reason: warmup.swap_pool_reason.clone(),
        },
        limits,
        batch: config.batch.clone(),
        responses: Arc::new(std::sync::Mutex::new(ResponseStore::new(config.responses_store))),
        is_lora_loading_enabled: config.lora.is_loading_enabled,
    })
}
