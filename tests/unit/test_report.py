import math

import numpy as np
import pytest

from loadtest.report.pages import write_report
from core.slo import parse_slo
from loadtest.report.report import Samples, headline, load_samples, meets_slo, summarize

HEADER = "end,name,latency_ms,ok,error,ttft_ms,output_tokens,prompt_tokens,itl_ms,wait_ms\n"


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
    (tmp_path / "samples.csv").write_text(HEADER + "1000.010,classify,10.0,1,,,,,,\n"
                                          "1000.020,classify,20.0,0,HTTP 503: busy,,,,,\n1000.015,classify,12.0,1,,,,,,\n")
    samples = load_samples(tmp_path / "samples.csv")
    assert list(samples.latency_ms) == [10.0, 12.0, 20.0] and samples.errors == ["HTTP 503: busy"]
    md = write_report(summarize(samples), samples, tmp_path, "t")
    assert (tmp_path / "latency.png").read_bytes()[:4] == b"\x89PNG"
    assert "P99" in md.read_text() and (tmp_path / "report.json").exists()
    html = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64," in html and 'src="latency.png"' not in html  # self-contained
    assert "latency_ms.p99," in (tmp_path / "summary.csv").read_text()


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
    ttft[200], tokens[200], itl[200] = np.nan, 1.0, []  # an unstreamed answer: tokens, no TTFT, not a stream
    lat = np.where(np.isnan(ttft), 50.0, ttft + 30.0)
    s = summarize(_streamed(ttft, tokens, itl, lat, ok), warmup_s=1.0)
    st = s.streaming
    assert st["requests"] == 198
    assert st["ttft_ms"] == {"p50": 20.0, "p90": 20.0, "p99": 20.0}
    assert st["itl_ms"] == {"p50": 10.0, "p90": 10.0, "p99": 10.0}
    assert st["tpot_ms"]["p99"] == 10.0  # (50 - 20) / 3
    assert math.isclose(st["output_tokens_per_s"], 198 * 4 / s.duration_s)
    assert st["mean_output_tokens"] == 4
    assert s.errors == 1


def test_mixed_rows_load_and_a_streamed_report_shows_its_figures(tmp_path):
    (tmp_path / "samples.csv").write_text(HEADER +
        "1000.010,classify,10.0,1,,,,,,\n"
        "1000.100,chat,100.0,1,,20.000,4,7,10.000 30.000 40.000,\n"
        "1000.200,chat,90.0,0,wrong answer: stream cut: no [DONE],,,,,\n"
        "1000.300,chat,60.0,1,,,1,7,,\n"  # unstreamed: tokens, no TTFT
        "1000.150,chat,120.0,1,,40.000,5,7,20.000 20.000 20.000 20.000,\n"
        "1000.400,chat,80.0")  # a row cut short when locust was killed
    samples = load_samples(tmp_path / "samples.csv")
    assert list(samples.latency_ms) == [10.0, 100.0, 120.0, 90.0, 60.0]
    assert list(samples.streamed) == [False, True, True, False, False]
    assert np.array_equal(samples.ttft_ms, [np.nan, 20.0, 40.0, np.nan, np.nan], equal_nan=True)
    assert [list(g) for g in samples.itl_ms] == [[], [10.0, 30.0, 40.0], [20.0] * 4, [], []]
    assert samples.errors == ["wrong answer: stream cut: no [DONE]"]
    s = summarize(samples)
    assert s.streaming["ttft_ms"] == {"p50": 20.0, "p90": 40.0, "p99": 40.0}
    assert s.streaming["itl_ms"]["p50"] == 20.0 and s.streaming["itl_ms"]["p99"] == 40.0
    assert s.streaming["mean_output_tokens"] == 4.5
    md = write_report(s, samples, tmp_path, "t").read_text()
    assert "TTFT P50 20.0 ms, P99 40.0 ms" in md and "streaming.png" in md and "inter-token gap" in md
    assert (tmp_path / "streaming.png").read_bytes()[:4] == b"\x89PNG"


def test_plain_runs_have_no_streaming_section(tmp_path):
    (tmp_path / "samples.csv").write_text(HEADER + "1000.010,classify,10.0,1,,,,,,\n")
    samples = load_samples(tmp_path / "samples.csv")
    s = summarize(samples)
    assert samples.ttft_ms is None and s.streaming == {}
    md = write_report(s, samples, tmp_path, "t").read_text()
    assert "TTFT" not in md and not (tmp_path / "streaming.png").exists()


def test_goodput_counts_requests_within_every_limit_where_they_have_the_figure():
    # 4 streamed chat requests and 1 classify (no TTFT): the TTFT limit cannot apply to the classify one
    samples = _streamed([50, 150, 50, 50, np.nan], [5, 5, 5, 1, np.nan], [[10] * 4, [10] * 4, [90] * 4, [], []],
                        [100, 200, 400, 60, 30])
    assert parse_slo("ttft:100,e2el:300") == {"ttft": 100.0, "e2el": 300.0}
    assert list(meets_slo(samples, parse_slo("ttft:100,e2el:300"))) == [True, False, False, True, True]
    assert list(meets_slo(samples, parse_slo("itl:50"))) == [True, True, False, True, True]
    s = summarize(samples, slo=parse_slo("ttft:100,e2el:300"))
    assert s.goodput["good_requests"] == 3 and s.goodput["fraction"] == 3 / 5
    assert s.goodput["p99_ms"] == {"ttft": 150.0, "e2el": 400.0} and not s.goodput["p99_within_slo"]
    assert math.isclose(s.goodput["goodput_rps"], 3 / s.duration_s)


