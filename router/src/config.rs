//! Command-line flags and the typed configuration built from them once at start.

use std::{net::SocketAddr, path::PathBuf};

use clap::Parser;

/// rill-router: Rill's HTTP server, scheduler and KV block owner. Normally started by `launcher.py`,
/// which starts the shards first; the router connects to them, sizes the KV pool (Warmup) and serves.
#[derive(Debug, Parser)]
#[command(version, about)]
pub struct Args {
    /// Hugging Face-layout model folder (tokenizer.json is read from it).
    #[arg(long, env = "RILL_MODEL_ID")]
    pub model_id: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1", env = "RILL_HOSTNAME")]
    pub hostname: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 8080, env = "RILL_PORT")]
    pub port: u16,
    /// Unix socket of a shard rank, once per rank, rank 0 first.
    #[arg(long = "shard-socket", required = true)]
    pub shard_sockets: Vec<PathBuf>,
    /// Longest prompt accepted, in tokens.
    #[arg(long, default_value_t = 4095, env = "RILL_MAX_INPUT_TOKENS")]
    pub max_input_tokens: u32,
    /// Most tokens of one request, prompt plus generated.
    #[arg(long, default_value_t = 4096, env = "RILL_MAX_TOTAL_TOKENS")]
    pub max_total_tokens: u32,
    /// Most tokens computed in one forward pass (one iteration); longer prompts are prefilled in chunks.
    #[arg(long, default_value_t = 2048, env = "RILL_MAX_BATCH_TOKENS")]
    pub max_batch_tokens: u32,
    /// KV capacity in tokens over all sequences; 0 lets the shards size it from free memory at warmup.
    #[arg(long, default_value_t = 0, env = "RILL_MAX_BATCH_TOTAL_TOKENS")]
    pub max_batch_total_tokens: u64,
    /// Most sequences in one forward pass.
    #[arg(long, default_value_t = 64, env = "RILL_MAX_BATCH_SIZE")]
    pub max_batch_size: u32,
    /// Most requests in the server at once (waiting or running); more get 429 at once.
    #[arg(long, default_value_t = 128, env = "RILL_MAX_CONCURRENT_REQUESTS")]
    pub max_concurrent_requests: u32,
    /// Most stop sequences one request may give.
    #[arg(long, default_value_t = 4, env = "RILL_MAX_STOP_SEQUENCES")]
    pub max_stop_sequences: u32,
    /// Model name of the OpenAI API (`/v1/models`, the `model` field); default: the model folder's name.
    #[arg(long, env = "RILL_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Seconds to wait for the shards' sockets to answer at start.
    #[arg(long, default_value_t = 60)]
    pub shard_connect_timeout: u64,
}

/// Request limits enforced by validation.
#[derive(Debug, Clone)]
pub struct LimitsConfig {
    pub max_input_tokens: u32,
    pub max_total_tokens: u32,
    pub max_stop_sequences: u32,
    pub max_concurrent_requests: u32,
}

/// Per-iteration budgets given to the scheduler.
#[derive(Debug, Clone)]
pub struct BatchConfig {
    pub max_batch_tokens: u32,
    pub max_batch_size: u32,
    pub max_batch_total_tokens: u64,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub model_id: PathBuf,
    pub served_model_name: String,
    pub addr: SocketAddr,
    pub shard_sockets: Vec<PathBuf>,
    pub shard_connect_timeout_s: u64,
    pub limits: LimitsConfig,
    pub batch: BatchConfig,
}

impl Config {
    pub fn from_args(args: Args) -> anyhow::Result<Self> {
        let addr = format!("{}:{}", args.hostname, args.port)
            .parse()
            .map_err(|e| anyhow::anyhow!("--hostname/--port do not form an address: {e}"))?;
        anyhow::ensure!(
            args.max_input_tokens < args.max_total_tokens,
            "--max-input-tokens ({}) must be below --max-total-tokens ({})",
            args.max_input_tokens,
            args.max_total_tokens
        );
        anyhow::ensure!(args.max_batch_tokens > 0, "--max-batch-tokens must be positive");
        anyhow::ensure!(args.max_batch_size > 0, "--max-batch-size must be positive");
        let served_model_name = args.served_model_name.unwrap_or_else(|| {
            let name = args.model_id.file_name().unwrap_or(args.model_id.as_os_str());
            name.to_string_lossy().into_owned()
        });
        Ok(Self {
            served_model_name,
            model_id: args.model_id,
            addr,
            shard_sockets: args.shard_sockets,
            shard_connect_timeout_s: args.shard_connect_timeout,
            limits: LimitsConfig {
                max_input_tokens: args.max_input_tokens,
                max_total_tokens: args.max_total_tokens,
                max_stop_sequences: args.max_stop_sequences,
                max_concurrent_requests: args.max_concurrent_requests,
            },
            batch: BatchConfig {
                max_batch_tokens: args.max_batch_tokens,
                max_batch_size: args.max_batch_size,
                max_batch_total_tokens: args.max_batch_total_tokens,
            },
        })
    }
}
