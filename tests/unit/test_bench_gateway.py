"""B1's arithmetic and report on canned samples (the real run is `rtxserve bench gateway`)."""

import numpy as np

from bench.gateway import _plot, latency_summary, markdown


def test_percentiles_come_from_every_sample_and_errors_are_counted():
    s = latency_summary(list(np.arange(1, 1001, dtype=float)), errors=3, seconds=2.0)
    assert s["p50_ms"] == 500.5 and s["p99_ms"] == 990.01 and s["qps"] == 500.0 and s["errors"] == 3


def test_report_states_ratios_against_targets_beside_the_plain_proxy(tmp_path):
    gw = {"p50_ms": 12, "p90_ms": 15, "p99_ms": 23, "p99.9_ms": 30, "qps": 450, "errors": 0, "cpu_ms_per_request": 0.8}
    proxy = {"p50_ms": 10.4, "p90_ms": 13, "p99_ms": 21, "p99.9_ms": 26, "qps": 490, "errors": 0,
             "cpu_ms_per_request": 0.1}
    direct = {"p50_ms": 10, "p90_ms": 13, "p99_ms": 20, "p99.9_ms": 25, "qps": 500, "errors": 0}
    level = {"concurrency": 8, "medians": {"gateway": gw, "proxy": proxy, "direct": direct}, "p99_ratio": 1.15,
             "qps_ratio": 0.9, "p50_added_ms": 2, "proxy_p50_added_ms": 0.4, "qps_vs_proxy": 0.918,
             "cpu_ms_per_request": 0.8}
    text = markdown({"model": "m", "gateway_workers": 1, "rounds": 3, "duration_s": 8, "cpu": "EPYC; avx2",
                     "levels": [level], "verdict": {"qps_vs_proxy": False, "p50_added_ms": False,
                                                    "cpu_ms_per_request": False}})
    assert "| 8 | 1.15 | 0.9 | 2 / 0.4 | 0.8 / 0.1 |" in text and "| 8 | gateway | 12 |" in text
    assert "| qps_vs_proxy >= 0.95 | 0.918 | **missed** |" in text and "| cpu_ms_per_request <= 0.3 | 0.8 |" in text
    assert "| 8 | proxy | 10.4 |" in text and "CPU: EPYC; avx2" in text
    _plot([{**level, "samples": {"gateway": [12.0, 13.0], "proxy": [10.5, 11.0], "direct": [10.0, 11.0]}}],
          tmp_path / "b1.png")
    assert (tmp_path / "b1.png").stat().st_size > 10_000


def test_b1s_judges_the_served_targets_on_the_layout_serve_up_runs_here(monkeypatch):
    """On a small box `serve up` runs the engine in two processes, B1s's `core` layout: it alone is measured by
    default, judged on both target sets; on a bigger box the three-process layout is measured too and carries the
    served targets."""
    import os

    from bench.streams import TARGETS, default_layouts, served_layout, targets
    from serve.vllm_server import SMALL_BOX_CORES

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)))
    assert (served_layout(), default_layouts()) == ("core", ("core",))
    assert targets("core") == TARGETS["core"] + TARGETS["served"] and targets("three") == ()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(SMALL_BOX_CORES + 1)))
    assert (served_layout(), default_layouts()) == ("three", ("core", "three"))
    assert targets("core") == TARGETS["core"] and targets("three") == TARGETS["served"]


def test_streams_report_states_the_gap_to_the_plain_proxy(tmp_path):
    from bench.streams import TARGETS, markdown as streams_markdown, plot

    def path(ttft, tokens):
        return {"ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft, "itl_p50_ms": 20.0, "itl_p99_ms": 40.0, "output_tokens_s": tokens}

    medians = {"direct": path(50.0, 300.0), "proxy": path(52.0, 298.0), "gateway": path(60.5, 290.0)}
    level = {"concurrency": 4, "medians": medians, "ttft_p50_over_proxy_ms": 8.5, "tokens_s_vs_proxy": 0.973,
             "rounds": {p: {k: [v, v] for k, v in m.items()} for p, m in medians.items()}}
    result = {"model": "m", "input_len": 60, "output_len": 64, "prompts": 100, "rounds": 2, "levels": [level],
              "layout": "core", "verdict": {"tokens_s_vs_proxy": True, "ttft_p50_over_proxy_ms": False}}
    text = streams_markdown(result)
    assert "| tokens_s_vs_proxy >= 0.97 | 0.973 | met |" in text and "| ttft_p50_over_proxy_ms <= 5 | 8.5 | **missed** |" in text
    assert "| 4 | +8.5 | 0.973 |" in text and "| 4 | gateway | 60.5 | 121.0 | 20.0 | 40.0 | 290.0 |" in text
    assert plot(result, tmp_path / "b1s.png").stat().st_size > 10_000
    assert "LiteLLM's proxy was not measured" in text
    # with the peer measured in the same rounds: its row, and the gateway against it
    medians["litellm"] = path(70.0, 250.0)
    level |= {"ttft_p50_over_litellm_ms": -9.5, "tokens_s_vs_litellm": 1.16,
              "rounds": {p: {k: [v, v] for k, v in m.items()} for p, m in medians.items()}}
    text = streams_markdown(result | {"litellm": "1.108.7", "layout": "three", "targets": TARGETS["served"],
                                      "verdict": {"any": True}})
    assert "| tokens_s_vs_litellm > 1 | 1.16 | met |" in text and "b1s-three.png" in text
    assert "| tokens_s_vs_proxy >= 0.9 | 0.973 | met |" in text and "0.97 |" not in text
    # the layout `serve up` runs here judged on both: core's targets and the served ones, each its own row
    text = streams_markdown(result | {"litellm": "1.108.7", "targets": TARGETS["core"] + TARGETS["served"],
                                      "verdict": {"any": True}})
    assert "| tokens_s_vs_proxy >= 0.97 | 0.973 | met |" in text and "| tokens_s_vs_proxy >= 0.9 | 0.973 | met |" in text
    # each front end's CPU per 1,000 tokens, and where the gateway's went
    medians["gateway"]["cpu_ms_per_1k_tokens"] = 41.5
    profiled = {"concurrency": 4, "seconds": 10, "streams": 80, "samples": 900, "parts": {"HTTP client (aiohttp)": 30.0},
                "under_own_files": {"serve/gateway/backends/vllm.py": 20.0}, "top": [("f (x.py:1)", 5.0)]}
    text = streams_markdown(result | {"litellm": "1.108.7", "profile": profiled})
    assert "| 4 | gateway | 60.5 | 121.0 | 20.0 | 40.0 | 290.0 |  | 41.5 |" in text
    assert "relaying 4 streams at a time, 10 s, 80 streams" in text and "| HTTP client (aiohttp) | 30.0 % |" in text
    assert "| 4 | +8.5 | 0.973 | -9.5 | 1.16 |" in text and "| 4 | litellm | 70.0 |" in text and "LiteLLM 1.108.7" in text
    assert plot(result, tmp_path / "b1s-peer.png").stat().st_size > 10_000
