//! The OpenAI-compatible API: `/v1/completions`, `/v1/models`, and what `/v1/chat/completions` (`chat.rs`)
//! shares with them.
//! Requests become the shared `GenerateInput`, so validation, sampling, stop handling and text are
//! exactly the native API's.

use std::{
    convert::Infallible,
    time::{SystemTime, UNIX_EPOCH},
};

use axum::{
    extract::{rejection::JsonRejection, Path, State},
    response::{
        sse::{Event, KeepAlive, Sse},
        IntoResponse, Response,
    },
    Extension, Json,
};
use futures::{stream::SelectAll, StreamExt};
use tokio_stream::wrappers::ReceiverStream;

use super::{
    acquire, collect_all, compat, error::OpenAiError, guided, submit, ApiError, AppState, Finished, RequestTag,
};
use crate::{
    api::{
        openai::{
            CompletionChoice, CompletionLogprobs, CompletionPrompt, CompletionRequest, CompletionResponse,
            ErrorResponse, Model, ModelList, PromptTokensDetails, SamplingFields, StreamOptions, Usage,
        },
        FinishReason,
    },
    engine::{EngineError, EventReceiver, TokenEvent},
    validation::{GenerateInput, Prompt, ValidationError},
};

/// Most choices one request may ask for.
const MAX_N: u32 = 32;

pub(super) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

pub(super) fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Length => "length",
        FinishReason::EosToken | FinishReason::StopSequence => "stop",
    }
}

pub(super) fn check_model(state: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(model) if *model != state.served_model_name => {
            Err(ApiError::ModelNotFound(model.clone(), state.served_model_name.clone()))
        }
        _ => Ok(()),
    }
}

/// Maps the OpenAI sampling fields onto the shared `GenerateInput`.
pub(super) fn apply_sampling(input: &mut GenerateInput, fields: &SamplingFields) -> Result<u32, ApiError> {
    // OpenAI samples by default (temperature 1); `temperature: 0` asks for greedy decoding.
    input.do_sample = true;
    input.temperature = fields.temperature;
    input.top_p = fields.top_p;
    input.seed = fields.seed;
    input.stop = fields.stop.clone().map(|s| s.into_vec()).unwrap_or_default();
    input.presence_penalty = fields.presence_penalty;
    input.frequency_penalty = fields.frequency_penalty;
    input.repetition_penalty = fields.repetition_penalty;
    input.min_p = fields.min_p;
    input.top_k = match fields.top_k {
        None | Some(-1) | Some(0) => None,
        Some(k) if k > 0 => Some(u32::try_from(k).unwrap_or(u32::MAX)),
        Some(k) => return Err(ValidationError::OutOfRange("top_k", "> 0, or -1 for no limit", k.to_string()).into()),
    };
    input.min_new_tokens = fields.min_tokens.unwrap_or(0);
    input.ignore_eos = fields.ignore_eos;
    input.stop_token_ids = fields.stop_token_ids.clone().unwrap_or_default();
    input.skip_special_tokens = fields.skip_special_tokens.unwrap_or(true);
    input.priority = fields.priority.unwrap_or(0);
    input.cache_salt = fields.cache_salt.clone();
    input.timeout = fields.timeout;
    if let Some(bias) = &fields.logit_bias {
        for (key, &value) in bias {
            let id: u32 = key
                .parse()
                .map_err(|_| ValidationError::OutOfRange("logit_bias", "keyed by token ids", format!("key {key:?}")))?;
            input.logit_bias.insert(id, value);
        }
    }
    let n = fields.n.unwrap_or(1);
    if n == 0 || n > MAX_N {
        return Err(ValidationError::OutOfRange("n", "in [1, 32]", n.to_string()).into());
    }
    Ok(n)
}

pub(super) fn usage(prompts: &[(u32, u32)], choices: &[Finished]) -> Usage {
    let prompt_tokens: u32 = prompts.iter().map(|(tokens, _)| tokens).sum();
    let completion_tokens = choices.iter().map(|c| c.end.num_generated_tokens).sum();
    Usage {
        prompt_tokens,
        completion_tokens,
        total_tokens: prompt_tokens + completion_tokens,
        prompt_tokens_details: PromptTokensDetails {
            cached_tokens: prompts.iter().map(|(_, cached)| cached).sum(),
        },
    }
}

/// Streams several choices as one: each event tagged with its choice index.
type ChoiceStream = SelectAll<futures::stream::BoxStream<'static, (u32, Result<TokenEvent, EngineError>)>>;

pub(super) fn merge(receivers: Vec<EventReceiver>) -> ChoiceStream {
    futures::stream::select_all(
        receivers
            .into_iter()
            .enumerate()
            .map(|(index, rx)| ReceiverStream::new(rx).map(move |event| (index as u32, event)).boxed()),
    )
}

