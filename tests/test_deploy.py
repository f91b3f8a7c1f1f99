"""deploy/: every manifest renders, validates against Kubernetes' schemas, runs the connector with settings it
accepts and every secure setting on, and its alerts and dashboard use only metrics the connector exports.

Offline and in a few seconds: the kustomizations are rendered here (resources, namespace, JSON6902 patches and
configMapGenerator, the subset deploy/ uses; any other field fails the test rather than being ignored), the
built-in kinds are validated with jsonschema against tests/data/k8s-schemas-v1.33-strict.json (written by
tools/vendor_k8s_schemas.py from kubernetes-validate's strict schemas), the CRDs (LeaderWorkerSet,
PrometheusRule, cert-manager) are checked structurally, their pod templates against the PodTemplateSpec schema.
Every --kv-transfer-config is rebuilt as Kubernetes would expand it ($(VAR) from the container's env, ConfigMaps
of the same render) and parsed with ConnectorSettings.from_extra_config; the metric names come from
connector/vllm/stats.py itself (its SparseKVPromMetrics, run against recording stand-ins for vLLM's classes)."""

from __future__ import annotations

import ast
import copy
import importlib.util
import json
import pathlib
import re
import sys
import types
from typing import Any, Iterator

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from connector.vllm.config import ConnectorSettings  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SCHEMAS = json.loads((ROOT / "tests" / "data" / "k8s-schemas-v1.33-strict.json").read_text())
PENDING_KEYS = {"trusted_prefill_keys", "allowed_prefill_hosts"}
"""Decode settings another change adds; accepted here only while ConnectorSettings does not know them yet."""
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "resources", "patches", "configMapGenerator"}
SAMPLE_FIELDS = {"metadata.name": "pod-0", "status.podIP": "10.1.2.3"}
CRD_KINDS = {"leaderworkerset.x-k8s.io/v1/LeaderWorkerSet", "monitoring.coreos.com/v1/PrometheusRule",
             "cert-manager.io/v1/Certificate", "cert-manager.io/v1/Issuer"}


# --- rendering (the kustomize subset deploy/ uses) -------------------------------------------------------------

def load_docs(path: pathlib.Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def json_patch(obj: dict, ops: list[dict], where: str) -> None:
    """RFC 6902 add / replace / remove (what deploy/'s patches use)."""
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node: Any = obj
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key: Any = int(last) if isinstance(node, list) and last != "-" else last
        if op["op"] == "add":
            if isinstance(node, list):
                node.insert(len(node) if key == "-" else key, op["value"])
            else:
                node[key] = op["value"]
        elif op["op"] == "replace":
            assert (key in node) if isinstance(node, dict) else key < len(node), f"{where}: no {op['path']} to replace"
            node[key] = op["value"]
        elif op["op"] == "remove":
            assert (key in node) if isinstance(node, dict) else key < len(node), f"{where}: no {op['path']} to remove"
            del node[key]
        else:
            raise AssertionError(f"{where}: op {op['op']!r} is not rendered here")


def render(directory: pathlib.Path, used: set[pathlib.Path]) -> list[dict]:
    """The objects `kustomize build directory` makes; `used` collects every file it read."""
    kfile = directory / "kustomization.yaml"
    used.add(kfile)
    k = yaml.safe_load(kfile.read_text())
    unknown = set(k) - KUSTOMIZATION_KEYS
    assert not unknown, f"{kfile}: {sorted(unknown)} are not rendered by this test: extend render() first"
    assert k["kind"] == "Kustomization"
    objects: list[dict] = []
    for res in k.get("resources", []):
        path = (directory / res).resolve()
        if path.is_dir():
            objects += render(path, used)
        else:
            used.add(path)
            objects += load_docs(path)
    for gen in k.get("configMapGenerator", []):
        options = gen.get("options", {})
        assert options.get("disableNameSuffixHash"), f"{kfile}: a generated name's hash suffix is not rendered here"
        data = {}
        for name in gen["files"]:
            used.add((directory / name).resolve())
            data[pathlib.Path(name).name] = (directory / name).read_text()
        objects.append({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": gen["name"], "labels": dict(options.get("labels", {}))}, "data": data})
    for patch in k.get("patches", []):
        path = (directory / patch["path"]).resolve()
        used.add(path)
        target = patch["target"]
        hits = [o for o in objects if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
        assert len(hits) == 1, f"{kfile}: patch {patch['path']} targets {target}, found {len(hits)}"
        json_patch(hits[0], yaml.safe_load(path.read_text()), f"{kfile}: {patch['path']}")
    if "namespace" in k:
        for o in objects:
            o["metadata"]["namespace"] = k["namespace"]
    return copy.deepcopy(objects)


def kustomizations() -> list[pathlib.Path]:
    return sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))


def top_level() -> list[pathlib.Path]:
    """The kustomizations no other one includes: what an operator applies."""
    included: set[pathlib.Path] = set()
    for d in kustomizations():
        for res in yaml.safe_load((d / "kustomization.yaml").read_text()).get("resources", []):
            included.add((d / res).resolve())
    return [d for d in kustomizations() if d.resolve() not in included]


RENDERED: dict[pathlib.Path, list[dict]] = {}


def rendered(directory: pathlib.Path) -> list[dict]:
    if directory not in RENDERED:
        RENDERED[directory] = render(directory, set())
    return RENDERED[directory]


def gvk(obj: dict) -> str:
    return f"{obj['apiVersion']}/{obj['kind']}"


# --- the tests ------------------------------------------------------------------------------------------------

def test_every_file_under_deploy_is_rendered():
    used: set[pathlib.Path] = set()
    for d in kustomizations():
        render(d, used)
    files = {p.resolve() for p in DEPLOY.rglob("*") if p.is_file() and p.suffix in (".yaml", ".yml", ".json")}
    orphans = sorted(str(p.relative_to(DEPLOY)) for p in files - {u.resolve() for u in used})
    assert not orphans, f"files no kustomization uses (so this test checks nothing in them): {orphans}"
    assert {d.relative_to(DEPLOY).as_posix() for d in top_level()} == {
        "overlays/pod-network", "overlays/host-network", "overlays/lws", "cert-manager", "monitoring"}


def validator(schema: dict):
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)


def schema_errors(obj: Any, kind: str) -> list[str]:
    schema = {**SCHEMAS["kinds"][kind], "$defs": SCHEMAS["$defs"]}
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator(schema).iter_errors(obj)]


