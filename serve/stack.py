"""Start Triton and the gateway together on free loopback ports (the demo and the tests use it)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .launcher import ServerProcess, crash_restarts, free_port
from .triton_server import DEFAULT_ENV, TritonInstall, TritonOptions, triton_command


@dataclass
class Stack:
    triton: ServerProcess
    gateway: ServerProcess
    gateway_url: str
    triton_http_url: str
    triton_grpc_url: str
    triton_metrics_url: str = ""
    vllm: ServerProcess | None = None
    vllm_url: str = ""
    repository: Path | None = None  # the Triton repository it serves (where each entry's reference set lies)

    def stop(self) -> None:
        # Gateway first: it stops taking requests before its backends go away.
        self.gateway.stop()
        if self.vllm is not None:
            self.vllm.stop()
        self.triton.stop()

    def __enter__(self) -> "Stack":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_triton(repository: Path, log_dir: Path, triton_env: Path = DEFAULT_ENV, timeout_s: float = 300,
                 extra_args: tuple[str, ...] = (), load_models: list[str] | None = None) -> tuple[ServerProcess, TritonOptions]:
    """tritonserver on `repository`: every entry loaded, or (`load_models`) explicit model control with those loaded."""
    opts = TritonOptions(repository=repository, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                         load_models=load_models, extra_args=list(extra_args))
    argv, env = triton_command(TritonInstall.from_env(triton_env), opts)
    # started again where it crashes as it loads (triton-inference-server/server#8882), as a box's restart policy does
    for attempt in crash_restarts("tritonserver", log=print):
        with attempt:
            server = ServerProcess("tritonserver", argv, env=env, log_path=log_dir / "tritonserver.log",
                                   ready_url=f"http://127.0.0.1:{opts.http_port}/v2/health/ready")
            server.start(timeout_s)
    return server, opts


def start_vllm(opts, log_dir: Path, vllm_env: Path | None = None, timeout_s: float = 300,
               env: dict[str, str] | None = None) -> tuple[ServerProcess, str]:
    """The real vLLM OpenAI server for `opts` (a serve.vllm_server.VLLMOptions; its port is replaced by a free one), with `env`
    over its environment."""
    from .vllm_server import DEFAULT_ENV as VLLM_ENV, vllm_command

    opts.port = free_port()
    argv, command_env = vllm_command(opts, vllm_env or VLLM_ENV)
    env = command_env | (env or {})
    url = f"http://127.0.0.1:{opts.port}"
    server = ServerProcess("vllm", argv, env=env, log_path=log_dir / "vllm.log", ready_url=f"{url}/v1/models")
    return server.start(timeout_s), url


def start_gateway(triton_grpc_url: str, log_dir: Path, *, vllm_url: str = "", workers: int = 1, extra_env: dict | None = None,
                  timeout_s: float = 180, wait_for: str = "/readyz", port: int | None = None) -> tuple[ServerProcess, str]:
    """The gateway as its own process (`rtxserve serve gateway`) on `port` (default: a free one); by default started
    once its models are ready (`wait_for="/healthz"`: once it is live, e.g. to test it with a dead backend)."""
    port = port or free_port()
    env = {**os.environ, "RTXSERVE_TRITON_GRPC_URL": triton_grpc_url, "RTXSERVE_VLLM_URL": vllm_url, "RTXSERVE_PORT": str(port),
           "RTXSERVE_WORKERS": str(workers), **(extra_env or {})}
    argv = [sys.executable, "-m", "rtxserve.cli", "serve", "gateway", "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    server = ServerProcess("gateway", argv, env=env, log_path=log_dir / "gateway.log", ready_url=f"{url}{wait_for}")
    return server.start(timeout_s), url


def start_stack(repository: Path, log_dir: Path, *, triton_env: Path = DEFAULT_ENV, gateway_workers: int = 1,
                vllm_opts=None, timeout_s: float = 300) -> Stack:
    """Triton on `repository` (ready within `timeout_s`), vLLM too when `vllm_opts` (serve.vllm_server.VLLMOptions) is
    given, and the gateway."""
    triton, opts = start_triton(repository, log_dir, triton_env, timeout_s=timeout_s)
    grpc_url = f"127.0.0.1:{opts.grpc_port}"
    vllm, vllm_url = None, ""
    try:
        if vllm_opts is not None:
            vllm, vllm_url = start_vllm(vllm_opts, log_dir)
        gateway, url = start_gateway(grpc_url, log_dir, workers=gateway_workers, vllm_url=vllm_url)
    except BaseException:
        if vllm is not None:
            vllm.stop()
        triton.stop()
        raise
    return Stack(triton, gateway, url, f"http://127.0.0.1:{opts.http_port}", grpc_url,
                 f"http://127.0.0.1:{opts.metrics_port}/metrics", vllm, vllm_url, repository)
