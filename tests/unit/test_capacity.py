"""The capacity search's logic against a fake box (the runs faked: tests/integration/test_capacity.py runs real
locust against real Triton): ramp, bisect, confirm, the boxes' arithmetic, the answer when nothing holds, and the
early stop."""

import pytest

import loadtest.capacity as capacity
from loadtest.report.report import Summary
from loadtest.runner import LoadSpec, RunResult, scenario_options


class FakeBox:
    """A box whose P99 is 20 ms below `limit` requests/s and 900 ms above it (but on its `flake`-th run)."""

    def __init__(self, limit: float, flake: int = 0):
        self.limit, self.flake, self.rates = limit, flake, []

    def __call__(self, spec, out, log=None, stop_early=None):
        rate = spec.options["rate"]
        self.rates.append(rate)
        held = (rate <= self.limit) != (len(self.rates) == self.flake)
        p99 = 20.0 if held else 900.0
        summary = Summary(requests=round(rate * 10), errors=0, duration_s=10, qps=rate, sent_rps=rate,
                          latency_ms={"p50": p99 / 2, "p90": p99, "p99": p99}, warmup_s=0,
                          goodput={"p99_ms": {"e2el": p99}, "p99_within_slo": p99 <= 100, "goodput_rps": rate})
        out.mkdir(parents=True)
        return RunResult(summary, out / "report.md", out)


def _search(monkeypatch, tmp_path, box, **kw):
    monkeypatch.setattr(capacity, "run", box)
    monkeypatch.setattr(LoadSpec, "check", lambda self: None)
    spec = LoadSpec("http://box", scenario_options(model="m", arrival="poisson", rate=1.0), slo="e2el:100")
    return capacity.search(spec, tmp_path / "cap", log=lambda m: None, **kw)


def test_the_search_ramps_bisects_and_is_confirmed(monkeypatch, tmp_path):
    box = FakeBox(limit=13)
    result = _search(monkeypatch, tmp_path, box, target_rps=100, headroom=0.2)
    # ramp 1, 2, 4, 8, 16 (misses); bisect 12, 14 (misses), 13: within 10 % of 13; confirm 11.7 and 14.3
    assert box.rates == pytest.approx([1, 2, 4, 8, 16, 12, 14, 13, 11.7, 14.3])
    assert result.answer == 13 and [s["phase"] for s in result.steps][-2:] == ["confirm-0.9x", "confirm-1.1x"]
    assert "holds 13 requests/s" in result.headline and "confirmed: 0.9x holds, 1.1x misses" in result.headline
    # 100 / (13 x 0.8 = 10.4) = 9.6: 10 boxes
    assert result.boxes["boxes"] == 10 and "you need 10 such boxes" in result.headline
    page = (tmp_path / "cap" / "capacity.md").read_text()
    assert "= 9.62, rounded up: **10 boxes**" in page and (tmp_path / "cap" / "capacity.png").stat().st_size > 10_000


def test_a_noisy_box_is_said_to_be_noisy_and_a_box_that_holds_nothing_gets_no_answer(monkeypatch, tmp_path):
    noisy = _search(monkeypatch, tmp_path / "a", FakeBox(limit=13, flake=9))  # the 0.9x confirm run misses
    assert "the confirm runs disagree" in noisy.headline
    none = _search(monkeypatch, tmp_path / "b", FakeBox(limit=0.5))
    assert none.answer is None and len(none.steps) == 1
    assert none.headline.startswith("the lowest step, 1 req/s, already misses the SLO (P99 e2el ≤ 100 ms): P99 over")


def test_the_search_refuses_what_it_cannot_answer(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="needs an SLO"):
        capacity.search(LoadSpec("http://box", scenario_options(model="m", arrival="poisson", rate=1)), tmp_path)
    with pytest.raises(ValueError, match="--arrival poisson or gamma, or --trace"):
        capacity.search(LoadSpec("http://box", scenario_options(model="m"), slo="e2el:5"), tmp_path)


def test_a_step_is_stopped_early_only_after_three_readings_in_a_row():
    check = capacity.early_stop({"e2el": 100})
    row = lambda median, rps=10, failed=0: {"50%": str(median), "Requests/s": str(rps), "Failures/s": str(failed)}  # noqa: E731
    assert [check(row(m)) for m in (300, 300, 50, 300, 300)] == [""] * 5  # a good reading starts the count again
    assert "over twice the SLO's 100 ms for 3 s" in check(row(300))
    failing = capacity.early_stop({"ttft": 100})
    assert check({"50%": "N/A"}) == "" and [failing(row(5, 10, 8)) for _ in range(3)][-1].startswith("most requests")
