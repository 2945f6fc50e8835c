//! One error type for every handler, and its one mapping to a status code and a JSON body.

use axum::{
    extract::rejection::JsonRejection,
    http::{header, StatusCode},
    response::{IntoResponse, Response},
    Json,
};

use crate::{api::ErrorResponse, engine::EngineError, validation::ValidationError};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    Validation(#[from] ValidationError),
    #[error("invalid request body: {0}")]
    BadRequest(String),
    #[error("invalid request: {0}")]
    Unprocessable(String),
    #[error("the server has --max-concurrent-requests = {0} requests in flight; retry later")]
    Overloaded(u32),
    #[error("{0}")]
    Engine(#[from] EngineError),
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        match rejection {
            // Well-formed JSON whose fields have the wrong names, types or values.
            JsonRejection::JsonDataError(e) => ApiError::Unprocessable(e.body_text()),
            other => ApiError::BadRequest(other.body_text()),
        }
    }
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Validation(_) | ApiError::Unprocessable(_) => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Engine(EngineError::Closed) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Engine(EngineError::Shard(_) | EngineError::Detokenize(_)) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }

    /// The TGI `error_type` name.
    pub fn error_type(&self) -> &'static str {
        match self {
            ApiError::Validation(_) | ApiError::Unprocessable(_) | ApiError::BadRequest(_) => {
                "validation"
            }
            ApiError::Overloaded(_) => "overloaded",
            ApiError::Engine(_) => "generation",
        }
    }

    pub fn body(&self) -> ErrorResponse {
        ErrorResponse {
            error: self.to_string(),
            error_type: self.error_type(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::error!(error = %self, "request failed");
        }
        let mut response = (status, Json(self.body())).into_response();
        if status == StatusCode::TOO_MANY_REQUESTS {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        response
    }
}
