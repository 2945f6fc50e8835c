//! `/v1/chat/completions`: the conversation rendered with the model's chat template (with the request's
//! tools, `http::tools`), generated like any request, and each choice's text read back as it streams:
//! the thinking of a reasoning model apart (`--reasoning-parser`), tool calls out (the format of
//! `--tool-call-parser` or the template's).

use axum::{
    extract::{rejection::JsonRejection, State},
    response::Response,
    Extension, Json,
};

use super::{
    acquire, compat,
    error::OpenAiError,
    guided,
    openai::{answering_model, apply_sampling, finish_reason, resolve_model, uuid_like},
    responder::{respond, OpenAiFormat, ResponseHead, Submitted},
    submit,
    tools::OfferedTools,
    ApiError, AppState, Finished, RequestTag,
};
use crate::{
    api::{
        openai::{
            AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
            ChatCompletionResponse, ChatDelta, ChatLogprobs, ErrorResponse, FunctionCall, FunctionCallDelta,
            TokenLogprob, ToolCall, ToolCallDelta, TopLogprob, Usage,
        },
        FinishReason,
    },
    engine::TokenEvent,
    grammar::GrammarSpec,
    lora::AdapterRef,
    text::{
        reasoning::{ReasoningFormat, ReasoningParser},
        tool_calls::{self, Function, Markers, ToolCallFormat, ToolCallParser},
    },
    validation::{GenerateInput, Prompt, ValidationError},
};

/// The chat template's extra variables: `chat_template_kwargs`, `reasoning_effort` and `tools`.
pub(super) fn template_variables(
    request: &ChatCompletionRequest,
    tools: Option<&OfferedTools>,
) -> serde_json::Map<String, serde_json::Value> {
    let mut variables = request.chat_template_kwargs.clone().unwrap_or_default();
    if let Some(effort) = &request.reasoning_effort {
        variables.insert("reasoning_effort".into(), effort.clone().into());
    }
    if let Some(tools) = tools {
        variables.insert("tools".into(), tools.template_value());
    }
    variables
}

/// What a piece of one choice's text turned out to be.
#[derive(Debug, Default)]
pub(super) struct AnswerPiece {
    pub reasoning: String,
    pub content: String,
    /// Pieces of the calls being written (for streams), numbered among the answer's calls.
    pub deltas: Vec<tool_calls::CallDelta>,
    /// Calls completed by this piece.
    pub calls: Vec<tool_calls::ToolCall>,
}

/// Reads one choice's text as it arrives: the reasoning apart, then tool calls out of the answer.
pub(super) struct AnswerReader {
    reasoning: Option<ReasoningParser>,
    tool_calls: Option<ToolCallParser>,
    /// Calls read so far.
    num_calls: u32,
}

impl AnswerReader {
    /// `tool_calls`: the format calls are written in and the functions the answer may call.
    pub(super) fn new(
        reasoning: Option<ReasoningFormat>,
        tool_calls: Option<(ToolCallFormat, &[Function])>,
        prompt: &str,
    ) -> Self {
        Self {
            reasoning: reasoning.map(|format| ReasoningParser::new(format, prompt)),
            tool_calls: tool_calls.map(|(format, functions)| format.parser(functions)),
            num_calls: 0,
        }
    }

    /// The next piece of text; with `is_last`, also everything held back.
    pub(super) fn push(&mut self, text: &str, is_last: bool) -> AnswerPiece {
        let mut piece = AnswerPiece::default();
        let mut answer = match &mut self.reasoning {
            Some(parser) => {
                let mut split = parser.push(text);
                if is_last {
                    let rest = parser.finish();
                    split.reasoning.push_str(&rest.reasoning);
                    split.content.push_str(&rest.content);
                }
                piece.reasoning = split.reasoning;
                split.content
            }
            None => text.to_owned(),
        };
        if let Some(parser) = &mut self.tool_calls {
            let mut parsed = parser.push(&answer);
            if is_last {
                parsed.append(parser.finish());
            }
            answer = parsed.content;
            piece.deltas = parsed.deltas;
            piece.calls = parsed.calls;
        }
        piece.content = answer;
        self.num_calls += piece.calls.len() as u32;
        piece
    }

