//! OpenAI compatibility over HTTP against the fake shard: the fields today's clients send, unknown
//! fields, `/v1/models/{id}`, CORS preflights.

use axum::{
    body::Body,
    http::{Request, StatusCode},
};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

use super::{
    app,
    tests::{get, post, server, sse_data},
};

#[tokio::test]
async fn harmless_fields_at_their_defaults_are_accepted() {
    let server = server(64, 16).await;
    let body = json!({
        "model": "fake", "messages": [{"role": "user", "content": "w3"}], "max_tokens": 2,
        "tools": null, "tool_choice": "none", "parallel_tool_calls": true, "response_format": {"type": "text"},
        "store": false, "metadata": null, "reasoning_effort": "low", "service_tier": "auto",
        "modalities": ["text"], "chat_template_kwargs": {"enable_thinking": false}, "user": "u1",
        "safety_identifier": "s", "prompt_cache_key": "k", "logprobs": false, "top_logprobs": null,
    });
    let (status, _, text) = post(&server.app, "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let body = json!({"prompt": "w1", "max_tokens": 1, "best_of": 1, "suffix": null, "echo": false});
    let (status, _, text) = post(&server.app, "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
}

#[tokio::test]
async fn inert_fields_asking_for_more_get_a_422_naming_them() {
    let server = server(64, 16).await;
    for (field, value) in [
        ("store", json!(true)),
        ("modalities", json!(["text", "audio"])),
        ("audio", json!({"voice": "alloy"})),
        ("service_tier", json!("flex")),
    ] {
        let mut body = json!({"messages": [{"role": "user", "content": "w3"}], "max_tokens": 1});
        body[field] = value;
        let (status, _, text) = post(&server.app, "/v1/chat/completions", body).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{field}: {text}");
        let error: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(error["error"]["param"], field, "{text}");
        assert!(text.contains(&format!("`{field}`")), "{text}");
    }
}

#[tokio::test]
async fn unknown_fields_are_ignored_logged_and_counted() {
    let server = server(64, 16).await;
    let body = json!({"prompt": "w1", "max_tokens": 1, "seed": 2, "store": false, "response_format": {"type": "text"},
                      "frobnicate": 3, "some_other_servers_extension": {}});
    let (status, _, text) = post(&server.app, "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let metrics = server.state.engine.metrics.render();
    assert!(
        metrics.contains("rill_ignored_request_fields_total{field=\"frobnicate\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("field=\"some_other_servers_extension\"} 1"),
        "{metrics}"
    );
    // Known fields are never counted, whatever struct of the request holds them.
    for known in ["prompt", "max_tokens", "seed", "store", "response_format"] {
        assert!(!metrics.contains(&format!("field=\"{known}\"")), "{known}: {metrics}");
    }
}

#[tokio::test]
async fn continuous_usage_stats_put_usage_on_every_chunk() {
    let server = server(64, 16).await;
    let body = json!({"messages": [{"role": "user", "content": "w3"}], "max_tokens": 3, "stream": true,
                      "stream_options": {"include_usage": true, "continuous_usage_stats": true}});
    let (status, _, text) = post(&server.app, "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let data = sse_data(&text);
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("json"))
        .collect();
    // The role chunk first, then one chunk per token with the running count, then the final usage.
    let counts: Vec<Value> = chunks[1..]
        .iter()
        .map(|c| c["usage"]["completion_tokens"].clone())
        .collect();
    assert_eq!(counts, [json!(1), json!(2), json!(3), json!(3)]);
    assert!(chunks[1..].iter().all(|c| c["usage"]["prompt_tokens"] == 2));
}

#[tokio::test]
async fn one_model_by_id() {
    let server = server(64, 16).await;
    let model = get(&server.app, "/v1/models/fake").await;
    assert_eq!(model["id"], "fake");
    assert_eq!(model["object"], "model");
    let missing = get(&server.app, "/v1/models/gpt-4").await;
    assert_eq!(missing["error"]["code"], "model_not_found");
}

async fn preflight(app: &axum::Router, origin: &str) -> axum::response::Response {
    let request = Request::builder()
        .method("OPTIONS")
        .uri("/v1/chat/completions")
        .header("origin", origin)
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "authorization,content-type")
        .body(Body::empty())
        .expect("valid request");
    app.clone().oneshot(request).await.expect("infallible")
}

#[tokio::test]
async fn cors_preflights_from_allowed_origins_succeed_even_with_an_api_key() {
    let server = server(64, 16).await;
    assert_eq!(
        preflight(&server.app, "https://ui.example").await.status(),
        StatusCode::METHOD_NOT_ALLOWED
    );
    let mut state = server.state.clone();
    state.cors_allow_origins = vec!["https://ui.example".into()];
    state.api_key = Some("s3cret".into());
    let app = app(state);
    let response = preflight(&app, "https://ui.example").await;
    assert!(response.status().is_success(), "{}", response.status());
    assert_eq!(response.headers()["access-control-allow-origin"], "https://ui.example");
    let response = preflight(&app, "https://evil.example").await;
    assert!(response.headers().get("access-control-allow-origin").is_none());
    // An actual request from the allowed origin carries the header too.
    let request = Request::builder()
        .uri("/health")
        .header("origin", "https://ui.example")
        .body(Body::empty())
        .expect("valid request");
    let response = app.clone().oneshot(request).await.expect("infallible");
    assert_eq!(response.headers()["access-control-allow-origin"], "https://ui.example");
    let _ = response.into_body().collect().await;
}
