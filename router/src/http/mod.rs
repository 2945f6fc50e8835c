//! The HTTP API (axum): routes, handlers, streaming, and the mapping of errors to responses.
//! Handlers turn bodies into `GenerateInput`s, validate, submit to the engine and shape its events;
//! they never schedule or touch KV.

mod build;
mod chat;
mod compat;
#[cfg(test)]
mod compat_tests;
mod error;
mod guided;
mod lora;
#[cfg(test)]
mod lora_tests;
mod messages;
mod middleware;
mod native;
mod openai;
#[cfg(test)]
mod pin_tests;
mod render;
mod responder;
mod response_store;
mod responses;
pub mod serve;
mod service;
#[cfg(test)]
mod speculative_draft_tests;
#[cfg(test)]
mod speculative_tests;
#[cfg(test)]
mod tests;
mod tools;

use std::sync::{
    atomic::{AtomicBool, Ordering},
    Arc,
};

use axum::{
    routing::{get, post},
    Router,
};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub use build::{build, ModelFiles, Server};
pub use error::ApiError;
pub use middleware::RequestTag;

use crate::{
    api::{openai::ChatMessage, MemoryInfo},
    chat_template::{ChatTemplate, ChatTemplateError},
    config::{BatchConfig, LimitsConfig},
    engine::{EndEvent, EngineError, EngineHandle, EventReceiver, TokenEvent},
    metrics::Outcome,
    shard::pb,
    text::{reasoning::ReasoningFormat, tool_calls::ToolCallFormat},
    validation::{GenerateInput, ValidRequest, Validator},
};

/// Everything the handlers share.
#[derive(Clone)]
pub struct AppState {
    pub engine: EngineHandle,
    pub validator: Validator,
    /// One permit per sequence in the server; none left means 429.
    pub admission: Arc<Semaphore>,
    /// One permit per request waiting for admission (`--max-waiting-requests`); none left means 429.
    pub waiting: Arc<Semaphore>,
    /// Set on SIGTERM: new requests get 503 while those in flight finish.
    pub draining: Arc<AtomicBool>,
    /// With `--api-key`: the bearer token generation and tokenization routes require.
    pub api_key: Option<Arc<str>>,
    /// Largest request body accepted (`--max-body-bytes`); larger ones get 413.
    pub max_body_bytes: usize,
    /// Origins whose browser pages may call the API (`--cors-allow-origin`); `*` = any; empty = no CORS.
    pub cors_allow_origins: Vec<String>,
    /// Log prompts' text (`--log-prompts`); off by default, prompts are never logged.
    pub log_prompts: bool,
    pub chat_template: Option<Arc<ChatTemplate>>,
    /// How the model writes tool calls (`--tool-call-parser`, or from its chat template).
    pub tool_call_format: ToolCallFormat,
    /// How it separates its thinking from its answer (`--reasoning-parser`); `None`: it does not.
    pub reasoning_format: Option<ReasoningFormat>,
    pub model_id: String,
    /// The model name of the OpenAI API.
    pub served_model_name: String,
    /// Unix time the server started, in seconds.
    pub started_at: u64,
    pub shard_info: pb::InfoResponse,
    /// The pools' sizes and why, from the shards' Warmup answer (shown in /info).
    pub memory: MemoryInfo,
    pub limits: LimitsConfig,
    pub batch: BatchConfig,
    /// Stored `/v1/responses` responses and their token histories (`--responses-store-*`).
    pub responses: Arc<responses::Store>,
    /// `--enable-lora-loading`: the load and unload endpoints work.
    pub is_lora_loading_enabled: bool,
}

impl AppState {
    /// The text of one token, special tokens included (for logprobs).
    pub fn token_text(&self, id: u32) -> String {
        self.decode(&[id], false)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        self.validator
            .tokenizer()
            .decode(ids, skip_special_tokens)
            .unwrap_or_default()
    }

    pub fn is_special(&self, id: u32) -> bool {
        let tokenizer = self.validator.tokenizer();
        tokenizer
            .id_to_token(id)
            .is_some_and(|token| tokenizer.get_added_vocabulary().is_special_token(&token))
    }

    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ChatTemplateError> {
        self.chat_template
            .as_ref()
            .ok_or(ChatTemplateError::Missing)?
            .render(messages, add_generation_prompt, extra)
    }
}

