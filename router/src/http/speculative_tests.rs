//! Speculative decoding (n-gram) over HTTP, against the fake shard (whose model predicts `t + 1` after
//! `t`, so a prompt that holds its own continuation is proposed and accepted): the same tokens as without
//! speculation, stop sequences and `max_new_tokens` that end a sequence mid-proposal, preemption under
//! memory pressure, cancellation, the blocks of rejected proposals given back, and the metrics.

use serde_json::{json, Value};

use super::tests::{generate, idle_free_blocks, post, start, submit_direct, test_config, TestServer};
use crate::{
    metrics::Outcome,
    scheduler::{BatchingMode, KvAdmission, PreemptionMode},
    shard::fake::{FakeShard, FAKE_VOCAB_SIZE},
    speculative::SpeculativeConfig,
};

/// The speculation settings of the test servers: up to 4 proposals a step, however many sequences run.
pub(super) fn speculative_config() -> SpeculativeConfig {
    SpeculativeConfig {
        max_proposed_tokens: 4,
        ngram_min: 1,
        ngram_max: 3,
        max_step_tokens: 64,
    }
}

/// A server on `num_blocks` blocks of 4 (20 host blocks to swap to), with n-gram speculation or without.
async fn server(num_blocks: u32, is_speculative: bool, preemption_mode: PreemptionMode) -> TestServer {
    let mut config = test_config(64, BatchingMode::Continuous, preemption_mode, KvAdmission::Incremental);
    config.batch.speculative = is_speculative.then(speculative_config);
    start(config, FakeShard::new(num_blocks, 4).with_swap_pool(20)).await
}

