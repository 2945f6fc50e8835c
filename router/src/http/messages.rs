//! Anthropic's Messages API, `/v1/messages` and `/v1/messages/count_tokens`, on the chat machinery:
//! the request becomes a chat conversation (system → a system turn, `tool_use` blocks → an assistant's
//! `tool_calls`, `tool_result` blocks → `tool` turns), rendered with the model's chat template and its
//! tools (`tool_choice` `any` and `tool` grammar-enforced, as chat's `required` and named choices), and
//! the answer read back by chat's `AnswerReader` into `thinking`, `text` and `tool_use` blocks. One
//! `MessageBuilder` shapes both the stream's events and the whole message, so they always agree.

use std::convert::Infallible;

use axum::{
    extract::{rejection::JsonRejection, State},
    response::{
        sse::{Event, KeepAlive, Sse},
        IntoResponse, Response,
    },
    Extension, Json,
};
use serde_json::Value;
use tokio::sync::OwnedSemaphorePermit;

use super::{
    acquire,
    chat::{output_grammar, AnswerReader},
    collect, compat,
    error::AnthropicError,
    openai::{check_model, uuid_like},
    submit,
    tools::{OfferedTools, ToolChoice},
    ApiError, AppState, Finished, RequestTag,
};
use crate::{
    api::{
        anthropic::{
            BlockDelta, CacheControl, CacheTtl, Content, ContentBlock, InputBlock, Message, MessageDelta, MessageUsage,
            MessagesRequest, OutputFormat, Role, StopReason, StreamEvent, ThinkingConfig, TokenCount,
            ToolChoice as AnthropicChoice,
        },
        openai::{ChatMessage, FunctionCall, FunctionDefinition, MessageContent, Tool, ToolCall},
        FinishReason,
    },
    engine::{EndEvent, EngineError, EventReceiver},
    grammar::GrammarSpec,
    text::tool_calls,
    validation::{GenerateInput, Prompt, ValidationError},
};

/// What separates the text blocks of one turn once they are one text.
const BLOCK_SEPARATOR: &str = "\n";

/// A request's conversation in chat form, and what else it asks for.
#[derive(Debug)]
struct Conversation {
    messages: Vec<ChatMessage>,
    tools: Option<OfferedTools>,
    /// The longest TTL of the request's cache breakpoints (`cache_control`), if it has any.
    cache_ttl: Option<CacheTtl>,
}

/// Collects the request's cache breakpoints as the conversion meets them.
#[derive(Debug, Default)]
struct CacheBreakpoints(Option<CacheTtl>);

impl CacheBreakpoints {
    fn note(&mut self, cache_control: Option<CacheControl>) {
        if let Some(cache_control) = cache_control {
            self.0 = self.0.max(Some(cache_control.ttl));
        }
    }
}

fn text_message(role: &str, text: String) -> ChatMessage {
    ChatMessage {
        role: role.into(),
        content: Some(MessageContent::Text(text)),
        name: None,
        tool_calls: None,
        tool_call_id: None,
        reasoning_content: None,
    }
}

fn join(text: &mut String, more: &str) {
    if !text.is_empty() {
        text.push_str(BLOCK_SEPARATOR);
    }
    text.push_str(more);
}

/// `content`'s blocks, each read at `path[i]` (a string is one text block).
fn read_blocks(content: &Content, path: &str) -> Result<Vec<InputBlock>, ApiError> {
    match content {
        Content::Text(text) => Ok(vec![InputBlock::Text {
            text: text.clone(),
            cache_control: None,
        }]),
        Content::Blocks(blocks) => blocks
            .iter()
            .enumerate()
            .map(|(i, block)| {
                serde_json::from_value(block.clone())
                    .map_err(|e| ApiError::Unprocessable(format!("`{path}[{i}]`: {e}")))
            })
            .collect(),
    }
}

/// A block this API accepts but no served model can read, or one that does not belong where it is.
fn refuse(path: String, block: &InputBlock) -> ApiError {
    let message = match block {
        InputBlock::Image => format!("`{path}` is an `image` block: Rill serves text-only models"),
        InputBlock::Document => format!("`{path}` is a `document` block: Rill serves text-only models"),
        _ => format!("`{path}`: this kind of block is not allowed in this place (`tool_use` and `thinking` belong to assistant turns, `tool_result` to user turns)"),
    };
    ApiError::Unsupported { message, param: path }
}

