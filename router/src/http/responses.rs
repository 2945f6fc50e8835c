//! OpenAI's Responses API: `POST /v1/responses` (streamed with typed events, or not), `GET` and `DELETE
//! /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, `GET /v1/responses/{id}/input_items`.
//!
//! A request is read into a chat conversation (`instructions` as the system message, then the items) and
//! served by chat's machinery: the chat template with the tools, `output_grammar` for `required` and
//! named tool choices and `text.format`, `AnswerReader` for the thinking and the calls
//! (`responses_output`).
//!
//! The store (`response_store`, bounded by `--responses-store-*`) keeps each response with its **token
//! history**: the exact prompt token ids and the generated ones. A request with `previous_response_id`
//! does not re-render that conversation: its prompt is the stored tokens followed by the tokens of the
//! new turn alone, so the prefix cache holds the whole previous turn by construction (up to the blocks it
//! evicted since). The new turn's text comes from the template itself (`continuation_text`); only where
//! the template cannot render it as an append (or the instructions or tools changed, which changes the
//! start of the prompt) is the whole conversation rendered again, which is logged.

use std::{convert::Infallible, time::Instant};

use axum::{
    extract::{rejection::JsonRejection, Path, Query, State},
    response::{
        sse::{Event, KeepAlive, Sse},
        IntoResponse, Response,
    },
    Extension, Json,
};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{
    acquire,
    chat::{output_grammar, template_variables, AnswerReader},
    compat,
    error::OpenAiError,
    openai::{apply_sampling, check_model, now, uuid_like},
    response_store::ResponseStore,
    responses_output::OutputBuilder,
    submit,
    tools::OfferedTools,
    ApiError, AppState, RequestTag,
};
use crate::{
    api::{
        openai::{
            ChatCompletionRequest, ChatMessage, ErrorResponse, FunctionCall, FunctionDefinition, GuidedFields,
            InertFields, JsonSchemaFormat, MessageContent, ResponseFormat, SamplingFields, Tool, ToolCall,
        },
        responses::{
            ContentPart, CreateResponseRequest, DeletedResponse, FunctionTool, IncompleteDetails, InputContent,
            InputItem, InputItemList, InputTokensDetails, OutputTokensDetails, ResponseErrorInfo, ResponseInput,
            ResponseObject, ResponseUsage, StreamEvent, StreamEventKind, TextConfig, TextFormat,
        },
        FinishReason, ResponsesStoreInfo,
    },
    chat_template::{ChatTemplate, ChatTemplateError},
    engine::{EndEvent, EngineError, EventReceiver},
    validation::{GenerateInput, Prompt, ValidationError},
};

/// What the store keeps of a response.
pub struct StoredResponse {
    /// As `GET /v1/responses/{id}` shows it.
    object: ResponseObject,
    /// The request's input items, ids given (`input_items`).
    input_items: Vec<Value>,
    /// What a later turn continues; None for a failed response, which cannot be continued.
    history: Option<TokenHistory>,
}

/// A conversation as the model saw it: the tokens, and the messages they render (for a later turn's text).
#[derive(Clone)]
struct TokenHistory {
    /// The response's `instructions`: a later turn with others renders the conversation again.
    instructions: Option<String>,
    /// The chat template's variables (tools, reasoning effort): a later turn with others renders again.
    variables: serde_json::Map<String, Value>,
    /// The conversation after the instructions, this response's output last.
    messages: Vec<ChatMessage>,
    /// The prompt's token ids, then the generated ones.
    token_ids: Vec<u32>,
}

impl StoredResponse {
    /// The bytes it holds, roughly (what `--responses-store-max-bytes` bounds): its JSON and its tokens.
    fn num_bytes(&self) -> usize {
        let history = self.history.as_ref().map_or(0, |h| {
            json_len(&h.messages) + json_len(&h.variables) + h.token_ids.len() * size_of::<u32>()
        });
        json_len(&self.object) + json_len(&self.input_items) + history
    }
}

fn json_len(value: &impl serde::Serialize) -> usize {
    serde_json::to_vec(value).map_or(0, |bytes| bytes.len())
}

pub type Store = std::sync::Mutex<ResponseStore<StoredResponse>>;

