"""LoRA adapters on the shard (rill/shard/lora.py) against PEFT, the library whose format Rill serves.

Tiny random Llama (and Phi-3, Qwen2, Qwen3, Gemma 2) checkpoints get adapters made by `peft` with random A
and B (`init_lora_weights=False`), saved with `save_pretrained`; `PeftModel` on the same checkpoint is the
oracle.
A batch that mixes adapters and base rows, and a few slots cycled through more adapters than they hold, must
give every sequence bitwise what it gets alone.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import peft
import pytest
import safetensors.torch
import torch
from rill.shard import distributed
from rill.shard.batch import ForwardRequest, SequenceChunk
from rill.shard.config import ShardConfig
from rill.shard.pb.shard.v1 import shard_pb2, shard_pb2_grpc
from rill.shard.runner import LoraOffError, ModelRunner

from .conftest import chunk, hf_model, logits_of, save_tiny_model
from .test_server import shard_server

PROMPT = [5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 12]
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (router id, peft.LoraConfig fields)
ADAPTERS: dict[str, tuple[int, dict[str, Any]]] = {
    "all": (1, dict(r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS)),
    "rslora": (
        2,
        dict(
            r=8,
            lora_alpha=16,
            target_modules=ALL_PROJECTIONS,
            use_rslora=True,
            rank_pattern={"v_proj": 4, r"layers\.1\.mlp\.down_proj": 2},
            alpha_pattern={"o_proj": 4},
        ),
    ),
    "qv": (3, dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
}


def save_adapter(
    base_dir: Path, out_dir: Path, seed: int, save_embedding_layers: bool | str = "auto", **fields: Any
) -> Path:
    """A PEFT LoRA adapter of `base_dir`'s model with random A and B, saved into `out_dir`."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(hf_model(base_dir), peft.LoraConfig(init_lora_weights=False, **fields))
    model.save_pretrained(out_dir, save_embedding_layers=save_embedding_layers)
    return out_dir


def peft_logits(base_dir: Path, adapter_dir: Path | None, token_ids: list[int]) -> torch.Tensor:
    """Logits [tokens, vocab] of the base model, with the adapter in `adapter_dir` as PEFT applies it."""
    model = hf_model(base_dir)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


def lora_runner(
    path: Path, attention_backend: str = "torch", max_loras: int = 4, max_lora_rank: int = 16
) -> ModelRunner:
    config = ShardConfig(
        model_path=path,
        socket_path=path / "unused.sock",
        block_size=4,
        attention_backend=attention_backend,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
    )
    runner = ModelRunner(config)
    runner.warmup(max_batch_tokens=64, max_batch_size=4, max_total_kv_tokens=1024)
    return runner


def with_adapter(seq: SequenceChunk, adapter_id: int) -> SequenceChunk:
    return dataclasses.replace(seq, adapter_id=adapter_id)


@pytest.fixture(scope="module")
def adapter_dirs(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: save_adapter(llama_dir, root / name, seed=adapter_id, **fields)
        for name, (adapter_id, fields) in ADAPTERS.items()
    }


@pytest.fixture(scope="module", params=["cpu", "torch"])
def runner(request: pytest.FixtureRequest, llama_dir: Path, adapter_dirs: dict[str, Path]) -> ModelRunner:
    """The tiny Llama with every adapter of ADAPTERS loaded, on the CPU kernels, then the torch references."""
    runner = lora_runner(llama_dir, attention_backend=request.param)
    for name, (adapter_id, _) in ADAPTERS.items():
        runner.load_adapter(adapter_id, adapter_dirs[name])
    return runner


def prefill_then_decode(runner: ModelRunner, adapter_id: int, seq_id: int, prefix: int = 5) -> torch.Tensor:
    """Logits at positions prefix - 1 .. len(PROMPT) - 1: a prefill of PROMPT[:prefix], then one decode call
    per remaining token, with the adapter."""
    first_block = 1 + 10 * seq_id
    got = [logits_of(runner, with_adapter(chunk(seq_id, PROMPT[:prefix], 0, first_block), adapter_id))[0]]
    for position in range(prefix, len(PROMPT)):
        step = chunk(seq_id, [PROMPT[position]], position, first_block, params=None)
        got.append(logits_of(runner, step)[0])
    return torch.stack(got)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_logits_match_peft(
    runner: ModelRunner, llama_dir: Path, adapter_dirs: dict[str, Path], name: str
) -> None:
    adapter_id = ADAPTERS[name][0]
    expected = peft_logits(llama_dir, adapter_dirs[name], PROMPT)[4:]
    base = peft_logits(llama_dir, None, PROMPT)[4:]
    assert (expected - base).abs().max() > 0.1, (
        "the adapter must change the logits for the test to mean anything"
    )
    got = prefill_then_decode(runner, adapter_id, seq_id=adapter_id)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # The same sequence without the adapter is the base model again.
    torch.testing.assert_close(prefill_then_decode(runner, 0, seq_id=9), base, rtol=1e-4, atol=1e-4)


