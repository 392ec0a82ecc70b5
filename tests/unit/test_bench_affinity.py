"""B10's report on canned figures (the real run is `rtxserve bench affinity`: vLLM engines, two gateways, caches
ample on two engines, then scarce on two and on three)."""

from bench.affinity import _judged, ceiling, markdown, plot, scarce_blocks


def test_the_report_puts_both_routings_side_by_side_for_each_row_with_the_targets_per_scarce_row(tmp_path):
    def run(hit, ttft):
        return {"hit_rate": hit, "ttft_p50_ms": ttft, "ttft_p90_ms": 2 * ttft, "ttft_p99_ms": 3 * ttft,
                "first_turn_ttft_p50_ms": 30.0, "requests": 48, "seconds": 2.0, "spilled": None}

    def row(blocks, replicas, affinity, least):
        return {"caches": "scarce" if blocks else "ample", "replicas": replicas, "blocks": blocks,
                "shared_tokens": 12, "first_turn_tokens": 600, "conversation_tokens": 700, "ceiling": 0.8, "medians": {"affinity": affinity, "least busy": least},
                "runs": {"affinity": [affinity, affinity], "least busy": [least, least]}}

    result = {"model": "tiny", "conversations": 12, "turns": 4, "concurrency": 4, "rounds": 2,
              "rows": [row(None, 2, {**run(0.9, 10.0), "spilled": 0.125}, run(0.85, 9.0)),
                       _judged(row(11, 2, run(0.8, 10.0), run(0.5, 20.0))),
                       _judged(row(11, 3, run(0.8, 10.0), run(0.3, 12.0)))]}
    text = markdown(result)
    assert "| ample, 2 engines (vLLM's default) | affinity | 0.9 | 10.0 | 30.0 | 30.0 | 12% | 2.0 |" in text
    assert "| ample, 2 engines (vLLM's default) | least busy | 0.85 | 9.0 | 27.0 | 30.0 | – | 2.0 |" in text
    assert "| scarce, 3 engines (11 blocks of 128 tokens) | least busy | 0.3 | 12.0 | 36.0 |" in text
    assert "| target (scarce caches, affinity / least busy) | scarce, 2 engines | scarce, 3 engines |" in text
    assert "| hit_rate >= 2.0x | 1.6x (**missed**) | 2.667x (met) |" in text
    assert "| ttft_p50_ms <= 0.8x | 0.5x (met) | 0.833x (**missed**) |" in text
    assert "holds its share of the 4 conversations running at once (2 on 2 engines, 2 on 3 engines;" in text
    assert "first turn is 600 tokens, 12 of them the system prompt that all share" in text
    assert ("The most any routing could hit here is 0.8" in text and "A 2x ratio asks affinity for twice least "
            "busy's hit rate: 125% of that ceiling on 2 engines (affinity reached 100%), 75% of that ceiling on 3 "
            "engines (affinity reached 100%)." in text)
    assert "Least busy's hit rate here: 0.5 on 2 engines against affinity's 0.8, 0.3 on 3 engines" in text
    assert "pooled" not in text  # no round kept its turns: each P99 is the median of the rounds'
    assert plot(result, tmp_path / "b10.png").stat().st_size > 10_000


def test_a_scarce_cache_holds_its_engine_s_share_of_the_live_conversations():
    """Two engines: half of 16 conversations of 1,293 tokens (81 blocks of 128); three: 6, rounded up (61 blocks)."""
    assert scarce_blocks(16, 2, 1293) == 81 and scarce_blocks(16, 3, 1293) == 61
    assert scarce_blocks(16, 3, 1293) * 128 < 6 * 1293 + 128 and scarce_blocks(16, 1, 100) * 128 >= 1600


def test_the_ceiling_counts_each_later_turn_s_hit_as_its_last_prompt_s_whole_blocks():
    """941 tokens then 15 more a turn, blocks of 128: each later turn finds 7 blocks (896 tokens); the first nothing."""
    prompts = [941 + 15 * turn for turn in range(6)]
    assert ceiling(prompts) == 5 * 896 / sum(prompts)
    assert ceiling([100, 300]) == 0.0 and ceiling([256, 300], block=128) == 256 / 556


def test_the_routing_choices_are_read_from_the_gateway_s_own_counter(monkeypatch):
    """rtxserve_affinity_total as prometheus_client writes it, by outcome."""
    import httpx
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from bench.affinity import _routed
    from core.metric_names import AFFINITY

    registry = CollectorRegistry()
    counter = Counter(AFFINITY, "routing choices", ("outcome",), registry=registry)
    counter.labels("preferred").inc(7)
    counter.labels("spilled").inc(2)
    page = generate_latest(registry).decode()
    monkeypatch.setattr(httpx, "get", lambda url, timeout: httpx.Response(200, text=page))
    assert _routed("http://gateway") == {"preferred": 7.0, "spilled": 2.0}


def test_the_later_turns_p99_is_pooled_over_the_rounds_and_the_other_figures_are_their_medians():
    from bench.affinity import summarised

    slow = [10.0] * 97 + [1000.0] * 3  # one round's three slowest turns: its own P99 is 1000
    runs = [{"hit_rate": h, "ttft_p99_ms": p99, "later_ttfts_ms": later}
            for h, p99, later in ((0.5, 1000.0, slow), (0.7, 10.0, [10.0] * 100), (0.6, 10.0, [10.0] * 100))]
    summary = summarised({"affinity": runs})["affinity"]
    # 3 slow of 300 pooled: the P99 lies between the last fast turn and the first slow one (numpy's linear rule)
    assert summary == {"hit_rate": 0.6, "ttft_p99_ms": 19.9}
    # a result from before the samples were kept: the median of the rounds' P99s, as it was
    assert summarised({"affinity": [{"ttft_p99_ms": v} for v in (1000.0, 10.0, 20.0)]})["affinity"] == {"ttft_p99_ms": 20.0}
