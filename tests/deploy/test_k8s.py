"""deploy/k8s: every manifest (the base, and the stock overlay with its patch applied)
validated strictly against Kubernetes 1.33's schemas (kubernetes-validate, failing on its
warnings too), and the sidecar's settings checked against the vLLM container beside it.
No cluster here: these are the checks that need none."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import warnings

import pytest
import yaml

from prefill_gate.proxy.settings import Settings
from tests.deploy.conftest import ROOT, engine_settings

if os.environ.get("PREFILL_GATE_REQUIRE_DEPLOY_TOOLS") == "1":
    import kubernetes_validate as kv  # scripts/test.sh installs it: fail loudly
else:
    kv = pytest.importorskip("kubernetes_validate")

K8S = ROOT / "deploy" / "k8s"
VERSION = "1.33"


def base() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / "base" / name).read_text()) if d]
    return docs


def json_patch(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902 'add', 'replace' and 'test' (the ops the overlays use), on a copy; a failed
    'test' fails the patch, as kustomize does."""
    doc = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] in ("add", "replace", "test"), op
        *parents, last = op["path"].lstrip("/").split("/")
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if op["op"] == "test":
            assert (node[int(last)] if isinstance(node, list) else node[last]) == op["value"], op
        elif op["op"] == "replace":
            key = int(last) if isinstance(node, list) else last
            assert key in range(len(node)) if isinstance(node, list) else key in node, op
            node[key] = op["value"]
        elif isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), op["value"])
        else:
            node[last] = op["value"]
    return doc


def overlay(name: str) -> list[dict]:
    """The base with ``overlays/<name>``'s JSON patches applied, as kustomize would."""
    folder = K8S / "overlays" / name
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../../base"]
    docs = base()
    for patch in kustomization["patches"]:
        ops = json.loads((folder / patch["path"]).read_text())
        target = patch["target"]
        docs = [json_patch(d, ops) if (d["kind"], d["metadata"]["name"]) == (target["kind"], target["name"]) else d
                for d in docs]
    return docs


def stock() -> list[dict]:
    return overlay("stock")


def hybrid() -> list[dict]:
    return overlay("hybrid")


@pytest.mark.parametrize("variant", [base, stock, hybrid])
def test_every_manifest_validates_strictly(variant):
    docs = variant()
    assert {d["kind"] for d in docs} == {"Deployment", "Service"}
    for doc in docs:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an unknown kind only warns: that fails here
            kv.validate(doc, VERSION, strict=True)


def test_validation_can_fail():
    doc = base()[0]
    doc["spec"]["template"]["spec"]["containers"][1]["readinessProbe"]["httpGet"]["pathh"] = "/ready"
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, VERSION, strict=True)


def containers(docs: list[dict]) -> dict[str, dict]:
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def flag(args: list[str], name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in args if a.startswith(name + "=")), None)


@pytest.mark.parametrize("variant", [base, stock, hybrid])
def test_the_sidecar_matches_the_vllm_beside_it(variant):
    docs = variant()
    c = containers(docs)
    vllm, gate = c["vllm"], c["prefill-gate"]
    port = int(flag(vllm["args"], "--port"))
    assert vllm["ports"] == [{"name": "vllm", "containerPort": port}]
    assert flag(gate["args"], "--upstream") == f"http://127.0.0.1:{port}"  # its own engine, in the pod
    assert "--enable-prompt-tokens-details" in vllm["args"]  # slicing's cache-miss counter needs it
    assert gate["readinessProbe"]["httpGet"]["path"] == "/ready" and gate["livenessProbe"]["httpGet"]["path"] == "/health"
    assert gate["securityContext"]["runAsNonRoot"] is True
    spec = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]
    grace = Settings.model_fields["shutdown_grace"].default
    assert spec["spec"]["terminationGracePeriodSeconds"] > grace + 10
    assert spec["metadata"]["annotations"]["prometheus.io/port"] == str(gate["ports"][0]["containerPort"])
    service = next(d for d in docs if d["kind"] == "Service")
    assert service["spec"]["ports"][0]["targetPort"] == gate["ports"][0]["name"]  # clients reach the gate
    env = {e["name"]: e["value"] for e in vllm.get("env", [])}
    if flag(gate["args"], "--itl-slo-ms") is not None:  # the closed loop only next to a pacing engine
        assert env.get("PREFILL_GATE_PACING") == "adaptive" and flag(vllm["args"], "--scheduler-cls")
    if env.get("PREFILL_GATE_PACING", "off") != "off":  # pacing needs the paced scheduler
        assert flag(vllm["args"], "--scheduler-cls") == "prefill_gate.engine_patches.pacing.PacedAsyncScheduler"
    # The proxy decides from what it finds upstream: no mode flag in either variant.
    assert not any(a.startswith(("--slicing", "--paced-admission")) for a in gate["args"]), gate["args"]
    names = {"--" + n.replace("_", "-") for n in Settings.model_fields} | {"--upstream"}
    assert all(a.split("=", 1)[0] in names for a in gate["args"]), gate["args"]  # every flag is a setting


