"""ModelRunner: warmup sizing, per-sequence params lifecycle, greedy generation against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rill.shard import memory
from rill.shard.batch import ForwardRequest
from rill.shard.config import ShardConfig
from rill.shard.runner import ModelRunner, NotReadyError

from .conftest import chunk, hf_model, make_runner


def hf_greedy(path: Path, prompt: list[int], num_new_tokens: int) -> list[int]:
    model = hf_model(path)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_warmup_sizes_pool_from_requested_tokens(llama_dir: Path) -> None:
    runner = make_runner(llama_dir, block_size=16, max_total_kv_tokens=100)
    assert runner.kv_cache is not None and runner.kv_cache.num_blocks == 8  # ceil(100 / 16) + 1 null block
    assert runner.kv_cache.k[0].shape == (8, 16, 2, 16)


def test_warmup_sizes_pool_from_available_memory(llama_dir: Path) -> None:
    runner = make_runner(llama_dir, block_size=16)
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4  # k and v, layers, block_size, kv heads, head_dim, float32
    num_blocks, reason = runner._decide_num_blocks(0, 4 * 2**20, "MemAvailable 0.00 GiB")
    assert num_blocks == 2**20 // bytes_per_block and reason.endswith("MemAvailable 0.00 GiB")


def test_mem_available_parses_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  100 kB\nMemAvailable:   2048 kB\n")
    assert memory.mem_available_bytes(meminfo) == 2048 * 1024


def test_forward_before_warmup_is_refused(llama_dir: Path) -> None:
    runner = ModelRunner(ShardConfig(model_path=llama_dir, socket_path=llama_dir / "x.sock"))
    with pytest.raises(NotReadyError):
        runner.forward(ForwardRequest(sequences=[chunk(1, [1], 0, first_block=1)]))


def test_params_kept_until_released(llama_runner: ModelRunner) -> None:
    llama_runner.forward(ForwardRequest(sequences=[chunk(50, [1, 2, 3], 0, first_block=1)]))
    llama_runner.forward(ForwardRequest(sequences=[chunk(50, [4], 3, first_block=1, params=None)]))
    with pytest.raises(ValueError, match="params missing"):
        llama_runner.forward(
            ForwardRequest(released_ids=[50], sequences=[chunk(50, [5], 4, first_block=1, params=None)])
        )
    llama_runner.forward(ForwardRequest(sequences=[chunk(51, [1], 0, first_block=1)]))
    llama_runner.clear()
    assert llama_runner.params_by_id == {}


def test_greedy_generation_matches_transformers(llama_dir: Path, llama_runner: ModelRunner) -> None:
    prompt, num_new_tokens = [3, 141, 59, 26, 53, 58, 97], 8
    tokens: list[int] = []
    generations = llama_runner.forward(
        ForwardRequest(sequences=[chunk(60, prompt, 0, first_block=1)])
    ).generations
    for step in range(num_new_tokens - 1):
        tokens.append(generations[0].token_id)
        position = len(prompt) + step
        generations = llama_runner.forward(
            ForwardRequest(sequences=[chunk(60, [tokens[-1]], position, first_block=1, params=None)])
        ).generations
    tokens.append(generations[0].token_id)
    assert tokens == hf_greedy(llama_dir, prompt, num_new_tokens)
    assert generations[0].logprob <= 0


def test_forward_reports_the_model_time_in_its_result(llama_runner: ModelRunner) -> None:
    result = llama_runner.forward(ForwardRequest(sequences=[chunk(70, [1, 2, 3], 0, first_block=1)]))
    assert len(result.generations) == 1 and result.model_seconds > 0
