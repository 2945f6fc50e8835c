//! HTTP tests: the real app, engine, scheduler and allocator against the fake shard, via `oneshot`.

use std::{collections::HashMap, sync::Arc, time::Duration};

use axum::{
    body::Body,
    http::{Request, StatusCode},
    Router,
};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tokenizers::{models::wordlevel::WordLevel, pre_tokenizers::whitespace::Whitespace, AddedToken, Tokenizer};
use tower::ServiceExt;

use super::{app, build, AppState, ModelFiles, Server};
use crate::{
    chat_template::ChatTemplate,
    config::{BatchConfig, Config, ConnectionConfig, LimitsConfig, Scheduling},
    engine::EngineTask,
    metrics::Outcome,
    scheduler::{BatchingMode, KvAdmission, PreemptionMode},
    shard::{
        fake::{FakeShard, FAKE_EOS, FAKE_VOCAB_SIZE},
        ShardClient,
    },
};

/// Words `w0`..`w30` and the special `<eos>` (id 31), split on whitespace.
fn tokenizer() -> Tokenizer {
    let mut vocab: HashMap<String, u32> = (0..FAKE_EOS).map(|i| (format!("w{i}"), i)).collect();
    vocab.insert("<eos>".into(), FAKE_EOS);
    let model = WordLevel::builder()
        .vocab(vocab.into_iter().collect())
        .unk_token("w0".into())
        .build()
        .expect("valid word-level model");
    let mut tokenizer = Tokenizer::new(model);
    tokenizer.with_pre_tokenizer(Some(Whitespace {}));
    tokenizer.add_special_tokens(&[AddedToken::from("<eos>", true)]);
    assert_eq!(tokenizer.get_vocab_size(true) as u32, FAKE_VOCAB_SIZE);
    tokenizer
}

/// `--max-unread-tokens` of the test servers.
const MAX_UNREAD_TOKENS: usize = 8;

pub(super) struct TestServer {
    pub(super) app: Router,
    pub(super) state: AppState,
    pub(super) shard: FakeShard,
    engine: EngineTask,
}

pub(super) async fn server(num_blocks: u32, max_concurrent_requests: u32) -> TestServer {
    server_with_mode(num_blocks, max_concurrent_requests, BatchingMode::Continuous).await
}

async fn server_with_mode(num_blocks: u32, max_concurrent_requests: u32, mode: BatchingMode) -> TestServer {
    server_with(
        num_blocks,
        max_concurrent_requests,
        mode,
        (PreemptionMode::Recompute, 0),
        KvAdmission::Incremental,
        0,
    )
    .await
}

/// A test server, wired by `build` as the binary is. `preemption`: the mode and the fake shard's swap
/// pool (in host blocks); `window` > 0: the fake model attends through a sliding window of that many
/// tokens on every layer.
async fn server_with(
    num_blocks: u32,
    max_concurrent_requests: u32,
    mode: BatchingMode,
    (preemption_mode, num_host_blocks): (PreemptionMode, u32),
    kv_admission: KvAdmission,
    window: u32,
) -> TestServer {
    let shard = FakeShard::new(num_blocks, 4)
        .with_swap_pool(num_host_blocks)
        .with_window(window);
    let config = test_config(max_concurrent_requests, mode, preemption_mode, kv_admission);
    start(config, shard).await
}

/// The flags of the test servers.
pub(super) fn test_config(
    max_concurrent_requests: u32,
    mode: BatchingMode,
    preemption_mode: PreemptionMode,
    kv_admission: KvAdmission,
) -> Config {
    let (scheduling, static_batch_wait_ms) = match mode {
        BatchingMode::Continuous => (Scheduling::Continuous, 0),
        BatchingMode::Static { max_wait_ms } => (Scheduling::Static, max_wait_ms),
    };
    Config {
        model_id: "fake".into(),
        served_model_name: "fake".into(),
        addr: ([127, 0, 0, 1], 0).into(),
        shard_sockets: Vec::new(),
        draft_shard_socket: None,
        shard_connect_timeout_s: 0,
        shutdown_timeout: Duration::ZERO,
        connections: ConnectionConfig {
            header_read_timeout: None,
            max_connections: 64,
        },
        forward_timeout: None,
        api_key: None,
        max_body_bytes: 4096,
        cors_allow_origins: Vec::new(),
        tool_call_parser: None,
        reasoning_parser: None,
        grammar_compile_timeout: std::time::Duration::from_secs(5),
        log_prompts: false,
        responses_store: crate::config::StoreBounds {
            max_entries: 2,
            max_bytes: 1 << 20,
            ttl: Duration::from_secs(60),
        },
        limits: LimitsConfig {
            max_input_tokens: 64,
            max_total_tokens: 128,
            max_stop_sequences: 4,
            max_concurrent_requests,
            max_waiting_requests: max_concurrent_requests,
            request_timeout: None,
            max_unread_tokens: MAX_UNREAD_TOKENS,
            cache_pin_ttl: Duration::from_secs(300),
            max_cache_pin_ttl: Duration::from_secs(3600),
        },
        batch: BatchConfig {
            max_batch_tokens: 16,
            max_batch_size: 8,
            max_batch_total_tokens: 0,
            scheduling,
            static_batch_wait_ms,
            target_itl_ms: None,
            max_queue_time: None,
            prefix_caching: true,
            max_pinned_kv_fraction: 0.25,
            preemption_mode,
            swap_space_bytes: Some(0),
            kv_admission,
            speculative: None,
        },
        lora: Default::default(),
        kv_events: None,
    }
}

/// A test server with `config` in front of `shard`, wired by `build` as the binary is.
pub(super) async fn start(config: Config, shard: FakeShard) -> TestServer {
    try_start(config, shard).await.expect("the fake shard wires")
}

