//! The OpenAI-compatible API: `/v1/completions`, `/v1/models`, and the request fields `/v1/chat/completions`
//! (`chat.rs`) shares with them; both answer through `responder.rs`.
//! Requests become the shared `GenerateInput`, so validation, sampling, stop handling and text are
//! exactly the native API's.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::{
    extract::{rejection::JsonRejection, Path, State},
    response::Response,
    Extension, Json,
};

use super::{
    acquire, compat,
    error::OpenAiError,
    guided,
    responder::{respond, OpenAiFormat, ResponseHead, Submitted},
    submit, ApiError, AppState, Finished, RequestTag,
};
use crate::{
    api::{
        openai::{
            CompletionChoice, CompletionLogprobs, CompletionPrompt, CompletionRequest, CompletionResponse,
            ErrorResponse, Model, ModelList, SamplingFields, Usage,
        },
        FinishReason,
    },
    engine::TokenEvent,
    lora::AdapterRef,
    validation::{CachePin, GenerateInput, Prompt, ValidationError},
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

/// The one place a request's `model` is read (every OpenAI route, Anthropic's, and TGI's `adapter_id`):
/// no name or the served model's is the base model (None); a LoRA adapter's name selects it, held for the
/// request (see `AdapterRef`); any other name is a 404 naming it.
pub(super) fn resolve_model(state: &AppState, model: Option<&str>) -> Result<Option<AdapterRef>, ApiError> {
    let Some(model) = model.filter(|model| *model != state.served_model_name) else {
        return Ok(None);
    };
    match state.engine.adapters.resolve(model) {
        Some(adapter) => Ok(Some(adapter)),
        None => Err(model_not_found(state, model)),
    }
}

/// The `model` a response names: the adapter's when the request ran one, else the served model's.
pub(super) fn answering_model(state: &AppState, adapter: Option<&AdapterRef>) -> String {
    adapter.map_or_else(|| state.served_model_name.clone(), |adapter| adapter.name.to_string())
}

/// The 404 of a model name that is neither the served model's nor a LoRA adapter's: it lists those.
fn model_not_found(state: &AppState, model: &str) -> ApiError {
    let adapters: Vec<String> = state
        .engine
        .adapters
        .ready()
        .iter()
        .map(|adapter| format!("`{}`", adapter.name))
        .collect();
    let served = match adapters.is_empty() {
        true => format!("`{}`", state.served_model_name),
        false => format!(
            "`{}` and the LoRA adapters {}",
            state.served_model_name,
            adapters.join(", ")
        ),
    };
    ApiError::ModelNotFound(model.into(), served)
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
    input.cache_pin = fields
        .prompt_cache_key
        .clone()
        .map(|key| CachePin::new("prompt_cache_key", key));
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

/// List the served model and its LoRA adapters (each with the served model as `parent`).
#[utoipa::path(get, path = "/v1/models", tag = "openai",
    responses((status = 200, body = ModelList), (status = 401, body = ErrorResponse)))]
pub async fn models(State(state): State<AppState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: served_models(&state),
    })
}

/// The served model, then its ready LoRA adapters in load order.
fn served_models(state: &AppState) -> Vec<Model> {
    let base = Model {
        id: state.served_model_name.clone(),
        object: "model",
        created: state.started_at,
        owned_by: "rill",
        max_model_len: state.limits.max_total_tokens,
        root: state.model_id.clone(),
        parent: None,
    };
    let adapters = state.engine.adapters.ready().into_iter().map(|adapter| Model {
        id: adapter.name.to_string(),
        created: adapter.created,
        root: adapter.path,
        parent: Some(state.served_model_name.clone()),
        ..base.clone()
    });
    std::iter::once(base.clone()).chain(adapters).collect()
}

/// One model by name: the served model or a LoRA adapter, or 404.
#[utoipa::path(get, path = "/v1/models/{id}", tag = "openai", params(("id" = String, Path, description = "Model name")),
    responses((status = 200, body = Model), (status = 404, body = ErrorResponse), (status = 401, body = ErrorResponse)))]
pub async fn model(State(state): State<AppState>, Path(id): Path<String>) -> Result<Json<Model>, OpenAiError> {
    match served_models(&state).into_iter().find(|model| model.id == id) {
        Some(model) => Ok(Json(model)),
        None => Err(model_not_found(&state, &id).into()),
    }
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
    let CompletionInputs { inputs, n, adapter } = completion_inputs(&state, &tag, &request)?;
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
    let format = Completions {
        echoes,
        is_echo: request.echo,
        n,
        wants_logprobs: request.logprobs.is_some(),
    };
    let submitted = Submitted {
        receivers,
        n,
        model: answering_model(&state, adapter.as_ref()),
        num_prompt_tokens,
        permit,
    };
    let stream = request.sampling.stream.unwrap_or(false);
    Ok(respond(state, format, submitted, stream, request.sampling.stream_options).await?)
}

