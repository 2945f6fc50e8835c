//! The native (TGI-compatible) API: `POST /generate` and `POST /generate_stream`.

use std::convert::Infallible;

use axum::{
    extract::{rejection::JsonRejection, State},
    response::{
        sse::{Event, KeepAlive, Sse},
        IntoResponse, Response,
    },
    Extension, Json,
};
use futures::Stream;

use super::{acquire, collect, guided, openai::resolve_model, submit, ApiError, AppState, RequestTag};
use crate::{
    api::{
        Details, ErrorResponse, GenerateParameters, GenerateRequest, GenerateResponse, StreamDetails, StreamResponse,
        Token, TopToken,
    },
    engine::TokenEvent,
    validation::{GenerateInput, Prompt},
};

fn unsupported(param: &str, message: &str) -> ApiError {
    ApiError::Unsupported {
        message: format!("`{param}` {message}"),
        param: param.into(),
    }
}

/// Maps the TGI parameters onto the shared `GenerateInput`; `adapter_id` names a LoRA adapter as OpenAI's
/// `model` does.
fn generate_input(state: &AppState, inputs: String, parameters: GenerateParameters) -> Result<GenerateInput, ApiError> {
    if parameters.best_of.is_some_and(|n| n > 1) {
        return Err(unsupported("best_of", "> 1 is not supported"));
    }
    if parameters.watermark {
        return Err(unsupported("watermark", "is not supported"));
    }
    if parameters.decoder_input_details {
        return Err(unsupported("decoder_input_details", "is not supported"));
    }
    let mut input = GenerateInput::new(
        Prompt::Text {
            text: inputs,
            add_special_tokens: true,
        },
        "inputs",
        "max_new_tokens",
    );
    input.max_new_tokens = parameters.max_new_tokens;
    input.do_sample = parameters.do_sample;
    input.temperature = parameters.temperature;
    input.top_k = parameters.top_k;
    input.top_p = parameters.top_p;
    input.typical_p = parameters.typical_p;
    input.seed = parameters.seed;
    input.stop = parameters.stop;
    input.repetition_penalty = parameters.repetition_penalty;
    input.frequency_penalty = parameters.frequency_penalty;
    input.top_n_tokens = parameters.top_n_tokens.unwrap_or(0);
    input.truncate = parameters.truncate;
    input.priority = parameters.priority;
    input.cache_salt = parameters.cache_salt;
    input.timeout = parameters.timeout;
    input.adapter = resolve_model(state, parameters.adapter_id.as_deref())?;
    if let Some(grammar) = &parameters.grammar {
        input.grammar = guided::from_tgi(grammar)?;
    }
    Ok(input)
}

fn token(event: &TokenEvent) -> Token {
    Token {
        id: event.token_id,
        text: event.text.clone(),
        logprob: event.logprob,
        special: event.is_special,
    }
}

fn top_tokens(state: &AppState, event: &TokenEvent) -> Vec<TopToken> {
    event
        .top_logprobs
        .iter()
        .map(|&(id, logprob)| TopToken {
            id,
            text: state.token_text(id),
            logprob,
            special: state.is_special(id),
        })
        .collect()
}

/// Generate text.
#[utoipa::path(post, path = "/generate", tag = "native", request_body = GenerateRequest,
    responses((status = 200, body = GenerateResponse), (status = 404, body = ErrorResponse), (status = 422, body = ErrorResponse),
              (status = 429, body = ErrorResponse), (status = 504, body = ErrorResponse)))]
pub async fn generate(
    State(state): State<AppState>,
    Extension(tag): Extension<RequestTag>,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Result<Json<GenerateResponse>, ApiError> {
    let _permit = acquire(&state, 1)?;
    let Json(request) = body?;
    let prefix = request.parameters.return_full_text.then(|| request.inputs.clone());
    let details = request.parameters.details;
    let input = generate_input(&state, request.inputs, request.parameters)?;
    let (valid, mut receivers) = submit(&state, &tag, input, 1).await?;
    let finished = collect(receivers.pop().expect("one choice")).await?;
    let details = details.then(|| Details {
        finish_reason: finished.end.finish_reason,
        generated_tokens: finished.end.num_generated_tokens,
        seed: valid.sampling.do_sample.then_some(valid.sampling.seed),
        input_length: finished.end.num_prompt_tokens,
        cached_tokens: finished.end.num_cached_tokens,
        tokens: finished.tokens.iter().map(token).collect(),
        top_tokens: if valid.top_n_tokens > 0 {
            finished.tokens.iter().map(|e| top_tokens(&state, e)).collect()
        } else {
            Vec::new()
        },
    });
    Ok(Json(GenerateResponse {
        generated_text: prefix.unwrap_or_default() + &finished.end.generated_text,
        details,
    }))
}

/// Generate text as server-sent events, one per token; the last carries the whole text and details.
#[utoipa::path(post, path = "/generate_stream", tag = "native", request_body = GenerateRequest,
    responses((status = 200, description = "text/event-stream of StreamResponse", body = StreamResponse),
              (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse),
              (status = 404, body = ErrorResponse), (status = 413, body = ErrorResponse),
              (status = 422, body = ErrorResponse), (status = 429, body = ErrorResponse),
              (status = 500, body = ErrorResponse), (status = 503, body = ErrorResponse)))]
pub async fn generate_stream(
    State(state): State<AppState>,
    Extension(tag): Extension<RequestTag>,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let permit = acquire(&state, 1)?;
    let Json(request) = body?;
    let prefix = request.parameters.return_full_text.then(|| request.inputs.clone());
    let input = generate_input(&state, request.inputs, request.parameters)?;
    let (valid, mut receivers) = submit(&state, &tag, input, 1).await?;
    let mut events = receivers.pop().expect("one choice");
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
                        top_tokens: top_tokens(&state, &event),
                        generated_text: end.map(|end| prefix.clone().unwrap_or_default() + &end.generated_text),
                        details: end.map(|end| StreamDetails {
                            finish_reason: end.finish_reason,
                            generated_tokens: end.num_generated_tokens,
                            seed: valid.sampling.do_sample.then_some(valid.sampling.seed),
                            input_length: end.num_prompt_tokens,
                            cached_tokens: end.num_cached_tokens,
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

/// TGI's compatibility route: `/generate_stream` when the body says `"stream": true`, else `/generate`.
#[utoipa::path(post, path = "/", tag = "native", request_body = GenerateRequest,
    responses((status = 200, body = GenerateResponse), (status = 404, body = ErrorResponse), (status = 422, body = ErrorResponse),
              (status = 504, body = ErrorResponse)))]
pub async fn compat(
    State(state): State<AppState>,
    Extension(tag): Extension<RequestTag>,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Response {
    match &body {
        Ok(Json(request)) if request.stream => generate_stream(State(state), Extension(tag), body)
            .await
            .into_response(),
        _ => generate(State(state), Extension(tag), body).await.into_response(),
    }
}
