"""A short real locust run of streamed chat through the real gateway and vLLM: TTFT, ITL and tokens/s."""

import json
import math

import numpy as np

from loadtest.report import headline, load_samples
from loadtest.runner import run


def test_streamed_chat_run_reports_ttft_itl_and_tokens_per_second(llm_gateway, tmp_path):
    result = run("chat", llm_gateway, tmp_path / "report", users=4, duration_s=8, warmup_s=1,
                 env={"RTXSERVE_MODEL": "adapter-a", "RTXSERVE_MAX_TOKENS": "16"}, log=lambda m: None)
    s, st = result.summary, result.summary.streaming
    print(headline(s))  # shown with -s: the figures of this run
    assert s.requests > 0 and s.errors == 0, s.error_kinds
    assert st["requests"] == s.requests
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "output_tokens_per_s_per_request"):
        figures = st[name]
        assert set(figures) == {"p50", "p90", "p99"}, (name, figures)
        assert all(math.isfinite(v) and v > 0 for v in figures.values()), (name, figures)
        assert figures["p50"] <= figures["p90"] <= figures["p99"], (name, figures)
    samples = load_samples(tmp_path / "report" / "samples.csv")
    timed = np.isfinite(samples.ttft_ms)
    assert timed.sum() > 0 and (samples.ttft_ms[timed] < samples.latency_ms[timed]).all()
    assert 0 < st["mean_output_tokens"] <= 16 and st["output_tokens_per_s"] > 0
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["streaming"] == st
    assert (tmp_path / "report" / "streaming.png").stat().st_size > 10_000
    assert "TTFT P50" in result.report.read_text()


def test_unknown_model_fails_every_request_with_its_status(llm_gateway, tmp_path):
    result = run("chat", llm_gateway, tmp_path / "report", users=2, duration_s=3, warmup_s=0.5,
                 env={"RTXSERVE_MODEL": "no-such-model"}, log=lambda m: None)
    assert result.summary.errors == result.summary.requests > 0
    assert result.summary.error_kinds == {"HTTP 404": result.summary.errors}
    assert result.summary.streaming == {}
