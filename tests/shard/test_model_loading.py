"""Which checkpoint files a model folder loads, tied and untied embeddings, unsupported model types."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rill.shard.weights import INDEX_FILE, checkpoint_files
from safetensors.torch import save_file

from .conftest import hf_model, make_runner, save_tiny_model
from .test_models import PROMPT, all_position_logits, check_against_hf


def save_sharded(path: Path, **overrides: object) -> Path:
    """A tiny checkpoint split into indexed HF shards (model-0000x-of-0000n.safetensors + index)."""
    save_tiny_model(path, model_type="mistral", **overrides)
    model = hf_model(path)
    for file in path.glob("*.safetensors"):
        file.unlink()
    model.save_pretrained(path, safe_serialization=True, max_shard_size="100KB")
    assert (path / INDEX_FILE).is_file()
    return path


def test_indexed_shards_only_beside_consolidated(tmp_path: Path) -> None:
    path = save_sharded(tmp_path)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1
    # Mistral's own format, the same weights under other names: loading it too would fail on its names.
    save_file({"layers.0.attention.wq.weight": torch.zeros(64, 64)}, path / "consolidated.safetensors")
    assert checkpoint_files(path) == shards
    check_against_hf(path)


def test_index_naming_a_missing_file_is_reported(tmp_path: Path) -> None:
    path = save_sharded(tmp_path)
    index = json.loads((path / INDEX_FILE).read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "model-gone.safetensors"
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model-gone.safetensors"):
        checkpoint_files(path)


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_embeddings(tmp_path: Path, tied: bool) -> None:
    path = save_tiny_model(tmp_path, tie_word_embeddings=tied)
    runner = make_runner(path)
    is_shared = runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
    assert is_shared == tied
    expected = hf_model(path)(torch.tensor([PROMPT])).logits[0].detach()
    torch.testing.assert_close(all_position_logits(runner, PROMPT), expected, rtol=1e-4, atol=1e-4)


def test_untied_checkpoint_without_lm_head_is_reported(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path = save_tiny_model(tmp_path, tie_word_embeddings=False)
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="lm_head"):
        make_runner(path)


def test_unsupported_model_type_lists_the_supported_ones(tmp_path: Path) -> None:
    path = save_tiny_model(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "gpt_bigcode"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt_bigcode'; supported: \[.*'llama'"):
        make_runner(path)
