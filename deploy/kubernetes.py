"""A kustomize base for a fleet: one Deployment, Service, PodDisruptionBudget, NetworkPolicy and ServiceMonitor per
server, the gateway with its autoscaler, the alert rules, and a suspended locust Job."""

from __future__ import annotations

from pathlib import Path

import yaml

from core.tasks import ENCODER, LLM, SPEECH, TASKS, of_kind
from serve.vllm import serve_args, served_task

from . import monitoring
from .engines import Build, build_script
from .images import (GATEWAY_IMAGE, KEYS_IN_CONTAINER, MODELS, REDIS_IMAGE, TENSORRT_IMAGE, image_context, triton_image,
                     vllm_image)
from .plan import Plan
from .services import Service
from .spec import Deployment, encoder_metadata, llm_app

KUBERNETES_VERSION = "1.32.0"  # the API version the manifests are validated against


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
        if d.kubernetes.runtime_class:
            spec["runtimeClassName"] = d.kubernetes.runtime_class
    return out


def image(d: Deployment, name: str) -> str:
    """An image as the cluster pulls it: one built here from `kubernetes.registry` when one is set."""
    return f"{d.kubernetes.registry.rstrip('/')}/{name}" if d.kubernetes.registry and image_context(name) else name


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
            "metadata": {"name": app, "labels": _labels(app, d) | d.kubernetes.monitoring_labels},
            "spec": {"selector": {"matchLabels": _labels(app, d)},
                     # the job label of the compose scrape config, so that one set of rules serves both
                     "endpoints": [{"port": port, "path": "/metrics", "interval": "15s", "relabelings": [
                         {"targetLabel": "job", "replacement": f"rtxserve-{kind}"}]}]}}