/// A completion request's inputs, one per prompt, each with its `n` choices: what `/v1/completions` submits
/// and `/v1/completions/render` shows.
pub(super) struct CompletionInputs {
    pub inputs: Vec<GenerateInput>,
    pub n: u32,
    pub adapter: Option<AdapterRef>,
}

/// Reads a completion request into its inputs (every check before validation).
pub(super) fn completion_inputs(
    state: &AppState,
    tag: &RequestTag,
    request: &CompletionRequest,
) -> Result<CompletionInputs, ApiError> {
    let adapter = resolve_model(state, request.model.as_deref())?;
    compat::ignore_unknown(&state.engine.metrics, tag, &request.unknown);
    tracing::debug!(user = ?request.sampling.user, "completion request");
    let prompts = prompts(&request.prompt);
    if prompts.is_empty() {
        return Err(ValidationError::EmptyInput("prompt").into());
    }
    let top_n = request.logprobs.unwrap_or(0);
    if request.echo && request.logprobs.is_some() {
        return Err(ApiError::Unsupported {
            message: "`echo` together with `logprobs` is not supported (prompt logprobs are not computed)".into(),
            param: "echo".into(),
        });
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
        input.adapter = adapter.clone();
        inputs.push(input);
    }
    Ok(CompletionInputs { inputs, n, adapter })
}

/// The prompts of a completion request: one, or a batch.
fn prompts(prompt: &CompletionPrompt) -> Vec<Prompt> {
    let text = |text| Prompt::Text {
        text,
        add_special_tokens: true,
    };
    match prompt {
        CompletionPrompt::Text(one) => vec![text(one.clone())],
        CompletionPrompt::Texts(texts) => texts.iter().cloned().map(text).collect(),
        CompletionPrompt::Tokens(ids) => vec![Prompt::Tokens(ids.clone())],
        CompletionPrompt::TokenLists(lists) => lists.iter().cloned().map(Prompt::Tokens).collect(),
    }
}

/// How completions show their choices: text (after the echoed prompt, with `echo`) and its logprobs.
struct Completions {
    /// Per prompt: its text with `echo`, else empty.
    echoes: Vec<String>,
    /// `echo`: the stream opens with the prompts.
    is_echo: bool,
    /// Choices per prompt.
    n: u32,
    wants_logprobs: bool,
}

impl Completions {
    /// The logprobs of `tokens`, whose text starts at byte `offset` of the choice's text.
    fn logprobs(&self, state: &AppState, tokens: &[TokenEvent], offset: usize) -> Option<CompletionLogprobs> {
        if !self.wants_logprobs {
            return None;
        }
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
        Some(logprobs)
    }
}

impl OpenAiFormat for Completions {
    const ID_PREFIX: &'static str = "cmpl";
    type Choice = CompletionChoice;
    type Response = CompletionResponse;
    type ChunkChoice = CompletionChoice;
    type Chunk = CompletionResponse;

    fn choice(&self, state: &AppState, index: u32, finished: &Finished) -> CompletionChoice {
        let echo = &self.echoes[(index / self.n) as usize];
        CompletionChoice {
            index,
            text: format!("{echo}{}", finished.end.generated_text),
            logprobs: self.logprobs(state, &finished.tokens, echo.len()),
            finish_reason: Some(finish_reason(finished.end.finish_reason)),
        }
    }

    fn response(head: ResponseHead, choices: Vec<CompletionChoice>, usage: Usage) -> CompletionResponse {
        Self::chunk(&head, choices, Some(usage))
    }

    /// With `echo`, each choice's prompt.
    fn opening(&self) -> Vec<CompletionChoice> {
        if !self.is_echo {
            return Vec::new();
        }
        self.echoes
            .iter()
            .enumerate()
            .flat_map(|(prompt_index, echo)| {
                (0..self.n).map(move |k| CompletionChoice {
                    index: prompt_index as u32 * self.n + k,
                    text: echo.clone(),
                    logprobs: None,
                    finish_reason: None,
                })
            })
            .collect()
    }

    fn chunk_choice(&mut self, state: &AppState, index: u32, event: &TokenEvent) -> CompletionChoice {
        CompletionChoice {
            index,
            text: event.text.clone(),
            logprobs: self.logprobs(state, std::slice::from_ref(event), 0),
            finish_reason: event.end.as_ref().map(|end| finish_reason(end.finish_reason)),
        }
    }

    fn chunk(head: &ResponseHead, choices: Vec<CompletionChoice>, usage: Option<Usage>) -> CompletionResponse {
        CompletionResponse {
            id: head.id.clone(),
            object: "text_completion",
            created: head.created,
            model: head.model.clone(),
            choices,
            usage,
        }
    }
}

/// A random 24-hex-digit id for responses.
pub(super) fn uuid_like() -> String {
    format!("{:024x}", rand::random::<u128>() >> 32)
}
