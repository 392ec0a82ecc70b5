"""A deployment as the servers it runs: one Triton for every encoder, one vLLM engine per LLM replica, and
the gateway wired to all of them, each as the options its program takes.

This is the pure step: it reads no file but the adapters' configs (their ranks size vLLM's LoRA slots).
A `Layout` says where the servers run: on this host (`serve up`: loopback, the artifacts where they are)
or in containers (`deploy render`: every port on 0.0.0.0 inside its container, services reached by name,
artifacts under /models). The same services are then started here, or written as compose services,
systemd units or Kubernetes Deployments.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .plan import Plan, sleep_level
from .spec import Deployment, DeploymentError, LLMModel, control_port, engine_name


@dataclass
class Service:
    name: str  # "triton", "vllm-<model>-<replica>", "gateway"
    kind: str  # "triton" | "vllm" | "gateway"
    args: list[str]  # the program's options (the program itself depends on where it runs)
    port: int  # the port its health answers on
    ready_path: str
    live_path: str
    metrics_port: int
    env: dict[str, str] = field(default_factory=dict)
    gpu: int | None = None  # the GPU a vLLM engine runs on
    models: list[str] = field(default_factory=list)  # what it serves
    control_port: int | None = None  # an on-demand CPU engine: where serve/engine_control.py (which starts it) listens
    sleep_level: int | None = None  # an on-demand GPU engine: put to sleep at this level once it has started


def put_to_sleep(s: Service, host: str) -> list[str]:
    """The command that waits for an on-demand GPU engine to be ready, then puts it to sleep (serve/wait_ready.py):
    vLLM cannot start asleep, and the next engine on its card must find its share free."""
    return ["python", "-m", "serve.wait_ready", f"http://{host}:{s.port}{s.ready_path}", "--timeout", "600",
            "--then-sleep", str(s.sleep_level)]


def under_control(s: Service, python: str, log: str, engine: list[str], host: str = "127.0.0.1") -> list[str]:
    """An on-demand CPU engine's command: serve/engine_control.py owning the `engine` command, which it starts on the
    first request and stops to free the memory (vLLM's sleep API, answered for an engine that cannot sleep on a CPU)."""
    return [python, "-m", "serve.engine_control", "--host", host, "--port", str(s.control_port),
            "--engine-url", f"http://127.0.0.1:{s.metrics_port}", "--log", log, "--", *engine]


def container_command(s: Service) -> list[str]:
    """A vLLM engine's command in its container or pod: `vllm serve`, under its engine control where it is an on-demand
    CPU engine (listening beyond loopback: the gateway reaches it from its own container; the engine's log in /tmp)."""
    engine = ["vllm", "serve"]
    return under_control(s, "python", "/tmp/engine.log", engine, host="0.0.0.0") if s.control_port is not None else engine


@dataclass
class Layout:
    bind: str = "127.0.0.1"  # the address servers listen on
    host_of: Callable[[str], str] = lambda service: "127.0.0.1"  # how the gateway reaches a service
    path: Callable[[Path], str] = lambda p: str(Path(p).resolve())  # where a server sees an artifact
    repository: str = "model_repository"  # the assembled Triton repository, as Triton sees it
    gateway_config: str = "gateway.yaml"  # the gateway's settings file, as the gateway sees it
    gateway_host: str | None = None  # where the gateway listens (default: the deployment's gateway.host)
    batch_dir: str | None = None  # where the gateway keeps the Batch API's files and state (None: that API is off)
    rollout_file: str | None = None  # where the gateway keeps what promotions changed (None: its memory only)
    capacity_file: str | None = None  # where it keeps each model's confirmed capacity (None: its memory only)
    restarts_file: str | None = None  # where a `serve up` box's keeper counts its restarts (the gateway reports them)
    store_password: str | None = None  # where the gateway reads the store's password, if any
    store_url: str | None = None  # the box's own PostgreSQL (store.server) as the gateway reaches it
    # the models a promotion on this box retired (`serve up` reads them from the rollout file): not loaded at start
    retired: frozenset[str] = frozenset()


def vllm_options(d: Deployment, p: Plan, m: LLMModel, port: int, bind: str, retired: frozenset[str] = frozenset()):
    from serve.vllm_server import VLLMOptions

    extra = ["--max-num-seqs", str(m.max_num_seqs)]
    if m.max_num_batched_tokens:
        extra += ["--max-num-batched-tokens", str(m.max_num_batched_tokens)]
    if d.on_gpu:
        extra += ["--gpu-memory-utilization", f"{p.gpu_memory_utilization[m.name]:.2f}"]
    if m.kv_cache_dtype != "auto":  # vLLM's CPU attention keeps an fp8 cache too
        extra += ["--kv-cache-dtype", m.kv_cache_dtype]
    if d.on_gpu and m.resident == "on-demand":  # sleeps between uses (its /sleep and /wake_up: VLLM_SERVER_DEV_MODE)
        extra += ["--enable-sleep-mode"]
    return VLLMOptions(model=d.resolve(m.path), served_name=m.name, host=bind, port=port, max_model_len=m.max_model_len,
                       kv_cache_gib=m.kv_cache_gib,
                       adapters={n: d.resolve(a) for n, a in m.adapters.items() if n not in retired},
                       dtype=m.dtype, tool_call_parser=m.tool_call_parser,
                       chat_template=d.resolve(m.chat_template) if m.chat_template else None,
                       max_images=m.max_images, max_image_pixels=m.max_image_pixels,
                       # the image hosts the gateway lets through are the ones vLLM may fetch from
                       media_domains=list(d.gateway.settings.get("chat_image_domains") or []),
                       extra_args=[*extra, *m.vllm_args])


def gateway_settings(d: Deployment, layout: Layout, p: Plan) -> dict:
    """The gateway's settings file (RTXSERVE_CONFIG): the deployment's wiring (the on-demand entries with what the plan
    gives each, and their room), then its own settings."""
    urls = {(m.name, r): f"http://{layout.host_of(engine_name(m.name, r))}:{port}" for m, r, port in d.engines()}
    settings = {"host": layout.gateway_host or d.gateway.host, "port": d.ports.gateway,
                "workers": d.gateway.workers,
                "triton_grpc_url": f"{layout.host_of('triton')}:{d.ports.triton_grpc}" if d.encoders else "",
                "vllm_url": ",".join(urls.values()),
                # /readyz waits for every model the deployment names, adapters included, but those loaded on demand
                "required_models": [n for m in d.models if m.resident == "always"
                                    for n in (m.name, *getattr(m, "adapters", {}))]}
    if d.on_demand:
        settings["on_demand"] = {m.name: {"task": p.estimates[m.name].task, "gib": round(p.on_demand[m.name], 3),
                                          "idle_unload_s": m.idle_unload_s} for m in d.on_demand}
        settings["swap_room_gib"] = round(p.swap_room_gib, 3)
        for m, r, port in d.engines():  # an on-demand engine wakes through its sleep API: on a GPU, vLLM's own (its
            # port); on a CPU, engine_control's, which stops and starts it
            if m.resident == "on-demand":
                settings["on_demand"][m.name] |= {"engine": urls[m.name, r], "adapters": list(m.adapters)}
                settings.setdefault("engine_control", {})[urls[m.name, r]] = urls[m.name, r] if d.on_gpu else \
                    f"http://{layout.host_of(engine_name(m.name, r))}:{control_port(port)}"
    cached = {m.name: m.response_cache_mb for m in d.encoders if m.response_cache_mb}
    if cached:
        settings["response_cache_mb"] = cached
    settings["model_concurrency"] = model_gates(d, p)
    if d.gateway.keys_file is not None:
        settings["keys_file"] = layout.path(d.resolve(d.gateway.keys_file))
    if d.store.url or layout.store_url:  # one PostgreSQL every gateway shares, its password a secret of the target's
        settings["batch_store_url"] = d.store.url or layout.store_url
        if layout.store_password:
            settings["batch_store_password_file"] = layout.store_password
        if layout.store_url and d.on_demand:  # the box's own, which its workers alone share: one of them decides
            settings["residency_store_url"] = layout.store_url
    elif layout.batch_dir:
        settings["batch_dir"] = layout.batch_dir
    if layout.rollout_file:
        settings["rollout_file"] = layout.rollout_file
    if layout.capacity_file:
        settings["capacity_file"] = layout.capacity_file
    if layout.restarts_file:
        settings["restarts_file"] = layout.restarts_file
    own = d.gateway.settings
    return settings | own | {"model_concurrency": settings["model_concurrency"] | own.get("model_concurrency", {})}


def model_gates(d: Deployment, p: Plan) -> dict[str, int]:
    """Each model's requests in flight per gateway worker, as the plan runs them at most (the gate of
    `model_concurrency`): an engine's max_num_seqs on each replica, a Triton entry's instances x max batch size on
    each device; shared by the workers. More wait at the gateway, where people go before a batch (admission.py),
    rather than in the backend's own first-come queue."""
    from serve.entry_config import read_batching

    workers = d.gateway.workers
    gates = {m.name: m.max_num_seqs * m.replicas for m in d.vllm_models}
    for m in d.encoders:
        source = d.resolve(m.path)
        batch = m.max_batch_size or read_batching(source.parent, source.name).max_batch_size or 1
        gates[m.name] = p.instances[m.name] * max(1, len(p.devices) if p.on_gpu else 1) * batch
    return {name: max(1, -(-n // workers)) for name, n in gates.items()}


def build_services(d: Deployment, p: Plan, layout: Layout = Layout(), *, vllm_env: Path | None = None) -> list[Service]:
    """Triton (if any encoder), the vLLM engines, then the gateway: the order they start in. Each engine's
    model and adapters are checked (serve.vllm_server.check_vllm: their configs and shapes) on the way; `vllm_env` is
    the vLLM install that will run them on this host (None: elsewhere, e.g. a container)."""
    from serve.triton_server import TritonOptions, triton_args
    from serve.vllm_server import (VLLMConfigError, box_layout_env, check_vllm, runtime_lora_env, serving_dtype,
                                   vllm_args)

    services = []
    if d.encoders:
        from .repository import response_cache_args

        opts = TritonOptions(repository=Path(layout.repository), http_port=d.ports.triton_http, grpc_port=d.ports.triton_grpc,
                             metrics_port=d.ports.triton_metrics, address=layout.bind, extra_args=response_cache_args(d),
                             # explicit model control where some are loaded on demand, or retired by a promotion
                             load_models=[m.name for m in d.encoders if m.resident == "always" and m.name not in
                                          layout.retired] if d.on_demand or layout.retired else None)
        services.append(Service("triton", "triton", triton_args(opts, layout.repository), d.ports.triton_http,
                                "/v2/health/ready", "/v2/health/live", d.ports.triton_metrics,
                                models=[m.name for m in d.encoders]))
    for m, replica, port in d.engines():
        opts = vllm_options(d, p, m, port, layout.bind, layout.retired)
        try:
            adapters = check_vllm(opts, env_dir=vllm_env)
        except VLLMConfigError as exc:
            raise DeploymentError(f"models.{m.name}: {exc}") from None
        dtype = serving_dtype(opts, vllm_env) if vllm_env is not None else serving_dtype(opts, cpu=not d.on_gpu)
        env = ({"VLLM_CPU_KVCACHE_SPACE": f"{m.kv_cache_gib:g}"} if not d.on_gpu else {}) | runtime_lora_env(adapters)
        if m.name in p.cpu_binds:
            env["VLLM_CPU_OMP_THREADS_BIND"] = p.cpu_binds[m.name]
        if not d.on_gpu:
            env |= box_layout_env(len(os.sched_getaffinity(0)), m.name in p.cpu_binds)
        if d.on_gpu and m.resident == "on-demand":
            env["VLLM_SERVER_DEV_MODE"] = "1"  # mounts /sleep, /wake_up and /is_sleeping
        control = control_port(port) if m.resident == "on-demand" and not d.on_gpu else None
        # an on-demand engine answers ready through its control, asleep: it starts on its first request
        services.append(Service(engine_name(m.name, replica), "vllm", vllm_args(opts, adapters, dtype, paths=layout.path),
                                control or port, "/health", "/health", port, env=env | {"HF_HUB_OFFLINE": "1"},
                                gpu=p.engines[m.name][replica] if d.on_gpu else None, models=[m.name, *m.adapters],
                                control_port=control, sleep_level=sleep_level(d)
                                if d.on_gpu and m.resident == "on-demand" else None))
    services.append(Service("gateway", "gateway", ["serve", "gateway", "--log-level", "info"], d.ports.gateway,
                            "/readyz", "/healthz", d.ports.gateway, env={"RTXSERVE_CONFIG": layout.gateway_config}))
    return services
