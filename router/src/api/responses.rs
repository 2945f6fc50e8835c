//! Request and response bodies of OpenAI's Responses API (`/v1/responses`), in the shapes of the
//! official `openai` SDK's `types/responses`. Input items arrive as JSON values and are read one by one
//! (`InputItem`), so an error can name the item; everything the server sends is typed here.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::openai::UnknownFields;

/// `POST /v1/responses`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CreateResponseRequest {
    pub model: Option<String>,
    /// A user message's text, or a list of items (`message`, `function_call`, `function_call_output`,
    /// `reasoning`).
    #[schema(value_type = Object)]
    pub input: ResponseInput,
    /// A system message put before the conversation. Not carried over from `previous_response_id`.
    pub instructions: Option<String>,
    /// Function tools (`{"type": "function", "name", "description", "parameters", "strict"}`).
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<Value>>,
    /// "none", "auto" (default), "required" or `{"type": "function", "name": ...}`.
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// Whether a `required` or named choice may make several calls in one turn. Default true.
    pub parallel_tool_calls: Option<bool>,
    pub max_output_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Keep the response for retrieval and `previous_response_id` (default true), in a bounded store.
    pub store: Option<bool>,
    pub stream: Option<bool>,
    /// Continue the stored token history of this response.
    pub previous_response_id: Option<String>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", ...}}`.
    pub text: Option<TextConfig>,
    /// `{"effort": ...}`: handed to the chat template as `reasoning_effort`.
    pub reasoning: Option<ReasoningConfig>,
    /// Up to 16 string pairs, echoed back.
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<serde_json::Map<String, Value>>,
    /// Recorded for the caller's bookkeeping only (echoed back).
    pub user: Option<String>,
    /// OpenAI's cache-routing hint (echoed back).
    pub prompt_cache_key: Option<String>,
    /// "disabled" (default: a prompt over the limit is a 422) or "auto" (drop the oldest tokens).
    pub truncation: Option<String>,
    /// Extra output to include; none is supported (an empty list is accepted).
    pub include: Option<Vec<String>>,
    /// OpenAI fields accepted only at their default value.
    #[serde(flatten)]
    pub inert: ResponsesInertFields,
    /// Every field not named above: ignored, with a warning in the log and
    /// `rill_ignored_request_fields_total{field}` counted.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: UnknownFields,
}

/// OpenAI Responses fields Rill does not act on, accepted only at the value that means "nothing special".
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct ResponsesInertFields {
    /// Run in the background: accepted when false.
    pub background: Option<bool>,
    /// Server-side conversations: accepted when null.
    #[schema(value_type = Option<Object>)]
    pub conversation: Option<Value>,
    /// Stored prompt templates: accepted when null.
    #[schema(value_type = Option<Object>)]
    pub prompt: Option<Value>,
    /// Accepted when null, "auto" or "default".
    pub service_tier: Option<String>,
    /// Logprobs of output tokens: accepted when null or 0.
    pub top_logprobs: Option<u32>,
    /// Identifies the end user to OpenAI's abuse monitoring; recorded nowhere. Always accepted.
    pub safety_identifier: Option<String>,
    /// Most built-in tool calls: no built-in tools here. Always accepted.
    pub max_tool_calls: Option<u32>,
    /// Stream options (obfuscation): always accepted, nothing is obfuscated.
    #[schema(value_type = Option<Object>)]
    pub stream_options: Option<Value>,
}

/// `input`: text (one user message) or items.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(untagged)]
pub enum ResponseInput {
    Text(String),
    Items(Vec<Value>),
}

/// One input item, read from `input[i]` (a message may leave out `"type": "message"`).
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum InputItem {
    Message {
        /// "user", "system", "developer" or "assistant".
        role: String,
        content: InputContent,
    },
    /// A call the model made in an earlier turn.
    FunctionCall {
        call_id: String,
        name: String,
        arguments: String,
    },
    /// The result of a call.
    FunctionCallOutput { call_id: String, output: InputContent },
    /// The model's thinking in an earlier turn.
    Reasoning {
        #[serde(default)]
        content: Option<Vec<ContentPart>>,
    },
}

/// A message's content: text, or parts of which only text parts are supported.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(untagged)]
pub enum InputContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One content part; only text kinds (`input_text`, `output_text`, `reasoning_text`) carry text here.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// A function tool in the Responses shape.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct FunctionTool {
    /// "function".
    #[serde(rename = "type")]
    pub kind: String,
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[schema(value_type = Option<Object>)]
    pub parameters: Option<Value>,
    pub strict: Option<bool>,
}

