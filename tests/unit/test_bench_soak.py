"""R18's verdict and report on canned windows (the real run is `rtxserve bench soak`)."""

import json

import pytest

from bench.soak import markdown, plot, verdict


def windows(rss=lambda i: 100.0, fds=lambda i: 40, p99=lambda i: 20.0, n=30, codes=None):
    return [{"t_s": 10.0 * (i + 1), "rss_mb": rss(i), "fds": fds(i), "p99_ms": p99(i), "p50_ms": 5.0, "qps": 200.0,
             "codes": codes or {"200": 1900, "422": 100}} for i in range(n)]


def test_a_steady_gateway_passes():
    v = verdict(windows(rss=lambda i: 100 + (i % 3) * 0.5))  # noise, no trend
    assert v["passed"] and v["rss_flat"] and v["fds_flat"] and v["p99_drift_ok"]
    assert json.loads(json.dumps(v)) == v  # saved as soak.json


@pytest.mark.parametrize("kind, ws", [
    ("rss_flat", windows(rss=lambda i: 100 + 0.5 * i)),  # +0.5 MB per window: a leak
    ("fds_flat", windows(fds=lambda i: 40 + i // 5)),  # a descriptor kept every 50 s
    ("p99_drift_ok", windows(p99=lambda i: 20 + 0.3 * i)),  # latency creeping up
])
def test_each_kind_of_decay_fails_its_own_check(kind, ws):
    v = verdict(ws)
    assert not v[kind] and not v["passed"]
    assert [k for k in ("rss_flat", "fds_flat", "p99_drift_ok") if not v[k]] == [kind]


def test_the_warm_up_is_not_judged_getting_faster_is_no_drift_and_unexpected_answers_fail():
    assert verdict(windows(p99=lambda i: 30 - 0.3 * i))["p99_drift_ok"]
    v = verdict(windows(rss=lambda i: 60 + 8 * i if i < 6 else 100))  # grows while warming up, then flat
    assert v["rss_flat"]
    assert not verdict(windows(codes={"200": 10, "500": 1}))["passed"]
    with pytest.raises(ValueError, match="run longer"):
        verdict(windows(n=2))


def test_report_and_plot(tmp_path):
    ws = windows()
    result = {"duration_s": 300, "concurrency": 8, "gateway_workers": 1, "model": "m", "windows": ws, "verdict": verdict(ws)}
    assert "| P99 drift | 20.0 -> 20.0 ms (+0.0%) | at most +10% | met |" in markdown(result)
    plot(result, tmp_path / "soak.png")
    assert (tmp_path / "soak.png").stat().st_size > 10_000
