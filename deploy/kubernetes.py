"""A kustomize base for a fleet: on GPUs, one pod per card holding what the plan put on that card (its Triton
instances as a sidecar, then its vLLM engine) with one GPU claimed through Dynamic Resource Allocation; on CPU, a
Deployment per server. A Service per Triton and per engine, a PodDisruptionBudget and a NetworkPolicy per pod, a
ServiceMonitor per kind, the gateway with its autoscaler, the alert rules, and a suspended locust Job."""

from __future__ import annotations

import math
from pathlib import Path

from core.tasks import ENCODER, LLM, SPEECH, TASKS, of_kind
from serve.vllm_server import serve_args, served_task

from . import monitoring
from .engines import Build, build_script
from .images import (GATEWAY_IMAGE, KEYS_IN_CONTAINER, MODELS, POSTGRES_IMAGE, REDIS_IMAGE, SPEECH_VLLM_IMAGE,
                     STORE_HOST, STORE_PASSWORD_FILE, STORE_PASSWORD_IN_CONTAINER, TENSORRT_IMAGE, VLLM_IMAGE,
                     image_context, triton_image, vllm_image)
from .plan import Plan, server_host_gib
from .services import Service, container_command, put_to_sleep
from .spec import Deployment
from .load import encoder_metadata

# The API version the manifests are validated against: resource.k8s.io/v1 (Dynamic Resource Allocation) is GA from 1.34,
# native sidecars (init containers with restartPolicy Always) from 1.33
KUBERNETES_VERSION = "1.34.0"


def _labels(app: str, d: Deployment) -> dict:
    return {"app.kubernetes.io/name": app, "app.kubernetes.io/instance": d.name, "app.kubernetes.io/part-of": "rtxserve"}


def _probe(path: str, port: int, period: int = 10, failures: int = 3) -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "timeoutSeconds": 5,
            "failureThreshold": failures}


def _resources(gib: float, claim: bool = False) -> dict:
    """Memory from the plan (requested as estimated, limited at twice that, in quarters of a GiB), a CPU, and the pod's
    GPU claim where the container uses the card."""
    quarters = max(1, math.ceil(gib * 4))
    out = {"requests": {"cpu": "1", "memory": f"{quarters * 256}Mi"}, "limits": {"memory": f"{quarters * 512}Mi"}}
    return out | ({"claims": [{"name": "gpu"}]} if claim else {})


def _pod(d: Deployment, app: str, replicas: int, containers: list[dict], *, init: list[dict] | None = None,
         volumes: list[dict] | None = None, shm: str | None = None, gpu: bool = False, fs_group: int | None = None) -> dict:
    """A Deployment of `replicas` pods of `containers` (after `init`); `gpu`: its containers share one GPU, claimed
    through Dynamic Resource Allocation (gpu-claim.yaml), and its pods are replaced rather than rolled (no spare GPU
    for a surge pod); `fs_group`: the group its volumes are made writable by."""
    pod_volumes = list(volumes or [])
    if shm:  # PyTorch and the python backend pass tensors through /dev/shm
        pod_volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}})
        for c in [*containers, *(init or [])]:
            c.setdefault("volumeMounts", []).append({"name": "shm", "mountPath": "/dev/shm"})
    spec = {"automountServiceAccountToken": False, **({"initContainers": init} if init else {}), "containers": containers}
    if pod_volumes:
        spec["volumes"] = pod_volumes
    if fs_group is not None:
        spec["securityContext"] = {"fsGroup": fs_group}
    if gpu:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": GPU_CLAIM}]
        if d.kubernetes.runtime_class:
            spec["runtimeClassName"] = d.kubernetes.runtime_class
    out = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": app, "labels": _labels(app, d)},
           "spec": {"replicas": replicas, "selector": {"matchLabels": _labels(app, d)},
                    "template": {"metadata": {"labels": _labels(app, d)}, "spec": spec}}}
    if gpu:
        out["spec"]["strategy"] = {"type": "Recreate"}
    return out


def image(d: Deployment, name: str) -> str:
    """An image as the cluster pulls it: one built here from `kubernetes.registry` when one is set."""
    return f"{d.kubernetes.registry.rstrip('/')}/{name}" if d.kubernetes.registry and image_context(name) else name


