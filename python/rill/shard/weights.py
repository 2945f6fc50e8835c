"""Loads a Hugging Face safetensors checkpoint into a Rill model, tensor by tensor, through each parameter's
`weight_loader` (fused layers map the checkpoint's separate q/k/v and gate/up tensors into their slices).

A parameter with a `weight_loader` gets a lazy safetensors slice of the memory-mapped file, and its loader
reads only this tensor-parallel rank's rows or columns: a rank never materializes a whole split tensor.
Parameters without one (norms) are replicated and read whole.

Which files: with a `model.safetensors.index.json` the files its `weight_map` names, and only those (a
Mistral folder ships `consolidated.safetensors`, the same weights under other names, beside its indexed HF
shards); without one, every `*.safetensors` in the folder.

A folder with `model.gguf` (rill.convert's folder for a GGUF file served as it is) loads from that file
instead (`load_gguf_weights`): llama.cpp's tensor names mapped to Hugging Face's, quantized matrices handed to
their layers' `load_quantized` as they are, everything else de-quantized to float."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from rill.kernels.quant import QTYPES, QuantizedTensor, quantize
from rill.shard.layers.embedding import LMHead, VocabParallel
from rill.shard.layers.linear import Linear, loaded_shape, read_part

logger = logging.getLogger(__name__)

# Checkpoint tensors with no parameter in Rill's models (buffers recomputed at init).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


class CheckpointLayout(Protocol):
    """What a model class declares about its checkpoint's names, read by `load_weights` (every model has all
    three; rill.shard.models.llama.LlamaForCausalLM gives the Llama defaults).

    - `packed_modules_mapping`: a Hugging Face module name -> (our fused parameter's module, the part of it),
      e.g. "q_proj" -> ("qkv_proj", "q"): the tensor goes to that part through the parameter's
      `weight_loader`.
    - `fused_checkpoint_parts`: our module -> its parts in row order, (part, rows) each, for a checkpoint that
      stores a fused tensor (Phi-3's qkv_proj): the tensor is split and each part loaded.
    - `resolve_checkpoint_name(name)`: (our parameter name, part) for a checkpoint name the model maps itself
      (MoE experts), tried first; None: the mappings above decide.
    """

    packed_modules_mapping: dict[str, tuple[str, object]]
    fused_checkpoint_parts: dict[str, list[tuple[object, int]]]

    def resolve_checkpoint_name(self, name: str) -> tuple[str, object] | None: ...

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, nn.Parameter]]: ...  # fmt: skip


INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_path: Path) -> list[Path]:
    """The safetensors files that hold the checkpoint (see the module docstring)."""
    model_path = Path(model_path)
    index = model_path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [model_path / name for name in sorted(set(weight_map.values()))]
        missing = [file.name for file in files if not file.is_file()]
        if missing:
            raise ValueError(f"{index} names files that are not in the folder: {missing}")
        return files
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in model folder {model_path}")
    return files


def load_weights(model: CheckpointLayout, model_path: Path) -> None:
    """Copies every tensor of the checkpoint's files into `model`; fails if a parameter stays unloaded."""
    if (Path(model_path) / GGUF_FILE).is_file():
        return load_gguf_weights(model, Path(model_path))
    files = checkpoint_files(model_path)
    params = dict(model.named_parameters(remove_duplicate=False))
    names_per_file: list[tuple[Path, list[str]]] = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            names_per_file.append((file, list(f.keys())))
    num_tensors = sum(len(names) for _, names in names_per_file)
    loaded: set[str] = set()
    with tqdm(total=num_tensors, desc="loading weights", unit="tensor") as progress:
        for file, names in names_per_file:
            with safe_open(file, framework="pt") as f:
                for name in names:
                    progress.update(1)
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    target, shard_id, parts = checkpoint_target(model, name)
                    if target not in params:
                        raise ValueError(
                            f"checkpoint tensor {name!r} ({file.name}) has no parameter in the model"
                        )
                    param = params[target]
                    loader = getattr(param, "weight_loader", None)
                    if parts:
                        _load_fused(param, f.get_slice(name), parts)
                    elif loader is not None:
                        loader(param, f.get_slice(name), shard_id)
                    else:
                        assert shard_id is None, f"{target} is fused but has no weight_loader"
                        _default_weight_loader(param, f.get_tensor(name))
                    loaded.add(target)
    _check_complete(params, loaded, model_path)
    logger.info("loaded %d tensors from %d safetensors file(s)", num_tensors, len(files))


def _check_complete(params: dict[str, nn.Parameter], loaded: set[str], model_path: Path) -> None:
    # A tied LM head shares the embedding's tensor, so loading either name loads both.
    tied = {name for name, p in params.items() for other in loaded if params[other] is p}
    missing = sorted(set(params) - loaded - tied)
    if missing:
        raise ValueError(f"checkpoint in {model_path} lacks tensors for parameters: {missing}")


GGUF_FILE = "model.gguf"
# llama.cpp's names of a Llama-layout model's tensors -> Hugging Face's (blk.N.x -> model.layers.N.x).
_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# The GGUF architectures whose files load as they are, and whether llama.cpp's converter permuted the rows of
# their q and k projections (its rotary layout), which loading undoes.
GGUF_NATIVE_ARCHITECTURES = {"llama": True, "qwen2": False}


def gguf_hf_name(name: str) -> str:
    """A GGUF tensor name as Hugging Face's checkpoint spells it (ValueError for a tensor outside the map)."""
    base, suffix = name.rsplit(".", 1)
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in _GGUF_NAMES:
            return f"model.layers.{layer}.{_GGUF_NAMES[part]}.{suffix}"
    elif base in _GGUF_NAMES:
        return f"{_GGUF_NAMES[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} has no place in a Llama-layout model")


def _unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row i of the Hugging Face q/k weight is row index[i] of llama.cpp's: per head, llama.cpp interleaves
    the two rotary halves (row 2j + t holds half t's row j)."""
    return torch.arange(num_rows).view(num_heads, -1, 2).transpose(1, 2).reshape(-1)


def load_gguf_weights(model: CheckpointLayout, model_path: Path) -> None:
    """Loads `model_path / model.gguf` into `model`: quantized matrices (the `QTYPES`) go to their layers'
    `load_quantized` as they are, other tensors are de-quantized (F16, BF16) to float and loaded as a
    safetensors tensor would be."""
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize

    config = json.loads((model_path / "config.json").read_text())
    # Copy-on-write mapping: the tensors are views of the file's pages, never written.
    reader = GGUFReader(model_path / GGUF_FILE, "c")
    architecture = str(reader.fields["general.architecture"].contents())
    if architecture not in GGUF_NATIVE_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {architecture!r} does not load as it is (rill.convert expands it)"
        )
    heads = {"q_proj": config["num_attention_heads"],
             "k_proj": config.get("num_key_value_heads", config["num_attention_heads"])}  # fmt: skip
    params = dict(model.named_parameters(remove_duplicate=False))
    modules: dict[str, Any] = dict(model.named_modules())  # type: ignore[attr-defined]
    loaded: set[str] = set()
    num_quantized = 0
    for tensor in tqdm(reader.tensors, desc="loading weights", unit="tensor"):
        name = gguf_hf_name(tensor.name)
        target, shard_id, parts = checkpoint_target(model, name)
        if target not in params or parts:
            raise ValueError(f"GGUF tensor {tensor.name!r} ({name}) has no parameter in the model")
        param, module = params[target], modules[target.rsplit(".", 1)[0]]
        qtype = tensor.tensor_type.name
        data = torch.from_numpy(tensor.data) if qtype in QTYPES else None
        columns = int(tensor.shape[0])
        projection = name.split(".")[-2]
        if GGUF_NATIVE_ARCHITECTURES[architecture] and projection in heads and name.endswith(".weight"):
            rows = _unpermute_rows(int(tensor.n_elements) // columns, heads[projection])
        else:
            rows = None
        if data is not None and hasattr(module, "load_quantized") and param is module.weight:
            module.load_quantized(
                QuantizedTensor(qtype, data if rows is None else data[rows], columns), shard_id
            )
            num_quantized += 1
        else:
            values = torch.from_numpy(
                np.asarray(gguf_dequantize(tensor.data, tensor.tensor_type), np.float32)
            )
            values = values.reshape(-1, columns) if values.dim() > 1 or data is not None else values
            if rows is not None:
                values = values[rows]
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, values, shard_id)
            else:
                _default_weight_loader(param, values)
        loaded.add(target)
    _check_complete(params, loaded, model_path)
    mixed = [name for name, module in modules.items() if getattr(module, "partly_quantized", False)]
    if mixed:
        raise ValueError(
            f"{GGUF_FILE} stores some parts of {mixed[0]} quantized and others in float; serve it expanded "
            "(--dtype float32)"
        )
    logger.info(
        "loaded %d tensors from %s (%d quantized, kept as they are)",
        len(reader.tensors),
        GGUF_FILE,
        num_quantized,
    )


def checkpoint_target(model: CheckpointLayout, name: str) -> tuple[str, object, list[tuple[object, int]]]:
    """Where a checkpoint tensor goes (the layout's mappings, see `CheckpointLayout`): our parameter's name,
    the part of it (None: all of it), and for a fused checkpoint tensor its parts in row order (else [])."""
    target, shard_id = model.resolve_checkpoint_name(name) or _resolve(name, model.packed_modules_mapping)
    return target, shard_id, _fused_parts(target, model.fused_checkpoint_parts)


def checkpoint_shapes(model_path: Path) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor's name and full shape, read from the files' headers (no tensor data)."""
    shapes = {}
    for file in checkpoint_files(model_path):
        with safe_open(file, framework="pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def _fused_parts(target: str, fused: dict[str, list[tuple[object, int]]]) -> list[tuple[object, int]]:
    for module, parts in fused.items():
        if f".{module}." in target:
            return parts
    return []


def _load_fused(param: nn.Parameter, loaded: object, parts: list[tuple[object, int]]) -> None:
    """A checkpoint tensor that stacks several parts along its rows (Phi-3's qkv_proj): each part's rows go
    to the fused layer's loader under its shard id."""
    total_rows = sum(rows for _, rows in parts)
    if loaded_shape(loaded)[0] != total_rows:
        raise ValueError(
            f"fused tensor has {loaded_shape(loaded)[0]} rows, its parts {parts} sum to {total_rows}"
        )
    start = 0
    for shard_id, rows in parts:
        param.weight_loader(param, read_part(loaded, 0, start, rows), shard_id)
        start += rows


def _resolve(name: str, packed: dict[str, tuple[str, object]]) -> tuple[str, object]:
    """Checkpoint tensor name -> (model parameter name, part of a fused parameter or None)."""
    for hf_part, (fused, shard_id) in packed.items():
        if f".{hf_part}." in name:
            return name.replace(f".{hf_part}.", f".{fused}."), shard_id
    return name, None


def quantize_weights(model: nn.Module, qtype: str) -> int:
    """`--quantize`: each decoder projection's float weight to `qtype` blocks (q8_0, q4_0: the `gguf`
    package's rounding, llama.cpp's), the embedding and an untied LM head to Q8_0 (finer, as llama.cpp's
    quantizer keeps them); a matrix whose inputs are not a multiple of 32 stays float. Returns how many were
    quantized."""
    count = 0
    for module in model.modules():
        if (
            not isinstance(module, Linear | VocabParallel)
            or module.quantized is not None
            or module.weight is None
        ):
            continue
        if isinstance(module, LMHead) and module.is_tied:
            continue
        if module.weight.shape[1] % 32 != 0:
            continue
        target = "Q8_0" if isinstance(module, VocabParallel) else qtype.upper()
        module.quantized = [quantize(module.weight.data, target)]
        count += 1
    return count