    /// `finish_reason`: "tool_calls" for an answer that made calls and ended on its own.
    fn finish_reason(&self, reason: FinishReason) -> &'static str {
        match reason {
            FinishReason::EosToken | FinishReason::StopSequence if self.num_calls > 0 => "tool_calls",
            _ => finish_reason(reason),
        }
    }
}

fn reply_call(call: tool_calls::ToolCall) -> ToolCall {
    ToolCall {
        id: format!("call_{}", uuid_like()),
        kind: "function".into(),
        function: FunctionCall {
            name: call.name,
            arguments: call.arguments,
        },
    }
}

/// A streamed piece of a call; its first piece gets the call's id.
fn call_delta(delta: tool_calls::CallDelta) -> ToolCallDelta {
    let is_first = delta.name.is_some();
    ToolCallDelta {
        index: delta.index,
        id: is_first.then(|| format!("call_{}", uuid_like())),
        kind: is_first.then_some("function"),
        function: FunctionCallDelta {
            name: delta.name,
            arguments: delta.arguments,
        },
    }
}

fn chat_logprobs(state: &AppState, tokens: &[TokenEvent]) -> ChatLogprobs {
    ChatLogprobs {
        content: tokens
            .iter()
            .map(|event| {
                let token = state.token_text(event.token_id);
                TokenLogprob {
                    bytes: token.as_bytes().to_vec(),
                    token,
                    logprob: event.logprob,
                    top_logprobs: event
                        .top_logprobs
                        .iter()
                        .map(|&(id, logprob)| {
                            let token = state.token_text(id);
                            TopLogprob {
                                bytes: token.as_bytes().to_vec(),
                                token,
                                logprob,
                            }
                        })
                        .collect(),
                }
            })
            .collect(),
    }
}

/// Sets what `input`'s output may be. Its grammar: the tools' or the request's own, at most one;
/// after the thinking when a reasoning parser is set and the answer to `prompt` may still think.
/// Under `auto`, the tools' grammar (free text, then valid calls once the model starts one) gives
/// way to a `response_format`. With tools, the format's markers stay in the text for its parser to
/// read, even where the tokenizer has them as special tokens.
pub(super) async fn constrain_output(
    state: &AppState,
    input: &mut GenerateInput,
    guided: Option<(GrammarSpec, &'static str)>,
    tools: Option<&OfferedTools>,
    prompt: &str,
) -> Result<(), ApiError> {
    let mut grammar = guided;
    if let Some(tools) = tools {
        let tokenizer = state.validator.tokenizer();
        input.kept_special_tokens = (state.tool_call_format.markers().iter())
            .filter_map(|marker| tokenizer.token_to_id(marker))
            .collect();
        let special_token = |marker: &str| state.validator.special_token(marker);
        let spec = tools.grammar(state.tool_call_format, &Markers(&special_token));
        match &grammar {
            Some((_, field)) if tools.is_enforced() => {
                return Err(ApiError::Unsupported {
                    message: format!("`tool_choice` asks for a tool call, which `{field}` would constrain too"),
                    param: (*field).into(),
                })
            }
            // Compiling (cached) still checks the tools' schemas.
            Some(_) => drop(state.validator.compile_grammar(&spec, "tools").await?),
            None => grammar = Some((spec, "tools")),
        }
    }
    let reasoning = state
        .reasoning_format
        .map(|format| ReasoningParser::new(format, prompt));
    input.grammar = match reasoning.and_then(|parser| parser.starts_in_reasoning()) {
        Some(is_open) => grammar.map(|(answer, field)| {
            let spec = GrammarSpec::AfterReasoning {
                is_open,
                answer: Box::new(answer),
            };
            (spec, field)
        }),
        None => grammar,
    };
    Ok(())
}

/// Chat completions, streaming or not, with the model's own chat template.
#[utoipa::path(post, path = "/v1/chat/completions", tag = "openai", request_body = ChatCompletionRequest,
    responses((status = 200, body = ChatCompletionResponse), (status = 404, body = ErrorResponse),
              (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse),
              (status = 413, body = ErrorResponse), (status = 422, body = ErrorResponse),
              (status = 429, body = ErrorResponse), (status = 500, body = ErrorResponse),
              (status = 503, body = ErrorResponse), (status = 504, body = ErrorResponse)))]
