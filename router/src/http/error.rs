//! One error type for every handler and its one mapping to a status code. The native API renders it
//! as TGI's `{"error", "error_type"}`; `/v1/*` wraps it in `OpenAiError` for OpenAI's
//! `{"error": {"message", "type", "param", "code"}}`, and `/v1/messages*` in `AnthropicError` for
//! Anthropic's `{"type": "error", "error": {"type", "message"}}`.

use axum::{
    extract::rejection::JsonRejection,
    http::{header, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    Json,
};

use crate::{
    api::{openai, ErrorResponse},
    chat_template::ChatTemplateError,
    engine::EngineError,
    lora::LoraError,
    shard::ShardError,
    validation::ValidationError,
};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    Validation(#[from] ValidationError),
    #[error("{0}")]
    ChatTemplate(#[from] ChatTemplateError),
    #[error("invalid request body: {0}")]
    BadRequest(String),
    #[error("the request body is larger than --max-body-bytes: {0}")]
    PayloadTooLarge(String),
    #[error("invalid request: {0}")]
    Unprocessable(String),
    #[error("{message}")]
    Unsupported { message: String, param: String },
    /// `tools` or `tool_choice` do not make sense (answered with 400).
    #[error("{message}")]
    InvalidTools { message: String, param: String },
    /// A field of a Responses request that does not make sense (answered with 400).
    #[error("{message}")]
    InvalidField { message: String, param: String },
    /// `GET`/`DELETE /v1/responses/{id}` of an id that is not stored.
    #[error("Response with id '{0}' not found (never stored, deleted, or evicted or expired from the store)")]
    ResponseNotFound(String),
    /// `previous_response_id` names a response that is not stored (answered with 400, as OpenAI does).
    #[error("Previous response with id '{0}' not found (never stored, stored with `store: false`, deleted, or evicted or expired from the store)")]
    PreviousResponseNotFound(String),
    /// `POST /v1/responses/{id}/cancel` of a response that is not running in the background.
    #[error("{0}")]
    NotCancellable(String),
    /// A `model` (or `adapter_id`) naming neither the served model nor a LoRA adapter; the second field
    /// lists what is served.
    #[error("The model `{0}` does not exist; this server serves {1}")]
    ModelNotFound(String, String),
    /// Runtime LoRA loading is off (`--enable-lora-loading`).
    #[error("loading LoRA adapters at run time is off: start the router with --enable-lora-loading")]
    LoraLoadingDisabled,
    /// A LoRA load or unload the registry refused (a taken or unknown name).
    #[error("{0}")]
    Lora(#[from] crate::lora::LoraError),
    /// A LoRA adapter the shards could not load: a folder a shard refused (its message says why), or a
    /// shard that failed.
    #[error("loading the lora adapter `{name}` from {path} failed: {error}")]
    LoraLoad {
        name: String,
        path: String,
        error: ShardError,
    },
    #[error("the server has --max-concurrent-requests = {0} requests in flight; retry later")]
    Overloaded(u32),
    #[error("the queue holds --max-waiting-requests = {0} requests; retry later")]
    QueueFull(u32),
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("{0}")]
    Engine(#[from] EngineError),
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        match rejection {
            // Well-formed JSON whose fields have the wrong names, types or values.
            JsonRejection::JsonDataError(e) => ApiError::Unprocessable(e.body_text()),
            other if other.status() == StatusCode::PAYLOAD_TOO_LARGE => ApiError::PayloadTooLarge(other.body_text()),
            other => ApiError::BadRequest(other.body_text()),
        }
    }
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            // A grammar that does not compile is a malformed request, as in OpenAI's API.
            ApiError::Validation(ValidationError::InvalidGrammar(..)) => StatusCode::BAD_REQUEST,
            ApiError::Validation(ValidationError::GrammarCompile(_)) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Validation(_) | ApiError::Unprocessable(_) | ApiError::ChatTemplate(_) => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            ApiError::Unsupported { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::BadRequest(_)
            | ApiError::InvalidTools { .. }
            | ApiError::InvalidField { .. }
            | ApiError::PreviousResponseNotFound(_)
            | ApiError::NotCancellable(_) => StatusCode::BAD_REQUEST,
            ApiError::ResponseNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::ModelNotFound(..) | ApiError::LoraLoadingDisabled => StatusCode::NOT_FOUND,
            ApiError::Lora(LoraError::Unknown(_)) => StatusCode::NOT_FOUND,
            ApiError::Lora(LoraError::Duplicate(_) | LoraError::InvalidName(_)) => StatusCode::BAD_REQUEST,
            // A folder a shard refused is the request's fault; a shard that failed or timed out is not.
            ApiError::LoraLoad {
                error: ShardError::Refused { .. },
                ..
            } => StatusCode::BAD_REQUEST,
            ApiError::LoraLoad { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Overloaded(_) | ApiError::QueueFull(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Engine(EngineError::QueueTimeout(_)) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Engine(EngineError::Deadline(_)) => StatusCode::GATEWAY_TIMEOUT,
            // Only a stream ever sees it (as an SSE `error` event): its client stopped reading.
            ApiError::Engine(EngineError::SlowReader(_)) => StatusCode::REQUEST_TIMEOUT,
            ApiError::Engine(EngineError::Closed | EngineError::Stopped) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Engine(EngineError::Shard(_) | EngineError::Detokenize(_)) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The TGI `error_type` name.
    pub fn error_type(&self) -> &'static str {
        match self {
            ApiError::Overloaded(_) | ApiError::QueueFull(_) => "overloaded",
            ApiError::ShuttingDown => "unavailable",
            ApiError::ModelNotFound(..) => "model_not_found",
            ApiError::Engine(_) => "generation",
            ApiError::LoraLoadingDisabled | ApiError::Lora(_) | ApiError::LoraLoad { .. } => "lora",
            _ => "validation",
        }
    }

    /// The request field the error is about, when there is one.
    pub fn param(&self) -> Option<String> {
        match self {
            ApiError::Validation(e) => e.param().map(str::to_owned),
            ApiError::ChatTemplate(_) => Some("messages".into()),
            ApiError::Unsupported { param, .. }
            | ApiError::InvalidTools { param, .. }
            | ApiError::InvalidField { param, .. } => Some(param.clone()),
            ApiError::PreviousResponseNotFound(_) => Some("previous_response_id".into()),
            ApiError::ModelNotFound(..) => Some("model".into()),
            ApiError::Lora(_) => Some("lora_name".into()),
            ApiError::LoraLoad { .. } => Some("lora_path".into()),
            _ => None,
        }
    }

    pub fn body(&self) -> ErrorResponse {
        ErrorResponse {
            error: self.to_string(),
            error_type: self.error_type().into(),
        }
    }

    pub fn openai_body(&self) -> openai::ErrorResponse {
        let status = self.status();
        let (kind, code) = match self {
            ApiError::ModelNotFound(..) => ("invalid_request_error", Some("model_not_found")),
            ApiError::PreviousResponseNotFound(_) => ("invalid_request_error", Some("previous_response_not_found")),
            ApiError::Overloaded(_) | ApiError::QueueFull(_) => ("rate_limit_error", Some("rate_limit_exceeded")),
            _ if status.is_server_error() => ("server_error", None),
            _ => ("invalid_request_error", None),
        };
        openai::ErrorResponse {
            error: openai::ErrorBody {
                message: self.to_string(),
                kind: kind.into(),
                param: self.param(),
                code: code.map(str::to_owned),
            },
        }
    }

    /// Anthropic's error body and status: its API has no 422, so a request it cannot serve is a 400
    /// `invalid_request_error`, as every other client error whose status has no type of its own.
    pub fn anthropic_body(&self) -> (StatusCode, serde_json::Value) {
        let status = match self.status() {
            StatusCode::UNPROCESSABLE_ENTITY => StatusCode::BAD_REQUEST,
            status => status,
        };
        let kind = match status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            status if status.is_server_error() => "api_error",
            _ => "invalid_request_error",
        };
        let body = serde_json::json!({"type": "error", "error": {"type": kind, "message": self.to_string()}});
        (status, body)
    }

    fn respond(self, body: impl serde::Serialize) -> Response {
        let status = self.status();
        self.respond_as(status, body)
    }

    fn respond_as(self, status: StatusCode, body: impl serde::Serialize) -> Response {
        if status.is_server_error() {
            tracing::error!(error = %self, "request failed");
        }
        let mut response = (status, Json(body)).into_response();
        if status == StatusCode::TOO_MANY_REQUESTS {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body();
        self.respond(body)
    }
}

/// An `ApiError` rendered in OpenAI's shape, for the `/v1/*` routes.
#[derive(Debug)]
pub struct OpenAiError(pub ApiError);

impl<E: Into<ApiError>> From<E> for OpenAiError {
    fn from(error: E) -> Self {
        OpenAiError(error.into())
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        let body = self.0.openai_body();
        self.0.respond(body)
    }
}

/// An `ApiError` rendered in Anthropic's shape, for the `/v1/messages*` routes.
#[derive(Debug)]
pub struct AnthropicError(pub ApiError);

impl<E: Into<ApiError>> From<E> for AnthropicError {
    fn from(error: E) -> Self {
        AnthropicError(error.into())
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        let (status, body) = self.0.anthropic_body();
        self.0.respond_as(status, body)
    }
}
