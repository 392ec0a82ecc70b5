"""The arithmetic behind `rtxserve bench llm`: parameter counts, the roofline, GPU bandwidth lookup,
the interleaved B4 rounds and the G3 search (with a fake vLLM: the real one runs in integration)."""

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


def test_g3_is_a_loadtest_sweep_of_poisson_arrivals_under_a_ttft_slo(monkeypatch, tmp_path):
    import loadtest.sweep

    seen = {}

    def fake_sweep(spec, out, *, start, max_steps, log):
        seen.update(spec=spec, start=start)
        return loadtest.sweep.SweepResult([{"load": 8, "qps": 7.9}], {"max_load_within_slo": 8, "max_qps_within_slo": 7.9},
                                          out / "sweep.md", "h")

    monkeypatch.setattr(loadtest.sweep, "sweep", fake_sweep)
    result = llm.g3("http://x", "m", tmp_path, start_rate=2, progress=lambda m: None)
    spec = seen["spec"]
    assert spec.options["arrival"] == "poisson" and spec.options["scenario"] == "completions" and spec.slo == "ttft:500"
    assert seen["start"] == 2 and result["max_rate"] == 8 and result["max_qps"] == 7.9


def test_markdown_report_has_the_ratio_and_the_plot(tmp_path):
    b4 = {"ratio": 7.5, "target": 5.0, "median_tokens_per_s": {1: 10.0, 16: 75.0},
          "rounds": {1: [9.0, 10.0, 11.0], 16: [70.0, 75.0, 80.0]}}
    text = llm.markdown({"device": "CPU", "model": "m", "versions": {"vllm": "0.32.0"}, "B4": b4})
    assert "**B4 = 7.50x**" in text and "b4.png" in text
    assert llm.plot_b4(b4, tmp_path / "b4.png").read_bytes()[:4] == b"\x89PNG"
