//! LoRA over HTTP, against the fake shard: adapters at start (`--lora-adapters`) and at run time (the
//! load and unload endpoints), selection by OpenAI's `model` and TGI's `adapter_id`, 404s, `/v1/models`,
//! `/info`, draining, the per-call adapter bound, prefix-cache isolation and the metrics.

use std::path::PathBuf;

use axum::{body::Body, http::Request, http::StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

use super::tests::{get, post, start, test_config, try_start, TestServer};
use crate::{
    config::LoraConfig,
    scheduler::{BatchingMode, KvAdmission, PreemptionMode},
    shard::fake::FakeShard,
};

/// A server whose fake shard has `max_loras` slots, started with `lora`'s flags.
async fn lora_server(max_loras: u32, lora: LoraConfig) -> anyhow::Result<TestServer> {
    let mut config = test_config(
        64,
        BatchingMode::Continuous,
        PreemptionMode::Recompute,
        KvAdmission::Incremental,
    );
    config.lora = lora;
    try_start(config, FakeShard::new(64, 4).with_lora(max_loras)).await
}

fn adapters(items: &[(&str, &str)]) -> LoraConfig {
    LoraConfig {
        adapters: items.iter().map(|(n, p)| (n.to_string(), PathBuf::from(p))).collect(),
        is_loading_enabled: false,
    }
}

/// With `sql` and `chat` loaded at start, on 2 slots, runtime loading on.
async fn two_adapters() -> TestServer {
    let mut lora = adapters(&[("sql", "/a/sql"), ("chat", "/a/chat")]);
    lora.is_loading_enabled = true;
    lora_server(2, lora).await.expect("the adapters load")
}

async fn completion(server: &TestServer, model: &str, prompt: &str) -> (StatusCode, Value) {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0});
    let (status, _, text) = post(&server.app, "/v1/completions", body).await;
    (status, serde_json::from_str(&text).expect("json body"))
}

/// A TGI `/generate` with `adapter_id`: the status and the body.
async fn generate(server: &TestServer, adapter_id: Option<&str>, inputs: &str) -> (StatusCode, Value) {
    let body =
        json!({"inputs": inputs, "parameters": {"max_new_tokens": 1, "details": true, "adapter_id": adapter_id}});
    let (status, _, text) = post(&server.app, "/generate", body).await;
    (status, serde_json::from_str(&text).expect("json body"))
}

async fn load(server: &TestServer, name: &str, path: &str) -> (StatusCode, String) {
    let body = json!({"lora_name": name, "lora_path": path});
    let (status, _, text) = post(&server.app, "/v1/load_lora_adapter", body).await;
    (status, text)
}

async fn unload(server: &TestServer, name: &str) -> (StatusCode, String) {
    let (status, _, text) = post(&server.app, "/v1/unload_lora_adapter", json!({"lora_name": name})).await;
    (status, text)
}

async fn metrics(server: &TestServer) -> String {
    let request = Request::builder()
        .uri("/metrics")
        .body(Body::empty())
        .expect("valid request");
    let response = server.app.clone().oneshot(request).await.expect("infallible");
    let bytes = response.into_body().collect().await.expect("body").to_bytes();
    String::from_utf8(bytes.to_vec()).expect("utf-8")
}

#[tokio::test]
async fn lora_flags_need_lora_slots_on_the_shards() {
    for lora in [
        adapters(&[("sql", "/a/sql")]),
        LoraConfig {
            adapters: Vec::new(),
            is_loading_enabled: true,
        },
    ] {
        let error = lora_server(0, lora).await.err().expect("refused").to_string();
        assert!(error.contains("--max-loras"), "{error}");
    }
}

#[tokio::test]
async fn an_adapter_the_shard_refuses_stops_the_start_with_its_reason() {
    let error = lora_server(2, adapters(&[("sql", "/a/missing")]))
        .await
        .err()
        .expect("refused");
    let error = format!("{error:#}");
    assert!(
        error.contains("`sql`") && error.contains("/a/missing has no adapter_config.json"),
        "{error}"
    );
}

#[tokio::test]
async fn models_and_info_list_the_adapters_with_their_base() {
    let server = two_adapters().await;
    let models = get(&server.app, "/v1/models").await;
    let data = models["data"].as_array().expect("a list");
    let ids: Vec<&str> = data.iter().map(|m| m["id"].as_str().expect("id")).collect();
    assert_eq!(ids, ["fake", "sql", "chat"]);
    assert_eq!(data[0]["parent"], Value::Null);
    assert_eq!(data[1]["parent"], "fake");
    assert_eq!(data[1]["root"], "/a/sql");
    assert_eq!(data[1]["object"], "model");
    assert_eq!(get(&server.app, "/v1/models/chat").await["root"], "/a/chat");
    let info = get(&server.app, "/info").await;
    assert_eq!(info["lora"]["max_loras"], 2);
    assert_eq!(info["lora"]["runtime_loading"], true);
    assert_eq!(info["lora"]["adapters"][0]["name"], "sql");
    assert_eq!(info["lora"]["adapters"][0]["id"], 1);
    assert_eq!(info["lora"]["adapters"][1]["rank"], 8);
    assert_eq!(server.shard.adapters().len(), 2);
}