def check_crd(obj: dict) -> list[str]:
    """Structural checks of the custom resources (no schema of theirs is vendored)."""
    kind, spec, errors = gvk(obj), obj.get("spec", {}), []
    if kind.endswith("/LeaderWorkerSet"):
        lwt = spec["leaderWorkerTemplate"]
        assert isinstance(lwt["size"], int) and lwt["size"] >= 2
        assert set(spec) <= {"replicas", "startupPolicy", "rolloutStrategy", "leaderWorkerTemplate",
                             "networkConfig"}, sorted(spec)
        assert set(lwt) <= {"size", "restartPolicy", "leaderTemplate", "workerTemplate", "subGroupPolicy"}
        for name in ("leaderTemplate", "workerTemplate"):
            errors += [f"{name}: {e}" for e in schema_errors(lwt[name], "PodTemplateSpec")]
    elif kind.endswith("/PrometheusRule"):
        assert set(spec) == {"groups"}
        for group in spec["groups"]:
            assert set(group) <= {"name", "interval", "rules"} and group["rules"], group.get("name")
            for rule in group["rules"]:
                assert set(rule) <= {"alert", "record", "expr", "for", "labels", "annotations"}, rule
                assert rule.get("alert") and isinstance(rule["expr"], str), rule
                assert re.fullmatch(r"\d+[smhdw]", rule.get("for", "0m")), rule
                assert rule["labels"]["severity"] in ("info", "warning", "critical"), rule
    elif kind.endswith("/Certificate"):
        assert spec["secretName"] and spec["issuerRef"]["name"] and (spec.get("dnsNames") or spec.get("isCA")), spec
    elif kind.endswith("/Issuer"):
        assert len(set(spec) & {"selfSigned", "ca", "acme", "vault"}) == 1, spec
    return errors


