"""The arithmetic behind `rtxserve bench llm`: parameter counts, the roofline, GPU bandwidth lookup,
the interleaved B4 rounds and the G3 search (with a fake vLLM: the real one runs in integration)."""

import asyncio
import math

import pytest

from bench import llm


def test_llama_8b_shape_has_8_billion_parameters():
    # Llama-3-8B: 8,030,261,248 parameters (untied embeddings and head).
    assert llm.llama_params(llm.LLAMA_8B) == 8_030_261_248


def test_roofline_fraction():
    figures = llm.roofline(tokens_per_s=150.0, bandwidth_gbs=3350, weight_bytes=16_060_522_496)
    assert math.isclose(figures["roofline_tokens_per_s"], 3350e9 / 16_060_522_496)
    assert math.isclose(figures["fraction"], 150.0 / figures["roofline_tokens_per_s"])


@pytest.mark.parametrize("name, expected", [
    ("NVIDIA H100 80GB HBM3", 3350), ("NVIDIA H100 PCIe", 2000), ("NVIDIA H200", 4800),
    ("NVIDIA GeForce RTX 4090", 1008), ("Tesla T4", None),
])
def test_bandwidth_from_the_gpu_name(name, expected):
    assert llm.gpu_bandwidth_gbs(name) == expected


def test_b4_interleaves_levels_and_takes_medians(monkeypatch):
    calls = []

    async def fake_closed_loop(url, model, streams, duration_s, max_tokens, prompts):
        calls.append(streams)
        rate = {1: 10.0, 16: 80.0}.get(streams, 30.0) + len(calls) * 0.01
        return {"streams": streams, "requests": 1, "tokens": 1, "wall_s": 1.0, "tokens_per_s": rate}

    monkeypatch.setattr(llm, "closed_loop", fake_closed_loop)
    result = llm.b4("http://x", "m", levels=(1, 16), rounds=3, progress=lambda m: None)
    assert calls == [16, 1, 16, 16, 1, 1, 16]  # warm-up, then 1,16 / 16,1 / 1,16
    assert result["median_tokens_per_s"][1] == pytest.approx(10.05)
    assert result["ratio"] == pytest.approx(result["median_tokens_per_s"][16] / result["median_tokens_per_s"][1])
    with pytest.raises(ValueError):
        llm.b4("http://x", "m", levels=(1, 8))


def test_g3_doubles_until_the_slo_breaks_then_bisects(monkeypatch):
    async def fake_open_loop(url, model, rate, duration_s, max_tokens, prompts, seed=0):
        ttft = 0.1 if rate <= 10 else 0.9  # the server keeps up to 10 req/s
        return [llm.Completion(True, 8, ttft, 1.0)] * 100

    monkeypatch.setattr(llm, "open_loop", fake_open_loop)
    result = llm.g3("http://x", "m", start_rate=2, progress=lambda m: None)
    assert [s["rate"] for s in result["steps"]] == [2, 4, 8, 16, 12]
    assert result["max_qps"] == 8


def test_open_loop_sends_poisson_arrivals_at_the_rate(monkeypatch):
    sent = []

    async def fake_complete(client, url, model, prompt, max_tokens):
        sent.append(asyncio.get_running_loop().time())
        return llm.Completion(True, 1, 0.0, 0.0)

    monkeypatch.setattr(llm, "complete", fake_complete)
    results = asyncio.run(llm.open_loop("http://x", "m", rate=200, duration_s=1.0, max_tokens=1, prompts=["p"]))
    assert 140 < len(results) < 260  # Poisson(200): 6 standard deviations either side
    gaps = [b - a for a, b in zip(sent, sent[1:])]
    assert max(gaps) > 3 * (sum(gaps) / len(gaps))  # exponential gaps, not a fixed beat


def test_markdown_report_has_the_ratio_and_the_plot(tmp_path):
    b4 = {"ratio": 7.5, "target": 5.0, "median_tokens_per_s": {1: 10.0, 16: 75.0},
          "rounds": {1: [9.0, 10.0, 11.0], 16: [70.0, 75.0, 80.0]}}
    text = llm.markdown({"device": "CPU", "model": "m", "versions": {"vllm": "0.32.0"}, "B4": b4})
    assert "**B4 = 7.50x**" in text and "b4.png" in text
    assert llm.plot_b4(b4, tmp_path / "b4.png").read_bytes()[:4] == b"\x89PNG"
