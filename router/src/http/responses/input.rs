//! A Responses request read into chat's terms: its items into the messages of a conversation (and the
//! items `input_items` lists), its tools and choices into chat's, the request into the
//! `ChatCompletionRequest` whose machinery (tools, grammar, template variables) serves it; the fields
//! Rill does not act on checked. Errors are 400s (422s for unsupported fields) naming the field.

use serde_json::{json, Value};

use super::super::{openai::uuid_like, ApiError};
use crate::{
    api::{
        openai::{
            ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDefinition, GuidedFields, InertFields,
            JsonSchemaFormat, MessageContent, ResponseFormat, SamplingFields, Tool, ToolCall,
        },
        responses::{
            ContentPart, CreateResponseRequest, FunctionTool, InputContent, InputItem, ResponseInput, TextFormat,
        },
    },
    validation::ValidationError,
};

pub(super) fn invalid(param: impl Into<String>, message: String) -> ApiError {
    ApiError::InvalidField {
        message,
        param: param.into(),
    }
}

fn unsupported(param: &str, message: &str) -> ApiError {
    ApiError::Unsupported {
        message: format!("`{param}` {message}"),
        param: param.into(),
    }
}

/// The OpenAI fields Rill does not act on: a 422 naming the first set away from its default.
pub(super) fn check_inert(request: &CreateResponseRequest) -> Result<(), ApiError> {
    let inert = &request.inert;
    if inert.background == Some(true) {
        return Err(unsupported(
            "background",
            "is not supported: responses run in the foreground",
        ));
    }
    if inert.conversation.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(unsupported(
            "conversation",
            "is not supported: use `previous_response_id`",
        ));
    }
    if inert.prompt.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(unsupported("prompt", "(stored prompt templates) is not supported"));
    }
    if inert
        .service_tier
        .as_deref()
        .is_some_and(|t| !["auto", "default"].contains(&t))
    {
        return Err(unsupported(
            "service_tier",
            "is supported only as \"auto\" or \"default\"",
        ));
    }
    if inert.top_logprobs.is_some_and(|n| n > 0) {
        return Err(unsupported("top_logprobs", "is not supported"));
    }
    if request.include.as_ref().is_some_and(|include| !include.is_empty()) {
        return Err(unsupported("include", "is not supported except as an empty list"));
    }
    let verbosity = request.text.as_ref().and_then(|text| text.verbosity.as_deref());
    if verbosity.is_some_and(|v| v != "medium") {
        return Err(unsupported("text.verbosity", "is supported only as \"medium\""));
    }
    match request.truncation.as_deref() {
        None | Some("disabled" | "auto") => Ok(()),
        Some(other) => Err(invalid(
            "truncation",
            format!("`truncation` must be \"disabled\" or \"auto\", got {other:?}"),
        )),
    }
}

/// The new turn of a request: its messages for the chat template, its items as `input_items` lists them.
#[derive(Debug)]
pub(super) struct NewTurn {
    pub messages: Vec<ChatMessage>,
    pub items: Vec<Value>,
}

pub(super) fn message(role: &str, content: Option<String>) -> ChatMessage {
    ChatMessage {
        role: role.into(),
        content: content.map(MessageContent::Text),
        name: None,
        tool_calls: None,
        tool_call_id: None,
        reasoning_content: None,
    }
}

/// The text of `content` (`field`): text parts only.
fn content_text(content: &InputContent, field: &str) -> Result<String, ApiError> {
    match content {
        InputContent::Text(text) => Ok(text.clone()),
        InputContent::Parts(parts) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                match (part.kind.as_str(), &part.text) {
                    ("input_text" | "output_text", Some(part)) => text.push_str(part),
                    (kind, _) => {
                        return Err(invalid(
                            format!("{field}[{j}]"),
                            format!(
                                "`{field}[{j}]` of type {kind:?} is not supported: only `input_text` and \
                                 `output_text` parts with `text`"
                            ),
                        ))
                    }
                }
            }
            Ok(text)
        }
    }
}