/// Text blocks only (the system prompt, a tool result), joined.
fn read_text(content: &Content, path: &str, cache: &mut CacheBreakpoints) -> Result<String, ApiError> {
    let mut text = String::new();
    for (i, block) in read_blocks(content, path)?.into_iter().enumerate() {
        match block {
            InputBlock::Text {
                text: more,
                cache_control,
            } => {
                cache.note(cache_control);
                join(&mut text, &more);
            }
            other => return Err(refuse(format!("{path}[{i}]"), &other)),
        }
    }
    Ok(text)
}

/// A user turn: its text, and a `tool` turn for each `tool_result`, in their order.
fn user_turn(
    blocks: Vec<InputBlock>,
    path: &str,
    cache: &mut CacheBreakpoints,
    messages: &mut Vec<ChatMessage>,
) -> Result<(), ApiError> {
    let mut text = String::new();
    let mut num_results = 0;
    for (i, block) in blocks.into_iter().enumerate() {
        match block {
            InputBlock::Text {
                text: more,
                cache_control,
            } => {
                cache.note(cache_control);
                join(&mut text, &more);
            }
            InputBlock::ToolResult {
                tool_use_id,
                content,
                cache_control,
            } => {
                cache.note(cache_control);
                if !text.is_empty() {
                    messages.push(text_message("user", std::mem::take(&mut text)));
                }
                let result = match &content {
                    Some(content) => read_text(content, &format!("{path}[{i}].content"), cache)?,
                    None => String::new(),
                };
                let mut message = text_message("tool", result);
                message.tool_call_id = Some(tool_use_id);
                messages.push(message);
                num_results += 1;
            }
            other => return Err(refuse(format!("{path}[{i}]"), &other)),
        }
    }
    if !text.is_empty() || num_results == 0 {
        messages.push(text_message("user", text));
    }
    Ok(())
}

