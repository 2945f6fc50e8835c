//! Request and response bodies of the HTTP APIs. Plain serde types: no validation here.
//! This file holds the native (TGI-compatible) API; `openai` the OpenAI-compatible one, `anthropic`
//! Anthropic's Messages API.

pub mod anthropic;
pub mod openai;
pub mod responses;

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// `POST /generate` and `POST /generate_stream`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GenerateRequest {
    /// The prompt text.
    #[schema(example = "The three primary colors are")]
    pub inputs: String,
    #[serde(default)]
    pub parameters: GenerateParameters,
    /// On `POST /`, whether to stream; `/generate` and `/generate_stream` decide by themselves.
    #[serde(default)]
    pub stream: bool,
}

/// Generation settings; every field is optional. TGI fields Rill does not implement (`best_of` > 1,
/// `watermark`, `decoder_input_details`) are accepted only at their off value.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GenerateParameters {
    /// Most tokens to generate. Default: what `--max-total-tokens` leaves after the prompt.
    pub max_new_tokens: Option<u32>,
    /// Sample instead of taking the most likely token. Implied by temperature, top_k or top_p.
    #[serde(default)]
    pub do_sample: bool,
    /// Logits are divided by it before sampling; > 0.
    pub temperature: Option<f32>,
    /// Sample from the k most likely tokens only; > 0.
    pub top_k: Option<u32>,
    /// Sample from the smallest set of tokens whose probability reaches top_p; in (0, 1].
    pub top_p: Option<f32>,
    /// Seed of the sampler; the same seed gives the same output whatever else is in the batch.
    pub seed: Option<u64>,
    /// Generation stops before the first occurrence of any of these strings.
    #[serde(default)]
    pub stop: Vec<String>,
    /// Return `details` (finish reason, token counts, seed, per-token logprobs).
    #[serde(default)]
    pub details: bool,
    /// HF-style penalty on every token already in the prompt or output; > 0, 1.0 = off.
    pub repetition_penalty: Option<f32>,
    /// OpenAI-style penalty per earlier occurrence in the output; in [-2, 2].
    pub frequency_penalty: Option<f32>,
    /// Typical-decoding mass; in (0, 1], 1.0 = off.
    pub typical_p: Option<f32>,
    /// Return this many most likely alternatives for each generated token (in `details.top_tokens`).
    pub top_n_tokens: Option<u32>,
    /// Keep only the last `truncate` tokens of the prompt.
    pub truncate: Option<u32>,
    /// Prepend the prompt to `generated_text`.
    #[serde(default)]
    pub return_full_text: bool,
    /// Scheduling priority: lower runs first, first come first served within a level. Default 0.
    #[serde(default)]
    pub priority: i32,
    /// Prefix-cache isolation: requests with different salts never share cached KV blocks.
    pub cache_salt: Option<String>,
    /// Seconds the request may take from arrival to its last token; past it, 504 (or an SSE `error`
    /// event). In [0.001, 1000000]; `--request-timeout`, when set, is the most it can be.
    #[schema(minimum = 0.001, maximum = 1000000.0)]
    pub timeout: Option<f64>,
    /// Not implemented: accepted when null or 1.
    pub best_of: Option<u32>,
    /// Not implemented: accepted when false.
    #[serde(default)]
    pub watermark: bool,
    /// Not implemented: accepted when false.
    #[serde(default)]
    pub decoder_input_details: bool,
    /// Constrained decoding: `{"type": "json", "value": <JSON Schema>}`, `{"type": "regex", "value": "..."}`
    /// or `{"type": "json_schema", "value": {"name": ..., "schema": <JSON Schema>}}`.
    #[schema(value_type = Option<Object>)]
    pub grammar: Option<serde_json::Value>,
    /// A LoRA adapter's name (as in `--lora-adapters` or `/v1/load_lora_adapter`); null or the served
    /// model's name: the base model. An unknown name gets 404.
    pub adapter_id: Option<String>,
}

/// A generated token, as streamed.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Token {
    pub id: u32,
    /// Text this token released to the client. Empty while a multi-byte character is incomplete or while
    /// the text might be the start of a stop sequence; the held text comes with a later token.
    pub text: String,
    /// Natural log of the token's probability.
    pub logprob: f32,
    /// Whether the token is a special token (end of sequence, ...).
    pub special: bool,
}

/// One of the most likely tokens at a generated position.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TopToken {
    pub id: u32,
    pub text: String,
    pub logprob: f32,
    pub special: bool,
}

/// Why generation ended: the engine's own reason, shown as is.
pub use crate::engine::FinishReason;

/// Details of a finished generation (`POST /generate` with `details`).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Details {
    pub finish_reason: FinishReason,
    pub generated_tokens: u32,
    /// The seed used, when sampling.
    pub seed: Option<u64>,
    pub input_length: u32,
    /// Prompt tokens whose K/V came from the prefix cache instead of being computed.
    pub cached_tokens: u32,
    pub tokens: Vec<Token>,
    /// Per generated token, the `top_n_tokens` most likely alternatives.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub top_tokens: Vec<Vec<TopToken>>,
}

