//! `/v1/messages` and `/v1/messages/count_tokens` over HTTP: the real app and engine against the fake
//! shard (which counts on from the prompt's last word: "w3 w0" → " w1 w2 ...").

use axum::{
    body::Body,
    http::{Request, StatusCode},
};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

use super::super::{
    app,
    tests::{post, server},
};

fn body(fields: Value) -> Value {
    let mut body = json!({"model": "fake", "max_tokens": 3, "messages": [{"role": "user", "content": "w3"}]});
    body.as_object_mut()
        .expect("an object")
        .extend(fields.as_object().expect("an object").clone());
    body
}

/// The SSE events of a stream, as (event name, data).
fn events(text: &str) -> Vec<(String, Value)> {
    let mut events = Vec::new();
    let mut name = None;
    for line in text.lines() {
        if let Some(event) = line.strip_prefix("event:") {
            name = Some(event.trim().to_owned());
        } else if let Some(data) = line.strip_prefix("data:") {
            let data: Value = serde_json::from_str(data.trim()).expect("JSON data");
            let name = name.take().expect("every event is named");
            assert_eq!(data["type"], name.as_str(), "the data's type is the event's name");
            events.push((name, data));
        }
    }
    events
}

#[tokio::test]
async fn streamed_and_whole_messages_agree() {
    let server = server(64, 16).await;
    let (status, _, text) = post(&server.app, "/v1/messages", body(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let whole: Value = serde_json::from_str(&text).expect("JSON");
    assert!(whole["id"].as_str().expect("an id").starts_with("msg_"), "{whole}");
    assert_eq!(whole["type"], "message");
    assert_eq!(whole["role"], "assistant");
    assert_eq!(whole["content"], json!([{"type": "text", "text": " w1 w2 w3"}]));
    assert_eq!(whole["stop_reason"], "max_tokens");
    assert_eq!(whole["stop_sequence"], Value::Null);
    let usage = &whole["usage"];
    assert_eq!(usage["output_tokens"], 3);
    let num_prompt_tokens =
        usage["input_tokens"].as_u64().expect("a count") + usage["cache_read_input_tokens"].as_u64().expect("a count");
    assert_eq!(num_prompt_tokens, 2);

    let (status, _, text) = post(&server.app, "/v1/messages", body(json!({"stream": true}))).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let events = events(&text);
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    let mut expected = vec!["message_start", "content_block_start", "ping"];
    expected.extend(["content_block_delta"; 3]);
    expected.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(names, expected);
    assert_eq!(events[0].1["message"]["content"], json!([]));
    assert_eq!(events[0].1["message"]["usage"]["input_tokens"], 2);
    assert_eq!(events[1].1["content_block"], json!({"type": "text", "text": ""}));
    let streamed: String = events
        .iter()
        .filter_map(|(_, data)| data["delta"]["text"].as_str())
        .collect();
    assert_eq!(streamed, " w1 w2 w3");
    let delta = &events[events.len() - 2].1;
    assert_eq!(
        delta["delta"],
        json!({"stop_reason": "max_tokens", "stop_sequence": null})
    );
    assert_eq!(delta["usage"]["output_tokens"], 3);
    // The final usage splits the prompt into computed and cached tokens.
    let total = delta["usage"]["input_tokens"].as_u64().expect("a count")
        + delta["usage"]["cache_read_input_tokens"].as_u64().expect("a count");
    assert_eq!(total, 2);
}

#[tokio::test]
async fn stop_sequences_and_count_tokens() {
    let server = server(64, 16).await;
    let (status, _, text) = post(
        &server.app,
        "/v1/messages",
        body(json!({"stop_sequences": ["w9", "w2"]})),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let message: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(message["stop_reason"], "stop_sequence");
    assert_eq!(message["stop_sequence"], "w2");
    assert_eq!(message["content"], json!([{"type": "text", "text": " w1 "}]));
    let mut count_body = body(json!({"system": "w5 w6"}));
    count_body.as_object_mut().expect("an object").remove("max_tokens");
    let (status, _, text) = post(&server.app, "/v1/messages/count_tokens", count_body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let count: Value = serde_json::from_str(&text).expect("JSON");
    count_body["max_tokens"] = json!(1);
    let (_, _, text) = post(&server.app, "/v1/messages", count_body).await;
    let usage = serde_json::from_str::<Value>(&text).expect("JSON")["usage"].clone();
    let total =
        usage["input_tokens"].as_u64().expect("a count") + usage["cache_read_input_tokens"].as_u64().expect("a count");
    assert_eq!(count, json!({"input_tokens": total}));
    assert_eq!(total, 4, "the system turn, the user's and the generation prompt");
}

#[tokio::test]
async fn errors_have_anthropic_shape() {
    let server = server(64, 16).await;
    let error = |text: &str| serde_json::from_str::<Value>(text).expect("JSON");
    let mut no_max_tokens = body(json!({}));
    no_max_tokens.as_object_mut().expect("an object").remove("max_tokens");
    let (status, _, text) = post(&server.app, "/v1/messages", no_max_tokens).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
    let error_body = error(&text);
    assert_eq!(error_body["type"], "error");
    assert_eq!(error_body["error"]["type"], "invalid_request_error");
    assert!(
        error_body["error"]["message"]
            .as_str()
            .expect("a message")
            .contains("`max_tokens`"),
        "{text}"
    );
    let (status, _, text) = post(
        &server.app,
        "/v1/messages",
        body(json!({"tool_choice": {"type": "some"}})),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
    assert!(
        error(&text)["error"]["message"]
            .as_str()
            .expect("a message")
            .contains("tool_choice"),
        "{text}"
    );
    let (status, _, text) = post(&server.app, "/v1/messages", body(json!({"model": "claude"}))).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{text}");
    assert_eq!(error(&text)["error"]["type"], "not_found_error");
    let (status, _, text) = post(&server.app, "/v1/messages", body(json!({"max_tokens": 1000}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
    assert!(
        error(&text)["error"]["message"]
            .as_str()
            .expect("a message")
            .contains("max_tokens"),
        "{text}"
    );
}

#[tokio::test]
async fn an_api_key_is_accepted_in_x_api_key() {
    let server = server(64, 16).await;
    let mut state = server.state.clone();
    state.api_key = Some("s3cret".into());
    let app = app(state);
    let send = |key: &'static str| {
        let app = app.clone();
        async move {
            let request = Request::builder()
                .method("POST")
                .uri("/v1/messages")
                .header("content-type", "application/json")
                .header("x-api-key", key)
                .header("anthropic-version", "2023-06-01")
                .body(Body::from(body(json!({})).to_string()))
                .expect("valid request");
            let response = app.oneshot(request).await.expect("infallible");
            let status = response.status();
            let bytes = response.into_body().collect().await.expect("body").to_bytes();
            (status, serde_json::from_slice::<Value>(&bytes).expect("JSON"))
        }
    };
    let (status, wrong) = send("wrong").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(wrong["error"]["type"], "authentication_error");
    assert_eq!(send("s3cret").await.0, StatusCode::OK);
}

#[tokio::test]
async fn output_config_and_a_forced_tool_call_do_not_mix() {
    let server = server(64, 16).await;
    let tools = json!([{"name": "f", "input_schema": {"type": "object"}}]);
    let format = json!({"format": {"type": "json_schema", "schema": {"type": "object"}}});
    let fields = json!({"tools": tools, "tool_choice": {"type": "any"}, "output_config": format});
    let (status, _, text) = post(&server.app, "/v1/messages", body(fields)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
    assert!(text.contains("`output_config`"), "{text}");
}

/// Every turn of one conversation with `cache_control` pins under one key (so each turn's pin replaces
/// the last), another conversation under another, and none without `cache_control`.
#[test]
fn cache_control_pins_a_conversation_under_one_key() {
    use super::{cache_pin, convert::convert};
    let pin_of = |fields: Value| {
        let request = serde_json::from_value(body(fields)).expect("a valid request");
        cache_pin(&convert(&request).expect("converts"))
    };
    let system = json!([{"type": "text", "text": "Be an agent.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]);
    let first = pin_of(json!({"system": system})).expect("cache_control asks for a pin");
    assert_eq!(first.ttl, Some(std::time::Duration::from_secs(3600)));
    let later_turn = json!({"system": system, "messages": [
        {"role": "user", "content": "w3"},
        {"role": "assistant", "content": "w4 w5"},
        {"role": "user", "content": "w6"},
    ]});
    assert_eq!(pin_of(later_turn).expect("a pin").key, first.key);
    let other = json!({"system": system, "messages": [{"role": "user", "content": "w7"}]});
    assert_ne!(pin_of(other).expect("a pin").key, first.key);
    assert_eq!(pin_of(json!({"system": "Be an agent."})), None);
}
