"""docs/flags.md's flag tables equal what the binaries' own help says (names, env variables, defaults,
meanings): docs/flags.py makes them, this test fails when a flag changed and `python docs/flags.py` was not
run."""

from __future__ import annotations

import difflib
import importlib.util
import os
import sys
from pathlib import Path

import pytest
from rill import launcher

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("docs_flags", ROOT / "docs" / "flags.py")
assert _spec is not None and _spec.loader is not None
flags = importlib.util.module_from_spec(_spec)
sys.modules["docs_flags"] = flags  # dataclasses look their module up there
_spec.loader.exec_module(flags)


def _router_bin() -> Path | None:
    """The router the launcher would use: --router-bin's RILL_ROUTER_BIN, else what it finds."""
    if "RILL_ROUTER_BIN" in os.environ:
        return Path(os.environ["RILL_ROUTER_BIN"])
    try:
        return launcher.find_router_bin(os.environ)
    except RuntimeError:
        return None


def _assert_same(name: str, expected: str) -> None:
    actual = flags.page_table(flags.PAGE.read_text(), name)
    diff = "".join(
        difflib.unified_diff(actual.splitlines(True), expected.splitlines(True), "docs/flags.md", "--help")
    )
    assert actual == expected, (
        f"docs/flags.md's {name} flags differ from --help; run `python docs/flags.py`:\n{diff}"
    )


def test_launcher_table_matches_its_parser() -> None:
    _assert_same("launcher", flags.table(flags.launcher_flags()))


@pytest.mark.skipif(_router_bin() is None, reason="rill-router is not built yet (cargo build --release)")
def test_router_table_matches_rill_router_help() -> None:
    router_bin = _router_bin()
    assert router_bin is not None
    router_flags = flags.router_flags(router_bin)
    by_name = {flag.name: flag for flag in router_flags}
    # The parser of --help itself: a few facts known from router/src/config.rs.
    assert by_name["--max-batch-tokens"] == flags.Flag(
        "--max-batch-tokens", "RILL_MAX_BATCH_TOKENS", "2048", by_name["--max-batch-tokens"].meaning
    )
    assert by_name["--model-id"].default == "required" and by_name["--target-itl-ms"].default == "unset"
    assert by_name["--api-key"].env == "RILL_API_KEY" and "[" not in by_name["--api-key"].meaning
    assert all(
        flag.env == "RILL_" + flag.name[2:].upper().replace("-", "_") or not flag.env for flag in router_flags
    )
    _assert_same("router", flags.table(router_flags))