/// `POST /generate` response.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct GenerateResponse {
    pub generated_text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<Details>,
}

/// Details on the last event of a stream.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct StreamDetails {
    pub finish_reason: FinishReason,
    pub generated_tokens: u32,
    pub seed: Option<u64>,
    pub input_length: u32,
    pub cached_tokens: u32,
}

/// One `data:` event of `POST /generate_stream`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct StreamResponse {
    /// 0-based position of the token among the generated ones.
    pub index: u32,
    pub token: Token,
    /// The `top_n_tokens` most likely alternatives at this position.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub top_tokens: Vec<TopToken>,
    /// The whole generated text, on the last event only.
    pub generated_text: Option<String>,
    /// On the last event only.
    pub details: Option<StreamDetails>,
}

/// `GET /info`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Info {
    pub model_id: String,
    /// The name `/v1/models` lists and OpenAI requests must name.
    pub served_model_name: String,
    pub model_type: String,
    /// The model class the shard runs for `model_type` (for example `Gemma3ForCausalLM`).
    pub model_architecture: String,
    /// Which layers attend through a sliding window.
    pub attention: AttentionInfo,
    pub model_dtype: String,
    pub model_device_type: String,
    pub num_shard: u32,
    pub max_input_tokens: u32,
    pub max_total_tokens: u32,
    pub max_batch_tokens: u32,
    pub max_batch_size: u32,
    pub max_concurrent_requests: u32,
    pub max_stop_sequences: u32,
    pub kv: KvInfo,
    pub memory: MemoryInfo,
    /// The `/v1/responses` store: its bounds and what it holds now.
    pub responses_store: ResponsesStoreInfo,
    pub lora: LoraInfo,
    pub version: &'static str,
}

/// LoRA adapters: the shards' slots and the adapters requests may name.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LoraInfo {
    /// The most distinct adapters one forward pass may use (the shards' `--max-loras`); 0 = LoRA off.
    pub max_loras: u32,
    /// The largest adapter rank the shards accept.
    pub max_lora_rank: u32,
    /// Whether adapters may be loaded and unloaded at run time (`--enable-lora-loading`).
    pub runtime_loading: bool,
    /// The adapters requests may name, in load order.
    pub adapters: Vec<LoraAdapterInfo>,
}

/// One LoRA adapter.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LoraAdapterInfo {
    /// What requests give in `model` (or `adapter_id`).
    pub name: String,
    /// The id the shards know it by.
    pub id: u32,
    /// The PEFT folder it was loaded from.
    pub path: String,
    pub rank: u32,
    /// The modules it modifies (for example `q_proj`).
    pub target_modules: Vec<String>,
}

/// The `/v1/responses` store (`--responses-store-*`).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ResponsesStoreInfo {
    pub max_entries: usize,
    pub max_bytes: usize,
    /// Seconds a response is kept after it was stored.
    pub ttl_secs: u64,
    /// Responses kept now.
    pub num_entries: usize,
    /// Their size in bytes, roughly.
    pub num_bytes: usize,
}

/// The model's attention layout, as the shard reports it in Info.
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct AttentionInfo {
    /// Decoder layers.
    pub num_layers: u32,
    /// Layers that attend through a sliding window.
    pub num_sliding_window_layers: u32,
    /// Per layer, in layer order: its sliding window in tokens; 0 = it attends to the whole context.
    pub sliding_windows: Vec<u32>,
}

impl AttentionInfo {
    pub fn from_windows(sliding_windows: &[u32]) -> Self {
        Self {
            num_layers: sliding_windows.len() as u32,
            num_sliding_window_layers: sliding_windows.iter().filter(|window| **window > 0).count() as u32,
            sliding_windows: sliding_windows.to_vec(),
        }
    }
}

/// The pools' sizes per shard as the shards chose them at warmup, and why.
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct MemoryInfo {
    /// Bytes of the KV pool on one shard, null block included.
    pub kv_pool_bytes: u64,
    /// Why it has that size: `--max-batch-total-tokens`, or the memory figures it was taken from
    /// (free device memory; the smaller of MemAvailable and the cgroup's room on the CPU).
    pub kv_pool_reason: String,
    /// Bytes of the host swap pool on one shard; 0 without one.
    pub swap_pool_bytes: u64,
    /// Why it has that size: `--swap-space`, or the share of host memory it was taken from.
    pub swap_pool_reason: String,
}

/// `GET /v1/loads`: the engine's load in the schema of SGLang's `/v1/loads`, which smg (SGLang's model
/// gateway) reads to balance load across replicas (its `WorkerLoadResponse`). Rill is one scheduler per
/// replica whatever the tensor-parallel size, so there is one rank.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LoadsResponse {
    /// When the engine state was read, RFC 3339 in UTC.
    pub timestamp: String,
    /// Data-parallel ranks: always 1.
    pub dp_rank_count: u32,
    /// One entry, the replica's engine.
    pub loads: Vec<RankLoad>,
}

