//! A Messages request as a chat conversation: system → a system turn, text blocks joined, an
//! assistant's `tool_use` blocks → its `tool_calls`, a user's `tool_result` blocks → `tool` turns,
//! earlier thinking → `reasoning_content`; what no served model can read is a 400 naming the block.

use serde_json::Value;

use super::super::{
    tools::{OfferedTools, ToolChoice},
    ApiError,
};
use crate::{
    api::{
        anthropic::{
            CacheControl, CacheTtl, Content, InputBlock, MessagesRequest, Role, ToolChoice as AnthropicChoice,
        },
        openai::{ChatMessage, FunctionCall, FunctionDefinition, MessageContent, Tool, ToolCall},
    },
    validation::ValidationError,
};

/// What separates the text blocks of one turn once they are one text.
const BLOCK_SEPARATOR: &str = "\n";

/// A request's conversation in chat form, and what else it asks for.
#[derive(Debug)]
pub(super) struct Conversation {
    pub messages: Vec<ChatMessage>,
    pub tools: Option<OfferedTools>,
    /// The longest TTL of the request's cache breakpoints (`cache_control`), if it has any.
    pub cache_ttl: Option<CacheTtl>,
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
pub(super) fn convert(request: &MessagesRequest) -> Result<Conversation, ApiError> {
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

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
}
