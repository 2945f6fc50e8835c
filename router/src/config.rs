//! Command-line flags and the typed configuration built from them once at start.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use clap::{builder::BoolishValueParser, Arg, ArgAction, Parser, ValueEnum};

use crate::{
    kv_events::{KvEventsConfig, KvEventsSocket},
    scheduler::{KvAdmission, PreemptionMode},
    speculative::SpeculativeConfig,
    text::{reasoning::ReasoningFormat, tool_calls::ToolCallFormat},
};

/// rill-router: Rill's HTTP server, scheduler and KV block owner. Normally started by the launcher (`python -m rill`),
/// which starts the shards first; the router connects to them, sizes the KV pool (Warmup) and serves.
//
// This struct is the one declaration of the router's flags: the launcher passes every flag it does not
// act on through unchanged, and docs/flags.md's flag table is generated from `--help` (docs/flags.py). Each
// flag reads `RILL_<FLAG>` when not given on the command line (a test checks that every flag has it); a
// switch is turned off with `--switch=false` (see `switch_takes_a_value`).
#[derive(Debug, Parser)]
#[command(version, about, mut_args = switch_takes_a_value)]
pub struct Args {
    /// Hugging Face-layout model folder (tokenizer.json is read from it).
    #[arg(long, env = "RILL_MODEL_ID")]
    pub model_id: PathBuf,
    /// Model name of the OpenAI API (`/v1/models`, the `model` field); default: the model folder's name.
    #[arg(long, env = "RILL_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// LoRA adapters to serve from the start, `name=path,...` (PEFT folders on the shards' machine); a
    /// request selects one by naming it in `model` (OpenAI, Anthropic) or `adapter_id` (TGI). Needs shards
    /// started with `--max-loras N`; an adapter a shard refuses stops the start with its reason.
    #[arg(long, env = "RILL_LORA_ADAPTERS", value_delimiter = ',', value_parser = crate::lora::parse_adapter_arg)]
    pub lora_adapters: Vec<(String, PathBuf)>,
    /// Allow loading and unloading LoRA adapters at run time (`POST /v1/load_lora_adapter`,
    /// `/v1/unload_lora_adapter`); off, those answer 404. Needs shards started with `--max-loras N`.
    #[arg(long, env = "RILL_ENABLE_LORA_LOADING")]
    pub enable_lora_loading: bool,
    /// Address to listen on.
    #[arg(long, env = "RILL_HOSTNAME", default_value = "127.0.0.1")]
    pub hostname: String,
    /// Port to listen on.
    #[arg(long, env = "RILL_PORT", default_value_t = 8080)]
    pub port: u16,
    /// Unix socket of a shard rank, once per rank, rank 0 first.
    #[arg(long = "shard-socket", env = "RILL_SHARD_SOCKET", required = true)]
    pub shard_sockets: Vec<PathBuf>,
    /// Longest prompt accepted, in tokens.
    #[arg(long, env = "RILL_MAX_INPUT_TOKENS", default_value_t = 4095)]
    pub max_input_tokens: u32,
    /// Most tokens of one request, prompt plus generated; lowered to the model's positions
    /// (`max_position_embeddings`) when above them, and --max-input-tokens with it (logged).
    #[arg(long, env = "RILL_MAX_TOTAL_TOKENS", default_value_t = 4096)]
    pub max_total_tokens: u32,
    /// Most tokens computed in one forward pass (one iteration); longer prompts are prefilled in chunks.
    #[arg(long, env = "RILL_MAX_BATCH_TOKENS", default_value_t = 2048)]
    pub max_batch_tokens: u32,
    /// KV capacity in tokens over all sequences; 0 lets the shards size it from free memory at warmup.
    #[arg(long, env = "RILL_MAX_BATCH_TOTAL_TOKENS", default_value_t = 0)]
    pub max_batch_total_tokens: u64,
    /// Most sequences in one forward pass.
    #[arg(long, env = "RILL_MAX_BATCH_SIZE", default_value_t = 64)]
    pub max_batch_size: u32,
    /// Most sequences in the server at once (waiting or running); more get 429 at once.
    #[arg(long, env = "RILL_MAX_CONCURRENT_REQUESTS", default_value_t = 128)]
    pub max_concurrent_requests: u32,
    /// Most requests waiting for admission; more get 429 at once.
    #[arg(long, env = "RILL_MAX_WAITING_REQUESTS", default_value_t = 128)]
    pub max_waiting_requests: u32,
    /// Seconds a request may wait for admission before it fails with 503; 0 = no limit.
    #[arg(long, env = "RILL_MAX_QUEUE_TIME", default_value_t = 0)]
    pub max_queue_time: u64,
    /// Most stop sequences one request may give.
    #[arg(long, env = "RILL_MAX_STOP_SEQUENCES", default_value_t = 4)]
    pub max_stop_sequences: u32,
    /// How batches form: `continuous` (iteration-level) or `static` (a baseline for benchmarks).
    #[arg(long, env = "RILL_SCHEDULING", value_enum, default_value_t = Scheduling::Continuous)]
    pub scheduling: Scheduling,
    /// With `--scheduling static`: start a partial batch once its oldest request waited this long.
    #[arg(long, env = "RILL_STATIC_BATCH_WAIT_MS", default_value_t = 1000)]
    pub static_batch_wait_ms: u64,
    /// Keep running streams' inter-token latency under this target by sizing prompt chunks from the
    /// step time measured at warmup and while serving; unset = a fixed --max-batch-tokens budget.
    #[arg(long, env = "RILL_TARGET_ITL_MS")]
    pub target_itl_ms: Option<f64>,
    /// Speculative decoding: `ngram` proposes, for each decoding sequence, the tokens that followed the
    /// latest earlier occurrence of its last few tokens (prompt lookup); `draft` has a smaller draft model
    /// with the same tokenizer (served by the shard of --draft-shard-socket) decode them greedily ahead.
    /// The shards verify them in the step's forward pass. The output is the same token for token (greedy
    /// or seeded); it comes sooner when the proposals are right. Off for requests under a grammar.
    /// Unset = off.
    #[arg(long, env = "RILL_SPECULATIVE", value_enum)]
    pub speculative: Option<SpeculativeMethod>,
    /// With --speculative: the most tokens proposed for one sequence in one step (fewer after rejections).
    #[arg(long, env = "RILL_NUM_SPECULATIVE_TOKENS", default_value_t = 4)]
    pub num_speculative_tokens: usize,
    /// With --speculative ngram: the shortest suffix of a sequence looked up among its earlier tokens.
    #[arg(long, env = "RILL_SPECULATIVE_NGRAM_MIN", default_value_t = 1)]
    pub speculative_ngram_min: usize,
    /// With --speculative ngram: the longest suffix looked up (the longest that recurs wins).
    #[arg(long, env = "RILL_SPECULATIVE_NGRAM_MAX", default_value_t = 3)]
    pub speculative_ngram_max: usize,
    /// With --speculative draft: the unix socket of the draft model's shard (one rank; the launcher starts
    /// it for --draft-model-id and sets this).
    #[arg(long, env = "RILL_DRAFT_SHARD_SOCKET")]
    pub draft_shard_socket: Option<PathBuf>,
    /// With --speculative: proposals join a step only while its decodes and proposals stay within this
    /// many tokens (beyond it a step is compute-bound, and a rejected proposal costs like a token).
    #[arg(long, env = "RILL_SPECULATIVE_MAX_STEP_TOKENS", default_value_t = 16)]
    pub speculative_max_step_tokens: usize,
    /// How a preempted sequence gives up its KV blocks: `recompute` (free them; recompute its K/V when it
    /// resumes), `swap` (copy them to the host swap pool and back when room returns; recompute when the
    /// swap pool is full) or `auto` (swap when the swap pool has room and copying is cheaper than
    /// recomputing, as the shards measured at warmup).
    #[arg(long, env = "RILL_PREEMPTION_MODE", value_enum, default_value_t = PreemptionModeArg::Auto)]
    pub preemption_mode: PreemptionModeArg,
    /// Host memory for the swap pool, in GiB per shard (pinned on a GPU); unused with
    /// `--preemption-mode recompute`. Unset: 10% of the host memory left after the KV pool (the smaller
    /// of MemAvailable and the cgroup's room, split between the shards).
    #[arg(long, env = "RILL_SWAP_SPACE")]
    pub swap_space: Option<f64>,
    /// How admission claims KV blocks: `incremental` (as tokens are computed; preempt when the pool runs
    /// out) or `reserve` (TGI's policy, a benchmark baseline: reserve prompt + max_new_tokens at
    /// admission, never preempt).
    #[arg(long, env = "RILL_KV_ADMISSION", value_enum, default_value_t = KvAdmissionArg::Incremental)]
    pub kv_admission: KvAdmissionArg,
    /// Turn off the prefix cache (on by default: computed prompt blocks are kept and reused).
    #[arg(long, env = "RILL_NO_PREFIX_CACHING")]
    pub no_prefix_caching: bool,
    /// Seconds a session pin keeps a finished request's cached prefix (prompt and output) from eviction
    /// when the request asks for a pin without a TTL (OpenAI's `prompt_cache_key`).
    #[arg(long, env = "RILL_CACHE_PIN_TTL", default_value_t = 300)]
    pub cache_pin_ttl: u64,
    /// Longest TTL of a session pin, in seconds; a request asking for longer gets this.
    #[arg(long, env = "RILL_MAX_CACHE_PIN_TTL", default_value_t = 3600)]
    pub max_cache_pin_ttl: u64,
    /// Most of the KV pool session pins may keep, as a fraction in [0, 1]; a new pin beyond it releases the
    /// oldest pins. Pinned blocks still give way under memory pressure (before any preemption). 0 turns
    /// pins off.
    #[arg(long, env = "RILL_MAX_PINNED_KV_FRACTION", default_value_t = 0.25)]
    pub max_pinned_kv_fraction: f64,
    /// Publish KV-cache events (vLLM's ZMQ format: blocks stored in and removed from the prefix cache, all
    /// cleared) on this ZeroMQ endpoint, so a gateway's indexer (llm-d's precise prefix-cache scorer) knows
    /// which prefixes this replica holds: `tcp://*:PORT` binds (subscribers connect), `tcp://HOST:PORT`
    /// connects to a subscriber that binds. Unset: off.
    #[arg(long, env = "RILL_KV_EVENTS_ENDPOINT")]
    pub kv_events_endpoint: Option<String>,
    /// The ZMQ topic of the KV-cache events; llm-d reads `kv@<pod>@<model>` and indexes the blocks under that
    /// pod and model (in Kubernetes: `kv@$(POD_IP):PORT@MODEL`). Unset: `kv@HOSTNAME:PORT@MODEL` from
    /// --hostname, --port and the served model name.
    #[arg(long, env = "RILL_KV_EVENTS_TOPIC")]
    pub kv_events_topic: Option<String>,
    /// On SIGTERM: refuse new requests (503) and let requests in flight finish for up to this many seconds.
    #[arg(long, env = "RILL_SHUTDOWN_TIMEOUT", default_value_t = 30)]
    pub shutdown_timeout: u64,
    /// Seconds a client has to send a whole request head once the router waits for one (after it connects,
    /// and after each answer on a kept-alive connection), else the connection is closed: bounds clients
    /// that send headers slowly, and is the idle timeout of silent and kept-alive connections; 0 = none.
    #[arg(long, env = "RILL_HEADER_READ_TIMEOUT", default_value_t = 10)]
    pub header_read_timeout: u64,
    /// Most HTTP connections open at once; one beyond it is closed as soon as it is accepted, so a flood
    /// of idle connections cannot use up file descriptors or memory.
    #[arg(long, env = "RILL_MAX_CONNECTIONS", default_value_t = 8192)]
    pub max_connections: usize,
    /// Seconds a forward call to the shards may take before the shards count as hung: the step's requests
    /// fail with an error and `/ready` turns 503. Unset: 20 times the slowest forward measured so far (the
    /// warmup's largest batch included), at least 30 s.
    #[arg(long, env = "RILL_FORWARD_TIMEOUT")]
    pub forward_timeout: Option<f64>,
    /// Seconds a request may take from arrival to its last token, queueing included; one that runs past it
    /// ends with 504 (non-streaming) or an SSE `error` event, and its KV blocks are freed. A request's own
    /// `timeout` field may only shorten it. Unset: no limit.
    #[arg(long, env = "RILL_REQUEST_TIMEOUT")]
    pub request_timeout: Option<f64>,
    /// Most token events a client may leave unread (produced, not yet taken by its HTTP connection); a
    /// client further behind is cut off: its request is cancelled and its KV blocks freed, so a reader that
    /// stalls never holds memory or slows the engine.
    #[arg(long, env = "RILL_MAX_UNREAD_TOKENS", default_value_t = 1024)]
    pub max_unread_tokens: usize,
    /// Require `Authorization: Bearer <key>` or `x-api-key: <key>` on the generation and tokenization routes
    /// (health, readiness and metrics stay open). Read from the environment so the key never shows in a process list.
    #[arg(long, env = "RILL_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Largest request body accepted, in bytes; larger ones get 413.
    #[arg(long, env = "RILL_MAX_BODY_BYTES", default_value_t = 2 << 20)]
    pub max_body_bytes: usize,
    /// Let browser pages from this origin call the API (CORS), e.g. `https://app.example.com`; repeat the
    /// flag for several origins, or give `*` for any. Off by default: no CORS headers, preflights get 405.
    #[arg(long = "cors-allow-origin", env = "RILL_CORS_ALLOW_ORIGIN", value_name = "ORIGIN")]
    pub cors_allow_origins: Vec<String>,
    /// How the model writes tool calls: `hermes` (`<tool_call>{...}</tool_call>`, Qwen and Hermes models),
    /// `qwen3_coder` (`<tool_call><function=...><parameter=...>`), `llama3` (a `{"name", "parameters"}`
    /// object), `mistral` (`[TOOL_CALLS][...]`) or `mistral_args` (`[TOOL_CALLS]name[ARGS]{...}`). Unset:
    /// the format whose markers the chat template shows, else `hermes` (templates without tool support
    /// are given the tools the Hermes way).
    #[arg(long, env = "RILL_TOOL_CALL_PARSER", value_enum, hide_possible_values = true)]
    pub tool_call_parser: Option<ToolCallFormat>,
    /// Separate a reasoning model's `<think>...</think>` from its answer, as `reasoning_content`:
    /// `deepseek_r1` (the answer starts inside the thinking) or `qwen3` (when it starts with `<think>`).
    /// A grammar (`response_format`, tool choices) then applies after the thinking. Unset: no separation.
    #[arg(long, env = "RILL_REASONING_PARSER", value_enum, hide_possible_values = true)]
    pub reasoning_parser: Option<ReasoningFormat>,
    /// Most responses the `/v1/responses` store keeps (`store: true`, the default); when full, the oldest
    /// are evicted first. 0 keeps none.
    #[arg(long, env = "RILL_RESPONSES_STORE_MAX_ENTRIES", default_value_t = 10_000)]
    pub responses_store_max_entries: usize,
    /// Most bytes the `/v1/responses` store holds (each response's JSON, its input items, and its token
    /// history at 4 bytes a token); when full, the oldest are evicted first.
    #[arg(long, env = "RILL_RESPONSES_STORE_MAX_BYTES", default_value_t = 512 << 20)]
    pub responses_store_max_bytes: usize,
    /// Seconds a stored response is kept (retrievable, and continued by `previous_response_id`).
    #[arg(long, env = "RILL_RESPONSES_STORE_TTL_SECS", default_value_t = 3600)]
    pub responses_store_ttl_secs: u64,
    /// Seconds a request's grammar (`response_format`, `guided_*`, tools' schemas) may take to compile;
    /// one that takes longer gets a 400 (llguidance's own size and work limits stop most sooner).
    #[arg(long, env = "RILL_GRAMMAR_COMPILE_TIMEOUT", default_value_t = 5.0)]
    pub grammar_compile_timeout: f64,
    /// Log each prompt's text (never logged otherwise).
    #[arg(long, env = "RILL_LOG_PROMPTS")]
    pub log_prompts: bool,
    /// Log one JSON object per line (request id, timings, outcome as fields) instead of text.
    #[arg(long, env = "RILL_JSON_LOGS")]
    pub json_logs: bool,
    /// Send OpenTelemetry spans (request, queue, step) over OTLP/HTTP to this collector, e.g.
    /// `http://localhost:4318` (spans go to `URL/v1/traces`); the shards join the same traces.
    #[arg(long, env = "RILL_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Seconds to wait for the shards' sockets to answer at start.
    #[arg(long, env = "RILL_SHARD_CONNECT_TIMEOUT", default_value_t = 60)]
    pub shard_connect_timeout: u64,
    /// Check the flags, print what the launcher needs of them as one JSON line and exit (0, or non-zero
    /// with the error), without connecting to the shards. The launcher runs this before it starts them.
    #[arg(long)]
    pub check_args: bool,
}