/// `item` as `input_items` lists it: with an id, and a message's content as a list of parts.
fn listed_item(mut item: Value, role: Option<&str>) -> Value {
    let prefix = match item["type"].as_str() {
        Some("message") => "msg",
        Some("function_call") => "fc",
        Some("function_call_output") => "fco",
        _ => "rs",
    };
    if !item["id"].is_string() {
        item["id"] = format!("{prefix}_{}", uuid_like()).into();
    }
    if let Some(role) = role {
        let kind = if role == "assistant" {
            "output_text"
        } else {
            "input_text"
        };
        if let Some(text) = item["content"].as_str() {
            item["content"] = json!([{"type": kind, "text": text}]);
        }
        if let Some(parts) = item["content"].as_array_mut() {
            for part in parts.iter_mut().filter(|part| part["type"] == "output_text") {
                part.as_object_mut()
                    .expect("parts were read as objects")
                    .entry("annotations")
                    .or_insert(json!([]));
            }
        }
    }
    if item["type"] == "reasoning" && item.get("summary").is_none() {
        item["summary"] = json!([]);
    }
    item.as_object_mut()
        .expect("items were read as objects")
        .entry("status")
        .or_insert("completed".into());
    item
}

/// Reads `input` into the new turn: a message per message item, calls joined to the assistant turn
/// before them, a `tool` message per call output, thinking to the assistant turn that follows it.
pub(super) fn read_input(input: &ResponseInput) -> Result<NewTurn, ApiError> {
    let values = match input {
        ResponseInput::Text(text) => vec![json!({"type": "message", "role": "user", "content": text})],
        ResponseInput::Items(items) => items.clone(),
    };
    if values.is_empty() {
        return Err(ValidationError::EmptyInput("input").into());
    }
    let mut turn = NewTurn {
        messages: Vec::new(),
        items: Vec::new(),
    };
    let mut reasoning: Option<String> = None;
    for (i, mut value) in values.into_iter().enumerate() {
        if value.is_object() && value.get("type").is_none() && value.get("role").is_some() {
            value["type"] = "message".into();
        }
        let item: InputItem = serde_json::from_value(value.clone()).map_err(|e| {
            let kind = value.get("type").cloned().unwrap_or(Value::Null);
            invalid(
                format!("input[{i}]"),
                format!(
                    "`input[{i}]` (type {kind}) is not a supported input item ({e}); supported: `message`, \
                     `function_call`, `function_call_output`, `reasoning`"
                ),
            )
        })?;
        let mut role = None;
        match item {
            InputItem::Message { role: given, content } => {
                let text = content_text(&content, &format!("input[{i}].content"))?;
                let chat_role = match given.as_str() {
                    "user" | "system" | "assistant" => given.as_str(),
                    "developer" => "system",
                    other => {
                        return Err(invalid(
                            format!("input[{i}].role"),
                            format!(
                                "`input[{i}].role` must be \"user\", \"system\", \"developer\" or \"assistant\", \
                                 got {other:?}"
                            ),
                        ))
                    }
                };
                let mut chat = message(chat_role, Some(text));
                if chat_role == "assistant" {
                    chat.reasoning_content = reasoning.take();
                }
                turn.messages.push(chat);
                role = Some(given);
            }
            InputItem::FunctionCall {
                call_id,
                name,
                arguments,
            } => {
                let call = ToolCall {
                    id: call_id,
                    kind: "function".into(),
                    function: FunctionCall { name, arguments },
                };
                match turn.messages.last_mut() {
                    Some(last) if last.role == "assistant" => last.tool_calls.get_or_insert_default().push(call),
                    _ => {
                        let mut chat = message("assistant", None);
                        chat.reasoning_content = reasoning.take();
                        chat.tool_calls = Some(vec![call]);
                        turn.messages.push(chat);
                    }
                }
            }
            InputItem::FunctionCallOutput { call_id, output } => {
                let mut chat = message("tool", Some(content_text(&output, &format!("input[{i}].output"))?));
                chat.tool_call_id = Some(call_id);
                turn.messages.push(chat);
            }
            InputItem::Reasoning { content } => {
                let parts = content.unwrap_or_default();
                reasoning = Some(
                    parts
                        .iter()
                        .filter_map(|part: &ContentPart| part.text.as_deref())
                        .collect(),
                );
            }
        }
        turn.items.push(listed_item(value, role.as_deref()));
    }
    Ok(turn)
}

