"""B1's profile: py-spy's raw stacks charged to the parts of the gateway by their innermost frame, and the page's
tables (the real run is `rtxserve bench gateway --profile-seconds`)."""

import pytest

from bench.gateway import markdown
from bench.profile import OTHER, plot, summarize

ENTRY = "_run_module_as_main (<frozen runpy>:198);main (rtxserve/cli.py:52);run (uvicorn/main.py:632)"
RAW = [
    f"{ENTRY};Runner.run (asyncio/runners.py:118) 50",  # the loop's C code
    f"{ENTRY};Runner.run (asyncio/runners.py:118);HotRoutes.__call__ (serve/gateway/edge/hotpath.py:60);"
    "_answer (serve/gateway/edge/hotpath.py:88) 20",
    f"{ENTRY};Runner.run (asyncio/runners.py:118);HotRoutes.__call__ (serve/gateway/edge/hotpath.py:60);"
    "TritonBackend.classify (serve/gateway/backends/triton.py:200);UnaryUnaryCall._invoke (grpc/aio/_call.py:595) 20",
    f"{ENTRY};Thread.run (threading.py:982) 10",
    "not a stack line",
]


def test_each_sample_is_charged_to_its_innermost_frames_part_and_to_the_gateway_file_it_ran_under():
    s = summarize(RAW)
    assert s["samples"] == 100
    assert s["parts"] == {"event loop and sockets (asyncio, selectors)": 50.0,
                          "the gateway's own code (serve/gateway/)": 20.0, "gRPC client (grpc.aio)": 20.0, OTHER: 10.0}
    # the gRPC call is spent under the Triton backend, the answer under the hot path; the entry (serve/cli) is not ours
    assert s["under_own_files"] == {"serve/gateway/edge/hotpath.py": 20.0, "serve/gateway/backends/triton.py": 20.0}
    assert s["top"][0] == ("Runner.run (asyncio/runners.py:118)", 50.0)
    with pytest.raises(ValueError, match="no samples"):
        summarize(["garbage"])


def test_the_page_shows_the_profile_with_each_parts_cpu_ms_and_says_when_there_is_none(tmp_path):
    gw = {"p50_ms": 12, "p90_ms": 15, "p99_ms": 23, "p99.9_ms": 30, "qps": 450, "errors": 0, "cpu_ms_per_request": 0.4}
    level = {"concurrency": 8, "medians": {"gateway": gw, "proxy": {**gw, "cpu_ms_per_request": 0.1}, "direct": gw},
             "p99_ratio": 1.15, "qps_ratio": 0.9, "p50_added_ms": 2, "proxy_p50_added_ms": 0.4}
    result = {"model": "m", "gateway_workers": 1, "rounds": 3, "duration_s": 8, "cpu": "EPYC; avx2", "levels": [level],
              "profile": {"concurrency": 8, "seconds": 10, "requests": 3000, "errors": 0, **summarize(RAW)}}
    text = markdown(result)
    assert "| event loop and sockets (asyncio, selectors) | 50.0 % | 0.200 |" in text
    assert "| `serve/gateway/edge/hotpath.py` | 20.0 % |" in text and "![where the gateway's CPU goes](b1-profile.png)" in text
    assert plot(result["profile"], tmp_path / "p.png", "t").stat().st_size > 10_000
    text = markdown(result | {"profile": {"error": "py-spy is not installed"}})
    assert "The gateway was not profiled: py-spy is not installed" in text
