"""On-demand vLLM engines on a CPU, through the real gateway: two engines (two variants of the tiny Llama) with room
for one, each behind serve/engine_control.py, which answers vLLM's sleep API by stopping and starting the real
`vllm serve`. The first request wakes an engine; the other variant's request puts it to sleep, but never while a
stream on it runs: that request waits for the stream's end, and the stream gets every token."""

import json
import sys
import threading

import httpx
import pytest

from serve.launcher import ServerProcess
from serve.stack import free_port, start_gateway
from serve.vllm_server import VLLMOptions, vllm_command

from . import VLLM_EAGER, until

VARIANTS = ("variant-a", "variant-b")
TOKENS = 200


@pytest.fixture(scope="module")
def engines(llm_fixtures, tmp_path_factory):
    """(gateway URL, {variant: engine control URL}): both engines asleep at the start."""
    logs = tmp_path_factory.mktemp("on-demand-vllm")
    controls, urls, processes = {}, {}, []
    try:
        for name in VARIANTS:
            opts = VLLMOptions(model=llm_fixtures / "base", served_name=name, max_model_len=512, port=free_port(),
                               extra_args=VLLM_EAGER)
            argv, env = vllm_command(opts)
            urls[name], port = f"http://127.0.0.1:{opts.port}", free_port()
            controls[name] = f"http://127.0.0.1:{port}"
            control = ServerProcess(f"control-{name}", [sys.executable, "-m", "serve.engine_control", "--port", str(port),
                                                         "--engine-url", urls[name], "--log", str(logs / f"{name}.log"),
                                                         "--", *argv],
                                    env=env, log_path=logs / f"control-{name}.log", ready_url=f"{controls[name]}/health")
            processes.append(control.start(60))
        on_demand = {n: {"task": "text-generation", "gib": 3.0, "engine": urls[n]} for n in VARIANTS}
        gateway, url = start_gateway("", logs, vllm_url=",".join(urls.values()), extra_env={
            "RTXSERVE_ON_DEMAND": json.dumps(on_demand), "RTXSERVE_SWAP_ROOM_GIB": "3",
            "RTXSERVE_ENGINE_CONTROL": json.dumps({urls[n]: controls[n] for n in VARIANTS}),
            "RTXSERVE_LOAD_WAIT_S": "300", "RTXSERVE_HEALTH_INTERVAL_S": "0.5"})
        processes.append(gateway)
        yield url, controls
    finally:
        for process in reversed(processes):
            process.stop(60)


def sleeping(control: str) -> bool:
    return httpx.get(f"{control}/is_sleeping", timeout=10).json()["is_sleeping"]


def chat(url: str, model: str, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
        "model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, **extra})


def test_both_engines_start_asleep_and_the_gateway_is_ready(engines):
    url, controls = engines
    assert all(sleeping(c) for c in controls.values())
    assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
    listed = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
    assert listed["variant-a"]["task"] == "text-generation" and listed["variant-a"]["ready"] is False


def test_a_request_wakes_its_engine(engines):
    url, controls = engines
    answer = chat(url, "variant-a")
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "variant-a" and not sleeping(controls["variant-a"])


def test_the_other_variant_waits_for_a_running_stream_and_never_cuts_it(engines):
    url, controls = engines
    assert chat(url, "variant-a").status_code == 200  # awake, whatever ran before
    body = {"model": "variant-a", "messages": [{"role": "user", "content": "tell me"}], "max_tokens": TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    other: dict = {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["model"] == "variant-a"
        # variant-b needs the room variant-a holds while this stream runs: its load waits
        worker = threading.Thread(target=lambda: other.setdefault("answer", chat(url, "variant-b")))
        worker.start()
        states = lambda: {m["id"]: m.get("on_demand", {}).get("state")  # noqa: E731
                          for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
        until(lambda: states()["variant-b"] == "loading", "variant-b's load under way")
        assert not sleeping(controls["variant-a"])  # still serving this stream
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    worker.join(600)
    usage = events[-1]["usage"]
    finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    assert usage["completion_tokens"] == TOKENS and finish == ["length"]  # every token: the stream was not cut
    assert other["answer"].status_code == 200, other["answer"].text
    assert sleeping(controls["variant-a"]) and not sleeping(controls["variant-b"])
