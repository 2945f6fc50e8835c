//! Session pins end to end against the fake shard: a pinned session prefix survives other traffic and
//! hits on the next turn while an unpinned one misses; pins give way before anything is preempted; an
//! expired pin lets go of its blocks while the engine idles.

use std::time::Duration;

use axum::http::StatusCode;
use serde_json::{json, Value};

use super::tests::{idle_free_blocks, post, server, submit_direct};
use crate::{
    metrics::PinRelease,
    validation::{GenerateInput, Prompt, ValidCachePin},
};

/// A greedy completion of `prompt` for `max_tokens` tokens, pinned under `key` when given.
async fn complete(app: &axum::Router, prompt: &str, max_tokens: u32, key: Option<&str>) -> Value {
    let mut body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true});
    if let Some(key) = key {
        body["prompt_cache_key"] = json!(key);
    }
    let (status, _, text) = post(app, "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    serde_json::from_str(&text).expect("json body")
}

fn cached_tokens(body: &Value) -> u64 {
    body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("usage in {body}"))
}

/// `w{first}` .. `w{last}`.
fn words(first: u32, last: u32) -> String {
    (first..=last).map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ")
}

/// Waits (up to 20 seconds, for a busy machine) until the engine publishes `expected` (pins, pinned
/// blocks), and checks it: a response may arrive just before the engine's stats of that step.
async fn check_pins(server: &super::tests::TestServer, expected: (i64, i64)) {
    let metrics = &server.state.engine.metrics;
    let published = || (metrics.kv_pins.get(), metrics.kv_pinned_blocks.get());
    for _ in 0..4000 {
        if published() == expected {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(published(), expected, "(pins, pinned blocks)");
}

fn preemptions(server: &super::tests::TestServer) -> u64 {
    let preemptions = &server.state.engine.metrics.preemptions;
    ["recompute", "swap"]
        .iter()
        .map(|mode| preemptions.with_label_values(&[mode]).get())
        .sum()
}

#[tokio::test]
async fn a_pinned_session_keeps_its_prefix_through_churn_and_an_unpinned_one_does_not() {
    // 12 blocks of 4 tokens; pins may keep 3 of them.
    let server = server(13, 16).await;
    let app = &server.app;
    let metrics = &server.state.engine.metrics;
    // Turn 1 of each session: 8 prompt tokens and 4 generated (w9..w12); 11 computed, 2 full blocks.
    let session = complete(app, &words(1, 8), 4, Some("s")).await;
    assert_eq!(session["choices"][0]["text"], " w9 w10 w11 w12");
    complete(app, &words(2, 9), 4, None).await;
    check_pins(&server, (1, 2)).await;
    assert_eq!(metrics.pins_created.get(), 1);
    // Other traffic: 10 prompts of their own, 3 blocks each (2 stay cached), churn every unpinned block.
    let evicted_before = metrics.prefix_cache_evicted_blocks.get();
    for first in 13..23 {
        complete(app, &words(first, first + 7), 4, None).await;
    }
    assert!(metrics.prefix_cache_evicted_blocks.get() - evicted_before >= 10);
    let info = super::tests::get(app, "/info").await;
    assert_eq!(
        info["kv"]["pins"],
        json!({"pins": 1, "pinned_blocks": 2, "max_pinned_blocks": 3, "default_ttl_s": 300, "max_ttl_s": 3600})
    );
    // Turn 2: the previous prompt, its output and one more word.
    let session = complete(app, &words(1, 13), 2, Some("s")).await;
    assert_eq!(cached_tokens(&session), 8, "the pinned blocks of turn 1");
    let control = complete(app, &words(2, 14), 2, None).await;
    assert_eq!(cached_tokens(&control), 0, "churned away");
    // The session's pin moved on to turn 2's longer prefix (12 computed tokens: 3 blocks).
    check_pins(&server, (1, 3)).await;
    assert_eq!(metrics.num_pins_released(PinRelease::Pressure), 0);
    assert_eq!(idle_free_blocks(&server).await, 12);
}

#[tokio::test]
async fn under_memory_pressure_pins_are_released_before_anything_is_preempted() {
    let server = server(13, 16).await;
    let app = &server.app;
    let metrics = &server.state.engine.metrics;
    complete(app, &words(1, 8), 4, Some("s")).await;
    check_pins(&server, (1, 2)).await;
    // Two sequences of 18 + 4 tokens (6 blocks each) need the whole pool: the pin gives way. Both are
    // validated first, then handed to the engine back to back, so they always run at the same time (sent
    // over HTTP, the first could finish before the second was tokenized on a busy machine).
    let mut valid = Vec::new();
    for word in [3u32, 6] {
        let prompt = vec![format!("w{word}"); 18].join(" ");
        let input = GenerateInput::new(
            Prompt::Text {
                text: prompt,
                add_special_tokens: true,
            },
            "inputs",
            "max_new_tokens",
        );
        let mut request = server.state.validator.validate(input).await.expect("valid");
        request.max_new_tokens = 4;
        request.ignore_eos = true;
        valid.push(request);
    }
    let receivers: Vec<_> = valid
        .into_iter()
        .map(|request| {
            server
                .state
                .engine
                .submit_n(request, 1, None, "test".into())
                .expect("submitted")
        })
        .collect();
    for (mut receivers, word) in receivers.into_iter().zip([3u32, 6]) {
        let mut receiver = receivers.pop().expect("one choice");
        let mut text = String::new();
        while let Some(event) = receiver.recv().await {
            text.push_str(&event.expect("no error").text);
        }
        assert_eq!(text, format!(" {}", words(word + 1, word + 4)));
    }
    check_pins(&server, (0, 0)).await;
    assert_eq!(preemptions(&server), 0);
    assert_eq!(metrics.num_pins_released(PinRelease::Pressure), 1);
    assert_eq!(idle_free_blocks(&server).await, 12);
}

#[tokio::test]
async fn an_expired_pin_lets_go_of_its_blocks_while_the_engine_idles() {
    let server = server(64, 16).await;
    let metrics = &server.state.engine.metrics;
    let mut receiver = submit_direct(&server, |valid| {
        valid.max_new_tokens = 8;
        valid.cache_pin = Some(ValidCachePin {
            key: "e".into(),
            ttl: Duration::from_millis(50),
        });
    })
    .await;
    while let Some(event) = receiver.recv().await {
        event.expect("no error");
    }
    assert_eq!(metrics.pins_created.get(), 1);
    // No request follows: the engine wakes for the deadline by itself.
    check_pins(&server, (0, 0)).await;
    assert_eq!(metrics.num_pins_released(PinRelease::Expired), 1);
    assert_eq!(idle_free_blocks(&server).await, 63);
}

#[tokio::test]
async fn a_bad_prompt_cache_key_is_a_422_naming_it() {
    let server = server(64, 16).await;
    let body = json!({"prompt": "w1", "max_tokens": 1, "prompt_cache_key": ""});
    let (status, _, text) = post(&server.app, "/v1/completions", body).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{text}");
    assert!(text.contains("prompt_cache_key"), "{text}");
}
