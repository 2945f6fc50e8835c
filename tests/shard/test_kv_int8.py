"""The int8 KV cache (`--kv-cache-dtype int8`, rill/shard/kv_cache.py): quantization, the CPU kernels against
the torch reference, batch invariance, swap, pool sizing, and what it costs the default model.

Bounds: the kernels' store is bitwise `quantize_int8`; their attention over int8 pools is within 1e-5
(float32) / 1e-2 (bfloat16) relative of the reference, which dequantizes the rows first (the kernels multiply
a key's scale into its score and a V row's into its probability: the same products in another order).
Against the float pools, int8 moves attention outputs on these random cases by 0.5-2% of their largest
magnitude (measured 0.0045-0.0197; bound 3e-2). The default model's teacher-forced argmax agreement with
the float32 pool is measured in `test_default_model_teacher_forced_agreement` (docs/kernels.md gives the
figure).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch
from rill.kernels import cpu
from rill.kernels.gpu import GpuOps
from rill.shard.batch import ForwardRequest
from rill.shard.config import ShardConfig
from rill.shard.kv_cache import KVCache, dequantize_int8, quantize_int8
from rill.shard.runner import ModelRunner

from bench.kernel_cases import AttentionCase, make_case, max_relative_error, plain_attention
from tests.shard.conftest import chunk, logits_of, make_runner, save_tiny_model
from tests.shard.test_cpu_kernels import BATCHES, TOLERANCE, metadata, reference_attention

OPS = cpu.CpuOps()
# Passage of ordinary English prose (a few hundred tokens) for the teacher-forced agreement measurement.
PASSAGE = (
    "The old harbour town woke slowly in winter. Before dawn the fishing boats slipped out past the "
    "breakwater, their lamps swinging in the dark, and by the time the bakery on the square opened its "
    "shutters the gulls were already quarrelling over the first catch on the quay. Most of the people "
    "who lived there had been born there, and most of them expected to die there, which gave the place a "
    "patience that visitors found either restful or maddening, depending on how long they stayed. The "
    "schoolteacher, a tall woman who had come from the city thirty years before and never quite stopped "
    "being a newcomer, liked to say that the town measured time in tides rather than hours. She taught "
    "the children to read from a box of books that had belonged to her grandmother, and every spring she "
    "took them up the hill behind the church to count the birds that returned from the south. The counts "
    "were written in a ledger kept in the library, and anyone who cared to look could see, page by page, "
    "how the swallows had grown fewer and the starlings more numerous over the decades. Nobody could say "
    "exactly why. The fishermen blamed the weather, the farmers blamed the fishermen, and the priest, "
    "who was fond of an argument, blamed everybody in turn. In the evenings the lights came on one by "
    "one along the harbour wall, and the smell of wood smoke drifted down the narrow streets towards the "
    "sea, where the boats were coming home."
)
# Measured (docs/kernels.md): the default model, float32, this passage (296 positions with the BOS): 0.980.
AGREEMENT_FLOOR = 0.97


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (NaN equals the same NaN); int8 as it is."""
    return t if t.dtype == torch.int8 else t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def int8_pools(case: AttentionCase) -> tuple[torch.Tensor, ...]:
    """The case's pools quantized as the store does (its NaN rows, in the null block and past each context,
    keep a NaN scale: a kernel that reads one gives NaN): (k, v, k_scale, v_scale)."""
    k, k_scale = quantize_int8(case.k_pool)
    v, v_scale = quantize_int8(case.v_pool)
    return k, v, k_scale, v_scale


def stored(case: AttentionCase, use_kernel: bool) -> tuple[torch.Tensor, ...]:
    """Copies of the case's int8 pools with the new tokens written by the kernel or by KVCache.store_kv."""
    num_blocks, block_size, num_kv_heads, head_dim = case.k_pool.shape
    cache = KVCache(1, num_blocks, block_size, num_kv_heads, head_dim, torch.int8, torch.device("cpu"))
    pools = (cache.k[0], cache.v[0], cache.k_scale[0], cache.v_scale[0])
    for pool, initial in zip(pools, int8_pools(case), strict=True):
        pool.copy_(initial)
    if use_kernel:
        OPS.store_kv(case.k, case.v, cache.k[0], cache.v[0], case.slot_mapping, *cache.scales(0))
    else:
        cache.store_kv(0, case.k, case.v, case.slot_mapping)
    return cache.k[0], cache.v[0], cache.k_scale[0], cache.v_scale[0]