# The images that run as a user of their own: those built here (uid 1000, rtxserve) and NGC's Triton (uid 1000,
# triton-server). vLLM's own image runs as root and keeps its caches under /root.
NON_ROOT_UID = 1000


def _security(user: int | None = None) -> dict:
    """No privilege escalation, no capabilities, the runtime's seccomp profile; and `user`, where the image runs as one."""
    out = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
    return out | ({"runAsNonRoot": True, "runAsUser": user} if user is not None else {})


def _image_user(d: Deployment, name: str) -> int | None:
    return None if name == VLLM_IMAGE or (name == SPEECH_VLLM_IMAGE and d.on_gpu) else NON_ROOT_UID


def _service(d: Deployment, name: str, app: str, ports: dict[str, int], component: str | None = None) -> dict:
    """Service `name` in front of `app`'s pods; `component` labels it for the ServiceMonitor of its kind."""
    labels = _labels(name, d) | ({"rtxserve.io/component": component} if component else {})
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
            "spec": {"selector": _labels(app, d),
                     "ports": [{"name": n, "port": p, "targetPort": p, "protocol": "TCP"} for n, p in ports.items()]}}


def _pdb(d: Deployment, app: str, max_unavailable: int = 1) -> dict:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": app, "labels": _labels(app, d)},
            "spec": {"maxUnavailable": max_unavailable, "selector": {"matchLabels": _labels(app, d)}}}


def _service_monitor(d: Deployment, component: str, port: str) -> dict:
    """One ServiceMonitor for every Service of a kind (each Triton, each vLLM engine: Prometheus scrapes each)."""
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": {"name": component, "labels": _labels(component, d) | d.kubernetes.monitoring_labels},
            "spec": {"selector": {"matchLabels": {"app.kubernetes.io/instance": d.name, "rtxserve.io/component": component}},
                     # the job label of the compose scrape config, so that one set of rules serves both
                     "endpoints": [{"port": port, "path": "/metrics", "interval": "15s", "relabelings": [
                         {"targetLabel": "job", "replacement": f"rtxserve-{component}"}]}]}}


def _engine_policy(d: Deployment, app: str, served: list[int], metrics: list[int]) -> dict:
    """Only the gateway reaches an engine's `served` ports, and Prometheus (its namespace) the `metrics` ones; a pod's
    own containers talk over localhost, which no policy governs."""
    def rule(peer: dict, ports: list[int]) -> dict:
        return {"from": [peer], "ports": [{"protocol": "TCP", "port": p} for p in sorted(set(ports))]}

    monitoring_ns = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": d.kubernetes.monitoring_namespace}}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": f"{app}-private"},
            "spec": {"podSelector": {"matchLabels": _labels(app, d)}, "policyTypes": ["Ingress"],
                     "ingress": [rule({"podSelector": {"matchLabels": _labels("gateway", d)}}, served),
                                 rule(monitoring_ns, metrics)]}}


# Every engine pod mounts the staged artifacts read-only at /models.
MODELS_VOLUME = [{"name": "models", "persistentVolumeClaim": {"claimName": "rtxserve-models", "readOnly": True}}]
MODELS_MOUNT = [{"name": "models", "mountPath": MODELS, "readOnly": True}]
GPU_CLAIM = "rtxserve-gpu"  # the ResourceClaimTemplate of one whole GPU, shared by a card pod's containers


