//! Request middleware: request ids, access control, and access logs.

use std::time::Instant;

use axum::{
    extract::{Request, State},
    http::{header, HeaderValue, StatusCode},
    middleware::Next,
    response::{IntoResponse, Response},
    Json,
};

use super::AppState;

/// The header that carries a request's id, in and out.
pub const REQUEST_ID: &str = "x-request-id";

/// A request's id: the client's `x-request-id` when it is a sane token, else a fresh one.
#[derive(Debug, Clone)]
pub struct RequestTag(pub String);

fn is_valid_request_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic())
}

/// Tags every request with an id (taken from the client or made here), returns it in the response
/// header, and logs one line per request with its id, route, status and time to response headers.
pub async fn request_id(mut request: Request, next: Next) -> Response {
    let id = request
        .headers()
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|id| is_valid_request_id(id))
        .map_or_else(|| format!("{:032x}", rand::random::<u128>()), str::to_owned);
    request.extensions_mut().insert(RequestTag(id.clone()));
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let started = Instant::now();
    let mut response = next.run(request).await;
    let status = response.status().as_u16();
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

/// `Authorization: Bearer <key>` on the routes it guards, when the server has an API key.
pub async fn require_api_key(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let Some(expected) = state.api_key.as_deref() else {
        return next.run(request).await;
    };
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    if constant_time_eq(given.as_bytes(), expected.as_bytes()) {
        return next.run(request).await;
    }
    let body = serde_json::json!({
        "error": "missing or wrong API key: send `Authorization: Bearer <key>`",
        "error_type": "authentication",
    });
    let mut response = (StatusCode::UNAUTHORIZED, Json(body)).into_response();
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// Compares two byte strings in time that depends only on their lengths, not on where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_exactly() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
    }

    #[test]
    fn request_ids_are_sane_tokens() {
        assert!(is_valid_request_id("abc-123_XYZ"));
        assert!(!is_valid_request_id(""));
        assert!(!is_valid_request_id("has space"));
        assert!(!is_valid_request_id(&"x".repeat(129)));
    }
}
