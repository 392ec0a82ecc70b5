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
        return {"qps": qps, "p50_ms": 9.0, "p99_ms": 20.0, "errors": 0, "client_cpu_ms": 0.4, "gateway_cpu_ms": 0.5,
                "triton_cpu_ms": round(600 / qps, 3)}

    result = {"target": 1.5, "cpu": "EPYC; avx2", "rounds": 2, "duration_s": 8.0, "concurrency": 8, "repeats": 0.5,
              "hit_rates": {"gateway-cache": 0.48, "triton-cache": None}, "gateway-cache": entry(900.0),
              "triton-cache": entry(700.0), "uncached": entry(600.0), "qps_ratio": 1.5, "triton_qps_ratio": 1.167,
              "per_round": {name: [entry(q - 10), entry(q + 10)] for name, q in
                            (("gateway-cache", 900.0), ("triton-cache", 700.0), ("uncached", 600.0))}}
    text = markdown(result)
    assert "| gateway-cache | 900.0 | 9.0 | 20.0 | 0 | 48% | 0.4 / 0.5 / 0.667 |" in text
    assert "| triton-cache | 700.0 | 9.0 | 20.0 | 0 | – | 0.4 / 0.5 / 0.857 |" in text
    assert "CPU-ms a request: client / gateway / triton" in text
    assert "**1.5** (target >= 1.5)" in text and "with Triton's:\n1.167" in text
    assert plot(result, tmp_path / "b9.png").stat().st_size > 10_000
