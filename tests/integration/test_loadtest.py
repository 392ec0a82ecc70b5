"""A short real locust run through the real gateway: the report has real figures and a plot."""

import json
import math
import time

from loadtest.runner import run

from .conftest import MODEL


def test_locust_run_reports_percentiles_qps_and_plot(stack, tmp_path):
    result = run("classify", stack.gateway_url, tmp_path / "report", users=4, duration_s=6, warmup_s=1,
                 env={"RTXSERVE_MODEL": MODEL}, log=lambda m: None)
    s = result.summary
    assert s.requests > 20 and s.errors == 0 and s.qps > 0
    assert all(math.isfinite(v) and v > 0 for v in s.latency_ms.values())
    assert s.latency_ms["p50"] <= s.latency_ms["p90"] <= s.latency_ms["p99"] <= s.latency_ms["max"]
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["qps"] == s.qps
    assert (tmp_path / "report" / "latency.png").stat().st_size > 10_000
    assert "P99" in result.report.read_text()


def test_errors_are_counted_not_hidden(stack, tmp_path):
    result = run("classify", stack.gateway_url, tmp_path / "report", users=2, duration_s=3, warmup_s=0.5,
                 env={"RTXSERVE_MODEL": "no_such_model"}, log=lambda m: None)
    assert result.summary.errors == result.summary.requests > 0
    assert result.summary.error_kinds == {"HTTP 404": result.summary.errors}


def test_nothing_listening_fails_at_once_without_a_report(tmp_path, capsys):
    from loadtest.cli import main
    from serve.launcher import free_port

    started = time.monotonic()
    code = main(["run", "--host", f"http://127.0.0.1:{free_port()}", "--model", MODEL, "--duration", "30",
                 "--out", str(tmp_path / "report")])
    assert code == 2 and time.monotonic() - started < 6
    assert "nothing answers at http://127.0.0.1:" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()