def test_a_batch_of_base_rows_and_three_adapters_gives_each_its_own_bits(runner: ModelRunner) -> None:
    prompts = {0: PROMPT[:7], 1: PROMPT[2:11], 2: PROMPT[1:4], 3: PROMPT[3:9]}  # adapter id -> prompt

    def prefill(adapter_id: int, seq_id: int) -> SequenceChunk:
        return with_adapter(chunk(seq_id, prompts[adapter_id], 0, 1 + 10 * seq_id), adapter_id)

    def decode(adapter_id: int, seq_id: int) -> SequenceChunk:
        return chunk(seq_id, [adapter_id + 20], len(prompts[adapter_id]), 1 + 10 * seq_id, params=None)

    # Alone: sequences 11..14; together, in a shuffled order: 15..18 (the base row twice).
    alone = {
        a: (logits_of(runner, prefill(a, 11 + a)), logits_of(runner, decode(a, 11 + a))) for a in prompts
    }
    order = [(2, 15), (0, 16), (3, 17), (1, 18), (0, 19)]
    batch_prefill = logits_of(runner, *[prefill(a, s) for a, s in order])
    batch_decode = logits_of(runner, *[decode(a, s) for a, s in order])
    for row, (adapter_id, _) in enumerate(order):
        assert torch.equal(batch_prefill[row], alone[adapter_id][0][0]), f"adapter {adapter_id} prefill"
        assert torch.equal(batch_decode[row], alone[adapter_id][1][0]), f"adapter {adapter_id} decode"