def kubernetes(d: Deployment, p: Plan, services: list[Service], builds: list[Build],
               gateway_replicas: int = 2) -> dict[str, list[dict]]:
    """file name -> its manifests. On GPUs, one pod per card holding what the plan put on it (cards.py's reasons);
    on CPU, Triton and each vLLM engine a Deployment of their own. Each Triton and each engine has a Service of its
    own, so the gateway balances over them and reaches each one."""
    files: dict[str, list[dict]] = {}
    claim = {"accessModes": [d.kubernetes.models_access_mode], "resources": {"requests": {"storage": "100Gi"}}}
    if d.kubernetes.storage_class:
        claim["storageClassName"] = d.kubernetes.storage_class
    files["models-pvc.yaml"] = [{"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                 "metadata": {"name": "rtxserve-models", "labels": _labels("models", d)}, "spec": claim}]
    host = server_host_gib(d, p)
    triton = next((s for s in services if s.kind == "triton"), None)
    engines = [s for s in services if s.kind == "vllm"]
    if d.on_gpu:
        files["gpu-claim.yaml"] = [gpu_claim(d)]
        for card in range(d.gpus.count):
            on_card = [s for s in engines if s.gpu == card]
            if triton or on_card:
                files[f"gpu-{card}.yaml"] = _card(d, card, triton, on_card, host, builds)
    else:
        if triton:
            files["triton.yaml"] = _cpu_triton(d, triton, host["triton"])
        for s in engines:
            files[f"{s.name}.yaml"] = _cpu_engine(d, s, host[s.models[0]])
    files["monitors.yaml"] = ([_service_monitor(d, "triton", "metrics")] if triton else []) + (
        [_service_monitor(d, "vllm", "http")] if engines else [])
    files["gateway.yaml"] = _gateway(d, next(s for s in services if s.kind == "gateway"), gateway_replicas)
    if needs_redis(d):
        files["redis.yaml"] = _redis(d)
    if not d.store.url:
        files["store.yaml"] = _store(d)
    files["prometheus-rules.yaml"] = [{"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
                                       "metadata": {"name": f"rtxserve-{d.name}",
                                                    "labels": _labels("rules", d) | d.kubernetes.monitoring_labels},
                                       "spec": monitoring.alert_rules(d)}]
    if any(m.kind != SPEECH for m in d.models):
        files["locust.yaml"] = locust_job(d)
    return files


def gpu_claim(d: Deployment) -> dict:
    """One whole GPU of the deployment's DRA device class (the NVIDIA DRA driver's gpu.nvidia.com by default): each
    card pod claims one, and its containers share it."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": GPU_CLAIM, "labels": _labels("gpu", d)},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": d.kubernetes.gpu_device_class, "allocationMode": "ExactCount", "count": 1}}]}}}}


def _triton_container(d: Deployment, s: Service, gib: float, claim: bool, repository: str | None = None) -> dict:
    args = [a if not (repository and a.startswith("--model-repository=")) else f"--model-repository={repository}"
            for a in s.args]
    name = triton_image(d.on_gpu)
    return {"name": "tritonserver", "image": image(d, name), "args": ["tritonserver", *args],
            "ports": [{"name": "http", "containerPort": d.ports.triton_http},
                      {"name": "grpc", "containerPort": d.ports.triton_grpc},
                      {"name": "metrics", "containerPort": d.ports.triton_metrics}],
            "startupProbe": _probe("/v2/health/ready", d.ports.triton_http, 10, 60),
            "readinessProbe": _probe("/v2/health/ready", d.ports.triton_http, 5),
            "livenessProbe": _probe("/v2/health/live", d.ports.triton_http),
            "resources": _resources(gib, claim), "volumeMounts": list(MODELS_MOUNT),
            "securityContext": _security(_image_user(d, name))}


def _engine_container(d: Deployment, s: Service, gib: float, claim: bool) -> dict:
    model = next(m for m in d.vllm_models if m.name == s.models[0])
    name = vllm_image(d.on_gpu, model.kind == SPEECH)
    ports = [{"name": "http", "containerPort": s.metrics_port}]
    if s.control_port is not None:  # on demand on a CPU: probed through its control, which starts it
        ports.append({"name": "control", "containerPort": s.control_port})
    return {"name": "vllm", "image": image(d, name), "command": container_command(s), "args": serve_args(s.args),
            "env": [{"name": k, "value": v} for k, v in sorted(s.env.items())], "ports": ports,
            "startupProbe": _probe("/health", s.port, 10, 60), "readinessProbe": _probe("/health", s.port, 5),
            "livenessProbe": _probe("/health", s.port), "resources": _resources(gib, claim),
            "volumeMounts": list(MODELS_MOUNT), "securityContext": _security(_image_user(d, name))}


def _card(d: Deployment, card: int, triton: Service | None, engines: list[Service], host: dict[str, float],
          builds: list[Build]) -> list[dict]:
    """The pod of GPU `card`, claiming one whole GPU that its containers share: the plan decides what shares a card,
    not the device plugin (whose time-slicing balances pods by count alone and may put two engines on one card).
    Triton (its instances on this card) and every engine but the last run as native sidecars, in that order, so that
    each starts once the one before has passed its startup probe: vLLM takes its share of what is free when it
    starts, and its start-up profile must not see another engine's allocations. TensorRT plans are built first, by
    an init container of the TensorRT release that matches Triton's."""
    app = f"gpu-{card}"
    containers, init, volumes = [], [], list(MODELS_VOLUME)
    out: list[dict] = []
    if triton:
        container = _triton_container(d, triton, host["triton"], True, "/repository" if builds else None)
        if builds:  # the claim is read-only: the repository is copied where the plans can be built
            volumes.append({"name": "repository", "emptyDir": {}})
            container["volumeMounts"].append({"name": "repository", "mountPath": "/repository"})
            init.append({"name": "build-engines", "image": TENSORRT_IMAGE, "command": ["sh", "-c", (
                f"cp -r {MODELS}/repository/. /repository/\n" + build_script(builds, "/repository"))],
                "volumeMounts": [*MODELS_MOUNT, {"name": "repository", "mountPath": "/repository"}],
                "resources": _resources(host["triton"], True), "securityContext": _security()})
        if engines:
            init.append(container | {"restartPolicy": "Always"})
        else:
            containers.append(container)
        out.append(_service(d, f"triton-{card}", app, {"http": d.ports.triton_http, "grpc": d.ports.triton_grpc,
                                                        "metrics": d.ports.triton_metrics}, "triton"))
    for i, engine in enumerate(engines):
        container = _engine_container(d, engine, host[engine.models[0]], True)
        if len(engines) > 1:  # containers of one pod need names of their own
            container["name"] = f"vllm-{i}"
        if engine is engines[-1]:
            containers.append(container)
        else:
            init.append(container | {"restartPolicy": "Always"})
            if engine.sleep_level:  # on demand: asleep before the next engine starts (an init container, run to its end)
                init.append({"name": f"vllm-{i}-asleep", "image": image(d, GATEWAY_IMAGE),
                             "command": put_to_sleep(engine, "localhost"),
                             "resources": _resources(0.1, False), "securityContext": _security()})
        out.append(_service(d, engine.name, app, {"http": engine.port}, "vllm"))
    pod = _pod(d, app, 1, containers, init=init, volumes=volumes, shm="8Gi" if engines else "2Gi", gpu=True,
               fs_group=NON_ROOT_UID)
    served = ([d.ports.triton_grpc] if triton else []) + [e.port for e in engines]
    metrics = ([d.ports.triton_metrics] if triton else []) + [e.port for e in engines]
    return [pod, *out, _pdb(d, app), _engine_policy(d, app, served, metrics)]


def _cpu_triton(d: Deployment, s: Service, gib: float) -> list[dict]:
    return [_pod(d, "triton", 1, [_triton_container(d, s, gib, False)], volumes=MODELS_VOLUME, shm="2Gi"),
            _service(d, "triton", "triton", {"http": d.ports.triton_http, "grpc": d.ports.triton_grpc,
                                             "metrics": d.ports.triton_metrics}, "triton"),
            _pdb(d, "triton"), _engine_policy(d, "triton", [d.ports.triton_grpc], [d.ports.triton_metrics])]


def _cpu_engine(d: Deployment, s: Service, gib: float) -> list[dict]:
    """A CPU engine: it takes no share of anything Triton holds, and starts when it likes."""
    control = {"control": s.control_port} if s.control_port is not None else {}
    return [_pod(d, s.name, 1, [_engine_container(d, s, gib, False)], volumes=MODELS_VOLUME, shm="8Gi"),
            _service(d, s.name, s.name, {"http": s.metrics_port, **control}, "vllm"), _pdb(d, s.name),
            _engine_policy(d, s.name, [s.metrics_port, *control.values()], [s.metrics_port])]


def _gateway(d: Deployment, gateway: Service, replicas: int) -> list[dict]:
    """The gateway's Deployment (its settings from a ConfigMap, its keys from a Secret), autoscaled on CPU."""
    mounts = [{"name": "config", "mountPath": "/etc/rtxserve", "readOnly": True}]
    volumes: list[dict] = [{"name": "config", "configMap": {"name": "rtxserve-gateway"}}]
    if d.gateway.keys_file is not None:
        mounts.append({"name": "keys", "mountPath": str(Path(KEYS_IN_CONTAINER).parent), "readOnly": True})
        volumes.append({"name": "keys", "secret": {"secretName": "rtxserve-api-keys"}})
    if has_store_password(d):
        mounts.append({"name": "store", "mountPath": str(Path(STORE_PASSWORD_IN_CONTAINER).parent), "readOnly": True})
        volumes.append({"name": "store", "secret": {"secretName": STORE_SECRET}})
    # Promotions need one state every gateway reads; each pod here has its own until the shared store: off (docs).
    # On-demand models are decided by one pod for all, over the PostgreSQL the Batch API keeps (fleet/decider.py).
    env = gateway.env | {"RTXSERVE_PROMOTIONS": "false"}
    container = {"name": "gateway", "image": image(d, GATEWAY_IMAGE), "command": ["rtxserve"], "args": gateway.args,
                 "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
                 "ports": [{"name": "http", "containerPort": gateway.port}],
                 "readinessProbe": _probe("/readyz", gateway.port, 5), "livenessProbe": _probe("/healthz", gateway.port),
                 "resources": {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
                 "volumeMounts": mounts}
    container["securityContext"] = _security(NON_ROOT_UID)
    pod = _pod(d, "gateway", replicas, [container], volumes=volumes)
    autoscaler = [
        {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "gateway"},
         "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gateway"},
                  "minReplicas": replicas, "maxReplicas": max(10, replicas),
                  "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {
                      "type": "Utilization", "averageUtilization": 70}}}]}}]
    return [pod, _service(d, "gateway", "gateway", {"http": gateway.port}, "gateway"), _pdb(d, "gateway"), *autoscaler,
            _service_monitor(d, "gateway", "http")]


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
    container["securityContext"] = _security(999)  # the redis image's own user
    deployment = _pod(d, REDIS, 1, [container])
    policy = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": f"{REDIS}-private"},
              "spec": {"podSelector": {"matchLabels": _labels(REDIS, d)}, "policyTypes": ["Ingress"],
                       "ingress": [{"from": [{"podSelector": {"matchLabels": _labels("gateway", d)}}],
                                    "ports": [{"protocol": "TCP", "port": 6379}]}]}}
    return [deployment, _service(d, REDIS, REDIS, {"redis": 6379}), policy]


