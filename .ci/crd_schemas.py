"""Writes kubeconform's JSON schema for each version of CustomResourceDefinitions, taken from their YAML, so
CI checks custom resources against the CRDs their projects publish (e.g. the InferencePool CRD of the Gateway
API Inference Extension's Go module) with no network beyond the package registries.

Run: python .ci/crd_schemas.py OUT_DIR CRD.yaml...
Each schema is OUT_DIR/KIND-GROUPPREFIX-VERSION.json (lowercase; GROUPPREFIX is the group up to its first
dot), the name kubeconform gives `{{ .ResourceKind }}{{ .KindSuffix }}.json`. Like the strict built-in
schemas, every object that lists its properties refuses unknown ones.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml


def strict(node: object) -> object:
    """`additionalProperties: false` on every object schema with `properties` and no say of its own."""
    if isinstance(node, dict):
        out = {key: strict(value) for key, value in node.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [strict(item) for item in node]
    return node


def main(out_dir: Path, crd_paths: list[Path]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in crd_paths:
        crd = yaml.safe_load(path.read_text())
        spec = crd["spec"]
        group_prefix = spec["group"].split(".")[0]
        kind = spec["names"]["kind"].lower()
        for version in spec["versions"]:
            schema = strict(version["schema"]["openAPIV3Schema"])
            name = f"{kind}-{group_prefix}-{version['name']}.json"
            (out_dir / name).write_text(json.dumps(schema))


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), [Path(arg) for arg in sys.argv[2:]])