fn invalid(param: impl Into<String>, message: String) -> ApiError {
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
fn check_inert(request: &CreateResponseRequest) -> Result<(), ApiError> {
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
struct NewTurn {
    messages: Vec<ChatMessage>,
    items: Vec<Value>,
}

fn message(role: &str, content: Option<String>) -> ChatMessage {
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
fn read_input(input: &ResponseInput) -> Result<NewTurn, ApiError> {
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
fn read_tools(tools: &[Value]) -> Result<Vec<FunctionTool>, ApiError> {
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
fn chat_request(
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

/// Marks where the answer goes when the template renders a turn, to find what closes an assistant turn.
const ANSWER_MARK: &str = "\u{1}rill-answer\u{1}";

/// What closing the previous answer still needs: the template's closing of an assistant turn, less the
/// end-of-turn token the model already generated when it starts that closing.
fn unclosed_part<'a>(closing: &'a str, last_special_token: Option<&str>) -> &'a str {
    match last_special_token {
        Some(token) if !token.is_empty() => closing.strip_prefix(token).unwrap_or(closing),
        _ => closing,
    }
}

/// The text that continues the token history `before` rendered (its last message the previous answer)
/// into the prompt of `conversation` (`before` and the new turn): the rest of the previous answer's
/// closing, then the template's rendering of the new turn with the generation prompt. None when the
/// template does not render the new turn as an append to the previous one.
fn continuation_text(
    template: &ChatTemplate,
    before: &[ChatMessage],
    conversation: &[ChatMessage],
    variables: &serde_json::Map<String, Value>,
    last_special_token: Option<&str>,
) -> Result<Option<String>, ApiError> {
    let closed = template.render(before, false, variables)?;
    let next = template.render(conversation, true, variables)?;
    let Some(new_turn) = next.strip_prefix(&closed) else {
        return Ok(None);
    };
    let mut probe = before.to_vec();
    match probe.last_mut() {
        Some(last) if last.role == "assistant" => *last = message("assistant", Some(ANSWER_MARK.into())),
        _ => return Ok(None),
    }
    let probe = template.render(&probe, false, variables)?;
    let Some(at) = probe.rfind(ANSWER_MARK) else {
        return Ok(None);
    };
    let closing = &probe[at + ANSWER_MARK.len()..];
    Ok(Some(format!(
        "{}{new_turn}",
        unclosed_part(closing, last_special_token)
    )))
}

/// The prompt of a turn (and its text, for the reasoning parser): `previous`'s token history continued
/// by the new turn, or the whole conversation rendered. `conversation` is everything the prompt holds,
/// the instructions first, its last `num_new` messages the new turn's.
async fn build_prompt(
    state: &AppState,
    previous: Option<&TokenHistory>,
    instructions: &Option<String>,
    conversation: &[ChatMessage],
    num_new: usize,
    variables: &serde_json::Map<String, Value>,
) -> Result<(Prompt, String), ApiError> {
    if let Some(history) = previous {
        if history.instructions == *instructions && history.variables == *variables {
            let before = &conversation[..conversation.len() - num_new];
            let last = *history.token_ids.last().expect("a history holds its prompt");
            let last_special = state.is_special(last).then(|| state.token_text(last));
            let template = state.chat_template.as_ref().ok_or(ChatTemplateError::Missing)?;
            match continuation_text(template, before, conversation, variables, last_special.as_deref())? {
                Some(text) => {
                    let encoding = state.validator.tokenize(text.clone(), false).await?;
                    let mut ids = history.token_ids.clone();
                    ids.extend_from_slice(encoding.get_ids());
                    return Ok((Prompt::Tokens(ids), text));
                }
                None => tracing::warn!(
                    "the chat template does not render a new turn as an append to the previous one: \
                     rendering the whole conversation again (its prefix may miss the cache)"
                ),
            }
        } else {
            tracing::debug!("instructions or tools changed since the previous response: rendering it all again");
        }
    }
    let text = state.render_chat(conversation, true, variables)?;
    let prompt = Prompt::Text {
        text: text.clone(),
        add_special_tokens: false,
    };
    Ok((prompt, text))
}

/// The response object before any output: what the request asked, echoed.
fn response_head(state: &AppState, request: &CreateResponseRequest, tools: Vec<FunctionTool>) -> ResponseObject {
    ResponseObject {
        id: format!("resp_{}", uuid_like()),
        object: "response",
        created_at: now(),
        status: "in_progress",
        error: None,
        incomplete_details: None,
        instructions: request.instructions.clone(),
        max_output_tokens: request.max_output_tokens,
        model: state.served_model_name.clone(),
        output: Vec::new(),
        parallel_tool_calls: request.parallel_tool_calls.unwrap_or(true),
        previous_response_id: request.previous_response_id.clone(),
        reasoning: request.reasoning.clone().unwrap_or_default(),
        store: request.store.unwrap_or(true),
        temperature: request.temperature.unwrap_or(1.0),
        text: request.text.clone().unwrap_or(TextConfig {
            format: Some(TextFormat::Text),
            verbosity: None,
        }),
        tool_choice: request.tool_choice.clone().unwrap_or("auto".into()),
        tools,
        top_p: request.top_p.unwrap_or(1.0),
        truncation: request.truncation.clone().unwrap_or("disabled".into()),
        usage: None,
        user: request.user.clone(),
        metadata: request.metadata.clone().unwrap_or_default(),
        prompt_cache_key: request.prompt_cache_key.clone(),
        background: false,
    }
}

/// One turn on its way: what finishing it needs.
struct Turn {
    head: ResponseObject,
    builder: OutputBuilder,
    /// The prompt's token ids; the generated ones are appended as they come.
    token_ids: Vec<u32>,
    /// The history to store: the conversation so far (the output is added at the end).
    history: TokenHistory,
    input_items: Vec<Value>,
}

impl Turn {
    /// Reads one event; returns its stream events and, on the last, the finished response.
    fn push(&mut self, event: &crate::engine::TokenEvent) -> (Vec<StreamEventKind>, Option<ResponseObject>) {
        self.token_ids.push(event.token_id);
        let events = self.builder.push(event);
        (events, event.end.as_ref().map(|end| self.finish(end)))
    }

    fn finish(&self, end: &EndEvent) -> ResponseObject {
        let mut object = self.head.clone();
        if end.finish_reason == FinishReason::Length {
            object.status = "incomplete";
            object.incomplete_details = Some(IncompleteDetails {
                reason: "max_output_tokens",
            });
        } else {
            object.status = "completed";
        }
        object.output = self.builder.items().to_vec();
        object.usage = Some(ResponseUsage {
            input_tokens: end.num_prompt_tokens,
            input_tokens_details: InputTokensDetails {
                cached_tokens: end.num_cached_tokens,
                cache_write_tokens: 0,
            },
            output_tokens: end.num_generated_tokens,
            output_tokens_details: OutputTokensDetails {
                reasoning_tokens: self.builder.num_reasoning_tokens(),
            },
            total_tokens: end.num_prompt_tokens + end.num_generated_tokens,
        });
        object
    }

    /// The response failed: its object says why.
    fn fail(&self, error: &ApiError) -> ResponseObject {
        let mut object = self.head.clone();
        object.status = "failed";
        object.error = Some(ResponseErrorInfo {
            code: "server_error",
            message: error.to_string(),
        });
        object.output = self.builder.items().to_vec();
        object
    }

    /// Stores the response, when asked, with its token history unless it failed.
    fn keep(self, state: &AppState, object: &ResponseObject) {
        if !object.store {
            return;
        }
        let history = (object.status != "failed").then(|| {
            let (text, reasoning, calls) = self.builder.answer();
            let mut answer = message("assistant", (!text.is_empty() || calls.is_empty()).then_some(text));
            answer.reasoning_content = (!reasoning.is_empty()).then_some(reasoning);
            answer.tool_calls = (!calls.is_empty()).then(|| {
                let calls = calls.iter().map(|(id, call)| ToolCall {
                    id: id.clone(),
                    kind: "function".into(),
                    function: FunctionCall {
                        name: call.name.clone(),
                        arguments: call.arguments.clone(),
                    },
                });
                calls.collect()
            });
            let mut history = self.history;
            history.messages.push(answer);
            history.token_ids = self.token_ids;
            history
        });
        let stored = StoredResponse {
            object: object.clone(),
            input_items: self.input_items,
            history,
        };
        let num_bytes = stored.num_bytes();
        let mut store = state.responses.lock().expect("the store's lock is never poisoned");
        if !store.insert(object.id.clone(), stored, num_bytes, Instant::now()) {
            tracing::warn!(
                id = object.id,
                num_bytes,
                "response not stored: larger than --responses-store-max-bytes, or the store keeps none"
            );
        }
    }
}

/// The store's bounds and size, after dropping the expired entries; the size is also set on the gauges.
pub(super) fn store_size(state: &AppState) -> ResponsesStoreInfo {
    let mut store = state.responses.lock().expect("the store's lock is never poisoned");
    store.expire(Instant::now());
    let metrics = &state.engine.metrics;
    metrics.responses_stored.set(store.len() as i64);
    metrics.responses_stored_bytes.set(store.num_bytes() as i64);
    let bounds = store.bounds();
    ResponsesStoreInfo {
        max_entries: bounds.max_entries,
        max_bytes: bounds.max_bytes,
        ttl_secs: bounds.ttl.as_secs(),
        num_entries: store.len(),
        num_bytes: store.num_bytes(),
    }
}

/// The stored token history `id` names, or the 400 OpenAI gives for an unknown previous response.
fn previous_history(state: &AppState, id: &str) -> Result<TokenHistory, ApiError> {
    let mut store = state.responses.lock().expect("the store's lock is never poisoned");
    let stored = store
        .get(id, Instant::now())
        .ok_or_else(|| ApiError::PreviousResponseNotFound(id.into()))?;
    stored.history.clone().ok_or_else(|| {
        invalid(
            "previous_response_id",
            format!("Previous response with id '{id}' failed and cannot be continued"),
        )
    })
}

/// Create a response, streaming or not.
#[utoipa::path(post, path = "/v1/responses", tag = "openai", request_body = CreateResponseRequest,
    responses((status = 200, body = ResponseObject), (status = 400, body = ErrorResponse),
              (status = 404, body = ErrorResponse), (status = 422, body = ErrorResponse),
              (status = 429, body = ErrorResponse), (status = 500, body = ErrorResponse),
              (status = 503, body = ErrorResponse), (status = 504, body = ErrorResponse)))]
pub async fn create(
    State(state): State<AppState>,
    Extension(tag): Extension<RequestTag>,
    body: Result<Json<CreateResponseRequest>, JsonRejection>,
) -> Result<Response, OpenAiError> {
    let Json(request) = body?;
    check_model(&state, &request.model)?;
    compat::ignore_unknown(&state.engine.metrics, &tag, &request.unknown);
    check_inert(&request)?;
    let previous = match &request.previous_response_id {
        Some(id) => Some(previous_history(&state, id)?),
        None => None,
    };
    let turn = read_input(&request.input)?;
    let tools = read_tools(request.tools.as_deref().unwrap_or_default())?;
    // The conversation: the instructions, the stored one, the new turn.
    let mut conversation: Vec<ChatMessage> = request
        .instructions
        .iter()
        .map(|text| message("system", Some(text.clone())))
        .collect();
    let mut history_messages = previous.as_ref().map(|h| h.messages.clone()).unwrap_or_default();
    conversation.extend(history_messages.iter().cloned());
    conversation.extend(turn.messages.iter().cloned());
    history_messages.extend(turn.messages.iter().cloned());
    let chat = chat_request(&request, conversation, &tools)?;
    let offered = OfferedTools::from_request(&chat)?;
    let variables = template_variables(&chat, offered.as_ref());
    let (prompt, prompt_text) = build_prompt(
        &state,
        previous.as_ref(),
        &request.instructions,
        &chat.messages,
        turn.messages.len(),
        &variables,
    )
    .await?;
    let grammar = output_grammar(&state, &chat, offered.as_ref(), &prompt_text).await?;
    let mut input = GenerateInput::new(prompt, "input", "max_output_tokens");
    input.max_new_tokens = request.max_output_tokens;
    apply_sampling(&mut input, &chat.sampling)?;
    input.grammar = grammar;
    if request.truncation.as_deref() == Some("auto") {
        // Keep the newest tokens that fit.
        input.truncate = Some(state.limits.max_input_tokens);
    }
    // PIN HOOK (#35, item 4): hand `request.prompt_cache_key` to the engine here (on `input`), so this
    // conversation's prefix stays pinned for its TTL while the client runs its tools.
    let permit = acquire(&state, 1)?;
    let (valid, mut receivers) = submit(&state, &tag, input, 1).await?;
    let events = receivers.pop().expect("one receiver per choice");
    let reader = AnswerReader::new(
        state.reasoning_format,
        offered.as_ref().map(|_| state.tool_call_format),
        &prompt_text,
    );
    let turn = Turn {
        head: response_head(&state, &request, tools),
        builder: OutputBuilder::new(reader),
        token_ids: valid.prompt_ids,
        history: TokenHistory {
            instructions: request.instructions.clone(),
            variables,
            messages: history_messages,
            token_ids: Vec::new(),
        },
        input_items: turn.items,
    };
    if request.stream.unwrap_or(false) {
        return Ok(stream(state, turn, events, permit));
    }
    let _permit = permit;
    let object = answer(turn, events, &state).await?;
    Ok(Json(object).into_response())
}

/// Reads the whole answer, stores it, and returns it.
async fn answer(mut turn: Turn, mut events: EventReceiver, state: &AppState) -> Result<ResponseObject, ApiError> {
    while let Some(event) = events.recv().await {
        if let (_, Some(object)) = turn.push(&event?) {
            turn.keep(state, &object);
            return Ok(object);
        }
    }
    Err(EngineError::Closed.into())
}

/// Numbers a stream's events.
struct Sequence(u32);

impl Sequence {
    fn event(&mut self, kind: StreamEventKind) -> Result<Event, Infallible> {
        let event = Event::default().event(kind.name()).json_data(StreamEvent {
            sequence_number: self.0,
            kind,
        });
        self.0 += 1;
        Ok(event.expect("events serialize"))
    }
}

/// The answer as typed SSE events: created, in progress, the items' events, then completed (or
/// incomplete); on an engine error, `error` and then `response.failed`.
fn stream(
    state: AppState,
    mut turn: Turn,
    mut events: EventReceiver,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> Response {
    let stream = async_stream::stream! {
        let _permit = permit;
        let mut sequence = Sequence(0);
        yield sequence.event(StreamEventKind::Created { response: Box::new(turn.head.clone()) });
        yield sequence.event(StreamEventKind::InProgress { response: Box::new(turn.head.clone()) });
        let error = loop {
            let event = match events.recv().await {
                Some(Ok(event)) => event,
                Some(Err(error)) => break ApiError::from(error),
                None => break ApiError::from(EngineError::Closed),
            };
            let (kinds, finished) = turn.push(&event);
            for kind in kinds {
                yield sequence.event(kind);
            }
            if let Some(object) = finished {
                turn.keep(&state, &object);
                let response = Box::new(object);
                yield sequence.event(match response.status {
                    "incomplete" => StreamEventKind::Incomplete { response },
                    _ => StreamEventKind::Completed { response },
                });
                return;
            }
        };
        let body = error.openai_body().error;
        yield sequence.event(StreamEventKind::Error { code: body.code, message: body.message, param: body.param });
        let object = turn.fail(&error);
        turn.keep(&state, &object);
        yield sequence.event(StreamEventKind::Failed { response: Box::new(object) });
    };
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

/// Retrieve a stored response.
#[utoipa::path(get, path = "/v1/responses/{id}", tag = "openai", params(("id" = String, Path)),
    responses((status = 200, body = ResponseObject), (status = 404, body = ErrorResponse)))]
pub async fn retrieve(State(state): State<AppState>, Path(id): Path<String>) -> Result<Response, OpenAiError> {
    let mut store = state.responses.lock().expect("the store's lock is never poisoned");
    let stored = store.get(&id, Instant::now()).ok_or(ApiError::ResponseNotFound(id))?;
    Ok(Json(&stored.object).into_response())
}

/// Delete a stored response.
#[utoipa::path(delete, path = "/v1/responses/{id}", tag = "openai", params(("id" = String, Path)),
    responses((status = 200, body = DeletedResponse), (status = 404, body = ErrorResponse)))]
