"""CI compile check: every rill/kernels/csrc/*.cu compiles with nvcc for sm_80 and sm_90, and the torch
binding (binding.cpp) passes a host compiler syntax check; no GPU needed. nvcc comes from PATH / CUDA_HOME
or from the PyPI wheels (`pip install "rill[cuda]"`). Exit status 1 on any compile error.

    python .ci/compile_cuda.py [--archs 80,90] [--no-binding]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from rill.kernels.cuda import CSRC, find_cuda_home


def run(command: list[str]) -> tuple[bool, float, str]:
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    return result.returncode == 0, time.perf_counter() - start, result.stdout + result.stderr


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--archs", default="80,90", help="comma-separated SM versions (default: 80,90)")
    parser.add_argument("--no-binding", action="store_true", help="skip the binding.cpp syntax check")
    args = parser.parse_args()
    cuda_home = find_cuda_home()
    if cuda_home is None:
        print("compile_check: nvcc not found (pip install 'rill[cuda]' or put the CUDA toolkit on PATH)")
        return 1
    nvcc = str(cuda_home / "bin" / "nvcc")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in args.archs.split(",")]
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for source in sorted(CSRC.glob("*.cu")):
            command = [
                nvcc,
                "-std=c++17",
                "-O3",
                "-c",
                str(source),
                "-o",
                str(Path(tmp) / f"{source.stem}.o"),
            ]
            ok, seconds, output = run(command + gencode)
            print(f"{'ok  ' if ok else 'FAIL'} {source.name} (sm_{args.archs}) {seconds:.1f}s")
            if not ok:
                failures += 1
                print("\n".join(output.splitlines()[-60:]))
    if not args.no_binding:
        from torch.utils import cpp_extension

        includes = [
            *cpp_extension.include_paths(),
            str(cuda_home / "include"),
            sysconfig.get_paths()["include"],
        ]
        command = [
            "c++",
            "-std=c++20",
            "-fsyntax-only",
            "-DTORCH_EXTENSION_NAME=rill_kernels",
            *(f"-I{path}" for path in includes),
            str(CSRC / "binding.cpp"),
        ]
        ok, seconds, output = run(command)
        print(f"{'ok  ' if ok else 'FAIL'} binding.cpp (host syntax check) {seconds:.1f}s")
        if not ok:
            failures += 1
            print("\n".join(output.splitlines()[-60:]))
    print(f"compile_check: {'all sources compile' if not failures else f'{failures} failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