/// The router's HTTP application.
pub fn app(state: AppState) -> Router {
    let guarded = Router::new()
        .route("/", post(native::compat))
        .route("/generate", post(native::generate))
        .route("/generate_stream", post(native::generate_stream))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions/render", post(render::completions))
        .route("/v1/chat/completions/render", post(render::chat_completions))
        .route("/v1/messages", post(messages::messages))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{id}", get(responses::retrieve).delete(responses::delete))
        .route("/v1/responses/{id}/cancel", post(responses::cancel))
        .route("/v1/responses/{id}/input_items", get(responses::input_items))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{id}", get(openai::model))
        .route("/v1/load_lora_adapter", post(lora::load))
        .route("/v1/unload_lora_adapter", post(lora::unload))
        .route("/tokenize", post(service::tokenize))
        .route("/detokenize", post(service::detokenize))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            middleware::require_api_key,
        ));
    let cors = cors_layer(&state.cors_allow_origins);
    let app = Router::new()
        .merge(guarded)
        .route("/health", get(service::health))
        .route("/ready", get(service::ready))
        .route("/metrics", get(service::metrics))
        .route("/info", get(service::info))
        .route("/v1/loads", get(service::loads))
        .route("/openapi.json", get(service::openapi))
        .route("/docs", get(service::docs))
        .layer(axum::extract::DefaultBodyLimit::max(state.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            middleware::request_id,
        ))
        .with_state(state);
    // Outermost, so preflights are answered before the API-key check (browsers send them without
    // credentials).
    match cors {
        Some(cors) => app.layer(cors),
        None => app,
    }
}

/// CORS for the allowed origins (none: no layer, so no CORS headers at all). Any method and header
/// may be used; `Authorization` is how API keys travel.
fn cors_layer(origins: &[String]) -> Option<tower_http::cors::CorsLayer> {
    use tower_http::cors::{AllowOrigin, Any, CorsLayer};
    if origins.is_empty() {
        return None;
    }
    let allow_origin = if origins.iter().any(|origin| origin == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().map(|origin| {
            origin
                .parse::<axum::http::HeaderValue>()
                .expect("checked to be visible ASCII when the flags were read")
        }))
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow_origin)
            .allow_methods(Any)
            .allow_headers(Any)
            .expose_headers([axum::http::HeaderName::from_static(middleware::REQUEST_ID)]),
    )
}

/// Takes one admission permit per sequence, at once or not at all (429).
fn acquire(state: &AppState, num_sequences: u32) -> Result<OwnedSemaphorePermit, ApiError> {
    if state.draining.load(Ordering::SeqCst) {
        return Err(ApiError::ShuttingDown);
    }
    let max = state.limits.max_concurrent_requests;
    if num_sequences > max {
        return Err(ApiError::Unprocessable(format!(
            "the request asks for {num_sequences} sequences; --max-concurrent-requests is {max}"
        )));
    }
    state
        .admission
        .clone()
        .try_acquire_many_owned(num_sequences)
        .map_err(|_| {
            state.engine.metrics.count_request(Outcome::Overloaded);
            ApiError::Overloaded(max)
        })
}

/// Validates and queues `n` choices of one prompt.
async fn submit(
    state: &AppState,
    tag: &RequestTag,
    input: GenerateInput,
    n: u32,
) -> Result<(ValidRequest, Vec<EventReceiver>), ApiError> {
    if state.log_prompts {
        tracing::info!(request_id = %tag.id, prompt = ?input.prompt, "prompt");
    }
    let valid = state.validator.validate(input).await.inspect_err(|_| {
        state.engine.metrics.count_request(Outcome::Invalid);
    })?;
    let waiting_permit = state.waiting.clone().try_acquire_owned().map_err(|_| {
        state.engine.metrics.count_request(Outcome::Overloaded);
        ApiError::QueueFull(state.limits.max_waiting_requests)
    })?;
    let receivers = state
        .engine
        .submit_n(valid.clone(), n, Some(waiting_permit), tag.id.clone())?;
    tag.hand_to_engine();
    if let Some(adapter) = &valid.adapter {
        state.engine.metrics.count_lora_request(&adapter.name);
    }
    Ok((valid, receivers))
}

/// A finished choice: every token event, and how it ended.
pub struct Finished {
    pub tokens: Vec<TokenEvent>,
    pub end: EndEvent,
}

/// Waits for every choice to finish, reading all of them at once (one read in turn would leave the
/// others' events unread, and cut them off as slow readers).
async fn collect_all(receivers: Vec<EventReceiver>) -> Result<Vec<Finished>, EngineError> {
    futures::future::try_join_all(receivers.into_iter().map(collect)).await
}

/// Waits for a choice to finish.
async fn collect(mut events: EventReceiver) -> Result<Finished, EngineError> {
    let mut tokens = Vec::new();
    while let Some(event) = events.recv().await {
        let mut event = event?;
        if let Some(end) = event.end.take() {
            tokens.push(event);
            return Ok(Finished { tokens, end });
        }
        tokens.push(event);
    }
    Err(EngineError::Closed)
}
