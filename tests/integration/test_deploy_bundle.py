"""`rtxserve deploy bundle`: the archive installs into fresh virtual environments with pip's index and every
find-links turned off, and the stack it installs answers a request (with a key); a tampered file stops
the install before anything is installed."""

import os
import subprocess
import sys
import tarfile

import httpx
import pytest
import yaml

from export.encoders.encoder import export_text_classification
from export.triton.entry import EntryOptions
from serve.gateway.access.keys import ApiKey, hash_key, write_keys
from serve.launcher import free_port

OFFLINE = {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1"}  # no index, no find-links from this machine's config


@pytest.fixture(scope="module")
def archive(classifier_checkpoint, tmp_path_factory):
    work = tmp_path_factory.mktemp("bundle")
    export_text_classification(classifier_checkpoint, EntryOptions(name="sentiment"), work / "repo")
    write_keys(work / "keys.json", {"ops": ApiKey(name="ops", hash=hash_key("rtx-test-secret"))})
    ports = {k: free_port() for k in ("gateway", "triton_http", "triton_grpc", "triton_metrics", "vllm")}
    (work / "box.yaml").write_text(yaml.safe_dump({
        "name": "offline-box", "ports": ports, "gateway": {"keys_file": "keys.json"},
        "models": [{"name": "sentiment", "kind": "encoder", "path": "repo/sentiment"}]}))
    made = subprocess.run([sys.executable, "-m", "rtxserve.cli", "deploy", "bundle", str(work / "box.yaml"),
                           "--out", str(work / "box.tar"), "--prefix", str(work / "installed")],
                          capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stderr[-3000:]
    return work / "box.tar", work / "installed", ports


def test_the_archive_holds_wheels_models_rendered_files_images_and_checksums(archive):
    tar, _, _ = archive
    with tarfile.open(tar) as t:
        names = set(t.getnames())
    root = "rtxserve-offline-box"
    for expected in ("install.sh", "deployment.yaml", "SHA256SUMS", "images.txt", "compose/compose.yaml",
                     "kubernetes/kustomization.yaml", "models/repository/sentiment/config.pbtxt",
                     "gateway-image/Dockerfile", "wheels/gateway/requirements.txt", "wheels/triton/requirements.txt"):
        assert f"{root}/{expected}" in names, expected
    # --prefix is a test folder: under /tmp (which the units' PrivateTmp would hide) no units, and a README says why
    hidden = any(tar.is_relative_to(t) for t in ("/tmp", "/var/tmp"))
    assert (f"{root}/systemd/README" in names) == hidden
    assert (f"{root}/systemd/rtxserve-offline-box.target" in names) == (not hidden)
    assert any(n.startswith(f"{root}/wheels/gateway/rtxserve-") and n.endswith(".whl") for n in names)
    assert any(n.startswith(f"{root}/wheels/triton/nvidia_pytriton-") for n in names)
    assert not any(n.startswith(f"{root}/wheels/vllm") for n in names)  # no LLM in this deployment


def test_a_tampered_file_stops_the_install(archive, tmp_path):
    tar, _, _ = archive
    with tarfile.open(tar) as t:
        t.extractall(tmp_path, filter="tar")
    root = tmp_path / "rtxserve-offline-box"
    (root / "deployment.yaml").write_text((root / "deployment.yaml").read_text() + "# changed\n")
    run = subprocess.run(["sh", str(root / "install.sh")], capture_output=True, text=True, env={**os.environ, **OFFLINE})
    assert run.returncode != 0 and "deployment.yaml: FAILED" in run.stdout + run.stderr
    assert not (root / ".venv").exists()


def test_it_installs_offline_and_the_stack_answers(archive):
    tar, installed, ports = archive
    installed.mkdir()
    with tarfile.open(tar) as t:
        t.extractall(installed.parent, filter="tar")
    (installed.parent / "rtxserve-offline-box").rename(installed)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))} | OFFLINE
    env["RTXSERVE_STATE_DIR"] = str(installed.parent / "state")  # not this machine's ~/.local/state: runs share that
    install = subprocess.run(["sh", str(installed / "install.sh")], capture_output=True, text=True, env=env, timeout=900)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]
    rtxserve = str(installed / ".venv" / "bin" / "rtxserve")
    up = subprocess.run([rtxserve, "serve", "up", "deployment.yaml"], cwd=installed, capture_output=True, text=True,
                        env=env, timeout=600)
    assert up.returncode == 0, up.stderr[-3000:]
    try:
        url = f"http://127.0.0.1:{ports['gateway']}/v1/classify"
        body = {"model": "sentiment", "input": ["what a great day"]}
        assert httpx.post(url, json=body, timeout=30).status_code == 401  # the bundled keys file is in force
        r = httpx.post(url, json=body, headers={"Authorization": "Bearer rtx-test-secret"}, timeout=30)
        assert r.status_code == 200 and r.json()["data"][0]["label"] in {"negative", "neutral", "positive"}
    finally:
        down = subprocess.run([rtxserve, "serve", "down", "offline-box"], cwd=installed, capture_output=True, text=True, env=env)
    assert down.returncode == 0, down.stderr