/// An assistant turn: its text, its calls as `tool_calls`, its thinking as `reasoning_content`
/// (for templates that show it; redacted thinking is dropped).
fn assistant_turn(blocks: Vec<InputBlock>, path: &str, cache: &mut CacheBreakpoints) -> Result<ChatMessage, ApiError> {
    let (mut text, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
    for (i, block) in blocks.into_iter().enumerate() {
        match block {
            InputBlock::Text {
                text: more,
                cache_control,
            } => {
                cache.note(cache_control);
                join(&mut text, &more);
            }
            InputBlock::ToolUse {
                id,
                name,
                input,
                cache_control,
            } => {
                cache.note(cache_control);
                calls.push(ToolCall {
                    id,
                    kind: "function".into(),
                    function: FunctionCall {
                        name,
                        arguments: input.to_string(),
                    },
                });
            }
            InputBlock::Thinking { thinking } => join(&mut reasoning, &thinking),
            InputBlock::RedactedThinking => {}
            other => return Err(refuse(format!("{path}[{i}]"), &other)),
        }
    }
    let has_text = !text.is_empty();
    let mut message = text_message("assistant", text);
    if !calls.is_empty() {
        if !has_text {
            message.content = None;
        }
        message.tool_calls = Some(calls);
    }
    message.reasoning_content = (!reasoning.is_empty()).then_some(reasoning);
    Ok(message)
}

fn invalid_tools(param: &str, message: String) -> ApiError {
    ApiError::InvalidTools {
        message,
        param: param.into(),
    }
}

/// The request's tools as chat offers them: `None` without tools or with `tool_choice: none`; a 400
/// naming the field for a server tool, a name given twice, a missing `input_schema`, or a choice of a
/// tool not given.
fn offered_tools(request: &MessagesRequest, cache: &mut CacheBreakpoints) -> Result<Option<OfferedTools>, ApiError> {
    let definitions = request.tools.as_deref().unwrap_or_default();
    let (choice, disable_parallel) = match &request.tool_choice {
        None => (ToolChoice::Auto, false),
        Some(AnthropicChoice::None) => return Ok(None),
        Some(AnthropicChoice::Auto {
            disable_parallel_tool_use,
        }) => (ToolChoice::Auto, *disable_parallel_tool_use),
        Some(AnthropicChoice::Any {
            disable_parallel_tool_use,
        }) => (ToolChoice::Required, *disable_parallel_tool_use),
        Some(AnthropicChoice::Tool {
            name,
            disable_parallel_tool_use,
        }) => (ToolChoice::Named(name.clone()), *disable_parallel_tool_use),
    };
    if definitions.is_empty() {
        return match choice {
            ToolChoice::Auto => Ok(None),
            _ => Err(invalid_tools(
                "tool_choice",
                "`tool_choice` asks for a tool call, but `tools` is empty".into(),
            )),
        };
    }
    let mut tools = Vec::with_capacity(definitions.len());
    for (i, definition) in definitions.iter().enumerate() {
        if let Some(kind) = definition.kind.as_deref().filter(|&kind| kind != "custom") {
            return Err(invalid_tools(
                "tools",
                format!("`tools[{i}]` is a server tool of type {kind:?}: Rill runs no tools itself; give client tools (`name`, `description`, `input_schema`)"),
            ));
        }
        let name = &definition.name;
        if name.is_empty() || definitions[..i].iter().any(|earlier| earlier.name == *name) {
            return Err(invalid_tools(
                "tools",
                format!("`tools[{i}].name` {name:?} is empty or not unique"),
            ));
        }
        let Some(schema) = definition.input_schema.clone().filter(Value::is_object) else {
            return Err(invalid_tools(
                "tools",
                format!("`tools[{i}].input_schema` must be a JSON Schema object"),
            ));
        };
        cache.note(definition.cache_control);
        tools.push(Tool {
            kind: "function".into(),
            function: FunctionDefinition {
                name: name.clone(),
                description: definition.description.clone(),
                parameters: Some(schema),
                strict: None,
            },
        });
    }
    if let ToolChoice::Named(name) = &choice {
        if !tools.iter().any(|tool| tool.function.name == *name) {
            return Err(invalid_tools(
                "tool_choice",
                format!("`tool_choice` names the tool {name:?}, which is not among `tools`"),
            ));
        }
    }
    Ok(Some(OfferedTools {
        tools,
        choice,
        is_parallel: !disable_parallel,
    }))
}

/// The request as a chat conversation.
fn convert(request: &MessagesRequest) -> Result<Conversation, ApiError> {
    if request.messages.is_empty() {
        return Err(ValidationError::EmptyInput("messages").into());
    }
    let mut cache = CacheBreakpoints::default();
    cache.note(request.cache_control);
    let tools = offered_tools(request, &mut cache)?;
    let mut messages = Vec::with_capacity(request.messages.len() + 1);
    if let Some(system) = &request.system {
        messages.push(text_message("system", read_text(system, "system", &mut cache)?));
    }
    for (i, message) in request.messages.iter().enumerate() {
        let path = format!("messages[{i}].content");
        let blocks = read_blocks(&message.content, &path)?;
        match message.role {
            Role::User => user_turn(blocks, &path, &mut cache, &mut messages)?,
            Role::Assistant => messages.push(assistant_turn(blocks, &path, &mut cache)?),
        }
    }
    if request.messages.last().is_some_and(|last| last.role == Role::Assistant) {
        return Err(ApiError::Unsupported {
            message: "the last of `messages` is an assistant turn (a prefill to continue), which is not supported; end with a user turn".into(),
            param: "messages".into(),
        });
    }
    Ok(Conversation {
        messages,
        tools,
        cache_ttl: cache.0,
    })
}

/// A request's prompt, rendered with the chat template, and its tools.
struct Rendered {
    prompt: String,
    tools: Option<OfferedTools>,
    cache_ttl: Option<CacheTtl>,
}

fn render(state: &AppState, tag: &RequestTag, request: &MessagesRequest) -> Result<Rendered, ApiError> {
    check_model(state, &Some(request.model.clone()))?;
    compat::ignore_unknown(&state.engine.metrics, tag, &request.unknown);
    let conversation = convert(request)?;
    let mut variables = serde_json::Map::new();
    if let Some(tools) = &conversation.tools {
        variables.insert("tools".into(), tools.template_value());
    }
    if let Some(thinking) = request.thinking {
        variables.insert("enable_thinking".into(), (thinking != ThinkingConfig::Disabled).into());
    }
    if let Some(effort) = request.output_config.as_ref().and_then(|config| config.effort.clone()) {
        variables.insert("reasoning_effort".into(), effort.into());
    }
    Ok(Rendered {
        prompt: state.render_chat(&conversation.messages, true, &variables)?,
        tools: conversation.tools,
        cache_ttl: conversation.cache_ttl,
    })
}

/// Anthropic's Messages API, streaming or not.
#[utoipa::path(post, path = "/v1/messages", tag = "anthropic", request_body = MessagesRequest,
    responses((status = 200, body = Message), (status = 400), (status = 401), (status = 404), (status = 413),
              (status = 429), (status = 500), (status = 503), (status = 504)))]
