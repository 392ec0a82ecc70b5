"""systemd units for a bare-metal box: one per server, from an install at a prefix (a GPU box's Triton from NGC's image
through Docker, or its own tritonserver), and a target for them all."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from core.envs import TRITON, VLLM, env_under

from .services import Service, under_control
from .spec import Deployment


@dataclass(frozen=True)
class TritonContainer:
    """A GPU box's Triton run by its unit through Docker: `image` (NGC's with the python steps' packages, built on the
    box from the rendered triton-image/), the staged `models` folder mounted at the same path, so that the units'
    host paths hold inside; TensorRT plans built first by `tensorrt_image`, Triton's matching release."""

    image: str
    models: Path
    tensorrt_image: str


def _docker_run(name: str, image: str, mounts: list[str], argv: list[str]) -> list[str]:
    """`docker run` in the foreground, as the unit's main process: the host's network (the units' ports), its GPUs,
    and a /dev/shm of its own (what a killed server leaves there goes with the container)."""
    volumes = [a for m in mounts for a in ("-v", m)]
    return ["/usr/bin/docker", "run", "--rm", "--name", name, "--gpus", "all", "--network", "host", "--shm-size", "2g",
            "--ulimit", "memlock=-1", "--ulimit", "stack=67108864", *volumes, image, *argv]


def _triton_command(d: Deployment, s: Service, prefix: Path, tritonserver: Path | None, backend_directory: Path | None,
                    container: TritonContainer | None) -> tuple[list[str], dict[str, str]]:
    from serve import triton_server

    if container is not None:
        models = str(container.models)
        return _docker_run(f"rtxserve-{d.name}-triton", container.image, [f"{models}:{models}:ro"],
                           ["tritonserver", *s.args]), {"PATH": "/usr/bin:/bin"}
    install = (triton_server.TritonInstall(Path(tritonserver), Path(backend_directory or "/opt/tritonserver/backends"))
               if tritonserver else triton_server.TritonInstall.at(env_under(prefix, TRITON), "python%d.%d" % sys.version_info[:2]))
    return triton_server.install_argv(install, s.args), triton_server.install_env(install, base={"PATH": "/usr/bin:/bin"})


def _build_lines(s: Service, build_engines: str, container: TritonContainer | None) -> list[str]:
    """TensorRT plans built before Triton starts: in TensorRT's image beside Triton's container, or with the box's
    TensorRT (trtexec where its packages put it)."""
    repository = next(a.split("=", 1)[1] for a in s.args if a.startswith("--model-repository="))
    if container is not None:
        build = _docker_run(f"rtxserve-build-engines-{s.name}", container.tensorrt_image,
                            [f"{repository}:{repository}", f"{build_engines}:{build_engines}:ro"], ["sh", build_engines])
        return [f"ExecStartPre={' '.join(_quote(a) for a in build)}"]
    return [f"ExecStartPre=/usr/bin/env PATH=/usr/src/tensorrt/bin:/usr/bin:/bin /bin/sh {_quote(build_engines)}",
            f"ReadWritePaths={_quote(repository)}"]


def credential(d: Deployment, service: str, name: str) -> str:
    """Where the unit of `service` reads its credential `name` (LoadCredential=): its own folder under /run, which
    only it can read, whatever the source file's owner and mode."""
    return f"/run/credentials/rtxserve-{d.name}-{service}.service/{name}"


