"""B6 machinery on the real vLLM: `vllm bench serve` and `rtxserve loadtest` send the same random-token workload
and both tools' figures come back (the figures themselves are `make bench`'s, not a test's)."""

import math

from bench.accuracy import markdown, run


def test_both_tools_measure_the_same_server_and_their_ratios_are_reported(llm_servers, llm_fixtures, tmp_path):
    _, vllm_url, _ = llm_servers
    result = run(tmp_path, url=vllm_url, model_dir=llm_fixtures / "base", served_name="tiny-llama", rounds=1,
                 prompts=12, concurrency=2, input_len=32, output_len=8, progress=print)
    assert set(result["ratios"]) == {"ttft_p50", "ttft_p99", "e2el_p50", "e2el_p99"}
    assert all(math.isfinite(v) and v > 0 for v in result["ratios"].values())
    assert "| e2el_p99 |" in markdown(result) and (tmp_path / "bench-accuracy.json").exists()
