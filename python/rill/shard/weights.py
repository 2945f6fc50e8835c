"""Loads a Hugging Face safetensors checkpoint into a Rill model, tensor by tensor, through each parameter's
`weight_loader` (fused layers map the checkpoint's separate q/k/v and gate/up tensors into their slices).

A parameter with a `weight_loader` gets a lazy safetensors slice of the memory-mapped file, and its loader
reads only this tensor-parallel rank's rows or columns: a rank never materializes a whole split tensor.
Parameters without one (norms) are replicated and read whole.

Which files: with a `model.safetensors.index.json` the files its `weight_map` names, and only those (a
Mistral folder ships `consolidated.safetensors`, the same weights under other names, beside its indexed HF
shards); without one, every `*.safetensors` in the folder."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from rill.shard.layers.linear import loaded_shape, read_part

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
    # A tied LM head shares the embedding's tensor, so loading either name loads both.
    tied = {name for name, p in params.items() for other in loaded if params[other] is p}
    missing = sorted(set(params) - loaded - tied)
    if missing:
        raise ValueError(f"checkpoint in {model_path} lacks tensors for parameters: {missing}")
    logger.info("loaded %d tensors from %d safetensors file(s)", num_tensors, len(files))


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