pub async fn delete(State(state): State<AppState>, Path(id): Path<String>) -> Result<Response, OpenAiError> {
    let mut store = state.responses.lock().expect("the store's lock is never poisoned");
    // Drop the expired entries first, so an expired id is not found here either.
    store
        .get(&id, Instant::now())
        .ok_or_else(|| ApiError::ResponseNotFound(id.clone()))?;
    store.remove(&id);
    Ok(Json(DeletedResponse {
        id,
        object: "response",
        deleted: true,
    })
    .into_response())
}

/// Cancel a background response. None runs in the background here (`background: true` is refused), so
/// a stored response has finished and cannot be cancelled: 400, as OpenAI answers for a response not
/// created in the background; an unknown id is a 404.
#[utoipa::path(post, path = "/v1/responses/{id}/cancel", tag = "openai", params(("id" = String, Path)),
    responses((status = 400, body = ErrorResponse), (status = 404, body = ErrorResponse)))]
pub async fn cancel(State(state): State<AppState>, Path(id): Path<String>) -> Result<Response, OpenAiError> {
    let mut store = state.responses.lock().expect("the store's lock is never poisoned");
    store
        .get(&id, Instant::now())
        .ok_or_else(|| ApiError::ResponseNotFound(id.clone()))?;
    Err(ApiError::NotCancellable(format!(
        "Only responses created with `background: true` can be cancelled; response '{id}' was not (this \
         server runs no response in the background)"
    ))
    .into())
}