pub async fn messages(
    State(state): State<AppState>,
    Extension(tag): Extension<RequestTag>,
    body: Result<Json<MessagesRequest>, JsonRejection>,
) -> Result<Response, AnthropicError> {
    let Json(request) = body?;
    let max_tokens = request
        .max_tokens
        .ok_or_else(|| ApiError::BadRequest("`max_tokens` is required".into()))?;
    let rendered = render(&state, &tag, &request)?;
    // Prompt cache pins (#35 item 4) take the request's `cache_control` from here: the rendered
    // prompt is the prefix to keep, `rendered.cache_ttl` (its breakpoints' longest TTL) how long.
    tracing::debug!(request_id = %tag.id, cache_ttl = ?rendered.cache_ttl, "cache_control");
    let format = request.output_config.as_ref().and_then(|config| config.format.as_ref());
    let guided =
        format.map(|OutputFormat::JsonSchema { schema }| (GrammarSpec::JsonSchema(schema.clone()), "output_config"));
    let grammar = output_grammar(&state, guided, rendered.tools.as_ref(), &rendered.prompt).await?;
    let tool_call_format = rendered.tools.as_ref().map(|_| state.tool_call_format);
    let reader = AnswerReader::new(state.reasoning_format, tool_call_format, &rendered.prompt);
    // The template already holds the special tokens (BOS, role markers): add none when tokenizing.
    let prompt = Prompt::Text {
        text: rendered.prompt,
        add_special_tokens: false,
    };
    let mut input = GenerateInput::new(prompt, "messages", "max_tokens");
    input.max_new_tokens = Some(max_tokens);
    // Anthropic samples at temperature 1 by default; 0 asks for greedy decoding.
    input.do_sample = true;
    input.temperature = request.temperature;
    input.top_p = request.top_p;
    input.top_k = request.top_k;
    input.stop = request.stop_sequences.clone().unwrap_or_default();
    input.grammar = grammar;
    let permit = acquire(&state, 1)?;
    let (valid, receivers) = submit(&state, &tag, input, 1).await?;
    let receiver = receivers.into_iter().next().expect("one choice was submitted");
    let builder = MessageBuilder::new(
        format!("msg_{}", uuid_like()),
        state.served_model_name.clone(),
        reader,
        valid.prompt_ids.len() as u32,
    );
    if request.stream {
        return Ok(stream(builder, receiver, permit));
    }
    let _permit = permit;
    Ok(Json(builder.build(collect(receiver).await?)).into_response())
}

/// The prompt's tokens for a Messages request (its `max_tokens` is not needed): what the answer's
/// usage would count as `input_tokens + cache_read_input_tokens`.
#[utoipa::path(post, path = "/v1/messages/count_tokens", tag = "anthropic", request_body = MessagesRequest,
    responses((status = 200, body = TokenCount), (status = 400), (status = 401), (status = 404), (status = 413)))]
pub async fn count_tokens(
    State(state): State<AppState>,
    Extension(tag): Extension<RequestTag>,
    body: Result<Json<MessagesRequest>, JsonRejection>,
) -> Result<Json<TokenCount>, AnthropicError> {
    let Json(request) = body?;
    let rendered = render(&state, &tag, &request)?;
    let encoding = state.validator.tokenize(rendered.prompt, false).await?;
    Ok(Json(TokenCount {
        input_tokens: encoding.len() as u32,
    }))
}

fn sse(event: &StreamEvent) -> Result<Event, Infallible> {
    Ok(Event::default()
        .event(event.name())
        .json_data(event)
        .expect("events serialize"))
}

/// Streams the answer's events; an engine error ends the stream with an `error` event.
fn stream(mut builder: MessageBuilder, mut receiver: EventReceiver, permit: OwnedSemaphorePermit) -> Response {
    let events = async_stream::stream! {
        let _permit = permit;
        yield sse(&builder.start());
        while let Some(event) = receiver.recv().await {
            match event {
                Ok(event) => {
                    for shaped in builder.push(&event.text, event.end.as_ref()) {
                        yield sse(&shaped);
                    }
                    if event.end.is_some() {
                        return;
                    }
                }
                Err(error) => {
                    yield sse_error(error);
                    return;
                }
            }
        }
        yield sse_error(EngineError::Closed);
    };
    let ping = sse(&StreamEvent::Ping).expect("infallible");
    Sse::new(events)
        .keep_alive(KeepAlive::new().event(ping))
        .into_response()
}