/// `text`: the shape of the answer.
#[derive(Debug, Clone, Default, Deserialize, Serialize, ToSchema)]
pub struct TextConfig {
    pub format: Option<TextFormat>,
    /// Answer length hint of OpenAI's models; accepted when null or "medium".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verbosity: Option<String>,
}

/// `text.format`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TextFormat {
    Text,
    JsonObject,
    /// JSON that validates against `schema` (always enforced, whatever `strict` says).
    JsonSchema {
        name: String,
        #[schema(value_type = Option<Object>)]
        schema: Option<Value>,
        #[serde(skip_serializing_if = "Option::is_none")]
        description: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        strict: Option<bool>,
    },
}

/// `reasoning`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, ToSchema)]
pub struct ReasoningConfig {
    pub effort: Option<String>,
    /// Summaries are not generated; echoed back.
    pub summary: Option<String>,
}

/// The response object: `POST /v1/responses` (non-streaming), `GET /v1/responses/{id}`, and inside the
/// stream's `response.*` lifecycle events.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ResponseObject {
    /// `resp_` and 24 hex digits.
    pub id: String,
    /// "response".
    pub object: &'static str,
    /// Unix time, in seconds.
    pub created_at: u64,
    /// "in_progress", "completed", "incomplete" or "failed".
    pub status: &'static str,
    pub error: Option<ResponseErrorInfo>,
    pub incomplete_details: Option<IncompleteDetails>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u32>,
    pub model: String,
    pub output: Vec<OutputItem>,
    pub parallel_tool_calls: bool,
    pub previous_response_id: Option<String>,
    pub reasoning: ReasoningConfig,
    pub store: bool,
    pub temperature: f32,
    pub text: TextConfig,
    #[schema(value_type = Object)]
    pub tool_choice: Value,
    pub tools: Vec<FunctionTool>,
    pub top_p: f32,
    pub truncation: String,
    pub usage: Option<ResponseUsage>,
    pub user: Option<String>,
    #[schema(value_type = Object)]
    pub metadata: serde_json::Map<String, Value>,
    pub prompt_cache_key: Option<String>,
    pub background: bool,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ResponseErrorInfo {
    /// "server_error".
    pub code: &'static str,
    pub message: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct IncompleteDetails {
    /// "max_output_tokens".
    pub reason: &'static str,
}

/// An output item.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    /// The answer's text.
    Message {
        /// `msg_` and 24 hex digits.
        id: String,
        /// "assistant".
        role: &'static str,
        /// "in_progress", "completed" or "incomplete".
        status: &'static str,
        content: Vec<OutputContent>,
    },
    /// A tool call.
    FunctionCall {
        /// `fc_` and 24 hex digits.
        id: String,
        /// `call_` and 24 hex digits: what the `function_call_output` names.
        call_id: String,
        name: String,
        /// The arguments, a JSON text.
        arguments: String,
        status: &'static str,
    },
    /// The thinking a `--reasoning-parser` separated from the answer.
    Reasoning {
        /// `rs_` and 24 hex digits.
        id: String,
        /// Always empty: no summaries are generated.
        summary: Vec<Value>,
        content: Vec<OutputContent>,
        status: &'static str,
    },
}

