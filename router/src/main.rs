//! rill-router: loads the tokenizer, connects to the model shards, wires the router (`http::build`: sizes
//! the KV pool, starts the engine loop, builds the app), serves HTTP and drains on SIGTERM.
//! Usually started by the launcher (`python -m rill`); run `rill-router --help` for the flags.

use std::{
    sync::{atomic::Ordering, Arc},
    time::Duration,
};

use anyhow::Context;
use clap::Parser;

use rill_router::{
    chat_template,
    config::{Args, Config},
    engine::EngineTask,
    http,
    shard::GrpcShards,
    telemetry,
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
    let config = Config::from_args(args)?;

    let tokenizer_path = config.model_id.join("tokenizer.json");
    let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_path)
        .map_err(|e| anyhow::anyhow!("cannot load {}: {e}", tokenizer_path.display()))?;

    let shards = GrpcShards::connect(
        &config.shard_sockets,
        Duration::from_secs(config.shard_connect_timeout_s),
    )
    .await?
    .with_forward_deadline(config.forward_timeout);
    tracing::info!(ranks = shards.num_ranks(), "connected to the shards");
    let draft_shard = match &config.draft_shard_socket {
        Some(socket) => {
            let draft = GrpcShards::connect(
                std::slice::from_ref(socket),
                Duration::from_secs(config.shard_connect_timeout_s),
            )
            .await
            .context("the draft model's shard (--draft-shard-socket)")?
            .with_forward_deadline(config.forward_timeout);
            tracing::info!("connected to the draft model's shard");
            Some(Arc::new(draft) as Arc<dyn rill_router::shard::ShardClient>)
        }
        None => None,
    };
    let model = http::ModelFiles {
        tokenizer: Arc::new(tokenizer),
        tokenizer_path: Some(tokenizer_path),
        chat_template: chat_template::ChatTemplate::load(&config.model_id)?.map(Arc::new),
    };
    let http::Server { app, state, engine } = http::build(&config, Arc::new(shards), draft_shard, model).await?;
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .with_context(|| format!("cannot listen on {}", config.addr))?;
    tracing::info!(addr = %config.addr, "serving HTTP");
    let drained = drain_on_signal(state.clone(), config.shutdown_timeout);
    let drained = exit_if_engine_stops(engine, drained);
    http::serve::serve(listener, app, config.connections, drained).await;
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
