"""The boot tier (`make test-boot`, outside `make test`): rendered deployments started for real on this machine with
the tools a box has, from Debian's packages (Docker Engine and docker-compose, systemd-nspawn). Images are built FROM a
debian:bookworm-slim made here from Debian's packages (no registry is reachable), kept in the engine between runs.

Network rule: containers only on the networks their deployment creates, clients only on ports published to
127.0.0.1, nothing addressed elsewhere."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from deploy.images import BASE_IMAGE

DEBIAN_MIRROR = "http://deb.debian.org/debian"
ROOT = Path(__file__).resolve().parents[2]
KEY = "boot-test-key"  # the gateway key of the booted boxes


def run(argv: list[str], timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """A tool's run; its output in the failure when it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(argv[:4])}... exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return done


class DockerEngine:
    """This machine's Docker Engine, or dockerd started for the session (as root, as the box's is)."""

    def __init__(self, log: Path):
        self.log, self.daemon = log, None
        if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
            self.start()

    def start(self) -> None:
        with open(self.log, "a") as out:
            self.daemon = subprocess.Popen(["dockerd"], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"dockerd did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.terminate()  # as at shutdown: dockerd stops its containers, then exits
            self.daemon.wait(120)
            self.daemon = None

    def restart(self) -> None:
        """As a reboot does: the engine stopped with its containers, started again, restarting every container whose
        policy says so (all at once: depends_on is compose's, not the engine's)."""
        if self.daemon is None:
            pytest.skip("this machine's own Docker Engine runs here: the boot tier restarts only a dockerd it started")
        self.stop()
        self.start()


@pytest.fixture(scope="session")
def docker(tmp_path_factory):
    """A running Docker Engine (DockerEngine): this machine's, or dockerd started for the session."""
    if not shutil.which("docker") or not shutil.which("docker-compose"):
        pytest.fail("no docker / docker-compose: `make test-boot` installs Debian's docker.io and docker-compose")
    engine = DockerEngine(tmp_path_factory.mktemp("dockerd") / "dockerd.log")
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def debian_base(docker, tmp_path_factory) -> str:
    """BASE_IMAGE as Docker Hub serves it (debootstrap's minbase of Debian 12), made from Debian's packages and imported
    where no registry can be reached; made once, then kept by the engine."""
    if subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True).returncode == 0:
        return BASE_IMAGE
    root = tmp_path_factory.mktemp("debian") / "root"
    run(["debootstrap", "--variant=minbase", "bookworm", str(root), DEBIAN_MIRROR], timeout=900)
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    run(["docker", "import", "-c", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
         "-c", 'CMD ["bash"]', "-", BASE_IMAGE], stdin=tar.stdout)
    tar.wait()
    shutil.rmtree(root, ignore_errors=True)
    return BASE_IMAGE


def site_files(context: Path, wheels: bool) -> None:
    """What this machine's pip is set up with, into an image's context: its CA bundle (certs/: the network here
    re-signs TLS) and, with `wheels`, those of its find-links folders (wheels/: the CPU torch no index here serves)."""
    import configparser
    import os

    config = configparser.ConfigParser()
    config.read([p for p in ("/etc/pip.conf", "/etc/xdg/pip/pip.conf", os.path.expanduser("~/.config/pip/pip.conf"))])
    cert = os.environ.get("PIP_CERT") or config.get("global", "cert", fallback="")
    if cert and Path(cert).is_file():
        shutil.copy(cert, context / "certs" / "site.crt")
    links = (os.environ.get("PIP_FIND_LINKS") or config.get("global", "find-links", fallback="")).split() if wheels else []
    for folder in map(Path, links):
        for wheel in folder.glob("*.whl") if folder.is_dir() else []:
            shutil.copy(wheel, context / "wheels" / wheel.name)


def write_cpu_box(box: Path, ports: dict[str, int]) -> Path:
    """deploy/examples/cpu-box.yaml in `box` beside what it names, with `ports`: the fixture classifier exported as
    `sentiment`, the tiny Llama as llm/base and its adapter packaged as llm/support, a keys file with KEY."""
    import yaml

    from export.encoders.encoder import export_text_classification
    from export.llm.llm import LLMOptions, export_llm
    from export.triton.entry import EntryOptions
    from fixture_models.llm import write_llm_with_adapters
    from fixture_models.text import write_text_classifier
    from serve.gateway.access.keys import ApiKey, hash_key, write_keys

    export_text_classification(write_text_classifier(box / "checkpoint"), EntryOptions(name="sentiment", instances=2),
                               box / "model_repository")
    llm = write_llm_with_adapters(box / "fixtures")
    shutil.copytree(llm / "base", box / "llm" / "base")
    export_llm(llm / "adapter-a", box / "llm" / "support", LLMOptions())
    write_keys(box / "keys.json", {"boot": ApiKey(name="boot", hash=hash_key(KEY))})
    # safetensors saves weights readable by their owner only, and render refuses them (the servers run as users of
    # their own): what its message says to do
    for path in box.rglob("*.safetensors"):
        path.chmod(0o644)
    data = yaml.safe_load((ROOT / "deploy" / "examples" / "cpu-box.yaml").read_text()) | {"ports": ports}
    (box / "cpu-box.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return box / "cpu-box.yaml"