# ------------------------------------------------------------------ the PodMonitor
# kubernetes-validate has no schema for the Prometheus operator's kinds (it only warns), and
# no registry reachable here ships the operator's CRD text. The PodMonitor is checked
# against @kubernetes-models/prometheus-operator instead (pinned in tests/deploy/npm; made
# from the operator's Go API types, the types its CRD is generated from): its validator for
# types, formats and required fields, and, since that validator lets unknown fields through,
# every key of ours against the fields its declarations name.
NPM = ROOT / "tests" / "deploy" / "npm"
OPERATOR_V1 = NPM / "node_modules" / "@kubernetes-models" / "prometheus-operator" / "monitoring.coreos.com" / "v1"
VALIDATE_JS = """
import { readFileSync } from "node:fs";
import { PodMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor";
try { new PodMonitor(JSON.parse(readFileSync(0, "utf8"))).validate(); }
catch (e) { console.log(e.message); process.exit(1); }
"""


def podmonitor() -> dict:
    component = yaml.safe_load((K8S / "components" / "podmonitor" / "kustomization.yaml").read_text())
    assert component["kind"] == "Component" and component["resources"] == ["podmonitor.yaml"]
    return yaml.safe_load((K8S / "components" / "podmonitor" / "podmonitor.yaml").read_text())