/// One scheduler's load, as of the engine's latest step (the `core` section of SGLang's answer; the
/// others, `include=disagg,queues,memory`, are not reported and smg reads them as absent).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct RankLoad {
    /// Always 0.
    pub dp_rank: u32,
    /// Sequences admitted and holding KV blocks (each of a request's `n` choices counts).
    pub num_running_reqs: u32,
    /// Requests waiting for admission, and sequences preempted into the swap pool waiting to resume.
    pub num_waiting_reqs: u32,
    /// Running + waiting.
    pub num_total_reqs: u32,
    /// Tokens' worth of KV blocks the sequences hold (blocks × block size; idle cached blocks excluded).
    pub num_used_tokens: u64,
    /// Tokens' worth of the usable KV blocks.
    pub max_total_num_tokens: u64,
    /// `num_used_tokens / max_total_num_tokens`, 0 to 1: `rill_kv_cache_usage_ratio`.
    pub token_usage: f64,
    /// Prompt tokens found in the prefix cache / prompt tokens looked up, since the server started.
    pub cache_hit_rate: f64,
    /// The most sequences one step runs (`--max-batch-size`).
    pub max_running_requests: u32,
}

/// The KV pool, as the router's allocator sees it now.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct KvInfo {
    /// Tokens per block.
    pub block_size: u32,
    /// Blocks a sequence can use (the pool minus the null block); total = free + cached + used.
    pub total_blocks: u32,
    /// Blocks on the free list.
    pub free_blocks: u32,
    /// Blocks only the prefix cache holds: they serve prefix hits and are evicted when blocks run short
    /// (pinned ones last, see `pins`).
    pub cached_blocks: u32,
    /// Blocks held by sequences (some of them may also be in the prefix cache).
    pub used_blocks: u32,
    /// All blocks in the prefix cache, held by sequences or not.
    pub prefix_cache_blocks: u32,
    pub waiting_requests: u32,
    pub running_requests: u32,
    /// Prompt tokens computed by the shards since start (prefix-cache hits and shared prompts excluded).
    pub prompt_tokens_computed: u64,
    /// The sliding window (tokens) after which running sequences release their blocks: the model's when
    /// every layer is windowed, else 0 (every block is kept while its sequence runs).
    pub kv_window: u32,
    /// Blocks running sequences released since start because the window had left them (they went to the
    /// prefix cache, or were freed).
    pub window_released_blocks: u64,
    /// Session pins (`prompt_cache_key`): finished requests' cached prefixes kept from eviction.
    pub pins: PinInfo,
    /// With `--speculative draft`: the draft model's own pool, blocks a sequence can use and those free
    /// (all of them once the server is idle); 0 otherwise.
    pub draft_total_blocks: u32,
    pub draft_free_blocks: u32,
}

/// Session pins as the engine last published them, and their bounds.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PinInfo {
    /// Pins in force.
    pub pins: u32,
    /// Cached blocks they keep (counted in `cached_blocks` unless a sequence holds them).
    pub pinned_blocks: u32,
    /// The most blocks pins may keep (`--max-pinned-kv-fraction` of the pool; 0: pins are off).
    pub max_pinned_blocks: u32,
    /// A pin's TTL when the request gives none (`--cache-pin-ttl`), in seconds.
    pub default_ttl_s: u64,
    /// The longest TTL a pin gets (`--max-cache-pin-ttl`), in seconds.
    pub max_ttl_s: u64,
}

/// Error body of the native API.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ErrorResponse {
    pub error: String,
    pub error_type: String,
}

/// `POST /tokenize`: a plain prompt, or chat messages rendered with the model's chat template.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenizeRequest {
    /// Plain text (TGI calls it `inputs`; both names are accepted).
    #[serde(alias = "inputs")]
    pub prompt: Option<String>,
    /// Chat messages, rendered with the model's chat template first.
    pub messages: Option<Vec<openai::ChatMessage>>,
    /// With `messages`: end the rendered prompt with the assistant's turn opening. Default true.
    pub add_generation_prompt: Option<bool>,
    /// With `messages`: the tools offered, rendered as a chat request's `tools` are.
    pub tools: Option<Vec<openai::Tool>>,
    /// With `prompt`: add the tokenizer's special tokens (BOS, ...). Default true.
    pub add_special_tokens: Option<bool>,
}

/// One token of a tokenized prompt.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TokenSpan {
    pub id: u32,
    /// The prompt text this token covers.
    pub text: String,
    /// Byte offsets of `text` in the prompt.
    pub start: usize,
    pub stop: usize,
}

/// `POST /tokenize` response.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TokenizeResponse {
    /// The text that was tokenized (the rendered chat prompt when `messages` were given).
    pub prompt: String,
    pub tokens: Vec<TokenSpan>,
    pub count: usize,
    pub max_input_tokens: u32,
}

/// `POST /detokenize`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeRequest {
    pub tokens: Vec<u32>,
    /// Default true.
    pub skip_special_tokens: Option<bool>,
}

/// `POST /detokenize` response.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

/// Token id to bias, as JSON object keys are strings in OpenAI's API.
pub type LogitBias = HashMap<String, f32>;
