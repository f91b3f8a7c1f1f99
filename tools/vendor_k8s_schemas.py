#!/usr/bin/env python3
"""Writes tests/data/k8s-schemas-v1.33-strict.json: the Kubernetes JSON schemas that tests/test_deploy.py validates
deploy/'s manifests against, offline, with jsonschema alone.

They come from PyPI's kubernetes-validate (Apache-2.0; its v1.33.0-local-strict schemas, "strict" = no unknown
fields), which is too heavy to be a test dependency (a 22.5 MB wheel, 110 MB installed, for 13 Kubernetes
versions): only the kinds deploy/ uses are kept, with the definitions they reach, descriptions dropped.

    pip download --no-deps kubernetes-validate==1.37.0 -d /tmp/kv
    python tools/vendor_k8s_schemas.py /tmp/kv/kubernetes_validate-1.37.0-py3-none-any.whl

Add a kind to KINDS when deploy/ starts using it, and run this again."""

from __future__ import annotations

import json
import pathlib
import sys
import zipfile

VERSION = "v1.33.0-local-strict"
KINDS = {  # apiVersion/kind -> the schema file of kubernetes-validate, or a definition
    "v1/ConfigMap": "configmap-v1.json",
    "v1/Service": "service-v1.json",
    "v1/Secret": "secret-v1.json",
    "apps/v1/Deployment": "deployment-apps-v1.json",
    "apps/v1/StatefulSet": "statefulset-apps-v1.json",
    "networking.k8s.io/v1/NetworkPolicy": "networkpolicy-networking-v1.json",
    "PodTemplateSpec": "#io.k8s.api.core.v1.PodTemplateSpec",  # inside CRDs (LeaderWorkerSet's templates)
}
PREFIX = "/api/_definitions.json#/$defs/"
OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "k8s-schemas-v1.33-strict.json"


def strip(node, refs: set[str]):
    """`node` without descriptions, its $refs pointing into one `$defs`, the names it refers to added to refs."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "description" and isinstance(value, str):
                continue
            if key == "$ref":
                name = value.removeprefix(PREFIX).removeprefix("#/$defs/")
                refs.add(name)
                out[key] = "#/$defs/" + name
            else:
                out[key] = strip(value, refs)
        return out
    if isinstance(node, list):
        return [strip(value, refs) for value in node]
    return node


def main(wheel: str) -> None:
    root = f"kubernetes_validate/kubernetes-json-schema/{VERSION}/"
    with zipfile.ZipFile(wheel) as zf:
        defs = json.loads(zf.read(root + "_definitions.json"))["$defs"]
        kinds, todo = {}, set()
        for kind, source in KINDS.items():
            if source.startswith("#"):
                kinds[kind] = {"$ref": "#/$defs/" + source[1:]}
                todo.add(source[1:])
            else:
                kinds[kind] = strip(json.loads(zf.read(root + source)), todo)
    kept: dict = {}
    while todo:
        name = todo.pop()
        if name not in kept:
            kept[name] = strip(defs[name], todo)
    OUT.write_text(json.dumps({"source": f"kubernetes-validate 1.37.0, {VERSION}", "kinds": kinds,
                               "$defs": dict(sorted(kept.items()))}, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"{OUT}: {len(kinds)} kinds, {len(kept)} definitions, {OUT.stat().st_size} bytes")


if __name__ == "__main__":
    main(sys.argv[1])