STORE = STORE_HOST  # the Files and Batch APIs' PostgreSQL, without store.url: its StatefulSet and Service
STORE_SECRET = "rtxserve-store"  # its password (store-password.txt, made at the first render and kept after)
POSTGRES_UID = 999  # the postgres image's own user


def has_store_password(d: Deployment) -> bool:
    """The gateway reads a store password: the StatefulSet's, or store.password_file's."""
    return not d.store.url or d.store.password_file is not None


def _store(d: Deployment) -> list[dict]:
    """One PostgreSQL every gateway pod shares for the Files and Batch APIs (store.url: a server of the site's
    instead): a StatefulSet of one, its data on a volume claim of its own that outlives the pod, its password from the
    Secret the gateway reads too, reached only from the gateway's pods."""
    password = str(Path("/run/secrets/postgres") / "password")
    container = {"name": "postgres", "image": POSTGRES_IMAGE,
                 "env": [{"name": "POSTGRES_USER", "value": "rtxserve"}, {"name": "POSTGRES_DB", "value": "rtxserve"},
                         {"name": "POSTGRES_PASSWORD_FILE", "value": password},
                         # a folder below the volume's root, which may hold lost+found (initdb wants an empty one)
                         {"name": "PGDATA", "value": "/var/lib/postgresql/data/pgdata"}],
                 "ports": [{"name": "postgres", "containerPort": 5432}],
                 "readinessProbe": {"exec": {"command": ["pg_isready", "-U", "rtxserve", "-d", "rtxserve",
                                                         "-h", "127.0.0.1"]}, "periodSeconds": 5, "timeoutSeconds": 5},
                 "livenessProbe": {"tcpSocket": {"port": 5432}, "periodSeconds": 10, "failureThreshold": 6},
                 "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                 "volumeMounts": [{"name": "data", "mountPath": "/var/lib/postgresql/data"},
                                  {"name": "password", "mountPath": str(Path(password).parent), "readOnly": True},
                                  {"name": "run", "mountPath": "/var/run/postgresql"}],
                 "securityContext": _security(POSTGRES_UID) | {"runAsGroup": POSTGRES_UID}}
    claim = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": d.store.storage}}}
    if d.kubernetes.storage_class:
        claim["storageClassName"] = d.kubernetes.storage_class
    statefulset = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": STORE, "labels": _labels(STORE, d)},
        "spec": {"serviceName": STORE, "replicas": 1, "selector": {"matchLabels": _labels(STORE, d)},
                 "template": {"metadata": {"labels": _labels(STORE, d)}, "spec": {
                     "automountServiceAccountToken": False, "containers": [container],
                     # the volume's files made the postgres user's group's; its socket folder, a writable emptyDir
                     "securityContext": {"fsGroup": POSTGRES_UID},
                     "volumes": [{"name": "password", "secret": {"secretName": STORE_SECRET, "defaultMode": 0o440}},
                                 {"name": "run", "emptyDir": {}}]}},
                 "volumeClaimTemplates": [{"metadata": {"name": "data", "labels": _labels(STORE, d)}, "spec": claim}]}}
    service = _service(d, STORE, STORE, {"postgres": 5432})
    service["spec"]["clusterIP"] = "None"  # headless: the StatefulSet's pod by name
    policy = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": f"{STORE}-private"},
              "spec": {"podSelector": {"matchLabels": _labels(STORE, d)}, "policyTypes": ["Ingress"],
                       "ingress": [{"from": [{"podSelector": {"matchLabels": _labels("gateway", d)}}],
                                    "ports": [{"protocol": "TCP", "port": 5432}]}]}}
    return [statefulset, service, policy]


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
                     "securityContext": _security(NON_ROOT_UID)}
        if name == "locust-master":
            container["ports"] = [{"name": "master", "containerPort": 5557}]
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": _labels(name, d)},
                "spec": {"suspend": True, "parallelism": parallelism, "completions": parallelism, "backoffLimit": 0,
                         "template": {"metadata": {"labels": _labels(name, d)},
                                      "spec": {"restartPolicy": "Never", "containers": [container]}}}}

    return [job("locust-master", master, 1), _service(d, "locust-master", "locust-master", {"master": 5557}),
            job("locust-worker", worker, workers)]


