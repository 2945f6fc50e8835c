"""Writes kubeconform's offline schema folder from the JSON schemas that the `kubernetes-validate` PyPI
package ships, so CI validates the Helm chart's output with no network beyond the package registries.

Run: python .ci/kubernetes_schemas.py KUBERNETES_VERSION OUT_DIR   (e.g. 1.31.0 /tmp/schemas)
Then kubeconform -strict -kubernetes-version 1.31.0 -schema-location OUT_DIR/TEMPLATE, as .ci/run does, with
TEMPLATE
    {{ .NormalizedKubernetesVersion }}-standalone{{ .StrictSuffix }}/{{ .ResourceKind }}{{ .KindSuffix }}.json
(the layout of kubeconform's own schemas).

The package's schemas point at one shared `_definitions.json` through an absolute `$id`
(https://kubernetes.io/api/...), which kubeconform would try to download; each schema written here carries
the definitions it reaches under its own `$defs` instead.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import kubernetes_validate

REF_PREFIX = "/api/_definitions.json#/$defs/"
LOCAL_PREFIX = "#/$defs/"


def localize(node: object, reached: set[str]) -> object:
    """Rewrites refs into the shared definitions as local refs, collecting the names they reach."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                for prefix in (REF_PREFIX, LOCAL_PREFIX):  # the definitions refer to each other locally
                    if value.startswith(prefix):
                        reached.add(value[len(prefix) :])
                        value = LOCAL_PREFIX + value[len(prefix) :]
            out[key] = localize(value, reached)
        return out
    if isinstance(node, list):
        return [localize(item, reached) for item in node]
    return node


def main(version: str, out_dir: Path) -> None:
    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    for strict in ("", "-strict"):
        source = root / f"v{version}-local{strict}"
        if not source.is_dir():
            sys.exit(f"kubernetes-validate has no schemas for Kubernetes {version} (see {root})")
        definitions = json.loads((source / "_definitions.json").read_text())["$defs"]
        target = out_dir / f"v{version}-standalone{strict}"
        target.mkdir(parents=True, exist_ok=True)
        for path in source.glob("*.json"):
            if path.name == "_definitions.json":
                continue
            schema = json.loads(path.read_text())
            schema.pop("$id", None)
            reached: set[str] = set()
            schema = localize(schema, reached)
            defs, todo = {}, list(reached)
            while todo:
                name = todo.pop()
                if name in defs:
                    continue
                found: set[str] = set()
                defs[name] = localize(definitions[name], found)
                todo.extend(found - defs.keys())
            if defs:
                schema["$defs"] = defs
            (target / path.name).write_text(json.dumps(schema))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], Path(sys.argv[2]))
