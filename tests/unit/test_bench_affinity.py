"""B10's report on canned figures (the real run is `rtxserve bench affinity`: two vLLM engines, two gateways, caches
ample then scarce)."""

from bench.affinity import markdown, plot


def test_the_report_puts_both_routings_side_by_side_for_both_cache_sizes_with_the_targets(tmp_path):
    def run(hit, ttft):
        return {"hit_rate": hit, "ttft_p50_ms": ttft, "ttft_p90_ms": 2 * ttft, "ttft_p99_ms": 3 * ttft,
                "first_turn_ttft_p50_ms": 30.0, "requests": 48, "seconds": 2.0}

    def row(blocks, affinity, least):
        return {"blocks": blocks, "conversation_tokens": 700, "medians": {"affinity": affinity, "least busy": least},
                "runs": {"affinity": [affinity, affinity], "least busy": [least, least]}}

    result = {"model": "tiny", "conversations": 12, "turns": 4, "concurrency": 4, "rounds": 2,
              "rows": {"ample": row(None, run(0.9, 10.0), run(0.85, 9.0)), "scarce": row(11, run(0.8, 10.0), run(0.3, 20.0))},
              "scarce_ratios": {"hit_rate": 2.667, "ttft_p50_ms": 0.5, "ttft_p99_ms": 0.5},
              "verdict": {"hit_rate": True, "ttft_p50_ms": True, "ttft_p99_ms": True}}
    text = markdown(result)
    assert "| ample (vLLM's default) | affinity | 0.9 | 10.0 | 30.0 | 30.0 | 2.0 |" in text
    assert "| scarce (11 blocks of 128 tokens) | least busy | 0.3 | 20.0 | 60.0 |" in text
    assert "| hit_rate >= 2.0x | 2.667x | met |" in text and "holds 2 of the 4 conversations" in text
    assert plot(result, tmp_path / "b10.png").stat().st_size > 10_000
