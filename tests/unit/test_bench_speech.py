"""B11's report on canned figures (the real run is `rtxserve bench speech`)."""

from bench.speech import markdown, plot


def test_report_gives_the_real_time_factor_per_level(tmp_path):
    figures = {"1": {"rtf": 4.2, "rtf_p50": 4.4, "p50_ms": 560.0, "p99_ms": 700.0, "requests": 20, "errors": 0},
               "4": {"rtf": 9.5, "rtf_p50": 2.5, "p50_ms": 1000.0, "p99_ms": 1400.0, "requests": 45, "errors": 0}}
    result = {"cpu": "test CPU; avx2", "rounds": 2, "duration_s": 10.0, "model": "fixture Whisper", "users": figures,
              "per_round": {n: [f, f] for n, f in figures.items()}}
    text = markdown(result)
    assert "| 4 | 9.50 | 2.50 | 1000 | 1400 | 0 |" in text and "test CPU; avx2" in text
    assert plot(result, tmp_path / "b11.png").stat().st_size > 10_000