def _engine_policy(d: Deployment, app: str, ports: list[int]) -> dict:
    """Only the gateway and Prometheus reach an engine."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": f"{app}-private"},
            "spec": {"podSelector": {"matchLabels": _labels(app, d)}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {"matchLabels": _labels("gateway", d)}},
                                           {"namespaceSelector": {"matchLabels": {
                                               "kubernetes.io/metadata.name": d.kubernetes.monitoring_namespace}}}],
                                  "ports": [{"protocol": "TCP", "port": p} for p in ports]}]}}


# Every engine pod mounts the staged artifacts read-only at /models.
MODELS_VOLUME = [{"name": "models", "persistentVolumeClaim": {"claimName": "rtxserve-models", "readOnly": True}}]
MODELS_MOUNT = [{"name": "models", "mountPath": MODELS, "readOnly": True}]


def kubernetes(d: Deployment, p: Plan, services: list[Service], builds: list[Build],
               gateway_replicas: int = 2) -> dict[str, list[dict]]:
    """file name -> its manifests. Each Triton or vLLM pod gets whole GPUs (Kubernetes does not share one
    between pods): Triton one, each LLM one per replica."""
    files: dict[str, list[dict]] = {}
    claim = {"accessModes": [d.kubernetes.models_access_mode], "resources": {"requests": {"storage": "100Gi"}}}
    if d.kubernetes.storage_class:
        claim["storageClassName"] = d.kubernetes.storage_class
    files["models-pvc.yaml"] = [{"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                 "metadata": {"name": "rtxserve-models", "labels": _labels("models", d)}, "spec": claim}]
    seen_llms = set()
    for s in services:
        if s.kind == "triton":
            files["triton.yaml"] = _triton(d, s, builds)
        elif s.kind == "vllm" and s.models[0] not in seen_llms:
            # every replica of one LLM is one Deployment: the first engine's options
            seen_llms.add(s.models[0])
            files[f"{llm_app(s.models[0])}.yaml"] = _vllm(d, s)
    files["gateway.yaml"] = _gateway(d, next(s for s in services if s.kind == "gateway"), gateway_replicas)
    if needs_redis(d):
        files["redis.yaml"] = _redis(d)
    files["prometheus-rules.yaml"] = [{"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
                                       "metadata": {"name": f"rtxserve-{d.name}",
                                                    "labels": _labels("rules", d) | d.kubernetes.monitoring_labels},
                                       "spec": monitoring.alert_rules(d)}]
    if any(m.kind != SPEECH for m in d.models):
        files["locust.yaml"] = locust_job(d)
    return files


def _triton(d: Deployment, s: Service, builds: list[Build]) -> list[dict]:
    """Triton's Deployment (with the TensorRT plans built by an init container where asked) and its companions."""
    container = {"name": "tritonserver", "image": image(d, triton_image(d.on_gpu)), "args": ["tritonserver", *s.args],
                 "ports": [{"name": "http", "containerPort": d.ports.triton_http},
                           {"name": "grpc", "containerPort": d.ports.triton_grpc},
                           {"name": "metrics", "containerPort": d.ports.triton_metrics}],
                 "startupProbe": _probe("/v2/health/ready", d.ports.triton_http, 10, 60),
                 "readinessProbe": _probe("/v2/health/ready", d.ports.triton_http, 5),
                 "livenessProbe": _probe("/v2/health/live", d.ports.triton_http),
                 "volumeMounts": list(MODELS_MOUNT)}
    volumes = list(MODELS_VOLUME)
    init = []
    if builds:  # the claim is read-only: the repository is copied where the plans can be built
        container["args"] = ["tritonserver", *(a if not a.startswith("--model-repository=")
                                               else "--model-repository=/repository" for a in s.args)]
        container["volumeMounts"].append({"name": "repository", "mountPath": "/repository"})
        volumes.append({"name": "repository", "emptyDir": {}})
        init = [{"name": "build-engines", "image": TENSORRT_IMAGE,
                 "command": ["sh", "-c", f"cp -r {MODELS}/repository/. /repository/\n" + build_script(builds, "/repository")],
                 "volumeMounts": [*MODELS_MOUNT, {"name": "repository", "mountPath": "/repository"}],
                 "resources": {"limits": {"nvidia.com/gpu": 1}, "requests": {"nvidia.com/gpu": 1}},
                 "securityContext": _security()}]
    # One pod per GPU, each with one GPU (its instance_group counts are per GPU, as planned): Kubernetes hands out
    # GPUs per pod, and the gateway reaches them all through the Service.
    deployment = _deployment(d, "triton", d.gpus.count if d.on_gpu else 1, container, gpu=1 if d.on_gpu else 0,
                             shm="2Gi", volumes=volumes)
    if init:
        deployment["spec"]["template"]["spec"]["initContainers"] = init
    return [deployment,
            _service(d, "triton", {"http": d.ports.triton_http, "grpc": d.ports.triton_grpc, "metrics": d.ports.triton_metrics}),
            _pdb(d, "triton"), _engine_policy(d, "triton", [d.ports.triton_grpc, d.ports.triton_metrics]),
            _service_monitor(d, "triton", "metrics", "triton")]


def _vllm(d: Deployment, s: Service) -> list[dict]:
    """One LLM's Deployment (a pod per replica) and its companions."""
    model = next(m for m in d.vllm_models if m.name == s.models[0])
    app = llm_app(model.name)
    # The plan's --gpu-memory-utilization stays: the pod shares its GPU with Triton's (time-slicing, no memory
    # isolation), so vLLM must hold its planned share and no more.
    args = serve_args(s.args)
    container = {"name": "vllm", "image": image(d, vllm_image(d.on_gpu, model.kind == SPEECH)),
                 "command": ["vllm", "serve"], "args": args,
                 "env": [{"name": k, "value": v} for k, v in sorted(s.env.items())],
                 "ports": [{"name": "http", "containerPort": s.port}],
                 "startupProbe": _probe("/health", s.port, 10, 60), "readinessProbe": _probe("/health", s.port, 5),
                 "livenessProbe": _probe("/health", s.port), "volumeMounts": list(MODELS_MOUNT)}
    deployment = _deployment(d, app, model.replicas, container, gpu=1 if d.on_gpu else 0, shm="8Gi", volumes=MODELS_VOLUME)
    if d.encoders:  # vLLM takes its share of what is free when it starts: after Triton has loaded
        deployment["spec"]["template"]["spec"]["initContainers"] = [_wait_for_triton(d)]
    return [deployment, _service(d, app, {"http": s.port}), _pdb(d, app), _engine_policy(d, app, [s.port]),
            _service_monitor(d, app, "http", "vllm")]