def _command(d: Deployment, s: Service, prefix: Path, tritonserver: Path | None, backend_directory: Path | None,
             container: TritonContainer | None) -> tuple[list[str], dict[str, str]]:
    """What the unit of `s` runs and its environment, from the install at `prefix` (a GPU engine on its GPU by
    nvidia-smi's index; an on-demand CPU engine under its control), caches in systemd's directories for the user."""
    from serve import vllm_server

    if s.kind == "triton":
        argv, env = _triton_command(d, s, prefix, tritonserver, backend_directory, container)
    elif s.kind == "vllm":
        argv = vllm_server.install_argv(env_under(prefix, VLLM), s.args)
        env = vllm_server.install_env(env_under(prefix, VLLM), base={"PATH": "/usr/bin:/bin"}) | s.env
        if s.control_port is not None:  # on demand on a CPU: its control starts it at the first request
            argv = under_control(s, str(prefix / ".venv" / "bin" / "python"),
                                 f"/var/log/rtxserve/{d.name}-{s.name}-engine.log", argv)
        if s.gpu is not None:  # nvidia-smi's index (the plan's): CUDA counts fastest first unless told otherwise
            env |= {"CUDA_VISIBLE_DEVICES": str(s.gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    else:
        argv, env = [str(prefix / ".venv" / "bin" / "rtxserve"), *s.args], dict(s.env)
    # caches (vLLM's compiled kernels, the python backend's) go to directories systemd makes for the user
    return argv, env | {"HOME": "/var/lib/rtxserve", "XDG_CACHE_HOME": "/var/cache/rtxserve"}


def _unit_section(d: Deployment, s: Service, services: list[Service], target: str, docker: bool,
                  store: bool = False) -> list[str]:
    """The [Unit] section of `s`'s unit: part of the box's `target`, after (and wanting) the units it needs up first
    (with `store`, the box's own store too)."""
    engines = [f"rtxserve-{d.name}-{e.name}.service" for e in services if e.kind != "gateway"]
    engines += [f"rtxserve-{d.name}-store.service"] if store else []
    triton_units = [f"rtxserve-{d.name}-{e.name}.service" for e in services if e.kind == "triton"]
    # The gateway starts once every engine answers ready; a vLLM engine once Triton has loaded (it takes its
    # planned share of the memory free when it starts, and refuses to start on less).
    needs = engines if s.kind == "gateway" else triton_units + [  # and the engines before it on its card
        f"rtxserve-{d.name}-{e.name}.service" for e in services[:services.index(s)]
        if e.kind == "vllm" and e.gpu is not None and e.gpu == s.gpu] if s.kind == "vllm" else []
    # Triton in a container needs the Docker Engine up first, after a reboot too (units start together otherwise)
    after = ["network-online.target", *(["docker.service"] if docker else []), *needs]
    lines = ["[Unit]", f"Description=rtxserve {d.name}: {s.name} ({s.kind})",
             f"After={' '.join(after)}", "Wants=network-online.target", f"PartOf={target}"]
    if docker:
        lines.append("Requires=docker.service")
    if needs:  # Wants, not Requires: with Requires, systemd restarts the gateway whenever an engine's unit restarts
        # (booted, a Triton killed and started again by Restart= took the gateway and every stream on it down too);
        # the gateway rides out an engine's absence itself (its breakers, /readyz), and vLLM runs on without Triton
        lines.append(f"Wants={' '.join(needs)}")
    return lines


def store_unit(d: Deployment, target: str, start_store: str, store_password: str) -> str:
    """The box's own PostgreSQL (store.server): Debian's postgresql package (installed on the box) run as its
    `postgres` user by `start_store` (deploy/store/start-store.sh), its cluster in a state directory of its own, made at
    the first start with the password it reads as its credential, on 127.0.0.1 at ports.store."""
    state = f"rtxserve-{d.name}-store"
    env = {"PGDATA": f"/var/lib/{state}/data", "STORE_PASSWORD_FILE": "%d/store-password", "STORE_LISTEN": "127.0.0.1",
           "STORE_PORT": str(d.ports.store)}
    return "\n".join([
        "[Unit]", f"Description=rtxserve {d.name}: the store every gateway worker shares (PostgreSQL)",
        "After=network-online.target", "Wants=network-online.target", f"PartOf={target}", "",
        "[Service]", "Type=simple", "User=postgres", "Group=postgres", f"StateDirectory={state}",
        f"LoadCredential=store-password:{store_password}", *(f'Environment="{k}={v}"' for k, v in env.items()),
        f"ExecStart=/bin/sh {_quote(start_store)}", f"ExecStartPost=/bin/sh {_quote(start_store)} wait",
        "TimeoutStartSec=180", "KillMode=mixed", "KillSignal=SIGINT", "TimeoutStopSec=60", "Restart=on-failure",
        "RestartSec=5", "NoNewPrivileges=yes", "PrivateTmp=yes", "ProtectSystem=strict", "ProtectHome=yes",
        "", "[Install]", f"WantedBy={target}", ""])


def systemd_units(d: Deployment, services: list[Service], prefix: Path, tritonserver: Path | None = None,
                  backend_directory: Path | None = None, build_engines: str | None = None,
                  triton_container: TritonContainer | None = None, store_password: str | None = None,
                  start_store: str | None = None) -> dict[str, str]:
    """One unit per server, run as the `rtxserve` user from an install at `prefix` (what the bundle's install.sh
    makes), and a target that starts them together. A GPU box's Triton runs from `tritonserver` (the box's own,
    NGC's layout) or else through Docker (`triton_container`); the gateway reads `store_password` (a file on the box)
    as its credential store-password; with `start_store`, the box runs that store itself (store_unit)."""
    units = {}
    target = f"rtxserve-{d.name}.target"
    if start_store and store_password:
        units[f"rtxserve-{d.name}-store.service"] = store_unit(d, target, start_store, store_password)
    for s in services:
        docker = s.kind == "triton" and triton_container is not None
        argv, env = _command(d, s, prefix, tritonserver, backend_directory, triton_container)
        name = f"rtxserve-{d.name}-{s.name}.service"
        lines = _unit_section(d, s, services, target, docker, store=bool(start_store) and s.kind == "gateway")
        lines += ["", "[Service]", "Type=simple", "User=rtxserve", "Group=rtxserve", f"WorkingDirectory={prefix}",
                  "StateDirectory=rtxserve", "CacheDirectory=rtxserve"]
        if s.control_port is not None:  # the engine's own log, beside the journal that has its control's
            lines.append("LogsDirectory=rtxserve")
        if s.kind == "gateway" and store_password:  # read by systemd as root: the file may stay root's alone
            lines.append(f"LoadCredential=store-password:{store_password}")
        if docker:  # the Docker socket: its group's members may run containers; a container left by a crash or a
            # power cut holds the name (`docker run --name` then fails): removed first, its absence no error
            lines += ["SupplementaryGroups=docker", f"ExecStartPre=-/usr/bin/docker rm -f rtxserve-{d.name}-triton",
                      f"ExecStop=/usr/bin/docker stop -t 30 rtxserve-{d.name}-triton"]
        lines += [f'Environment="{k}={v}"' for k, v in sorted(env.items())]
        building = s.kind == "triton" and build_engines
        if building:
            lines += _build_lines(s, build_engines, triton_container)
        lines += [f"ExecStart={' '.join(_quote(a) for a in argv)}",
                  # readiness: the unit counts as started once the server answers ready
                  f"ExecStartPost={prefix / '.venv' / 'bin' / 'python'} -m serve.wait_ready "
                  f"http://127.0.0.1:{s.port}{s.ready_path} --timeout {600 if s.kind == 'vllm' else 300}"
                  # an on-demand GPU engine then sleeps, before the next engine on its card starts
                  + (f" --then-sleep {s.sleep_level}" if s.sleep_level else ""),
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