@pytest.mark.parametrize("bad", ["ttft", "ttft:0", "latency:5", "ttft:abc"])
def test_a_malformed_slo_names_what_is_accepted(bad):
    with pytest.raises(ValueError, match="e2el, ttft, tpot, itl"):
        parse_slo(bad)


def test_a_mixed_run_gets_figures_per_api_and_late_open_loop_arrivals_are_counted():
    samples = _samples([10.0, 20.0, 100.0, 200.0])
    samples.names = np.array(["classify", "classify", "chat", "chat"], dtype=object)
    samples.wait_ms = np.array([0.5, 0.2, 40.0, np.nan])
    s = summarize(samples)
    assert set(s.by_name) == {"classify", "chat"}
    assert s.by_name["classify"]["requests"] == 2 and s.by_name["chat"]["latency_ms"]["p50"] == 100.0
    assert s.late_arrivals == {"requests": 1, "of": 3, "max_wait_ms": 40.0, "late_ms": 10.0, "capped": 0}
    samples.cap_wait_ms = np.array([0.0, 0.0, 30.0, np.nan])  # 30 of its 40 ms late were the in-flight cap's
    assert summarize(samples).late_arrivals["capped"] == 1


def test_a_mixed_run_reads_per_api_in_the_headline_the_page_and_the_plot(tmp_path):
    from PIL import Image

    rows = "".join(f"{1000 + i * 0.05:.3f},classify,{20 + i % 3},1,,,,,,\n" for i in range(60))
    rows += "".join(f"{1000 + i * 0.5:.3f},chat,{1300 + 10 * i},1,,{100 + i},8,7,30 30,\n" for i in range(6))
    (tmp_path / "samples.csv").write_text(HEADER + rows)
    samples = load_samples(tmp_path / "samples.csv")
    s = summarize(samples)
    lines = headline(s).splitlines()
    assert lines[0].startswith("chat: P50 1320.0 ms, P99 1350.0 ms, QPS ") and lines[0].endswith(
        "errors 0/6; TTFT P50 102.0 ms, P99 105.0 ms")
    assert lines[1].startswith("classify: P50 21.0 ms, P99 22.0 ms, QPS ") and "TTFT" not in lines[1]
    md = write_report(s, samples, tmp_path, "mix").read_text()
    assert f"**{lines[0]}**  \n**{lines[1]}**" in md
    assert "| latency (pooled over all APIs: see per API below) | ms |" in md
    assert "| chat | 6 | 0 |" in md and "| 102.0 | 105.0 |" in md
    # one row of panels per API: twice the height of a run of one API
    one = tmp_path / "one"
    write_report(summarize(samples.where(samples.names == "classify")), samples.where(samples.names == "classify"),
                 one, "one")
    assert Image.open(tmp_path / "latency.png").height == 2 * Image.open(one / "latency.png").height


def test_compare_puts_every_figure_of_two_runs_side_by_side(tmp_path):
    from loadtest.report.compare import compare

    for name, latency in (("before", 20.0), ("after", 10.0)):
        samples = _samples([latency] * 200)
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "samples.csv", "w") as f:  # the raw samples the overlay is drawn from
            f.write(HEADER + "".join(f"{e:.6f},classify,{l},1,,,,,,\n" for e, l in zip(samples.end, samples.latency_ms)))
        write_report(summarize(samples), samples, tmp_path / name, name)
    md = compare(tmp_path / "before", tmp_path / "after", tmp_path / "cmp").read_text()
    assert "| latency_ms.p99 | 20 | 10 | -50.0% |" in md
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 10_000 and (tmp_path / "cmp" / "compare.html").exists()
    with pytest.raises(ValueError, match="neither a run"):
        compare(tmp_path / "before", tmp_path, tmp_path / "cmp")


def test_one_run_answered_by_two_models_is_split_and_compared_by_model(tmp_path):
    """Behind an alias each answer names its target: the report splits by it (failed requests name none and stay in
    the whole run's errors) and `compare` sets the two side by side from the one run."""
    from loadtest.report.compare import compare_models
    from loadtest.report.report import load_samples

    latency = {"v1": 20.0, "v2": 10.0}
    rows = [(f"{1000 + 0.01 * i:.6f}", "v1" if i % 4 else "v2", i % 10 != 9) for i in range(400)]
    with open(tmp_path / "samples.csv", "w") as f:
        f.write(HEADER.rstrip("\n") + ",images,detections,audio_s,process,model\n")
        f.writelines(f"{end},classify,{latency[m]},{int(ok)},{'' if ok else 'HTTP 503: x'},,,,,,,,,main,{m if ok else ''}\n"
                     for end, m, ok in rows)
    samples = load_samples(tmp_path / "samples.csv")
    summary = summarize(samples)
    assert summary.by_name == {}  # one API
    assert {m: (f["requests"], f["errors"]) for m, f in summary.by_model.items()} == {"v1": (260, 0), "v2": (100, 0)}
    assert summary.errors == 40 and summary.by_model["v2"]["latency_ms"]["p99"] == 10.0
    write_report(summary, samples, tmp_path, "canary")
    assert "model v1: P50 20.0 ms" in (tmp_path / "report.md").read_text()
    md = compare_models(tmp_path, tmp_path / "cmp").read_text()
    assert "# rtxserve compare: v1 → v2" in md and "| latency_ms.p99 | 20 | 10 | -50.0% |" in md
    assert "| latency_ms.p99 | 10 | 20 | +100.0% |" in compare_models(tmp_path, tmp_path / "back", ("v2", "v1")).read_text()
    with pytest.raises(ValueError, match="no answer of the run .* names v3"):
        compare_models(tmp_path, tmp_path / "cmp", ("v1", "v3"))
