"""`rtxserve doctor`: the box's tools stood in for at their command line (an nvidia-smi that answers as NVIDIA's does
on an RTX 4090, an RTX 3090, an A100; a docker with and without the nvidia runtime), and for real for what this
machine has. Each check is one line; the exit code tells a script whether anything failed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from deploy.doctor import main
from deploy.images import MIN_DRIVER
from tests.plan_fixtures import write_artifacts
from tests.postgres import INSTALLED as POSTGRES_INSTALLED, WHY_NOT as POSTGRES_WHY_NOT, Postgres

ROOT = Path(__file__).resolve().parents[2]
# nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv,noheader,nounits, as published
# for each card (memory in MiB)
CARDS = {"4090": "NVIDIA GeForce RTX 4090, 24564, 1, 580.65.06",
         "3090": "NVIDIA GeForce RTX 3090, 24576, 1, 535.183.01",
         "a100": "NVIDIA A100-SXM4-80GB, 81920, 4, 580.65.06",
         "4090-busy": "NVIDIA GeForce RTX 4090, 24564, 20480, 580.65.06",
         "4090-r575": "NVIDIA GeForce RTX 4090, 24564, 1, 575.64.05"}  # CUDA 12.9's driver: too old for CUDA 13


def _tools(folder: Path, card: str | None, count: int = 1, nvidia_runtime: bool = True) -> None:
    """Fake nvidia-smi (for `count` cards of `card`) and docker, on PATH first."""
    folder.mkdir()
    if card:
        rows = "\\n".join(f"{i}, {CARDS[card]}" for i in range(count))
        (folder / "nvidia-smi").write_text(f'#!/bin/sh\nprintf "{rows}\\n"\n')
    runtimes = '{"runc":{},"nvidia":{}}' if nvidia_runtime else '{"runc":{}}'
    (folder / "docker").write_text(f"#!/bin/sh\n[ \"$1\" = info ] && echo '{runtimes}' && exit 0\n"
                                   "[ \"$1\" = compose ] && echo 'Docker Compose version v2.29.1' && exit 0\nexit 1\n")
    for tool in folder.iterdir():
        tool.chmod(0o755)


def _box(tmp_path: Path, example: str = "one-4090") -> Path:
    path = Path(shutil.copy(ROOT / "deploy" / "examples" / f"{example}.yaml", tmp_path / f"{example}.yaml"))
    write_artifacts(path)
    data = yaml.safe_load(path.read_text())
    data["ports"] = {"gateway": 18080, "triton_http": 18000, "triton_grpc": 18001, "triton_metrics": 18002, "vllm": 18100}
    path.write_text(yaml.safe_dump(data))
    return path


def _doctor(capsys, path: Path, target: str) -> tuple[int, dict[str, str]]:
    code = main([str(path), "--target", target])
    lines = capsys.readouterr().out.splitlines()
    return code, {line[6:].split(":")[0]: line for line in lines[:-1]}


@pytest.mark.parametrize("card, driver_ok", [("4090", True), ("3090", False), ("a100", True), ("4090-r575", False)])
def test_the_gpu_and_driver_are_checked_against_the_plan_and_the_images(tmp_path, monkeypatch, capsys, card, driver_ok):
    _tools(tmp_path / "bin", card)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    code, lines = _doctor(capsys, _box(tmp_path), "compose")
    assert lines["GPUs"].startswith("ok") and CARDS[card].split(",")[0] in lines["GPUs"]
    assert lines["driver"].startswith("ok" if driver_ok else "FAIL"), lines["driver"]
    if not driver_ok:
        assert CARDS[card].split(", ")[-1] in lines["driver"] and f"{MIN_DRIVER} or later" in lines["driver"]
    assert lines["GPU 0 memory"].startswith("ok"), lines["GPU 0 memory"]
    assert lines["NVIDIA container toolkit"].startswith("ok") and lines["compose"].startswith("ok")
    assert code == (0 if driver_ok and all(l.startswith("ok") for l in lines.values()) else 1)


def test_too_few_cards_a_busy_card_and_no_container_toolkit_are_each_one_line(tmp_path, monkeypatch, capsys):
    _tools(tmp_path / "bin", "4090-busy", count=1, nvidia_runtime=False)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    code, lines = _doctor(capsys, _box(tmp_path, "four-4090"), "compose")
    assert code == 1
    assert lines["GPUs"].startswith("FAIL") and "names 4" in lines["GPUs"]
    assert lines["GPU 0 memory"].startswith("FAIL") and "3.99 free" in lines["GPU 0 memory"]
    assert lines["NVIDIA container toolkit"].startswith("FAIL") and "nvidia-ctk runtime configure" in lines["NVIDIA container toolkit"]


def test_no_nvidia_smi_says_to_install_the_driver(tmp_path, monkeypatch, capsys):
    _tools(tmp_path / "bin", None)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    code, lines = _doctor(capsys, _box(tmp_path), "serve")
    assert code == 1 and lines["GPUs"].startswith("FAIL") and "install NVIDIA's driver" in lines["GPUs"]


def test_on_this_machine_the_one_4090_example_lacks_what_it_lacks(tmp_path, capsys):
    """For real: no GPU here, no NVIDIA runtime in Docker (where it runs), NGC's Triton image not built; the ports it
    names are free, the tools vLLM needs are here. With --tritonserver: no native tritonserver either."""
    code, lines = _doctor(capsys, _box(tmp_path), "systemd")
    assert code == 1
    assert lines["GPUs"].startswith("FAIL") and lines["Triton image"].startswith("FAIL")
    assert lines["ports"].startswith("ok") and lines["C compiler"].startswith("ok") and lines["deployment"].startswith("ok")
    assert main([str(tmp_path / "one-4090.yaml"), "--target", "systemd", "--tritonserver"]) == 1
    assert "FAIL  tritonserver: no /opt/tritonserver/bin/tritonserver" in capsys.readouterr().out


def test_a_port_in_use_and_private_weights_are_named(tmp_path, capsys):
    import socket

    path = _box(tmp_path, "cpu-box")
    data = yaml.safe_load(path.read_text())
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        data["ports"]["gateway"] = held.getsockname()[1]
        path.write_text(yaml.safe_dump(data))
        weights = next(tmp_path.rglob("*.safetensors"))
        weights.chmod(0o600)
        code, lines = _doctor(capsys, path, "serve")
    assert code == 1
    assert lines["ports"].startswith("FAIL") and f"{data['ports']['gateway']} (ports.gateway)" in lines["ports"]
    assert lines["artifacts readable"].startswith("FAIL") and "chmod a+r" in lines["artifacts readable"]


def _kubectl(folder: Path, minor: str, apis: list[str], device_class: bool, slices: list[dict]) -> None:
    """A fake kubectl answering what doctor asks of a cluster, as kubectl prints it."""
    import json

    folder.mkdir()
    version = json.dumps({"clientVersion": {"major": "1", "minor": "34"}, "serverVersion": {"major": "1", "minor": minor}})
    (folder / "version.json").write_text(version)
    (folder / "slices.json").write_text(json.dumps({"apiVersion": "v1", "items": slices}))
    (folder / "kubectl").write_text(f"""#!/bin/sh