pub async fn chat_completions(
    State(state): State<AppState>,
    Extension(tag): Extension<RequestTag>,
    body: Result<Json<ChatCompletionRequest>, JsonRejection>,
) -> Result<Response, OpenAiError> {
    let Json(request) = body?;
    let ChatInput {
        input,
        n,
        adapter,
        tools,
        prompt,
    } = chat_input(&state, &tag, &request).await?;
    let tool_calls = tools.as_ref().map(|tools| (state.tool_call_format, tools.functions()));
    let new_reader = {
        let (reasoning, prompt) = (state.reasoning_format, prompt.clone());
        move || {
            let tool_calls = tool_calls
                .as_ref()
                .map(|(format, functions)| (*format, functions.as_slice()));
            AnswerReader::new(reasoning, tool_calls, &prompt)
        }
    };
    let model = answering_model(&state, adapter.as_ref());
    let permit = acquire(&state, n)?;
    let (valid, receivers) = submit(&state, &tag, input, n).await?;
    let format = Chat {
        readers: (0..n).map(|_| new_reader()).collect(),
        new_reader: Box::new(new_reader),
        wants_logprobs: request.logprobs,
    };
    let submitted = Submitted {
        receivers,
        n,
        model,
        num_prompt_tokens: valid.prompt_ids.len() as u32,
        permit,
    };
    let stream = request.sampling.stream.unwrap_or(false);
    Ok(respond(state, format, submitted, stream, request.sampling.stream_options).await?)
}

/// A chat request's input, rendered with the chat template: what `/v1/chat/completions` submits and
/// `/v1/chat/completions/render` shows; the tools offered and the rendered prompt, for reading the answer.
pub(super) struct ChatInput {
    pub input: GenerateInput,
    pub n: u32,
    pub adapter: Option<AdapterRef>,
    pub tools: Option<OfferedTools>,
    pub prompt: String,
}

/// Reads a chat request into its input (every check before validation).
pub(super) async fn chat_input(
    state: &AppState,
    tag: &RequestTag,
    request: &ChatCompletionRequest,
) -> Result<ChatInput, ApiError> {
    let adapter = resolve_model(state, request.model.as_deref())?;
    compat::ignore_unknown(&state.engine.metrics, tag, &request.unknown);
    tracing::debug!(user = ?request.sampling.user, "chat completion request");
    if request.messages.is_empty() {
        return Err(ValidationError::EmptyInput("messages").into());
    }
    let tools = OfferedTools::from_request(request)?;
    let prompt = state.render_chat(
        &request.messages,
        request.add_generation_prompt.unwrap_or(true),
        &template_variables(request, tools.as_ref()),
    )?;
    let guided = guided::from_openai(&request.guided)?;
    // The template already holds the special tokens (BOS, role markers): add none when tokenizing.
    let mut input = GenerateInput::new(
        Prompt::Text {
            text: prompt.clone(),
            add_special_tokens: false,
        },
        "messages",
        "max_completion_tokens",
    );
    constrain_output(state, &mut input, guided, tools.as_ref(), &prompt).await?;
    input.max_new_tokens = request.max_completion_tokens.or(request.max_tokens);
    if request.top_logprobs.is_some() && !request.logprobs {
        return Err(
            ValidationError::OutOfRange("top_logprobs", "used with `logprobs: true`", "without it".into()).into(),
        );
    }
    input.top_n_tokens = request.top_logprobs.unwrap_or(0);
    let n = apply_sampling(&mut input, &request.sampling)?;
    compat::check_inert(&request.inert)?;
    input.adapter = adapter.clone();
    Ok(ChatInput {
        input,
        n,
        adapter,
        tools,
        prompt,
    })
}