def attend(case: AttentionCase, pools: tuple[torch.Tensor, ...], meta=None, q=None) -> torch.Tensor:
    k, v, k_scale, v_scale = pools
    meta = case.metadata() if meta is None else meta
    q = case.q if q is None else q
    return OPS.paged_attention(q, k, v, meta, case.scale, k_scale=k_scale, v_scale=v_scale)


def test_quantize_int8_rounds_half_to_even_and_maps_a_zero_row_to_zeros() -> None:
    # amax 127: scale 1, so x / scale is x itself: ties go to the even neighbour.
    x = torch.tensor([[127.0, 2.5, -2.5, 3.5, 0.49, -127.0], [0.0] * 6])
    q, scale = quantize_int8(x)
    assert scale.tolist() == [1.0, 0.0]
    assert q.tolist() == [[127, 2, -2, 4, 0, -127], [0] * 6]
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    rows = torch.randn(50, 64) * torch.logspace(-20, 20, 50)[:, None]
    q, scale = quantize_int8(rows)
    assert (q.abs().amax(dim=-1) == 127).all()
    assert ((dequantize_int8(q, scale) - rows).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_is_bitwise_the_reference_and_skips_negative_slots(dtype: torch.dtype) -> None:
    case = make_case([3, 40, 1], [20, 40, 70], 4, 2, 64, 16, dtype, device="cpu", seed=1)
    # Rows of every magnitude, a zero row, and ties at half an integer.
    case.k.mul_(torch.logspace(-30, 30, case.k.shape[0]).to(dtype)[:, None, None])
    case.k[0] = 0
    case.v[1, 0] = torch.arange(64, dtype=dtype) / 2
    skipped = int(case.slot_mapping[2])
    case.slot_mapping[2] = -1
    keep = case.slot_mapping >= 0  # the reference scatters every row: it gets the kept ones only
    kept = dataclasses.replace(case, k=case.k[keep], v=case.v[keep], slot_mapping=case.slot_mapping[keep])
    kernel, reference = stored(case, use_kernel=True), stored(kept, use_kernel=False)
    for got, expected in zip(kernel, reference, strict=True):
        assert got.dtype == expected.dtype and torch.equal(bits(got), bits(expected))
    written = case.slot_mapping[case.slot_mapping >= 0]
    k, _, k_scale, _ = kernel
    assert torch.equal(k.view(-1, 2, 64)[written], quantize_int8(case.k)[0][case.slot_mapping >= 0])
    assert k_scale.view(-1, 2)[int(written[0])].tolist() == [0.0, 0.0]  # the zero row
    before_k, _, before_scale, _ = int8_pools(case)
    assert torch.equal(k.view(-1, 2, 64)[skipped], before_k.view(-1, 2, 64)[skipped])
    assert torch.equal(bits(k_scale.view(-1, 2)[skipped]), bits(before_scale.view(-1, 2)[skipped]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [8, 16])
def test_attention_over_int8_pools_matches_the_reference(block_size, group, batch, dtype) -> None:
    query_lens, context_lens = BATCHES[batch]
    case = make_case(query_lens, context_lens, 2 * group, 2, 64, block_size, dtype, device="cpu", seed=group)
    pools = stored(case, use_kernel=True)
    out = attend(case, pools)
    assert out.dtype == dtype and out.shape == case.q.shape
    k, v, k_scale, v_scale = pools
    expected = reference_attention(case, dequantize_int8(k, k_scale), dequantize_int8(v, v_scale))
    assert max_relative_error(out, expected) < TOLERANCE[dtype]
    # Against the same attention over float pools: the quantization error alone.
    cache = KVCache(1, *case.k_pool.shape, dtype, torch.device("cpu"))
    cache.k[0].copy_(case.k_pool)
    cache.v[0].copy_(case.v_pool)
    cache.store_kv(0, case.k, case.v, case.slot_mapping)
    assert max_relative_error(out, reference_attention(case, cache.k[0], cache.v[0])) < 3e-2


@pytest.mark.parametrize(("window", "softcap"), [(16, 0.0), (50, 5.0)])
def test_sliding_window_and_softcap_over_int8_pools_match_plain_torch(window: int, softcap: float) -> None:
    case = make_case([1, 60, 1, 12], [65, 60, 200, 90], 6, 2, 64, 16, torch.float32, device="cpu", seed=3)
    k, v, k_scale, v_scale = stored(case, use_kernel=True)
    out = OPS.paged_attention(
        case.q, k, v, case.metadata(), case.scale, window, softcap, k_scale=k_scale, v_scale=v_scale
    )
    keys, values = dequantize_int8(k, k_scale), dequantize_int8(v, v_scale)
    for i, context_len in enumerate(case.context_lens):
        start, end = case.cu_seqlens_q[i], case.cu_seqlens_q[i + 1]
        blocks = case.block_tables[i, : -(-context_len // 16)]
        expected = plain_attention(
            case.q[start:end],
            keys[blocks].flatten(0, 1)[:context_len],
            values[blocks].flatten(0, 1)[:context_len],
            case.positions[start:end],
            case.scale,
            window,
            softcap,
        )
        assert max_relative_error(out[start:end], expected) < TOLERANCE[torch.float32]


def test_the_layer_reads_int8_pools_through_the_reference_and_the_kernels_alike() -> None:
    """PagedAttention's torch path (KVCache.store_kv + rows) and its kernel path over an int8 cache."""
    from rill.shard.layers.attention import ForwardContext, PagedAttention, forward_context

    case = make_case([1, 30, 1, 12], [65, 30, 129, 50], 4, 2, 64, 16, torch.float32, device="cpu", seed=4)
    outputs, caches = [], []
    for ops in (None, OPS):
        cache = KVCache(1, *case.k_pool.shape[:3], 64, torch.int8, torch.device("cpu"), ops=ops)
        pools = (cache.k[0], cache.v[0], cache.k_scale[0], cache.v_scale[0])
        for pool, initial in zip(pools, int8_pools(case), strict=True):
            pool.copy_(initial)
        layer = PagedAttention(0, 4, 2, 64, case.scale)
        layer.use_ops(ops)
        with torch.inference_mode(), forward_context(ForwardContext(cache, case.metadata())):
            outputs.append(layer(case.q, case.k, case.v))
        caches.append(cache)
    for reference_pool, kernel_pool in zip(
        (caches[0].k[0], caches[0].v[0], caches[0].k_scale[0], caches[0].v_scale[0]),
        (caches[1].k[0], caches[1].v[0], caches[1].k_scale[0], caches[1].v_scale[0]),
        strict=True,
    ):
        assert torch.equal(bits(reference_pool), bits(kernel_pool))
    assert max_relative_error(outputs[1], outputs[0]) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_attention_is_batch_invariant(dtype: torch.dtype) -> None:
    """A sequence alone equals it inside a batch; a prefill equals its chunks and its decode rows; 1 thread
    equals 2: bitwise, as over float pools."""
    case = make_case([1, 30, 1, 12, 300], [65, 30, 129, 50, 300], 12, 4, 64, 16, dtype, device="cpu", seed=5)
    pools = stored(case, use_kernel=True)
    batch = attend(case, pools)
    cu = case.cu_seqlens_q

    def rows(entries: list[tuple[int, int, int]]) -> torch.Tensor:
        q = torch.cat([case.q[start:end] for _, start, end in entries])
        positions = torch.cat([case.positions[start:end] for _, start, end in entries])
        tables = torch.stack([case.block_tables[seq] for seq, _, _ in entries])
        lens = torch.tensor([0] + [end - start for _, start, end in entries]).cumsum(0)
        return attend(case, pools, metadata(tables, lens, positions), q)

    for seq in range(len(case.context_lens)):
        assert torch.equal(rows([(seq, cu[seq], cu[seq + 1])]), batch[cu[seq] : cu[seq + 1]])
    last = len(case.context_lens) - 1
    bounds = [cu[last] + b for b in (0, 10, 37, 150, 299, 300)]
    chunks = [(last, a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert torch.equal(rows(chunks), batch[cu[last] :])
    decode_rows = [(last, t, t + 1) for t in reversed(range(cu[last], cu[last + 1]))]
    assert torch.equal(rows(decode_rows).flip(0), batch[cu[last] :])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = attend(case, pools)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(two, batch)


def test_kernels_check_int8_pools_and_the_gpu_refuses_them() -> None:
    case = make_case([1], [20], 4, 2, 64, 16, torch.float32, device="cpu")
    k, v, k_scale, v_scale = stored(case, use_kernel=False)
    with pytest.raises(RuntimeError, match="given together"):
        OPS.store_kv(case.k, case.v, k, v, case.slot_mapping, k_scale, None)
    with pytest.raises(RuntimeError, match="must be an int8"):
        OPS.paged_attention(
            case.q, k.float(), v.float(), case.metadata(), 1.0, k_scale=k_scale, v_scale=v_scale
        )
    with pytest.raises(RuntimeError, match="num_kv_heads"):
        OPS.paged_attention(case.q, k, v, case.metadata(), 1.0, k_scale=k_scale[..., :1], v_scale=v_scale)
    with pytest.raises(ValueError, match="no int8 KV cache"):
        GpuOps().store_kv(case.k, case.v, k, v, case.slot_mapping, k_scale, v_scale)


@pytest.mark.parametrize("kernel_layout", [False, True])
def test_swap_copies_the_scales_with_the_rows(kernel_layout: bool) -> None:
    cache = KVCache(2, 6, 4, 2, 16, torch.int8, torch.device("cpu"), ops=OPS if kernel_layout else None)
    cache.allocate_host_pool(5)
    assert len(cache.host_k_scale) == 2 and cache.host_v_scale[0].shape == (5, 4, 2)
    k = torch.randn(8, 2, 16)
    for layer in range(2):
        cache.store_kv(layer, k * (layer + 1), -k, torch.arange(4, 12))  # blocks 1 and 2
    before = [pool.clone() for pools, _ in cache.pool_pairs() for pool in pools]
    cache.swap_out([1, 2], [3, 4])
    for pools, _ in cache.pool_pairs():
        for pool in pools:
            pool[1:3] = 0
    cache.swap_in([3, 4], [4, 5])
    after = [pool for pools, _ in cache.pool_pairs() for pool in pools]
    assert len(after) == 8  # K, V and both scales of each layer
    for b, a in zip(before, after, strict=True):
        assert torch.equal(a[4:6], b[1:3])


def runner(
    path: Path, kv_cache_dtype: str, attention_backend: str = "auto", max_total_kv_tokens: int = 1024
) -> ModelRunner:
    return make_runner(
        path,
        block_size=16,
        max_total_kv_tokens=max_total_kv_tokens,
        attention_backend=attention_backend,
        kv_cache_dtype=kv_cache_dtype,
    )


def test_bytes_per_block_counts_the_scales_and_sizes_more_blocks(tmp_path: Path) -> None:
    # The default model's shapes: 30 layers, 3 KV heads of 64 dims.
    float32 = KVCache.bytes_per_block(30, 16, 3, 64, torch.float32)
    bfloat16 = KVCache.bytes_per_block(30, 16, 3, 64, torch.bfloat16)
    int8 = KVCache.bytes_per_block(30, 16, 3, 64, torch.int8)
    assert int8 == 2 * 30 * 16 * 3 * (64 + 4)
    assert round(float32 / int8, 2) == 3.76 and round(bfloat16 / int8, 2) == 1.88
    cache = KVCache(30, 3, 16, 3, 64, torch.int8, torch.device("cpu"))
    allocated = sum(pool.numel() * pool.element_size() for pools, _ in cache.pool_pairs() for pool in pools)
    assert allocated == 3 * int8
    model_dir = save_tiny_model(tmp_path / "model")
    host_bytes = 64 * 2**20
    blocks = {
        dtype: runner(model_dir, dtype)._decide_num_blocks(0, host_bytes, "test")[0]
        for dtype in ("auto", "int8")
    }
    assert blocks["int8"] == pytest.approx(blocks["auto"] * 64 / 20, rel=1e-3)  # head_dim 16: 64 B vs 16 + 4


@pytest.mark.parametrize("attention_backend", ["cpu", "torch"])
def test_a_runner_with_an_int8_pool_stays_close_to_the_float_one(
    tmp_path: Path, attention_backend: str
) -> None:
    model_dir = save_tiny_model(tmp_path / "model")
    int8_runner = runner(model_dir, "int8", attention_backend)
    float_runner = runner(model_dir, "auto", attention_backend)
    assert int8_runner.kv_cache is not None and int8_runner.kv_cache.is_int8
    tokens = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    prefill = [chunk(1, tokens[:30], 0, 1, block_size=16), chunk(2, tokens[10:40], 0, 3, block_size=16)]
    for model_runner in (int8_runner, float_runner):
        model_runner.clear()
    int8_logits, float_logits = logits_of(int8_runner, *prefill), logits_of(float_runner, *prefill)
    assert max_relative_error(int8_logits, float_logits) < 5e-2
    assert torch.equal(int8_logits.argmax(-1), float_logits.argmax(-1))
    # A decode step after it reads the int8 pool the prefill wrote.
    decode = chunk(1, tokens[30:31], 30, 1, block_size=16)
    assert max_relative_error(logits_of(int8_runner, decode), logits_of(float_runner, decode)) < 5e-2


def test_the_cuda_kernels_refuse_an_int8_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = save_tiny_model(tmp_path / "model")
    config = ShardConfig(model_path=model_dir, socket_path=tmp_path / "s.sock", kv_cache_dtype="int8")
    model_runner = ModelRunner.__new__(ModelRunner)  # only what _choose_ops reads: no GPU needed
    model_runner.config = config
    model_runner.device = torch.device("cuda")
    with pytest.raises(ValueError, match="--kv-cache-dtype int8 is not supported by the cuda kernels"):
        model_runner._choose_ops()


@pytest.fixture(scope="module")
def default_model() -> Path:
    from rill import convert

    if importlib.util.find_spec(convert.GGUF_PACKAGE) is None:
        pytest.skip(f"needs `{convert.INSTALL_COMMAND}`")
    return convert.ensure_default_model()


def teacher_forced_argmax(model_runner: ModelRunner, token_ids: list[int]) -> torch.Tensor:
    """The argmax after every position of one prefill of `token_ids` (each position's row sampled)."""
    sequence = dataclasses.replace(
        chunk(0, token_ids, 0, 1, block_size=16), num_speculative_tokens=len(token_ids) - 1
    )
    model_runner.clear()
    _, logits, _ = model_runner.forward_logits(ForwardRequest(sequences=[sequence]))
    return logits.argmax(dim=-1)


def test_default_model_teacher_forced_agreement(default_model: Path) -> None:
    """The default model reads PASSAGE once with each pool; the int8 pool's next-token argmax agrees with the
    float32 pool's at AGREEMENT_FLOOR of the positions or more (docs/kernels.md has the measured figure)."""
    from tokenizers import Tokenizer

    token_ids = [1, *Tokenizer.from_file(str(default_model / "tokenizer.json")).encode(PASSAGE).ids]
    argmax = {}
    for dtype in ("auto", "int8"):
        model_runner = runner(default_model, dtype, max_total_kv_tokens=len(token_ids) + 16)
        argmax[dtype] = teacher_forced_argmax(model_runner, token_ids)
        del model_runner
    agreement = (argmax["auto"] == argmax["int8"]).float().mean().item()
    print(
        f"teacher-forced argmax agreement, int8 vs float32 KV: {agreement:.4f} "
        f"over {len(token_ids)} positions"
    )
    assert agreement >= AGREEMENT_FLOOR