/// Tracks usage over a stream: prompt tokens once per prompt, completion tokens per choice.
pub(super) struct StreamUsage {
    prompt_tokens: u32,
    cached_tokens: u32,
    /// Tokens of the choices that ended, as the engine counted them.
    completion_tokens: u32,
    /// Token events streamed so far, over all choices.
    streamed_tokens: u32,
    /// `stream_options.continuous_usage_stats`: usage on every chunk.
    is_continuous: bool,
}

impl StreamUsage {
    pub(super) fn new(prompt_tokens: u32, options: Option<StreamOptions>) -> Self {
        Self {
            prompt_tokens,
            cached_tokens: 0,
            completion_tokens: 0,
            streamed_tokens: 0,
            is_continuous: options.is_some_and(|o| o.continuous_usage_stats),
        }
    }

    /// Counts one token event; with continuous usage stats, returns the usage so far for its chunk.
    pub(super) fn add(&mut self, event: &TokenEvent, is_first_choice_of_prompt: bool) -> Option<Usage> {
        self.streamed_tokens += 1;
        if let Some(end) = &event.end {
            if is_first_choice_of_prompt {
                self.cached_tokens += end.num_cached_tokens;
            }
            self.completion_tokens += end.num_generated_tokens;
        }
        self.is_continuous.then(|| self.usage(self.streamed_tokens))
    }

    /// The final usage, once every choice ended.
    pub(super) fn total(&self) -> Usage {
        self.usage(self.completion_tokens)
    }

    fn usage(&self, completion_tokens: u32) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens,
            total_tokens: self.prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: self.cached_tokens,
            },
        }
    }
}

pub(super) fn sse_json(value: impl serde::Serialize) -> Result<Event, Infallible> {
    Ok(Event::default().json_data(value).expect("responses serialize"))
}

pub(super) fn sse_error(error: EngineError) -> Result<Event, Infallible> {
    Ok(Event::default()
        .event("error")
        .json_data(ApiError::from(error).openai_body())
        .expect("errors serialize"))
}

/// List the served model.
#[utoipa::path(get, path = "/v1/models", tag = "openai",
    responses((status = 200, body = ModelList), (status = 401, body = ErrorResponse)))]
pub async fn models(State(state): State<AppState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![served_model(&state)],
    })
}

fn served_model(state: &AppState) -> Model {
    Model {
        id: state.served_model_name.clone(),
        object: "model",
        created: state.started_at,
        owned_by: "rill",
        max_model_len: state.limits.max_total_tokens,
    }
}

/// One model by name: the served model, or 404.
#[utoipa::path(get, path = "/v1/models/{id}", tag = "openai", params(("id" = String, Path, description = "Model name")),
    responses((status = 200, body = Model), (status = 404, body = ErrorResponse), (status = 401, body = ErrorResponse)))]
pub async fn model(State(state): State<AppState>, Path(id): Path<String>) -> Result<Json<Model>, OpenAiError> {
    check_model(&state, &Some(id))?;
    Ok(Json(served_model(&state)))
}

/// Legacy completions, streaming or not.
#[utoipa::path(post, path = "/v1/completions", tag = "openai", request_body = CompletionRequest,
    responses((status = 200, body = CompletionResponse), (status = 404, body = ErrorResponse),
              (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse),
              (status = 413, body = ErrorResponse), (status = 422, body = ErrorResponse),
              (status = 429, body = ErrorResponse), (status = 500, body = ErrorResponse),
              (status = 503, body = ErrorResponse), (status = 504, body = ErrorResponse)))]