/// A content part of an output item.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputContent {
    OutputText {
        text: String,
        /// Always empty.
        annotations: Vec<Value>,
    },
    ReasoningText {
        text: String,
    },
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ResponseUsage {
    pub input_tokens: u32,
    pub input_tokens_details: InputTokensDetails,
    pub output_tokens: u32,
    pub output_tokens_details: OutputTokensDetails,
    pub total_tokens: u32,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct InputTokensDetails {
    /// Input tokens whose K/V were reused from the prefix cache.
    pub cached_tokens: u32,
    /// Always 0: caching needs no write.
    pub cache_write_tokens: u32,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct OutputTokensDetails {
    /// Output tokens of the thinking (with `--reasoning-parser`).
    pub reasoning_tokens: u32,
}

/// One event of a streamed response; `sequence_number` counts from 0 over the stream.
#[derive(Debug, Clone, Serialize)]
pub struct StreamEvent {
    pub sequence_number: u32,
    #[serde(flatten)]
    pub kind: StreamEventKind,
}

/// What happened, as OpenAI names it (`type`).
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type")]
pub enum StreamEventKind {
    #[serde(rename = "response.created")]
    Created { response: Box<ResponseObject> },
    #[serde(rename = "response.in_progress")]
    InProgress { response: Box<ResponseObject> },
    #[serde(rename = "response.completed")]
    Completed { response: Box<ResponseObject> },
    #[serde(rename = "response.incomplete")]
    Incomplete { response: Box<ResponseObject> },
    #[serde(rename = "response.failed")]
    Failed { response: Box<ResponseObject> },
    /// The response failed; `response.failed` follows.
    #[serde(rename = "error")]
    Error {
        code: Option<String>,
        message: String,
        param: Option<String>,
    },
    #[serde(rename = "response.output_item.added")]
    OutputItemAdded { output_index: u32, item: OutputItem },
    #[serde(rename = "response.output_item.done")]
    OutputItemDone { output_index: u32, item: OutputItem },
    #[serde(rename = "response.content_part.added")]
    ContentPartAdded {
        item_id: String,
        output_index: u32,
        content_index: u32,
        part: OutputContent,
    },
    #[serde(rename = "response.content_part.done")]
    ContentPartDone {
        item_id: String,
        output_index: u32,
        content_index: u32,
        part: OutputContent,
    },
    #[serde(rename = "response.output_text.delta")]
    OutputTextDelta {
        item_id: String,
        output_index: u32,
        content_index: u32,
        delta: String,
        /// Always empty.
        logprobs: Vec<Value>,
    },
    #[serde(rename = "response.output_text.done")]
    OutputTextDone {
        item_id: String,
        output_index: u32,
        content_index: u32,
        text: String,
        /// Always empty.
        logprobs: Vec<Value>,
    },
    #[serde(rename = "response.reasoning_text.delta")]
    ReasoningTextDelta {
        item_id: String,
        output_index: u32,
        content_index: u32,
        delta: String,
    },
    #[serde(rename = "response.reasoning_text.done")]
    ReasoningTextDone {
        item_id: String,
        output_index: u32,
        content_index: u32,
        text: String,
    },
    #[serde(rename = "response.function_call_arguments.delta")]
    FunctionCallArgumentsDelta {
        item_id: String,
        output_index: u32,
        delta: String,
    },
    #[serde(rename = "response.function_call_arguments.done")]
    FunctionCallArgumentsDone {
        item_id: String,
        output_index: u32,
        name: String,
        arguments: String,
    },
}

impl StreamEventKind {
    /// The event's `type`, also sent as the SSE `event:` name.
    pub fn name(&self) -> &'static str {
        match self {
            StreamEventKind::Created { .. } => "response.created",
            StreamEventKind::InProgress { .. } => "response.in_progress",
            StreamEventKind::Completed { .. } => "response.completed",
            StreamEventKind::Incomplete { .. } => "response.incomplete",
            StreamEventKind::Failed { .. } => "response.failed",
            StreamEventKind::Error { .. } => "error",
            StreamEventKind::OutputItemAdded { .. } => "response.output_item.added",
            StreamEventKind::OutputItemDone { .. } => "response.output_item.done",
            StreamEventKind::ContentPartAdded { .. } => "response.content_part.added",
            StreamEventKind::ContentPartDone { .. } => "response.content_part.done",
            StreamEventKind::OutputTextDelta { .. } => "response.output_text.delta",
            StreamEventKind::OutputTextDone { .. } => "response.output_text.done",
            StreamEventKind::ReasoningTextDelta { .. } => "response.reasoning_text.delta",
            StreamEventKind::ReasoningTextDone { .. } => "response.reasoning_text.done",
            StreamEventKind::FunctionCallArgumentsDelta { .. } => "response.function_call_arguments.delta",
            StreamEventKind::FunctionCallArgumentsDone { .. } => "response.function_call_arguments.done",
        }
    }
}

/// `GET /v1/responses/{id}/input_items`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct InputItemList {
    /// "list".
    pub object: &'static str,
    #[schema(value_type = Vec<Object>)]
    pub data: Vec<Value>,
    pub first_id: Option<String>,
    pub last_id: Option<String>,
    pub has_more: bool,
}

/// `DELETE /v1/responses/{id}`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct DeletedResponse {
    pub id: String,
    /// "response".
    pub object: &'static str,
    pub deleted: bool,
}
