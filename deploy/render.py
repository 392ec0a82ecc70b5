"""`rtxserve deploy render DEPLOYMENT --out DIR`: the files a box or a fleet runs, for one deployment.

    DIR/models/              the artifacts, as every target mounts them at /models (hard links, no copies):
                             repository/ (the assembled Triton repository, planned instance counts),
                             llm/NAME/, adapters/NAME/
    DIR/secrets/keys.json    the gateway's keys file (hashes only), when the deployment has one
    DIR/gateway.yaml         the gateway's settings inside the containers
    DIR/compose/             compose.yaml for one box: the NGC Triton image, one vLLM container per GPU, the
                             gateway, Prometheus and Grafana with its dashboards; engines on an internal network
    DIR/systemd/             units for a bare-metal box (the programs of an install at --prefix)
    DIR/kubernetes/          a kustomize base for a fleet
    DIR/monitoring/          Prometheus rules and the Grafana dashboards (shared by compose and Kubernetes)
    DIR/images.txt           every container image to mirror for an air-gapped site
    DIR/gateway-image/       the gateway's Dockerfile (it installs the wheels put in gateway-image/wheels/)

Everything is built from the same services (deploy/services.py) that `serve up` starts, with paths and
hosts of the target. Rendering needs the artifacts (to plan and to check them), not the servers.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import yaml

from core import __version__
from core.envs import TRITON, VLLM, env_under
from core.tasks import ENCODER, TASKS, of_kind

from . import monitoring
from .plan import Plan, format_plan, plan
from .services import Layout, Service, build_services, gateway_settings
from .engines import TENSORRT_IMAGE, Build, build_script, plan_tensorrt
from .spec import Deployment, DeploymentError, encoder_metadata, llm_app

# Pinned releases. Triton 26.07 (2.71.0) is the image the TensorRT engine build step runs in, too:
# a plan only loads in the TensorRT it was built with.
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:26.07-py3"
VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
PROMETHEUS_IMAGE = "prom/prometheus:v3.14.0"
GRAFANA_IMAGE = "grafana/grafana:13.1.2"
PYTHON_IMAGE = "python:3.11-slim-bookworm"  # the gateway image's base
GATEWAY_IMAGE = f"rtxserve-gateway:{__version__}"
# The NGC image plus what the entries' python-backend steps import (tokenizers, ONNX Runtime, Pillow): built
# FROM it, offline from wheels for its Python (the bundle brings them).
SERVING_TRITON_IMAGE = f"rtxserve-triton:{__version__}"
TRITON_IMAGE_PYTHON = "3.12"  # Ubuntu 24.04's, in the 26.xx images
KUBERNETES_VERSION = "1.32.0"  # the API version the manifests are validated against
MODELS = "/models"
KEYS_IN_CONTAINER = "/etc/rtxserve/keys/api_keys.json"


# What vLLM reads from a model or adapter folder; anything else (optimizer states, `original/` consolidated
# checkpoints, .git) stays behind.
SERVED_FILES = ("*.json", "*.safetensors", "*.model", "*.jinja", "*.txt", "*.tiktoken")


def _link_tree(source: Path, to: Path) -> None:
    from serve.entry_config import link_file

    if to.exists():
        shutil.rmtree(to)
    to.mkdir(parents=True)
    for pattern in SERVED_FILES:
        for file in source.glob(pattern):
            link_file(str(file), str(to / file.name))


def stage_models(d: Deployment, p: Plan, out: Path) -> dict[Path, str]:
    """Lay the artifacts out under out/models (hard links) and return host path -> path in a container."""
    from .repository import assemble_repository

    where: dict[Path, str] = {}
    models = out / "models"
    models.mkdir(parents=True, exist_ok=True)
    if d.encoders:
        assemble_repository(d, p, models / "repository")
    for m in d.llms:
        _link_tree(d.resolve(m.path), models / "llm" / m.name)
        where[d.resolve(m.path)] = f"{MODELS}/llm/{m.name}"
        for name, adapter in m.adapters.items():
            _link_tree(d.resolve(adapter), models / "adapters" / name)
            where[d.resolve(adapter)] = f"{MODELS}/adapters/{name}"
        if m.chat_template:
            (models / "templates").mkdir(exist_ok=True)
            shutil.copy2(d.resolve(m.chat_template), models / "templates" / f"{m.name}.jinja")
            where[d.resolve(m.chat_template)] = f"{MODELS}/templates/{m.name}.jinja"
    return where


def container_layout(d: Deployment, where: dict[Path, str], host_of=lambda s: s) -> Layout:
    return Layout(bind="0.0.0.0", host_of=host_of, path=lambda p: where[Path(p).resolve()],
                  repository=f"{MODELS}/repository", gateway_config="/etc/rtxserve/gateway.yaml", gateway_host="0.0.0.0")


def _dump(path: Path, data, header: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(data, sort_keys=False, width=120)
    path.write_text(("---\n" if not header else f"# {header}\n---\n") + text)


# ---------------------------------------------------------------------------------------------- compose

def _serve_args(args: list[str]) -> list[str]:
    """`vllm serve` (the image's entrypoint) takes the model as its first argument, not as --model."""
    i = args.index("--model")
    return [args[i + 1], *args[:i], *args[i + 2:]]


def _health(url: str, start_period: str) -> dict:
    return {"test": ["CMD", "curl", "-fsS", url], "interval": "10s", "timeout": "5s", "retries": 3,
            "start_period": start_period}


def _gpus(ids: list[int]) -> dict:
    return {"resources": {"reservations": {"devices": [
        {"driver": "nvidia", "device_ids": [str(i) for i in ids], "capabilities": ["gpu"]}]}}}


def compose(d: Deployment, p: Plan, services: list[Service], builds: list[Build]) -> dict:
    out: dict = {"name": f"rtxserve-{d.name}", "services": {}}
    engines = [s for s in services if s.kind != "gateway"]
    if builds:  # TensorRT plans, built on this box before Triton starts (deploy/engines.py)
        out["services"]["build-engines"] = {
            "image": TENSORRT_IMAGE, "command": ["sh", "/build/build-engines.sh"], "network_mode": "none",
            "volumes": [f"../models/repository:{MODELS}/repository", "../engines:/build:ro"],
            "deploy": _gpus([0]), "restart": "no"}
    for s in services:
        if s.kind == "triton":
            svc = {"image": SERVING_TRITON_IMAGE, "build": {"context": "../triton-image"}, "command": ["tritonserver", *s.args],
                   "volumes": [f"../models:{MODELS}:ro"], "shm_size": "2gb",
                   "ulimits": {"memlock": -1, "stack": 67108864},
                   "healthcheck": _health(f"http://localhost:{s.port}{s.ready_path}", "300s")}
            if d.on_gpu:
                svc["deploy"] = _gpus(list(range(d.gpus.count)))
            if builds:
                svc["depends_on"] = {"build-engines": {"condition": "service_completed_successfully"}}
        elif s.kind == "vllm":
            svc = {"image": VLLM_IMAGE, "entrypoint": ["vllm", "serve"], "command": _serve_args(s.args),
                   "volumes": [f"../models:{MODELS}:ro"], "ipc": "host", "environment": s.env,
                   "healthcheck": _health(f"http://localhost:{s.port}{s.ready_path}", "600s")}
            if s.gpu is not None:
                svc["deploy"] = _gpus([s.gpu])
        else:
            from serve.gateway.settings import is_loopback

            host = d.gateway.host
            host = "127.0.0.1:" if is_loopback(host) else "" if host in ("0.0.0.0", "::") else f"{host}:"
            svc = {"image": GATEWAY_IMAGE, "build": {"context": "../gateway-image"}, "command": ["rtxserve", *s.args],
                   "environment": s.env, "ports": [f"{host}{s.port}:{s.port}"],
                   "volumes": ["../gateway.yaml:/etc/rtxserve/gateway.yaml:ro"],
                   "depends_on": {e.name: {"condition": "service_healthy", "restart": True} for e in engines},
                   "healthcheck": {"test": ["CMD", "python", "-c", "import urllib.request; "
                                            f"urllib.request.urlopen('http://localhost:{s.port}/readyz', timeout=3)"],
                                   "interval": "10s", "timeout": "5s", "retries": 3, "start_period": "30s"}}
            if d.gateway.keys_file is not None:
                svc["secrets"] = [{"source": "api_keys", "target": KEYS_IN_CONTAINER}]
        svc["restart"] = "unless-stopped"
        svc["networks"] = ["engines", "front"] if s.kind == "gateway" else ["engines"]
        out["services"][s.name] = svc
    out["services"]["prometheus"] = {
        "image": PROMETHEUS_IMAGE, "restart": "unless-stopped", "networks": ["engines", "front"],
        "volumes": ["./prometheus.yml:/etc/prometheus/prometheus.yml:ro", "../monitoring/rules.yml:/etc/prometheus/rules.yml:ro"],
        "ports": ["127.0.0.1:9090:9090"],
        "healthcheck": {"test": ["CMD", "wget", "-qO-", "http://localhost:9090/-/ready"], "interval": "10s",
                        "timeout": "5s", "retries": 3}}
    out["services"]["grafana"] = {
        "image": GRAFANA_IMAGE, "restart": "unless-stopped", "networks": ["front"], "ports": ["127.0.0.1:3000:3000"],
        "volumes": ["../monitoring/grafana/datasources:/etc/grafana/provisioning/datasources:ro",
                    "../monitoring/grafana/providers:/etc/grafana/provisioning/dashboards:ro",
                    "../monitoring/dashboards:/var/lib/grafana/dashboards:ro"],
        "depends_on": {"prometheus": {"condition": "service_healthy"}}}
    # The engines' network has no way out and nothing published: only the gateway (and Prometheus) reach them.
    out["networks"] = {"engines": {"internal": True}, "front": {}}
    if d.gateway.keys_file is not None:
        out["secrets"] = {"api_keys": {"file": "../secrets/keys.json"}}
    return out


def scrape_targets(services: list[Service], host_of) -> dict[str, list[str]]:
    targets: dict[str, list[str]] = {"gateway": [], "triton": [], "vllm": []}
    for s in services:
        targets[s.kind].append(f"{host_of(s.name)}:{s.metrics_port}")
    return {k: sorted(set(v)) for k, v in targets.items()}


# ---------------------------------------------------------------------------------------------- systemd

def systemd_units(d: Deployment, services: list[Service], prefix: Path, tritonserver: Path | None = None,
                  backend_directory: Path | None = None, build_engines: str | None = None) -> dict[str, str]:
    """One unit per server, run as the `rtxserve` user from an install at `prefix` (what the bundle's install.sh
    makes), and a target that starts them together."""
    from serve import triton, vllm

    units = {}
    target = f"rtxserve-{d.name}.target"
    engines = [f"rtxserve-{d.name}-{s.name}.service" for s in services if s.kind != "gateway"]
    for s in services:
        if s.kind == "triton":
            install = (triton.TritonInstall(Path(tritonserver), Path(backend_directory or "/opt/tritonserver/backends"))
                       if tritonserver else triton.TritonInstall.at(env_under(prefix, TRITON), "python%d.%d" % sys.version_info[:2]))
            argv, env = triton.install_argv(install, s.args), triton.install_env(install, base={"PATH": "/usr/bin:/bin"})
        elif s.kind == "vllm":
            argv = vllm.install_argv(env_under(prefix, VLLM), s.args)
            env = vllm.install_env(env_under(prefix, VLLM), base={"PATH": "/usr/bin:/bin"}) | s.env
            if s.gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(s.gpu)
        else:
            argv, env = [str(prefix / ".venv" / "bin" / "rtxserve"), *s.args], dict(s.env)
        # caches (vLLM's compiled kernels, the python backend's) go to directories systemd makes for the user
        env |= {"HOME": "/var/lib/rtxserve", "XDG_CACHE_HOME": "/var/cache/rtxserve"}
        name = f"rtxserve-{d.name}-{s.name}.service"
        needs = engines if s.kind == "gateway" else []  # the gateway starts once every engine answers ready
        lines = ["[Unit]", f"Description=rtxserve {d.name}: {s.name} ({s.kind})",
                 f"After={' '.join(['network-online.target', *needs])}", "Wants=network-online.target", f"PartOf={target}"]
        if needs:
            lines.append(f"Requires={' '.join(needs)}")
        lines += ["", "[Service]", "Type=simple", "User=rtxserve", "Group=rtxserve", f"WorkingDirectory={prefix}",
                  "StateDirectory=rtxserve", "CacheDirectory=rtxserve"]
        lines += [f'Environment="{k}={v}"' for k, v in sorted(env.items())]
        building = s.kind == "triton" and build_engines
        if building:  # TensorRT plans built here first, with the box's TensorRT (trtexec where its packages put it)
            repository = next(a.split("=", 1)[1] for a in s.args if a.startswith("--model-repository="))
            lines += [f"ExecStartPre=/usr/bin/env PATH=/usr/src/tensorrt/bin:/usr/bin:/bin /bin/sh {_quote(build_engines)}",
                      f"ReadWritePaths={_quote(repository)}"]
        lines += [f"ExecStart={' '.join(_quote(a) for a in argv)}",
                  # readiness: the unit counts as started once the server answers ready
                  f"ExecStartPost={prefix / '.venv' / 'bin' / 'python'} -m serve.wait_ready "
                  f"http://127.0.0.1:{s.port}{s.ready_path} --timeout {600 if s.kind == 'vllm' else 300}",
                  f"TimeoutStartSec={3600 if building else 660 if s.kind == 'vllm' else 360}",
                  "KillMode=control-group", "KillSignal=SIGTERM", "TimeoutStopSec=60", "Restart=on-failure",
                  "RestartSec=5", "NoNewPrivileges=yes", "PrivateTmp=yes", "ProtectSystem=strict", "ProtectHome=read-only",
                  "", "[Install]", f"WantedBy={target}", ""]
        units[name] = "\n".join(lines)
    units[target] = "\n".join(["[Unit]", f"Description=rtxserve deployment {d.name}",
                               f"Wants={' '.join(n for n in units if n != target)}", "",
                               "[Install]", "WantedBy=multi-user.target", ""])
    return units


def _quote(arg: str) -> str:
    """systemd's own quoting: one word, or a double-quoted string with \\ and " escaped; % doubled."""
    arg = arg.replace("%", "%%")
    if arg and not any(c in arg for c in ' \t"\'\\;$'):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


# ---------------------------------------------------------------------------------------------- Kubernetes

def _labels(app: str, d: Deployment) -> dict:
    return {"app.kubernetes.io/name": app, "app.kubernetes.io/instance": d.name, "app.kubernetes.io/part-of": "rtxserve"}


def _probe(path: str, port: int, period: int = 10, failures: int = 3) -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "timeoutSeconds": 5,
            "failureThreshold": failures}


