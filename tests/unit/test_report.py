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