def kustomization(d: Deployment, files: list[str]) -> dict:
    k = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": f"rtxserve-{d.name}",
         "resources": ["namespace.yaml", *files],
         "labels": [{"pairs": {"app.kubernetes.io/managed-by": "rtxserve"}}],
         "configMapGenerator": [{"name": "rtxserve-gateway", "files": ["gateway.yaml=gateway-config.yaml"]}]}
    if d.gateway.keys_file is not None:
        k["secretGenerator"] = [{"name": "rtxserve-api-keys", "files": ["api_keys.json=keys.json"]},
                                {"name": "rtxserve-loadtest-key", "files": [f"api-key={LOADTEST_KEY_FILE}"]}]
    if has_store_password(d):
        k.setdefault("secretGenerator", []).append({"name": STORE_SECRET, "files": [f"password={STORE_PASSWORD_FILE}"]})
    return k


LOADTEST_KEY_FILE = "loadtest-key.txt"


def models_loader(d: Deployment) -> dict:
    """A pod that mounts the models claim read-write, to fill it with `kubectl cp` (the engines mount it
    read-only); deleted once the copy is done."""
    container = {"name": "loader", "image": image(d, GATEWAY_IMAGE), "command": ["sleep", "infinity"],
                 "volumeMounts": [{"name": "models", "mountPath": MODELS}], "securityContext": _security(NON_ROOT_UID)}
    # fsGroup: a volume its provisioner made root's is made writable by the loader's group (uid 1000's)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "rtxserve-models-loader", "labels": _labels("models", d)},
            "spec": {"automountServiceAccountToken": False, "containers": [container], "restartPolicy": "Never",
                     "securityContext": {"fsGroup": NON_ROOT_UID},
                     "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "rtxserve-models"}}]}}