fn sse_error(error: EngineError) -> Result<Event, Infallible> {
    let (_, body) = ApiError::from(error).anthropic_body();
    Ok(Event::default()
        .event("error")
        .json_data(body)
        .expect("errors serialize"))
}

/// The kinds of block the answer's text is read into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TextKind {
    Thinking,
    Text,
}

/// Shapes one answer into content blocks, as stream events (`push`) and as the whole message
/// (`build`). Blocks open in the order the text arrives: thinking, then text and tool calls; a block
/// of only whitespace is never opened (the whitespace is held until something else follows it).
struct MessageBuilder {
    reader: AnswerReader,
    /// The message so far: blocks are appended to as the text arrives.
    message: Message,
    /// Whether the last block of `message.content` is still open.
    is_open: bool,
    /// Whitespace that would open a block of this kind, held back.
    held: Option<(TextKind, String)>,
    /// Whether the stream's one `ping` was sent (after the first `content_block_start`, as Anthropic's API).
    has_pinged: bool,
}

impl MessageBuilder {
    fn new(id: String, model: String, reader: AnswerReader, num_prompt_tokens: u32) -> Self {
        let usage = MessageUsage {
            input_tokens: num_prompt_tokens,
            ..MessageUsage::default()
        };
        Self {
            reader,
            message: Message {
                id,
                kind: "message",
                role: "assistant",
                content: Vec::new(),
                model,
                stop_reason: None,
                stop_sequence: None,
                usage,
            },
            is_open: false,
            held: None,
            has_pinged: false,
        }
    }

    /// The stream's first event. Its usage counts the whole prompt as `input_tokens`: what the prefix
    /// cache served is known only at the end, in `message_delta`'s usage.
    fn start(&self) -> StreamEvent {
        StreamEvent::MessageStart {
            message: self.message.clone(),
        }
    }

    /// The whole message of a finished answer.
    fn build(mut self, finished: Finished) -> Message {
        let num_tokens = finished.tokens.len();
        for (i, token) in finished.tokens.iter().enumerate() {
            self.push(&token.text, (i + 1 == num_tokens).then_some(&finished.end));
        }
        self.message
    }

    /// The events of the next piece of text; with `end`, the last piece, and the message's end.
    fn push(&mut self, text: &str, end: Option<&EndEvent>) -> Vec<StreamEvent> {
        let piece = self.reader.push(text, end.is_some());
        let mut events = Vec::new();
        self.push_text(TextKind::Thinking, &piece.reasoning, &mut events);
        self.push_text(TextKind::Text, &piece.content, &mut events);
        for call in piece.calls {
            self.push_call(call, &mut events);
        }
        if let Some(end) = end {
            self.finish(end, &mut events);
        }
        events
    }

    fn push_text(&mut self, kind: TextKind, text: &str, events: &mut Vec<StreamEvent>) {
        if text.is_empty() {
            return;
        }
        let open_kind = match self.message.content.last() {
            Some(ContentBlock::Text { .. }) if self.is_open => Some(TextKind::Text),
            Some(ContentBlock::Thinking { .. }) if self.is_open => Some(TextKind::Thinking),
            _ => None,
        };
        let mut text = text.to_owned();
        if open_kind != Some(kind) {
            let held = match &mut self.held {
                Some((held_kind, held)) if *held_kind == kind => held,
                held => &mut held.insert((kind, String::new())).1,
            };
            held.push_str(&text);
            if held.trim().is_empty() {
                return;
            }
            text = std::mem::take(held);
            self.held = None;
            self.close(events);
            let block = match kind {
                TextKind::Thinking => ContentBlock::Thinking {
                    thinking: String::new(),
                    signature: String::new(),
                },
                TextKind::Text => ContentBlock::Text { text: String::new() },
            };
            self.open(block, events);
        }
        let index = self.message.content.len() as u32 - 1;
        let delta = match self.message.content.last_mut() {
            Some(ContentBlock::Thinking { thinking, .. }) => {
                thinking.push_str(&text);
                BlockDelta::ThinkingDelta { thinking: text }
            }
            Some(ContentBlock::Text { text: all }) => {
                all.push_str(&text);
                BlockDelta::TextDelta { text }
            }
            _ => unreachable!("a text or thinking block is open"),
        };
        events.push(StreamEvent::ContentBlockDelta { index, delta });
    }

