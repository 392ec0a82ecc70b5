"""`rtxserve bench llm` end to end against the session's real vLLM server: it runs, saves its figures
and its plot. (No speed threshold here: benchmarks report, tests do not time.)"""

import json

from bench import cli


def test_bench_llm_against_a_running_vllm(llm_servers, tmp_path, capsys):
    _, vllm_url, _ = llm_servers
    out = tmp_path / "bench"
    assert cli.main(["llm", "--url", vllm_url, "--served-name", "tiny-llama", "--rounds", "1", "--duration", "1",
                     "--max-tokens", "8", "--out", str(out)]) == 0
    saved = json.loads((out / "bench-llm.json").read_text())
    b4 = saved["B4"]
    assert set(b4["median_tokens_per_s"]) == {"1", "2", "4", "8", "16"}
    assert all(v > 0 for v in b4["median_tokens_per_s"].values())
    assert b4["ratio"] == b4["median_tokens_per_s"]["16"] / b4["median_tokens_per_s"]["1"]
    assert saved["versions"]["vllm"] != "?"
    assert (out / "b4.png").stat().st_size > 10_000
    assert "**B4 =" in capsys.readouterr().out