def _wait_for_triton(d: Deployment) -> dict:
    """An init container that waits until Triton answers ready (the vLLM image's own Python, no extra image)."""
    url = f"http://triton:{d.ports.triton_http}/v2/health/ready"
    wait = ("import time, urllib.request\nwhile True:\n    try:\n        urllib.request.urlopen(%r, timeout=5)\n"
            "        break\n    except OSError:\n        time.sleep(5)\n" % url)
    return {"name": "wait-for-triton", "image": image(d, vllm_image(d.on_gpu, False)), "command": ["python3", "-c", wait],
            "securityContext": _security()}


def pods_per_gpu(d: Deployment, p: Plan) -> int:
    """The most GPU pods the plan puts on one GPU: Triton's pod on every GPU, and each vLLM engine on its own."""
    if not d.on_gpu:
        return 0
    engines = [sum(1 for gpus in p.engines.values() for g in gpus if g == i) for i in range(d.gpus.count)]
    return max(e + (1 if d.encoders else 0) for e in engines)


def time_slicing(d: Deployment, p: Plan) -> dict | None:
    """The NVIDIA device plugin's time-slicing config that lets the planned pods share their GPUs, or None when
    every pod has a GPU of its own. It is the GPU operator's (or the device plugin's) config, not the namespace's:
    apply it as its header (and the README's "Kubernetes on a GPU that Triton and vLLM share") says."""
    slices = pods_per_gpu(d, p)
    if slices <= 1:
        return None
    config = {"version": "v1", "sharing": {"timeSlicing": {"failRequestsGreaterThanOne": True,
                                                           "resources": [{"name": "nvidia.com/gpu", "replicas": slices}]}}}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"rtxserve-{d.name}-time-slicing", "namespace": "gpu-operator"},
            "data": {"any": yaml.safe_dump(config, sort_keys=False)}}


def _gateway(d: Deployment, gateway: Service, replicas: int) -> list[dict]:
    """The gateway's Deployment (its settings from a ConfigMap, its keys from a Secret), autoscaled on CPU."""
    mounts = [{"name": "config", "mountPath": "/etc/rtxserve", "readOnly": True}]
    volumes: list[dict] = [{"name": "config", "configMap": {"name": "rtxserve-gateway"}}]
    if d.gateway.keys_file is not None:
        mounts.append({"name": "keys", "mountPath": str(Path(KEYS_IN_CONTAINER).parent), "readOnly": True})
        volumes.append({"name": "keys", "secret": {"secretName": "rtxserve-api-keys"}})
    container = {"name": "gateway", "image": image(d, GATEWAY_IMAGE), "command": ["rtxserve"], "args": gateway.args,
                 "env": [{"name": k, "value": v} for k, v in sorted(gateway.env.items())],
                 "ports": [{"name": "http", "containerPort": gateway.port}],
                 "readinessProbe": _probe("/readyz", gateway.port, 5), "livenessProbe": _probe("/healthz", gateway.port),
                 "resources": {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
                 "volumeMounts": mounts}
    return [_deployment(d, "gateway", replicas, container, volumes=volumes),
            _service(d, "gateway", {"http": gateway.port}), _pdb(d, "gateway"),
            {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "gateway"},
             "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gateway"},
                      "minReplicas": replicas, "maxReplicas": max(10, replicas),
                      "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {
                          "type": "Utilization", "averageUtilization": 70}}}]}},
            _service_monitor(d, "gateway", "http", "gateway")]


REDIS = "rtxserve-redis"  # the quota counters' Service
REDIS_URI = f"async+redis://{REDIS}:6379"


