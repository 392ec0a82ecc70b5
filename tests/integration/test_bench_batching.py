"""`rtxserve bench batching` end to end on the real tritonserver: three served configurations, one round, both
ratios and the plot saved. (No speed threshold here: benchmarks report, tests do not time.)"""

import json

import pytest

from bench import cli


@pytest.mark.slow(reason="`make bench` runs B3 / B5 itself; test_tune's capacity test serves and loads Triton configurations")
def test_bench_batching_serves_each_configuration_and_saves_b3_and_b5(tmp_path, capsys):
    out = tmp_path / "bench"
    assert cli.main(["batching", "--rounds", "1", "--duration", "5", "--users", "4", "--out", str(out)]) == 0
    saved = json.loads((out / "bench-batching.json").read_text())
    assert set(saved["qps_median"]) == {"batching off", "batching on", "2 instances"}
    assert all(v > 0 for v in saved["qps_median"].values())
    assert saved["B3"]["ratio"] == saved["qps_median"]["batching on"] / saved["qps_median"]["batching off"]
    assert (out / "b3-b5.png").stat().st_size > 10_000 and "**B5 =" in capsys.readouterr().out
