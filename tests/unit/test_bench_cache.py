"""B9's inputs, arithmetic and report on canned figures (the real run is `rtxserve bench cache`)."""

import itertools

from bench.cache import REPEATED, _texts, markdown, plot


def test_the_inputs_repeat_as_often_as_asked_and_are_otherwise_new():
    texts = list(itertools.islice(_texts(0.5, seed=1), 4000))
    repeated = sum(t in REPEATED for t in texts)
    assert 1800 < repeated < 2200  # 0.5 of 4000, binomial: 6 standard deviations either side
    new = [t for t in texts if t not in REPEATED]
    assert len(set(new)) == len(new)
    assert not any(t in REPEATED for t in itertools.islice(_texts(0.0, seed=2), 500))


def test_report_states_the_ratio_against_the_target(tmp_path):
    def entry(qps):
        return {"qps": qps, "p50_ms": 9.0, "p99_ms": 20.0, "errors": 0}

    result = {"target": 1.5, "cpu": "EPYC; avx2", "rounds": 2, "duration_s": 8.0, "concurrency": 8, "repeats": 0.5,
              "hit_rate": 0.48, "cached": entry(900.0), "uncached": entry(600.0), "qps_ratio": 1.5,
              "per_round": {"cached": [entry(880.0), entry(920.0)], "uncached": [entry(590.0), entry(610.0)]}}
    text = markdown(result)
    assert "| cached | 900.0 | 9.0 | 20.0 | 0 |" in text and "**1.5** (target >= 1.5)" in text and "48%" in text
    assert plot(result, tmp_path / "b9.png").stat().st_size > 10_000
