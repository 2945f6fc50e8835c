//! Request and response bodies of the OpenAI-compatible API (`/v1/completions`, `/v1/chat/completions`,
//! `/v1/models`), with the sampling extensions vLLM users expect. OpenAI fields Rill does not act on are
//! listed in `InertFields` (accepted at their default value only); any other unknown field is collected
//! in `unknown`, ignored, logged and counted.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::LogitBias;

/// A string or a list of strings (`stop`).
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum StringOrList {
    One(String),
    Many(Vec<String>),
}

impl StringOrList {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StringOrList::One(s) => vec![s],
            StringOrList::Many(v) => v,
        }
    }
}

/// `prompt` of a completion: text, texts, token ids, or lists of token ids.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum CompletionPrompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, Copy, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` and no choices.
    #[serde(default, deserialize_with = "null_as_false")]
    pub include_usage: bool,
    /// vLLM extension: also put the running `usage` on every chunk.
    #[serde(default, deserialize_with = "null_as_false")]
    pub continuous_usage_stats: bool,
}

/// `null` reads as `false`, as OpenAI's clients send it.
fn null_as_false<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(deserializer)?.unwrap_or(false))
}

/// OpenAI fields Rill accepts but does not act on. Each is accepted at its default (absent, `null`,
/// `false`, or the value that means "nothing special"); any other value is a 422 naming the field.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct InertFields {
    /// OpenAI stores completions for its dashboard when true; Rill stores nothing. Accepted when false.
    pub store: Option<bool>,
    /// Tags for stored completions. Accepted when null or empty.
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
    /// Accepted when null, "auto" or "default".
    pub service_tier: Option<String>,
    /// Output modalities. Accepted when null or `["text"]`.
    pub modalities: Option<Vec<String>>,
    /// Audio output. Accepted when null.
    #[schema(value_type = Option<Object>)]
    pub audio: Option<serde_json::Value>,
    /// Predicted output. Accepted when null.
    #[schema(value_type = Option<Object>)]
    pub prediction: Option<serde_json::Value>,
    /// Web search. Accepted when null.
    #[schema(value_type = Option<Object>)]
    pub web_search_options: Option<serde_json::Value>,
    /// Deprecated predecessor of `tools`. Accepted when null or empty.
    #[schema(value_type = Option<Vec<Object>>)]
    pub functions: Option<Vec<serde_json::Value>>,
    /// Deprecated predecessor of `tool_choice`. Accepted when null or "none".
    #[schema(value_type = Option<Object>)]
    pub function_call: Option<serde_json::Value>,
    /// Answer length hint of OpenAI's reasoning models. Accepted when null or "medium".
    pub verbosity: Option<String>,
    /// Legacy completions: text after the completion. Accepted when null or empty.
    pub suffix: Option<String>,
    /// Legacy completions: candidates per choice. Accepted when null or 1.
    pub best_of: Option<u32>,
    /// Identifies the end user to OpenAI's abuse monitoring; recorded nowhere. Always accepted.
    pub safety_identifier: Option<String>,
}

/// Sampling fields shared by both endpoints. (No `flatten` inside: a nested flattened struct would see
/// every field of the request, and the request's `unknown` would then hold them all.)
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Choices per prompt; they share the prompt's KV blocks.
    pub n: Option<u32>,
    pub stop: Option<StringOrList>,
    pub seed: Option<u64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Token id (as a string) to a bias in [-100, 100] added to its logit.
    #[schema(value_type = Option<Object>)]
    pub logit_bias: Option<LogitBias>,
    /// Recorded for the caller's bookkeeping only.
    pub user: Option<String>,
    /// vLLM extension: sample among the k most likely tokens; -1 or 0 = off.
    pub top_k: Option<i64>,
    /// vLLM extension: drop tokens below min_p times the top token's probability.
    pub min_p: Option<f32>,
    /// vLLM extension: HF-style repetition penalty.
    pub repetition_penalty: Option<f32>,
    /// vLLM extension: no end-of-sequence or stop token before this many tokens.
    pub min_tokens: Option<u32>,
    /// vLLM extension: keep generating after an end-of-sequence token.
    #[serde(default)]
    pub ignore_eos: bool,
    /// vLLM extension: token ids that end generation like EOS.
    pub stop_token_ids: Option<Vec<u32>>,
    /// vLLM extension: drop special tokens from the text. Default true.
    pub skip_special_tokens: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// vLLM extension: scheduling priority, lower runs first. Default 0.
    pub priority: Option<i32>,
    /// vLLM extension: prefix-cache isolation; requests with different salts never share cached blocks.
    pub cache_salt: Option<String>,
    /// A session key (at most 1024 bytes): when the request finishes, the KV of its prompt and output stays
    /// pinned in the prefix cache under this key (and `cache_salt`) for `--cache-pin-ttl` seconds, so the
    /// session's next turn hits it even after other traffic. The next request with the key replaces the pin.
    pub prompt_cache_key: Option<String>,
    /// Seconds the request may take from arrival to its last token (the OpenAI clients' `timeout`, sent
    /// as a body field); past it, 504 (or an SSE `error` event). In [0.001, 1000000]; `--request-timeout`,
    /// when set, is the most it can be.
    #[schema(minimum = 0.001, maximum = 1000000.0)]
    pub timeout: Option<f64>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CompletionRequest {
    /// Must be the served model name when given.
    pub model: Option<String>,
    pub prompt: CompletionPrompt,
    pub max_tokens: Option<u32>,
    /// Return the logprobs of this many most likely tokens per position (0..=20) and the chosen one's.
    pub logprobs: Option<u32>,
    /// Put the prompt in front of the completion text.
    #[serde(default)]
    pub echo: bool,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(flatten)]
    pub inert: InertFields,
    #[serde(flatten)]
    pub guided: GuidedFields,
    /// Every field not named above: ignored, with a warning in the log and
    /// `rill_ignored_request_fields_total{field}` counted.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: UnknownFields,
}

