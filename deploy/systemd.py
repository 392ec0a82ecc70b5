"""systemd units for a bare-metal box: one per server, from an install at a prefix, and a target for them all."""

from __future__ import annotations

import sys
from pathlib import Path

from core.envs import TRITON, VLLM, env_under

from .services import Service
from .spec import Deployment


def systemd_units(d: Deployment, services: list[Service], prefix: Path, tritonserver: Path | None = None,
                  backend_directory: Path | None = None, build_engines: str | None = None) -> dict[str, str]:
    """One unit per server, run as the `rtxserve` user from an install at `prefix` (what the bundle's install.sh
    makes), and a target that starts them together."""
    from serve import triton, vllm

    units = {}
    target = f"rtxserve-{d.name}.target"
    engines = [f"rtxserve-{d.name}-{s.name}.service" for s in services if s.kind != "gateway"]
    triton_units = [f"rtxserve-{d.name}-{s.name}.service" for s in services if s.kind == "triton"]
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
        # The gateway starts once every engine answers ready; a vLLM engine once Triton has loaded (it takes its
        # planned share of the memory free when it starts, and refuses to start on less).
        needs = engines if s.kind == "gateway" else triton_units if s.kind == "vllm" else []
        lines = ["[Unit]", f"Description=rtxserve {d.name}: {s.name} ({s.kind})",
                 f"After={' '.join(['network-online.target', *needs])}", "Wants=network-online.target", f"PartOf={target}"]
        if needs:  # Wants, not Requires: with Requires, systemd restarts the gateway whenever an engine's unit restarts
            # (booted, a Triton killed and started again by Restart= took the gateway and every stream on it down too);
            # the gateway rides out an engine's absence itself (its breakers, /readyz), and vLLM runs on without Triton
            lines.append(f"Wants={' '.join(needs)}")
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
