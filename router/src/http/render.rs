//! `/v1/completions/render` and `/v1/chat/completions/render`: what Rill would run for a request, without
//! running it — above all the exact prompt token ids it would prefill, for gateways and prefix-cache
//! indexers that route by them. The request goes through the same reading (`openai::completion_inputs`,
//! `chat::chat_input`) and the same validation as the real handlers, so the ids cannot differ; the answer
//! is vLLM's render shape (`RenderedRequest`). Nothing is queued and no admission permit is taken.

use axum::{
    extract::{rejection::JsonRejection, State},
    Extension, Json,
};

use super::{
    chat::{chat_input, ChatInput},
    error::OpenAiError,
    openai::{answering_model, completion_inputs, uuid_like, CompletionInputs},
    ApiError, AppState, RequestTag,
};
use crate::{
    api::openai::{
        ChatCompletionRequest, CompletionRequest, ErrorResponse, RenderedRequest, RenderedSampling, SamplingFields,
    },
    validation::{GenerateInput, ValidRequest},
};

/// The prompt token ids and sampling parameters of each prompt of a completion request, in vLLM's
/// render shape (a list, one per prompt); errors as `/v1/completions` answers them.
#[utoipa::path(post, path = "/v1/completions/render", tag = "openai", request_body = CompletionRequest,
    responses((status = 200, body = [RenderedRequest]), (status = 400, body = ErrorResponse),
              (status = 401, body = ErrorResponse), (status = 404, body = ErrorResponse),
              (status = 413, body = ErrorResponse), (status = 422, body = ErrorResponse)))]
pub async fn completions(
    State(state): State<AppState>,
    Extension(tag): Extension<RequestTag>,
    body: Result<Json<CompletionRequest>, JsonRejection>,
) -> Result<Json<Vec<RenderedRequest>>, OpenAiError> {
    let Json(request) = body?;
    let CompletionInputs { inputs, n, adapter } = completion_inputs(&state, &tag, &request)?;
    let model = answering_model(&state, adapter.as_ref());
    let mut rendered = Vec::with_capacity(inputs.len());
    for input in inputs {
        let request_id = format!("cmpl-{}", uuid_like());
        rendered.push(render(&state, input, n, &request.sampling, request_id, model.clone()).await?);
    }
    Ok(Json(rendered))
}

/// The prompt token ids (chat template applied) and sampling parameters of a chat request, in vLLM's
/// render shape; errors as `/v1/chat/completions` answers them.
#[utoipa::path(post, path = "/v1/chat/completions/render", tag = "openai", request_body = ChatCompletionRequest,
    responses((status = 200, body = RenderedRequest), (status = 400, body = ErrorResponse),
              (status = 401, body = ErrorResponse), (status = 404, body = ErrorResponse),
              (status = 413, body = ErrorResponse), (status = 422, body = ErrorResponse)))]
pub async fn chat_completions(
    State(state): State<AppState>,
    Extension(tag): Extension<RequestTag>,
    body: Result<Json<ChatCompletionRequest>, JsonRejection>,
) -> Result<Json<RenderedRequest>, OpenAiError> {
    let Json(request) = body?;
    let ChatInput { input, n, adapter, .. } = chat_input(&state, &tag, &request).await?;
    let model = answering_model(&state, adapter.as_ref());
    let request_id = format!("chatcmpl-{}", uuid_like());
    Ok(Json(
        render(&state, input, n, &request.sampling, request_id, model).await?,
    ))
}

/// Validates `input` as a real request would be and shows the outcome.
async fn render(
    state: &AppState,
    input: GenerateInput,
    n: u32,
    fields: &SamplingFields,
    request_id: String,
    model: String,
) -> Result<RenderedRequest, ApiError> {
    let valid: ValidRequest = state.validator.validate(input).await?;
    let sampling = &valid.sampling;
    Ok(RenderedRequest {
        request_id,
        sampling_params: RenderedSampling {
            n,
            max_tokens: valid.max_new_tokens,
            min_tokens: valid.min_new_tokens,
            temperature: if sampling.do_sample { sampling.temperature } else { 0.0 },
            top_p: sampling.top_p,
            top_k: sampling.top_k,
            min_p: sampling.min_p,
            seed: fields.seed,
            presence_penalty: sampling.presence_penalty,
            frequency_penalty: sampling.frequency_penalty,
            repetition_penalty: sampling.repetition_penalty,
            stop: valid.stop_sequences.clone(),
            stop_token_ids: valid.stop_token_ids.clone(),
            ignore_eos: valid.ignore_eos,
            skip_special_tokens: valid.skip_special_tokens,
            logprobs: (valid.top_n_tokens > 0).then_some(valid.top_n_tokens),
        },
        token_ids: valid.prompt_ids,
        features: None,
        model,
        stream: fields.stream.unwrap_or(false),
        cache_salt: fields.cache_salt.clone(),
        priority: valid.priority,
    })
}