def needs_redis(d: Deployment) -> bool:
    """The gateway runs as several pods (its HPA), so per-key quotas are counted in one Redis that every pod shares,
    unless the deployment's gateway settings name a storage of their own."""
    return "rate_limit_storage" not in d.gateway.settings


def _redis(d: Deployment) -> list[dict]:
    """Counters only: no persistence (a restart starts the current minute again), no auth beyond the policy that
    lets only the gateway's pods reach it."""
    container = {"name": "redis", "image": REDIS_IMAGE, "args": ["--save", "", "--appendonly", "no"],
                 "ports": [{"name": "redis", "containerPort": 6379}],
                 "readinessProbe": {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 5},
                 "livenessProbe": {"tcpSocket": {"port": 6379}, "periodSeconds": 10},
                 "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}}}
    deployment = _deployment(d, REDIS, 1, container)
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContext"] |= {"runAsNonRoot": True,
                                                                                  "runAsUser": 999}
    policy = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": f"{REDIS}-private"},
              "spec": {"podSelector": {"matchLabels": _labels(REDIS, d)}, "policyTypes": ["Ingress"],
                       "ingress": [{"from": [{"podSelector": {"matchLabels": _labels("gateway", d)}}],
                                    "ports": [{"protocol": "TCP", "port": 6379}]}]}}
    return [deployment, _service(d, REDIS, {"redis": 6379}), policy]


def locust_job(d: Deployment, workers: int = 4) -> list[dict]:
    """A locust master and its workers as Jobs (the gateway image holds locust and the scenarios), suspended:
    set `suspend: false` on both (or `kubectl create job --from`) to run a load test in the cluster. They drive the
    first model that is not a speech model: a speech load test uploads audio files the gateway image does not hold
    (run `rtxserve loadtest --scenario transcribe --audio-dir DIR` where they are)."""
    first = next(m for m in d.models if m.kind != SPEECH)
    # the first model's task, from its entry (an encoder may classify, tag or embed), from its config (a vLLM engine
    # may generate or rank) or its kind (the one task)
    if first.kind == ENCODER:
        task = encoder_metadata(d, first).task
    elif first.kind == LLM:
        task = served_task(d.resolve(first.path))
    else:
        task = of_kind(first.kind)[0]
    scenario = TASKS[task].loadtest[0]
    locustfile = "$(python -c 'import loadtest, os; print(os.path.dirname(loadtest.__file__))')/scenarios/locustfile.py"
    common = f"locust -f {locustfile} --scenario {scenario} --model {first.name}"
    master = (f"{common} --master --headless --expect-workers {workers} -u 32 -r 32 -t 5m "
              f"--host http://gateway:{d.ports.gateway} --csv /tmp/locust --only-summary")
    worker = f"{common} --worker --master-host locust-master"
    master += " --api-key \"$RTXSERVE_API_KEY\""

    def job(name: str, command: str, parallelism: int) -> dict:
        container = {"name": "locust", "image": image(d, GATEWAY_IMAGE), "command": ["sh", "-c", command],
                     # the key render made for the load test (loadtest-key.txt, in kubernetes/keys.json only)
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
        k["secretGenerator"] = [{"name": "rtxserve-api-keys", "files": ["api_keys.json=keys.json"]},
                                {"name": "rtxserve-loadtest-key", "files": [f"api-key={LOADTEST_KEY_FILE}"]}]
    return k


LOADTEST_KEY_FILE = "loadtest-key.txt"


def models_loader(d: Deployment) -> dict:
    """A pod that mounts the models claim read-write, to fill it with `kubectl cp` (the engines mount it
    read-only); deleted once the copy is done."""
    container = {"name": "loader", "image": image(d, GATEWAY_IMAGE), "command": ["sleep", "infinity"],
                 "volumeMounts": [{"name": "models", "mountPath": MODELS}], "securityContext": _security()}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "rtxserve-models-loader", "labels": _labels("models", d)},
            "spec": {"automountServiceAccountToken": False, "containers": [container], "restartPolicy": "Never",
                     "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "rtxserve-models"}}]}}
