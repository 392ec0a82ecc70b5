import math

import numpy as np
import pytest

from loadtest.report import Samples, load_samples, summarize, write_report


def _samples(latencies_ms, ok=None, start=1000.0, spacing=0.01):
    lat = np.asarray(latencies_ms, dtype=float)
    starts = start + spacing * np.arange(len(lat))
    ok = np.ones(len(lat), bool) if ok is None else np.asarray(ok)
    return Samples(end=starts + lat / 1000, latency_ms=lat, ok=ok, errors=["HTTP 503: x"] * int((~ok).sum()))


def test_percentiles_come_from_the_raw_samples():
    s = summarize(_samples(np.arange(1, 1001)))  # 1..1000 ms
    assert s.latency_ms["p50"] == 500 and s.latency_ms["p90"] == 900 and s.latency_ms["p99"] == 990
    assert s.latency_ms["p99.9"] == 999 and s.latency_ms["max"] == 1000
    assert s.requests == 1000 and s.errors == 0 and s.qps > 0


def test_warmup_is_excluded_and_errors_are_counted_not_timed():
    lat = [1000.0] * 100 + [10.0] * 900  # slow first second, then fast
    ok = np.ones(1000, bool)
    ok[500] = False
    s = summarize(_samples(lat, ok), warmup_s=1.0)
    assert s.requests == 900 and s.errors == 1
    assert s.latency_ms["p99"] == 10.0
    assert s.error_kinds == {"HTTP 503": 1}
    assert math.isclose(s.qps, 899 / s.duration_s)


def test_warmup_longer_than_the_run_is_an_error():
    with pytest.raises(ValueError, match="warm-up"):
        summarize(_samples([5.0] * 10), warmup_s=60)


def test_report_files_and_sample_loading(tmp_path):
    prefix = tmp_path / "samples.csv"
    (tmp_path / "samples.csv.1").write_text("1000.010,classify,10.0,1,\n1000.020,classify,20.0,0,HTTP 503: busy\n")
    (tmp_path / "samples.csv.2").write_text("1000.015,classify,12.0,1,\n")
    samples = load_samples(prefix)
    assert list(samples.latency_ms) == [10.0, 12.0, 20.0] and samples.errors == ["HTTP 503: busy"]
    md = write_report(summarize(samples), samples, tmp_path, "t")
    assert (tmp_path / "latency.png").read_bytes()[:4] == b"\x89PNG"
    assert "P99" in md.read_text() and (tmp_path / "report.json").exists()


def _streamed(ttft_ms, tokens, itl_ms, latency_ms, ok=None, spacing=0.01):
    samples = _samples(latency_ms, ok, spacing=spacing)
    samples.ttft_ms = np.asarray(ttft_ms, dtype=float)
    samples.output_tokens = np.asarray(tokens, dtype=float)
    samples.itl_ms = [np.asarray(g, dtype=float) for g in itl_ms]
    return samples


def test_streaming_figures_are_nearest_rank_over_raw_values():
    i = np.arange(1, 101)  # request i: TTFT i ms, 5 tokens, gaps i/10 (3x) and 3i/10 ms, latency 9i ms
    s = summarize(_streamed(i, [5] * 100, [[k / 10] * 3 + [3 * k / 10] for k in i], 9 * i))
    st = s.streaming
    assert st["ttft_ms"] == {"p50": 50, "p90": 90, "p99": 99}
    # over all 400 gaps pooled (ranks 200, 360, 396), not over per-request means
    assert st["itl_ms"] == {"p50": 6.0, "p90": 18.0, "p99": 28.8}
    assert st["tpot_ms"] == {"p50": 100, "p90": 180, "p99": 198}  # (9i - i) / (5 - 1)
    # tokens/s per request is 5000 / 9i, so rank 50 (ascending) is i = 51, rank 90 is i = 11, rank 99 is i = 2
    per_request = st["output_tokens_per_s_per_request"]
    assert per_request == pytest.approx({"p50": 5000 / 459, "p90": 5000 / 99, "p99": 5000 / 18})
    window = max(0.01 * (k - 1) + 9 * k / 1000 for k in i)
    assert math.isclose(s.duration_s, window)
    assert math.isclose(st["output_tokens_per_s"], 500 / window)
    assert st["mean_output_tokens"] == 5 and st["requests"] == 100
    assert s.latency_ms["p50"] == 450  # the plain figures stay as they were