/// The one convention for switches (`bool` flags), in both binaries: `--switch` turns it on,
/// `--switch=false` (or `--switch false`) turns it off, and `RILL_<SWITCH>` takes 1/0, true/false,
/// yes/no or on/off, so a switch set in the environment can be turned off on the command line.
fn switch_takes_a_value(arg: Arg) -> Arg {
    if !matches!(arg.get_action(), ArgAction::SetTrue) {
        return arg;
    }
    arg.action(ArgAction::Set)
        .num_args(0..=1)
        .value_name("BOOL")
        .default_value("false")
        .default_missing_value("true")
        .value_parser(BoolishValueParser::new())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "lower")]
pub enum PreemptionModeArg {
    Recompute,
    Swap,
    Auto,
}

impl From<PreemptionModeArg> for PreemptionMode {
    fn from(mode: PreemptionModeArg) -> Self {
        match mode {
            PreemptionModeArg::Recompute => PreemptionMode::Recompute,
            PreemptionModeArg::Swap => PreemptionMode::Swap,
            PreemptionModeArg::Auto => PreemptionMode::Auto,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "lower")]
pub enum KvAdmissionArg {
    Incremental,
    Reserve,
}

impl From<KvAdmissionArg> for KvAdmission {
    fn from(admission: KvAdmissionArg) -> Self {
        match admission {
            KvAdmissionArg::Incremental => KvAdmission::Incremental,
            KvAdmissionArg::Reserve => KvAdmission::Reserve,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SpeculativeMethod {
    Ngram,
    Draft,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Scheduling {
    Continuous,
    Static,
}

/// LoRA adapters (`--lora-adapters`, `--enable-lora-loading`).
#[derive(Debug, Clone, Default)]
pub struct LoraConfig {
    /// Adapters loaded at start: (name, PEFT folder), in the flag's order.
    pub adapters: Vec<(String, PathBuf)>,
    /// Whether adapters may be loaded and unloaded at run time.
    pub is_loading_enabled: bool,
}

impl LoraConfig {
    /// Whether any LoRA flag is set (the shards must then have LoRA slots).
    pub fn is_wanted(&self) -> bool {
        !self.adapters.is_empty() || self.is_loading_enabled
    }
}

/// Request limits enforced by validation and admission.
#[derive(Debug, Clone)]
pub struct LimitsConfig {
    pub max_input_tokens: u32,
    pub max_total_tokens: u32,
    pub max_stop_sequences: u32,
    pub max_concurrent_requests: u32,
    pub max_waiting_requests: u32,
    /// `--request-timeout`: the longest a request may take from arrival to its last token; None = no limit.
    pub request_timeout: Option<Duration>,
    /// `--max-unread-tokens`: token events a client may leave unread before it is cut off.
    pub max_unread_tokens: usize,
    /// `--cache-pin-ttl`: a session pin's TTL when the request gives none.
    pub cache_pin_ttl: Duration,
    /// `--max-cache-pin-ttl`: the longest TTL a session pin gets.
    pub max_cache_pin_ttl: Duration,
}

impl LimitsConfig {
    /// Lowers the token limits to the model's positions (`max_position_embeddings`; 0 = unknown), so a request
    /// that would outgrow them is refused or ends at `length` instead of failing its whole batch in the shard.
    /// Returns what it changed, for the log.
    pub fn fit_to_model(&mut self, max_positions: u32) -> Option<String> {
        if max_positions == 0 || self.max_total_tokens <= max_positions {
            return None;
        }
        let asked = (self.max_input_tokens, self.max_total_tokens);
        self.max_total_tokens = max_positions;
        self.max_input_tokens = self.max_input_tokens.min(max_positions - 1);
        Some(format!(
            "the model has {max_positions} positions: --max-total-tokens lowered from {} to {}, \
             --max-input-tokens {} -> {}",
            asked.1, self.max_total_tokens, asked.0, self.max_input_tokens
        ))
    }
}

/// The longest deadline accepted, in seconds (`--request-timeout`, a request's `timeout`): about 11 days.
pub const MAX_TIMEOUT_S: f64 = 1e6;

/// Per-iteration budgets and batching policy given to the engine.
#[derive(Debug, Clone)]
pub struct BatchConfig {
    pub max_batch_tokens: u32,
    pub max_batch_size: u32,
    pub max_batch_total_tokens: u64,
    pub scheduling: Scheduling,
    pub static_batch_wait_ms: u64,
    pub target_itl_ms: Option<f64>,
    pub max_queue_time: Option<Duration>,
    pub prefix_caching: bool,
    /// `--max-pinned-kv-fraction`: the share of the KV pool session pins may keep.
    pub max_pinned_kv_fraction: f64,
    pub preemption_mode: PreemptionMode,
    /// Host swap pool per shard, in bytes; 0 with `--preemption-mode recompute`; None: the shards size it.
    pub swap_space_bytes: Option<u64>,
    pub kv_admission: KvAdmission,
    /// `--speculative` and its settings; None = off.
    pub speculative: Option<SpeculativeConfig>,
}

/// The bounds of the `/v1/responses` store (`--responses-store-max-entries`, `--responses-store-max-bytes`,
/// `--responses-store-ttl-secs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreBounds {
    /// Most entries kept; 0 keeps none (every response is then as if `store: false`).
    pub max_entries: usize,
    /// Most bytes kept over all entries; an entry larger than this alone is not kept.
    pub max_bytes: usize,
    /// How long an entry is kept after it was stored.
    pub ttl: Duration,
}

/// Limits on the HTTP connections themselves (`http::serve`).
#[derive(Debug, Clone, Copy)]
pub struct ConnectionConfig {
    /// Time to send a whole request head once the router waits for one; None = no limit.
    pub header_read_timeout: Option<Duration>,
    /// Connections open at once; more are closed on accept.
    pub max_connections: usize,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub model_id: PathBuf,
    pub served_model_name: String,
    pub addr: SocketAddr,
    pub shard_sockets: Vec<PathBuf>,
    /// `--draft-shard-socket`: the draft model's shard, with `--speculative draft` (and only then).
    pub draft_shard_socket: Option<PathBuf>,
    pub shard_connect_timeout_s: u64,
    pub shutdown_timeout: Duration,
    pub connections: ConnectionConfig,
    /// `--forward-timeout`; None = derived from the measured step time.
    pub forward_timeout: Option<Duration>,
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
    /// Origins allowed by CORS (`--cors-allow-origin`); `*` means any; empty means CORS off.
    pub cors_allow_origins: Vec<String>,
    /// `--tool-call-parser`; None = from the chat template.
    pub tool_call_parser: Option<ToolCallFormat>,
    /// `--reasoning-parser`; None = answers are not split.
    pub reasoning_parser: Option<ReasoningFormat>,
    /// `--grammar-compile-timeout`: the longest a grammar may take to compile.
    pub grammar_compile_timeout: Duration,
    pub log_prompts: bool,
    pub limits: LimitsConfig,
    pub batch: BatchConfig,
    /// `--responses-store-*`.
    pub responses_store: StoreBounds,
    pub lora: LoraConfig,
    /// `--kv-events-endpoint` and `--kv-events-topic`; None = off.
    pub kv_events: Option<KvEventsConfig>,
}

impl Config {
    pub fn from_args(args: Args) -> anyhow::Result<Self> {
        let addr: SocketAddr = format!("{}:{}", args.hostname, args.port)
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
        anyhow::ensure!(args.max_connections > 0, "--max-connections must be positive");
        anyhow::ensure!(args.max_unread_tokens > 0, "--max-unread-tokens must be positive");
        anyhow::ensure!(
            args.responses_store_ttl_secs > 0,
            "--responses-store-ttl-secs must be positive"
        );
        anyhow::ensure!(
            args.grammar_compile_timeout > 0.0 && args.grammar_compile_timeout <= MAX_TIMEOUT_S,
            "--grammar-compile-timeout must be a positive number of seconds, got {}",
            args.grammar_compile_timeout
        );
        anyhow::ensure!(
            args.forward_timeout.is_none_or(|s| s > 0.0 && s.is_finite()),
            "--forward-timeout must be a positive number of seconds, got {:?}",
            args.forward_timeout
        );
        anyhow::ensure!(
            args.request_timeout.is_none_or(|s| s > 0.0 && s <= MAX_TIMEOUT_S),
            "--request-timeout must be a positive number of seconds, at most {MAX_TIMEOUT_S}, got {:?}",
            args.request_timeout
        );
        anyhow::ensure!(
            args.swap_space.is_none_or(|gib| gib >= 0.0 && gib.is_finite()),
            "--swap-space must be a non-negative number of GiB, got {:?}",
            args.swap_space
        );
        for origin in &args.cors_allow_origins {
            anyhow::ensure!(
                !origin.is_empty() && origin.bytes().all(|b| b.is_ascii_graphic()) && !origin.ends_with('/'),
                "--cors-allow-origin takes `*` or an origin like https://app.example.com (no path), got {origin:?}"
            );
        }
        anyhow::ensure!(
            (0.0..=1.0).contains(&args.max_pinned_kv_fraction),
            "--max-pinned-kv-fraction must be in [0, 1], got {}",
            args.max_pinned_kv_fraction
        );
        anyhow::ensure!(
            args.cache_pin_ttl > 0 && args.cache_pin_ttl <= args.max_cache_pin_ttl,
            "--cache-pin-ttl ({}) must be positive and at most --max-cache-pin-ttl ({})",
            args.cache_pin_ttl,
            args.max_cache_pin_ttl
        );
        if let Some(target) = args.target_itl_ms {
            anyhow::ensure!(target > 0.0, "--target-itl-ms must be positive, got {target}");
        }
        if args.speculative.is_some() {
            anyhow::ensure!(
                args.num_speculative_tokens >= 1,
                "--num-speculative-tokens must be >= 1, got {}",
                args.num_speculative_tokens
            );
            anyhow::ensure!(
                1 <= args.speculative_ngram_min && args.speculative_ngram_min <= args.speculative_ngram_max,
                "--speculative-ngram-min ({}) must be >= 1 and at most --speculative-ngram-max ({})",
                args.speculative_ngram_min,
                args.speculative_ngram_max
            );
        }
        let is_draft = args.speculative == Some(SpeculativeMethod::Draft);
        anyhow::ensure!(
            is_draft == args.draft_shard_socket.is_some(),
            "{}",
            if is_draft {
                "--speculative draft needs the draft model's shard: --draft-shard-socket PATH (the launcher \
                 starts one for --draft-model-id)"
            } else {
                "--draft-shard-socket (the launcher sets it for --draft-model-id) needs --speculative draft"
            }
        );
        let served_model_name = args.served_model_name.unwrap_or_else(|| {
            let name = args.model_id.file_name().unwrap_or(args.model_id.as_os_str());
            name.to_string_lossy().into_owned()
        });
        for (i, (name, _)) in args.lora_adapters.iter().enumerate() {
            anyhow::ensure!(
                *name != served_model_name,
                "--lora-adapters: the adapter name `{name}` is the base model's (--served-model-name)"
            );
            anyhow::ensure!(
                !args.lora_adapters[..i].iter().any(|(other, _)| other == name),
                "--lora-adapters names `{name}` twice"
            );
        }
        let kv_events = match &args.kv_events_endpoint {
            Some(endpoint) => Some(KvEventsConfig {
                socket: KvEventsSocket::parse(endpoint)?,
                topic: args
                    .kv_events_topic
                    .clone()
                    .unwrap_or_else(|| format!("kv@{addr}@{served_model_name}")),
            }),
            None => {
                anyhow::ensure!(
                    args.kv_events_topic.is_none(),
                    "--kv-events-topic needs --kv-events-endpoint"
                );
                None
            }
        };
        Ok(Self {
            kv_events,
            served_model_name,
            model_id: args.model_id,
            addr,
            shard_sockets: args.shard_sockets,
            draft_shard_socket: args.draft_shard_socket,
            shard_connect_timeout_s: args.shard_connect_timeout,
            shutdown_timeout: Duration::from_secs(args.shutdown_timeout),
            connections: ConnectionConfig {
                header_read_timeout: (args.header_read_timeout > 0)
                    .then(|| Duration::from_secs(args.header_read_timeout)),
                max_connections: args.max_connections,
            },
            forward_timeout: args.forward_timeout.map(Duration::from_secs_f64),
            api_key: args.api_key.filter(|key| !key.is_empty()),
            max_body_bytes: args.max_body_bytes,
            cors_allow_origins: args.cors_allow_origins,
            tool_call_parser: args.tool_call_parser,
            reasoning_parser: args.reasoning_parser,
            grammar_compile_timeout: Duration::from_secs_f64(args.grammar_compile_timeout),
            log_prompts: args.log_prompts,
            responses_store: StoreBounds {
                max_entries: args.responses_store_max_entries,
                max_bytes: args.responses_store_max_bytes,
                ttl: Duration::from_secs(args.responses_store_ttl_secs),
            },
            lora: LoraConfig {
                adapters: args.lora_adapters,
                is_loading_enabled: args.enable_lora_loading,
            },
            limits: LimitsConfig {
                max_input_tokens: args.max_input_tokens,
                max_total_tokens: args.max_total_tokens,
                max_stop_sequences: args.max_stop_sequences,
                max_concurrent_requests: args.max_concurrent_requests,
                max_waiting_requests: args.max_waiting_requests,
                request_timeout: args.request_timeout.map(Duration::from_secs_f64),
                max_unread_tokens: args.max_unread_tokens,
                cache_pin_ttl: Duration::from_secs(args.cache_pin_ttl),
                max_cache_pin_ttl: Duration::from_secs(args.max_cache_pin_ttl),
            },
            batch: BatchConfig {
                max_batch_tokens: args.max_batch_tokens,
                max_batch_size: args.max_batch_size,
                max_batch_total_tokens: args.max_batch_total_tokens,
                scheduling: args.scheduling,
                static_batch_wait_ms: args.static_batch_wait_ms,
                target_itl_ms: args.target_itl_ms,
                max_queue_time: (args.max_queue_time > 0).then(|| Duration::from_secs(args.max_queue_time)),
                prefix_caching: !args.no_prefix_caching,
                max_pinned_kv_fraction: args.max_pinned_kv_fraction,
                preemption_mode: args.preemption_mode.into(),
                swap_space_bytes: if args.preemption_mode == PreemptionModeArg::Recompute {
                    Some(0)
                } else {
                    args.swap_space.map(|gib| (gib * f64::from(1u32 << 30)) as u64)
                },
                kv_admission: args.kv_admission.into(),
                speculative: args.speculative.map(|_| SpeculativeConfig {
                    max_proposed_tokens: args.num_speculative_tokens,
                    ngram_min: args.speculative_ngram_min,
                    ngram_max: args.speculative_ngram_max,
                    max_step_tokens: args.speculative_max_step_tokens,
                }),
            },
        })
    }

    /// What `--check-args` prints: the facts the launcher acts on (where to wait for `/health`, how long
    /// the router drains on SIGTERM), as the router resolved them from flag, `RILL_*` variable or default.
    pub fn launcher_view(&self) -> String {
        serde_json::json!({
            "addr": self.addr.to_string(),
            "shutdown_timeout_s": self.shutdown_timeout.as_secs(),
        })
        .to_string()
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn every_flag_reads_its_rill_variable() {
        for arg in Args::command().get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            // --check-args is a dry run: from the environment it would stop every start.
            if ["help", "version", "check-args"].contains(&long) {
                continue;
            }
            let expected = format!("RILL_{}", long.to_uppercase().replace('-', "_"));
            assert_eq!(
                arg.get_env().and_then(|env| env.to_str()),
                Some(expected.as_str()),
                "--{long}"
            );
        }
    }

    #[test]
    fn limits_fit_the_models_positions() {
        let parse = |flags: &[&str]| {
            let base = ["rill-router", "--model-id", "m", "--shard-socket", "s"];
            Config::from_args(Args::try_parse_from(base.iter().chain(flags)).unwrap())
                .unwrap()
                .limits
        };
        let mut limits = parse(&["--max-input-tokens", "64", "--max-total-tokens", "1024"]);
        assert!(limits.fit_to_model(512).is_some());
        assert_eq!((limits.max_input_tokens, limits.max_total_tokens), (64, 512));
        let mut limits = parse(&[]); // 4095 / 4096
        assert!(limits.fit_to_model(2048).is_some());
        assert_eq!((limits.max_input_tokens, limits.max_total_tokens), (2047, 2048));
        let mut limits = parse(&[]);
        assert_eq!(limits.fit_to_model(8192), None);
        assert_eq!(limits.fit_to_model(0), None); // unknown
        assert_eq!((limits.max_input_tokens, limits.max_total_tokens), (4095, 4096));
    }

    #[test]
    fn lora_adapters_are_a_list_of_distinct_names() {
        let parse = |flags: &[&str]| {
            let base = ["rill-router", "--model-id", "/m/base", "--shard-socket", "s"];
            Args::try_parse_from(base.iter().chain(flags))
                .map_err(|e| e.to_string())
                .and_then(|args| Config::from_args(args).map_err(|e| e.to_string()))
                .map(|config| config.lora)
        };
        let lora = parse(&["--lora-adapters", "sql=/a/sql,chat=/a/chat"]).unwrap();
        assert_eq!(
            lora.adapters,
            [
                ("sql".into(), PathBuf::from("/a/sql")),
                ("chat".into(), PathBuf::from("/a/chat"))
            ]
        );
        assert!(lora.is_wanted() && !lora.is_loading_enabled);
        assert!(!parse(&[]).unwrap().is_wanted());
        assert!(parse(&["--enable-lora-loading"]).unwrap().is_wanted());
        assert!(parse(&["--lora-adapters", "sql"])
            .unwrap_err()
            .contains("expected name=path"));
        assert!(parse(&["--lora-adapters", "a=/x,a=/y"]).unwrap_err().contains("twice"));
        assert!(parse(&["--lora-adapters", "base=/x"])
            .unwrap_err()
            .contains("base model"));
    }

    #[test]
    fn a_draft_shard_goes_with_draft_speculation_only() {
        let parse = |flags: &[&str]| {
            let base = ["rill-router", "--model-id", "m", "--shard-socket", "s"];
            Config::from_args(Args::try_parse_from(base.iter().chain(flags)).unwrap()).map_err(|e| e.to_string())
        };
        let config = parse(&["--speculative", "draft", "--draft-shard-socket", "d"]).unwrap();
        assert_eq!(config.draft_shard_socket, Some(PathBuf::from("d")));
        assert!(config.batch.speculative.is_some());
        assert!(parse(&["--speculative", "draft"])
            .unwrap_err()
            .contains("--draft-shard-socket PATH"));
        assert!(parse(&["--draft-shard-socket", "d"])
            .unwrap_err()
            .contains("needs --speculative draft"));
        assert!(parse(&["--speculative", "ngram", "--draft-shard-socket", "d"])
            .unwrap_err()
            .contains("needs --speculative draft"));
        assert_eq!(parse(&["--speculative", "ngram"]).unwrap().draft_shard_socket, None);
    }

    #[test]
    fn a_switch_turns_off_with_false() {
        let parse = |flags: &[&str]| {
            let base = ["rill-router", "--model-id", "m", "--shard-socket", "s"];
            Args::try_parse_from(base.iter().chain(flags)).map(|args| args.json_logs)
        };
        assert!(!parse(&[]).unwrap());
        assert!(parse(&["--json-logs"]).unwrap());
        assert!(parse(&["--json-logs=true", "--port", "1"]).unwrap());
        assert!(!parse(&["--json-logs=false"]).unwrap());
        assert!(!parse(&["--json-logs", "off"]).unwrap());
        assert!(parse(&["--json-logs=maybe"]).is_err());
    }

    #[test]
    fn a_switch_set_in_the_environment_turns_off_on_the_command_line() {
        // No other test reads RILL_LOG_PROMPTS.
        std::env::set_var("RILL_LOG_PROMPTS", "1");
        let parse = |flags: &[&str]| {
            let base = ["rill-router", "--model-id", "m", "--shard-socket", "s"];
            Args::try_parse_from(base.iter().chain(flags)).map(|args| args.log_prompts)
        };
        let (from_env, turned_off) = (parse(&[]), parse(&["--log-prompts=false"]));
        std::env::remove_var("RILL_LOG_PROMPTS");
        assert!(from_env.unwrap());
        assert!(!turned_off.unwrap());
    }
}
