"""Rope scalings against transformers' own rope init functions (`transformers.modeling_rope_utils`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from rill.shard.layers.rotary import rope_parameters
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

HEAD_DIM, THETA, MAX_LEN = 64, 10000.0, 4096
LONGROPE_FACTORS = dict(
    short_factor=[1.0 + 0.01 * i for i in range(32)], long_factor=[1.0 + 0.3 * i for i in range(32)]
)

CASES: dict[str, tuple[dict[str, Any], int]] = {
    # name: (rope parameters, max_position_embeddings)
    "linear": ({"rope_type": "linear", "factor": 4.0}, MAX_LEN),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, MAX_LEN),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, MAX_LEN),
    "yarn-mscale": (
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 16,
        },
        MAX_LEN * 40,
    ),
    "longrope-128k": (
        {"rope_type": "longrope", "original_max_position_embeddings": 4096, **LONGROPE_FACTORS},
        131072,
    ),
    "longrope-4k": (
        {"rope_type": "longrope", "original_max_position_embeddings": 4096, **LONGROPE_FACTORS},
        4096,
    ),
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
        MAX_LEN,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rope_scaling_matches_transformers(name: str) -> None:
    params, max_len = CASES[name]
    config = transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_len,
        rope_parameters={"rope_theta": THETA, **params},
    )
    rope_type = params["rope_type"]
    # The longest context Rill serves fixes the frequencies (see rill.shard.layers.rotary).
    seq_len = {"dynamic": int(params.get("factor", 1) * max_len), "longrope": max_len}.get(rope_type)
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    inv_freq, attention_factor = rope_parameters(
        HEAD_DIM, THETA, {**params, "max_position_embeddings": max_len}
    )
    torch.testing.assert_close(inv_freq, expected_inv_freq.float(), rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(expected_factor, rel=1e-9)


def test_unknown_rope_type_is_named() -> None:
    with pytest.raises(ValueError, match="unsupported rope_type 'su'.*longrope"):
        rope_parameters(HEAD_DIM, THETA, {"rope_type": "su", "factor": 2.0})
