//! rill-router: connects to the model shards, sizes the KV pool, starts the engine loop, serves HTTP.
//! Usually started by the launcher (`python -m rill`); run `rill-router --help` for the flags.

use std::{
    collections::HashSet,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use anyhow::Context;
use clap::Parser;
use tokio::sync::{mpsc, Semaphore};

use rill_router::{
    api::MemoryInfo,
    chat_template,
    config::{Args, Config, Scheduling},
    engine::{self, preemption_config, EngineConfig, EngineCore, EngineHandle, EngineTask},
    grammar::GrammarCompiler,
    http,
    kv::{self, KvPool},
    metrics,
    scheduler::{BatchingMode, SchedulerConfig},
    shard::{pb, GrpcShards, ShardClient},
    telemetry,
    text::tool_calls::ToolCallFormat,
    validation::Validator,
};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.check_args {
        println!("{}", Config::from_args(args)?.launcher_view());
        return Ok(());
    }
    // Dropped last, on every way out of `main`: flushes the spans still buffered.
    let _telemetry = telemetry::init(args.json_logs, args.otlp_endpoint.as_deref())?;
    let mut config = Config::from_args(args)?;

    let tokenizer_path = config.model_id.join("tokenizer.json");
    let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_path)
        .map_err(|e| anyhow::anyhow!("cannot load {}: {e}", tokenizer_path.display()))?;
    let tokenizer = Arc::new(tokenizer);

    let shards = GrpcShards::connect(
        &config.shard_sockets,
        Duration::from_secs(config.shard_connect_timeout_s),
    )
    .await?
    .with_forward_deadline(config.forward_timeout);
    tracing::info!(ranks = shards.num_ranks(), "connected to the shards");
    let shards: Arc<dyn ShardClient> = Arc::new(shards);
    let shard_info = shards.info().await.context("shard Info failed")?;
    tracing::info!(?shard_info, "shard info");
    if let Some(change) = config.limits.fit_to_model(shard_info.max_position_embeddings) {
        tracing::warn!("{change}");
    }

    tracing::info!("warming up: sizing the KV pool");
    let warmup_request = pb::WarmupRequest {
        max_batch_tokens: config.batch.max_batch_tokens,
        max_batch_size: config.batch.max_batch_size,
        max_total_kv_tokens: config.batch.max_batch_total_tokens,
        swap_space_bytes: config.batch.swap_space_bytes,
    };
    let warmup = shards.warmup(warmup_request).await.context("shard Warmup failed")?;
    let block_size = shard_info.block_size as usize;
    let kv = KvPool::new(warmup.num_blocks, block_size, config.batch.prefix_caching);
    let num_usable_blocks = kv.num_usable_blocks() as usize;
    anyhow::ensure!(num_usable_blocks > 0, "the shards' KV pool has no usable block");
    // Admission leaves 1% of the pool (at least one block) for running sequences to grow into.
    let watermark_blocks = (num_usable_blocks / 100).max(1).min(num_usable_blocks - 1);
    tracing::info!(
        blocks = num_usable_blocks,
        block_size,
        kv_tokens = num_usable_blocks * block_size,
        prefix_caching = config.batch.prefix_caching,
        preemption_mode = ?config.batch.preemption_mode,
        kv_admission = ?config.batch.kv_admission,
        swap_blocks = warmup.num_host_blocks.saturating_sub(1),
        swap_us_per_block = f64::from(warmup.swap_seconds_per_block) * 1e6,
        prefill_us_per_token = f64::from(warmup.prefill_seconds_per_token) * 1e6,
        "KV pool ready"
    );
    let kv_window = kv::kv_window(&shard_info.sliding_windows);
    if kv_window > 0 {
        tracing::info!(
            kv_window,
            "every layer attends through a sliding window: blocks the window has left are released"
        );
    }

    let engine_config = EngineConfig {
        scheduler: SchedulerConfig {
            max_batch_tokens: config.batch.max_batch_tokens as usize,
            max_batch_size: config.batch.max_batch_size as usize,
            block_size,
            watermark_blocks,
            mode: match config.batch.scheduling {
                Scheduling::Continuous => BatchingMode::Continuous,
                Scheduling::Static => BatchingMode::Static {
                    max_wait_ms: config.batch.static_batch_wait_ms,
                },
            },
            kv_admission: config.batch.kv_admission,
            max_times_overtaken: MAX_TIMES_OVERTAKEN,
            kv_window,
        },
        target_itl_ms: config.batch.target_itl_ms,
        max_queue_time: config.batch.max_queue_time,
        warmup: warmup_request,
        prefix_caching: config.batch.prefix_caching,
        preemption: preemption_config(config.batch.preemption_mode, &warmup),
    };
    let metrics = Arc::new(metrics::Metrics::new());
    let (inbox_tx, inbox_rx) = mpsc::unbounded_channel();
    let eos_token_ids: HashSet<u32> = shard_info.eos_token_ids.iter().copied().collect();
    let core = EngineCore::new(
        shards.clone(),
        tokenizer.clone(),
        eos_token_ids,
        engine_config,
        kv,
        inbox_rx,
        metrics.clone(),
    );
    let engine_task = engine::spawn(core);

    // Constrained decoding: the token trie of the tokenizer, built once.
    let grammar = GrammarCompiler::new(&tokenizer_path, &shard_info.eos_token_ids, shard_info.vocab_size)
        .context("cannot build the grammar compiler's token trie")?
        .with_metrics(metrics.grammar_compile_seconds.clone());
    // A single sequence may use the whole pool except the admission watermark.
    let max_kv_tokens = (num_usable_blocks - watermark_blocks) * block_size;
    let chat_template = chat_template::ChatTemplate::load(&config.model_id)?.map(Arc::new);
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
    let state = http::AppState {
        engine: EngineHandle::new(inbox_tx, shards, metrics, config.limits.max_unread_tokens),
        validator: Validator::new(tokenizer, config.limits.clone(), shard_info.vocab_size, max_kv_tokens)
            .with_grammar(grammar),
        admission: Arc::new(Semaphore::new(config.limits.max_concurrent_requests as usize)),
        waiting: Arc::new(Semaphore::new(config.limits.max_waiting_requests as usize)),
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
        limits: config.limits.clone(),
        batch: config.batch.clone(),
    };
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .with_context(|| format!("cannot listen on {}", config.addr))?;
    tracing::info!(addr = %config.addr, "serving HTTP");
    let drained = drain_on_signal(state.clone(), config.shutdown_timeout);
    let drained = exit_if_engine_stops(engine_task, drained);
    http::serve::serve(listener, http::app(state), config.connections, drained).await;
    tracing::info!("stopped");
    Ok(())
}