/// `start`, or why `build` refused.
pub(super) async fn try_start(config: Config, shard: FakeShard) -> anyhow::Result<TestServer> {
    try_start_with_draft(config, shard, None).await
}

/// `try_start`, with `draft` as the draft model's shard.
pub(super) async fn try_start_with_draft(
    config: Config,
    shard: FakeShard,
    draft: Option<Arc<dyn ShardClient>>,
) -> anyhow::Result<TestServer> {
    let model = ModelFiles {
        tokenizer: Arc::new(tokenizer()),
        tokenizer_path: None,
        chat_template: Some(Arc::new(
            ChatTemplate::new(
                "{% for m in messages %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}w0{% endif %}".into(),
                String::new(),
                "<eos>".into(),
            )
            .expect("valid template"),
        )),
    };
    let Server { app, state, engine } = build(&config, Arc::new(shard.clone()), draft, model).await?;
    Ok(TestServer {
        app,
        state,
        shard,
        engine,
    })
}

pub(super) async fn post(app: &Router, uri: &str, body: Value) -> (StatusCode, axum::http::HeaderMap, String) {
    let request = Request::builder()
        .method("POST")
        .uri(uri)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("valid request");
    let response = app.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = response.into_body().collect().await.expect("body").to_bytes();
    (status, headers, String::from_utf8(bytes.to_vec()).expect("utf-8 body"))
}

