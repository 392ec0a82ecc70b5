"""What a gateway is measured against (B1, B1s): the floor, nginx as a plain reverse proxy in front of a backend, with
no buffering and kept-alive upstream connections, one worker process (as the gateway's one worker); and, for streams,
a peer, LiteLLM's proxy (one worker) passing OpenAI completions on to vLLM. `make setup-bench` installs both: Debian's
`nginx` package, and LiteLLM in an environment of its own (.envs/litellm)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LITELLM = ROOT / ".envs" / "litellm" / "bin" / "litellm"

CONFIG = """worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    upstream backend {{
        server {upstream};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        client_max_body_size 64m;
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


PATHS = ("direct", "proxy", "gateway")  # what B1 and B1s compare: the backend itself, the floor, ours


def path_table(levels: list[dict], level_header: str, columns: list[tuple[str, str]]) -> list[str]:
    """A Markdown table with a row per level and path of each level's medians: `columns` (header, key)."""
    lines = [f"| {level_header} | path | " + " | ".join(h for h, _ in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for level in levels:
        for path, m in level["medians"].items():  # PATHS, and any a benchmark adds
            lines.append(f"| {level['concurrency']} | {path} | " + " | ".join(str(m.get(k, "")) for _, k in columns) + " |")
    return lines


def nginx() -> str | None:
    return shutil.which("nginx", path=f"{os.environ.get('PATH', '')}:/usr/sbin")


def nginx_version() -> str:
    import subprocess

    binary = nginx()
    if binary is None:
        return "absent"
    return subprocess.run([binary, "-v"], capture_output=True, text=True).stderr.strip().removeprefix("nginx version: ")


@contextlib.contextmanager
def running(server, port: int, timeout_s: float) -> Iterator[tuple[str, int]]:
    """`server` (serve.launcher.ServerProcess, listening on `port`) started: (its URL, its pid), stopped on exit."""
    server.start(timeout_s)
    try:
        yield f"http://127.0.0.1:{port}", server.process.pid
    finally:
        server.stop()


@contextlib.contextmanager
def plain_proxy(upstream: str, work: Path, ready_path: str) -> Iterator[tuple[str, int]]:
    """nginx proxying to `upstream` (host:port): (its URL, its master's pid), stopped on exit. It counts as
    started once `ready_path` answers 200 through it."""
    from serve.launcher import ServerProcess, free_port

    binary = nginx()
    if binary is None:
        raise RuntimeError("no nginx on this machine: `make setup-bench` installs Debian's package")
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    (work / "nginx.conf").write_text(CONFIG.format(prefix=work, upstream=upstream, port=port))
    server = ServerProcess("nginx", [binary, "-p", str(work), "-c", str(work / "nginx.conf"), "-g", "daemon off;"],
                           log_path=work / "nginx.log", ready_url=f"http://127.0.0.1:{port}{ready_path}")
    with running(server, port, 30) as started:
        yield started


LITELLM_CONFIG = """model_list:
  - model_name: {served}
    litellm_params:
      model: text-completion-openai/{served}
      api_base: {upstream}/v1
      api_key: none
"""


def litellm_version() -> str:
    import subprocess

    if not LITELLM.exists():
        return "absent"
    python = LITELLM.parent / "python"
    return subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
                          capture_output=True, text=True).stdout.strip()


@contextlib.contextmanager
def litellm_proxy(upstream: str, served: str, work: Path) -> Iterator[tuple[str, int]]:
    """LiteLLM's proxy (`litellm --config`, one worker) sending `served`'s completions to `upstream` (a vLLM URL) as
    its `text-completion-openai/` provider passes them on: (its URL, its pid), stopped on exit. Like the gateway and
    nginx here it checks no key, and it reads its model cost map from its own package rather than the network."""
    from serve.launcher import ServerProcess, free_port

    if not LITELLM.exists():
        raise RuntimeError(f"no LiteLLM at {LITELLM}: `make setup-bench` installs it")
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    (work / "litellm.yaml").write_text(LITELLM_CONFIG.format(served=served, upstream=upstream.rstrip("/")))
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
           "LITELLM_LOG": "ERROR"}
    server = ServerProcess("litellm", [str(LITELLM), "--config", str(work / "litellm.yaml"), "--host", "127.0.0.1",
                                       "--port", str(port), "--num_workers", "1"], env=env, log_path=work / "litellm.log",
                           ready_url=f"http://127.0.0.1:{port}/health/liveliness")
    with running(server, port, 120) as started:
        yield started