/// Fields a request carried that this API does not know (`serde(flatten)` collects them last).
pub type UnknownFields = std::collections::BTreeMap<String, serde_json::Value>;

/// Content of a chat message: text, or a list of parts of which only text parts are supported.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ContentPart {
    /// Only "text" is supported.
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// One turn of a conversation.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    /// "system", "user", "assistant" (or any role the model's template knows).
    pub role: String,
    /// May be null on an assistant turn that made tool calls.
    pub content: Option<MessageContent>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Assistant turns: the tool calls it made.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// Tool turns: the id of the call this is the result of.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Assistant turns: the reasoning that came with it (for templates that show it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

/// A tool call: in an assistant turn of the history, and in a reply.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct ToolCall {
    /// `call_` and 24 hex digits in replies.
    pub id: String,
    /// "function".
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    pub function: FunctionCall,
}

fn function_kind() -> String {
    "function".into()
}

/// The function a call names, and its arguments as a JSON text.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: String,
}

/// A piece of a tool call in a stream chunk, as the model writes it: the first of a call carries its
/// `id`, `type` and `function.name`; each piece's `function.arguments` appends to the call's.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ToolCallDelta {
    /// Position of the call among the choice's calls.
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// "function".
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionCallDelta,
}

/// A piece of a call's function: its name (first piece only) and more of its arguments' JSON text.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct FunctionCallDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatCompletionRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    /// Deprecated by OpenAI in favour of `max_completion_tokens`; either is accepted.
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    /// Return the chosen token's logprob.
    #[serde(default)]
    pub logprobs: bool,
    /// With `logprobs`: this many most likely alternatives per position (0..=20).
    pub top_logprobs: Option<u32>,
    /// vLLM extension: end the prompt with the assistant's turn opening. Default true.
    pub add_generation_prompt: Option<bool>,
    /// vLLM extension: extra variables for the model's chat template (e.g. `{"enable_thinking": false}`).
    #[schema(value_type = Option<Object>)]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// Effort hint of reasoning models ("low", "medium", "high", ...): handed to the chat template as
    /// `reasoning_effort`, for the templates that use it.
    pub reasoning_effort: Option<String>,
    /// Function tools the model may call; they reach the model's chat template as `tools`.
    pub tools: Option<Vec<Tool>>,
    /// "auto" (default with tools: the model decides), "none" (no tools offered), "required" (at least
    /// one call), or `{"type": "function", "function": {"name": ...}}` (a call of that function);
    /// `required` and named choices are enforced with a grammar.
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<serde_json::Value>,
    /// Whether a `required` or named choice may make several calls in one turn. Default true.
    pub parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(flatten)]
    pub inert: InertFields,
    #[serde(flatten)]
    pub guided: GuidedFields,
    /// Every field not named above: ignored, with a warning in the log and
    /// `rill_ignored_request_fields_total{field}` counted.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: UnknownFields,
}

/// Constrained decoding: the output follows a grammar. At most one of these may be given.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct GuidedFields {
    /// The shape of the answer: `{"type": "text"}` (default), `{"type": "json_object"}`, or
    /// `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`.
    pub response_format: Option<ResponseFormat>,
    /// vLLM extension: JSON that validates against this JSON Schema (an object or a JSON string).
    #[schema(value_type = Option<Object>)]
    pub guided_json: Option<serde_json::Value>,
    /// vLLM extension: text that matches this regular expression.
    pub guided_regex: Option<String>,
    /// vLLM extension: text in the language of this Lark grammar (llguidance's dialect).
    pub guided_grammar: Option<String>,
    /// vLLM extension: exactly one of these strings.
    pub guided_choice: Option<Vec<String>>,
    /// vLLM extension: one of `json`, `regex`, `choice`, `grammar`, `json_object`.
    pub structured_outputs: Option<StructuredOutputs>,
}

