//! OpenAI's Responses API: `POST /v1/responses` (streamed with typed events, or not), `GET` and `DELETE
//! /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, `GET /v1/responses/{id}/input_items`.
//!
//! A request is read into a chat conversation (`instructions` as the system message, then the items) and
//! served by chat's machinery: the chat template with the tools, `constrain_output` for `required` and
//! named tool choices and `text.format`, `AnswerReader` for the thinking and the calls
//! (`output`). `input` reads the request.
//!
//! The store (`response_store`, bounded by `--responses-store-*`) keeps each response with its **token
//! history**: the exact prompt token ids and the generated ones. A request with `previous_response_id`
//! does not re-render that conversation: its prompt is the stored tokens followed by the tokens of the
//! new turn alone, so the prefix cache holds the whole previous turn by construction (up to the blocks it
//! evicted since); `history` says how.

mod history;
mod input;
mod output;

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
use serde_json::Value;

use history::{build_prompt, TokenHistory};
use input::{chat_request, check_inert, invalid, message, read_input, read_tools};
use output::OutputBuilder;

use super::{
    acquire,
    chat::{constrain_output, template_variables, AnswerReader},
    compat,
    error::OpenAiError,
    guided,
    openai::{answering_model, apply_sampling, now, resolve_model, uuid_like},
    response_store::ResponseStore,
    submit,
    tools::OfferedTools,
    ApiError, AppState, RequestTag,
};
use crate::{
    api::{
        openai::{ErrorResponse, FunctionCall, ToolCall},
        responses::{
            CreateResponseRequest, DeletedResponse, FunctionTool, IncompleteDetails, InputItemList, InputTokensDetails,
            OutputTokensDetails, ResponseErrorInfo, ResponseObject, ResponseUsage, StreamEvent, StreamEventKind,
            TextConfig, TextFormat,
        },
        FinishReason, ResponsesStoreInfo,
    },
    engine::{EndEvent, EngineError, EventReceiver, TokenEvent},
    validation::{CachePin, GenerateInput},
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

/// The response object before any output: what the request asked, echoed.
fn response_head(model: String, request: &CreateResponseRequest, tools: Vec<FunctionTool>) -> ResponseObject {
    ResponseObject {
        id: format!("resp_{}", uuid_like()),
        object: "response",
        created_at: now(),
        status: "in_progress",
        error: None,
        incomplete_details: None,
        instructions: request.instructions.clone(),
        max_output_tokens: request.max_output_tokens,
        model,
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
    /// The history to store: the conversation so far (the output is added at the end), and the prompt's
    /// token ids (the generated ones are appended as they come).
    history: TokenHistory,
    input_items: Vec<Value>,
}

impl Turn {
    /// Reads one event; returns its stream events and, on the last, the finished response.
    fn push(&mut self, event: &TokenEvent) -> (Vec<StreamEventKind>, Option<ResponseObject>) {
        self.history.token_ids.push(event.token_id);
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
    let adapter = resolve_model(&state, request.model.as_deref())?;
    compat::ignore_unknown(&state.engine.metrics, &tag, &request.unknown);
    check_inert(&request)?;
    let previous = match &request.previous_response_id {
        Some(id) => Some(previous_history(&state, id)?),
        None => None,
    };
    let turn = read_input(&request.input)?;
    let tools = read_tools(request.tools.as_deref().unwrap_or_default())?;
    // The conversation so far (after the instructions): the stored one, then the new turn.
    let mut history_messages = previous.as_ref().map(|h| h.messages.clone()).unwrap_or_default();
    history_messages.extend(turn.messages.iter().cloned());
    let instructions = request
        .instructions
        .iter()
        .map(|text| message("system", Some(text.clone())));
    let chat = chat_request(
        &request,
        instructions.chain(history_messages.iter().cloned()).collect(),
        &tools,
    )?;
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
    let guided = guided::from_openai(&chat.guided)?;
    let mut input = GenerateInput::new(prompt, "input", "max_output_tokens");
    constrain_output(&state, &mut input, guided, offered.as_ref(), &prompt_text).await?;
    input.max_new_tokens = request.max_output_tokens;
    apply_sampling(&mut input, &chat.sampling)?;
    if request.truncation.as_deref() == Some("auto") {
        // Keep the newest tokens that fit.
        input.truncate = Some(state.limits.max_input_tokens);
    }
    // A stored response's prefix stays pinned (`--cache-pin-ttl`) for the next turn, under the
    // client's `prompt_cache_key` or else the conversation's first response.
    let head = response_head(answering_model(&state, adapter.as_ref()), &request, tools);
    let session = match &previous {
        Some(previous) => previous.session.clone(),
        None => head.id.clone(),
    };
    let pin_key = match &request.prompt_cache_key {
        Some(key) => Some(CachePin::new("prompt_cache_key", key.clone())),
        None if head.store => Some(CachePin::new("previous_response_id", session.clone())),
        None => None,
    };
    input.cache_pin = pin_key;
    input.adapter = adapter;
    let permit = acquire(&state, 1)?;
    let (valid, mut receivers) = submit(&state, &tag, input, 1).await?;
    let events = receivers.pop().expect("one receiver per choice");
    let functions = offered.as_ref().map(OfferedTools::functions);
    let reader = AnswerReader::new(
        state.reasoning_format,
        functions
            .as_deref()
            .map(|functions| (state.tool_call_format, functions)),
        &prompt_text,
    );
    let turn = Turn {
        head,
        builder: OutputBuilder::new(reader),
        history: TokenHistory {
            instructions: request.instructions.clone(),
            variables,
            messages: history_messages,
            token_ids: valid.prompt_ids,
            session,
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
