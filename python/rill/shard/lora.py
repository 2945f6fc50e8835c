"""LoRA adapters on a shard: the slot stacks of the projections, PEFT adapter folders read into host memory,
and which adapters sit in the S device slots (`--max-loras`).

- `enable_lora` gives each LoRA-capable projection a `LoraStack` (`rill.shard.layers.lora`: the math and the
  stacks' layout): the decoder layers' attention q/k/v/o and MLP gate/up/down, found by their Hugging Face
  module names through the model's checkpoint layout (`rill.shard.weights.CheckpointLayout`), so a fused
  qkv/gate_up gets one stack whose parts are q, k, v or gate, up. MoE experts, the routers, the embeddings and
  the LM head get none, and an adapter that modifies them is refused. The runner calls it after loading the
  weights and before installing the kernel ops, so the stacks get the ops with their projection, and before
  sizing the KV pool, whose accounting then sees their memory.
- `LoraAdapters.load` reads a PEFT folder (`adapter_config.json`, `adapter_model.safetensors`) into host
  memory under the router's id: each tensor `base_model.model.<module>.lora_A.weight` [r, in] /
  `.lora_B.weight` [out, r] goes to Rill's projection and part by the names the checkpoint loader uses
  (Phi-3's fused `qkv_proj`: one A shared by the parts, B split by rows), sliced for this tensor-parallel rank
  by the projection's own `weight_loader` (B's rows as a column-parallel part's, A's columns as a row-parallel
  weight's), with the scaling (lora_alpha / r, or / sqrt(r) with rsLoRA) folded into B.
- `LoraAdapters.assign_slots`, before each forward, puts every adapter of the call in a slot (least recently
  used evicted first) and returns the slots. A slot is always written whole (zero where the adapter has
  nothing), so what an evicted adapter left there is gone, and a row's bits do not depend on the slot.

Not thread-safe: the runner calls it on its one model thread (loading included), so reading an adapter never
races a slot copy.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from rill.shard.layers.linear import Linear, RowParallelLinear
from rill.shard.layers.lora import LoraStack
from rill.shard.weights import CheckpointLayout, checkpoint_target

# The Hugging Face module names adapters may modify (their Rill projection: `packed_modules_mapping`).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<matrix>[AB])\.weight$")
# adapter_config.json fields that do not change what a LoRA adapter computes at inference: metadata, training
# settings, and the target selection (the saved tensors already name exactly the modules it selected). Every
# other field must keep its off value (None, False, empty) unless `read_adapter_config` handles it.
_NEUTRAL_FIELDS = frozenset(
    {
        "auto_mapping",
        "base_model_name_or_path",
        "revision",
        "task_type",
        "inference_mode",
        "peft_version",
        "lora_dropout",
        "target_modules",
        "exclude_modules",
        "layers_to_transform",
        "layers_pattern",
        "megatron_core",
        "qalora_group_size",
    }
)
# init_lora_weights values that only initialize A and B; the others (pissa, olora, corda, loftq, lora_ga)
# change the base weights too, so the adapter is meant for another base.
_INITS_KEEPING_BASE = (True, False, "gaussian", "eva", "orthogonal")


@dataclass(frozen=True)
class AdapterConfig:
    """What an adapter_config.json says about the scaling of each module."""

    rank: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    @property
    def max_rank(self) -> int:
        return max([self.rank, *self.rank_pattern.values()])

    def module_rank(self, module: str) -> int:
        return _by_pattern(self.rank_pattern, module, self.rank)

    def scaling(self, module: str) -> float:
        """PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (both per module with the patterns)."""
        rank, alpha = self.module_rank(module), _by_pattern(self.alpha_pattern, module, self.alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _by_pattern(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank/alpha pattern lookup: the first key that is a regex matching the module's full name or its
    trailing dotted components."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter_config(folder: Path, max_rank: int) -> AdapterConfig:
    """Reads and checks `folder`'s adapter_config.json; ValueError naming the field Rill cannot serve."""
    path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise ValueError(f"adapter folder {folder} does not exist")
    if not path.is_file():
        raise ValueError(
            f"{folder} has no {CONFIG_FILE} (a PEFT LoRA adapter folder has {CONFIG_FILE} and {WEIGHTS_FILE})"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: cannot read it: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    where = f"{path}:"
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{where} peft_type is {config.get('peft_type')!r}; Rill serves LoRA adapters only")
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where} r must be a positive integer, got {rank!r}")
    if config.get("bias", "none") != "none":
        raise ValueError(
            f"{where} bias = {config['bias']!r} is not supported (only 'none': adapters that "
            "train biases change more than A and B)"
        )
    init = config.get("init_lora_weights", True)
    if init not in _INITS_KEEPING_BASE:
        raise ValueError(
            f"{where} init_lora_weights = {init!r} is not supported: that initialization changes "
            "the base weights, so the adapter does not fit the unchanged base model"
        )
    handled = {
        "peft_type",
        "r",
        "lora_alpha",
        "use_rslora",
        "rank_pattern",
        "alpha_pattern",
        "bias",
        "init_lora_weights",
    }
    for field, value in config.items():
        if field not in handled and field not in _NEUTRAL_FIELDS and value not in (None, False, {}, []):
            raise ValueError(
                f"{where} {field} = {value!r} is not supported (Rill serves plain LoRA: A, B and "
                "a scaling per module)"
            )
    adapter_config = AdapterConfig(
        rank=rank,
        alpha=float(alpha),
        use_rslora=bool(config.get("use_rslora", False)),
        rank_pattern=dict(config.get("rank_pattern") or {}),
        alpha_pattern=dict(config.get("alpha_pattern") or {}),
    )
    if adapter_config.max_rank > max_rank:
        raise ValueError(
            f"{where} rank {adapter_config.max_rank} exceeds the shard's --max-lora-rank {max_rank}"
        )
    return adapter_config


