//! Speculative decoding with a draft model over HTTP, against two fake shards: the target, and a draft
//! fake that predicts like it (every proposal accepted) or mispredicts after some tokens (rejections and
//! rollbacks of the draft's K/V). The fakes check every block table against what they computed, so a
//! draft block table that lost its K/V fails the call. Checked: the same tokens as without speculation,
//! both KV pools whole when idle, preemption under memory pressure, a draft shard that fails (nobody
//! notices but the metrics), and a draft with another vocabulary refused at start.

use std::sync::Arc;

use futures::{future::BoxFuture, FutureExt};

use super::{
    speculative_tests::{accepted, num_preemptions, speculative_config, token_ids},
    tests::{generate, idle_free_blocks, start, test_config, try_start_with_draft, TestServer},
};
use crate::{
    config::Config,
    scheduler::{BatchingMode, KvAdmission, PreemptionMode},
    shard::{fake::FakeShard, fake::FAKE_VOCAB_SIZE, pb, ShardClient, ShardError},
};

fn config(preemption_mode: PreemptionMode) -> Config {
    let mut config = test_config(64, BatchingMode::Continuous, preemption_mode, KvAdmission::Incremental);
    config.batch.speculative = Some(speculative_config());
    config
}

/// A target on `num_blocks` blocks of 4 (20 host blocks to swap to) with `draft` as its draft model.
async fn server(num_blocks: u32, draft: impl ShardClient + 'static, preemption_mode: PreemptionMode) -> TestServer {
    let target = FakeShard::new(num_blocks, 4).with_swap_pool(20);
    try_start_with_draft(config(preemption_mode), target, Some(Arc::new(draft)))
        .await
        .expect("the fake shards wire")
}

async fn plain_server() -> TestServer {
    let config = test_config(
        64,
        BatchingMode::Continuous,
        PreemptionMode::Recompute,
        KvAdmission::Incremental,
    );
    start(config, FakeShard::new(64, 4)).await
}

/// Waits for the engine to go idle; then every block of the target's pool is free or cached and every
/// block of the draft's pool free.
async fn assert_pools_whole(server: &TestServer, num_target_blocks: u32) {
    assert_eq!(idle_free_blocks(server).await, num_target_blocks - 1);
    let stats = server.state.engine.stats();
    assert!(stats.num_usable_draft_blocks > 0);
    assert_eq!(
        stats.num_free_draft_blocks, stats.num_usable_draft_blocks,
        "draft blocks leaked"
    );
}

/// Prompts and `max_new_tokens`; the last one's output reaches EOS (`w27` counts up to it).
const PROMPTS: [(&str, u32); 5] = [
    ("w1 w2", 12),
    ("w7 w3 w9", 5),
    ("w4", 1),
    ("w20 w21 w5", 17),
    ("w27", 9),
];

#[tokio::test]
async fn a_draft_changes_no_token_and_a_faithful_one_is_always_accepted() {
    let plain = plain_server().await;
    let faithful = server(64, FakeShard::new(40, 4), PreemptionMode::Recompute).await;
    let wrong = server(
        64,
        FakeShard::new(40, 4).with_mispredictions(3),
        PreemptionMode::Recompute,
    )
    .await;
    let mut expected_reasons = Vec::new();
    for (n, (prompt, max_new_tokens)) in PROMPTS.into_iter().enumerate() {
        if n == PROMPTS.len() - 1 {
            // Before the output that reaches EOS: the proposals past EOS are never accepted.
            let (drafts, draft_tokens, accepted_tokens) = accepted(&faithful);
            assert!(
                drafts > 0 && draft_tokens > drafts,
                "{drafts} drafts of {draft_tokens} tokens"
            );
            assert_eq!(
                accepted_tokens, draft_tokens,
                "the faithful draft predicts as the target does"
            );
        }
        let expected = generate(&plain.app, prompt, max_new_tokens).await;
        expected_reasons.push(expected["details"]["finish_reason"].clone());
        for spec in [&faithful, &wrong] {
            let result = generate(&spec.app, prompt, max_new_tokens).await;
            assert_eq!(result["generated_text"], expected["generated_text"], "{prompt}");
            assert_eq!(token_ids(&result), token_ids(&expected), "{prompt}");
            assert_eq!(result["details"]["finish_reason"], expected["details"]["finish_reason"]);
        }
    }
    assert_eq!(expected_reasons, ["length", "length", "length", "length", "eos_token"]);
    let (drafts, draft_tokens, accepted_tokens) = accepted(&wrong);
    assert!(
        drafts > 0 && accepted_tokens > 0,
        "{drafts} drafts, {accepted_tokens} accepted"
    );
    assert!(
        accepted_tokens < draft_tokens,
        "the draft mispredicts after every third token"
    );
    assert_eq!(accepted(&plain), (0, 0, 0));
    assert_pools_whole(&faithful, 64).await;
    assert_pools_whole(&wrong, 64).await;
}

