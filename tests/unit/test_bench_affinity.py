"""B10's report on canned figures (the real run is `rtxserve bench affinity`: two vLLM engines, two gateways)."""

from bench.affinity import markdown, plot


def test_the_report_puts_both_routings_side_by_side(tmp_path):
    def run(hit, ttft):
        return {"hit_rate": hit, "ttft_p50_ms": ttft, "ttft_p90_ms": 2 * ttft, "first_turn_ttft_p50_ms": 30.0,
                "requests": 48, "seconds": 2.0}

    result = {"model": "tiny", "conversations": 12, "turns": 4, "concurrency": 4, "rounds": 2,
              "medians": {"affinity": run(0.9, 10.0), "least busy": run(0.6, 20.0)},
              "runs": {"affinity": [run(0.89, 9.0), run(0.91, 11.0)], "least busy": [run(0.58, 19.0), run(0.62, 21.0)]}}
    text = markdown(result)
    assert "| affinity | 0.9 | 10.0 | 20.0 | 30.0 | 2.0 |" in text and "| least busy | 0.6 | 20.0 |" in text
    assert plot(result, tmp_path / "b10.png").stat().st_size > 10_000