/// `tools`: function tools only, in the Responses shape.
pub(super) fn read_tools(tools: &[Value]) -> Result<Vec<FunctionTool>, ApiError> {
    tools
        .iter()
        .enumerate()
        .map(|(i, tool)| {
            if tool["type"] != "function" {
                return Err(invalid(
                    "tools",
                    format!(
                        "`tools[{i}].type` {} is not supported: only function tools \
                         (`{{\"type\": \"function\", \"name\", \"parameters\"}}`)",
                        tool["type"]
                    ),
                ));
            }
            serde_json::from_value(tool.clone())
                .map_err(|e| invalid("tools", format!("`tools[{i}]` is not a function tool: {e}")))
        })
        .collect()
}

/// `tool_choice` in chat's shape (a named function is `{"type": "function", "name"}` here).
fn chat_tool_choice(choice: &Option<Value>) -> Result<Option<Value>, ApiError> {
    match choice {
        None | Some(Value::Null) | Some(Value::String(_)) => Ok(choice.clone()),
        Some(named) => match named["name"].as_str() {
            Some(name) if named["type"] == "function" => Ok(Some(json!({"type": "function", "function": {"name": name}}))),
            _ => Err(invalid(
                "tool_choice",
                format!("`tool_choice` must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"name\": ...}}, got {named}"),
            )),
        },
    }
}