case "$1 $2" in
  "version -o") cat {folder}/version.json ;;
  "api-versions ") printf '{chr(10).join(apis)}\\n' ;;
  "get deviceclass") {"echo deviceclass.resource.k8s.io/gpu.nvidia.com" if device_class else "echo 'Error from server (NotFound)' >&2; exit 1"} ;;
  "get resourceslices") cat {folder}/slices.json ;;
  *) exit 1 ;;
esac
""")
    (folder / "kubectl").chmod(0o755)


def _slice(node: str, drivers: list[str]) -> dict:
    """A ResourceSlice of NVIDIA's DRA driver: a device per GPU with its type and driverVersion (and a MIG device,
    which is not a card)."""
    devices = [{"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}, "driverVersion": {"version": v},
                                                   "productName": {"string": "NVIDIA GeForce RTX 4090"}}}
               for i, v in enumerate(drivers)]
    devices.append({"name": "gpu-0-mig-1g", "attributes": {"type": {"string": "mig"}}})
    return {"spec": {"driver": "gpu.nvidia.com", "nodeName": node, "devices": devices}}


def test_kubernetes_is_checked_in_the_cluster_kubectl_reaches_not_on_this_machine(tmp_path, monkeypatch, capsys):
    """A containerd or k3s node has no Docker: for Kubernetes, doctor asks the cluster what the manifests need (the API
    version, resource.k8s.io/v1, the Prometheus Operator's API, the DRA device class, and the GPUs in its
    ResourceSlices, on a driver as new as the images need) and nothing of this machine's Docker or nvidia-smi."""
    ready = ["v1", "apps/v1", "resource.k8s.io/v1", "monitoring.coreos.com/v1"]
    _kubectl(tmp_path / "ok", "34", ready, True, [_slice("node-a", ["580.65.6"] * 2), _slice("node-b", ["580.82.7"] * 2)])
    monkeypatch.setenv("PATH", f"{tmp_path / 'ok'}:/usr/bin:/bin")
    code, lines = _doctor(capsys, _box(tmp_path, "four-4090"), "kubernetes")
    assert code == 0, lines
    assert lines["Kubernetes"] == "ok    Kubernetes: 1.34" and lines["GPUs"].endswith("4 in ResourceSlices of gpu.nvidia.com on node-a, node-b")
    assert "Docker Engine" not in lines and "NVIDIA container toolkit" not in lines and "ports" not in lines
    _kubectl(tmp_path / "old", "33+", ["v1", "resource.k8s.io/v1beta1"], False, [_slice("node-a", ["575.64.5", "580.65.6"])])
    monkeypatch.setenv("PATH", f"{tmp_path / 'old'}:/usr/bin:/bin")
    code, lines = _doctor(capsys, tmp_path / "four-4090.yaml", "kubernetes")
    assert code == 1
    assert lines["Kubernetes"].startswith("FAIL") and "1.34 or later" in lines["Kubernetes"]
    assert lines["resource.k8s.io/v1"].startswith("FAIL") and lines["monitoring.coreos.com/v1"].startswith("FAIL")
    assert lines["GPU device class"].startswith("FAIL") and "gpuResourcesEnabledOverride=true" in lines["GPU device class"]
    assert lines["GPUs"].startswith("FAIL") and "2 in ResourceSlices" in lines["GPUs"] and "names 4" in lines["GPUs"]
    assert lines["driver"].startswith("FAIL") and f"{MIN_DRIVER} or later" in lines["driver"] and "575.64.5" in lines["driver"]
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    code, lines = _doctor(capsys, tmp_path / "four-4090.yaml", "kubernetes")
    assert code == 1 and lines["kubectl"].startswith("FAIL") and "KUBECONFIG" in lines["kubectl"]


