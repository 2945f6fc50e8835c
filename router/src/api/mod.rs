//! Request and response bodies of the native (TGI-compatible) API. Plain serde types: no validation here.

use serde::{Deserialize, Serialize};

/// `POST /generate` and `POST /generate_stream`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateRequest {
    /// The prompt text.
    pub inputs: String,
    #[serde(default)]
    pub parameters: GenerateParameters,
}

/// Generation settings; every field is optional.
#[derive(Debug, Clone, Default, Deserialize)]
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
}

/// A generated token, as streamed.
#[derive(Debug, Clone, Serialize)]
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

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_new_tokens` reached.
    Length,
    /// The model produced an end-of-sequence token.
    EosToken,
    /// A stop sequence matched.
    StopSequence,
}

/// Details of a finished generation (`POST /generate` with `details`).
#[derive(Debug, Clone, Serialize)]
pub struct Details {
    pub finish_reason: FinishReason,
    pub generated_tokens: u32,
    /// The seed used, when sampling.
    pub seed: Option<u64>,
    pub input_length: u32,
    pub tokens: Vec<Token>,
}

/// `POST /generate` response.
#[derive(Debug, Clone, Serialize)]
pub struct GenerateResponse {
    pub generated_text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<Details>,
}

/// Details on the last event of a stream.
#[derive(Debug, Clone, Serialize)]
pub struct StreamDetails {
    pub finish_reason: FinishReason,
    pub generated_tokens: u32,
    pub seed: Option<u64>,
    pub input_length: u32,
}

/// One `data:` event of `POST /generate_stream`.
#[derive(Debug, Clone, Serialize)]
pub struct StreamResponse {
    /// 0-based position of the token among the generated ones.
    pub index: u32,
    pub token: Token,
    /// The whole generated text, on the last event only.
    pub generated_text: Option<String>,
    /// On the last event only.
    pub details: Option<StreamDetails>,
}

/// `GET /info`.
#[derive(Debug, Clone, Serialize)]
pub struct Info {
    pub model_id: String,
    pub model_type: String,
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
    pub version: &'static str,
}

/// The KV pool, as the router's allocator sees it now.
#[derive(Debug, Clone, Serialize)]
pub struct KvInfo {
    /// Tokens per block.
    pub block_size: u32,
    /// Blocks a sequence can use (the pool minus the null block).
    pub total_blocks: u32,
    pub free_blocks: u32,
    pub used_blocks: u32,
    pub waiting_requests: u32,
    pub running_requests: u32,
}

/// Error body of the native API.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorResponse {
    pub error: String,
    pub error_type: &'static str,
}
