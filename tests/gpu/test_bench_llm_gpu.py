"""G2 and G3 on a real GPU: vLLM (CUDA build, `make setup-vllm VLLM_REQUIREMENTS=deploy/vllm/requirements-cuda.txt`)
on an 8B-shaped FP16 model with random weights. The figures go in the issue note; the test checks they exist."""

import json
import math

from bench import cli


def test_g2_g3_on_an_8b_shaped_model(tmp_path):
    out = tmp_path / "bench"
    assert cli.main(["llm", "--gpu", "--skip-b4", "--g3-duration", "10", "--out", str(out)]) == 0
    saved = json.loads((out / "bench-llm.json").read_text())
    assert saved["G2"]["weight_bytes"] == 8_030_261_248 * 2
    # a decode step at batch 1 reads every weight once: nothing beats the memory roofline; over 1, the bandwidth or the
    # weight bytes behind it are wrong
    assert 0 < saved["G2"]["fraction"] <= 1.0 and math.isfinite(saved["G2"]["tokens_per_s"])
    # an 8B model on a data-centre GPU holds P99 TTFT <= 500 ms at the sweep's first rate at least
    assert saved["G3"]["steps"] and saved["G3"]["max_qps"] > 0 and saved["G3"]["max_rate"] > 0
