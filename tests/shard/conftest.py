"""Shared fixtures for shard tests: tiny random Hugging Face checkpoints and runners loaded from them."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from rill.shard.batch import ForwardRequest, SequenceChunk
from rill.shard.config import ShardConfig
from rill.shard.runner import ModelRunner
from rill.shard.sampling import SamplingParams

torch.set_num_threads(1)
# Without a GPU, Rill's Triton kernels (rill/kernels/triton_*.py, test_triton_*.py) run on the CPU under
# Triton's interpreter. Its `@triton.jit` decorators read this when those modules are first imported, which
# nothing does before the tests (rill.kernels.gpu imports them on first use).
IS_INTERPRETED = not torch.cuda.is_available()
if IS_INTERPRETED:
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=512,
)
GREEDY = SamplingParams(do_sample=False)


def save_tiny_model(path: Path, model_type: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Writes a random-weight HF checkpoint (config.json + model.safetensors) into `path` and returns it."""
    config_class = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
        "qwen3": transformers.Qwen3Config,
        "phi3": transformers.Phi3Config,
        "gemma2": transformers.Gemma2Config,
        "gemma3_text": transformers.Gemma3TextConfig,
        "mixtral": transformers.MixtralConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
    }[model_type]
    config = config_class(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Spread the weights so logits are far from uniform and greedy tokens are not near-ties.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 1:
                param.normal_(0.0, 0.2 if param.dim() == 2 else 0.05).add_(1.0 if param.dim() == 1 else 0.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


def rewrite_config_transformers4(path: Path) -> None:
    """Rewrites config.json as transformers 4 wrote it: top-level rope_theta/rope_scaling, torch_dtype."""
    config = json.loads((path / "config.json").read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    if "dtype" in config:
        config["torch_dtype"] = config.pop("dtype")
    (path / "config.json").write_text(json.dumps(config, indent=2))


def hf_model(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def make_runner(
    path: Path, block_size: int = 4, max_total_kv_tokens: int = 1024, **config: Any
) -> ModelRunner:
    """A warmed-up runner of the model at `path`; `config`: other `ShardConfig` fields (attention_backend,
    dtype, kv_cache_dtype, quantize, ...)."""
    config = ShardConfig(model_path=path, socket_path=path / "unused.sock", block_size=block_size, **config)
    runner = ModelRunner(config)
    runner.warmup(max_batch_tokens=64, max_batch_size=4, max_total_kv_tokens=max_total_kv_tokens)
    return runner


def chunk(
    seq_id: int,
    token_ids: list[int],
    num_computed_tokens: int,
    first_block: int,
    block_size: int = 4,
    sample: bool = True,
    params: SamplingParams | None = GREEDY,
) -> SequenceChunk:
    """A chunk whose block table is the contiguous blocks first_block, first_block + 1, ..."""
    num_blocks = -(-(num_computed_tokens + len(token_ids)) // block_size)
    return SequenceChunk(
        id=seq_id,
        token_ids=token_ids,
        num_computed_tokens=num_computed_tokens,
        block_table=list(range(first_block, first_block + num_blocks)),
        sample=sample,
        params=params,
    )


def logits_of(runner: ModelRunner, *sequences: SequenceChunk) -> torch.Tensor:
    _, logits, _ = runner.forward_logits(ForwardRequest(sequences=list(sequences)))
    return logits


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield save_tiny_model(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def llama_runner(llama_dir: Path) -> ModelRunner:
    return make_runner(llama_dir)


@pytest.fixture(scope="session", params=["cpu", "torch"])
def llama_runner_each_backend(request: pytest.FixtureRequest, llama_dir: Path) -> ModelRunner:
    """The tiny Llama on the CPU kernels, then on the torch references."""
    return make_runner(llama_dir, attention_backend=request.param)


def _dot_as_a_tensor_core(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
    """The interpreter's `tl.dot`, replaced: operands widened to float32 (exact for 16-bit floats), each
    output element summed over K in order, then added to the accumulator d: what a tensor core computes.
    Triton 3.9's own multiplies bfloat16 operands as their raw uint16 bits, and sums float32 ones through
    numpy's BLAS, whose result for a row depends on its place in the matrix."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    a32 = a.data if a.dtype.scalar == tl.float32 else self.cast_impl(a, tl.float32).data
    b32 = b.data if b.dtype.scalar == tl.float32 else self.cast_impl(b, tl.float32).data
    products = a32.astype(np.float32)[:, :, None] * b32.astype(np.float32)[None, :, :]
    total = np.add.reduce(products, axis=1, dtype=np.float32)  # sequential over K: the middle axis
    return interpreter.TensorHandle((total + d.data).astype(np.float32), d.dtype.scalar)


@pytest.fixture
def tensor_core_dots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter, `tl.dot` as a tensor core computes it (`_dot_as_a_tensor_core`); on a GPU, the
    GPU's own."""
    if IS_INTERPRETED:
        from triton.runtime import interpreter

        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", _dot_as_a_tensor_core)