/// `GET /v1/responses/{id}/input_items` query: OpenAI's cursor pagination.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
pub struct InputItemsQuery {
    /// Items per page, 1..=100 (default 20).
    limit: Option<usize>,
    /// "asc" or "desc" (default: newest first).
    order: Option<String>,
    /// List the items after the one with this id.
    after: Option<String>,
}

/// The input items of a stored response.
#[utoipa::path(get, path = "/v1/responses/{id}/input_items", tag = "openai",
    params(("id" = String, Path), InputItemsQuery),
    responses((status = 200, body = InputItemList), (status = 400, body = ErrorResponse),
              (status = 404, body = ErrorResponse)))]
pub async fn input_items(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(query): Query<InputItemsQuery>,
) -> Result<Response, OpenAiError> {
    let limit = query.limit.unwrap_or(20);
    if !(1..=100).contains(&limit) {
        return Err(invalid("limit", format!("`limit` must be in [1, 100], got {limit}")).into());
    }
    let mut items = {
        let mut store = state.responses.lock().expect("the store's lock is never poisoned");
        let stored = store.get(&id, Instant::now()).ok_or(ApiError::ResponseNotFound(id))?;
        stored.input_items.clone()
    };
    match query.order.as_deref() {
        None | Some("desc") => items.reverse(),
        Some("asc") => {}
        Some(other) => {
            return Err(invalid("order", format!("`order` must be \"asc\" or \"desc\", got {other:?}")).into())
        }
    }
    if let Some(after) = &query.after {
        let at = items
            .iter()
            .position(|item| item["id"] == after.as_str())
            .ok_or_else(|| {
                invalid(
                    "after",
                    format!("`after` names no input item of this response: {after:?}"),
                )
            })?;
        items.drain(..=at);
    }
    let has_more = items.len() > limit;
    items.truncate(limit);
    let id_of = |item: &Value| item["id"].as_str().map(str::to_owned);
    Ok(Json(InputItemList {
        object: "list",
        first_id: items.first().and_then(id_of),
        last_id: items.last().and_then(id_of),
        has_more,
        data: items,
    })
    .into_response())
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

    #[test]
    fn the_generated_end_of_turn_is_not_closed_twice() {
        assert_eq!(unclosed_part("<|im_end|>\n", Some("<|im_end|>")), "\n");
        // Cut off by max_output_tokens: the whole closing is still due.
        assert_eq!(unclosed_part("<|im_end|>\n", None), "<|im_end|>\n");
        // An end-of-sequence token the template does not write: kept, and the closing follows.
        assert_eq!(unclosed_part("<|im_end|>\n", Some("</s>")), "<|im_end|>\n");
    }
}
