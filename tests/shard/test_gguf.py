"""GGUF files as --model-id: which quantisation types are accepted, what the tokenizer metadata says, and
the error for a missing file. (The conversion itself runs end to end in tests/e2e: the built-in default
model, Q4_1; Gemma 3 270M, Q4_K/Q5_0/Q6_K/Q8_0, opt-in.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, quants
from rill.shard.default_model import check_gguf, ensure_gguf_model


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
    assert metadata == {"pre_tokenizer": "default", "add_bos_token": True, "add_eos_token": False}


def test_unsupported_type_is_refused_by_name(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "q2k.gguf", [GGMLQuantizationType.F32, GGMLQuantizationType.Q2_K], False)
    with pytest.raises(RuntimeError, match=r"tensors of type Q2_K; Rill de-quantizes .*Q4_K, Q5_K, Q6_K"):
        check_gguf(path)


def test_missing_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="does not exist"):
        ensure_gguf_model(tmp_path / "absent.gguf", cache_dir=tmp_path / "cache")
