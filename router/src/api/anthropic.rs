//! Request and response bodies of Anthropic's Messages API (`/v1/messages`,
//! `/v1/messages/count_tokens`), as the `anthropic` SDKs and Claude Code send and read them.
//! Content blocks stay JSON here: `http::messages` reads each one, so an error names the block
//! (`messages[1].content[0]`) rather than the whole content.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::openai::UnknownFields;

/// `POST /v1/messages` and, without `max_tokens`, `POST /v1/messages/count_tokens`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct MessagesRequest {
    /// Must be the served model name.
    pub model: String,
    /// Most tokens to generate, thinking included; required on `/v1/messages`.
    pub max_tokens: Option<u32>,
    /// The system prompt: a string or a list of text blocks.
    #[schema(value_type = Option<Object>)]
    pub system: Option<Content>,
    pub messages: Vec<InputMessage>,
    /// Generation ends when one of these is produced (`stop_reason: "stop_sequence"`).
    pub stop_sequences: Option<Vec<String>>,
    /// Default 1; 0 is greedy decoding.
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    /// `user_id` for Anthropic's abuse monitoring; accepted and ignored.
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Value>,
    /// Client tools (`name`, `description`, `input_schema`); server tools are refused.
    pub tools: Option<Vec<ToolDefinition>>,
    pub tool_choice: Option<ToolChoice>,
    pub thinking: Option<ThinkingConfig>,
    pub output_config: Option<OutputConfig>,
    /// A cache breakpoint at the end of the prompt.
    pub cache_control: Option<CacheControl>,
    /// Every field not named above: ignored, with a warning in the log and
    /// `rill_ignored_request_fields_total{field}` counted.
    #[serde(flatten)]
    #[schema(ignore)]
    pub unknown: UnknownFields,
}

/// One turn of the conversation.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct InputMessage {
    pub role: Role,
    /// A string or a list of content blocks.
    #[schema(value_type = Object)]
    pub content: Content,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    User,
    Assistant,
}

/// Text, or content blocks (each read into an `InputBlock` with its position in errors).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Blocks(Vec<Value>),
}

/// A content block of a request.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum InputBlock {
    Text {
        text: String,
        cache_control: Option<CacheControl>,
    },
    /// Refused: the served models read text only.
    Image,
    /// Refused, as images.
    Document,
    /// A call the assistant made.
    ToolUse {
        id: String,
        name: String,
        input: Value,
        cache_control: Option<CacheControl>,
    },
    /// The user's answer to a call: a string or text blocks.
    ToolResult {
        tool_use_id: String,
        content: Option<Content>,
        cache_control: Option<CacheControl>,
    },
    /// The assistant's earlier thinking: shown to templates that render reasoning.
    Thinking { thinking: String },
    /// Encrypted thinking from Anthropic's models, which no other model can read: dropped.
    RedactedThinking,
}

/// A cache breakpoint: Anthropic caches the prompt's prefix up to the block that carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, ToSchema)]
pub struct CacheControl {
    /// Only "ephemeral".
    #[serde(rename = "type")]
    pub kind: CacheControlKind,
    /// How long the prefix should stay cached; default 5 minutes.
    #[serde(default)]
    pub ttl: CacheTtl,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CacheControlKind {
    Ephemeral,
}

/// Anthropic's two cache lifetimes; ordered, so the longest of a request's breakpoints is its `max`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Deserialize, ToSchema)]
pub enum CacheTtl {
    #[default]
    #[serde(rename = "5m")]
    FiveMinutes,
    #[serde(rename = "1h")]
    OneHour,
}

impl CacheTtl {
    pub fn duration(self) -> std::time::Duration {
        match self {
            CacheTtl::FiveMinutes => std::time::Duration::from_secs(5 * 60),
            CacheTtl::OneHour => std::time::Duration::from_secs(60 * 60),
        }
    }
}

/// A tool of the request: a client tool (no `type`, or "custom"), or a server tool of another `type`
/// (refused: Rill runs no tools itself).
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ToolDefinition {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub name: String,
    pub description: Option<String>,
    /// The JSON Schema of the tool's `input`; required for client tools.
    #[schema(value_type = Option<Object>)]
    pub input_schema: Option<Value>,
    pub cache_control: Option<CacheControl>,
}

/// What the model must do with the tools.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToolChoice {
    /// Call tools or answer, as it likes (the default).
    Auto {
        #[serde(default)]
        disable_parallel_tool_use: bool,
    },
    /// Call at least one tool (grammar-enforced).
    Any {
        #[serde(default)]
        disable_parallel_tool_use: bool,
    },
    /// Call this tool (grammar-enforced).
    Tool {
        name: String,
        #[serde(default)]
        disable_parallel_tool_use: bool,
    },
    /// Offer no tools: the template does not see them.
    None,
}

