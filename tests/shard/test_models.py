"""Rill's Llama-family model against transformers' implementation on tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rill.kernels.ops import AttentionMetadata
from rill.shard.layers.attention import ForwardContext, forward_context
from rill.shard.runner import ModelRunner

from .conftest import chunk, hf_model, logits_of, make_runner, rewrite_config_transformers4, save_tiny_model

PROMPT = [5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 12, 13, 200]


def all_position_logits(runner: ModelRunner, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of a one-sequence prefill (the runner itself computes only sampled rows)."""
    seq = chunk(1, token_ids, 0, first_block=1)
    num_tokens = len(token_ids)
    meta = AttentionMetadata.build(
        [0, num_tokens],
        [num_tokens],
        torch.tensor([seq.block_table]),
        torch.tensor([seq.block_table[p // 4] * 4 + p % 4 for p in range(num_tokens)]),
        torch.arange(num_tokens),
    )
    with torch.inference_mode(), forward_context(ForwardContext(runner.kv_cache, meta)):
        hidden = runner.model(torch.tensor(token_ids), meta.positions)
        return runner.model.compute_logits(hidden)


def check_against_hf(path: Path, attention_backend: str = "auto") -> None:
    runner = make_runner(path, attention_backend=attention_backend)
    reference = hf_model(path)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(all_position_logits(runner, PROMPT), expected, rtol=1e-4, atol=1e-4)
    # Prefill a prefix, then decode token by token through the paged cache.
    prefix = 5
    got = [logits_of(runner, chunk(2, PROMPT[:prefix], 0, first_block=20))[0]]
    for position in range(prefix, len(PROMPT)):
        got.append(logits_of(runner, chunk(2, [PROMPT[position]], position, first_block=20))[0])
    torch.testing.assert_close(torch.stack(got), expected[prefix - 1 :], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attention_backend", ["cpu", "torch"])
def test_llama_matches_transformers(llama_dir: Path, attention_backend: str) -> None:
    check_against_hf(llama_dir, attention_backend)


def test_llama3_rope_scaling_tied_embeddings_and_head_dim(tmp_path: Path) -> None:
    path = save_tiny_model(
        tmp_path,
        head_dim=32,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    )
    check_against_hf(path)


def test_qwen2_with_bias(tmp_path: Path) -> None:
    check_against_hf(save_tiny_model(tmp_path, model_type="qwen2", num_hidden_layers=3))


def test_mistral(tmp_path: Path) -> None:
    check_against_hf(save_tiny_model(tmp_path, model_type="mistral", head_dim=None))


@pytest.mark.parametrize("rope_type", ["default", "llama3"])
def test_transformers4_config_layout(tmp_path: Path, rope_type: str) -> None:
    scaling = None
    if rope_type == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    path = save_tiny_model(tmp_path, rope_theta=5000.0, rope_scaling=scaling)
    expected = all_position_logits(make_runner(path), PROMPT)
    rewrite_config_transformers4(path)
    runner = make_runner(path)
    assert runner.model_config.rope_theta == 5000.0
    assert (runner.model_config.rope_scaling or {}).get("rope_type", "default") == rope_type
    assert torch.equal(all_position_logits(runner, PROMPT), expected)


def test_missing_tensor_is_reported(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = save_tiny_model(tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="down_proj"):
        make_runner(path)