def _deployment(d: Deployment, app: str, replicas: int, container: dict, *, gpu: int = 0, shm: str | None = None,
                volumes: list[dict] | None = None) -> dict:
    if gpu:  # requests too: without them GPU pods are BestEffort and evicted first
        container["resources"] = {"limits": {"nvidia.com/gpu": gpu},
                                  "requests": {"nvidia.com/gpu": gpu, "cpu": "2", "memory": "16Gi"}}
    pod_volumes = list(volumes or [])
    mounts = container.setdefault("volumeMounts", [])
    if shm:  # PyTorch and the python backend pass tensors through /dev/shm
        pod_volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    container["securityContext"] = _security(non_root=not gpu and app == "gateway")
    spec = {"automountServiceAccountToken": False, "containers": [container], "volumes": pod_volumes}
    if not pod_volumes:
        del spec["volumes"]
    out = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": app, "labels": _labels(app, d)},
           "spec": {"replicas": replicas, "selector": {"matchLabels": _labels(app, d)},
                    "template": {"metadata": {"labels": _labels(app, d)}, "spec": spec}}}
    if gpu:  # a rolling update would need a spare GPU for the surge pod: replace pods instead
        out["spec"]["strategy"] = {"type": "Recreate"}
    return out


def _security(non_root: bool = False) -> dict:
    """No privilege escalation, no capabilities, the runtime's seccomp profile; the gateway image runs as uid
    1000 (the NGC and vLLM images run as root and write their caches under it)."""
    out = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
    return out | ({"runAsNonRoot": True, "runAsUser": 1000} if non_root else {})


