//! Route handlers: validate, submit to the engine, and shape its token events into TGI's responses.

use std::{convert::Infallible, sync::atomic::Ordering};

use axum::{
    extract::{rejection::JsonRejection, State},
    response::{
        sse::{Event, KeepAlive, Sse},
        IntoResponse, Response,
    },
    Json,
};
use futures::Stream;
use tokio::sync::OwnedSemaphorePermit;

use super::{ApiError, AppState};
use crate::{
    api::{
        Details, GenerateRequest, GenerateResponse, Info, KvInfo, StreamDetails, StreamResponse,
        Token,
    },
    engine::{EventReceiver, TokenEvent},
    validation::ValidRequest,
};

/// Takes a concurrency permit (429 when none is left), validates, and submits to the engine.
async fn admit(
    state: &AppState,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Result<(ValidRequest, EventReceiver, OwnedSemaphorePermit), ApiError> {
    let permit = state
        .admission
        .clone()
        .try_acquire_owned()
        .map_err(|_| ApiError::Overloaded(state.limits.max_concurrent_requests))?;
    let Json(request) = body?;
    let valid = state.validator.validate(request).await?;
    let (_, events) = state.engine.submit(valid.clone())?;
    Ok((valid, events, permit))
}

fn token(event: &TokenEvent) -> Token {
    Token {
        id: event.token_id,
        text: event.text.clone(),
        logprob: event.logprob,
        special: event.is_special,
    }
}

/// `POST /generate`: the whole generation in one JSON body.
pub async fn generate(
    State(state): State<AppState>,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Result<Json<GenerateResponse>, ApiError> {
    let (valid, mut events, _permit) = admit(&state, body).await?;
    let mut tokens = Vec::new();
    while let Some(event) = events.recv().await {
        let event = event?;
        tokens.push(token(&event));
        if let Some(end) = event.end {
            let details = valid.details.then(|| Details {
                finish_reason: end.finish_reason,
                generated_tokens: end.num_generated_tokens,
                seed: valid.sampling.do_sample.then_some(valid.sampling.seed),
                input_length: end.num_prompt_tokens,
                tokens,
            });
            return Ok(Json(GenerateResponse {
                generated_text: end.generated_text,
                details,
            }));
        }
    }
    Err(ApiError::Engine(crate::engine::EngineError::Closed))
}

/// `POST /generate_stream`: one SSE event per generated token; the last carries the whole text and details.
pub async fn generate_stream(
    State(state): State<AppState>,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let (valid, mut events, permit) = admit(&state, body).await?;
    let stream = async_stream::stream! {
        // Held until the stream ends (or the client goes, which drops the stream and cancels the request).
        let _permit = permit;
        let mut index = 0;
        while let Some(event) = events.recv().await {
            match event {
                Ok(event) => {
                    let end = event.end.as_ref();
                    let response = StreamResponse {
                        index,
                        token: token(&event),
                        generated_text: end.map(|end| end.generated_text.clone()),
                        details: end.map(|end| StreamDetails {
                            finish_reason: end.finish_reason,
                            generated_tokens: end.num_generated_tokens,
                            seed: valid.sampling.do_sample.then_some(valid.sampling.seed),
                            input_length: end.num_prompt_tokens,
                        }),
                    };
                    index += 1;
                    yield Ok(Event::default().json_data(response).expect("stream events serialize"));
                    if end.is_some() {
                        break;
                    }
                }
                Err(error) => {
                    let body = ApiError::from(error).body();
                    yield Ok(Event::default().event("error").json_data(body).expect("errors serialize"));
                    break;
                }
            }
        }
    };
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

/// `GET /health`: liveness — the router is up and serving HTTP.
pub async fn health() -> Response {
    axum::http::StatusCode::OK.into_response()
}

/// `GET /info`: the model, the limits, and the KV pool as the allocator sees it now.
pub async fn info(State(state): State<AppState>) -> Json<Info> {
    let stats = &state.engine.stats;
    let total_blocks = stats.num_total_blocks.load(Ordering::Relaxed);
    let free_blocks = stats.num_free_blocks.load(Ordering::Relaxed);
    Json(Info {
        model_id: state.model_id.clone(),
        model_type: state.shard_info.model_type.clone(),
        model_dtype: state.shard_info.dtype.clone(),
        model_device_type: state.shard_info.device.clone(),
        num_shard: state.shard_info.world_size,
        max_input_tokens: state.limits.max_input_tokens,
        max_total_tokens: state.limits.max_total_tokens,
        max_batch_tokens: state.batch.max_batch_tokens,
        max_batch_size: state.batch.max_batch_size,
        max_concurrent_requests: state.limits.max_concurrent_requests,
        max_stop_sequences: state.limits.max_stop_sequences,
        kv: KvInfo {
            block_size: state.shard_info.block_size,
            total_blocks,
            free_blocks,
            used_blocks: total_blocks - free_blocks,
            waiting_requests: stats.num_waiting.load(Ordering::Relaxed),
            running_requests: stats.num_running.load(Ordering::Relaxed),
        },
        version: env!("CARGO_PKG_VERSION"),
    })
}
