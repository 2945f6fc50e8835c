"""Maps a Hugging Face `model_type` to Rill's model class and reads the model folder's config files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from rill.shard.models.gemma2 import Gemma2ForCausalLM
from rill.shard.models.gemma3 import Gemma3ForCausalLM
from rill.shard.models.llama import LlamaForCausalLM
from rill.shard.models.mixtral import MixtralForCausalLM
from rill.shard.models.phi3 import Phi3ForCausalLM
from rill.shard.models.qwen3 import Qwen3ForCausalLM
from rill.shard.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


def load_hf_config(model_path: Path) -> dict[str, Any]:
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"no config.json in model folder {model_path}")
    return json.loads(config_file.read_text())


def get_model_class(model_type: str) -> type[nn.Module]:
    if model_type not in MODEL_REGISTRY:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[model_type]


def eos_token_ids(model_path: Path, hf_config: dict[str, Any]) -> list[int]:
    """EOS ids from config.json and generation_config.json (each an int, a list, or absent), deduplicated."""
    sources = [hf_config.get("eos_token_id")]
    generation_config = Path(model_path) / "generation_config.json"
    if generation_config.is_file():
        sources.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    ids: list[int] = []
    for source in sources:
        for token_id in source if isinstance(source, list) else [source]:
            if token_id is not None and token_id not in ids:
                ids.append(int(token_id))
    return ids
