"""GGUF files as --model-id: which quantisation types are accepted, what the tokenizer metadata says, the
error for a missing file, and a tiny Llama written as a GGUF (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; llama.cpp's q/k
row order; the default model's tokenizer metadata) converted into a folder whose weights are the originals
within each type's rounding and which Rill serves as transformers does. gguf-py cannot write K-quants:
Q5_K is written by this file's own encoder (`quantize_q5_k`, checked against gguf-py's de-quantizer, then in
a tiny Llama); Q4_K and Q6_K run in the opt-in Gemma 3 270M test."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, quants
from rill.convert import check_gguf, ensure_gguf_model


def write_gguf(path: Path, tensor_types: list[GGMLQuantizationType], add_bos_token: bool) -> Path:
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_pre("default")
    writer.add_add_bos_token(add_bos_token)
    rng = np.random.default_rng(0)
    for i, tensor_type in enumerate(tensor_types):
        values = rng.standard_normal((4, 256)).astype(np.float32)
        if tensor_type == GGMLQuantizationType.F32:
            writer.add_tensor(f"t{i}", values)
        elif tensor_type == GGMLQuantizationType.Q2_K:  # no quantizer in gguf-py: any bytes of the size
            num_bytes = (
                4 * 256 // quants.GGML_QUANT_SIZES[tensor_type][0] * quants.GGML_QUANT_SIZES[tensor_type][1]
            )
            writer.add_tensor(f"t{i}", np.zeros((4, num_bytes // 4), np.uint8), raw_dtype=tensor_type)
        else:
            writer.add_tensor(f"t{i}", quants.quantize(values, tensor_type), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_supported_types_pass_and_tokenizer_metadata_is_read(tmp_path: Path) -> None:
    types = [GGMLQuantizationType[name] for name in ("F32", "Q4_0", "Q4_1", "Q5_0", "Q8_0")]
    metadata = check_gguf(write_gguf(tmp_path / "ok.gguf", types, add_bos_token=True))
    assert metadata == {
        "architecture": "llama",
        "pre_tokenizer": "default",
        "add_bos_token": True,
        "add_eos_token": False,
    }


def test_unsupported_type_is_refused_by_name(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "q2k.gguf", [GGMLQuantizationType.F32, GGMLQuantizationType.Q2_K], False)
    with pytest.raises(RuntimeError, match=r"tensors of type Q2_K; Rill de-quantizes .*Q4_K, Q5_K, Q6_K"):
        check_gguf(path)


def test_missing_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="does not exist"):
        ensure_gguf_model(tmp_path / "absent.gguf", cache_dir=tmp_path / "cache")


QUANT_CYCLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (its converter interleaves the rotary halves per head)."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_tiny_llama_gguf(
    hf_dir: Path, tokenizer_source: Path, path: Path, quant_cycle: tuple[str, ...] = QUANT_CYCLE
) -> dict[str, str]:
    """The tiny HF llama in `hf_dir` as a GGUF file (2-D weights quantized, cycling through `quant_cycle`;
    Q5_K by `quantize_q5_k`) with the tokenizer metadata of `tokenizer_source`; returns each HF weight's
    quantisation type."""
    import json

    from gguf import GGUFReader
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    source = GGUFReader(str(tokenizer_source))
    writer.add_tokenizer_model(source.fields["tokenizer.ggml.model"].contents())
    writer.add_tokenizer_pre(source.fields["tokenizer.ggml.pre"].contents())
    writer.add_token_list(source.fields["tokenizer.ggml.tokens"].contents())
    writer.add_token_types(source.fields["tokenizer.ggml.token_type"].contents())
    writer.add_token_merges(source.fields["tokenizer.ggml.merges"].contents())
    writer.add_bos_token_id(source.fields["tokenizer.ggml.bos_token_id"].contents())
    writer.add_eos_token_id(source.fields["tokenizer.ggml.eos_token_id"].contents())
    writer.add_add_bos_token(False)
    writer.add_chat_template(source.fields["tokenizer.chat_template"].contents())
    names = {"embed_tokens": "token_embd", "lm_head": "output", "model.norm": "output_norm"}
    parts = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip
    types: dict[str, str] = {}
    for i, (name, weight) in enumerate(sorted(tensors.items())):
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{parts[rest.removesuffix('.weight')]}.weight"
        else:
            gguf_name = next(g for h, g in names.items() if h in name) + ".weight"
        if "q_proj" in name:
            weight = llama_cpp_permute(weight, config["num_attention_heads"])
        elif "k_proj" in name:
            weight = llama_cpp_permute(weight, config["num_key_value_heads"])
        if weight.ndim == 1:
            writer.add_tensor(gguf_name, weight)
            continue
        types[name] = quant_cycle[i % len(quant_cycle)]
        quant_type = GGMLQuantizationType[types[name]]
        if quant_type == GGMLQuantizationType.Q5_K:
            data = quantize_q5_k(weight)[0]
        else:
            data = quants.quantize(weight, quant_type)
        writer.add_tensor(gguf_name, data, raw_dtype=quant_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def test_tiny_llama_gguf_is_dequantized_and_served_like_transformers(tmp_path: Path) -> None:
    import torch
    from rill.convert import find_gguf
    from safetensors.torch import load_file

    from .conftest import hf_model, save_tiny_model
    from .test_models import check_against_hf

    hf_dir = save_tiny_model(tmp_path / "hf", vocab_size=49152, hidden_size=256, intermediate_size=512)
    types = write_tiny_llama_gguf(hf_dir, find_gguf(), tmp_path / "tiny.gguf")
    assert set(types.values()) == set(QUANT_CYCLE)
    model_dir = ensure_gguf_model(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache")
    assert ensure_gguf_model(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache") == model_dir  # cached
    original, converted = load_file(hf_dir / "model.safetensors"), load_file(model_dir / "model.safetensors")
    for name, quant_type in types.items():
        error = (converted[name] - original[name]).abs().max().item()
        # Within each type's rounding step, weights ~N(0, 0.2) (measured: 4-bit 0.09, 5-bit 0.03, 8-bit 0.004)
        assert error < {"Q8_0": 0.01, "Q5_0": 0.05, "Q5_1": 0.05}.get(quant_type, 0.12), (
            name,
            quant_type,
            error,
        )
    assert (model_dir / "chat_template.jinja").is_file()
    hf_model(model_dir)  # transformers loads the folder
    check_against_hf(model_dir)
    assert torch.equal(converted["model.norm.weight"], original["model.norm.weight"])


QK_K = 256  # values per K-quant super-block
Q5_K_BLOCK_BYTES = 2 + 2 + 12 + QK_K // 8 + QK_K // 2  # d, dmin, 6-bit scales/mins, high bits, low nibbles


def quantize_q5_k(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGML's Q5_K of float32 `values` [rows, cols] (cols a multiple of 256), written from its block layout
    (a plain min/max fit, not llama.cpp's search): per super-block of 256, fp16 `d` and `dmin`, then 8
    sub-blocks of 32 with a 6-bit scale `sc` and min `m` each, and 5-bit quants `q`, so that
    x ≈ d * sc * q - dmin * m. Returns the bytes [rows, cols / 256 * 176] and the values they encode."""
    rows, cols = values.shape
    x = values.astype(np.float32).reshape(-1, 8, 32)  # [super-blocks, sub-blocks, values]
    sub_min = np.maximum(0.0, -x.min(axis=2))  # subtracted, so >= 0
    sub_scale = (x.max(axis=2) + sub_min) / 31
    d = (sub_scale.max(axis=1) / 63).astype(np.float16)
    dmin = (sub_min.max(axis=1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.rint(sub_scale / d32), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin32 > 0, np.rint(sub_min / dmin32), 0).clip(0, 63).astype(np.uint8)
        step = (d32 * sc.astype(np.float32))[:, :, None]
        offset = (dmin32 * m.astype(np.float32))[:, :, None]
        q = np.where(step > 0, np.rint((x + offset) / step), 0).clip(0, 31).astype(np.uint8)
    decoded = step * q.astype(np.float32) - offset
    # Scales and mins, 12 bytes: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins);
    # sub-blocks 4-7 as low nibbles (scale) and high nibbles (min) of bytes 8-11, their top 2 bits in the
    # top 2 bits of bytes 0-3 (scales) and 4-7 (mins).
    packed = np.zeros((x.shape[0], 12), np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    # Sub-block 2k takes the low nibbles of low-bit bytes [32k, 32k + 32), sub-block 2k + 1 their high
    # nibbles; value l of sub-block i has its fifth bit in bit i of high-bit byte l.
    low = (q & 15).reshape(-1, 4, 2, 32)
    nibbles = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high_bits = ((q >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(
        axis=1, dtype=np.uint8
    )
    blocks = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, high_bits, nibbles],
        axis=1,
    )
    assert blocks.shape[1] == Q5_K_BLOCK_BYTES
    return blocks.reshape(rows, -1), decoded.reshape(rows, cols)


def test_q5_k_encoder_matches_gguf_py_dequantizer() -> None:
    """The bytes decode, through gguf-py, to exactly the values the encoder meant, within 5-bit rounding of
    the inputs; every byte field is exercised (scales and mins of all 8 sub-blocks, all 5 quant bits)."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal((6, 512)).astype(np.float32) * rng.uniform(0.01, 3, (6, 1)).astype(
        np.float32
    )
    values[0, :256] = np.abs(values[0, :256])  # a super-block with no negative value: mins of 0
    values[1, 256:] = 0.0  # an all-zero super-block: d = dmin = 0
    data, decoded = quantize_q5_k(values)
    assert data.shape == (6, 2 * Q5_K_BLOCK_BYTES)
    dequantized = quants.dequantize(data, GGMLQuantizationType.Q5_K)
    np.testing.assert_array_equal(dequantized, decoded)
    step = (values.max(axis=1) - np.minimum(0, values.min(axis=1))) / 31
    assert (np.abs(dequantized - values) <= step[:, None]).all()
    assert (np.abs(dequantized - values).max(axis=1) < 0.06 * np.abs(values).max(axis=1)).all()


def test_tiny_llama_with_q5_k_tensors_loads_like_transformers(tmp_path: Path) -> None:
    """Q5_K and Q8_0 tensors in a tiny Llama: Rill's conversion de-quantizes each Q5_K weight to exactly
    what the encoder put in it (q/k rows back in HF order), and serves the folder as transformers does."""
    from rill.convert import find_gguf
    from safetensors.torch import load_file

    from .conftest import save_tiny_model
    from .test_models import check_against_hf

    hf_dir = save_tiny_model(tmp_path / "hf", vocab_size=49152, hidden_size=256, intermediate_size=512)
    types = write_tiny_llama_gguf(hf_dir, find_gguf(), tmp_path / "tiny.gguf", quant_cycle=("Q5_K", "Q8_0"))
    assert {"Q5_K", "Q8_0"} == set(types.values())
    model_dir = ensure_gguf_model(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache")
    original, converted = load_file(hf_dir / "model.safetensors"), load_file(model_dir / "model.safetensors")
    num_heads = {"q_proj": 4, "k_proj": 2}  # the tiny config's attention and KV heads
    for name, quant_type in types.items():
        if quant_type != "Q5_K":
            continue
        weight = original[name].numpy()
        heads = next((n for part, n in num_heads.items() if part in name), None)
        if heads is None:
            expected = quantize_q5_k(weight)[1]
        else:  # encoded in llama.cpp's row order; the converter undoes it, as the inverse permutation here
            rows, cols = weight.shape
            permuted = quantize_q5_k(llama_cpp_permute(weight, heads))[1]
            expected = permuted.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
        np.testing.assert_array_equal(converted[name].numpy(), expected, err_msg=name)
        assert np.abs(expected - weight).max() < 0.05, name
    check_against_hf(model_dir)
