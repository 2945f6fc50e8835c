"""Imports in the `rill` package and the `bench` package above it point down: every module belongs to one
layer of `LAYERS`, and imports only from its own layer or lower ones, without a cycle. Read from the source
with `ast` (every import, also those inside functions or under TYPE_CHECKING), so nothing is imported to
check it.

A new module is placed in `LAYERS` (the test fails until it is); docs/architecture.md draws this graph."""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE_ROOTS = {"rill": REPO_ROOT / "python", "bench": REPO_ROOT}  # package -> the folder that holds it

# Lowest first. A module is in the layer of the longest prefix that names it (a package names its modules).
LAYERS: list[tuple[str, ...]] = [
    (
        "rill",
        "rill.shard",
        "rill.kernels",
    ),  # the two package markers import nothing; the kernels, no shard code
    (
        "rill.shard.pb",
        "rill.shard.memory",
        "rill.shard.distributed",
        "rill.shard.sampling",
        "rill.shard.telemetry",
    ),
    ("rill.shard.config", "rill.shard.kv_cache", "rill.shard.batch"),
    ("rill.shard.layers",),
    ("rill.shard.models", "rill.shard.weights", "rill.shard.lora"),
    ("rill.shard.cuda_graphs", "rill.convert"),  # built on the models (the converter checks the registry)
    ("rill.shard.runner",),
    ("rill.shard.server",),
    ("rill.launcher", "rill.__main__"),
    # The benchmarks, above all of rill (they may import any of it; rill imports none of them).
    (
        "bench",
        "bench.repeat_texts",
        "bench.workloads",
        "bench.servers",
        "bench.kernel_cases",
        "bench.roofline",
    ),
    ("bench.client", "bench.cpu_kernels", "bench.gpu_check"),
    ("bench.stats", "bench.runner", "bench.plots", "bench.soak"),
    ("bench.report",),
    ("bench.cli", "bench.__main__"),
    ("bench.harness",),  # starts Rill and runs the cli against it, for the suites
    ("bench.peers", "bench.agents"),
    ("bench.lora", "bench.speculative"),  # run the peers workload
    ("bench.suite",),
]


def find_modules(root: Path, package: str = "rill") -> dict[str, Path]:
    """Module name -> file, for every module of `package` under `root`."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = find_modules(PACKAGE_ROOTS["rill"], "rill") | find_modules(PACKAGE_ROOTS["bench"], "bench")


def layer_of(module: str) -> int:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for layer, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[0]
            ):
                best = (len(prefix), layer)
    package = module.partition(".")[0]
    if best is None or (best[0] == len(package) and module != package):  # named only by its package
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}")
    return best[1]


def imports_of(module: str, modules: dict[str, Path]) -> set[str]:
    """The rill and bench modules `module` imports (a `from package import name` names the submodule when it
    is one)."""
    path = modules[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {name for name in found if name.partition(".")[0] in PACKAGE_ROOTS} - {module}


GRAPH: dict[str, set[str]] = {module: imports_of(module, MODULES) for module in MODULES}


def test_every_module_is_in_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def test_imports_point_down() -> None:
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in GRAPH.items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import cycle of `graph` (module -> the modules it imports), its first module repeated at its end;
    None when there is none."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        for target in sorted(graph.get(module, ())):
            if cycle := visit(target, [*path, module]):
                return cycle
        done.add(module)
        return None

    for module in sorted(graph):
        if cycle := visit(module, []):
            return cycle
    return None


def test_no_import_cycle() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checker_sees_a_cycle_within_one_layer(tmp_path: Path) -> None:
    """Modules of one layer may import each other, but not in a circle (as bench.peers and bench.suite did,
    from inside functions)."""
    (tmp_path / "bench").mkdir()
    for name, text in {
        "__init__.py": "",
        "peers.py": "def run():\n    from bench import suite\n",
        "suite.py": "from bench import peers\n",
        "cli.py": "",
    }.items():
        (tmp_path / "bench" / name).write_text(text)
    modules = find_modules(tmp_path, "bench")
    graph = {module: imports_of(module, modules) for module in modules}
    assert find_cycle(graph) == ["bench.peers", "bench.suite", "bench.peers"]
    assert find_cycle({**graph, "bench.suite": set()}) is None


def test_kernels_import_nothing_of_the_shard() -> None:
    for module, targets in GRAPH.items():
        if module.startswith("rill.kernels"):
            assert not {t for t in targets if t.startswith("rill.shard")}, f"{module} imports {targets}"


def test_the_checker_sees_absolute_and_relative_imports(tmp_path: Path) -> None:
    """The checks can fail: an upward import is found however it is written."""
    for name, text in {
        "__init__.py": "",
        "shard/__init__.py": "",
        "shard/runner.py": "",
        "kernels/__init__.py": "def f():\n    from ..shard import runner\n",
        "kernels/build.py": "import rill.shard.runner\n",
    }.items():
        (tmp_path / "rill" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "rill" / name).write_text(text)
    modules = find_modules(tmp_path)
    assert imports_of("rill.kernels", modules) == {"rill.shard.runner"}
    assert imports_of("rill.kernels.build", modules) == {"rill.shard.runner"}
    assert layer_of("rill.shard.runner") > layer_of("rill.kernels.build")


def test_models_import_only_layers_and_models() -> None:
    """A model file is pure math: no distributed, no gRPC stubs, no runner state."""
    for module, targets in GRAPH.items():
        if module.startswith("rill.shard.models"):
            allowed = ("rill.shard.layers", "rill.shard.models")
            assert all(target.startswith(allowed) for target in targets), (
                f"{module} imports {sorted(targets)}"
            )
