//! The one OpenAI responder behind `/v1/completions` and `/v1/chat/completions`: once a request's choices
//! are submitted, `respond` reads them all at once and answers with one JSON body, or streams them as SSE
//! chunks (each tagged with its choice, usage as asked, an `error` event on failure, `[DONE]` at the
//! end). What the two APIs' choices look like is an `OpenAiFormat`.

use std::convert::Infallible;

use axum::{
    response::{
        sse::{Event, KeepAlive, Sse},
        IntoResponse, Response,
    },
    Json,
};
use futures::{stream::SelectAll, StreamExt};
use serde::Serialize;
use tokio::sync::OwnedSemaphorePermit;
use tokio_stream::wrappers::ReceiverStream;

use super::{collect_all, openai::uuid_like, ApiError, AppState, Finished};
use crate::{
    api::openai::{PromptTokensDetails, StreamOptions, Usage},
    engine::{EngineError, EventReceiver, TokenEvent},
};

/// What one response shares across its body or all its chunks.
pub(super) struct ResponseHead {
    /// `<ID_PREFIX>-` and 24 hex digits.
    pub id: String,
    /// Unix time of the response, in seconds.
    pub created: u64,
    /// The served model's name.
    pub model: String,
}

/// How one OpenAI API shapes its choices; `respond` does the rest. Choice `i` is choice `i % n` of
/// prompt `i / n`.
pub(super) trait OpenAiFormat: Send + 'static {
    /// Starts the response's id (`cmpl`, `chatcmpl`).
    const ID_PREFIX: &'static str;
    type Choice;
    type Response: Serialize;
    type ChunkChoice: Send;
    type Chunk: Serialize;

    /// A finished choice, as the non-streaming body shows it.
    fn choice(&self, state: &AppState, index: u32, finished: &Finished) -> Self::Choice;
    /// The non-streaming body.
    fn response(head: ResponseHead, choices: Vec<Self::Choice>, usage: Usage) -> Self::Response;
    /// What the stream opens with before any token, one chunk each (the role, an echoed prompt).
    fn opening(&self) -> Vec<Self::ChunkChoice>;
    /// One token event of choice `index`, as a chunk shows it.
    fn chunk_choice(&mut self, state: &AppState, index: u32, event: &TokenEvent) -> Self::ChunkChoice;
    /// One streamed chunk.
    fn chunk(head: &ResponseHead, choices: Vec<Self::ChunkChoice>, usage: Option<Usage>) -> Self::Chunk;
}

/// A request's submitted choices, ready to answer.
pub(super) struct Submitted {
    /// Every choice's events, `n` per prompt, in order.
    pub receivers: Vec<EventReceiver>,
    /// Choices per prompt.
    pub n: u32,
    /// The `model` the response names (`openai::answering_model`).
    pub model: String,
    /// Prompt tokens over all prompts.
    pub num_prompt_tokens: u32,
    /// The admission permits of the choices, held until the response is complete.
    pub permit: OwnedSemaphorePermit,
}

/// Answers with every choice at once, or as a stream when `stream` is set (`options`: its usage).
pub(super) async fn respond<F: OpenAiFormat>(
    state: AppState,
    format: F,
    submitted: Submitted,
    stream: bool,
    options: Option<StreamOptions>,
) -> Result<Response, ApiError> {
    let head = ResponseHead {
        id: format!("{}-{}", F::ID_PREFIX, uuid_like()),
        created: super::openai::now(),
        model: submitted.model.clone(),
    };
    if stream {
        return Ok(respond_streaming(state, format, head, submitted, options));
    }
    let Submitted {
        receivers, n, permit, ..
    } = submitted;
    let _permit = permit;
    let finished = collect_all(receivers).await?;
    let prompts: Vec<(u32, u32)> = finished
        .chunks(n as usize)
        .map(|group| (group[0].end.num_prompt_tokens, group[0].end.num_cached_tokens))
        .collect();
    let choices = finished
        .iter()
        .enumerate()
        .map(|(index, choice)| format.choice(&state, index as u32, choice))
        .collect();
    let usage = usage(&prompts, &finished);
    Ok(Json(F::response(head, choices, usage)).into_response())
}

fn respond_streaming<F: OpenAiFormat>(
    state: AppState,
    mut format: F,
    head: ResponseHead,
    submitted: Submitted,
    options: Option<StreamOptions>,
) -> Response {
    let Submitted {
        receivers,
        n,
        num_prompt_tokens,
        permit,
        ..
    } = submitted;
    let include_usage = options.is_some_and(|o| o.include_usage);
    let mut stream_usage = StreamUsage::new(num_prompt_tokens, options);
    let mut events = merge(receivers);
    let stream = async_stream::stream! {
        let _permit = permit;
        for choice in format.opening() {
            yield sse_json(F::chunk(&head, vec![choice], None));
        }
        while let Some((index, event)) = events.next().await {
            match event {
                Ok(event) => {
                    let choice = format.chunk_choice(&state, index, &event);
                    let usage = stream_usage.add(&event, index % n == 0);
                    yield sse_json(F::chunk(&head, vec![choice], usage));
                }
                Err(error) => {
                    yield sse_error(error);
                    return;
                }
            }
        }
        if include_usage {
            yield sse_json(F::chunk(&head, Vec::new(), Some(stream_usage.total())));
        }
        yield Ok(Event::default().data("[DONE]"));
    };
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

/// The usage of finished choices: `prompts` holds (prompt tokens, cached tokens) once per prompt.
fn usage(prompts: &[(u32, u32)], choices: &[Finished]) -> Usage {
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

fn merge(receivers: Vec<EventReceiver>) -> ChoiceStream {
    futures::stream::select_all(
        receivers
            .into_iter()
            .enumerate()
            .map(|(index, rx)| ReceiverStream::new(rx).map(move |event| (index as u32, event)).boxed()),
    )
}

/// Tracks usage over a stream: prompt tokens once per prompt, completion tokens per choice.
struct StreamUsage {
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
    fn new(prompt_tokens: u32, options: Option<StreamOptions>) -> Self {
        Self {
            prompt_tokens,
            cached_tokens: 0,
            completion_tokens: 0,
            streamed_tokens: 0,
            is_continuous: options.is_some_and(|o| o.continuous_usage_stats),
        }
    }

    /// Counts one token event; with continuous usage stats, returns the usage so far for its chunk.
    fn add(&mut self, event: &TokenEvent, is_first_choice_of_prompt: bool) -> Option<Usage> {
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
    fn total(&self) -> Usage {
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

fn sse_json(value: impl Serialize) -> Result<Event, Infallible> {
    Ok(Event::default().json_data(value).expect("responses serialize"))
}

fn sse_error(error: EngineError) -> Result<Event, Infallible> {
    Ok(Event::default()
        .event("error")
        .json_data(ApiError::from(error).openai_body())
        .expect("errors serialize"))
}