#[tokio::test]
async fn concurrent_drafting_sequences_survive_preemption_exactly() {
    // 16 requests growing to 23 tokens on 12 target blocks of 4, and a draft pool of 12 blocks too: the
    // target preempts (swap or recompute) while sequences draft, the draft pool runs out (those sequences
    // then go without a proposal), catch-ups are cut to the call's 16 tokens. Each request still gets
    // exactly its own tokens, and both pools are whole when idle.
    for mode in [PreemptionMode::Swap, PreemptionMode::Recompute] {
        let draft = FakeShard::new(13, 4).with_mispredictions(5);
        let server = server(13, draft.clone(), mode).await;
        let mut tasks = Vec::new();
        for i in 0..16u32 {
            let app = server.app.clone();
            tasks.push(tokio::spawn(async move {
                let start = i % 8;
                let prompt = format!("w{} w{} w{} w{start}", start + 9, start + 3, start + 11);
                (start, generate(&app, &prompt, 19).await)
            }));
        }
        for task in tasks {
            let (start, result) = task.await.expect("task");
            let counted: Vec<u64> = (1..=19).map(|k| u64::from((start + k) % FAKE_VOCAB_SIZE)).collect();
            assert_eq!(token_ids(&result), counted);
        }
        assert!(
            num_preemptions(&server) > 0,
            "{mode:?}: the pool is too small for 16 sequences"
        );
        let (_, draft_tokens, accepted_tokens) = accepted(&server);
        assert!(
            0 < accepted_tokens && accepted_tokens < draft_tokens,
            "{accepted_tokens} of {draft_tokens}"
        );
        assert_pools_whole(&server, 13).await;
        let metrics = &server.state.engine.metrics;
        assert_eq!(metrics.swap_blocks_free.get(), metrics.swap_blocks_total.get());
        assert!(draft.num_forwards() > 0);
    }
}

/// A draft shard that answers Info (with `vocab_size`) and Warmup like the fake, and fails every forward.
struct BrokenDraft {
    fake: FakeShard,
    vocab_size: u32,
}

impl ShardClient for BrokenDraft {
    fn info(&self) -> BoxFuture<'_, Result<pb::InfoResponse, ShardError>> {
        async move {
            let mut info = self.fake.info().await?;
            info.vocab_size = self.vocab_size;
            Ok(info)
        }
        .boxed()
    }

    fn health(&self) -> BoxFuture<'_, Result<bool, ShardError>> {
        self.fake.health()
    }

    fn warmup(&self, request: pb::WarmupRequest) -> BoxFuture<'_, Result<pb::WarmupResponse, ShardError>> {
        self.fake.warmup(request)
    }

    fn forward(&self, _: pb::ForwardRequest, _: bool) -> BoxFuture<'_, Result<pb::ForwardResponse, ShardError>> {
        async {
            Err(ShardError::Rpc {
                rank: 0,
                message: "the draft is down".into(),
            })
        }
        .boxed()
    }

    fn clear_cache(&self) -> BoxFuture<'_, Result<(), ShardError>> {
        self.fake.clear_cache()
    }

    fn load_adapter(
        &self,
        request: pb::LoadAdapterRequest,
    ) -> BoxFuture<'_, Result<pb::LoadAdapterResponse, ShardError>> {
        self.fake.load_adapter(request)
    }
}

#[tokio::test]
async fn a_failing_draft_fails_no_request() {
    let plain = plain_server().await;
    let broken = BrokenDraft {
        fake: FakeShard::new(40, 4),
        vocab_size: FAKE_VOCAB_SIZE,
    };
    let spec = server(64, broken, PreemptionMode::Recompute).await;
    for (prompt, max_new_tokens) in PROMPTS {
        let expected = generate(&plain.app, prompt, max_new_tokens).await;
        let result = generate(&spec.app, prompt, max_new_tokens).await;
        assert_eq!(token_ids(&result), token_ids(&expected), "{prompt}");
    }
    assert_eq!(accepted(&spec), (0, 0, 0), "no proposal without a draft");
    assert_pools_whole(&spec, 64).await;
}

#[tokio::test]
async fn a_draft_with_another_vocabulary_is_refused() {
    let draft = BrokenDraft {
        fake: FakeShard::new(40, 4),
        vocab_size: 50,
    };
    let result = try_start_with_draft(
        config(PreemptionMode::Recompute),
        FakeShard::new(64, 4),
        Some(Arc::new(draft)),
    )
    .await;
    let error = format!("{:#}", result.err().expect("refused"));
    assert!(
        error.contains("the draft model's vocabulary (50) differs from the target's (32)"),
        "{error}"
    );
}

#[tokio::test]
async fn no_draft_is_computed_when_the_decodes_fill_the_speculative_budget() {
    let plain = plain_server().await;
    let mut config = config(PreemptionMode::Recompute);
    config.batch.speculative = config.batch.speculative.map(|mut spec| {
        spec.max_step_tokens = 1; // one decode fills it
        spec
    });
    let draft = FakeShard::new(40, 4);
    let target = FakeShard::new(64, 4);
    let spec = try_start_with_draft(config, target, Some(Arc::new(draft.clone())))
        .await
        .expect("the fake shards wire");
    for (prompt, max_new_tokens) in PROMPTS {
        let expected = generate(&plain.app, prompt, max_new_tokens).await;
        let result = generate(&spec.app, prompt, max_new_tokens).await;
        assert_eq!(token_ids(&result), token_ids(&expected), "{prompt}");
    }
    assert_eq!(draft.num_forwards(), 0, "a draft nobody can verify is not computed");
    assert_eq!(accepted(&spec), (0, 0, 0));
}