@pytest.mark.parametrize("directory", top_level(), ids=lambda d: d.relative_to(DEPLOY).as_posix())
def test_manifests_validate(directory):
    objects = rendered(directory)
    assert objects
    seen = set()
    for obj in objects:
        key = (gvk(obj), obj["metadata"]["name"])
        assert key not in seen, f"{key} twice"
        seen.add(key)
        assert obj["metadata"].get("namespace") == "sparse-kv", key
        if gvk(obj) in SCHEMAS["kinds"]:
            errors = schema_errors(obj, gvk(obj))
        else:
            assert gvk(obj) in CRD_KINDS, f"{key}: no schema and no structural check for this kind"
            errors = check_crd(obj)
        assert not errors, f"{key}:\n" + "\n".join(errors[:20])


def pod_templates(objects: list[dict]) -> Iterator[tuple[str, dict]]:
    for obj in objects:
        spec = obj.get("spec", {})
        if obj["kind"] in ("Deployment", "StatefulSet"):
            yield obj["metadata"]["name"], spec["template"]
        elif obj["kind"] == "LeaderWorkerSet":
            for name in ("leaderTemplate", "workerTemplate"):
                yield f"{obj['metadata']['name']}/{name}", spec["leaderWorkerTemplate"][name]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are replaced, others left as written."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def container_env(container: dict, objects: list[dict], namespace: str) -> dict[str, str]:
    configmaps = {o["metadata"]["name"]: o["data"] for o in objects if o["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif "fieldRef" in var["valueFrom"]:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = namespace if path == "metadata.namespace" else SAMPLE_FIELDS[path]
        else:
            ref = var["valueFrom"]["configMapKeyRef"]
            assert ref["name"] in configmaps, f"ConfigMap {ref['name']} is not in this render"
            env[var["name"]] = configmaps[ref["name"]][ref["key"]]
    return env


def kv_transfer_configs(objects: list[dict]) -> Iterator[tuple[str, dict, dict, dict, dict]]:
    """(where, config, container, its env, pod spec) for every vLLM container."""
    for where, template in pod_templates(objects):
        for c in template["spec"]["containers"]:
            env = container_env(c, objects, objects[0]["metadata"]["namespace"])
            args = [expand(a, env) for a in c.get("args", [])]
            for i, arg in enumerate(args):
                if arg == "--kv-transfer-config" or arg.startswith("--kv-transfer-config="):
                    text = args[i + 1] if arg == "--kv-transfer-config" else arg.partition("=")[2]
                    assert "$(" not in text, f"{where}: unexpanded variable in {text}"
                    yield f"{where}/{c['name']}", json.loads(text), c, env, template["spec"]


def kv_transfer_config_fields() -> set[str]:
    """KVTransferConfig's fields, read from vLLM's source without importing vLLM (slow)."""
    spec = importlib.util.find_spec("vllm")
    fallback = {"kv_connector", "engine_id", "kv_buffer_device", "kv_role", "kv_port", "kv_connector_extra_config",
                "kv_connector_module_path", "enable_permute_local_kv", "kv_load_failure_policy"}
    if spec is None or not spec.submodule_search_locations:
        return fallback
    source = pathlib.Path(list(spec.submodule_search_locations)[0]) / "config" / "kv_transfer.py"
    tree = ast.parse(source.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "KVTransferConfig")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def mounted_secret(path: str, container: dict, pod: dict) -> tuple[str, str]:
    """The (Secret, key) a file path in the container comes from, or an assertion naming the path."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            secret = volumes[mount["name"]].get("secret")
            assert secret, f"{path} is on volume {mount['name']}, not a Secret"
            assert mount.get("readOnly"), f"{path}: mount it read-only"
            key = path[len(prefix):]
            items = {i["path"]: i["key"] for i in secret.get("items", [])}
            return secret["secretName"], items.get(key, key) if items else key
    raise AssertionError(f"{path} is on no volume of the container")


@pytest.mark.parametrize("directory", [d for d in top_level() if d.name in ("pod-network", "host-network", "lws")],
                         ids=lambda d: d.relative_to(DEPLOY).as_posix())
def test_kv_transfer_configs_parse_and_are_secure(directory):
    objects = rendered(directory)
    known = set(ConnectorSettings.__struct_fields__)
    top_fields = kv_transfer_config_fields()
    roles = set()
    for where, config, container, env, pod in kv_transfer_configs(objects):
        assert set(config) <= top_fields, f"{where}: {sorted(set(config) - top_fields)} are not KVTransferConfig's"
        assert config["kv_connector"] == "SparseKVConnector", where
        extra = dict(config["kv_connector_extra_config"])
        pending = {k: extra.pop(k) for k in PENDING_KEYS - known if k in extra}
        settings = ConnectorSettings.from_extra_config(extra)  # a wrong key or type fails here, as in vLLM
        roles.add(config["kv_role"])
        s = {**{k: getattr(settings, k) for k in known}, **pending}
        # secure settings, all on
        assert s["auth_token_file"] and not s["auth_token"] and not s["auth_token_env"], where
        assert mounted_secret(s["auth_token_file"], container, pod) == ("sparse-kv-auth", "token"), where
        assert s["require_transfer_secret"] is True, where
        if config["kv_role"] == "kv_producer":
            assert s["tls_cert_file"] and s["tls_key_file"] and s["prefill_key_file"], where
            assert mounted_secret(s["tls_cert_file"], container, pod) == ("sparse-kv-prefill-tls", "tls.crt")
            assert mounted_secret(s["tls_key_file"], container, pod) == ("sparse-kv-prefill-tls", "tls.key")
            assert mounted_secret(s["prefill_key_file"], container, pod) == ("sparse-kv-prefill-key", "key")
            check_side_channel_ports(where, s, container, objects)
        else:
            assert config["kv_role"] == "kv_consumer", where
            assert s["tls_ca_file"] and not s["tls_key_file"], where
            assert mounted_secret(s["tls_ca_file"], container, pod) == ("sparse-kv-prefill-tls", "ca.crt")
            assert isinstance(s["trusted_prefill_keys"], list) and s["trusted_prefill_keys"], where
            hosts = s["allowed_prefill_hosts"]
            assert isinstance(hosts, list) and hosts and all(isinstance(h, str) and h for h in hosts), where
        check_rdma_pod(where, container, env, pod, objects)
    assert roles == {"kv_producer", "kv_consumer"}, roles


def parallel(container: dict) -> tuple[int, int]:
    args = dict(a.partition("=")[::2] for a in container["args"] if a.startswith("--") and "=" in a)
    return int(args.get("--tensor-parallel-size", 1)), int(args.get("--pipeline-parallel-size", 1))


def check_side_channel_ports(where: str, s: dict, container: dict, objects: list[dict]) -> None:
    """Every rank's port (addressing.side_channel_port) is declared by a prefill pod, reached by a Service and
    open to decode in the NetworkPolicy."""
    from connector.protocol.addressing import side_channel_port

    tp, pp = parallel(container)
    wanted = {side_channel_port(s["side_channel_port"], (p, t), tp) for p in range(pp) for t in range(tp)}
    declared = {port["containerPort"] for _, tmpl in pod_templates(objects)
                for c in tmpl["spec"]["containers"] for port in c.get("ports", [])
                if tmpl["metadata"]["labels"].get("app.kubernetes.io/component") == "prefill"}
    assert wanted <= declared, f"{where}: side-channel ports {sorted(wanted - declared)} declared by no prefill pod"
    services = [o for o in objects if o["kind"] == "Service"
                and o["spec"]["selector"].get("app.kubernetes.io/component") == "prefill"]
    assert services and all(wanted <= {p["port"] for p in svc["spec"]["ports"]} for svc in services), where
    rules = [r for o in objects if o["kind"] == "NetworkPolicy"
             and o["spec"]["podSelector"]["matchLabels"].get("app.kubernetes.io/component") == "prefill"
             for r in o["spec"]["ingress"]
             if any(f.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == "decode"
                    for f in r.get("from", []))]
    opened = {n for r in rules for p in r["ports"] for n in range(p["port"], p.get("endPort", p["port"]) + 1)}
    assert wanted <= opened, f"{where}: side-channel ports {sorted(wanted - opened)} closed to decode"


def check_rdma_pod(where: str, container: dict, env: dict, pod: dict, objects: list[dict]) -> None:
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"], where
    limits = container["resources"]["limits"]
    assert limits.get("rdma/hca_shared_devices_a") and limits.get("nvidia.com/gpu"), where
    shm = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert shm and volumes[shm[0]["name"]]["emptyDir"]["medium"] == "Memory", where
    assert env.get("UCX_NET_DEVICES") or env.get("VLLM_GPU_NIC_PCIE_MAPPING"), where
    low, high = map(int, env["UCX_TCP_PORT_RANGE"].split("-"))
    opened = [p for o in objects if o["kind"] == "NetworkPolicy" for r in o["spec"]["ingress"] for p in r["ports"]
              if p["port"] == low and p.get("endPort") == high]
    assert len(opened) == 2, f"{where}: UCX_TCP_PORT_RANGE {low}-{high} not open both ways between prefill and decode"
    assert container.get("readinessProbe"), where


# --- metrics ------------------------------------------------------------------------------------------------

def exported_metric_names() -> set[str]:
    """Every series name SparseKVPromMetrics registers, with Prometheus' suffixes: connector/vllm/stats.py is run
    against stand-ins for vLLM's two base classes that record what it creates (importing vLLM takes ~30 s)."""
    created: list[tuple[str, str]] = []

    class Recorder:
        def __init__(self, kind: str, name: str, **_: Any) -> None:
            created.append((kind, name))

        def labels(self, *_: Any) -> "Recorder":
            return self

    class PromBase:
        def __init__(self, *_: Any, **__: Any) -> None:
            self._counter_cls = lambda **kw: Recorder("counter", **kw)
            self._histogram_cls = lambda **kw: Recorder("histogram", **kw)

    stub = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.metrics")
    stub.KVConnectorPromMetrics = PromBase
    stub.KVConnectorStats = type("KVConnectorStats", (), {})
    path = ROOT / "connector" / "vllm" / "stats.py"
    spec = importlib.util.spec_from_file_location("_deploy_test_stats", path)
    module = importlib.util.module_from_spec(spec)
    saved = {name: sys.modules.get(name) for name in (
        "vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
        "vllm.distributed.kv_transfer.kv_connector.v1", stub.__name__)}
    try:  # the module's own `from vllm... import` resolves through sys.modules, to the stand-ins
        for name in saved:
            sys.modules[name] = stub if name == stub.__name__ else types.ModuleType(name)
        spec.loader.exec_module(module)
        module.SparseKVPromMetrics(None, {}, ["model_name", "engine"], {0: ["m", "0"]})
    finally:  # put back whatever was there (a real vllm, imported by another test, included)
        for name, before in saved.items():
            if before is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = before
    names = set()
    for kind, name in created:
        suffixes = ("_total",) if kind == "counter" else ("_bucket", "_sum", "_count")
        names |= {name + suffix for suffix in suffixes}
    return names


def used_metric_names(text: str) -> set[str]:
    return set(re.findall(r"vllm:sparse_kv_[A-Za-z0-9_]+", text))


def test_alerts_and_dashboard_use_exported_metrics():
    exported = exported_metric_names()
    assert "vllm:sparse_kv_recvs_failed_total" in exported and "vllm:sparse_kv_recv_seconds_bucket" in exported
    objects = rendered(DEPLOY / "monitoring")
    rules = [r for o in objects if o["kind"] == "PrometheusRule" for g in o["spec"]["groups"] for r in g["rules"]]
    dashboards = [json.loads(text) for o in objects if o["kind"] == "ConfigMap"
                  for name, text in o["data"].items() if name.endswith(".json")]
    assert rules and dashboards
    exprs = [r["expr"] for r in rules] + [t["expr"] for d in dashboards for p in d["panels"] for t in p["targets"]] \
        + [v["query"] for d in dashboards for v in d["templating"]["list"] if v["type"] == "query"]
    used = set().union(*map(used_metric_names, exprs))
    assert not used - exported, f"not exported by connector/vllm/stats.py: {sorted(used - exported)}"
    # the failure counters and the transfer-time histograms are all watched
    alerted = set().union(*(used_metric_names(r["expr"]) for r in rules))
    for name in ("recvs_failed_total", "sends_failed_total", "sends_expired_total", "auth_failures_total",
                 "capability_refusals_total", "transfer_seconds_bucket", "recv_seconds_bucket"):
        assert f"vllm:sparse_kv_{name}" in alerted, name
    for expr in exprs:  # balanced, and every histogram read through its buckets
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        assert "histogram_quantile" not in expr or "_bucket" in expr, expr


def test_docs_link_the_runbook():
    assert "docs/gpu-runbook.md" in (ROOT / "README.md").read_text()
    assert "../docs/gpu-runbook.md" in (DEPLOY / "README.md").read_text()
    assert (ROOT / "docs" / "gpu-runbook.md").is_file()