/// How chat shows its choices: each choice's text read back by an `AnswerReader` into content,
/// reasoning and tool calls.
struct Chat {
    /// The stream's readers, one per choice.
    readers: Vec<AnswerReader>,
    /// A reader for a whole answer.
    new_reader: Box<dyn Fn() -> AnswerReader + Send>,
    wants_logprobs: bool,
}

impl OpenAiFormat for Chat {
    const ID_PREFIX: &'static str = "chatcmpl";
    type Choice = ChatChoice;
    type Response = ChatCompletionResponse;
    type ChunkChoice = ChatChunkChoice;
    type Chunk = ChatCompletionChunk;

    fn choice(&self, state: &AppState, index: u32, finished: &Finished) -> ChatChoice {
        let mut reader = (self.new_reader)();
        let answer = reader.push(&finished.end.generated_text, true);
        let tool_calls: Vec<ToolCall> = answer.calls.into_iter().map(reply_call).collect();
        ChatChoice {
            index,
            message: AssistantMessage {
                role: "assistant",
                content: (!answer.content.is_empty() || tool_calls.is_empty()).then_some(answer.content),
                reasoning_content: (!answer.reasoning.is_empty()).then_some(answer.reasoning),
                tool_calls,
            },
            logprobs: self.wants_logprobs.then(|| chat_logprobs(state, &finished.tokens)),
            finish_reason: reader.finish_reason(finished.end.finish_reason),
        }
    }

    fn response(head: ResponseHead, choices: Vec<ChatChoice>, usage: Usage) -> ChatCompletionResponse {
        ChatCompletionResponse {
            id: head.id,
            object: "chat.completion",
            created: head.created,
            model: head.model,
            choices,
            usage,
        }
    }

    /// Each choice's role.
    fn opening(&self) -> Vec<ChatChunkChoice> {
        (0..self.readers.len() as u32)
            .map(|index| {
                let delta = ChatDelta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                    ..ChatDelta::default()
                };
                ChatChunkChoice {
                    index,
                    delta,
                    logprobs: None,
                    finish_reason: None,
                }
            })
            .collect()
    }

    fn chunk_choice(&mut self, state: &AppState, index: u32, event: &TokenEvent) -> ChatChunkChoice {
        let reader = &mut self.readers[index as usize];
        let logprobs = self
            .wants_logprobs
            .then(|| chat_logprobs(state, std::slice::from_ref(event)));
        let piece = reader.push(&event.text, event.end.is_some());
        let finish = event.end.as_ref().map(|end| reader.finish_reason(end.finish_reason));
        let has_more = !piece.reasoning.is_empty() || !piece.deltas.is_empty();
        let delta = ChatDelta {
            role: None,
            content: (!piece.content.is_empty() || !has_more).then_some(piece.content),
            reasoning_content: (!piece.reasoning.is_empty()).then_some(piece.reasoning),
            tool_calls: (!piece.deltas.is_empty()).then(|| piece.deltas.into_iter().map(call_delta).collect()),
        };
        ChatChunkChoice {
            index,
            delta,
            logprobs,
            finish_reason: finish,
        }
    }

    fn chunk(head: &ResponseHead, choices: Vec<ChatChunkChoice>, usage: Option<Usage>) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: head.id.clone(),
            object: "chat.completion.chunk",
            created: head.created,
            model: head.model.clone(),
            choices,
            usage,
        }
    }
}
