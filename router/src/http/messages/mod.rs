//! Anthropic's Messages API, `/v1/messages` and `/v1/messages/count_tokens`, on the chat machinery:
//! the request becomes a chat conversation (system → a system turn, `tool_use` blocks → an assistant's
//! `tool_calls`, `tool_result` blocks → `tool` turns), rendered with the model's chat template and its
//! tools (`tool_choice` `any` and `tool` grammar-enforced, as chat's `required` and named choices), and
//! the answer read back by chat's `AnswerReader` into `thinking`, `text` and `tool_use` blocks. One
//! `MessageBuilder` shapes both the stream's events and the whole message, so they always agree.
//!
//! `convert` turns the request into the chat conversation; `builder` shapes the answer.

mod builder;
mod convert;
#[cfg(test)]
mod tests;

use std::{
    convert::Infallible,
    hash::{Hash, Hasher},
};

use axum::{
    extract::{rejection::JsonRejection, State},
    response::{
        sse::{Event, KeepAlive, Sse},
        IntoResponse, Response,
    },
    Extension, Json,
};
use tokio::sync::OwnedSemaphorePermit;

use self::{
    builder::MessageBuilder,
    convert::{convert, Conversation},
};
use super::{
    acquire,
    chat::{constrain_output, AnswerReader},
    collect, compat,
    error::AnthropicError,
    openai::{answering_model, resolve_model, uuid_like},
    submit,
    tools::OfferedTools,
    ApiError, AppState, RequestTag,
};
use crate::{
    api::anthropic::{Message, MessagesRequest, OutputFormat, StreamEvent, ThinkingConfig, TokenCount},
    engine::{EngineError, EventReceiver},
    grammar::GrammarSpec,
    lora::AdapterRef,
    validation::{CachePin, GenerateInput, Prompt},
};

/// A request's prompt, rendered with the chat template, and its tools.
struct Rendered {
    prompt: String,
    tools: Option<OfferedTools>,
    /// With `cache_control`: the pin that keeps this conversation's prefix for its next turn.
    cache_pin: Option<CachePin>,
    /// The LoRA adapter `model` names; None = the base model.
    adapter: Option<AdapterRef>,
}

/// The pin a request with `cache_control` asks for: its breakpoints' longest TTL, keyed by what starts
/// the conversation (the tools and the messages up to the first user turn), which every later turn of
/// it repeats, so each turn's pin replaces the last. Anthropic has no session id to key by.
fn cache_pin(conversation: &Conversation) -> Option<CachePin> {
    let ttl = conversation.cache_ttl?;
    let first_user = conversation.messages.iter().position(|m| m.role == "user");
    let opening = &conversation.messages[..first_user.map_or(0, |i| i + 1)];
    let mut hasher = std::hash::DefaultHasher::new();
    serde_json::to_string(opening).unwrap_or_default().hash(&mut hasher);
    let tools = conversation.tools.as_ref().map(OfferedTools::template_value);
    tools.unwrap_or_default().to_string().hash(&mut hasher);
    let key = format!("anthropic-{:016x}", hasher.finish());
    Some(CachePin::new("cache_control", key).with_ttl(ttl.duration()))
}

fn render(state: &AppState, tag: &RequestTag, request: &MessagesRequest) -> Result<Rendered, ApiError> {
    let adapter = resolve_model(state, Some(&request.model))?;
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
        cache_pin: cache_pin(&conversation),
        tools: conversation.tools,
        adapter,
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
    let format = request.output_config.as_ref().and_then(|config| config.format.as_ref());
    let guided =
        format.map(|OutputFormat::JsonSchema { schema }| (GrammarSpec::JsonSchema(schema.clone()), "output_config"));
    let functions = rendered.tools.as_ref().map(OfferedTools::functions);
    let tool_calls = functions
        .as_deref()
        .map(|functions| (state.tool_call_format, functions));
    let reader = AnswerReader::new(state.reasoning_format, tool_calls, &rendered.prompt);
    // The template already holds the special tokens (BOS, role markers): add none when tokenizing.
    let prompt = Prompt::Text {
        text: rendered.prompt.clone(),
        add_special_tokens: false,
    };
    let mut input = GenerateInput::new(prompt, "messages", "max_tokens");
    constrain_output(&state, &mut input, guided, rendered.tools.as_ref(), &rendered.prompt).await?;
    input.max_new_tokens = Some(max_tokens);
    // Anthropic samples at temperature 1 by default; 0 asks for greedy decoding.
    input.do_sample = true;
    input.temperature = request.temperature;
    input.top_p = request.top_p;
    input.top_k = request.top_k;
    input.stop = request.stop_sequences.clone().unwrap_or_default();
    input.cache_pin = rendered.cache_pin;
    let model = answering_model(&state, rendered.adapter.as_ref());
    input.adapter = rendered.adapter;
    let permit = acquire(&state, 1)?;
    let (valid, receivers) = submit(&state, &tag, input, 1).await?;
    let receiver = receivers.into_iter().next().expect("one choice was submitted");
    let builder = MessageBuilder::new(
        format!("msg_{}", uuid_like()),
        model,
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
