"""Tensor parallelism on the CPU (gloo): N rank processes must compute the logits of one shard.

Each case spawns N processes that build a `ModelRunner` with world size N from the same tiny random
checkpoint, run the same prefill + decode calls, and save their logits; rank 0's must match a single
shard's within 1e-4 relative, and every rank must hold bitwise the same logits (they sample the same tokens).
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch
from rill.shard import distributed
from rill.shard.batch import ForwardRequest
from rill.shard.config import ShardConfig
from rill.shard.models.llama import LlamaConfig, LlamaForCausalLM
from rill.shard.runner import ModelRunner

from .conftest import chunk, make_runner, save_tiny_model

TIMEOUT_S = 300


def forward_calls() -> list[ForwardRequest]:
    """A prefill of two prompts (one as a chunk that does not sample), then a decode step of both."""
    prompt_a, prompt_b = [(7 * i + 3) % 300 for i in range(11)], [(5 * i + 1) % 300 for i in range(6)]
    return [
        ForwardRequest(sequences=[chunk(1, prompt_a[:8], 0, 1), chunk(2, prompt_b, 0, 10)]),
        ForwardRequest(sequences=[chunk(1, prompt_a[8:], 8, 1), chunk(2, [42], 6, 10, params=None)]),
        ForwardRequest(sequences=[chunk(1, [17], 11, 1, params=None), chunk(2, [99], 7, 10, params=None)]),
    ]


def run_calls(runner: ModelRunner) -> torch.Tensor:
    return torch.cat([runner.forward_logits(request)[1] for request in forward_calls()])


def weight_bytes(runner: ModelRunner) -> int:
    return sum(p.numel() * p.element_size() for p in runner.model.parameters())


def _rank_main(rank: int, world_size: int, model_dir: str, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    config = ShardConfig(
        model_path=Path(model_dir),
        socket_path=Path(out_dir) / f"unused-{rank}.sock",
        block_size=4,
        rank=rank,
        world_size=world_size,
        dist_init_method=f"file://{init_file}",
    )
    runner = ModelRunner(config)
    num_blocks = runner.warmup(max_batch_tokens=64, max_batch_size=4, max_total_kv_tokens=1024).num_blocks
    logits = run_calls(runner)
    kv_heads = runner.kv_cache.k[0].shape[2]
    torch.save(
        {
            "logits": logits,
            "num_blocks": num_blocks,
            "weight_bytes": weight_bytes(runner),
            "kv_heads": kv_heads,
        },
        Path(out_dir) / f"rank-{rank}.pt",
    )
    distributed.shutdown()


def run_ranks(model_dir: Path, world_size: int, tmp_path: Path) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(
            target=_rank_main,
            args=(rank, world_size, str(model_dir), str(tmp_path / "dist-init"), str(tmp_path)),
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(TIMEOUT_S)
    for process in processes:
        if process.is_alive():
            process.kill()
    assert [p.exitcode for p in processes] == [0] * world_size, "a rank failed (see captured output)"
    return [torch.load(tmp_path / f"rank-{rank}.pt") for rank in range(world_size)]


@pytest.mark.parametrize(
    ("world_size", "overrides"),
    [
        (2, {}),  # 4 query heads, 2 KV heads: both split
        (4, {}),  # 2 KV heads on 4 ranks: each KV head replicated on 2 ranks
        (2, {"vocab_size": 301, "num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True}),
        (4, {"tie_word_embeddings": True}),  # tied vocab-parallel embedding and LM head
    ],
    ids=["n2", "n4-kv-replicated", "n2-odd-vocab-bias", "n4-tied"],
)
def test_tensor_parallel_logits_match_one_shard(tmp_path: Path, world_size: int, overrides: dict) -> None:
    model_dir = save_tiny_model(tmp_path / "model", **overrides)
    expected = run_calls(make_runner(model_dir))
    total_bytes = weight_bytes(make_runner(model_dir))
    results = run_ranks(model_dir, world_size, tmp_path)

    relative_error = (results[0]["logits"] - expected).abs().max() / expected.abs().max()
    print(f"N={world_size}: max relative logit error {relative_error:.2e} vs one shard")
    assert relative_error < 1e-4, f"N={world_size}: relative error {relative_error:.2e}"
    assert torch.equal(results[0]["logits"].argmax(-1), expected.argmax(-1))
    for result in results[1:]:
        assert torch.equal(result["logits"], results[0]["logits"]), "ranks disagree"
    assert len({result["num_blocks"] for result in results}) == 1
    num_kv_heads = json.loads((model_dir / "config.json").read_text())["num_key_value_heads"]
    assert [result["kv_heads"] for result in results] == [max(1, num_kv_heads // world_size)] * world_size
    # Only norms (and biases of row-parallel layers) are replicated: each rank holds about 1/N.
    for result in results:
        assert result["weight_bytes"] < total_bytes / world_size * 1.1, (result["weight_bytes"], total_bytes)


@pytest.mark.parametrize(
    ("world_size", "overrides", "message"),
    [
        (3, {}, r"num_attention_heads \(4\) is not divisible by the tensor-parallel size \(3\)"),
        (
            4,
            {"num_attention_heads": 8, "num_key_value_heads": 3},
            r"num_key_value_heads \(3\) is fewer than the tensor-parallel size \(4\)",
        ),
        (
            2,
            {"num_key_value_heads": 4, "num_attention_heads": 4, "intermediate_size": 129},
            r"output size of 0 \(129\) is not divisible by the tensor-parallel size \(2\)",
        ),
    ],
)
def test_indivisible_model_gets_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, world_size: int, overrides: dict, message: str
) -> None:
    hf = {
        "model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, **overrides,
    }  # fmt: skip
    monkeypatch.setattr(distributed, "_world_size", world_size)
    with pytest.raises(ValueError, match=message):
        LlamaForCausalLM(LlamaConfig.from_hf(hf))


def test_kv_heads_replicated_on_the_ranks_that_use_them(monkeypatch: pytest.MonkeyPatch) -> None:
    hf = {
        "model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 2,
    }  # fmt: skip
    monkeypatch.setattr(distributed, "_world_size", 4)
    head_dim = 64 // 8
    for rank, kv_head in enumerate([0, 0, 1, 1]):
        monkeypatch.setattr(distributed, "_rank", rank)
        qkv = LlamaForCausalLM(LlamaConfig.from_hf(hf)).model.layers[0].self_attn.qkv_proj
        assert (qkv.num_heads, qkv.num_kv_heads) == (2, 1)
        # Query heads 2r, 2r + 1 belong to KV head (2r) // 4.
        assert qkv.parts["q"][2] == rank * 2 * head_dim
        assert qkv.parts["k"][2] == qkv.parts["v"][2] == kv_head * head_dim
