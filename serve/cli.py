"""`rtxserve serve triton|vllm|gateway`: run one server in the foreground until Ctrl-C / SIGTERM. (`rtxserve
serve up|status|down`, a whole box from its deployment file, are deploy's: deploy/box_cli.py.)"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import tempfile
from pathlib import Path

from core import contract
from core.envs import TRITON, VLLM, env_dir


def _triton(args) -> int:
    from .launcher import ServerProcess
    from .triton_server import TritonInstall, TritonNotFound, TritonOptions, triton_command

    try:
        install = (
            TritonInstall.from_binary(args.tritonserver, args.backend_directory)
            if args.tritonserver else TritonInstall.from_env(args.triton_env)
        )
        argv, env = triton_command(install, TritonOptions(
            repository=args.repository, http_port=args.http_port, grpc_port=args.grpc_port,
            metrics_port=args.metrics_port, address=args.address,
        ))
    except (TritonNotFound, FileNotFoundError) as exc:
        print(f"rtxserve serve triton: error: {exc}", file=sys.stderr)
        return 2
    server = ServerProcess("tritonserver", argv, env=env, log_path=args.log,
                           ready_url=f"http://{args.address}:{args.http_port}/v2/health/ready")
    print(f"starting tritonserver on {args.repository} (log: {args.log})", file=sys.stderr)
    return _run_foreground(server, "triton", args.start_timeout,
                           f"tritonserver ready: grpc {args.address}:{args.grpc_port}, http {args.address}:{args.http_port}, "
                           f"metrics {args.address}:{args.metrics_port}")


def _run_foreground(server, what: str, timeout_s: float, ready_message: str) -> int:
    """Start `server`, report readiness, then wait for it; SIGTERM and Ctrl-C stop it cleanly."""
    from .launcher import ServerStartError

    try:
        server.start(timeout_s=timeout_s)
    except ServerStartError as exc:
        print(f"rtxserve serve {what}: error: {exc}", file=sys.stderr)
        return 1
    print(ready_message, file=sys.stderr)
    # Forward only: the main thread's wait() returns once the server has drained and exited.
    signal.signal(signal.SIGTERM, lambda *_: server.signal(signal.SIGTERM))
    try:
        return server.wait()
    except KeyboardInterrupt:  # the server runs in its own session, so Ctrl-C reaches only us
        return server.stop() or 0


def _vllm(args) -> int:
    from .launcher import ServerProcess
    from .vllm_server import VLLMConfigError, VLLMOptions, vllm_command

    try:
        adapters = {}
        for spec in args.lora:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise VLLMConfigError(f"--lora {spec!r}: use NAME=PATH")
            adapters[name] = Path(path)
        opts = VLLMOptions(model=args.model, served_name=args.served_model_name or args.model.name, host=args.address,
                           port=args.port, max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib,
                           adapters=adapters, dtype=args.dtype, tool_call_parser=args.tool_call_parser,
                           chat_template=args.chat_template, max_images=args.max_images_per_prompt,
                           max_image_pixels=args.max_image_pixels, media_domains=args.allowed_media_domain,
                           extra_args=args.vllm_arg)
        argv, env = vllm_command(opts, args.vllm_env)
    except VLLMConfigError as exc:
        print(f"rtxserve serve vllm: error: {exc}", file=sys.stderr)
        return 2
    server = ServerProcess("vllm", argv, env=env, log_path=args.log, ready_url=f"http://{args.address}:{args.port}/v1/models")
    print(f"starting vLLM for {opts.served_name} (+{len(adapters)} LoRA adapter(s)); log: {args.log}", file=sys.stderr)
    return _run_foreground(server, "vllm", args.start_timeout,
                           f"vLLM ready: http://{args.address}:{args.port}/v1 serving {', '.join([opts.served_name, *adapters])}")


def _gateway(args) -> int:
    import uvicorn

    # Settings travel to the workers through the environment (each worker builds its own app).
    for flag, key in (("host", "HOST"), ("port", "PORT"), ("workers", "WORKERS"), ("triton_grpc_url", "TRITON_GRPC_URL"),
                      ("vllm_url", "VLLM_URL"), ("keys", "KEYS_FILE")):
        value = getattr(args, flag)
        if value is not None:
            os.environ[f"RTXSERVE_{key}"] = str(value)
    from .gateway.access.keys import KeyRing, KeysFileError
    from .gateway.settings import GatewaySettings

    try:
        settings = GatewaySettings()
        if settings.keys_file:
            KeyRing(settings.keys_file)  # a damaged keys file stops us here, in one line, not in every worker
        if settings.otlp_endpoint:
            import importlib.util

            if importlib.util.find_spec("opentelemetry.instrumentation.fastapi") is None:
                raise ValueError("otlp_endpoint is set but tracing is not installed: pip install 'rtxserve[otel]'")
    except KeysFileError as exc:
        print(f"rtxserve serve gateway: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # pydantic ValidationError or a bad config file
        print(f"rtxserve serve gateway: error: invalid settings: {exc}", file=sys.stderr)
        return 2
    if settings.keys_file is None:
        print(f"rtxserve serve gateway: no keys file: running open on {settings.host} (loopback only); "
              "make keys with `rtxserve keys create` and pass --keys to require them", file=sys.stderr)
    if settings.workers > 1 and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="rtxserve-metrics-")
    if settings.workers > 1 and not settings.rollout_file:  # one promotion state for all workers (until a restart)
        os.environ["RTXSERVE_ROLLOUT_FILE"] = str(Path(tempfile.mkdtemp(prefix="rtxserve-rollout-")) / "rollout.json")
    if settings.workers > 1 and not settings.capacity_file:  # one recorded capacity for all workers
        os.environ["RTXSERVE_CAPACITY_FILE"] = str(Path(tempfile.mkdtemp(prefix="rtxserve-capacity-")) / "capacity.json")
    if settings.workers > 1 and settings.on_demand and not settings.residency_store_url:  # one decides what is loaded
        path = Path(tempfile.mkdtemp(prefix="rtxserve-residency-")) / "residency.sqlite"
        os.environ["RTXSERVE_RESIDENCY_STORE_URL"] = f"sqlite:///{path}"
    if settings.workers > 1 and not settings.rate_limit_storage:  # quotas counted once for all workers
        path = Path(tempfile.mkdtemp(prefix="rtxserve-quotas-")) / "quotas.sqlite"
        os.environ["RTXSERVE_RATE_LIMIT_STORAGE"] = f"async+sqlite://{path}"
    os.environ["RTXSERVE_LOG_LEVEL"] = args.log_level
    # one start for all the workers: a worker that starts late, or again after a crash, is not a restart of the gateway
    # (serve/gateway/fleet/rollout/table.py: a restart ends the promotions it finds)
    os.environ["RTXSERVE_GATEWAY_BOOT"] = secrets.token_hex(8)
    uvicorn.run(  # log_config=None: the app's JSON logging (serve/gateway/edge/logs.py) renders uvicorn's records too
        "serve.gateway.app:main_app", factory=True, host=settings.host, port=settings.port,
        workers=settings.workers, log_level=args.log_level, log_config=None, access_log=False,
        timeout_graceful_shutdown=30,
    )
    return 0


def add_commands(sub) -> None:
    """`triton`, `vllm` and `gateway`: one server in the foreground (`rtxserve serve` adds deploy's up / status /
    down beside them)."""
    t = sub.add_parser("triton", help="the real tritonserver on a model repository")
    t.add_argument("--repository", type=Path, default=Path(os.environ.get("RTXSERVE_REPOSITORY", "model_repository")))
    t.add_argument("--triton-env", type=Path, default=env_dir(TRITON), help="environment holding nvidia-pytriton")
    t.add_argument("--tritonserver", type=Path, help="use this tritonserver binary instead (e.g. in the NGC image)")
    t.add_argument("--backend-directory", type=Path, default=Path("/opt/tritonserver/backends"))
    t.add_argument("--address", default="127.0.0.1", help="bind address (default loopback: clients use the gateway)")
    t.add_argument("--http-port", type=int, default=contract.TRITON_HTTP_PORT)
    t.add_argument("--grpc-port", type=int, default=contract.TRITON_GRPC_PORT)
    t.add_argument("--metrics-port", type=int, default=contract.TRITON_METRICS_PORT)
    t.add_argument("--log", type=Path, default=Path(".rtxserve/logs/tritonserver.log"))
    t.add_argument("--start-timeout", type=float, default=300.0)
    t.set_defaults(run=_triton)
    v = sub.add_parser("vllm", help="the real vLLM OpenAI server for a model and its LoRA adapters")
    v.add_argument("model", type=Path, help="model folder (a full fine-tune or a base model)")
    v.add_argument("--served-model-name", help="name clients use (default: the folder name)")
    v.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", help="a LoRA adapter to serve (repeatable)")
    v.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    v.add_argument("--kv-cache-gib", type=float, default=float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", contract.CPU_KV_CACHE_GIB)),
                   help="KV cache on CPU, GiB (VLLM_CPU_KVCACHE_SPACE)")
    v.add_argument("--dtype", default="auto")
    v.add_argument("--tool-call-parser", help="vLLM's parser for the model's tool-call format (hermes, llama3_json, "
                   "mistral, ...): enables tool_choice 'auto' (tool_choice 'required' and named tools work without it)")
    v.add_argument("--chat-template", type=Path, help="a Jinja chat template file (e.g. one that renders tools)")
    v.add_argument("--max-images-per-prompt", type=int, help="vision-language models: images a prompt may hold "
                   "(vLLM's --limit-mm-per-prompt; 0 serves text only)")
    v.add_argument("--max-image-pixels", type=int, help="vision-language models: pixels an image is resized to at most "
                   "before it becomes tokens (the processor's max_pixels, Qwen2-VL style)")
    v.add_argument("--allowed-media-domain", action="append", default=[], metavar="HOST",
                   help="a host vLLM may fetch image URLs from (repeatable; the gateway's chat_image_domains too)")
    v.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="pass an option through to vLLM as is (repeatable), e.g. --vllm-arg=--max-num-seqs=64")
    v.add_argument("--address", default="127.0.0.1")
    v.add_argument("--port", type=int, default=contract.VLLM_PORT)
    v.add_argument("--vllm-env", type=Path, default=env_dir(VLLM))
    v.add_argument("--log", type=Path, default=Path(".rtxserve/logs/vllm.log"))
    v.add_argument("--start-timeout", type=float, default=600.0)
    v.set_defaults(run=_vllm)
    g = sub.add_parser("gateway", help="the HTTP gateway (settings also from RTXSERVE_* env / RTXSERVE_CONFIG YAML)")
    g.add_argument("--host")
    g.add_argument("--port", type=int)
    g.add_argument("--workers", type=int)
    g.add_argument("--triton-grpc-url", dest="triton_grpc_url", help="Triton gRPC address ('' for none)")
    g.add_argument("--vllm-url", dest="vllm_url", help="vLLM OpenAI server base URL")
    g.add_argument("--keys", help="API keys file (RTXSERVE_KEYS_FILE); required to bind beyond loopback")
    g.add_argument("--log-level", default="info")
    g.set_defaults(run=_gateway)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rtxserve serve", description="Run a server in the foreground.")
    add_commands(parser.add_subparsers(dest="server", required=True))
    args = parser.parse_args(argv)
    return args.run(args)