    fn push_call(&mut self, call: tool_calls::ToolCall, events: &mut Vec<StreamEvent>) {
        self.held = None;
        self.close(events);
        let id = format!("toolu_{}", uuid_like());
        let opening = ContentBlock::ToolUse {
            id: id.clone(),
            name: call.name.clone(),
            input: Value::Object(serde_json::Map::new()),
        };
        let index = self.open(opening, events);
        // The parser gives back calls whose arguments are JSON (anything else stays text).
        let input = serde_json::from_str(&call.arguments).unwrap_or(Value::String(call.arguments.clone()));
        *self.message.content.last_mut().expect("just opened") = ContentBlock::ToolUse {
            id,
            name: call.name,
            input,
        };
        events.push(StreamEvent::ContentBlockDelta {
            index,
            delta: BlockDelta::InputJsonDelta {
                partial_json: call.arguments,
            },
        });
        self.close(events);
    }

    /// Opens `block` (empty) as the next block; returns its index.
    fn open(&mut self, block: ContentBlock, events: &mut Vec<StreamEvent>) -> u32 {
        let index = self.message.content.len() as u32;
        events.push(StreamEvent::ContentBlockStart {
            index,
            content_block: block.clone(),
        });
        if !self.has_pinged {
            self.has_pinged = true;
            events.push(StreamEvent::Ping);
        }
        self.message.content.push(block);
        self.is_open = true;
        index
    }

    /// Closes the open block, if any (a thinking block gets its signature first).
    fn close(&mut self, events: &mut Vec<StreamEvent>) {
        if !self.is_open {
            return;
        }
        self.is_open = false;
        let index = self.message.content.len() as u32 - 1;
        if let Some(ContentBlock::Thinking { signature, .. }) = self.message.content.last() {
            events.push(StreamEvent::ContentBlockDelta {
                index,
                delta: BlockDelta::SignatureDelta {
                    signature: signature.clone(),
                },
            });
        }
        events.push(StreamEvent::ContentBlockStop { index });
    }