/// Resolves when `drained` does. If the engine task ends first (`EngineTask::until_drained`), logs why and
/// exits with status 1; the launcher then exits non-zero too, for its supervisor to restart it.
async fn exit_if_engine_stops(engine: EngineTask, drained: impl std::future::Future<Output = ()>) {
    if let Err(reason) = engine.until_drained(drained).await {
        tracing::error!(%reason, "the engine stopped; exiting");
        std::process::exit(1);
    }
}

/// Graceful shutdown: on SIGTERM or Ctrl-C, new requests get 503 while those in flight finish, for up
/// to `timeout`; then the server stops.
async fn drain_on_signal(state: http::AppState, timeout: Duration) {
    shutdown_signal().await;
    state.draining.store(true, Ordering::SeqCst);
    let max = state.limits.max_concurrent_requests as usize;
    tracing::info!(
        timeout_s = timeout.as_secs(),
        "draining: refusing new requests, finishing those in flight"
    );
    let deadline = tokio::time::Instant::now() + timeout;
    while state.admission.available_permits() < max && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let num_left = max - state.admission.available_permits();
    if num_left > 0 {
        tracing::warn!(num_left, "shutdown timeout reached with requests in flight");
    }
}

/// The scheduler's starvation bound: a request overtaken this often by later, higher-priority arrivals is
/// admitted first.
const MAX_TIMES_OVERTAKEN: u32 = 32;

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler cannot fail on unix");
    tokio::select! {
        _ = ctrl_c => {}
        _ = terminate.recv() => {}
    }
    tracing::info!("shutdown signal received");
}