pub(super) fn token_ids(result: &Value) -> Vec<u64> {
    result["details"]["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("tokens in {result}"))
        .iter()
        .map(|t| t["id"].as_u64().expect("id"))
        .collect()
}

/// A prompt ending at `start` whose earlier part holds the next `ahead` tokens after it (then a jump),
/// so proposals are right for a while, then wrong.
fn self_repeating_prompt(start: u32, ahead: u32) -> String {
    let mut words: Vec<String> = (1..=ahead).map(|k| format!("w{}", (start + k) % 30)).collect();
    words.push(format!("w{}", (start + 20) % 30));
    words.push(format!("w{start}"));
    words.join(" ")
}

/// (verifications, proposed tokens, accepted tokens)
pub(super) fn accepted(server: &TestServer) -> (u64, u64, u64) {
    let metrics = &server.state.engine.metrics;
    (
        metrics.spec_decode_drafts.get(),
        metrics.spec_decode_draft_tokens.get(),
        metrics.spec_decode_accepted_tokens.get(),
    )
}

/// Preemptions so far, swap and recompute.
pub(super) fn num_preemptions(server: &TestServer) -> u64 {
    let metrics = &server.state.engine.metrics;
    ["swap", "recompute"]
        .iter()
        .map(|mode| metrics.preemptions.with_label_values(&[mode]).get())
        .sum()
}

#[tokio::test]
async fn speculation_changes_no_token_and_accepts_what_repeats() {
    let plain = server(64, false, PreemptionMode::Recompute).await;
    let spec = server(64, true, PreemptionMode::Recompute).await;
    for (start, max_new_tokens) in [(2, 12), (5, 3), (1, 1), (0, 9)] {
        let prompt = self_repeating_prompt(start, 6);
        let expected = generate(&plain.app, &prompt, max_new_tokens).await;
        let result = generate(&spec.app, &prompt, max_new_tokens).await;
        assert_eq!(result["generated_text"], expected["generated_text"], "{prompt}");
        assert_eq!(token_ids(&result), token_ids(&expected));
        assert_eq!(result["details"]["finish_reason"], expected["details"]["finish_reason"]);
        let counted: Vec<u64> = (1..=max_new_tokens)
            .map(|k| u64::from((start + k) % FAKE_VOCAB_SIZE))
            .collect();
        assert_eq!(token_ids(&result), counted);
    }
    let (drafts, draft_tokens, accepted_tokens) = accepted(&spec);
    assert!(
        drafts > 0 && accepted_tokens > 0,
        "{drafts} drafts, {accepted_tokens} accepted"
    );
    assert!(
        accepted_tokens < draft_tokens,
        "the jump in each prompt makes a proposal wrong"
    );
    assert_eq!(accepted(&plain), (0, 0, 0));
    // Every block is back: rejected proposals' blocks went back the step they were rejected.
    assert_eq!(idle_free_blocks(&spec).await, 63);
}

#[tokio::test]
async fn a_stop_sequence_inside_a_proposal_ends_the_output_where_it_would_have() {
    let plain = server(64, false, PreemptionMode::Recompute).await;
    let spec = server(64, true, PreemptionMode::Recompute).await;
    // The output counts w3 w4 w5 ...; every token after the first is proposed, and "w6" stops it.
    let body = json!({
        "inputs": self_repeating_prompt(2, 8),
        "parameters": {"max_new_tokens": 12, "stop": ["w6"], "details": true},
    });
    let (_, _, expected) = post(&plain.app, "/generate", body.clone()).await;
    let (_, _, result) = post(&spec.app, "/generate", body).await;
    let expected: Value = serde_json::from_str(&expected).expect("json");
    let result: Value = serde_json::from_str(&result).expect("json");
    assert_eq!(result["details"]["finish_reason"], "stop_sequence");
    assert_eq!(result["generated_text"], expected["generated_text"]);
    assert_eq!(token_ids(&result), token_ids(&expected));
    assert_eq!(token_ids(&result), [3, 4, 5, 6]);
    assert!(accepted(&spec).2 > 0);
    assert_eq!(idle_free_blocks(&spec).await, 63);
}

#[tokio::test]
async fn speculating_sequences_survive_preemption_exactly() {
    // 16 requests growing to 25 tokens on 12 blocks of 4: sequences are preempted (swapped or
    // recomputed) while they speculate; each still gets exactly its own tokens (the fake shard checks
    // every block table holds what it computed), and the pools are whole when idle.
    for mode in [PreemptionMode::Swap, PreemptionMode::Recompute] {
        let server = server(13, true, mode).await;
        let mut tasks = Vec::new();
        for i in 0..16u32 {
            let app = server.app.clone();
            tasks.push(tokio::spawn(async move {
                let start = i % 8;
                (start, generate(&app, &self_repeating_prompt(start, 5), 18).await)
            }));
        }
        for task in tasks {
            let (start, result) = task.await.expect("task");
            let counted: Vec<u64> = (1..=18).map(|k| u64::from((start + k) % FAKE_VOCAB_SIZE)).collect();
            assert_eq!(token_ids(&result), counted);
        }
        assert!(
            num_preemptions(&server) > 0,
            "{mode:?}: the pool is too small for 16 sequences"
        );
        assert!(accepted(&server).2 > 0);
        assert_eq!(idle_free_blocks(&server).await, 12);
        let metrics = &server.state.engine.metrics;
        assert_eq!(metrics.swap_blocks_free.get(), metrics.swap_blocks_total.get());
    }
}

#[tokio::test]
async fn a_dropped_speculating_stream_is_cancelled_and_frees_its_blocks() {
    let server = server(64, true, PreemptionMode::Recompute).await;
    // Ids are the words' numbers: the prompt holds the 10 tokens after its last one, then a jump.
    let prompt: Vec<u32> = (3..=12).chain([25, 2]).collect();
    let mut receiver = submit_direct(&server, |valid| valid.prompt_ids = prompt).await;
    for _ in 0..4 {
        receiver.recv().await.expect("a token").expect("no error");
    }
    drop(receiver);
    assert_eq!(idle_free_blocks(&server).await, 63);
    assert_eq!(server.state.engine.metrics.num_requests(Outcome::Cancelled), 1);
    assert!(accepted(&server).2 > 0, "it speculated before it was dropped");
}