    fn finish(&mut self, end: &EndEvent, events: &mut Vec<StreamEvent>) {
        self.held = None;
        self.close(events);
        let has_calls = self
            .message
            .content
            .iter()
            .any(|block| matches!(block, ContentBlock::ToolUse { .. }));
        let stop_reason = match end.finish_reason {
            FinishReason::Length => StopReason::MaxTokens,
            FinishReason::StopSequence if end.stop_sequence.is_some() => StopReason::StopSequence,
            _ if has_calls => StopReason::ToolUse,
            _ => StopReason::EndTurn,
        };
        let usage = MessageUsage {
            input_tokens: end.num_prompt_tokens - end.num_cached_tokens,
            output_tokens: end.num_generated_tokens,
            cache_creation_input_tokens: 0,
            cache_read_input_tokens: end.num_cached_tokens,
        };
        self.message.stop_reason = Some(stop_reason);
        self.message.stop_sequence = end.stop_sequence.clone();
        self.message.usage = usage;
        events.push(StreamEvent::MessageDelta {
            delta: MessageDelta {
                stop_reason,
                stop_sequence: end.stop_sequence.clone(),
            },
            usage,
        });
        events.push(StreamEvent::MessageStop);
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::text::{reasoning::ReasoningFormat, tool_calls::ToolCallFormat};

    fn request(body: Value) -> MessagesRequest {
        let mut body = body;
        body["model"] = json!("m");
        serde_json::from_value(body).expect("a valid request")
    }

    fn weather() -> Value {
        json!([{"name": "weather", "description": "The weather in a city.", "cache_control": {"type": "ephemeral"},
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}])
    }

    /// A request's turns, as (role, content, tool call names and arguments, tool_call_id, reasoning).
    type Turn = (
        String,
        Option<String>,
        Vec<(String, String)>,
        Option<String>,
        Option<String>,
    );

    fn turns(conversation: &Conversation) -> Vec<Turn> {
        conversation
            .messages
            .iter()
            .map(|m| {
                let content = m.content.as_ref().map(|c| match c {
                    MessageContent::Text(text) => text.clone(),
                    MessageContent::Parts(_) => panic!("parts"),
                });
                let calls = m.tool_calls.iter().flatten();
                let calls = calls
                    .map(|c| (c.function.name.clone(), c.function.arguments.clone()))
                    .collect();
                (
                    m.role.clone(),
                    content,
                    calls,
                    m.tool_call_id.clone(),
                    m.reasoning_content.clone(),
                )
            })
            .collect()
    }

    fn turn(role: &str, content: Option<&str>) -> Turn {
        (role.into(), content.map(str::to_owned), Vec::new(), None, None)
    }

    #[test]
    fn a_tool_round_trip_becomes_the_chat_conversation() {
        let conversation = convert(&request(json!({
            "system": [{"type": "text", "text": "Be brief."},
                       {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            "tools": weather(),
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "I should call it.", "signature": "abc"},
                    {"type": "redacted_thinking", "data": "xyz"},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21 C"}]},
                    {"type": "text", "text": "And now?"}]},
            ],
        })))
        .expect("converts");
        let mut call = turn("assistant", None);
        call.2 = vec![("weather".into(), r#"{"city":"Paris"}"#.into())];
        call.4 = Some("I should call it.".into());
        let mut result = turn("tool", Some("21 C"));
        result.3 = Some("toolu_1".into());
        assert_eq!(
            turns(&conversation),
            vec![
                turn("system", Some("Be brief.\nUse tools.")),
                turn("user", Some("Weather in Paris?")),
                call,
                result,
                turn("user", Some("And now?")),
            ]
        );
        let tools = conversation.tools.expect("tools");
        assert_eq!(tools.choice, ToolChoice::Required);
        assert!(!tools.is_parallel);
        assert_eq!(
            tools.tools[0].function.parameters,
            weather()[0].get("input_schema").cloned()
        );
        assert_eq!(conversation.cache_ttl, Some(CacheTtl::OneHour));
    }

    #[test]
    fn choices_map_onto_chat_choices() {
        let choice = |tool_choice: Value| {
            let tools = offered_tools(
                &request(json!({"messages": [], "tools": weather(), "tool_choice": tool_choice})),
                &mut CacheBreakpoints::default(),
            );
            tools.expect("valid").map(|tools| (tools.choice, tools.is_parallel))
        };
        assert_eq!(choice(json!({"type": "auto"})), Some((ToolChoice::Auto, true)));
        assert_eq!(
            choice(json!({"type": "tool", "name": "weather"})),
            Some((ToolChoice::Named("weather".into()), true))
        );
        assert_eq!(choice(json!({"type": "none"})), None);
    }

    /// The message of an error, after checking it is a 400 in Anthropic's shape.
    fn error_message(body: Value) -> String {
        let error = convert(&request(body)).expect_err("refused");
        let (status, body) = error.anthropic_body();
        assert_eq!(status, axum::http::StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        body["error"]["message"].as_str().expect("a message").to_owned()
    }

    #[test]
    fn what_cannot_be_served_is_a_400_naming_it() {
        let image = json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}});
        let message =
            error_message(json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]}));
        assert!(
            message.contains("`messages[0].content[1]` is an `image` block"),
            "{message}"
        );
        let document = json!({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document"}]});
        let message = error_message(json!({"messages": [{"role": "user", "content": [document]}]}));
        assert!(
            message.contains("`messages[0].content[0].content[0]` is a"),
            "{message}"
        );
        let message = error_message(json!({"messages": [{"role": "user", "content": [{"type": "video"}]}]}));
        assert!(
            message.contains("`messages[0].content[0]`: unknown variant `video`"),
            "{message}"
        );
        let message = error_message(json!({"messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "web_search_20250305", "name": "web_search"}]}));
        assert!(message.contains("`tools[0]` is a server tool"), "{message}");
        let message = error_message(json!({"messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f"}]}));
        assert!(message.contains("`tools[0].input_schema`"), "{message}");
        let message = error_message(json!({"messages": [{"role": "user", "content": "hi"}],
            "tools": weather(), "tool_choice": {"type": "tool", "name": "nope"}}));
        assert!(message.contains("\"nope\""), "{message}");
        let message =
            error_message(json!({"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "any"}}));
        assert!(message.contains("`tools` is empty"), "{message}");
        let message = error_message(json!({"messages": [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Sure,"}]}));
        assert!(message.contains("prefill"), "{message}");
        let message = error_message(json!({"messages": [{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "t"}]}, {"role": "user", "content": "hi"}]}));
        assert!(message.contains("`messages[0].content[0]`"), "{message}");
    }

    fn end(reason: FinishReason, stop_sequence: Option<&str>) -> EndEvent {
        EndEvent {
            finish_reason: reason,
            generated_text: String::new(),
            num_generated_tokens: 9,
            num_prompt_tokens: 20,
            num_cached_tokens: 16,
            stop_sequence: stop_sequence.map(str::to_owned),
        }
    }

    fn builder() -> MessageBuilder {
        let reader = AnswerReader::new(Some(ReasoningFormat::DeepseekR1), Some(ToolCallFormat::Hermes), "");
        MessageBuilder::new("msg_1".into(), "m".into(), reader, 20)
    }

    /// Thinking, text and a call, fed one character at a time, make exactly Anthropic's event sequence;
    /// the whole message built from the same text agrees with what the events accumulate to.
    #[test]
    fn events_follow_anthropic_sequence_and_agree_with_the_message() {
        let text = "Let me see.</think>\n\nChecking.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n";
        let mut builder = builder();
        let mut events = vec![builder.start()];
        let chars: Vec<char> = text.chars().collect();
        let stop = end(FinishReason::EosToken, None);
        for (i, c) in chars.iter().enumerate() {
            events.extend(builder.push(&c.to_string(), (i + 1 == chars.len()).then_some(&stop)));
        }
        let names: Vec<&str> = events.iter().map(StreamEvent::name).collect();
        let deltas = |n| vec!["content_block_delta"; n];
        let expected = [
            vec!["message_start", "content_block_start", "ping"],
            deltas("Let me see.".len() + 1), // a character each, and the signature
            vec!["content_block_stop", "content_block_start"],
            deltas("Checking.\n".len()),
            vec![
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
            ],
            vec!["message_delta", "message_stop"],
        ]
        .concat();
        assert_eq!(names, expected);
        let message = builder.message.clone();
        let input = json!({"city": "Paris"});
        match &message.content[..] {
            [ContentBlock::Thinking { thinking, .. }, ContentBlock::Text { text }, ContentBlock::ToolUse { id, name, input: got }] =>
            {
                assert_eq!((thinking.as_str(), text.as_str()), ("Let me see.", "Checking.\n"));
                assert!(
                    id.starts_with("toolu_") && name == "weather" && *got == input,
                    "{message:?}"
                );
            }
            other => panic!("{other:?}"),
        }
        let partial: String = events
            .iter()
            .filter_map(|event| match event {
                StreamEvent::ContentBlockDelta {
                    delta: BlockDelta::InputJsonDelta { partial_json },
                    ..
                } => Some(partial_json.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(serde_json::from_str::<Value>(&partial).expect("JSON"), input);
        assert_eq!(message.stop_reason, Some(StopReason::ToolUse));
        let usage = MessageUsage {
            input_tokens: 4,
            output_tokens: 9,
            cache_creation_input_tokens: 0,
            cache_read_input_tokens: 16,
        };
        assert_eq!(message.usage, usage);
        match &events[events.len() - 2] {
            StreamEvent::MessageDelta { delta, usage: got } => {
                assert_eq!((delta.stop_reason, *got), (StopReason::ToolUse, usage))
            }
            other => panic!("{other:?}"),
        }
        let serialized = serde_json::to_value(&events[0]).expect("serializes");
        assert_eq!(serialized["type"], "message_start");
        assert_eq!(serialized["message"]["content"], json!([]));
        assert_eq!(serialized["message"]["usage"]["input_tokens"], 20);
    }

    #[test]
    fn stop_reasons_and_whitespace_only_blocks() {
        let mut shaper = builder();
        shaper.push("Done.</think>", None);
        let events = shaper.push("\n  ", Some(&end(FinishReason::StopSequence, Some("END"))));
        let names: Vec<&str> = events.iter().map(StreamEvent::name).collect();
        // The thinking block closes with its signature; the whitespace opens no text block.
        let expected = [
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ];
        assert_eq!(names, expected);
        assert_eq!(shaper.message.content.len(), 1);
        assert_eq!(shaper.message.stop_reason, Some(StopReason::StopSequence));
        assert_eq!(shaper.message.stop_sequence.as_deref(), Some("END"));
        let mut shaper = builder();
        shaper.push("a</think>b", Some(&end(FinishReason::Length, None)));
        assert_eq!(shaper.message.stop_reason, Some(StopReason::MaxTokens));
        let mut shaper = builder();
        shaper.push("a</think>b", Some(&end(FinishReason::EosToken, None)));
        assert_eq!(shaper.message.stop_reason, Some(StopReason::EndTurn));
    }
}
