"""The rendered Kubernetes manifests' NetworkPolicies, evaluated over every connection the manifests themselves
declare: the gateway to each address in its settings (every Triton, every vLLM engine, Redis), each container to each
URL in its command (an init container waiting on another pod), Prometheus in its namespace to every port a
ServiceMonitor names, and the locust Jobs to the gateway and their master. Each connection must be admitted by the
policies that select its target pod (Kubernetes' rules: a pod no Ingress policy selects takes everything; one that is
selected takes what some rule's peers and ports admit). The kubelet's probes come from the node, which these policies
do not govern (the CNIs we know admit node traffic), so they are not counted."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from deploy.render import render
from deploy.load import load_deployment
from tests.plan_fixtures import write_artifacts

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))


@dataclass(frozen=True)
class Pod:
    name: str  # the workload's
    namespace: str
    labels: tuple[tuple[str, str], ...]
    spec: dict


@dataclass(frozen=True)
class Connection:
    what: str
    source: Pod
    host: str  # a Service's name
    port: int | str  # a Service port's number or name


def _matches(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # matchExpressions are not rendered
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _pods(docs: list[dict], namespace: str) -> list[Pod]:
    pods = []
    for doc in docs:
        template = doc["spec"].get("template") if doc["kind"] in ("Deployment", "StatefulSet", "Job") else None
        if template is not None:
            pods.append(Pod(doc["metadata"]["name"], namespace, tuple(sorted(template["metadata"]["labels"].items())),
                            template["spec"]))
        elif doc["kind"] == "Pod":
            pods.append(Pod(doc["metadata"]["name"], namespace, tuple(sorted(doc["metadata"]["labels"].items())),
                            doc["spec"]))
    return pods


def _target(docs: list[dict], pods: list[Pod], host: str, port: int | str) -> tuple[list[Pod], int]:
    """The pods a Service name sends to, and the container port (number) a Service port reaches."""
    (service,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == host] or [None]
    assert service is not None, f"no Service {host!r}"
    (spec_port,) = [p for p in service["spec"]["ports"] if port in (p["port"], p.get("name"))]
    targets = [p for p in pods if _matches({"matchLabels": service["spec"]["selector"]}, dict(p.labels))]
    assert targets, f"Service {host} selects no pod"
    target_port = spec_port.get("targetPort", spec_port["port"])
    if isinstance(target_port, str):  # a named container port
        target_port = next(c["containerPort"] for pod in targets for c in _containers(pod.spec)
                           for c in c.get("ports", []) if c.get("name") == target_port)
    return targets, target_port


def _containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def admitted(policies: list[dict], source: Pod, target: Pod, port: int) -> bool:
    selecting = [p for p in policies if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and _matches(p["spec"]["podSelector"], dict(target.labels))]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            from_ok = not peers or any(_peer(peer, source, target) for peer in peers)
            ports = rule.get("ports")
            port_ok = not ports or any(p.get("port") == port for p in ports)
            if from_ok and port_ok:
                return True
    return False


def _peer(peer: dict, source: Pod, target: Pod) -> bool:
    names = {"kubernetes.io/metadata.name": source.namespace}
    if "namespaceSelector" in peer:
        in_namespace = _matches(peer["namespaceSelector"], names)
    else:  # a podSelector alone picks pods of the policy's own namespace
        in_namespace = source.namespace == target.namespace
    return in_namespace and ("podSelector" not in peer or _matches(peer["podSelector"], dict(source.labels)))


URL = re.compile(r"(?:https?|grpc)://([a-z0-9-]+):(\d+)")


def connections(out: Path, namespace: str, monitoring: str) -> tuple[list[dict], list[Pod], list[Connection]]:
    docs = [doc for f in sorted((out / "kubernetes").glob("*.yaml")) if f.name not in ("kustomization.yaml",
            "gateway-config.yaml") for doc in yaml.safe_load_all(f.read_text()) if doc and "kind" in doc]
    pods = _pods(docs, namespace)
    by_name = {p.name: p for p in pods}
    found = []
    settings = yaml.safe_load((out / "kubernetes" / "gateway-config.yaml").read_text())
    for address in filter(None, settings["triton_grpc_url"].split(",")):
        host, port = address.rsplit(":", 1)
        found.append(Connection("gateway -> Triton (gRPC)", by_name["gateway"], host, int(port)))
    for url in filter(None, settings["vllm_url"].split(",")):
        host, port = URL.match(url).groups()
        found.append(Connection("gateway -> vLLM", by_name["gateway"], host, int(port)))
    if "rate_limit_storage" in settings:
        host, port = re.search(r"//([a-z0-9-]+):(\d+)", settings["rate_limit_storage"]).groups()
        found.append(Connection("gateway -> Redis", by_name["gateway"], host, int(port)))
    for pod in pods:
        for c in _containers(pod.spec):
            text = " ".join(map(str, c.get("command", []) + c.get("args", [])))
            for host, port in URL.findall(text):
                found.append(Connection(f"{pod.name}/{c['name']} -> {host}", pod, host, int(port)))
            if "--master-host" in text:
                host = text.split("--master-host")[1].split()[0]
                found.append(Connection(f"{pod.name} -> locust master", pod, host, 5557))
    prometheus = Pod("prometheus", monitoring, (("app.kubernetes.io/name", "prometheus"),), {"containers": []})
    for monitor in (d for d in docs if d["kind"] == "ServiceMonitor"):
        for service in (d for d in docs if d["kind"] == "Service"
                        and _matches(monitor["spec"]["selector"], d["metadata"].get("labels", {}))):
            for endpoint in monitor["spec"]["endpoints"]:
                found.append(Connection(f"Prometheus -> {service['metadata']['name']}", prometheus,
                                        service["metadata"]["name"], endpoint["port"]))
    return docs, pods, found


def _rendered(example: Path, tmp_path: Path):
    d = load_deployment(write_artifacts(Path(shutil.copy(example, tmp_path / example.name))))
    render(d, tmp_path / "out", at=Path(f"/opt/rtxserve-{d.name}"), prefix=Path(f"/opt/rtxserve-{d.name}"))
    return d, tmp_path / "out"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_connection_the_manifests_declare_is_admitted(example, tmp_path):
    d, out = _rendered(example, tmp_path)
    docs, pods, found = connections(out, f"rtxserve-{d.name}", d.kubernetes.monitoring_namespace)
    policies = [doc for doc in docs if doc["kind"] == "NetworkPolicy"]
    assert policies and {c.what.split(" ->")[0] for c in found} >= {"gateway", "Prometheus"}
    refused = []
    for c in found:
        targets, port = _target(docs, pods, c.host, c.port)
        refused += [f"{c.what}: {c.host}:{c.port} ({t.name}, port {port})" for t in targets
                    if not admitted(policies, c.source, t, port)]
    assert refused == []


def test_the_evaluator_refuses_what_a_policy_leaves_out():
    """A pod selected by a policy admitting only the gateway on 8001 refuses another pod, and another port."""
    policy = {"spec": {"podSelector": {"matchLabels": {"app": "triton"}}, "policyTypes": ["Ingress"],
                       "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "gateway"}}}],
                                    "ports": [{"protocol": "TCP", "port": 8001}]}]}}
    pod = lambda name: Pod(name, "ns", (("app", name),), {"containers": []})  # noqa: E731
    assert admitted([policy], pod("gateway"), pod("triton"), 8001)
    assert not admitted([policy], pod("vllm"), pod("triton"), 8001)
    assert not admitted([policy], pod("gateway"), pod("triton"), 8000)
    assert admitted([policy], pod("vllm"), pod("gateway"), 8000)  # no policy selects the gateway
    outside = Pod("prometheus", "monitoring", (("app", "prometheus"),), {"containers": []})
    assert not admitted([policy], outside, pod("triton"), 8001)
