"""Every model family against transformers on tiny random configs: logits within 1e-4 relative (float32) for
a prompt longer than the sliding window, in one prefill, chunked beside another sequence, and token by token;
a sequence's logits are bitwise the same alone or batched; 2-rank tensor parallelism matches one shard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rill.shard.runner import ModelRunner

from .conftest import chunk, hf_model, logits_of, make_runner, save_tiny_model
from .test_models import all_position_logits
from .test_tensor_parallel import run_calls, run_ranks

WINDOW = 8
PROMPT = [(37 * i + 11) % 300 for i in range(40)]  # five windows long
OTHER = [(13 * i + 5) % 300 for i in range(9)]

# name: (model_type, config overrides)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral-windowed": ("mistral", {"sliding_window": WINDOW, "head_dim": None}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "qwen3-yarn": (
        "qwen3",
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
    ),
    "phi3": ("phi3", {"pad_token_id": 0}),
    "phi3-longrope-windowed": (
        "phi3",
        {
            "pad_token_id": 0,
            "sliding_window": WINDOW,
            "max_position_embeddings": 64,
            "original_max_position_embeddings": 16,
            "rope_parameters": {
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [1.0 + 0.5 * i for i in range(8)],
            },
        },
    ),
    "gemma2": (
        "gemma2",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": WINDOW,
            "num_hidden_layers": 3,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 5.0,
        },
    ),
    "gemma3": (
        "gemma3_text",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": WINDOW,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0},
            },
        },
    ),
    "gemma3-softcap": (
        "gemma3_text",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 5.0,
        },
    ),
    "mixtral-windowed": (
        "mixtral",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW},
    ),
    "qwen3-moe": (
        "qwen3_moe",
        {
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
        },
    ),
    "qwen3-moe-normalized": (
        "qwen3_moe",
        {"num_experts": 4, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "norm_topk_prob": True},
    ),
}


def family_dir(tmp_path: Path, name: str) -> Path:
    model_type, overrides = FAMILIES[name]
    return save_tiny_model(tmp_path / name, model_type=model_type, **overrides)


def hf_logits(path: Path, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path)(torch.tensor([token_ids])).logits[0]


def chunked_batched_logits(runner: ModelRunner) -> tuple[torch.Tensor, list[int]]:
    """PROMPT in chunks of 9, 14, then 1 token a call, each call beside OTHER (prefill, then decode); returns
    PROMPT's logits at the end of each chunk and those positions."""
    boundaries = [9, 23, *range(24, len(PROMPT) + 1)]
    rows, start = [], 0
    for call, end in enumerate(boundaries):
        seq = chunk(1, PROMPT[start:end], start, first_block=1)
        other = (
            chunk(2, OTHER, 0, first_block=30) if call == 0 else chunk(2, [call], len(OTHER) + call - 1, 30)
        )
        rows.append(logits_of(runner, seq, other)[0])
        start = end
    return torch.stack(rows), [end - 1 for end in boundaries]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers(tmp_path: Path, name: str) -> None:
    path = family_dir(tmp_path, name)
    expected = hf_logits(path, PROMPT)
    runner = make_runner(path)
    torch.testing.assert_close(all_position_logits(runner, PROMPT), expected, rtol=1e-4, atol=1e-4)
    got, positions = chunked_batched_logits(make_runner(path))
    torch.testing.assert_close(got, expected[positions], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_batched_equals_alone(tmp_path: Path, name: str) -> None:
    path = family_dir(tmp_path, name)
    alone = logits_of(make_runner(path), chunk(1, PROMPT, 0, first_block=1))
    runner = make_runner(path)
    batched = logits_of(runner, chunk(2, OTHER, 0, first_block=30), chunk(1, PROMPT, 0, first_block=1))
    assert torch.equal(batched[1], alone[0])


@pytest.mark.parametrize(
    "name", ["qwen3", "phi3-longrope-windowed", "gemma2", "gemma3", "mixtral-windowed", "qwen3-moe"]
)
def test_family_tensor_parallel_matches_one_shard(tmp_path: Path, name: str) -> None:
    path = family_dir(tmp_path, name)
    expected = run_calls(make_runner(path))
    results = run_ranks(path, 2, tmp_path)
    relative_error = (results[0]["logits"] - expected).abs().max() / expected.abs().max()
    assert relative_error < 1e-4, f"relative error {relative_error:.2e}"
    assert torch.equal(results[1]["logits"], results[0]["logits"]), "ranks disagree"
