"""B8's report on canned figures (the real run is `rtxserve bench quantize`)."""

from bench.quantize import markdown, plot


def _form(size: int, increase: float | None, target: float | None, one: float, sixteen: float) -> dict:
    accuracy = None if increase is None else {"tokens": 400, "perplexity": {"reference": 10.0, "quantized": 10.0 * (1 + increase)},
                                              "perplexity_increase": increase, "top1_agreement": 0.97, "mean_kl": 0.002}
    return {"size_bytes": size, "accuracy": accuracy, "target": target,
            "tokens_per_s": {"1": one, "16": sixteen}, "rounds": {"1": [one, one], "16": [sixteen, sixteen]}}


def test_report_compares_each_form_with_float32_and_its_target(tmp_path):
    result = {"cpu": "test CPU; avx2", "rounds": 2, "duration_s": 6.0, "max_tokens": 64, "model": "the B4 model",
              "forms": {"float32": _form(232_000_000, None, None, 100.0, 800.0),
                        "w8a8-int8": _form(70_000_000, 0.004, 0.01, 150.0, 1000.0),
                        "w4a16": _form(40_000_000, 0.08, 0.05, 120.0, 700.0)}}
    text = markdown(result)
    assert "| float32 | 232.0 MB (1.00x) | reference |  |  | 100 (1.00x) | 800 (1.00x) |" in text
    assert "| w8a8-int8 | 70.0 MB (0.30x) | +0.40% (target ≤ 1%: met) | 97.0% | 0.002 | 150 (1.50x) | 1000 (1.25x) |" in text
    assert "+8.00% (target ≤ 5%: NOT met)" in text and "test CPU; avx2" in text
    assert plot(result, tmp_path / "b8.png").stat().st_size > 10_000
