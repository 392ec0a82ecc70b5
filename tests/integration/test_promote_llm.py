"""`rtxserve promote` of a LoRA adapter on the real vLLM behind the real gateway, under a real locust load of streamed
chats: the trained chat Llama's adapter v1 replaced by v2 (each exported with its reference set, each held to it by the
eval gate) with no request failed and no stream cut; v1 then unloaded from the engine and its name answered by v2."""

import contextlib
import io
import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from core.metric_names import REQUESTS
from export.llm.llm import LLMOptions, export_llm
from fixture_models.llm import adapter_answers, write_chat_adapter, write_chat_llm
from loadtest.runner import LoadSpec, run, scenario_options
from serve.gateway.access.keys_cli import main as keys_main
from serve.stack import start_gateway, start_vllm
from serve.vllm_server import VLLMOptions
from tests.conftest import built_once
from tests.integration import VLLM_EAGER, until

BASE, V1, V2 = "chat-llm", "support-v1", "support-v2"


def eval_set(path: Path, answers: dict[str, str]) -> Path:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}], "answer": a}) + "\n"
                            for q, a in answers.items()))
    return path


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    """vLLM serving the chat Llama with adapters v1 and v2 (each packaged by `rtxserve export llm` with a reference set
    of its own questions and answers), a gateway with an admin key and a rollout file."""
    work = tmp_path_factory.mktemp("promote-llm")
    base = built_once(tmp_path_factory, "chat-llm", write_chat_llm)
    packages = {}
    for version, name in ((1, V1), (2, V2)):
        adapter = built_once(tmp_path_factory, f"chat-adapter-v{version}",
                             lambda out, v=version: write_chat_adapter(base, out, v))
        export_llm(adapter, work / name, LLMOptions(eval_set=eval_set(work / f"{name}.jsonl", adapter_answers(version))))
        packages[name] = work / name
    keys, out = work / "keys.json", io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert keys_main(["--keys", str(keys), "create", "--name", "ops", "--admin"]) == 0
    vllm, vllm_url = start_vllm(VLLMOptions(model=base, served_name=BASE, adapters=packages, max_model_len=512,
                                            extra_args=VLLM_EAGER), work)
    try:
        gateway, url = start_gateway("", work, vllm_url=vllm_url, extra_env={
            "RTXSERVE_KEYS_FILE": str(keys), "RTXSERVE_ROLLOUT_FILE": str(work / "rollout.json")})
    except BaseException:
        vllm.stop()
        raise
    yield {"url": url, "vllm": vllm_url, "key": out.getvalue().strip(), "packages": packages, "work": work}
    gateway.stop()
    vllm.stop()


def _answered(url: str, model: str) -> float:
    """The requests the gateway has answered for `model`, by its own /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
               for s in family.samples if s.name == REQUESTS and s.labels.get("model") == model)


def test_an_adapter_is_promoted_under_streamed_chats_with_no_request_failed_and_no_stream_cut(box):
    options = scenario_options(scenario="chat", model=V1, api_key=box["key"], arrival="poisson", rate=2.0,
                               output_len=12)
    # The load runs until the promotion has ended (a fixed 35 s once ended before the canary on a busy box: the
    # candidate's eval gate ran long, and the steps met no traffic); 600 s is only a bound.
    done, promoted = {}, threading.Event()
    load = threading.Thread(target=lambda: done.setdefault("summary", run(
        LoadSpec(box["url"], options, users=4, duration_s=600, warmup_s=0), box["work"] / "load",
        log=lambda *_: None, stop_early=lambda row: "promoted" if promoted.is_set() else "").summary))
    load.start()
    try:
        # the promotion starts once v1 has answered the load (locust starting late on a busy box once met only v2)
        until(lambda: _answered(box["url"], V1) > 0, "the load's first answers from v1", limit_s=120)
        cli = subprocess.run(
            [sys.executable, "-m", "rtxserve.cli", "promote", box["url"], "--model", V1, "--to", V2, "--api-key",
             box["key"], "--candidate-reference", str(box["packages"][V2]), "--current-reference",
             str(box["packages"][V1]), "--out", str(box["work"] / "report"), "--shadow-seconds", "4", "--step-seconds",
             "4", "--canary", "50", "--rollback-window", "4", "--min-requests", "3", "--latency-margin", "4",
             "--latency-floor-ms", "100"], capture_output=True, text=True, timeout=300)
    finally:
        promoted.set()
        load.join()
    assert cli.returncode == 0, cli.stdout + cli.stderr
    summary = done["summary"]
    # every stream ran to vLLM's [DONE]: a stream cut short is a failed request in the load's own check
    assert summary.requests > 30 and summary.errors == 0, summary.error_kinds
    assert summary.streaming["requests"] == summary.requests
    assert summary.by_model[V1]["requests"] > 0 and summary.by_model[V2]["requests"] > 0
    report = json.loads((box["work"] / "report" / "promote.json").read_text())
    assert report["result"] == "promoted" and all(s["passed"] for s in report["steps"])
    canary = next(s for s in report["steps"] if s.get("weight") == 50)
    assert "not judged" not in canary["detail"], canary  # the canary met the load: v2 was judged on its answers
    gate = report["evals"]["candidate"]
    assert gate["passed"] and gate["gold"]["served"] == 1.0  # v2 answers its own questions as it was trained to
    assert "unloaded" in report["promotion"]["reason"]
    engine = {m["id"] for m in httpx.get(f"{box['vllm']}/v1/models", timeout=10).json()["data"]}
    assert V1 not in engine and V2 in engine  # v1's adapter left the engine
    r = httpx.post(f"{box['url']}/v1/chat/completions", headers={"Authorization": f"Bearer {box['key']}"}, timeout=60,
                   json={"model": V1, "messages": [{"role": "user", "content": "hello"}], "temperature": 0,
                         "max_tokens": 16})
    assert r.status_code == 200 and r.json()["model"] == V2
    assert r.json()["choices"][0]["message"]["content"].strip() == adapter_answers(2)["hello"]
