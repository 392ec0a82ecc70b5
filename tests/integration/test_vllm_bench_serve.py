"""vLLM's own benchmark (`vllm bench serve`, the tool LLM users trust) through the gateway: its random
dataset sends `ignore_eos`, and no request may fail."""

import json
import subprocess
import sys
from pathlib import Path

from serve.vllm_server import DEFAULT_ENV

ROOT = Path(__file__).resolve().parents[2]


def test_vllm_bench_serve_through_the_gateway_fails_nothing(llm_gateway, llm_fixtures, tmp_path):
    prompts, output_len = 24, 16
    argv = [str((ROOT / DEFAULT_ENV / "bin" / "vllm").absolute()), "bench", "serve", "--base-url", llm_gateway, "--model", "tiny-llama",
            "--tokenizer", str(llm_fixtures / "base"), "--dataset-name", "random", "--random-input-len", "32",
            "--random-output-len", str(output_len), "--num-prompts", str(prompts), "--max-concurrency", "4",
            "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["failed"] == 0 and result["completed"] == prompts
    assert result["total_output_tokens"] == prompts * output_len  # ignore_eos reached vLLM
    print(json.dumps({k: result[k] for k in ("median_ttft_ms", "p99_ttft_ms", "median_e2el_ms", "p99_e2el_ms")
                      if k in result}), file=sys.stderr)