def test_more_adapters_than_slots_evicts_the_least_recent_and_keeps_the_bits(
    llama_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    runner = lora_runner(llama_dir, max_loras=2)
    for name, (adapter_id, _) in ADAPTERS.items():
        runner.load_adapter(adapter_id, adapter_dirs[name])

    def run(*adapter_ids: int) -> dict[int, torch.Tensor]:
        seqs = [with_adapter(chunk(50 + a, PROMPT, 0, 1 + 10 * a), a) for a in adapter_ids]
        return dict(zip(adapter_ids, logits_of(runner, *seqs), strict=True))

    first = run(1, 2) | run(3)  # 3 evicts 1, the least recently used
    assert dict(runner.adapters.slot_by_id) == {2: 1, 3: 0}
    seen_slots = {1: {0}, 2: {1}, 3: {0}}
    for adapter_ids in [(1,), (2, 3), (1, 3), (2,), (1, 2), (3,)]:
        for adapter_id, logits in run(*adapter_ids).items():
            assert torch.equal(logits, first[adapter_id]), f"adapter {adapter_id} after evictions"
            seen_slots[adapter_id].add(runner.adapters.slot_by_id[adapter_id])
    assert all(slots == {0, 1} for slots in seen_slots.values()), "each adapter has run from both slots"

    with pytest.raises(
        ValueError, match=r"3 distinct adapters \[1, 2, 3\], more than the shard's 2 LoRA slots"
    ):
        run(1, 2, 3)
    # Unloaded: its host copy and slot are gone, a sequence naming it is refused, the others run on.
    runner.forward(ForwardRequest(sequences=[chunk(70, [1], 0, 200)], unloaded_adapter_ids=[2]))
    assert 2 not in runner.adapters.host and 2 not in runner.adapters.slot_by_id
    with pytest.raises(ValueError, match="sequence 52: adapter_id 2 is not loaded on the shard"):
        run(2)
    assert torch.equal(run(3)[3], first[3])


def test_a_sequence_keeps_its_adapter_until_released(runner: ModelRunner) -> None:
    runner.forward(ForwardRequest(sequences=[with_adapter(chunk(80, PROMPT[:4], 0, 150), 1)]))
    assert runner.adapter_by_id[80] == 1
    runner.forward(ForwardRequest(sequences=[chunk(81, [3], 0, 160)], released_ids=[80]))
    assert 80 not in runner.adapter_by_id
    with pytest.raises(ValueError, match="sequence 81: adapter_id sent without params"):
        logits_of(runner, with_adapter(chunk(81, [4], 1, 160, params=None), 1))


def bad_adapters(llama_dir: Path, adapter_dirs: dict[str, Path], root: Path) -> dict[str, tuple[Path, str]]:
    """Adapter folders the shard must refuse -> (folder, the error it gives)."""

    def edited(name: str, **config: Any) -> Path:
        folder = root / name
        folder.mkdir()
        for file in adapter_dirs["qv"].iterdir():
            (folder / file.name).write_bytes(file.read_bytes())
        path = folder / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
        return folder

    deeper_model = save_tiny_model(root / "deeper-model", num_hidden_layers=3)
    wider_model = save_tiny_model(root / "wider-model", intermediate_size=96)
    no_weights = edited("no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    return {
        "rank": (
            save_adapter(llama_dir, root / "rank", 0, r=32, target_modules=["q_proj"]),
            "rank 32 exceeds the shard's --max-lora-rank 16",
        ),
        "dora": (
            save_adapter(llama_dir, root / "dora", 0, r=4, target_modules=["q_proj"], use_dora=True),
            "use_dora = True is not supported",
        ),
        "lm_head": (
            save_adapter(llama_dir, root / "lm_head", 0, False, r=4, target_modules=["lm_head"]),
            "modifies lm_head, which is not a LoRA target",
        ),
        "lm_head saved whole": (
            save_adapter(llama_dir, root / "lm_head-saved", 0, r=4, target_modules=["lm_head"]),
            "tensor 'base_model.model.lm_head.base_layer.weight' is not a LoRA weight",
        ),
        "missing layer": (
            save_adapter(deeper_model, root / "deeper", 0, r=4, target_modules=["q_proj"]),
            "modifies model.layers.2.self_attn.q_proj, which the base model does not have",
        ),
        "shape": (
            save_adapter(wider_model, root / "wider", 0, r=4, target_modules=["up_proj"]),
            r"model.layers.0.mlp.up_proj: lora_A \(4, 64\) and lora_B \(96, 4\) do not fit the base weight "
            r"\[128, 64\]",
        ),
        "no weights": (no_weights, "has no adapter_model.safetensors"),
        "no config": (root, "has no adapter_config.json"),
        "no folder": (root / "absent", "does not exist"),
        "not lora": (edited("ia3", peft_type="IA3"), "peft_type is 'IA3'; Rill serves LoRA adapters only"),
        "bias": (edited("bias", bias="all"), "bias = 'all' is not supported"),
        "modules_to_save": (
            edited("mts", modules_to_save=["lm_head"]),
            r"modules_to_save = \['lm_head'\] is not supported",
        ),
        "fan_in_fan_out": (edited("fifo", fan_in_fan_out=True), "fan_in_fan_out = True is not supported"),
        "pissa": (edited("pissa", init_lora_weights="pissa"), "init_lora_weights = 'pissa' is not supported"),
    }


def test_bad_adapter_folders_are_refused_with_a_clear_message(
    llama_dir: Path, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    runner = lora_runner(llama_dir, max_loras=1)
    for name, (folder, message) in bad_adapters(llama_dir, adapter_dirs, tmp_path).items():
        with pytest.raises(ValueError, match=message):
            runner.load_adapter(5, folder)
        assert not runner.adapters.host, name
    with pytest.raises(ValueError, match="adapter_id must be >= 1"):
        runner.load_adapter(0, adapter_dirs["qv"])
    runner.load_adapter(5, adapter_dirs["qv"])
    with pytest.raises(ValueError, match="adapter_id 5 is already loaded"):
        runner.load_adapter(5, adapter_dirs["all"])


def test_lora_off(llama_runner: ModelRunner, adapter_dirs: dict[str, Path]) -> None:
    with pytest.raises(LoraOffError, match="--max-loras"):
        llama_runner.load_adapter(1, adapter_dirs["all"])
    with pytest.raises(ValueError, match=r"adapter_id 1 is not loaded on the shard \(LoRA is off"):
        logits_of(llama_runner, with_adapter(chunk(1, [3], 0, 1), 1))


FAMILIES: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    # Fused q/k/v and gate/up in the checkpoint: one A per fused module, B split by rows into the parts.
    "phi3": ("phi3", {"pad_token_id": 0}, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "qwen2-qkv-bias": ("qwen2", {}, ALL_PROJECTIONS),  # the adapter's product comes before the bias
    "qwen3-head-norms": ("qwen3", {"head_dim": 32}, ALL_PROJECTIONS),
    "gemma2-geglu": ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 24}, ALL_PROJECTIONS),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_families_match_peft(tmp_path: Path, family: str) -> None:
    model_type, overrides, target_modules = FAMILIES[family]
    model_dir = save_tiny_model(tmp_path / family, model_type, **overrides)
    adapter = save_adapter(
        model_dir, tmp_path / "adapter", 0, r=8, lora_alpha=16, target_modules=target_modules
    )
    runner = lora_runner(model_dir)
    runner.load_adapter(1, adapter)
    expected = peft_logits(model_dir, adapter, PROMPT)[-1]
    assert (expected - peft_logits(model_dir, None, PROMPT)[-1]).abs().max() > 0.1
    got = logits_of(runner, with_adapter(chunk(1, PROMPT, 0, 1), 1))[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("module", ["block_sparse_moe.experts.0.w1", "block_sparse_moe.gate"])
def test_moe_experts_and_router_are_not_targets(tmp_path: Path, module: str) -> None:
    model_dir = save_tiny_model(tmp_path / "mixtral", "mixtral", num_local_experts=4, num_experts_per_tok=2)
    runner = lora_runner(model_dir, max_loras=1)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8}')
    out_features = {"block_sparse_moe.experts.0.w1": 128, "block_sparse_moe.gate": 4}[module]
    key = f"base_model.model.model.layers.0.{module}"
    safetensors.torch.save_file(
        {f"{key}.lora_A.weight": torch.ones(4, 64), f"{key}.lora_B.weight": torch.ones(out_features, 4)},
        adapter / "adapter_model.safetensors",
    )
    with pytest.raises(ValueError, match=rf"modifies model.layers.0.{module}, which is not a LoRA target"):
        runner.load_adapter(1, adapter)


# --- the gRPC server ---


@contextmanager
def warm_shard_server(model_dir: Path, socket_path: Path, *flags: str) -> Iterator[shard_pb2_grpc.ShardStub]:
    """`test_server.shard_server`, warmed up."""
    with shard_server(model_dir, socket_path, *flags) as stub:
        stub.Warmup(shard_pb2.WarmupRequest(max_batch_tokens=32, max_batch_size=4, max_total_kv_tokens=400))
        yield stub


def prefill_pb(seq_id: int, token_ids: list[int], adapter_id: int, **fields: Any) -> shard_pb2.ForwardRequest:
    seq = shard_pb2.SequenceChunk(
        id=seq_id,
        token_ids=token_ids,
        num_computed_tokens=0,
        block_table=list(range(1 + 10 * seq_id, 1 + 10 * seq_id + 10)),
        sample=True,
        params=shard_pb2.SamplingParams(do_sample=False),
        adapter_id=adapter_id,
    )
    return shard_pb2.ForwardRequest(sequences=[seq], **fields)


def peft_greedy(base_dir: Path, adapter_dir: Path, prompt: list[int], num_new_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_new_tokens):
        tokens.append(int(peft_logits(base_dir, adapter_dir, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def test_server_loads_adapters_serves_them_and_forgets_unloaded_ones(
    llama_dir: Path, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    with warm_shard_server(
        llama_dir, tmp_path / "lora.sock", "--max-loras", "2", "--max-lora-rank", "8"
    ) as stub:
        info = stub.Info(shard_pb2.InfoRequest())
        assert (info.max_loras, info.max_lora_rank) == (2, 8)
        loaded = stub.LoadAdapter(shard_pb2.LoadAdapterRequest(adapter_id=4, path=str(adapter_dirs["qv"])))
        assert (loaded.rank, list(loaded.target_modules)) == (8, ["q_proj", "v_proj"])
        loaded = stub.LoadAdapter(shard_pb2.LoadAdapterRequest(adapter_id=5, path=str(adapter_dirs["all"])))
        assert list(loaded.target_modules) == sorted(ALL_PROJECTIONS)

        prompt, num_new_tokens = PROMPT[:8], 4
        tokens = [stub.Prefill(prefill_pb(1, prompt, 4)).generations[0].token_id]
        for step in range(num_new_tokens - 1):
            seq = shard_pb2.SequenceChunk(
                id=1,
                token_ids=tokens[-1:],
                num_computed_tokens=len(prompt) + step,
                block_table=list(range(11, 21)),
                sample=True,
            )
            tokens.append(stub.Decode(shard_pb2.ForwardRequest(sequences=[seq])).generations[0].token_id)
        assert tokens == peft_greedy(llama_dir, adapter_dirs["qv"], prompt, num_new_tokens)

        for request, message in [
            (shard_pb2.LoadAdapterRequest(adapter_id=6, path=str(tmp_path / "absent")), "does not exist"),
            (shard_pb2.LoadAdapterRequest(adapter_id=4, path=str(adapter_dirs["all"])), "already loaded"),
        ]:
            with pytest.raises(grpc.RpcError) as error:
                stub.LoadAdapter(request)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in error.value.details()
        # Adapters load while forwards run (the router does not wait): every call gets its own answer.
        alone = stub.Prefill(prefill_pb(2, prompt, 5)).generations[0]
        with ThreadPoolExecutor(4) as pool:
            forwards = [pool.submit(stub.Prefill, prefill_pb(2, prompt, 5)) for _ in range(3)]
            loads = [
                pool.submit(stub.LoadAdapter, shard_pb2.LoadAdapterRequest(adapter_id=i, path=str(folder)))
                for i, folder in [(7, adapter_dirs["rslora"]), (8, adapter_dirs["all"])]
            ]
            assert all(forward.result().generations[0] == alone for forward in forwards)
            assert [load.result().rank for load in loads] == [8, 8]
        # Unloaded with the next call: that call runs, a later one naming the adapter is refused.
        stub.Prefill(prefill_pb(2, prompt, 5, unloaded_adapter_ids=[4], released_ids=[1]))
        with pytest.raises(grpc.RpcError) as error:
            stub.Prefill(prefill_pb(3, prompt, 4))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "adapter_id 4 is not loaded" in error.value.details()
        stub.Health(shard_pb2.HealthRequest())


def test_server_without_lora_refuses_adapters(
    llama_dir: Path, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    with warm_shard_server(llama_dir, tmp_path / "base.sock") as stub:
        info = stub.Info(shard_pb2.InfoRequest())
        assert (info.max_loras, info.max_lora_rank) == (0, 16)
        with pytest.raises(grpc.RpcError) as error:
            stub.LoadAdapter(shard_pb2.LoadAdapterRequest(adapter_id=1, path=str(adapter_dirs["qv"])))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--max-loras" in error.value.details()
        with pytest.raises(grpc.RpcError) as error:
            stub.Prefill(prefill_pb(1, PROMPT, 1))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "LoRA is off" in error.value.details()


# --- tensor parallelism ---


def _rank_main(rank: int, model_dir: str, adapter_dir: str, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    config = ShardConfig(
        model_path=Path(model_dir),
        socket_path=Path(out_dir) / f"unused-{rank}.sock",
        block_size=4,
        rank=rank,
        world_size=2,
        dist_init_method=f"file://{init_file}",
        max_loras=2,
    )
    runner = ModelRunner(config)
    runner.warmup(max_batch_tokens=64, max_batch_size=4, max_total_kv_tokens=1024)
    runner.load_adapter(1, Path(adapter_dir))
    torch.save(tp_logits(runner), Path(out_dir) / f"rank-{rank}.pt")
    distributed.shutdown()


def tp_logits(runner: ModelRunner) -> torch.Tensor:
    """A prefill mixing the adapter and the base, then a decode step of both."""
    seqs = [with_adapter(chunk(1, PROMPT, 0, 1), 1), chunk(2, PROMPT[:6], 0, 20)]
    prefill = logits_of(runner, *seqs)
    decode = logits_of(runner, chunk(1, [3], len(PROMPT), 1, params=None), chunk(2, [4], 6, 20, params=None))
    return torch.cat([prefill, decode])


def test_two_ranks_match_one_shard(llama_dir: Path, adapter_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Column-parallel projections split B's rows, row-parallel ones A's columns, as their weights."""
    runner = lora_runner(llama_dir)
    runner.load_adapter(1, adapter_dirs["all"])
    expected = tp_logits(runner)
    context = multiprocessing.get_context("spawn")
    args = (str(llama_dir), str(adapter_dirs["all"]), str(tmp_path / "dist-init"), str(tmp_path))
    processes = [context.Process(target=_rank_main, args=(rank, *args)) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(300)
        if process.is_alive():
            process.kill()
    assert [p.exitcode for p in processes] == [0, 0], "a rank failed (see captured output)"
    results = [torch.load(tmp_path / f"rank-{rank}.pt") for rank in range(2)]
    relative_error = (results[0] - expected).abs().max() / expected.abs().max()
    assert relative_error < 1e-4, f"relative error {relative_error:.2e}"
    assert torch.equal(results[0], results[1]), "ranks disagree"