def read_adapter_tensors(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """HF module name -> {"A": lora_A [r, in], "B": lora_B [out, r]} from the folder's safetensors file."""
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        other = (
            " (adapter_model.bin, a pickle, is not read: save with safe_serialization)"
            if (folder / "adapter_model.bin").is_file()
            else ""
        )
        raise ValueError(f"{folder} has no {WEIGHTS_FILE}{other}")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                match = _TENSOR_KEY.match(key)
                if match is None:
                    raise ValueError(
                        f"{path}: tensor {key!r} is not a LoRA weight "
                        "(base_model.model.<module>.lora_A.weight or .lora_B.weight)"
                    )
                modules.setdefault(match["module"], {})[match["matrix"]] = f.get_tensor(key)
    except (OSError, SafetensorError) as error:
        raise ValueError(f"{path}: cannot read it: {error}") from None
    if not modules:
        raise ValueError(f"{path} holds no LoRA weights")
    for module, matrices in modules.items():
        if set(matrices) != {"A", "B"}:
            raise ValueError(f"{path}: module {module} has lora_{''.join(matrices)} but not both A and B")
    return modules


@dataclass
class _Target:
    """A projection adapters may modify: its stack and its parts (shard ids in row order; [None]: unfused)."""

    linear: Linear
    stack: LoraStack
    parts: list[object]

    def part_rows(self, part: int) -> tuple[int, int]:
        ends = self.stack.part_ends
        return (ends[part - 1] if part else 0), ends[part]


@dataclass(frozen=True)
class HostAdapter:
    """One adapter in host memory, laid out for the stacks: per Rill projection (its module name), a
    [P, r, in] (each part's A, zero for parts it leaves alone) and b [out, r] (this rank's rows, scaling
    folded in), r the largest rank among its parts (the smaller ones zero-padded)."""

    rank: int
    target_modules: list[str]  # HF module names (q_proj, ...), sorted
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


class LoraAdapters:
    """The adapters loaded on this shard (host memory, by the router's id) and the device slots' occupants."""

    def __init__(
        self,
        model: CheckpointLayout,
        targets: dict[str, _Target],
        max_rank: int,
        base_shapes: dict[str, tuple[int, ...]],
    ) -> None:
        self.model, self.targets, self.max_rank, self.base_shapes = model, targets, max_rank, base_shapes
        self.num_slots = next(iter(targets.values())).stack.a.shape[0]
        self.host: dict[int, HostAdapter] = {}
        self.slot_by_id: OrderedDict[int, int] = OrderedDict()  # least recently used first

    def is_loaded(self, adapter_id: int) -> bool:
        return adapter_id in self.host

    def load(self, adapter_id: int, folder: Path) -> HostAdapter:
        """Reads the adapter in `folder` into host memory under `adapter_id` (ValueError: what is wrong)."""
        if adapter_id < 1:
            raise ValueError(f"adapter_id must be >= 1 (0 is the base model), got {adapter_id}")
        if adapter_id in self.host:
            raise ValueError(f"adapter_id {adapter_id} is already loaded")
        config = read_adapter_config(folder, self.max_rank)
        tensors = read_adapter_tensors(folder)
        parts: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, matrices in tensors.items():
            rill_module, module_parts = self._module_parts(module, matrices, config)
            parts.setdefault(rill_module, {}).update(module_parts)
        weights = {name: self._layout(self.targets[name], by_part) for name, by_part in parts.items()}
        adapter = HostAdapter(
            rank=max(a.shape[1] for a, _ in weights.values()),
            target_modules=sorted({module.rpartition(".")[2] for module in tensors}),
            weights=weights,
        )
        self.host[adapter_id] = adapter
        return adapter

    def _module_parts(
        self, module: str, matrices: dict[str, torch.Tensor], config: AdapterConfig
    ) -> tuple[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        """The Rill projection an HF module's A/B modify, and per part of it this rank's (A [r, in], B rows
        [part rows, r]), checked against the base's shapes."""
        a, b = matrices["A"], matrices["B"]
        base_name = f"{module}.weight"
        if base_name not in self.base_shapes:
            raise ValueError(f"the adapter modifies {module}, which the base model does not have")
        target_name, shard_id, fused_parts = checkpoint_target(self.model, base_name)
        rill_module = target_name.removesuffix(".weight")
        target = self.targets.get(rill_module)
        if target is None:
            raise ValueError(
                f"the adapter modifies {module}, which is not a LoRA target (Rill applies adapters "
                f"to the decoder layers' {', '.join(TARGET_MODULES)})"
            )
        rank, (out_features, in_features) = config.module_rank(module), self.base_shapes[base_name]
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise ValueError(
                f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base weight "
                f"[{out_features}, {in_features}] at rank {rank} (expected A [{rank}, {in_features}], "
                f"B [{out_features}, {rank}])"
            )
        b = (b.float() * config.scaling(module)).to(target.stack.b.dtype)
        a = a.to(target.stack.a.dtype)
        linear = target.linear
        if isinstance(linear, RowParallelLinear):  # A's columns split as the weight's, B whole
            a_local = a.new_zeros(rank, target.stack.a.shape[2])
            linear.weight_loader(a_local, a)
            return rill_module, {0: (a_local, b)}
        module_parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        row = 0
        for part_id, rows in fused_parts or [(shard_id, out_features)]:
            # B's rows as the weight's rows of this part: the layer's loader writes them into a stand-in.
            part = target.parts.index(part_id)
            b_local = b.new_zeros(target.stack.part_ends[-1], rank)
            linear.weight_loader(b_local, b[row : row + rows], part_id)
            start, end = target.part_rows(part)
            module_parts[part] = (a, b_local[start:end])
            row += rows
        return rill_module, module_parts

    @staticmethod
    def _layout(
        target: _Target, by_part: dict[int, tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rank = max(a.shape[0] for a, _ in by_part.values())
        stack = target.stack
        a_host = stack.a.new_zeros(len(target.parts), rank, stack.a.shape[2], device="cpu")
        b_host = stack.b.new_zeros(stack.b.shape[1], rank, device="cpu")
        for part, (a, b_rows) in by_part.items():
            start, end = target.part_rows(part)
            a_host[part, : a.shape[0]] = a
            b_host[start:end, : a.shape[0]] = b_rows
        return a_host, b_host

    def unload(self, adapter_ids: list[int]) -> None:
        """Frees the host copy and the slot of each id (one not loaded is ignored: idempotent)."""
        for adapter_id in adapter_ids:
            self.host.pop(adapter_id, None)
            self.slot_by_id.pop(adapter_id, None)

    def assign_slots(self, adapter_ids: set[int]) -> dict[int, int]:
        """Puts every adapter of `adapter_ids` (loaded ones) in a slot, evicting the least recently used
        others, and returns id -> slot. ValueError if they are more than the slots."""
        if len(adapter_ids) > self.num_slots:
            raise ValueError(
                f"the call uses {len(adapter_ids)} distinct adapters {sorted(adapter_ids)}, more than the "
                f"shard's {self.num_slots} LoRA slots (--max-loras)"
            )
        for adapter_id in sorted(adapter_ids):
            assert adapter_id in self.host, f"adapter {adapter_id} is not loaded"
            if adapter_id in self.slot_by_id:
                self.slot_by_id.move_to_end(adapter_id)
        for adapter_id in sorted(adapter_ids - set(self.slot_by_id)):
            free = sorted(set(range(self.num_slots)) - set(self.slot_by_id.values()))
            if free:
                slot = free[0]
            else:  # the call's own adapters were moved to the end, so the first is another's
                victim = next(iter(self.slot_by_id))
                assert victim not in adapter_ids
                slot = self.slot_by_id.pop(victim)
            self._fill(slot, self.host[adapter_id])
            self.slot_by_id[adapter_id] = slot
        return {adapter_id: self.slot_by_id[adapter_id] for adapter_id in adapter_ids}

    def _fill(self, slot: int, adapter: HostAdapter) -> None:
        """Writes slot `slot` of every stack whole: the adapter's A/B zero-padded to R, zero elsewhere."""
        for name, target in self.targets.items():
            stack = target.stack
            stack.a[slot].zero_()
            stack.b[slot].zero_()
            if name not in adapter.weights:
                continue
            a, b = adapter.weights[name]
            rank = a.shape[1]
            stack.a[slot].view(len(target.parts), stack.rank, -1)[:, :rank].copy_(a)
            stack.b[slot, :, :rank].copy_(b)


def _parts_of(linear: Linear) -> tuple[list[object], tuple[int, ...]]:
    """A projection's parts (shard ids in row order; [None] when unfused) and their local row ends."""
    parts = getattr(linear, "parts", None)
    if parts is None:
        return [None], (linear.weight.shape[0],)
    ordered = sorted(parts.items(), key=lambda item: item[1][0])  # by offset in this rank's rows
    return [part for part, _ in ordered], tuple(offset + size for _, (offset, size, _) in ordered)


def enable_lora(
    model: nn.Module, max_loras: int, max_rank: int, base_shapes: dict[str, tuple[int, ...]]
) -> LoraAdapters:
    """Gives each LoRA-capable projection of `model` (weights loaded, no kernel ops yet) a stack of
    `max_loras` slots of rank `max_rank`; `base_shapes`: the checkpoint's tensor shapes
    (`rill.shard.weights.checkpoint_shapes`), which an adapter's A and B must fit."""
    if max_loras < 1 or max_rank < 1:
        raise ValueError(f"need max_loras >= 1 and max_lora_rank >= 1, got {max_loras} and {max_rank}")
    names = {model.packed_modules_mapping.get(name, (name,))[0] for name in TARGET_MODULES}
    names |= set(model.fused_checkpoint_parts)
    targets: dict[str, _Target] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, Linear) or module_name.rpartition(".")[2] not in names:
            continue
        assert module.packed is None, "enable_lora runs before the kernel ops are installed"
        parts, part_ends = _parts_of(module)
        weight = module.weight
        module.lora = LoraStack(max_loras, max_rank, weight.shape[1], part_ends, weight.dtype, weight.device)
        targets[module_name] = _Target(module, module.lora, parts)
    if not targets:
        raise ValueError(f"{type(model).__name__} has no projection LoRA adapters can modify")
    return LoraAdapters(model, targets, max_rank, base_shapes)