def _service(d: Deployment, app: str, ports: dict[str, int]) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": app, "labels": _labels(app, d)},
            "spec": {"selector": _labels(app, d),
                     "ports": [{"name": n, "port": p, "targetPort": p, "protocol": "TCP"} for n, p in ports.items()]}}


def _pdb(d: Deployment, app: str, max_unavailable: int = 1) -> dict:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": app, "labels": _labels(app, d)},
            "spec": {"maxUnavailable": max_unavailable, "selector": {"matchLabels": _labels(app, d)}}}


def _service_monitor(d: Deployment, app: str, port: str, kind: str) -> dict:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": {"name": app, "labels": _labels(app, d)},
            "spec": {"selector": {"matchLabels": _labels(app, d)},
                     # the job label of the compose scrape config, so that one set of rules serves both
                     "endpoints": [{"port": port, "path": "/metrics", "interval": "15s", "relabelings": [
                         {"targetLabel": "job", "replacement": f"rtxserve-{kind}"}]}]}}


def _engine_policy(d: Deployment, app: str, ports: list[int]) -> dict:
    """Only the gateway and Prometheus reach an engine."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": f"{app}-private"},
            "spec": {"podSelector": {"matchLabels": _labels(app, d)}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {"matchLabels": _labels("gateway", d)}},
                                           {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
                                  "ports": [{"protocol": "TCP", "port": p} for p in ports]}]}}


def kubernetes(d: Deployment, p: Plan, services: list[Service], builds: list[Build],
               gateway_replicas: int = 2) -> dict[str, list[dict]]:
    """file name -> its manifests. Each Triton or vLLM pod gets whole GPUs (Kubernetes does not share one
    between pods): Triton one, each LLM one per replica."""
    files: dict[str, list[dict]] = {}
    models_volume = [{"name": "models", "persistentVolumeClaim": {"claimName": "rtxserve-models", "readOnly": True}}]
    models_mount = [{"name": "models", "mountPath": MODELS, "readOnly": True}]
    files["models-pvc.yaml"] = [{"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                 "metadata": {"name": "rtxserve-models", "labels": _labels("models", d)},
                                 "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "100Gi"}}}}]
    seen_llms = set()
    for s in services:
        if s.kind == "triton":
            container = {"name": "tritonserver", "image": SERVING_TRITON_IMAGE, "args": ["tritonserver", *s.args],
                         "ports": [{"name": "http", "containerPort": d.ports.triton_http},
                                   {"name": "grpc", "containerPort": d.ports.triton_grpc},
                                   {"name": "metrics", "containerPort": d.ports.triton_metrics}],
                         "startupProbe": _probe("/v2/health/ready", d.ports.triton_http, 10, 60),
                         "readinessProbe": _probe("/v2/health/ready", d.ports.triton_http, 5),
                         "livenessProbe": _probe("/v2/health/live", d.ports.triton_http),
                         "volumeMounts": list(models_mount)}
            volumes = list(models_volume)
            init = []
            if builds:  # the claim is read-only: the repository is copied where the plans can be built
                container["args"] = ["tritonserver", *(a if not a.startswith("--model-repository=")
                                                       else "--model-repository=/repository" for a in s.args)]
                container["volumeMounts"].append({"name": "repository", "mountPath": "/repository"})
                volumes.append({"name": "repository", "emptyDir": {}})
                init = [{"name": "build-engines", "image": TENSORRT_IMAGE,
                         "command": ["sh", "-c", f"cp -r {MODELS}/repository/. /repository/\n"
                                     + build_script(builds, "/repository")],
                         "volumeMounts": [*models_mount, {"name": "repository", "mountPath": "/repository"}],
                         "resources": {"limits": {"nvidia.com/gpu": 1}, "requests": {"nvidia.com/gpu": 1}},
                         "securityContext": _security()}]
            deployment = _deployment(d, "triton", 1, container, gpu=1 if d.on_gpu else 0, shm="2Gi", volumes=volumes)
            if init:
                deployment["spec"]["template"]["spec"]["initContainers"] = init
            files["triton.yaml"] = [
                deployment,
                _service(d, "triton", {"http": d.ports.triton_http, "grpc": d.ports.triton_grpc,
                                       "metrics": d.ports.triton_metrics}),
                _pdb(d, "triton"), _engine_policy(d, "triton", [d.ports.triton_grpc, d.ports.triton_metrics]),
                _service_monitor(d, "triton", "metrics", "triton")]
        elif s.kind == "vllm":
            model = next(m for m in d.llms if m.name == s.models[0])
            if model.name in seen_llms:  # every replica of one LLM is one Deployment: the first engine's options
                continue
            seen_llms.add(model.name)
            app = llm_app(model.name)
            args = _serve_args(s.args)
            if "--gpu-memory-utilization" in args:  # the pod owns its GPU: vLLM's own default share (0.9)
                i = args.index("--gpu-memory-utilization")
                del args[i:i + 2]
            container = {"name": "vllm", "image": VLLM_IMAGE, "command": ["vllm", "serve"], "args": args,
                         "env": [{"name": k, "value": v} for k, v in sorted(s.env.items())],
                         "ports": [{"name": "http", "containerPort": s.port}],
                         "startupProbe": _probe("/health", s.port, 10, 60), "readinessProbe": _probe("/health", s.port, 5),
                         "livenessProbe": _probe("/health", s.port), "volumeMounts": list(models_mount)}
            files[f"{app}.yaml"] = [
                _deployment(d, app, model.replicas, container, gpu=1 if d.on_gpu else 0, shm="8Gi", volumes=models_volume),
                _service(d, app, {"http": s.port}), _pdb(d, app), _engine_policy(d, app, [s.port]),
                _service_monitor(d, app, "http", "vllm")]
    gateway = next(s for s in services if s.kind == "gateway")
    mounts = [{"name": "config", "mountPath": "/etc/rtxserve", "readOnly": True}]
    volumes: list[dict] = [{"name": "config", "configMap": {"name": "rtxserve-gateway"}}]
    if d.gateway.keys_file is not None:
        mounts.append({"name": "keys", "mountPath": str(Path(KEYS_IN_CONTAINER).parent), "readOnly": True})
        volumes.append({"name": "keys", "secret": {"secretName": "rtxserve-api-keys"}})
    container = {"name": "gateway", "image": GATEWAY_IMAGE, "command": ["rtxserve"], "args": gateway.args,
                 "env": [{"name": k, "value": v} for k, v in sorted(gateway.env.items())],
                 "ports": [{"name": "http", "containerPort": gateway.port}],
                 "readinessProbe": _probe("/readyz", gateway.port, 5), "livenessProbe": _probe("/healthz", gateway.port),
                 "resources": {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
                 "volumeMounts": mounts}
    files["gateway.yaml"] = [
        _deployment(d, "gateway", gateway_replicas, container, volumes=volumes),
        _service(d, "gateway", {"http": gateway.port}), _pdb(d, "gateway"),
        {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "gateway"},
         "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gateway"},
                  "minReplicas": gateway_replicas, "maxReplicas": max(10, gateway_replicas),
                  "metrics": [{"type": "Resource", "resource": {"name": "cpu",
                                                                "target": {"type": "Utilization", "averageUtilization": 70}}}]}},
        _service_monitor(d, "gateway", "http", "gateway")]
    files["prometheus-rules.yaml"] = [{"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
                                       "metadata": {"name": f"rtxserve-{d.name}", "labels": _labels("rules", d)},
                                       "spec": monitoring.alert_rules(d)}]
    files["locust.yaml"] = locust_job(d)
    return files


def locust_job(d: Deployment, workers: int = 4) -> list[dict]:
    """A locust master and its workers as Jobs (the gateway image holds locust and the scenarios), suspended:
    set `suspend: false` on both (or `kubectl create job --from`) to run a load test in the cluster."""
    first = d.models[0]
    # the first model's task, from its entry (an encoder may classify, tag or embed) or its kind (the one task)
    task = encoder_metadata(d, first).task if first.kind == ENCODER else of_kind(first.kind)[0]
    scenario = TASKS[task].loadtest[0]
    locustfile = "$(python -c 'import loadtest, os; print(os.path.dirname(loadtest.__file__))')/scenarios/locustfile.py"
    common = f"locust -f {locustfile} --scenario {scenario} --model {first.name}"
    master = (f"{common} --master --headless --expect-workers {workers} -u 32 -r 32 -t 5m "
              f"--host http://gateway:{d.ports.gateway} --csv /tmp/locust --only-summary")
    worker = f"{common} --worker --master-host locust-master"
    master += " --api-key \"$RTXSERVE_API_KEY\""

    def job(name: str, command: str, parallelism: int) -> dict:
        container = {"name": "locust", "image": GATEWAY_IMAGE, "command": ["sh", "-c", command],
                     # a key of the gateway's, as plain text: create it with
                     # kubectl create secret generic rtxserve-loadtest-key --from-literal=api-key=rtx-...
                     "env": [{"name": "RTXSERVE_API_KEY", "valueFrom": {"secretKeyRef": {
                         "name": "rtxserve-loadtest-key", "key": "api-key"}}}],
                     "securityContext": _security(non_root=True)}
        if name == "locust-master":
            container["ports"] = [{"name": "master", "containerPort": 5557}]
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": _labels(name, d)},
                "spec": {"suspend": True, "parallelism": parallelism, "completions": parallelism, "backoffLimit": 0,
                         "template": {"metadata": {"labels": _labels(name, d)},
                                      "spec": {"restartPolicy": "Never", "containers": [container]}}}}

    return [job("locust-master", master, 1), _service(d, "locust-master", {"master": 5557}),
            job("locust-worker", worker, workers)]


def kustomization(d: Deployment, files: list[str]) -> dict:
    k = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": f"rtxserve-{d.name}",
         "resources": ["namespace.yaml", *files],
         "labels": [{"pairs": {"app.kubernetes.io/managed-by": "rtxserve"}}],
         "configMapGenerator": [{"name": "rtxserve-gateway", "files": ["gateway.yaml=gateway-config.yaml"]}]}
    if d.gateway.keys_file is not None:
        k["secretGenerator"] = [{"name": "rtxserve-api-keys", "files": ["api_keys.json=keys.json"]}]
    return k


# ---------------------------------------------------------------------------------------------- all of it

def render(d: Deployment, out: Path, *, at: Path | None = None, prefix: Path | None = None,
           tritonserver: Path | None = None, backend_directory: Path | None = None) -> list[Path]:
    """Write every file for `d` into `out`; returns them. Refuses a deployment that does not fit.

    `at`: where `out` will be on the box that runs it (default: `out` itself); `prefix`: where rtxserve is
    installed there (default: the current folder). Both only matter to the systemd units, which run from
    host paths."""
    p = plan(d)
    if not p.fits:
        raise DeploymentError(f"{d.name} does not fit:\n{format_plan(p)}")
    if d.gateway.keys_file is None:
        raise DeploymentError("gateway.keys_file: rendered deployments listen beyond loopback inside their containers, "
                              "so the gateway needs keys: make them with `rtxserve keys create` and name the file here")
    if d.llms and not d.on_gpu:
        raise DeploymentError("models: vLLM's images need a GPU, and this deployment has none (gpus.count 0): run a "
                              "CPU box with `rtxserve serve up`, or render it with its GPUs")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    where = stage_models(d, p, out)
    keys = out / "secrets" / "keys.json"
    keys.parent.mkdir(exist_ok=True)
    shutil.copy2(d.resolve(d.gateway.keys_file), keys)
    os.chmod(keys, 0o600)
    where[d.resolve(d.gateway.keys_file)] = KEYS_IN_CONTAINER
    written = []

    def write(rel: str, text: str) -> None:
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)

    def dump(rel: str, data, header: str = "") -> None:
        _dump(out / rel, data, header)
        written.append(out / rel)

    # compose and Kubernetes: the same containers, reached by service name
    inside = container_layout(d, where)
    services = build_services(d, p, inside)
    settings = gateway_settings(d, inside)
    dump("gateway.yaml", settings, "the gateway's settings (RTXSERVE_CONFIG) inside the containers")
    builds = plan_tensorrt(d, out / "models" / "repository") if d.encoders else []
    if builds:
        write("engines/build-engines.sh", build_script(builds, f"{MODELS}/repository"))
    dump("compose/compose.yaml", compose(d, p, services, builds), f"rtxserve {d.name}: docker compose up -d (from this folder)")
    dump("compose/prometheus.yml", monitoring.prometheus_config(scrape_targets(services, lambda s: s)))
    dump("monitoring/rules.yml", monitoring.alert_rules(d))
    for name, board in monitoring.dashboards(d).items():
        write(f"monitoring/dashboards/{name}", board)
    dump("monitoring/grafana/datasources/prometheus.yaml", monitoring.GRAFANA_DATASOURCES)
    dump("monitoring/grafana/providers/rtxserve.yaml", monitoring.GRAFANA_DASHBOARDS)
    # Kubernetes: one Deployment and Service per LLM in front of its replicas (all on its first engine's port)
    k8s_layout = container_layout(d, where)
    k8s_services = build_services(d, p, k8s_layout)
    k8s_settings = gateway_settings(d, k8s_layout)
    k8s_settings["vllm_url"] = ",".join(f"http://{llm_app(s.models[0])}:{s.port}"
                                        for s in k8s_services if s.kind == "vllm" and s.name.endswith("-0"))
    manifests = kubernetes(d, p, k8s_services, builds)
    for name, docs in manifests.items():
        write(f"kubernetes/{name}", "".join("---\n" + yaml.safe_dump(doc, sort_keys=False, width=120) for doc in docs))
    dump("kubernetes/namespace.yaml", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": f"rtxserve-{d.name}"}})
    dump("kubernetes/gateway-config.yaml", k8s_settings)
    shutil.copy2(keys, out / "kubernetes" / "keys.json")
    dump("kubernetes/kustomization.yaml", kustomization(d, list(manifests)))
    # systemd: the same servers on one host, from an install at `prefix`, artifacts under out/models
    prefix = Path(prefix or Path.cwd()).resolve()
    at = Path(at or out).resolve()
    host_where = {k: str(at / "models" / Path(v).relative_to(MODELS)) if v.startswith(MODELS) else
                  str(at / "secrets" / "keys.json") for k, v in where.items()}
    host = Layout(path=lambda p: host_where[Path(p).resolve()], repository=str(at / "models" / "repository"),
                  gateway_config=str(at / "systemd" / "gateway.yaml"))
    host_services = build_services(d, p, host)
    dump("systemd/gateway.yaml", gateway_settings(d, host))
    if builds:
        write("systemd/build-engines.sh", build_script(builds, str(at / "models" / "repository")))
    build = str(at / "systemd" / "build-engines.sh") if builds else None
    for name, text in systemd_units(d, host_services, prefix, tritonserver, backend_directory, build).items():
        write(f"systemd/{name}", text)
    images = [TRITON_IMAGE if d.encoders else None, TENSORRT_IMAGE if builds else None, VLLM_IMAGE if d.llms else None,
              PROMETHEUS_IMAGE, GRAFANA_IMAGE, PYTHON_IMAGE]
    write("images.txt", "".join(f"{i}\n" for i in images if i))
    wheels_note = "Wheels the image installs offline: `rtxserve deploy bundle` puts them here.\n"
    write("gateway-image/Dockerfile", GATEWAY_DOCKERFILE)
    write("gateway-image/wheels/README", wheels_note)
    if d.encoders:
        write("triton-image/Dockerfile", TRITON_DOCKERFILE)
        triton_reqs = Path(__file__).parent / "triton"
        requirements = (triton_reqs / "requirements-image.txt").read_text()
        if d.diffusion:  # PyTorch (the image's CUDA build from its index), diffusers and what pipelines import
            requirements += "".join(line.replace("torch==2.13.0", "torch") + "\n" for line in
                                    (triton_reqs / "requirements-diffusion.txt").read_text().splitlines()
                                    if line and not line.startswith("#"))
        write("triton-image/requirements.txt", requirements)
        write("triton-image/wheels/README", wheels_note)
    write("plan.txt", format_plan(p) + "\n")
    write("plan.json", json.dumps(p.to_json(), indent=2) + "\n")
    return written


GATEWAY_DOCKERFILE = f"""# The gateway (and locust, for load tests in the cluster). Offline: put the wheels of `.venv` in wheels/
# (rtxserve deploy bundle does), then `docker build -t {GATEWAY_IMAGE} .`
FROM {PYTHON_IMAGE}
COPY wheels/ /wheels/
RUN pip install --no-index --find-links=/wheels rtxserve && rm -rf /wheels \\
 && useradd --system --uid 1000 rtxserve
USER rtxserve
ENTRYPOINT []
CMD ["rtxserve", "serve", "gateway"]
"""


TRITON_DOCKERFILE = f"""# Triton with what the entries' python-backend steps import (tokenizers, ONNX Runtime, Pillow), installed
# from wheels/ for the image's Python {TRITON_IMAGE_PYTHON} (`rtxserve deploy bundle` puts them there; online,
# build with --build-arg PIP_ARGS= to take them from the index instead): docker build -t {SERVING_TRITON_IMAGE} .
FROM {TRITON_IMAGE}
ARG PIP_ARGS="--no-index --find-links=/wheels"
COPY requirements.txt /requirements.txt
COPY wheels/ /wheels/
RUN pip install --no-cache-dir $PIP_ARGS -r /requirements.txt && rm -rf /wheels
"""
