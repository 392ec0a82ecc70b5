"""`rtxserve serve up / status / down` on CPU, through the real CLI: a deployment file with an encoder, two detectors
(DETR, and a YOLO exported by Ultralytics with its NMS in the graph) and an LLM with an adapter brings up the real tritonserver, vLLM and
gateway; requests pass through it; `down`
leaves no process behind; a taken port is refused with the process that holds it."""

import base64
import http.server
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import yaml
from PIL import Image

from export.detection.detr import PARITY_THRESHOLD
from export.encoders.encoder import EncoderOptions, export_encoder, export_text_classification
from export.llm.llm import export_llm
from export.triton.entry import EntryOptions
from fixture_models.detection import probe_images
from serve.launcher import free_port
from tests.integration import VLLM_TWO_PROCESSES, png

from .conftest import yolo_images


def rtxserve(*args, state: Path, cwd: Path | None = None, timeout=900):
    """The CLI with its state directory set by the environment, as a user's shell would, from `cwd` (vLLM in its
    deployed process layout: without the session's VLLM_TWO_PROCESSES)."""
    shell = {k: v for k, v in os.environ.items() if k not in VLLM_TWO_PROCESSES}
    return subprocess.run([sys.executable, "-m", "rtxserve.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**shell, "RTXSERVE_STATE_DIR": str(state)})


@pytest.fixture(scope="module")
def deployment(classifier_checkpoint, detector_checkpoint, yolo_run, llm_fixtures, tmp_path_factory):
    work = tmp_path_factory.mktemp("box")
    export_text_classification(classifier_checkpoint, EntryOptions(name="sentiment"), work / "repo")
    export_encoder(detector_checkpoint, "object-detection", EntryOptions(name="detr"), work / "repo")
    # NMS in the graph (--nms); the session stack's YOLO runs it in its postprocess step (test_yolo_e2e)
    export_encoder(yolo_run, "object-detection", EntryOptions(name="yolo"), work / "repo", EncoderOptions(nms=True))
    export_llm(llm_fixtures / "adapter-a", work / "packages" / "support")
    ports = {k: free_port() for k in ("gateway", "triton_http", "triton_grpc", "triton_metrics", "vllm")}
    spec = {"name": "box", "ports": ports, "gateway": {"settings": {"max_tokens": 64}},
            "models": [{"name": "sentiment", "kind": "encoder", "path": "repo/sentiment", "instances": 2, "slo": "e2el:500"},
                       {"name": "detr", "kind": "encoder", "path": "repo/detr"},  # a detector is an encoder entry
                       {"name": "yolo", "kind": "encoder", "path": "repo/yolo"},
                       {"name": "tiny-llama", "kind": "llm", "path": str(llm_fixtures / "base"),
                        "adapters": {"support": "packages/support"}, "max_model_len": 512, "max_num_seqs": 4}]}
    path = work / "deployment.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path, spec, work / "run"


@pytest.fixture(scope="module")
def box(deployment):
    path, spec, runs = deployment
    up = rtxserve("serve", "up", path, "--verify", state=runs)
    assert up.returncode == 0, up.stdout + up.stderr
    # every model with a reference set answers as it was trained; the base, served from the trainer's folder, has none
    verified = {line.split(":")[0].removeprefix("verify ") for line in up.stdout.splitlines() if "PASSED" in line}
    assert verified == {"sentiment", "detr", "yolo", "support"}, up.stdout
    assert "verify tiny-llama: not verified" in up.stderr
    yield f"http://127.0.0.1:{spec['ports']['gateway']}", runs / "box"
    rtxserve("serve", "down", "box", state=runs)


def test_eval_finds_a_models_reference_set_through_the_box_by_its_name(box, deployment, tmp_path):
    _, _, runs = deployment
    done = rtxserve("eval", "box", "sentiment", "--out", tmp_path, state=runs)
    assert done.returncode == 0 and "sentiment: PASSED" in done.stdout, done.stdout + done.stderr
    status = rtxserve("serve", "status", "box", state=runs)
    assert status.returncode == 0 and "promoted:" not in status.stdout  # nothing promoted on this box


def test_requests_pass_through_every_server_it_started(box, yolo_run):
    url, run = box
    r = httpx.post(f"{url}/v1/classify", json={"model": "sentiment", "input": ["what a great day"]}, timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["label"] in {"negative", "neutral", "positive"}
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert sorted(m.id for m in sdk.models.list()) == ["detr", "sentiment", "support", "tiny-llama", "yolo"]
    rectangles = [png(array) for array in probe_images()]
    for detector, images, conf in (("detr", rectangles, PARITY_THRESHOLD), ("yolo", yolo_images(yolo_run), 0.25)):
        detect = httpx.post(f"{url}/v1/detect", timeout=30, json={"model": detector, "conf": conf, "input": [
            {"image": base64.b64encode(i).decode()} for i in images]})
        assert detect.status_code == 200, detect.text
        found = detect.json()["data"]
        sizes = [Image.open(io.BytesIO(i)).size for i in images]  # as the image is (these carry no EXIF rotation)
        assert [(d["width"], d["height"]) for d in found] == sizes
        # each fixture finds a rectangle in each of these (its build checked it, scoring over 0.4 and 0.6)
        assert all(d["detections"] for d in found), (detector, found)
    # the YOLO's NMS is its graph's: a request for another iou is refused by name, and the export matched Ultralytics'
    # predict with NMS in the graph
    refused = httpx.post(f"{url}/v1/detect", timeout=30, json={"model": "yolo", "iou": 0.3, "input": [
        {"image": base64.b64encode(yolo_images(yolo_run)[0]).decode()}]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "iou", refused.text
    parity = json.loads((run / "model_repository" / "yolo_model" / "parity.json").read_text())
    assert parity["served"]["passed"] and parity["served"]["detections"] >= len(yolo_images(yolo_run)), parity["served"]
    chat = sdk.chat.completions.create(model="support", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body={"ignore_eos": True})  # sampled: a random model may end at once
    assert chat.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # the deployment's gateway settings apply
        sdk.chat.completions.create(model="support", messages=[{"role": "user", "content": "hi"}], max_tokens=65)


def test_the_plan_set_the_instances_and_status_reports_every_server(box):
    from serve.entry_config import read_batching

    url, run = box
    assert read_batching(run / "model_repository", "sentiment").instances == 2
    # from another working directory (a new terminal), by name and with no name (every deployment that runs)
    for args in (("box",), ()):
        status = rtxserve("serve", "status", *args, state=run.parent, cwd=run.parent.parent)
        assert status.returncode == 0, status.stdout + status.stderr
        lines = status.stdout.splitlines()
        assert lines[0] == f"box ({run})"
        rows = lines[2:5]
        assert [r.split()[0] for r in rows] == ["triton", "vllm-tiny-llama-0", "gateway"]
        assert all(" alive " in r and " 200 " in r for r in rows)
        assert lines[5].strip().startswith("keeper: pid ") and len(lines) == 6  # no promotion, no failed restart


def test_an_adapter_is_added_and_removed_under_load_with_no_failed_request(deployment, box, llm_fixtures):
    """`rtxserve adapters add|remove` on the running box: streams to the base and its started adapter run throughout;
    the new adapter is checked, loaded, listed by the gateway within seconds, answers, and is unloaded; the
    deployment file gains it and loses it again, its comment kept; not one request of the load fails."""
    path, spec, runs = deployment
    url, _ = box
    path.write_text("# the box's deployment: adapters add|remove keep this line\n" + path.read_text())
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    stop, outcomes = threading.Event(), []

    def load(model):
        while not stop.is_set():
            try:
                stream = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=16, stream=True, stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True})
                outcomes.append([chunk.usage.completion_tokens for chunk in stream if chunk.usage][-1])
            except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                outcomes.append(exc)

    def listed():
        return {m.id for m in sdk.models.list()}

    threads = [threading.Thread(target=load, args=(m,), daemon=True) for m in ("tiny-llama", "support")]
    for t in threads:
        t.start()
    try:
        added = rtxserve("adapters", "add", "support-b", llm_fixtures / "adapter-b", "--deployment", path, state=runs)
        assert added.returncode == 0, added.stderr
        deadline = time.monotonic() + 10
        while "support-b" not in listed():
            assert time.monotonic() < deadline, "the gateway did not list the new adapter within 10 s"
            time.sleep(0.5)
        answer = sdk.chat.completions.create(model="support-b", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4, extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 4
        written = yaml.safe_load(path.read_text())["models"][-1]["adapters"]
        assert written == {"support": "packages/support", "support-b": str(llm_fixtures / "adapter-b")}
        taken = rtxserve("adapters", "add", "support", llm_fixtures / "adapter-b", "--deployment", path, state=runs)
        assert taken.returncode == 2 and "support is already served" in taken.stderr
        removed = rtxserve("adapters", "remove", "support-b", "--deployment", path, state=runs)
        assert removed.returncode == 0, removed.stderr
        deadline = time.monotonic() + 10
        while "support-b" in listed():
            assert time.monotonic() < deadline, "the gateway still lists the removed adapter after 10 s"
            time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    failures = [o for o in outcomes if isinstance(o, Exception)]
    assert not failures and len(outcomes) >= 4 and all(n == 16 for n in outcomes), failures or outcomes
    text = path.read_text()
    assert text.startswith("# the box's deployment") and "support-b" not in text


def test_a_taken_port_is_refused_with_the_process_holding_it(deployment, box):
    path, spec, runs = deployment
    port = free_port()
    server = http.server.HTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        free = {k: free_port() for k in ("triton_http", "triton_grpc", "triton_metrics", "vllm")}
        other = {**spec, "name": "other", "ports": {"gateway": port, **free}}
        (path.parent / "other.yaml").write_text(yaml.safe_dump(other))  # beside it: the same relative paths
        refused = rtxserve("serve", "up", path.parent / "other.yaml", state=runs)
        assert refused.returncode == 2
        assert f"ports.gateway: port {port} is taken by pid {psutil.Process().pid}" in refused.stderr
    finally:
        server.shutdown()


def _pids(runs: Path) -> dict[str, int]:
    return {s["name"]: s["pid"] for s in yaml.safe_load((runs / "box" / "state.json").read_text())["servers"]}


def test_up_of_a_running_box_leaves_it_as_it_is_and_its_keeper_brings_back_a_killed_gateway_alone(deployment, box):
    """As `docker compose up -d`: up of a box that runs changes nothing. After its gateway was killed (SIGKILL, its
    whole group), the box's keeper starts the gateway again and nothing else (before it, the only way back was down
    and up, every model stopped), counted in `serve status` and in the gateway's own metrics; a changed file is
    refused, naming what runs as the old one planned."""
    path, spec, runs = deployment
    before = _pids(runs)
    again = rtxserve("serve", "up", path, state=runs, cwd=runs)  # the same deployment twice, from elsewhere
    assert again.returncode == 0, again.stdout + again.stderr
    # its progress goes to stderr, as every step of `up` says it
    assert all(f"{name}: running (pid {pid}), left as it is" in again.stderr for name, pid in before.items())
    assert _pids(runs) == before and "0 server(s) started" in again.stderr
    gateway = [p for p in psutil.process_iter() if _pgid(p) == before["gateway"]]
    os.killpg(before["gateway"], signal.SIGKILL)
    _, alive = psutil.wait_procs(gateway, timeout=30)
    assert not alive
    deadline = time.monotonic() + 180
    while _pids(runs).get("gateway", before["gateway"]) == before["gateway"] and time.monotonic() < deadline:
        time.sleep(0.5)
    after = _pids(runs)
    assert after["gateway"] != before["gateway"] and {k: v for k, v in after.items() if k != "gateway"} == {
        k: v for k, v in before.items() if k != "gateway"}  # Triton and the engine never stopped
    assert httpx.get(f"{box[0]}/readyz", timeout=30).status_code == 200
    keeper_log = (runs / "box" / "logs" / "keeper.log").read_text()
    assert "gateway is gone; starting it again in 0 s" in keeper_log and "gateway started again (restart 1)" in keeper_log
    status = rtxserve("serve", "status", "box", state=runs)
    assert status.returncode == 0, status.stdout + status.stderr
    row = next(line.split() for line in status.stdout.splitlines() if line.split()[:2] == ["gateway", "gateway"])
    assert row[2] == str(after["gateway"]) and row[6] == "1", status.stdout  # pid ... RSS GiB, restarts
    assert "keeper: pid" in status.stdout
    metrics = httpx.get(f"{box[0]}/metrics", timeout=30).text
    assert 'rtxserve_server_restarts_total{outcome="ok",server="gateway"} 1.0' in metrics
    changed = yaml.safe_load(path.read_text())
    changed["gateway"]["settings"]["max_tokens"] = 32
    (path.parent / "changed.yaml").write_text(yaml.safe_dump(changed))
    refused = rtxserve("serve", "up", path.parent / "changed.yaml", state=runs)
    assert refused.returncode == 2 and "runs gateway as another deployment file planned" in refused.stderr
    assert _pids(runs) == after


def test_down_leaves_no_process_behind(deployment, box):
    path, spec, runs = deployment
    state = yaml.safe_load((box[1] / "state.json").read_text())
    groups = {s["pid"] for s in state["servers"]}
    members = [p for p in psutil.process_iter() if _pgid(p) in groups]
    assert len(members) >= 5  # tritonserver and its python stubs, vLLM's processes, the gateway
    members.append(psutil.Process(state["keeper"]["pid"]))  # stopped first: nothing is started again
    down = rtxserve("serve", "down", path, state=runs)
    assert down.returncode == 0, down.stderr
    assert down.stderr.index("stopping the keeper") < down.stderr.index("stopping gateway")
    gone, alive = psutil.wait_procs(members, timeout=1)
    assert not alive, alive
    assert rtxserve("serve", "status", "box", state=runs).returncode == 3  # nothing runs
    nothing = rtxserve("serve", "status", state=runs)
    assert nothing.returncode == 3 and f"no deployment runs from {runs}" in nothing.stderr
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{box[0]}/healthz")


def _pgid(p):
    import os

    try:
        return os.getpgid(p.pid)
    except (ProcessLookupError, psutil.Error):
        return None