pub async fn completions(
    State(state): State<AppState>,
    Extension(tag): Extension<RequestTag>,
    body: Result<Json<CompletionRequest>, JsonRejection>,
) -> Result<Response, OpenAiError> {
    let Json(request) = body?;
    check_model(&state, &request.model)?;
    compat::ignore_unknown(&state.engine.metrics, &tag, &request.unknown);
    tracing::debug!(user = ?request.sampling.user, "completion request");
    let prompts: Vec<Prompt> = match request.prompt {
        CompletionPrompt::Text(text) => vec![Prompt::Text {
            text,
            add_special_tokens: true,
        }],
        CompletionPrompt::Texts(texts) => texts
            .into_iter()
            .map(|text| Prompt::Text {
                text,
                add_special_tokens: true,
            })
            .collect(),
        CompletionPrompt::Tokens(ids) => vec![Prompt::Tokens(ids)],
        CompletionPrompt::TokenLists(lists) => lists.into_iter().map(Prompt::Tokens).collect(),
    };
    if prompts.is_empty() {
        return Err(ValidationError::EmptyInput("prompt").into());
    }
    let top_n = request.logprobs.unwrap_or(0);
    if request.echo && request.logprobs.is_some() {
        return Err(ApiError::Unsupported {
            message: "`echo` together with `logprobs` is not supported (prompt logprobs are not computed)".into(),
            param: "echo".into(),
        }
        .into());
    }
    compat::check_inert(&request.inert)?;
    let grammar = guided::from_openai(&request.guided)?;
    let mut n = 1;
    let mut inputs = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let mut input = GenerateInput::new(prompt, "prompt", "max_tokens");
        // OpenAI's default for completions is 16 tokens.
        input.max_new_tokens = Some(request.max_tokens.unwrap_or(16));
        input.top_n_tokens = top_n;
        n = apply_sampling(&mut input, &request.sampling)?;
        input.grammar = grammar.clone();
        inputs.push(input);
    }
    let permit = acquire(&state, inputs.len() as u32 * n)?;
    let mut receivers = Vec::new();
    let mut echoes = Vec::new();
    let mut num_prompt_tokens = 0;
    for input in inputs {
        let (valid, rxs) = submit(&state, &tag, input, n).await?;
        num_prompt_tokens += valid.prompt_ids.len() as u32;
        let echo = if request.echo {
            state.decode(&valid.prompt_ids, false)
        } else {
            String::new()
        };
        echoes.push(echo);
        receivers.extend(rxs);
    }
    let id = format!("cmpl-{}", uuid_like());
    let model = state.served_model_name.clone();
    let created = now();
    let wants_logprobs = request.logprobs.is_some();
    let completion_logprobs = |state: &AppState, tokens: &[TokenEvent], offset: usize| -> CompletionLogprobs {
        let mut logprobs = CompletionLogprobs::default();
        let mut text_offset = offset;
        for event in tokens {
            let text = state.token_text(event.token_id);
            logprobs.text_offset.push(text_offset);
            text_offset += event.text.len();
            logprobs.tokens.push(text);
            logprobs.token_logprobs.push(Some(event.logprob));
            logprobs.top_logprobs.push(Some(
                event
                    .top_logprobs
                    .iter()
                    .map(|&(tid, lp)| (state.token_text(tid), serde_json::json!(lp)))
                    .collect(),
            ));
        }
        logprobs
    };

    if !request.sampling.stream.unwrap_or(false) {
        let _permit = permit;
        let finished = collect_all(receivers).await?;
        let prompts: Vec<(u32, u32)> = finished
            .chunks(n as usize)
            .map(|group| (group[0].end.num_prompt_tokens, group[0].end.num_cached_tokens))
            .collect();
        let choices = finished
            .iter()
            .enumerate()
            .map(|(index, choice)| {
                let echo = &echoes[index / n as usize];
                CompletionChoice {
                    index: index as u32,
                    text: format!("{echo}{}", choice.end.generated_text),
                    logprobs: wants_logprobs.then(|| completion_logprobs(&state, &choice.tokens, echo.len())),
                    finish_reason: Some(finish_reason(choice.end.finish_reason)),
                }
            })
            .collect();
        let usage = usage(&prompts, &finished);
        return Ok(Json(CompletionResponse {
            id,
            object: "text_completion",
            created,
            model,
            choices,
            usage: Some(usage),
        })
        .into_response());
    }

    let include_usage = request.sampling.stream_options.is_some_and(|o| o.include_usage);
    let mut stream_usage = StreamUsage::new(num_prompt_tokens, request.sampling.stream_options);
    let mut events = merge(receivers);
    let stream = async_stream::stream! {
        let _permit = permit;
        let chunk = |choices: Vec<CompletionChoice>, usage: Option<Usage>| CompletionResponse {
            id: id.clone(), object: "text_completion", created, model: model.clone(), choices, usage,
        };
        if request.echo {
            for (prompt_index, echo) in echoes.iter().enumerate() {
                for k in 0..n {
                    let index = prompt_index as u32 * n + k;
                    yield sse_json(chunk(vec![CompletionChoice { index, text: echo.clone(), logprobs: None, finish_reason: None }], None));
                }
            }
        }
        while let Some((index, event)) = events.next().await {
            match event {
                Ok(event) => {
                    let logprobs = wants_logprobs.then(|| completion_logprobs(&state, std::slice::from_ref(&event), 0));
                    let finish = event.end.as_ref().map(|end| finish_reason(end.finish_reason));
                    let usage = stream_usage.add(&event, index % n == 0);
                    yield sse_json(chunk(vec![CompletionChoice { index, text: event.text.clone(), logprobs, finish_reason: finish }], usage));
                }
                Err(error) => {
                    yield sse_error(error);
                    return;
                }
            }
        }
        if include_usage {
            yield sse_json(chunk(Vec::new(), Some(stream_usage.total())));
        }
        yield Ok(Event::default().data("[DONE]"));
    };
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()).into_response())
}

/// A random 24-hex-digit id for responses.
pub(super) fn uuid_like() -> String {
    format!("{:024x}", rand::random::<u128>() >> 32)
}
