"""The CPU box's systemd units, as its air-gapped bundle installs them, booted for real: a Debian root (from Debian's
packages) unpacks `rtxserve deploy bundle`'s archive, runs its install.sh, makes the rtxserve user and enables the
deployment's target, then boots with systemd-nspawn (systemd as PID 1, the host's network). The target starts every
server and the box's own PostgreSQL (store.server, the box's Debian package), the gateway answers from 127.0.0.1 with
keys enforced and keeps its batches in that store, and a server killed with SIGKILL is started again by its unit's
restart policy while the gateway stays up and becomes ready again."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from deploy.bundle import bundle
from deploy.load import load_deployment
from serve.launcher import free_port

from .conftest import DEBIAN_MIRROR, KEY, run, write_cpu_box

# What the box has before rtxserve: systemd, and what the install and its servers need from the system (Python 3.11
# with venv, the python-backend stub's libpython, a C compiler and Python's headers for torch.compile, libnuma; Debian's
# postgresql for the box's own store)
PACKAGES = ("systemd,systemd-sysv,dbus,python3,python3-venv,libpython3.11,python3-dev,g++,libnuma1,ca-certificates,"
            "postgresql")
PREFIX = Path("/opt/rtxserve-cpu-box")


def _root_tarball() -> Path:
    """debootstrap of Debian 12 with PACKAGES, kept as a tarball in this user's cache (made once per package list)."""
    import hashlib

    from platformdirs import user_cache_dir

    cache = Path(user_cache_dir("rtxserve")) / "boot"
    tarball = cache / f"bookworm-{hashlib.sha256(PACKAGES.encode()).hexdigest()[:12]}.tar"
    if not tarball.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        root = cache / "root.partial"
        shutil.rmtree(root, ignore_errors=True)
        run(["debootstrap", "--variant=minbase", f"--include={PACKAGES}", "bookworm", str(root), DEBIAN_MIRROR], timeout=1200)
        run(["tar", "-C", str(root), "-cf", f"{tarball}.partial", "."], timeout=600)
        Path(f"{tarball}.partial").rename(tarball)
        shutil.rmtree(root)
    return tarball


def _in_root(root: Path, script: str, timeout: float = 900) -> None:
    """`script` run in `root` as root, with nothing booted (systemd-nspawn as a chroot)."""
    run(["systemd-nspawn", "--register=no", "--keep-unit", "-q", "-D", str(root), f"--chdir={PREFIX}", "sh", "-euc",
         script], timeout=timeout)


class Booted:
    """systemd-nspawn -b of `root`, and commands run inside it (nsenter into its PID 1's namespaces)."""

    def __init__(self, root: Path, log: Path):
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen(["systemd-nspawn", "--register=no", "--keep-unit", "-D", str(root), "-b"],
                                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not (children := subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True,
                                              text=True).stdout.split()):
            assert self.process.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        self.init = children[0]

    def sh(self, script: str) -> str:
        return run(["nsenter", "-t", self.init, "-a", "sh", "-c", script], timeout=120).stdout

    def unit(self, name: str, *properties: str) -> dict[str, str]:
        shown = self.sh(f"systemctl show {' '.join(f'-p {p}' for p in properties)} {name}")
        return dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)

    def poweroff(self) -> None:
        if self.process.poll() is None:
            subprocess.run(["nsenter", "-t", self.init, "-a", "systemctl", "poweroff"], capture_output=True, timeout=60)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _ready(url: str, seconds: float, box: Booted) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            pytest.fail("the gateway was not ready in time:\n" + box.sh(
                "systemctl list-units 'rtxserve*' --all --no-pager; journalctl -u 'rtxserve*' --no-pager -n 60"))
        time.sleep(1)


@pytest.fixture(scope="module")
def booted(tmp_path_factory):
    """(the deployment, the gateway's URL, the booted root), the box installed from its bundle and booted."""
    work = tmp_path_factory.mktemp("systemd-box")
    ports = {"gateway": free_port(), "triton_http": free_port(), "triton_grpc": free_port(),
             "triton_metrics": free_port(), "vllm": free_port(), "store": free_port()}  # the host's network: free ones
    path = write_cpu_box(work / "box", ports)
    path.write_text(yaml.safe_dump(yaml.safe_load(path.read_text()) | {"store": {"server": True}}, sort_keys=False))
    d = load_deployment(path)
    archive = bundle(d, work / "cpu-box.tar", prefix=PREFIX, log=lambda line: None)
    root = work / "root"
    root.mkdir()
    run(["tar", "-C", str(root), "-xf", str(_root_tarball())], timeout=600)
    with tarfile.open(archive) as tar:  # its folder is rtxserve-cpu-box/: PREFIX
        tar.extractall(root / PREFIX.parent.relative_to("/"), filter="tar")
    # what install.sh says to do, then the target enabled as a box's administrator would
    _in_root(root, f"sh install.sh && useradd --system --home /var/lib/rtxserve rtxserve && chown -R rtxserve: secrets "
                   f"&& cp systemd/*.service systemd/*.target /etc/systemd/system/ "
                   f"&& systemctl enable rtxserve-{d.name}.target "
                   # the package's own cluster would take 5432 on the host's network, which this machine may hold
                   f"&& systemctl mask postgresql.service postgresql@15-main.service", timeout=1800)
    box = Booted(root, work / "boot.log")
    try:
        url = f"http://127.0.0.1:{ports['gateway']}"
        _ready(url, 600, box)
        # the gateway answers ready a moment before its unit's ExecStartPost (serve.wait_ready, polling) sees it:
        # the target is active once every unit has started
        deadline = time.monotonic() + 120
        while box.unit(f"rtxserve-{d.name}.target", "ActiveState")["ActiveState"] != "active":
            assert time.monotonic() < deadline, "the gateway is ready but the target did not become active"
            time.sleep(1)
        yield d, url, box
    finally:
        box.poweroff()