pub(super) async fn generate(app: &Router, inputs: &str, max_new_tokens: u32) -> Value {
    let body = json!({"inputs": inputs, "parameters": {"max_new_tokens": max_new_tokens, "details": true}});
    let (status, _, text) = post(app, "/generate", body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    serde_json::from_str(&text).expect("json body")
}

/// Waits until the engine has nothing left and returns the blocks no sequence holds (free or cached).
pub(super) async fn idle_free_blocks(server: &TestServer) -> u32 {
    let metrics = &server.state.engine.metrics;
    for _ in 0..200 {
        if metrics.running_sequences.get() == 0 && metrics.queue_depth.get() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    (metrics.kv_blocks_free.get() + metrics.kv_blocks_cached_idle.get()) as u32
}

#[tokio::test]
async fn generate_counts_up_to_max_new_tokens() {
    let server = server(64, 8).await;
    let result = generate(&server.app, "w1 w2", 3).await;
    assert_eq!(result["generated_text"], " w3 w4 w5");
    assert_eq!(result["details"]["finish_reason"], "length");
    assert_eq!(result["details"]["generated_tokens"], 3);
    assert_eq!(result["details"]["input_length"], 2);
    let ids: Vec<u64> = result["details"]["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t["id"].as_u64().expect("id"))
        .collect();
    assert_eq!(ids, vec![3, 4, 5]);
}

#[tokio::test]
async fn eos_ends_generation_without_text() {
    let server = server(64, 8).await;
    let result = generate(&server.app, "w29", 10).await;
    assert_eq!(result["generated_text"], " w30");
    assert_eq!(result["details"]["finish_reason"], "eos_token");
    assert_eq!(result["details"]["tokens"][1]["special"], true);
}

#[tokio::test]
async fn stop_sequence_text_never_leaks() {
    let server = server(64, 8).await;
    let body = json!({"inputs": "w1", "parameters": {"max_new_tokens": 10, "stop": ["w4 w"]}});
    let (status, _, text) = post(&server.app, "/generate_stream", body).await;
    assert_eq!(status, StatusCode::OK);
    let events: Vec<Value> = text
        .lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .map(|data| serde_json::from_str(data.trim()).expect("json event"))
        .collect();
    let streamed: String = events
        .iter()
        .map(|e| e["token"]["text"].as_str().expect("text"))
        .collect();
    assert_eq!(streamed, " w2 w3 ");
    let last = events.last().expect("events");
    assert_eq!(last["generated_text"], " w2 w3 ");
    assert_eq!(last["details"]["finish_reason"], "stop_sequence");
}

#[tokio::test]
async fn many_requests_on_a_tiny_pool_all_finish_and_free_their_blocks() {
    // 12 usable blocks of 4 tokens: 16 requests growing to 20 tokens each cannot all fit, so the
    // scheduler must queue and preempt; every request still gets exactly its own tokens.
    let server = server(13, 64).await;
    let mut tasks = Vec::new();
    for i in 0..16u32 {
        let app = server.app.clone();
        tasks.push(tokio::spawn(async move {
            let start = i % 10;
            let prompt = format!("w{start} w{}", start + 1);
            let result = generate(&app, &prompt, 18).await;
            (start, result)
        }));
    }
    for task in tasks {
        let (start, result) = task.await.expect("task");
        let tokens = result["details"]["tokens"].as_array().expect("tokens").clone();
        let expected: Vec<u64> = (0..tokens.len() as u32)
            .map(|k| ((start + 2 + k) % FAKE_VOCAB_SIZE) as u64)
            .collect();
        let ids: Vec<u64> = tokens.iter().map(|t| t["id"].as_u64().expect("id")).collect();
        assert_eq!(ids, expected);
    }
    assert_eq!(idle_free_blocks(&server).await, 12);
    // Every sequence the shard saw was released (they ride on the next call, so send one more).
    generate(&server.app, "w1", 1).await;
    assert!(server.shard.num_known() <= 1);
}

#[tokio::test]
async fn bad_input_gets_a_json_error_naming_the_field() {
    let server = server(64, 8).await;
    let cases = [
        (
            json!({"inputs": "w1", "parameters": {"top_p": 0}}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "top_p",
        ),
        (
            json!({"inputs": "w1", "parameters": {"max_new_tokens": 500}}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "max-total-tokens",
        ),
        (
            json!({"inputs": "w1", "surprise": true}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "surprise",
        ),
        (json!({"inputs": 7}), StatusCode::UNPROCESSABLE_ENTITY, "inputs"),
        (json!({"inputs": ""}), StatusCode::UNPROCESSABLE_ENTITY, "inputs"),
    ];
    for (body, status, field) in cases {
        let (got, _, text) = post(&server.app, "/generate", body.clone()).await;
        assert_eq!(got, status, "{body}: {text}");
        let error: Value = serde_json::from_str(&text).expect("json error");
        assert!(error["error"].as_str().expect("message").contains(field), "{text}");
        assert_eq!(error["error_type"], "validation");
    }
    let request = Request::builder()
        .method("POST")
        .uri("/generate")
        .header("content-type", "application/json")
        .body(Body::from("{oops"))
        .expect("valid request");
    let response = server.app.clone().oneshot(request).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    // The server carries on.
    assert_eq!(generate(&server.app, "w1", 1).await["details"]["generated_tokens"], 1);
}

#[tokio::test]
async fn overload_gets_429_with_retry_after() {
    let server = server(64, 1).await;
    let _held = server.state.admission.clone().try_acquire_owned().expect("one permit");
    let (status, headers, text) = post(&server.app, "/generate", json!({"inputs": "w1"})).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["retry-after"], "1");
    assert!(text.contains("max-concurrent-requests"));
}

#[tokio::test]
async fn info_reports_the_kv_pool() {
    let server = server(64, 8).await;
    generate(&server.app, "w1", 2).await;
    let request = Request::builder()
        .uri("/info")
        .body(Body::empty())
        .expect("valid request");
    let response = server.app.clone().oneshot(request).await.expect("infallible");
    let bytes = response.into_body().collect().await.expect("body").to_bytes();
    let info: Value = serde_json::from_slice(&bytes).expect("json");
    assert_eq!(info["kv"]["total_blocks"], 63);
    assert_eq!(info["kv"]["block_size"], 4);
    assert_eq!(idle_free_blocks(&server).await, 63);
}

pub(super) async fn get(app: &Router, uri: &str) -> Value {
    let request = Request::builder().uri(uri).body(Body::empty()).expect("valid request");
    let response = app.clone().oneshot(request).await.expect("infallible");
    let bytes = response.into_body().collect().await.expect("body").to_bytes();
    serde_json::from_slice(&bytes).expect("json")
}

pub(super) fn sse_data(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .map(|d| d.trim().to_owned())
        .collect()
}

/// The chunks of an OpenAI stream, which must end with `[DONE]`.
fn openai_chunks(text: &str) -> Vec<Value> {
    let data = sse_data(text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("json"))
        .collect()
}

#[tokio::test]
async fn n_choices_share_one_prompt_prefill() {
    let server = server(64, 16).await;
    // 10 prompt tokens with blocks of 4: the choices share the first 2 blocks and each computes 2 tokens.
    let prompt = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10";
    let body = json!({"model": "fake", "prompt": prompt, "max_tokens": 3, "n": 4, "seed": 5});
    let (status, _, text) = post(&server.app, "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let response: Value = serde_json::from_str(&text).expect("json");
    let choices = response["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 4);
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(choice["text"], " w11 w12 w13");
        assert_eq!(choice["finish_reason"], "length");
    }
    assert_eq!(response["usage"]["prompt_tokens"], 10);
    assert_eq!(response["usage"]["completion_tokens"], 12);
    let info = get(&server.app, "/info").await;
    assert_eq!(info["kv"]["prompt_tokens_computed"], 10 + 3 * 2);
    assert_eq!(idle_free_blocks(&server).await, 63);
}

#[tokio::test]
async fn openai_streams_end_with_usage_and_done() {
    let server = server(64, 16).await;
    let body = json!({"messages": [{"role": "user", "content": "w3"}], "max_tokens": 2, "stream": true,
                      "stream_options": {"include_usage": true}});
    let (status, _, text) = post(&server.app, "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let chunks = openai_chunks(&text);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .filter_map(|c| c["delta"]["content"].as_str())
        .collect();
    // The template renders "w3 w0": the fake then counts on from w0.
    assert_eq!(content, " w1 w2");
    let usage = &chunks.last().expect("usage chunk")["usage"];
    assert_eq!(usage["completion_tokens"], 2);
    assert_eq!(usage["prompt_tokens"], 2);
}

#[tokio::test]
async fn completions_echo_each_prompt_before_its_choices() {
    let server = server(64, 16).await;
    let body = json!({"prompt": ["w1 w2", "w5"], "max_tokens": 2, "n": 2, "echo": true});
    let (status, _, text) = post(&server.app, "/v1/completions", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let response: Value = serde_json::from_str(&text).expect("json");
    let texts: Vec<&str> = response["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .map(|c| c["text"].as_str().expect("text"))
        .collect();
    assert_eq!(texts, ["w1 w2 w3 w4", "w1 w2 w3 w4", "w5 w6 w7", "w5 w6 w7"]);
    assert_eq!(response["usage"]["prompt_tokens"], 3);
    assert_eq!(response["usage"]["completion_tokens"], 8);

    let mut body = body;
    body["stream"] = json!(true);
    let (status, _, text) = post(&server.app, "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let chunks = openai_chunks(&text);
    let opening: Vec<(u64, &str)> = chunks[..4]
        .iter()
        .map(|c| {
            (
                c["choices"][0]["index"].as_u64().expect("index"),
                c["choices"][0]["text"].as_str().expect("text"),
            )
        })
        .collect();
    assert_eq!(opening, [(0, "w1 w2"), (1, "w1 w2"), (2, "w5"), (3, "w5")]);
    let mut streamed = vec![String::new(); 4];
    for chunk in &chunks[4..] {
        let choice = &chunk["choices"][0];
        streamed[choice["index"].as_u64().expect("index") as usize] += choice["text"].as_str().expect("text");
    }
    assert_eq!(streamed, [" w3 w4", " w3 w4", " w6 w7", " w6 w7"]);
}

#[tokio::test]
async fn openai_errors_have_openai_shape() {
    let server = server(64, 16).await;
    let (status, _, text) = post(
        &server.app,
        "/v1/completions",
        json!({"model": "gpt-4", "prompt": "w1"}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let error: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(error["error"]["code"], "model_not_found");
    assert_eq!(error["error"]["param"], "model");
    let (status, _, text) = post(&server.app, "/v1/completions", json!({"prompt": "w1", "suffix": "x"})).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(text.contains("`suffix`"), "{text}");
    let (status, _, text) = post(
        &server.app,
        "/v1/chat/completions",
        json!({"messages": [], "temperature": 1.0}),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let error: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(error["error"]["type"], "invalid_request_error");
    assert_eq!(error["error"]["param"], "messages");
    let models = get(&server.app, "/v1/models").await;
    assert_eq!(models["data"][0]["id"], "fake");
}

#[tokio::test]
async fn tokenize_and_detokenize_round_trip() {
    let server = server(64, 16).await;
    let (status, _, text) = post(&server.app, "/tokenize", json!({"prompt": "w4 w5"})).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let tokens: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(tokens["count"], 2);
    assert_eq!(tokens["tokens"][1]["id"], 5);
    assert_eq!(tokens["tokens"][1]["text"], "w5");
    let (_, _, text) = post(&server.app, "/detokenize", json!({"tokens": [4, 5]})).await;
    assert_eq!(serde_json::from_str::<Value>(&text).expect("json")["prompt"], "w4 w5");
    let (_, _, text) = post(
        &server.app,
        "/tokenize",
        json!({"messages": [{"role": "user", "content": "w7"}]}),
    )
    .await;
    assert_eq!(serde_json::from_str::<Value>(&text).expect("json")["prompt"], "w7 w0");
}

#[tokio::test]
async fn render_shows_the_prompt_ids_the_real_requests_prefill() {
    let server = server(64, 16).await;
    let messages = json!([{"role": "user", "content": "w7 w8"}]);
    let (status, _, text) = post(
        &server.app,
        "/v1/chat/completions/render",
        json!({"messages": messages, "temperature": 0, "n": 2, "cache_salt": "s", "stream": true}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let rendered: Value = serde_json::from_str(&text).expect("json");
    // The template renders "w7 w8 w0", as /tokenize shows.
    assert_eq!(rendered["token_ids"], json!([7, 8, 0]));
    let (_, _, text) = post(&server.app, "/tokenize", json!({"messages": messages})).await;
    let tokens: Value = serde_json::from_str(&text).expect("json");
    let ids: Vec<Value> = tokens["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t["id"].clone())
        .collect();
    assert_eq!(rendered["token_ids"], json!(ids));
    assert!(
        rendered["request_id"]
            .as_str()
            .is_some_and(|id| id.starts_with("chatcmpl-")),
        "{rendered}"
    );
    assert_eq!(rendered["model"], "fake");
    assert_eq!(rendered["features"], Value::Null);
    assert_eq!(rendered["stream"], true);
    assert_eq!(rendered["cache_salt"], "s");
    assert_eq!(rendered["sampling_params"]["n"], 2);
    assert_eq!(rendered["sampling_params"]["temperature"], 0.0);
    assert_eq!(rendered["sampling_params"]["seed"], Value::Null);

    let (status, _, text) = post(
        &server.app,
        "/v1/completions/render",
        json!({"prompt": ["w4 w5", "w6"], "max_tokens": 3, "seed": 9, "stop": ["w9"]}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let rendered: Value = serde_json::from_str(&text).expect("json");
    let rendered = rendered.as_array().expect("one per prompt");
    assert_eq!(rendered.len(), 2);
    assert_eq!(rendered[0]["token_ids"], json!([4, 5]));
    assert_eq!(rendered[1]["token_ids"], json!([6]));
    assert!(rendered[1]["request_id"]
        .as_str()
        .is_some_and(|id| id.starts_with("cmpl-")));
    assert_eq!(rendered[0]["sampling_params"]["max_tokens"], 3);
    assert_eq!(rendered[0]["sampling_params"]["seed"], 9);
    assert_eq!(rendered[0]["sampling_params"]["stop"], json!(["w9"]));
    assert_eq!(rendered[0]["sampling_params"]["temperature"], 1.0);
    // Rendering runs nothing.
    assert_eq!(server.state.engine.metrics.generated_tokens.get(), 0);
}

#[tokio::test]
async fn render_refuses_what_the_real_requests_refuse() {
    let server = server(64, 16).await;
    for (uri, body, field) in [
        ("/v1/chat/completions/render", json!({"messages": []}), "messages"),
        ("/v1/completions/render", json!({"prompt": "w1 ".repeat(65)}), "prompt"),
        (
            "/v1/completions/render",
            json!({"prompt": "w1", "model": "other"}),
            "other",
        ),
    ] {
        let (status, _, text) = post(&server.app, uri, body).await;
        assert!(status.is_client_error(), "{uri}: {status} {text}");
        assert!(text.contains(field), "{uri}: {text}");
    }
}

#[tokio::test]
async fn openapi_document_lists_every_route() {
    let server = server(64, 16).await;
    let doc = get(&server.app, "/openapi.json").await;
    for path in [
        "/generate",
        "/generate_stream",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/completions/render",
        "/v1/chat/completions/render",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/v1/responses/{id}",
        "/v1/models",
        "/tokenize",
        "/info",
        "/v1/loads",
    ] {
        assert!(
            doc["paths"].get(path).is_some(),
            "{path} missing from the OpenAPI document"
        );
    }
}

#[tokio::test]
async fn metrics_count_outcomes_and_latencies() {
    let server = server(64, 16).await;
    generate(&server.app, "w1", 3).await;
    generate(&server.app, "w2", 2).await;
    let (status, _, _) = post(
        &server.app,
        "/generate",
        json!({"inputs": "w1", "parameters": {"top_k": 0}}),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let metrics = &server.state.engine.metrics;
    assert_eq!(metrics.num_requests(Outcome::Success), 2);
    assert_eq!(metrics.num_requests(Outcome::Invalid), 1);
    let request = Request::builder()
        .uri("/metrics")
        .body(Body::empty())
        .expect("valid request");
    let response = server.app.clone().oneshot(request).await.expect("infallible");
    let text =
        String::from_utf8(response.into_body().collect().await.expect("body").to_bytes().to_vec()).expect("utf-8");
    assert!(text.contains("rill_requests_total{outcome=\"success\"} 2"), "{text}");
    assert!(text.contains("rill_time_to_first_token_seconds_count 2"), "{text}");
    assert!(text.contains("rill_inter_token_latency_seconds_count 3"), "{text}");
    assert!(text.contains("rill_generated_tokens_total 5"), "{text}");
    assert!(
        metrics.engine_planning_seconds.get() > 0.0,
        "the engine's own time is counted"
    );
    assert!(text.contains("rill_engine_planning_seconds_total"), "{text}");
}

/// The text of `GET /metrics`.
async fn metrics_text(app: &Router) -> String {
    let request = Request::builder()
        .uri("/metrics")
        .body(Body::empty())
        .expect("valid request");
    let response = app.clone().oneshot(request).await.expect("infallible");
    String::from_utf8(response.into_body().collect().await.expect("body").to_bytes().to_vec()).expect("utf-8")
}

#[tokio::test]
async fn idle_cached_blocks_leave_the_kv_usage_at_zero() {
    let server = server(64, 16).await;
    generate(&server.app, "w1 w2 w3 w4 w5 w6 w7 w8 w9", 2).await;
    assert_eq!(idle_free_blocks(&server).await, 63);
    let text = metrics_text(&server.app).await;
    // Two full blocks of the prompt stay cached, idle: new work may evict them, so they are not usage.
    assert!(text.contains("rill_prefix_cache_blocks 2"), "{text}");
    assert!(text.contains("rill_kv_cache_usage_ratio 0\n"), "{text}");
    assert!(
        text.contains("rill_kv_cache_config_info{block_size=\"4\",num_gpu_blocks=\"63\"} 1"),
        "{text}"
    );
}

#[tokio::test]
async fn loads_report_the_pool_and_the_prefix_hits_in_sglangs_schema() {
    let server = server(64, 16).await;
    for _ in 0..2 {
        generate(&server.app, "w1 w2 w3 w4 w5 w6 w7 w8 w9", 2).await;
    }
    assert_eq!(idle_free_blocks(&server).await, 63);
    let loads = get(&server.app, "/v1/loads?include=core,disagg,queues,memory").await;
    assert_eq!(loads["dp_rank_count"], 1);
    assert!(loads["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')), "{loads}");
    // The second request found the first's two full blocks: 8 of the 18 prompt tokens looked up.
    assert_eq!(
        loads["loads"],
        json!([{
            "dp_rank": 0,
            "num_running_reqs": 0,
            "num_waiting_reqs": 0,
            "num_total_reqs": 0,
            "num_used_tokens": 0,
            "max_total_num_tokens": 63 * 4,
            "token_usage": 0.0,
            "cache_hit_rate": 8.0 / 18.0,
            "max_running_requests": 8,
        }])
    );
}

#[tokio::test]
async fn a_dropped_stream_is_cancelled_and_frees_its_blocks() {
    let server = server(64, 16).await;
    let receiver = {
        let valid = server
            .state
            .validator
            .validate(crate::validation::GenerateInput::new(
                crate::validation::Prompt::Text {
                    text: "w1 w2 w3 w4 w5".into(),
                    add_special_tokens: true,
                },
                "inputs",
                "max_new_tokens",
            ))
            .await
            .expect("valid");
        let mut valid = valid;
        valid.max_new_tokens = 50;
        server
            .state
            .engine
            .submit_n(valid, 1, None, "test".into())
            .expect("submitted")
            .pop()
            .expect("one")
    };
    let mut receiver = receiver;
    receiver.recv().await.expect("a first token").expect("no error");
    drop(receiver);
    assert_eq!(idle_free_blocks(&server).await, 63);
    assert_eq!(server.state.engine.metrics.num_requests(Outcome::Cancelled), 1);
}

/// Submits `w1 w2 w3 w4 w5` for 50 tokens through the engine handle, after `edit`; returns its events.
pub(super) async fn submit_direct(
    server: &TestServer,
    edit: impl FnOnce(&mut crate::validation::ValidRequest),
) -> crate::engine::EventReceiver {
    let input = crate::validation::GenerateInput::new(
        crate::validation::Prompt::Text {
            text: "w1 w2 w3 w4 w5".into(),
            add_special_tokens: true,
        },
        "inputs",
        "max_new_tokens",
    );
    let mut valid = server.state.validator.validate(input).await.expect("valid");
    valid.max_new_tokens = 50;
    edit(&mut valid);
    let mut receivers = server
        .state
        .engine
        .submit_n(valid, 1, None, "test".into())
        .expect("submitted");
    receivers.pop().expect("one")
}

#[tokio::test]
async fn a_reader_that_falls_behind_is_cut_off_and_frees_its_blocks() {
    let server = server(64, 16).await;
    let mut receiver = submit_direct(&server, |_| {}).await;
    let metrics = &server.state.engine.metrics;
    for _ in 0..200 {
        if metrics.slow_readers.get() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(metrics.slow_readers.get(), 1);
    assert_eq!(metrics.num_requests(Outcome::Cancelled), 1);
    assert_eq!(idle_free_blocks(&server).await, 63);
    // What the client finds once it reads again: the tokens it left unread, then the reason.
    for _ in 0..MAX_UNREAD_TOKENS {
        receiver.recv().await.expect("a token").expect("no error");
    }
    let error = receiver.recv().await.expect("an event").expect_err("cut off");
    assert!(
        matches!(error, crate::engine::EngineError::SlowReader(MAX_UNREAD_TOKENS)),
        "{error}"
    );
    assert!(receiver.recv().await.is_none());
}

#[tokio::test]
async fn a_request_past_its_deadline_ends_with_the_error_and_frees_its_blocks() {
    let server = server(64, 16).await;
    let mut receiver = submit_direct(&server, |valid| valid.timeout = Some(Duration::from_nanos(1))).await;
    let error = receiver.recv().await.expect("an event").expect_err("expired");
    assert!(matches!(error, crate::engine::EngineError::Deadline(_)), "{error}");
    assert_eq!(idle_free_blocks(&server).await, 63);
    assert_eq!(server.state.engine.metrics.num_requests(Outcome::Timeout), 1);
}

#[tokio::test]
async fn a_bad_timeout_is_a_422_naming_it() {
    let server = server(64, 16).await;
    for timeout in [json!(0), json!(-1.5), json!(1e9)] {
        let body = json!({"inputs": "w1", "parameters": {"timeout": timeout}});
        let (status, _, text) = post(&server.app, "/generate", body).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{text}");
        assert!(text.contains("timeout"), "{text}");
        let body = json!({"model": "fake", "prompt": "w1", "timeout": timeout});
        let (status, _, text) = post(&server.app, "/v1/completions", body).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{text}");
        assert!(text.contains("\"param\":\"timeout\""), "{text}");
    }
}

#[tokio::test]
async fn n_choices_are_read_at_once_and_none_is_cut_off() {
    let server = server(64, 16).await;
    // Each choice produces more events than a channel holds before the response is built.
    let body = json!({"model": "fake", "prompt": "w1", "n": 3, "max_tokens": 4 * MAX_UNREAD_TOKENS});
    let (status, _, text) = post(&server.app, "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(server.state.engine.metrics.slow_readers.get(), 0);
}

#[tokio::test]
async fn ready_reports_the_shards() {
    let server = server(64, 16).await;
    let request = Request::builder()
        .uri("/ready")
        .body(Body::empty())
        .expect("valid request");
    let response = server.app.clone().oneshot(request).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_dead_engine_fails_health_and_ready_with_the_reason() {
    let server = server(64, 16).await;
    server.engine.abort();
    for _ in 0..200 {
        if !server.state.engine.is_running() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    for uri in ["/health", "/ready"] {
        let request = Request::builder().uri(uri).body(Body::empty()).expect("valid request");
        let response = server.app.clone().oneshot(request).await.expect("infallible");
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE, "{uri}");
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("body");
        let body: Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(body["reason"], "the engine stopped", "{uri}");
    }
    let (status, _, text) = post(&server.app, "/generate", json!({"inputs": "w1"})).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
}

#[tokio::test]
async fn a_draining_server_refuses_new_requests_with_503() {
    let server = server(64, 16).await;
    server.state.draining.store(true, std::sync::atomic::Ordering::SeqCst);
    let (status, _, text) = post(&server.app, "/generate", json!({"inputs": "w1"})).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
}

#[tokio::test]
async fn a_full_waiting_queue_gets_429() {
    let server = server(64, 16).await;
    let _all = server
        .state
        .waiting
        .clone()
        .try_acquire_many_owned(16)
        .expect("all waiting permits");
    let (status, headers, text) = post(&server.app, "/generate", json!({"inputs": "w1"})).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{text}");
    assert!(text.contains("max-waiting-requests"));
    assert_eq!(headers["retry-after"], "1");
}

#[tokio::test]
async fn an_api_key_guards_generation_but_not_health() {
    let server = server(64, 16).await;
    let mut state = server.state.clone();
    state.api_key = Some(Arc::from("s3cret"));
    let app = app(state);
    let (status, headers, text) = post(&app, "/generate", json!({"inputs": "w1"})).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{text}");
    assert_eq!(headers["www-authenticate"], "Bearer");
    let request = Request::builder()
        .method("POST")
        .uri("/v1/completions")
        .header("content-type", "application/json")
        .header("authorization", "Bearer s3cret")
        .body(Body::from(json!({"prompt": "w1", "max_tokens": 1}).to_string()))
        .expect("valid request");
    assert_eq!(
        app.clone().oneshot(request).await.expect("infallible").status(),
        StatusCode::OK
    );
    for path in ["/health", "/ready", "/metrics", "/info"] {
        let request = Request::builder().uri(path).body(Body::empty()).expect("valid request");
        assert_eq!(
            app.clone().oneshot(request).await.expect("infallible").status(),
            StatusCode::OK,
            "{path}"
        );
    }
}

#[tokio::test]
async fn oversized_bodies_get_413() {
    let server = server(64, 16).await;
    let (status, _, text) = post(&server.app, "/generate", json!({"inputs": "w1 ".repeat(3000)})).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{text}");
    assert!(text.contains("max-body-bytes"), "{text}");
}

#[tokio::test]
async fn request_ids_are_echoed_or_made() {
    let server = server(64, 16).await;
    let request = Request::builder()
        .method("POST")
        .uri("/generate")
        .header("content-type", "application/json")
        .header("x-request-id", "client-42")
        .body(Body::from(
            json!({"inputs": "w1", "parameters": {"max_new_tokens": 1}}).to_string(),
        ))
        .expect("valid request");
    let response = server.app.clone().oneshot(request).await.expect("infallible");
    assert_eq!(response.headers()["x-request-id"], "client-42");
    let request = Request::builder()
        .uri("/health")
        .body(Body::empty())
        .expect("valid request");
    let response = server.app.clone().oneshot(request).await.expect("infallible");
    assert_eq!(response.headers()["x-request-id"].len(), 32);
}

#[tokio::test]
async fn static_batches_wait_then_run_to_completion() {
    // Batches of up to 8 form after 50 ms; requests arriving one by one still all complete.
    let server = server_with_mode(64, 16, BatchingMode::Static { max_wait_ms: 50 }).await;
    let mut tasks = Vec::new();
    for i in 0..5u32 {
        let app = server.app.clone();
        tasks.push(tokio::spawn(
            async move { generate(&app, &format!("w{i}"), 3 + i).await },
        ));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for (i, task) in tasks.into_iter().enumerate() {
        let result = task.await.expect("task");
        assert_eq!(result["details"]["generated_tokens"], 3 + i as u64);
    }
    assert_eq!(idle_free_blocks(&server).await, 63);
}

/// 16 requests growing to 20 tokens on 12 blocks of 4, under a preemption mode and admission policy: each
/// gets exactly its own tokens (the fake shard also checks every block table holds what it computed, so a
/// lost or misplaced swap fails the request), and the pool and the swap pool are whole when idle.
async fn run_under_memory_pressure(mode: PreemptionMode, kv_admission: KvAdmission) -> TestServer {
    run_under_memory_pressure_windowed(mode, kv_admission, 0).await
}

/// `run_under_memory_pressure` for a fake model whose every layer has a sliding window of `window` tokens
/// (0: none).
async fn run_under_memory_pressure_windowed(
    mode: PreemptionMode,
    kv_admission: KvAdmission,
    window: u32,
) -> TestServer {
    // The fake shard's swap pool: 20 host blocks, copied at 1 us a block against 100 us a prefill token.
    let server = server_with(13, 64, BatchingMode::Continuous, (mode, 20), kv_admission, window).await;
    let mut tasks = Vec::new();
    for i in 0..16u32 {
        let app = server.app.clone();
        tasks.push(tokio::spawn(async move {
            let start = i % 10;
            let result = generate(&app, &format!("w{start} w{}", start + 1), 18).await;
            (start, result)
        }));
    }
    for task in tasks {
        let (start, result) = task.await.expect("task");
        let ids: Vec<u64> = result["details"]["tokens"]
            .as_array()
            .unwrap_or_else(|| panic!("tokens in {result}"))
            .iter()
            .map(|t| t["id"].as_u64().expect("id"))
            .collect();
        let expected: Vec<u64> = (0..18).map(|k| ((start + 2 + k) % FAKE_VOCAB_SIZE) as u64).collect();
        assert_eq!(ids, expected);
    }
    assert_eq!(idle_free_blocks(&server).await, 12);
    let metrics = &server.state.engine.metrics;
    assert_eq!(metrics.swapped_sequences.get(), 0);
    assert_eq!(metrics.swap_blocks_free.get(), metrics.swap_blocks_total.get());
    server
}

fn preemptions(server: &TestServer, mode: &str) -> u64 {
    server.state.engine.metrics.preemptions.with_label_values(&[mode]).get()
}

#[tokio::test]
async fn swap_preemption_restores_every_sequence_exactly() {
    let server = run_under_memory_pressure(PreemptionMode::Swap, KvAdmission::Incremental).await;
    assert!(preemptions(&server, "swap") > 0);
    let metrics = &server.state.engine.metrics;
    assert!(metrics.swapped_out_blocks.get() > 0);
    assert_eq!(metrics.swapped_in_blocks.get(), metrics.swapped_out_blocks.get());
}

#[tokio::test]
async fn recompute_preemption_counts_recomputed_tokens() {
    let server = run_under_memory_pressure(PreemptionMode::Recompute, KvAdmission::Incremental).await;
    assert!(preemptions(&server, "recompute") > 0);
    assert_eq!(preemptions(&server, "swap"), 0);
    assert!(server.state.engine.metrics.recomputed_tokens.get() > 0);
}

#[tokio::test]
async fn auto_swaps_when_copying_is_cheaper() {
    let server = run_under_memory_pressure(PreemptionMode::Auto, KvAdmission::Incremental).await;
    assert!(preemptions(&server, "swap") > 0);
}

#[tokio::test]
async fn windowed_sequences_survive_swap_and_recompute_preemption() {
    // Window 6 on blocks of 4: each sequence decodes holding at most 3 blocks, 16 of them still outgrow
    // the 12 blocks; its null entries are never swapped, and every output is exact.
    for mode in [PreemptionMode::Swap, PreemptionMode::Recompute] {
        let server = run_under_memory_pressure_windowed(mode, KvAdmission::Incremental, 6).await;
        assert!(preemptions(&server, "swap") + preemptions(&server, "recompute") > 0);
        let metrics = &server.state.engine.metrics;
        assert!(metrics.window_released_blocks.get() > 0);
        assert_eq!(metrics.swapped_in_blocks.get(), metrics.swapped_out_blocks.get());
        assert!(
            server.shard.max_decode_blocks() <= 3,
            "{}",
            server.shard.max_decode_blocks()
        );
    }
}

#[tokio::test]
async fn a_long_windowed_sequence_holds_only_its_window_and_its_prefix_still_hits() {
    let window = 8;
    let server = server_with(
        64,
        8,
        BatchingMode::Continuous,
        (PreemptionMode::Recompute, 0),
        KvAdmission::Incremental,
        window,
    )
    .await;
    let prompt: Vec<String> = (0..40).map(|i| format!("w{}", i % 30)).collect();
    let prompt = prompt.join(" ");
    let first = generate(&server.app, &prompt, 80).await;
    // A decode at position p holds blocks from (p + 1 - 8) / 4 to p / 4: at most ceil(8 / 4) + 1.
    assert!(
        server.shard.max_decode_blocks() <= 3,
        "{}",
        server.shard.max_decode_blocks()
    );
    let metrics = &server.state.engine.metrics;
    // The fake counts up to its EOS: 40 prompt and 22 generated tokens, the first 13 blocks released.
    assert_eq!(first["details"]["generated_tokens"], 22);
    assert_eq!(metrics.window_released_blocks.get(), 13);
    // The released blocks went to the prefix cache: the same prompt again reuses a complete chain from
    // its start, and gets the same tokens.
    let hits_before = metrics.prefix_cache_hit_tokens.get();
    let second = generate(&server.app, &prompt, 80).await;
    assert_eq!(first["details"]["tokens"], second["details"]["tokens"]);
    assert_eq!(metrics.prefix_cache_hit_tokens.get() - hits_before, 36);
    assert_eq!(idle_free_blocks(&server).await, 63);
}

#[tokio::test]
async fn reserve_admission_never_preempts() {
    let server = run_under_memory_pressure(PreemptionMode::Swap, KvAdmission::Reserve).await;
    assert_eq!(preemptions(&server, "swap") + preemptions(&server, "recompute"), 0);
}

async fn call(app: &Router, method: &str, uri: &str) -> (StatusCode, Value) {
    let request = Request::builder()
        .method(method)
        .uri(uri)
        .body(Body::empty())
        .expect("valid request");
    let response = app.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let bytes = response.into_body().collect().await.expect("body").to_bytes();
    (status, serde_json::from_slice(&bytes).expect("json"))
}

/// The store as the API shows it: a turn continued by `previous_response_id` holds the first turn's
/// tokens, prompt and answer, as a prefix hit; the store keeps two responses (the test config), the
/// oldest evicted first; delete; a stream's typed events in order, numbered from 0.
#[tokio::test]
async fn responses_are_stored_continued_and_evicted() {
    let server = server(64, 8).await;
    let create = |body: Value| {
        let app = server.app.clone();
        async move {
            let (status, _, text) = post(&app, "/v1/responses", body).await;
            assert_eq!(status, StatusCode::OK, "{text}");
            serde_json::from_str::<Value>(&text).expect("json body")
        }
    };
    // "w1 w0": the prompt; the fake model counts on from its last token.
    let first = create(json!({"input": "w1", "max_output_tokens": 3, "temperature": 0})).await;
    assert_eq!(first["status"], "incomplete");
    assert_eq!(first["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(first["output"][0]["content"][0]["text"], " w1 w2 w3");
    assert_eq!(first["usage"]["input_tokens"], 2);
    let id = first["id"].as_str().expect("id").to_owned();
    assert_eq!(
        call(&server.app, "GET", &format!("/v1/responses/{id}")).await,
        (StatusCode::OK, first.clone())
    );
    let second = create(json!({"input": "w5", "previous_response_id": id, "max_output_tokens": 2})).await;
    // The history (2 + 3 tokens), the closing " " of the template's turn, then "w5 w0": 2 more tokens.
    assert_eq!(second["usage"]["input_tokens"], 7);
    assert!(
        second["usage"]["input_tokens_details"]["cached_tokens"].as_u64() >= Some(4),
        "{second}"
    );
    assert_eq!(second["previous_response_id"], id.as_str());
    let (status, items) = call(
        &server.app,
        "GET",
        &format!("/v1/responses/{}/input_items", second["id"].as_str().expect("id")),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        items["data"][0]["content"],
        json!([{"type": "input_text", "text": "w5"}])
    );
    let third = create(json!({"input": "w7", "max_output_tokens": 1})).await;
    let (status, error) = call(&server.app, "GET", &format!("/v1/responses/{id}")).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{error}");
    let (status, _, text) = post(
        &server.app,
        "/v1/responses",
        json!({"input": "w1", "previous_response_id": id}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let error: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(error["error"]["code"], "previous_response_not_found");
    let third_uri = format!("/v1/responses/{}", third["id"].as_str().expect("id"));
    assert_eq!(call(&server.app, "DELETE", &third_uri).await.0, StatusCode::OK);
    assert_eq!(call(&server.app, "GET", &third_uri).await.0, StatusCode::NOT_FOUND);
    assert_eq!(server.state.responses.lock().expect("lock").len(), 1);

    let (status, _, text) = post(
        &server.app,
        "/v1/responses",
        json!({"input": "w1", "max_output_tokens": 2, "stream": true}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let events: Vec<Value> = sse_data(&text)
        .iter()
        .map(|data| serde_json::from_str(data).expect("json event"))
        .collect();
    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().expect("type")).collect();
    assert_eq!(
        types,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
    );
    for (i, event) in events.iter().enumerate() {
        assert_eq!(event["sequence_number"], i);
    }
    assert_eq!(events[6]["text"], " w1 w2");
}
