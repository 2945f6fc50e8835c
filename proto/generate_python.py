"""Regenerates the gRPC stubs in rill/shard/pb from proto/ (run: python rill/shard/pb/generate.py).

The output is committed and never edited by hand; rerun this script after changing the proto.
Two rewrites make the output a usable package for our declared runtime ranges:
- imports become absolute (`from rill.shard.pb.shard.v1 import shard_pb2`), since protoc writes
  `from shard.v1 import ...` relative to its include path;
- the gencode/runtime version gates are removed: grpcio-tools stamps its own protobuf and grpcio
  versions into the files and refuses older runtimes, while pyproject supports protobuf>=5.28 and
  grpcio>=1.66, whose builder API the generated code uses unchanged.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO_ROOT / "proto"
OUT_ROOT = REPO_ROOT / "python" / "rill" / "shard" / "pb"
PROTO_FILES = ["shard/v1/shard.proto"]

_PB2_VERSION_GATE = re.compile(
    r"from google\.protobuf import runtime_version as _runtime_version\n"
    r"|_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:    .*\n)*?\)\n"
)
_GRPC_VERSION_GATE = re.compile(r"GRPC_GENERATED_VERSION = .*?\n\n\n(?=class )", re.DOTALL)
_RELATIVE_IMPORT = re.compile(r"^from shard\.v1 import ", re.MULTILINE)


def _rewrite(path: Path) -> None:
    text = path.read_text()
    if path.name.endswith("_pb2.py"):
        text, count = _PB2_VERSION_GATE.subn("", text)
        assert count == 2, f"unexpected protoc output layout in {path} (found {count} gate parts)"
    elif path.name.endswith("_pb2_grpc.py"):
        text, count = _GRPC_VERSION_GATE.subn("", text)
        assert count == 1, f"unexpected grpc plugin output layout in {path}"
        text = text.replace("import warnings\n", "")
    text = _RELATIVE_IMPORT.sub("from rill.shard.pb.shard.v1 import ", text)
    path.write_text(text)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(PROTO_ROOT / name) for name in PROTO_FILES),
        ]
        if protoc.main(args) != 0:
            print("protoc failed", file=sys.stderr)
            return 1
        generated_root = OUT_ROOT / "shard"
        if generated_root.exists():
            shutil.rmtree(generated_root)
        shutil.copytree(Path(tmp) / "shard", generated_root)
    for package_dir in [generated_root, *(p for p in generated_root.rglob("*") if p.is_dir())]:
        (package_dir / "__init__.py").write_text("")
    for path in generated_root.rglob("*.py*"):
        _rewrite(path)
    print(f"generated stubs under {generated_root.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