def operator_validate(doc: dict) -> str | None:
    """None when the operator's API takes ``doc``, else why not."""
    from tests.deploy.conftest import tool

    node = tool("node")
    if not OPERATOR_V1.exists():
        if os.environ.get("PREFILL_GATE_REQUIRE_DEPLOY_TOOLS") == "1":
            pytest.fail("the operator's API types are not installed (scripts/test.sh: npm ci --prefix tests/deploy/npm)")
        pytest.skip("npm ci --prefix tests/deploy/npm first")
    done = subprocess.run([node, "--input-type=module", "-e", VALIDATE_JS], input=json.dumps(doc), cwd=NPM,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode in (0, 1), done.stderr
    return done.stdout.strip() or None if done.returncode else None


def declared(type_name: str) -> set[str]:
    """The field names a type of the operator's API declares (its own and inherited)."""
    return set(re.findall(r'^\s+"(\w+)"\??:', (OPERATOR_V1 / f"{type_name}.d.ts").read_text(), re.M))


def undeclared(doc: dict) -> set[str]:
    """Keys of the spec and its endpoints that the operator's API does not declare."""
    spec = doc["spec"]
    keys = set(spec) - declared("PodMonitorSpec")
    for endpoint in spec.get("podMetricsEndpoints", []):
        keys |= set(endpoint) - declared("PodMetricsEndpoint")
    return keys


def test_the_podmonitor_matches_the_operators_api():
    doc = podmonitor()
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert operator_validate(doc) is None
    assert undeclared(doc) == set()


def test_the_podmonitor_checks_can_fail():
    doc = podmonitor()
    doc["spec"]["podMetricsEndpoints"][0]["interval"] = 15  # a number where the API takes a duration string
    assert "interval must be string" in (operator_validate(doc) or "")
    doc = podmonitor()
    doc["spec"]["podMetricsEndpoints"][1]["pathh"] = "/x"  # the validator takes it; the key check does not
    assert operator_validate(doc) is None and undeclared(doc) == {"pathh"}


def test_the_podmonitor_scrapes_what_the_pod_serves():
    """Its selector picks the Deployment's pods, its port is the proxy's named port, its
    paths the proxy's two metrics pages."""
    doc, docs = podmonitor(), base()
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()
    proxy_ports = {p["name"] for p in containers(docs)["prefill-gate"]["ports"]}
    assert {e["port"] for e in doc["spec"]["podMetricsEndpoints"]} <= proxy_ports
    assert sorted(e["path"] for e in doc["spec"]["podMetricsEndpoints"]) == ["/metrics", "/vllm/metrics"]


def test_the_base_paces_and_the_stock_overlay_does_not():
    """The stack's default is step pacing (adaptive 15 ms, short prompts first, full CUDA
    graphs) and the GDN hybrids' recurrent short-prompt steps in whole graphs; the stock
    overlay turns the engine patches off (pacing and the GDN path) and nothing else, in a
    combination the plugin accepts."""
    env = {e["name"]: e["value"] for e in containers(base())["vllm"]["env"]}
    assert env["PREFILL_GATE_PACING"] == "adaptive" and env["PREFILL_GATE_PACING_TARGET_ITL_MS"] == "15"
    assert env["PREFILL_GATE_GDN_RECURRENT"] == "on" and env["PREFILL_GATE_GDN_WALK"] == "8x1"
    assert env["PREFILL_GATE_GDN_GRAPH"] == "on"
    assert json.loads(flag(containers(base())["vllm"]["args"], "--compilation-config")) == {"cudagraph_mode": "FULL"}
    a, b = containers(base()), containers(stock())
    env_b = {e["name"]: e["value"] for e in b["vllm"]["env"]}
    assert env_b == {**env, "PREFILL_GATE_PACING": "off", "PREFILL_GATE_GDN_RECURRENT": "off",
                     "PREFILL_GATE_GDN_GRAPH": "off"}
    assert a["vllm"]["args"] == b["vllm"]["args"] and a["prefill-gate"] == b["prefill-gate"]
    assert engine_settings(env) == {"pacing": "adaptive", "gdn_limit": 512, "gdn_graph": True, "gdn_conv": "vllm",
                                    "gdn_walk": (8, 1)}
    assert engine_settings(env_b)["pacing"] == "off" and not engine_settings(env_b)["gdn_graph"]


def test_the_hybrid_overlay_serves_a_hybrid_as_measured():
    """overlays/hybrid: the base's stack with the hybrid's pacing (44 ms, below the align block)
    and vLLM flags (docs/results/hybrid.md), as deploy/hybrid.env gives compose; nothing else."""
    a, h = containers(base()), containers(hybrid())
    env_a = {e["name"]: e["value"] for e in a["vllm"]["env"]}
    env_h = {e["name"]: e["value"] for e in h["vllm"]["env"]}
    assert env_h == {**env_a, "PREFILL_GATE_PACING_TARGET_ITL_MS": "44", "PREFILL_GATE_PACING_SUB_BLOCK": "1"}
    assert engine_settings(env_h)["gdn_graph"]  # whole graphs for its mixed steps: FULL below
    args = h["vllm"]["args"]
    assert json.loads(flag(args, "--compilation-config")) == {"cudagraph_mode": "FULL"}
    assert flag(args, "--max-num-batched-tokens") == "2048" and flag(args, "--max-num-seqs") == "64"
    assert "--enable-prefix-caching" in args and len(args) == len(a["vllm"]["args"]) + 3
    assert flag(args, "--scheduler-cls") == flag(a["vllm"]["args"], "--scheduler-cls")
    assert h["prefill-gate"] == a["prefill-gate"]