/// Extended thinking: handed to the chat template as `enable_thinking`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ThinkingConfig {
    /// `budget_tokens` is accepted; the thinking counts against `max_tokens`, as at Anthropic.
    Enabled {
        budget_tokens: u32,
    },
    Adaptive,
    BetweenTools,
    Disabled,
}

/// How the answer should be written.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct OutputConfig {
    /// "low" ... "max": handed to the chat template as `reasoning_effort`, for the templates that use it.
    pub effort: Option<String>,
    /// Structured output: the answer is JSON that validates against the schema (grammar-enforced).
    pub format: Option<OutputFormat>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputFormat {
    JsonSchema {
        #[schema(value_type = Object)]
        schema: Value,
    },
}

/// A `/v1/messages` response, and the `message` of a stream's `message_start`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Message {
    /// `msg_` and 24 hex digits.
    pub id: String,
    /// "message".
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// "assistant".
    pub role: &'static str,
    pub content: Vec<ContentBlock>,
    pub model: String,
    /// Null in `message_start`.
    pub stop_reason: Option<StopReason>,
    /// The stop string that ended the answer, with `stop_reason: "stop_sequence"`.
    pub stop_sequence: Option<String>,
    pub usage: MessageUsage,
}

/// A content block of a response.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentBlock {
    Text {
        text: String,
    },
    /// The model's thinking (`--reasoning-parser`). `signature` is empty: Rill does not sign
    /// thinking, and ignores the thinking of earlier turns' signatures.
    Thinking {
        thinking: String,
        signature: String,
    },
    ToolUse {
        /// `toolu_` and 24 hex digits.
        id: String,
        name: String,
        #[schema(value_type = Object)]
        input: Value,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model ended its turn.
    EndTurn,
    /// `max_tokens` reached.
    MaxTokens,
    /// One of `stop_sequences` was produced.
    StopSequence,
    /// The model ended its turn after calling tools.
    ToolUse,
}

/// Token counts. The prompt's tokens are `input_tokens + cache_read_input_tokens +
/// cache_creation_input_tokens`, as at Anthropic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct MessageUsage {
    /// Prompt tokens computed for this request (not read from the prefix cache).
    pub input_tokens: u32,
    pub output_tokens: u32,
    /// Always 0: Rill caches every prompt's blocks as it computes them, at no extra cost.
    pub cache_creation_input_tokens: u32,
    /// Prompt tokens whose KV was reused from the prefix cache.
    pub cache_read_input_tokens: u32,
}

/// One server-sent event of a `/v1/messages` stream; its SSE `event:` name is its `type`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamEvent {
    /// The message with no content yet, no stop reason, and the prompt's size as usage.
    MessageStart {
        message: Message,
    },
    ContentBlockStart {
        index: u32,
        content_block: ContentBlock,
    },
    Ping,
    ContentBlockDelta {
        index: u32,
        delta: BlockDelta,
    },
    ContentBlockStop {
        index: u32,
    },
    MessageDelta {
        delta: MessageDelta,
        usage: MessageUsage,
    },
    MessageStop,
}

impl StreamEvent {
    /// The SSE `event:` name.
    pub fn name(&self) -> &'static str {
        match self {
            StreamEvent::MessageStart { .. } => "message_start",
            StreamEvent::ContentBlockStart { .. } => "content_block_start",
            StreamEvent::Ping => "ping",
            StreamEvent::ContentBlockDelta { .. } => "content_block_delta",
            StreamEvent::ContentBlockStop { .. } => "content_block_stop",
            StreamEvent::MessageDelta { .. } => "message_delta",
            StreamEvent::MessageStop => "message_stop",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BlockDelta {
    TextDelta { text: String },
    InputJsonDelta { partial_json: String },
    ThinkingDelta { thinking: String },
    SignatureDelta { signature: String },
}

/// `message_delta`'s top-level changes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MessageDelta {
    pub stop_reason: StopReason,
    pub stop_sequence: Option<String>,
}

/// `POST /v1/messages/count_tokens` response.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TokenCount {
    /// The prompt's tokens: the usage's `input_tokens + cache_read_input_tokens` of the same request.
    pub input_tokens: u32,
}
