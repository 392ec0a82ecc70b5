"""`rtxserve bench reliability`'s verdicts, page and plot on canned figures (the real run starts Triton and the
gateway: `rtxserve bench reliability`)."""

import pytest

from bench.faults import DEADLINE_S, R5_BODY_CAP, oversized
from bench.reliability import judge, markdown, plot


def _result(*, oversized_p99_ms: float, noticed_s: list[float], answered_s: tuple[float, float] = (1.5, 1.52)) -> dict:
    rounds = [{"capacity": {"qps": 200.0, "p99_ms": 30.0}, "backoff": {"qps": 190.0, "p99_ms": 40.0},
               "goodput": 0.95, "p99_ratio": 1.33} for _ in noticed_s]
    r14 = [{"alone_p99_ms": 10.0, "beside_p99_ms": 11.0, "p99_ratio": 1.1, "alone": [5.0, 9.0, 10.0],
            "beside": [5.5, 9.5, 11.0]} for _ in noticed_s]
    refused = {"200 MB declared, none sent": [1.0, 2.0], "JSON 3,000 deep": [3.0, oversized_p99_ms]}
    result = {"bench": "R3 / R14 / R2 / R1 / R5 / R11", "model": "fixture", "rounds": len(noticed_s), "cpu": "EPYC; avx2",
              "r3": {"rounds": rounds, "goodput": 0.95, "p99_ratio": 1.33, "shed_p99_ms": 4.0},
              "r14": {"rounds": r14, "p99_ratio": 1.1},
              "faults": {"deadline_s": DEADLINE_S, "answered_min_s": answered_s[0], "answered_max_s": answered_s[1],
                         "probe_p99_ms": 8.0, "rounds": [{"probes": [2.0, 8.0]}], "refusal_p99_ms": 3.0,
                         "refusals": [1.0, 3.0], "oversized": refused, "oversized_p99_ms": oversized_p99_ms,
                         "oversized_max_ms": {name: max(ms) for name, ms in refused.items()}},
              "r11": {"interval_s": 1.5, "noticed_s": noticed_s, "noticed_max_intervals": max(noticed_s) / 1.5}}
    result["verdict"] = judge(result)
    return result


def test_each_target_is_judged_on_its_own_figure():
    good = judge(_result(oversized_p99_ms=20.0, noticed_s=[1.2, 2.9]))
    assert all(good.values()), good
    slow = judge(_result(oversized_p99_ms=120.0, noticed_s=[1.2, 3.1], answered_s=(1.3, 1.5)))
    assert {name for name, met in slow.items() if not met} == {"R5 oversized P99", "R11 noticed",
                                                              "R2 504 at the deadline"}


def test_the_page_names_each_target_its_figure_and_the_cpu(tmp_path):
    result = _result(oversized_p99_ms=120.0, noticed_s=[1.2, 2.4])
    text = markdown(result)
    assert "CPU: EPYC; avx2" in text
    assert "| R5 oversized requests refused: P99 < 100 ms | 120.0 ms (slowest: JSON 3,000 deep, 120.0 ms) | " \
           "**missed** |" in text
    assert "| R11 a dead model behind a ready server noticed within 2 health intervals (1.5 s) | 2.40 s (1.60) | met |" \
           in text
    assert "| 2 | 200 | 190 | 30.0 / 40.0 | 10.0 / 11.0 | 2.40 |" in text
    assert plot(result, tmp_path / "r.png").stat().st_size > 10_000


@pytest.mark.parametrize("name", list(oversized()))
def test_each_oversized_request_is_whole_http_and_over_the_cap(name):
    data, status = oversized(b"Authorization: Bearer k\r\n")[name]
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].endswith(b" HTTP/1.1") and b"Authorization: Bearer k" in head
    if status == 413:  # over the body cap, declared or sent
        declared = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.startswith(b"Content-Length")]
        assert (declared and declared[0] > R5_BODY_CAP) or (len(body) > R5_BODY_CAP and body.endswith(b"0\r\n\r\n"))
    elif status == 431:
        assert len(head) > 64 * 1024 and not body
    else:
        assert status == 422 and body.count(b"[") == 3000