/// The request as a chat completion over `messages`, for the machinery chat and Responses share.
pub(super) fn chat_request(
    request: &CreateResponseRequest,
    messages: Vec<ChatMessage>,
    tools: &[FunctionTool],
) -> Result<ChatCompletionRequest, ApiError> {
    let response_format = match request.text.as_ref().and_then(|text| text.format.clone()) {
        None | Some(TextFormat::Text) => None,
        Some(TextFormat::JsonObject) => Some(ResponseFormat::JsonObject),
        Some(TextFormat::JsonSchema {
            name,
            schema,
            description,
            strict,
        }) => Some(ResponseFormat::JsonSchema {
            json_schema: JsonSchemaFormat {
                name,
                description,
                schema,
                strict,
            },
        }),
    };
    let tools = tools
        .iter()
        .map(|tool| Tool {
            kind: tool.kind.clone(),
            function: FunctionDefinition {
                name: tool.name.clone(),
                description: tool.description.clone(),
                parameters: tool.parameters.clone(),
                strict: tool.strict,
            },
        })
        .collect();
    Ok(ChatCompletionRequest {
        model: request.model.clone(),
        messages,
        max_tokens: None,
        max_completion_tokens: request.max_output_tokens,
        logprobs: false,
        top_logprobs: None,
        add_generation_prompt: Some(true),
        chat_template_kwargs: None,
        reasoning_effort: request.reasoning.as_ref().and_then(|r| r.effort.clone()),
        tools: Some(tools),
        tool_choice: chat_tool_choice(&request.tool_choice)?,
        parallel_tool_calls: request.parallel_tool_calls,
        sampling: SamplingFields {
            temperature: request.temperature,
            top_p: request.top_p,
            user: request.user.clone(),
            stream: request.stream,
            ..SamplingFields::default()
        },
        inert: InertFields::default(),
        guided: GuidedFields {
            response_format,
            ..GuidedFields::default()
        },
        unknown: Default::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body: Value) -> CreateResponseRequest {
        serde_json::from_value(body).expect("a valid request")
    }

    #[test]
    fn items_become_a_chat_conversation() {
        let input = request(json!({"input": [
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                {"type": "input_text", "text": "in Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call", "call_id": "call_2", "name": "time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ]}))
        .input;
        let turn = read_input(&input).expect("valid items");
        let roles: Vec<&str> = turn.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool"]);
        let user = serde_json::to_value(&turn.messages[1]).expect("serializes");
        assert_eq!(user["content"], "Weather in Paris?");
        let assistant = &turn.messages[2];
        assert_eq!(assistant.reasoning_content.as_deref(), Some("hm"));
        let calls = assistant.tool_calls.as_ref().expect("calls");
        assert_eq!(
            calls.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(),
            ["call_1", "call_2"]
        );
        assert_eq!(turn.messages[3].tool_call_id.as_deref(), Some("call_1"));
        // Listed items: each with an id and a status, a string content as a part.
        assert_eq!(turn.items.len(), 6);
        assert!(turn
            .items
            .iter()
            .all(|item| item["id"].is_string() && item["status"].is_string()));
        assert_eq!(
            turn.items[0]["content"],
            json!([{"type": "input_text", "text": "Be brief."}])
        );
        assert_eq!(turn.items[2]["id"], "rs_1");
        // Text input is one user message.
        let text = read_input(&ResponseInput::Text("hi".into())).expect("valid");
        assert_eq!(text.messages.len(), 1);
        assert_eq!(text.messages[0].role, "user");
    }

    #[test]
    fn bad_items_and_tools_are_400s_naming_them() {
        let error = |input: Value| read_input(&request(json!({"input": input})).input).unwrap_err();
        let image = error(json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]));
        assert_eq!(image.status(), axum::http::StatusCode::BAD_REQUEST);
        assert_eq!(image.param().as_deref(), Some("input[0].content[0]"));
        let kind = error(json!([{"role": "user", "content": "a"}, {"type": "web_search_call", "id": "x"}]));
        assert_eq!(kind.param().as_deref(), Some("input[1]"));
        assert!(kind.to_string().contains("web_search_call"), "{kind}");
        let role = error(json!([{"role": "tool", "content": "a"}]));
        assert_eq!(role.param().as_deref(), Some("input[0].role"));
        let empty = error(json!([]));
        assert_eq!(empty.param().as_deref(), Some("input"));
        let tools = read_tools(&[json!({"type": "web_search"})]).unwrap_err();
        assert_eq!(tools.status(), axum::http::StatusCode::BAD_REQUEST);
        assert!(tools.to_string().contains("tools[0].type"), "{tools}");
    }

    #[test]
    fn the_request_reads_as_a_chat_completion() {
        let body = request(json!({"input": "hi", "tools": [{"type": "function", "name": "weather",
            "parameters": {"type": "object"}}], "tool_choice": {"type": "function", "name": "weather"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "max_output_tokens": 7, "temperature": 0, "reasoning": {"effort": "low"}}));
        let tools = read_tools(body.tools.as_deref().unwrap_or_default()).expect("valid tools");
        let chat = chat_request(&body, Vec::new(), &tools).expect("valid");
        assert_eq!(chat.max_completion_tokens, Some(7));
        assert_eq!(chat.sampling.temperature, Some(0.0));
        assert_eq!(chat.reasoning_effort.as_deref(), Some("low"));
        assert_eq!(
            chat.tool_choice,
            Some(json!({"type": "function", "function": {"name": "weather"}}))
        );
        assert_eq!(
            chat.tools.as_ref().map(|tools| tools[0].function.name.as_str()),
            Some("weather")
        );
        assert!(matches!(
            chat.guided.response_format,
            Some(ResponseFormat::JsonSchema { .. })
        ));
        let bad = request(json!({"input": "hi", "tool_choice": {"type": "file_search"}}));
        assert_eq!(
            chat_request(&bad, Vec::new(), &[]).unwrap_err().param().as_deref(),
            Some("tool_choice")
        );
        let background = request(json!({"input": "hi", "background": true}));
        assert_eq!(
            check_inert(&background).unwrap_err().param().as_deref(),
            Some("background")
        );
    }
}