#[tokio::test]
async fn model_and_adapter_id_select_an_adapter_and_unknown_names_get_404() {
    let server = two_adapters().await;
    let (status, body) = completion(&server, "sql", "w1 w2").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["model"], "sql", "the answer names the adapter, as vLLM's does");
    assert_eq!(
        server.shard.max_adapters_per_call(),
        1,
        "the sequence ran with its adapter"
    );
    assert_eq!(completion(&server, "fake", "w1").await.0, StatusCode::OK);
    let (status, body) = completion(&server, "nope", "w1").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let message = body["error"]["message"].as_str().expect("message");
    assert!(
        message.contains("`nope` does not exist") && message.contains("`sql`, `chat`"),
        "{message}"
    );
    assert_eq!(body["error"]["code"], "model_not_found");
    assert_eq!(generate(&server, Some("chat"), "w1").await.0, StatusCode::OK);
    assert_eq!(generate(&server, None, "w1").await.0, StatusCode::OK);
    let (status, body) = generate(&server, Some("nope"), "w1").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(body["error"].as_str().expect("message").contains("`nope`"), "{body}");
    let anthropic = json!({"model": "chat", "max_tokens": 1, "messages": [{"role": "user", "content": "w1"}]});
    let (status, _, body) = post(&server.app, "/v1/messages", anthropic).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let body: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(body["model"], "chat", "the answer names the adapter");
    let text = metrics(&server).await;
    assert!(text.contains(r#"rill_lora_requests_total{adapter="chat"} 2"#), "{text}");
    assert!(text.contains(r#"rill_lora_requests_total{adapter="sql"} 1"#), "{text}");
}

#[tokio::test]
async fn runtime_loading_is_off_without_its_flag() {
    let server = lora_server(2, adapters(&[("sql", "/a/sql")])).await.expect("starts");
    let (status, text) = load(&server, "b", "/a/b").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(text.contains("--enable-lora-loading"), "{text}");
    assert_eq!(unload(&server, "sql").await.0, StatusCode::NOT_FOUND);
    assert_eq!(completion(&server, "sql", "w1").await.0, StatusCode::OK, "still served");
}

#[tokio::test]
async fn adapters_load_and_unload_at_run_time() {
    let server = two_adapters().await;
    let (status, text) = load(&server, "b", "/a/b").await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(text, "Success: LoRA adapter 'b' added successfully.");
    assert_eq!(completion(&server, "b", "w1").await.0, StatusCode::OK);
    let (status, text) = load(&server, "b", "/a/other").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(text.contains("already been loaded"), "{text}");
    let (status, text) = load(&server, "fake", "/a/other").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "the base model's name: {text}");
    let (status, text) = load(&server, "c", "/a/missing").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(text.contains("/a/missing has no adapter_config.json"), "{text}");
    assert_eq!(
        completion(&server, "c", "w1").await.0,
        StatusCode::NOT_FOUND,
        "c never loaded"
    );
    let (status, text) = unload(&server, "nope").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(text.contains("`nope` cannot be found"), "{text}");
    assert_eq!(unload(&server, "b").await.0, StatusCode::OK);
    assert_eq!(completion(&server, "b", "w1").await.0, StatusCode::NOT_FOUND);
    // The next forward call frees it on the shard (the fake fails a call that unloads twice).
    assert_eq!(completion(&server, "sql", "w1").await.0, StatusCode::OK);
    assert_eq!(completion(&server, "sql", "w2").await.0, StatusCode::OK);
    let loaded: Vec<String> = server.shard.adapters().into_values().collect();
    assert!(!loaded.contains(&"/a/b".to_string()), "{loaded:?}");
    // The name is free again, for a new adapter (a new id).
    assert_eq!(load(&server, "b", "/a/b2").await.0, StatusCode::OK);
    let info = get(&server.app, "/info").await;
    assert_eq!(info["lora"]["adapters"][2]["name"], "b");
    assert_eq!(
        info["lora"]["adapters"][2]["id"], 5,
        "ids 3 (b) and 4 (the refused c) are not reused"
    );
}

#[tokio::test]
async fn an_unloaded_adapter_stays_on_the_shards_while_a_request_holds_it() {
    let server = two_adapters().await;
    // A request that resolved `sql` and still runs (or still validates).
    let held = server.state.engine.adapters.resolve("sql").expect("loaded");
    assert_eq!(unload(&server, "sql").await.0, StatusCode::OK);
    assert_eq!(
        completion(&server, "sql", "w1").await.0,
        StatusCode::NOT_FOUND,
        "no new requests"
    );
    assert_eq!(completion(&server, "chat", "w1").await.0, StatusCode::OK);
    assert!(server.shard.adapters().contains_key(&held.id), "still draining");
    drop(held);
    assert_eq!(completion(&server, "chat", "w2").await.0, StatusCode::OK);
    assert!(!server.shard.adapters().contains_key(&1), "freed with the next call");
}

#[tokio::test]
async fn one_call_never_uses_more_adapters_than_the_shards_have_slots() {
    let lora = adapters(&[("a", "/a/a"), ("b", "/a/b"), ("c", "/a/c")]);
    let server = lora_server(2, lora).await.expect("starts");
    let mut tasks = Vec::new();
    for i in 0..12u32 {
        let app = server.app.clone();
        let model = ["a", "b", "c", "fake"][i as usize % 4];
        tasks.push(tokio::spawn(async move {
            let body = json!({"model": model, "prompt": format!("w{i}"), "max_tokens": 6, "temperature": 0});
            post(&app, "/v1/completions", body).await
        }));
    }
    for task in tasks {
        let (status, _, text) = task.await.expect("task");
        assert_eq!(status, StatusCode::OK, "{text}");
    }
    assert_eq!(
        server.shard.max_adapters_per_call(),
        2,
        "the fake fails a call over its slots"
    );
}

#[tokio::test]
async fn adapters_and_the_base_model_never_share_cached_prefixes() {
    let server = two_adapters().await;
    let prompt = "w1 w2 w3 w4 w5 w6 w7 w8 w9";
    let cached = |body: &Value| body["details"]["cached_tokens"].as_u64().expect("cached_tokens");
    let (_, first) = generate(&server, Some("sql"), prompt).await;
    assert_eq!(cached(&first), 0);
    let (_, again) = generate(&server, Some("sql"), prompt).await;
    assert_eq!(cached(&again), 8, "the same adapter reuses its two full blocks");
    let (_, base) = generate(&server, None, prompt).await;
    assert_eq!(cached(&base), 0, "the base model does not see the adapter's blocks");
    let (_, other) = generate(&server, Some("chat"), prompt).await;
    assert_eq!(cached(&other), 0, "nor does another adapter");
    let (_, base_again) = generate(&server, None, prompt).await;
    assert_eq!(cached(&base_again), 8);
}

#[tokio::test]
async fn the_gateway_reads_running_and_waiting_adapters() {
    let server = two_adapters().await;
    let text = metrics(&server).await;
    assert!(
        text.contains(r#"rill_lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}"#),
        "{text}"
    );
    // A stream with `sql` that the client does not read to the end: it keeps running for a while.
    let body = json!({"model": "sql", "prompt": "w1", "max_tokens": 20, "temperature": 0, "stream": true});
    let request = Request::builder()
        .method("POST")
        .uri("/v1/completions")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("valid request");
    let response = server.app.clone().oneshot(request).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::OK);
    let mut seen = false;
    // The test runtime has one thread: the engine runs a step or so at each yield.
    for _ in 0..1000 {
        let text = metrics(&server).await;
        if text.contains(r#"running_lora_adapters="sql""#) {
            assert_eq!(
                text.matches("rill_lora_requests_info{").count(),
                1,
                "one series: {text}"
            );
            seen = true;
            break;
        }
        tokio::task::yield_now().await;
    }
    drop(response);
    assert!(seen, "the running adapter shows");
}

#[tokio::test]
async fn a_server_without_lora_serves_the_base_model_only() {
    let server = start(
        test_config(
            8,
            BatchingMode::Continuous,
            PreemptionMode::Recompute,
            KvAdmission::Incremental,
        ),
        FakeShard::new(64, 4),
    )
    .await;
    let (status, _) = completion(&server, "fake", "w1").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(completion(&server, "sql", "w1").await.0, StatusCode::NOT_FOUND);
    assert_eq!(generate(&server, Some("sql"), "w1").await.0, StatusCode::NOT_FOUND);
    assert_eq!(
        get(&server.app, "/v1/models").await["data"]
            .as_array()
            .expect("list")
            .len(),
        1
    );
    assert!(metrics(&server).await.contains(r#"max_lora="0""#));
}
