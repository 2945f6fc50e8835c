"""Building and loading a kernel extension, written once for every device: the sources of a `KernelSources`
are compiled by `torch.utils.cpp_extension.load` into ~/.cache/rill/kernels/<prefix>-<hash>, where the hash
covers the sources, torch's version and whatever else ties the binary to a machine (compiler flags, CPU
features, CUDA archs). The first use builds (logged, with its time); a later one imports the cached library
directly, so a started machine needs neither the compiler nor ninja.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    return Path.home() / ".cache" / "rill" / "kernels"


@dataclass(frozen=True)
class KernelSources:
    """One extension: `sources` compiled from `directory`, `headers` hashed with them (paths relative to
    `directory`), built with these flags. `machine` is what else the binary depends on (CPU flags, archs)."""

    prefix: str
    directory: Path
    sources: tuple[str, ...]
    headers: tuple[str, ...]
    cflags: tuple[str, ...] = ()
    cuda_cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    machine: str = ""

    def key(self) -> str:
        digest = hashlib.sha256()
        for name in self.sources + self.headers:
            digest.update(name.encode())
            digest.update((self.directory / name).read_bytes())
        flags = " ".join(self.cflags + self.cuda_cflags + self.ldflags)
        digest.update(f"{torch.__version__}|{torch.version.cuda}|{flags}|{self.machine}".encode())
        return digest.hexdigest()[:16]

    def build_dir(self) -> Path:
        return cache_root() / f"{self.prefix}-{self.key()}"

    def library_name(self) -> str:
        return f"rill_{self.prefix.replace('-', '_')}_kernels_{self.key()}"

    def library_path(self) -> Path:
        return self.build_dir() / f"{self.library_name()}.so"

    def is_built(self) -> bool:
        return self.library_path().is_file()


def load_extension(sources: KernelSources, verbose: bool = False) -> ModuleType:
    """The cached library when built, else builds it (once per machine) and loads it."""
    if sources.is_built():
        name = sources.library_name()
        spec = importlib.util.spec_from_file_location(name, sources.library_path())
        assert spec is not None and spec.loader is not None, (
            "a file location always gives a spec with a loader"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    from torch.utils import cpp_extension

    directory = sources.build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    logger.info("building Rill's %s kernels (once) into %s", sources.prefix, directory)
    start = time.perf_counter()
    module = cpp_extension.load(
        name=sources.library_name(),
        sources=[str(sources.directory / name) for name in sources.sources],
        extra_cflags=list(sources.cflags),
        extra_cuda_cflags=list(sources.cuda_cflags),
        extra_ldflags=list(sources.ldflags),
        build_directory=str(directory),
        verbose=verbose,
    )
    logger.info("built Rill's %s kernels in %.0f s", sources.prefix, time.perf_counter() - start)
    return module
