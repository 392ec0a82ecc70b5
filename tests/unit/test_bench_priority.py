"""B14's report on canned figures (the real run is `rtxserve bench priority`): each row, the verdicts read off the box
defaults, and the frontier of the batch's share of the engine."""

from bench.priority import FRONTIER, MEASURED, ROWS, markdown, plot


def _users(p50: float, p99: float) -> dict:
    return {"ttft_p50_ms": p50, "ttft_p99_ms": p99, "rps": 5.0, "ttfts_ms": [p50] * 98 + [p99, p99]}


def test_the_page_gives_each_row_the_verdicts_and_the_frontier(tmp_path):
    row = {"users_alone": _users(30.0, 50.0), "users_beside": _users(45.0, 55.0), "batch_alone": {"rps": 36.0},
           "batch_beside": {"rps": 28.0}, "ttft_p50_ratio": 1.5, "ttft_p99_ratio": 1.1, "left_rps": 31.0,
           "batch_share_of_left": 0.903}
    frontier = [{"batch_concurrency": n, "ttft_p50_ms": 30.0 + n, "ttft_p99_ms": 50.0 + 10 * n,
                 "ttft_p50_ratio": round((30.0 + n) / 30, 3), "ttft_p99_ratio": round((50.0 + 10 * n) / 50, 3),
                 "batch_rps": 4.0 * n, "batch_share_of_left": round(4.0 * n / 31, 3)} for n in FRONTIER]
    result = {"model": "fixture Llama", "machine": "AMD EPYC; avx2", "users": 2, "max_tokens": 16, "think_s": 0.25,
              "batch": 1000, "batch_concurrency": None, "rows": {name: row for name in ROWS}, "frontier": frontier,
              "verdict": {"ttft_p99_ratio": True, "batch_share_of_left": True}}
    text = markdown(result)
    assert f"| {MEASURED} | 30.0 / 50.0 | 45.0 / 55.0 | 1.5x / 1.1x | 36.0 | 28.0 | 31.0 | 0.903x |" in text
    assert "| ttft_p99_ratio <= 1.2x | 1.1x | met |" in text
    assert "| 8 | 38.0 / 130.0 | 1.267x / 2.6x | 32.0 | 1.032x |" in text
    assert plot(result, tmp_path / "b14.png").stat().st_size > 10_000
