//! Request middleware: request ids, access control, and access logs.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Instant,
};

use axum::{
    extract::{MatchedPath, Request, State},
    http::{header, HeaderValue, StatusCode},
    middleware::Next,
    response::{IntoResponse, Response},
    Json,
};

use subtle::ConstantTimeEq;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::AppState;
use crate::{
    metrics::{Metrics, Outcome},
    telemetry,
};

/// The header that carries a request's id, in and out.
pub const REQUEST_ID: &str = "x-request-id";

/// A request's id — the client's `x-request-id` when it is a sane token, else a fresh one — and whether
/// the engine has taken it over (from then on the engine counts how it ends).
#[derive(Debug, Clone)]
pub struct RequestTag {
    pub id: String,
    handed_to_engine: Arc<AtomicBool>,
}

impl RequestTag {
    /// The engine accepted the request: its outcome is the engine's to count.
    pub fn hand_to_engine(&self) {
        self.handed_to_engine.store(true, Ordering::SeqCst);
    }
}

/// Counts a request whose client went away before it got a response or reached the engine (while its body
/// was read or its prompt tokenized): nothing else would.
struct AbandonGuard {
    metrics: Arc<Metrics>,
    handed_to_engine: Arc<AtomicBool>,
    is_answered: bool,
}

impl Drop for AbandonGuard {
    fn drop(&mut self) {
        if !self.is_answered && !self.handed_to_engine.load(Ordering::SeqCst) {
            self.metrics.count_request(Outcome::Cancelled);
        }
    }
}

fn is_valid_request_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic())
}

/// Tags every request with an id (taken from the client or made here), returns it in the response
/// header, and logs one line per request with its id, route, status and time to response headers.
/// The handler runs in the request's `request` span (see `telemetry`).
pub async fn request_id(State(state): State<AppState>, mut request: Request, next: Next) -> Response {
    let id = request
        .headers()
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|id| is_valid_request_id(id))
        .map_or_else(|| format!("{:032x}", rand::random::<u128>()), str::to_owned);
    let handed_to_engine = Arc::new(AtomicBool::new(false));
    request.extensions_mut().insert(RequestTag {
        id: id.clone(),
        handed_to_engine: handed_to_engine.clone(),
    });
    let mut guard = AbandonGuard {
        metrics: state.engine.metrics.clone(),
        handed_to_engine,
        is_answered: false,
    };
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or(path.as_str(), MatchedPath::as_str);
    let span = tracing::info_span!(
        target: telemetry::TARGET,
        "request",
        otel.kind = "server",
        request_id = %id,
        http.route = route,
        http.request.method = %method,
        http.response.status_code = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    if let Some(parent) = telemetry::remote_parent(request.headers()) {
        let _ = span.set_parent(parent);
    }
    let started = Instant::now();
    let mut response = next.run(request).instrument(span.clone()).await;
    guard.is_answered = true;
    let status = response.status().as_u16();
    span.record("http.response.status_code", i64::from(status)); // OpenTelemetry has no unsigned ints
    if status >= 500 {
        span.record("otel.status_code", "error");
    }
    tracing::info!(
        request_id = %id,
        %method,
        path,
        status,
        latency_ms = started.elapsed().as_secs_f64() * 1e3,
        "http request"
    );
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(REQUEST_ID, value);
    }
    response
}

/// The header Anthropic's clients send their API key in.
const X_API_KEY: &str = "x-api-key";

/// `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's clients) on the routes it guards,
/// when the server has an API key; either header works on every route.
pub async fn require_api_key(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let Some(expected) = state.api_key.as_deref() else {
        return next.run(request).await;
    };
    let headers = request.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let x_api_key = headers.get(X_API_KEY).and_then(|v| v.to_str().ok());
    let matches =
        |given: Option<&str>| given.is_some_and(|given| bool::from(given.as_bytes().ct_eq(expected.as_bytes())));
    if matches(bearer) || matches(x_api_key) {
        return next.run(request).await;
    }
    let message = "missing or wrong API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`";
    // Each API answers in its own error shape.
    let path = request.uri().path();
    let body = if path.starts_with("/v1/messages") {
        serde_json::json!({"type": "error", "error": {"type": "authentication_error", "message": message}})
    } else if path.starts_with("/v1/") {
        serde_json::json!({"error": {"message": message, "type": "authentication_error", "param": null,
                                     "code": "invalid_api_key"}})
    } else {
        serde_json::json!({"error": message, "error_type": "authentication"})
    };
    let mut response = (StatusCode::UNAUTHORIZED, Json(body)).into_response();
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_sane_tokens() {
        assert!(is_valid_request_id("abc-123_XYZ"));
        assert!(!is_valid_request_id(""));
        assert!(!is_valid_request_id("has space"));
        assert!(!is_valid_request_id(&"x".repeat(129)));
    }
}