@pytest.mark.skipif(not POSTGRES_INSTALLED, reason=POSTGRES_WHY_NOT)
def test_the_store_is_reached_as_its_user_with_its_password_or_the_reason_is_said(tmp_path, capsys):
    """store.url against a real PostgreSQL that asks for a password: the right one passes (the server's version said),
    a wrong one fails with the server's own reason, the password in neither line."""
    server = Postgres(password="right-password").start()
    try:
        path = _box(tmp_path, "cpu-box")
        data = yaml.safe_load(path.read_text())
        data["store"] = {"url": f"postgresql://rtx@127.0.0.1:{server.port}/postgres", "password_file": "db-password"}
        path.write_text(yaml.safe_dump(data))
        lines = {}
        for password in ("right-password", "wrong-password"):
            (tmp_path / "db-password").write_text(password + "\n")
            _, found = _doctor(capsys, path, "serve")
            lines[password] = found["store"]
    finally:
        server.stop()
    assert lines["right-password"].startswith("ok") and "PostgreSQL 1" in lines["right-password"]
    assert lines["wrong-password"].startswith("FAIL") and 'password authentication failed for user "rtx"' in \
        lines["wrong-password"]
    assert not any(p in line for line in lines.values() for p in ("right-password", "wrong-password"))


def test_a_box_s_own_store_under_systemd_needs_debian_s_postgresql_and_its_port(tmp_path, capsys):
    """store.server, systemd: this machine has Debian's postgresql (`make test` installs it), and the port is said when
    something holds it."""
    import socket

    path = _box(tmp_path, "cpu-box")
    data = yaml.safe_load(path.read_text())
    data["store"], data["ports"]["store"] = {"server": True}, 18543
    path.write_text(yaml.safe_dump(data))
    _, found = _doctor(capsys, path, "systemd")
    assert found["store server"].startswith("ok") and "/usr/lib/postgresql/" in found["store server"]
    assert found["store port"].startswith("ok")
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 18543))
        holder.listen()
        _, found = _doctor(capsys, path, "systemd")
    assert found["store port"].startswith("FAIL") and "ports.store 18543 in use" in found["store port"]
    _, found = _doctor(capsys, path, "compose")  # compose builds its own: nothing of the box's to check
    assert "store server" not in found and "store port" not in found