/// vLLM's `structured_outputs`: exactly one key set.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StructuredOutputs {
    #[schema(value_type = Option<Object>)]
    pub json: Option<serde_json::Value>,
    pub regex: Option<String>,
    pub choice: Option<Vec<String>>,
    pub grammar: Option<String>,
    #[serde(default)]
    pub json_object: bool,
}

/// A tool the model may call.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct Tool {
    /// Only "function".
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDefinition,
}

/// A function tool: its name, what it does, and its arguments' JSON Schema.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct FunctionDefinition {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[schema(value_type = Option<Object>)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// `response_format`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    /// Free text (the default).
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON that validates against `json_schema.schema`.
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct JsonSchemaFormat {
    pub name: String,
    pub description: Option<String>,
    /// The JSON Schema; absent means any JSON value.
    #[schema(value_type = Option<Object>)]
    pub schema: Option<serde_json::Value>,
    /// OpenAI's strict mode. Rill always enforces the schema, so both values behave the same.
    pub strict: Option<bool>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose K/V were reused from the prefix cache (or a sibling choice).
    pub cached_tokens: u32,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// Legacy completions logprobs.
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    #[schema(value_type = Vec<Object>)]
    pub top_logprobs: Vec<Option<serde_json::Map<String, serde_json::Value>>>,
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    /// "stop" or "length"; null on stream chunks before the last.
    pub finish_reason: Option<&'static str>,
}

/// `POST /v1/completions` response, and each chunk of its stream.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CompletionResponse {
    pub id: String,
    /// "text_completion".
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AssistantMessage {
    /// "assistant".
    pub role: &'static str,
    /// The answer; null when it is only tool calls.
    pub content: Option<String>,
    /// With `--reasoning-parser`: the model's thinking, apart from the answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    /// "stop", "length", or "tool_calls" (the answer ended after making tool calls).
    pub finish_reason: &'static str,
}

/// `POST /v1/chat/completions` response.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletionResponse {
    pub id: String,
    /// "chat.completion".
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// One chunk of a `/v1/chat/completions` stream.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletionChunk {
    pub id: String,
    /// "chat.completion.chunk".
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Model {
    pub id: String,
    /// "model".
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// Most tokens of one request, prompt plus generated.
    pub max_model_len: u32,
    /// Where it was loaded from: the model folder, or a LoRA adapter's folder.
    pub root: String,
    /// A LoRA adapter's base model (the served model's name); null for the base model.
    pub parent: Option<String>,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelList {
    /// "list".
    pub object: &'static str,
    pub data: Vec<Model>,
}

/// OpenAI's error body.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[schema(as = OpenAiErrorBody)]
pub struct ErrorBody {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
#[schema(as = OpenAiErrorResponse)]
pub struct ErrorResponse {
    pub error: ErrorBody,
}

/// `POST /v1/load_lora_adapter` (vLLM's request).
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct LoadLoraAdapterRequest {
    /// The name requests will give in `model` (or TGI's `adapter_id`).
    pub lora_name: String,
    /// A PEFT LoRA folder (`adapter_config.json`, `adapter_model.safetensors`) on the shards' machine.
    pub lora_path: String,
}

/// `POST /v1/unload_lora_adapter` (vLLM's request).
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct UnloadLoraAdapterRequest {
    pub lora_name: String,
}

/// The answer of `/v1/completions/render` (one per prompt) and `/v1/chat/completions/render`: the request
/// as Rill would run it, in the shape of vLLM's `GenerateRequest` (its render endpoints' answer), so a
/// gateway or prefix-cache indexer reads the exact prompt token ids Rill prefills.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct RenderedRequest {
    /// A fresh id, `cmpl-…` or `chatcmpl-…`.
    pub request_id: String,
    /// The prompt's token ids (chat template applied, special tokens as the real request adds them).
    pub token_ids: Vec<u32>,
    /// Multimodal features: always null (Rill serves text).
    pub features: Option<serde_json::Value>,
    pub sampling_params: RenderedSampling,
    /// The model that would answer: the served model, or the LoRA adapter the request names.
    pub model: String,
    pub stream: bool,
    /// The request's `cache_salt`, if any.
    pub cache_salt: Option<String>,
    pub priority: i32,
}

/// The sampling parameters after validation and defaults, under vLLM's `SamplingParams` names.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct RenderedSampling {
    /// Choices of the prompt.
    pub n: u32,
    pub max_tokens: u32,
    pub min_tokens: u32,
    /// 0: greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0: no limit.
    pub top_k: u32,
    pub min_p: f32,
    /// The request's seed; null: drawn by the server.
    pub seed: Option<u64>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub skip_special_tokens: bool,
    /// Top log-probabilities returned per token; null: none.
    pub logprobs: Option<u32>,
}
