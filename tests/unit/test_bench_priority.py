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
    assert f"| {MEASURED} | 30.0 / 50.0 | 45.0 / 55.0 | 1.5x / 1.1x | – / – | 36.0 | 28.0 | 31.0 | 0.903x |" in text
    assert "| ttft_p99_ratio <= 1.2x | 1.1x | met |" in text
    assert "| 8 | 38.0 / 130.0 | 1.267x / 2.6x | 32.0 | 1.032x |" in text
    assert plot(result, tmp_path / "b14.png").stat().st_size > 10_000


def _point(n: int, p99_ratio: float, share: float) -> dict:
    return {"batch_concurrency": n, "ttft_p50_ratio": p99_ratio, "ttft_p99_ratio": p99_ratio, "batch_share_of_left": share}


def test_the_frontier_names_the_least_share_that_meets_both_targets_or_says_why_none_does():
    from bench.priority import frontier_reading

    met = frontier_reading([_point(1, 1.1, 0.5), _point(2, 1.15, 0.85), _point(4, 1.19, 0.95), _point(8, 1.6, 1.0)])
    assert met.startswith("With 2 of the batch's requests in flight the box meets both targets") and \
        "`batch_concurrency: 2`" in met
    missed = frontier_reading([_point(8, 1.77, 0.9), _point(1, 1.8, 0.303), _point(4, 1.88, 0.6)])
    assert missed.startswith("No share of the engine meets both targets here. The least there is, 1 of the batch's")
    assert "TTFT P99 at 1.8x" in missed and "0.303x of what is left" in missed
    starved = frontier_reading([_point(1, 1.1, 0.29), _point(2, 1.42, 0.45), _point(8, 1.35, 1.2)])
    assert starved.startswith("No share of the engine meets both targets here. The shares that keep the users' TTFT "
                              "P99 within 1.2x alone give the batch at most 0.29x of what is left (1 in flight: P99 1.1x")