def test_streaming_figures_skip_warmup_failures_and_untimed_requests():
    n = 300  # 0.01 s apart: the first 100 start in the 1 s warm-up
    ttft = np.array([5000.0] * 100 + [20.0] * 200)
    tokens = np.full(n, 4.0)
    itl = [[500.0] * 3] * 100 + [[10.0] * 3] * 200
    ok = np.ones(n, bool)
    ok[150] = False  # a failure: its figures, whatever they say, do not count
    ttft[150], tokens[150], itl[150] = 9999.0, 100.0, [9999.0]
    ttft[200], tokens[200], itl[200] = np.nan, 1.0, []  # one token, no text: counts as tokens, has no TTFT
    lat = np.where(np.isnan(ttft), 50.0, ttft + 30.0)
    s = summarize(_streamed(ttft, tokens, itl, lat, ok), warmup_s=1.0)
    st = s.streaming
    assert st["requests"] == 199
    assert st["ttft_ms"] == {"p50": 20.0, "p90": 20.0, "p99": 20.0}
    assert st["itl_ms"] == {"p50": 10.0, "p90": 10.0, "p99": 10.0}
    assert st["tpot_ms"]["p99"] == 10.0  # (50 - 20) / 3; the 1-token request has none
    assert math.isclose(st["output_tokens_per_s"], (198 * 4 + 1) / s.duration_s)
    assert math.isclose(st["mean_output_tokens"], (198 * 4 + 1) / 199)
    assert s.errors == 1


def test_mixed_rows_load_and_a_streamed_report_shows_its_figures(tmp_path):
    (tmp_path / "samples.csv.1").write_text(
        "1000.010,classify,10.0,1,\n"
        "1000.100,chat,100.0,1,,20.000,4,10.000 30.000 40.000\n"
        "1000.200,chat,90.0,0,stream cut: no [DONE]\n"
        "1000.300,chat,60.0,1,,,1,\n"
        "1000.400,chat,80.0,1,,30.0")  # a row cut short when locust was stopped
    (tmp_path / "samples.csv.2").write_text("1000.150,chat,120.0,1,,40.000,5,20.000 20.000 20.000 20.000\n")
    samples = load_samples(tmp_path / "samples.csv")
    assert list(samples.latency_ms) == [10.0, 100.0, 120.0, 90.0, 60.0]
    assert list(samples.streamed) == [False, True, True, False, True]
    assert np.array_equal(samples.ttft_ms, [np.nan, 20.0, 40.0, np.nan, np.nan], equal_nan=True)
    assert [list(g) for g in samples.itl_ms] == [[], [10.0, 30.0, 40.0], [20.0] * 4, [], []]
    assert samples.errors == ["stream cut: no [DONE]"]
    s = summarize(samples)
    assert s.streaming["ttft_ms"] == {"p50": 20.0, "p90": 40.0, "p99": 40.0}
    assert s.streaming["itl_ms"]["p50"] == 20.0 and s.streaming["itl_ms"]["p99"] == 40.0
    assert s.streaming["mean_output_tokens"] == 10 / 3
    md = write_report(s, samples, tmp_path, "t").read_text()
    assert "TTFT P50 20.0 ms, P99 40.0 ms" in md and "streaming.png" in md and "inter-token gap" in md
    assert (tmp_path / "streaming.png").read_bytes()[:4] == b"\x89PNG"


def test_plain_runs_have_no_streaming_section(tmp_path):
    (tmp_path / "samples.csv.1").write_text("1000.010,classify,10.0,1,\n")
    samples = load_samples(tmp_path / "samples.csv")
    s = summarize(samples)
    assert samples.ttft_ms is None and s.streaming == {}
    md = write_report(s, samples, tmp_path, "t").read_text()
    assert "TTFT" not in md and not (tmp_path / "streaming.png").exists()