def test_the_target_starts_every_server_as_the_rtxserve_user(booted):
    d, _, box = booted
    for server in ("triton", "vllm-tiny-llama-0", "gateway"):
        unit = box.unit(f"rtxserve-{d.name}-{server}.service", "ActiveState", "SubState", "User", "MainPID")
        assert (unit["ActiveState"], unit["SubState"], unit["User"]) == ("active", "running", "rtxserve"), (server, unit)
        assert box.sh(f"stat -c %U /proc/{unit['MainPID']}").strip() == "rtxserve", server
    assert box.unit(f"rtxserve-{d.name}.target", "ActiveState")["ActiveState"] == "active"


def test_the_gateway_keeps_its_batches_in_the_box_s_own_postgresql(booted):
    """The store's unit runs the box's Debian postgresql as postgres; a batch through the gateway completes, and its
    tables are in that server, reached with the password the render made."""
    import openai

    d, url, box = booted
    unit = box.unit(f"rtxserve-{d.name}-store.service", "ActiveState", "SubState", "User")
    assert (unit["ActiveState"], unit["SubState"], unit["User"]) == ("active", "running", "postgres"), unit
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    lines = b"".join(b'{"custom_id": "q%d", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "support", '
                     b'"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": true}}\n' % i
                     for i in range(4))
    batch = sdk.batches.create(input_file_id=sdk.files.create(file=("in.jsonl", lines), purpose="batch").id,
                               endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (batch := sdk.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline and batch.status in ("validating", "in_progress", "finalizing"), batch
        time.sleep(0.5)
    assert batch.request_counts.completed == 4
    rows = box.sh(f'PGPASSWORD="$(head -n 1 {PREFIX}/secrets/store/store-password.txt)" '
                  f"$(ls -d /usr/lib/postgresql/*/bin | tail -n 1)/psql -h 127.0.0.1 -p {d.ports.store} -U rtxserve "
                  "-d rtxserve -Atc 'SELECT status, total FROM batches'")
    assert rows.split() == ["completed|4"], rows


def test_the_gateway_answers_from_127_0_0_1_with_keys_enforced(booted):
    _, url, _ = booted
    body = {"model": "sentiment", "input": ["what a great day"]}
    assert httpx.post(f"{url}/v1/classify", json=body, timeout=30).status_code == 401
    answer = httpx.post(f"{url}/v1/classify", json=body, timeout=30, headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 200 and answer.json()["data"][0]["label"] in {"negative", "neutral", "positive"}
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {KEY}"}, json={
        "model": "support", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 4, chat.text


def test_a_killed_server_is_started_again_by_its_unit_and_the_gateway_recovers(booted):
    d, url, box = booted
    name = f"rtxserve-{d.name}-triton.service"
    before = box.unit(name, "MainPID", "NRestarts")
    gateway = box.unit(f"rtxserve-{d.name}-gateway.service", "MainPID")["MainPID"]
    box.sh(f"kill -9 {before['MainPID']}")
    deadline = time.monotonic() + 120
    while (now := box.unit(name, "MainPID", "NRestarts", "ActiveState"))["NRestarts"] == before["NRestarts"]:
        assert time.monotonic() < deadline, now
        time.sleep(1)
    assert now["MainPID"] != before["MainPID"] and int(now["NRestarts"]) == int(before["NRestarts"]) + 1
    _ready(url, 300, box)
    answer = httpx.post(f"{url}/v1/classify", timeout=30, headers={"Authorization": f"Bearer {KEY}"},
                        json={"model": "sentiment", "input": ["fine"]})
    assert answer.status_code == 200, answer.text
    assert box.unit(f"rtxserve-{d.name}-gateway.service", "MainPID")["MainPID"] == gateway  # not restarted
