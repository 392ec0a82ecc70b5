"""B6 machinery on the real vLLM: `vllm bench serve` and `rtxserve loadtest` send the same random-token workload
and both tools' figures come back (the figures themselves are `make bench`'s, not a test's)."""

import json

import pytest

from bench.accuracy import FIGURES, markdown, run

PROMPTS, OUTPUT_LEN = 12, 8


def test_both_tools_measure_the_same_server_and_their_ratios_are_reported(llm_servers, llm_fixtures, tmp_path):
    _, vllm_url, _ = llm_servers
    result = run(tmp_path, url=vllm_url, model_dir=llm_fixtures / "base", served_name="tiny-llama", rounds=1,
                 prompts=PROMPTS, concurrency=2, input_len=32, output_len=OUTPUT_LEN, progress=print)
    theirs = json.loads((tmp_path / "round-1" / "vllm" / "result.json").read_text())
    assert theirs["completed"] == PROMPTS and theirs["total_output_tokens"] == PROMPTS * OUTPUT_LEN  # the workload ran
    rounds = result["rounds"]
    for k, (their_name, _) in FIGURES.items():  # vLLM's figures are what its tool wrote; each ratio is ours over theirs
        assert rounds["vllm"][k] == [pytest.approx(theirs[their_name])]
        assert result["ratios"][k] == pytest.approx(rounds["rtxserve"][k][0] / rounds["vllm"][k][0])
    for tool, m in result["medians"].items():  # each tool's first token before its last, P50 no more than P99
        assert 0 < m["ttft_p50"] <= m["ttft_p99"] and m["ttft_p50"] <= m["e2el_p50"] <= m["e2el_p99"], (tool, m)
    assert "| e2el_p99 |" in markdown(result) and (tmp_path / "bench-accuracy.json").exists()
