"""What the suites of `bench.suite` and `bench.peers` share: Rill started with the suite's flags, `python -m
bench` run in-process against the servers, their Prometheus samples read, a ratio printed."""

from __future__ import annotations

import argparse
import json
import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import cli
from bench.servers import Server, free_port, rill_command, serving


@contextmanager
def rill(args: argparse.Namespace, name: str, *flags: str) -> Iterator[Server]:
    """A Rill server started with `python -m rill` and these extra flags; stopped with SIGTERM on exit."""
    port = free_port()
    log = Path(tempfile.gettempdir()) / f"rill-bench-{name}-{port}.log"
    command = rill_command(port, "--device", args.device, "--num-threads", str(args.num_threads), *flags)
    if args.model_id:
        command += ["--model-id", str(args.model_id)]
    if args.router_bin:
        command += ["--router-bin", str(args.router_bin)]
    print(f"[suite] starting {name}: {' '.join(flags) or '(defaults)'}; log {log}", flush=True)
    with serving(command, port, log, what=name, timeout_s=900) as server:
        yield server


def metrics(server: Server) -> dict[str, float]:
    """The server's Prometheus samples by name (labels kept in the name)."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def bench(args: argparse.Namespace, *argv: str, seed: int | None = None) -> dict[str, Any]:
    """Runs `python -m bench ...` in-process with a JSON report (seeded with `seed`, default `--seed`) and
    returns it."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        path = Path(out.name)
    common = ["--seed", str(args.seed if seed is None else seed), "--json", str(path)]
    if args.tokenizer:
        common += ["--tokenizer", str(args.tokenizer)]
    code = cli.main([*argv, *common])
    if code != 0:
        raise RuntimeError(f"bench {' '.join(argv)} failed with {code}")
    return dict(json.loads(path.read_text()))


def compare(
    args: argparse.Namespace, a: Server, b: Server, *argv: str, seed: int | None = None
) -> dict[str, Any]:
    return compare_urls(args, a.url, b.url, *argv, seed=seed)


def compare_urls(
    args: argparse.Namespace, a_url: str, b_url: str, *argv: str, seed: int | None = None
) -> dict[str, Any]:
    """`python -m bench compare` of two servers, back to back (ratios b/a)."""
    return bench(args, "compare", "--a", f"a={a_url}", "--b", f"b={b_url}", "--no-progress", *argv, seed=seed)


def ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"
