"""Server metrics: Prometheus text from Triton, vLLM and the gateway -> CSV rows -> derived series -> plot."""

import numpy as np

from loadtest import server_metrics as sm
from loadtest.report.plots import PANELS, panel_lines, plot_servers as plot
from loadtest.server_metrics import Row, derive, summary

T0 = 1_700_000_000.0


def triton_text(success, failure, queue_us, compute_us, count, execs, pending=0):
    """Triton 2.51's /metrics for the `reviews` ensemble: tokenizer -> reviews_model (the only model
    with compute of its own here), with `compute_us` = (input, infer, output)."""
    cin, cinfer, cout = compute_us
    lines = ["# HELP nv_inference_request_success Number of successful inference requests, all batch sizes",
             "# TYPE nv_inference_request_success counter"]
    lines += [f'nv_inference_request_success{{model="{m}",version="1"}} {success}'
              for m in ("reviews", "reviews_model", "tokenizer")]
    lines += ["# HELP nv_inference_request_failure Number of failed inference requests, all batch sizes",
              "# TYPE nv_inference_request_failure counter",
              f'nv_inference_request_failure{{model="reviews_model",reason="BACKEND",version="1"}} {failure}',
              'nv_inference_request_failure{model="reviews_model",reason="REJECTED",version="1"} 0']
    for name, value in (("count", count), ("exec_count", execs), ("queue_duration_us", queue_us),
                        ("compute_input_duration_us", cin), ("compute_infer_duration_us", cinfer),
                        ("compute_output_duration_us", cout), ("request_duration_us", 99999)):
        lines += [f"# HELP nv_inference_{name} Cumulative figure", f"# TYPE nv_inference_{name} counter",
                  f'nv_inference_{name}{{model="reviews_model",version="1"}} {value}',
                  f'nv_inference_{name}{{model="reviews",version="1"}} {value if "count" in name else 0}']
    lines += ["# HELP nv_inference_pending_request_count Instantaneous number of pending requests",
              "# TYPE nv_inference_pending_request_count gauge",
              f'nv_inference_pending_request_count{{model="reviews_model",version="1"}} {pending}',
              "# HELP nv_cpu_utilization CPU utilization rate [0.0 - 1.0]", "# TYPE nv_cpu_utilization gauge",
              "nv_cpu_utilization 0.25"]
    return "\n".join(lines) + "\n"


def vllm_text(running, waiting, kv, tokens, queue_sum, queue_count, kv_name="vllm:kv_cache_usage_perc"):
    labels = 'engine="0",model_name="tiny-llama"'
    return f"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{labels}}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{labels}}} {waiting}
# HELP {kv_name} KV-cache usage. 1 means 100 percent usage.
# TYPE {kv_name} gauge
{kv_name}{{{labels}}} {kv}
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{{labels}}} {tokens}
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{{{labels},le="0.3"}} {queue_count}
vllm:request_queue_time_seconds_bucket{{{labels},le="+Inf"}} {queue_count}
vllm:request_queue_time_seconds_count{{{labels}}} {queue_count}
vllm:request_queue_time_seconds_sum{{{labels}}} {queue_sum}
"""


def histogram(name, labels, total, count):
    return "".join([f'{name}_bucket{{{labels},le="0.05"}} {count}\n', f'{name}_bucket{{{labels},le="+Inf"}} {count}\n',
                    f"{name}_count{{{labels}}} {count}\n", f"{name}_sum{{{labels}}} {total}\n"])


def gateway_text(routes, backend, in_flight, queued, shed):
    """`routes`: {route: (sum seconds, count)}; `backend`: (sum seconds, count) of backend triton-0."""
    text = "# HELP rtxserve_request_duration_seconds Gateway request latency\n"
    text += "# TYPE rtxserve_request_duration_seconds histogram\n"
    for route, (total, count) in routes.items():
        text += histogram("rtxserve_request_duration_seconds", f'model="",route="{route}",status="200"', total, count)
    text += "# HELP rtxserve_gateway_overhead_seconds The gateway's own time per request\n"
    text += "# TYPE rtxserve_gateway_overhead_seconds histogram\n"
    for route, (total, count) in routes.items():  # a tenth of each request's time is the gateway's own
        text += histogram("rtxserve_gateway_overhead_seconds", f'route="{route}"', total / 10, count)
    text += "# HELP rtxserve_backend_request_duration_seconds Time a backend replica took per call\n"
    text += "# TYPE rtxserve_backend_request_duration_seconds histogram\n"
    text += histogram("rtxserve_backend_request_duration_seconds", 'backend="triton-0"', *backend)
    return text + f"""# HELP rtxserve_requests_in_flight Model requests being served
# TYPE rtxserve_requests_in_flight gauge
rtxserve_requests_in_flight {in_flight}
# HELP rtxserve_requests_queued Model requests waiting for a slot
# TYPE rtxserve_requests_queued gauge
rtxserve_requests_queued {queued}
# HELP rtxserve_requests_shed_total Model requests refused by admission control
# TYPE rtxserve_requests_shed_total counter
rtxserve_requests_shed_total{{reason="queue_full"}} {shed}
"""


def rows(target, scrapes):
    """CSV rows as the Scraper writes them, from (seconds since T0, exposition text) pairs."""
    return [Row(T0 + t, target, *sample) for t, text in scrapes for sample in sm.parse(text)]


def y(series, name):
    return series[name].y


def test_triton_queue_compute_batch_and_rates_per_model_and_nan_without_new_requests():
    series = derive(rows("http://triton:8002/metrics", [
        (0, triton_text(10, 0, 5000, (100, 2000, 100), 10, 5)),
        (1, triton_text(13, 1, 8000, (400, 7400, 400), 13, 7, pending=2)),  # 3 requests in 2 executions
        (2, triton_text(13, 1, 8000, (400, 7400, 400), 13, 7)),  # idle second: no new requests
    ]), T0)
    np.testing.assert_allclose(series["triton reviews_model queue"].x, [1.0, 2.0])
    np.testing.assert_allclose(y(series, "triton reviews_model queue"), [1.0, np.nan])  # 3000 us / 3
    np.testing.assert_allclose(y(series, "triton reviews_model compute"), [2.0, np.nan])  # (300+5400+300) / 3
    np.testing.assert_allclose(y(series, "triton reviews_model batch size"), [1.5, np.nan])
    np.testing.assert_allclose(y(series, "triton reviews_model requests/s"), [3.0, 0.0])
    np.testing.assert_allclose(y(series, "triton reviews_model failures/s"), [1.0, 0.0])  # summed over reasons
    assert series["triton reviews_model queue"].unit == "ms/request"
    assert {"triton reviews requests/s", "triton tokenizer requests/s"} <= set(series)  # every model is kept


def test_the_response_cache_hit_rate_of_a_model_that_has_one():
    def cached(hits, misses):
        return (triton_text(10, 0, 5000, (100, 2000, 100), 10, 5)
                + "# HELP nv_cache_num_hits_per_model Number of cache hits per model\n"
                + "# TYPE nv_cache_num_hits_per_model counter\n"
                + f'nv_cache_num_hits_per_model{{model="reviews",version="1"}} {hits}\n'
                + "# HELP nv_cache_num_misses_per_model Number of cache misses per model\n"
                + "# TYPE nv_cache_num_misses_per_model counter\n"
                + f'nv_cache_num_misses_per_model{{model="reviews",version="1"}} {misses}\n')

    series = derive(rows("http://triton:8002/metrics", [(0, cached(2, 2)), (1, cached(5, 3)), (2, cached(5, 3))]), T0)
    np.testing.assert_allclose(y(series, "triton reviews cache hits"), [75.0, np.nan])  # 3 of 4 lookups; none after
    assert "triton reviews_model cache hits" not in series  # no cache there: no series


def test_counter_reset_skips_the_interval_instead_of_a_negative_rate():
    series = derive(rows("http://triton:8002/metrics", [
        (0, triton_text(10, 0, 5000, (0, 1000, 0), 10, 10)),
        (1, triton_text(13, 0, 8000, (0, 4000, 0), 13, 13)),
        (2, triton_text(2, 0, 1000, (0, 500, 0), 2, 2)),  # Triton restarted
        (3, triton_text(5, 0, 4000, (0, 3500, 0), 5, 5)),
    ]), T0)
    np.testing.assert_allclose(y(series, "triton reviews_model requests/s"), [3.0, np.nan, 3.0])
    np.testing.assert_allclose(y(series, "triton reviews_model queue"), [1.0, np.nan, 1.0])
    assert not any((s.y < 0).any() for s in series.values())


def test_vllm_gauges_kv_percent_tokens_per_second_and_queue_time():
    series = derive(rows("http://vllm:8001/metrics", [
        (0, vllm_text(2.0, 0.0, 0.1, 100.0, 0.3, 10.0)),
        (0.5, vllm_text(3.0, 1.0, 0.25, 150.0, 0.5, 12.0)),
    ]), T0)
    np.testing.assert_allclose(y(series, "vllm tiny-llama running"), [2.0, 3.0])
    np.testing.assert_allclose(y(series, "vllm tiny-llama waiting"), [0.0, 1.0])
    np.testing.assert_allclose(y(series, "vllm tiny-llama KV cache"), [10.0, 25.0])
    np.testing.assert_allclose(y(series, "vllm tiny-llama generated tokens/s"), [100.0])
    np.testing.assert_allclose(y(series, "vllm tiny-llama queue time"), [100.0])  # 0.2 s over 2 requests


def test_older_vllm_kv_cache_name_is_read_when_the_new_one_is_absent():
    old = "vllm:gpu_cache_usage_perc"
    series = derive(rows("http://vllm:8001/metrics", [(0, vllm_text(1, 0, 0.5, 0, 0, 0, kv_name=old))]), T0)
    np.testing.assert_allclose(y(series, "vllm tiny-llama KV cache"), [50.0])


def test_gateway_time_excludes_probes_and_counts_a_route_seen_for_the_first_time_from_zero():
    probes = {"/metrics": (0.001, 1), "/healthz": (0.002, 5)}
    series = derive(rows("http://gw:8000/metrics", [
        (0, gateway_text({"/v1/embeddings": (1.0, 10), **probes}, (0.8, 10), 3, 1, 0)),
        (1, gateway_text({"/v1/embeddings": (1.2, 14), "/v1/classify": (0.1, 1),
                          "/metrics": (0.101, 2), "/healthz": (5.002, 9)}, (0.92, 14), 4, 0, 2)),
    ]), T0)
    np.testing.assert_allclose(y(series, "gateway request time"), [60.0])  # (0.2 + 0.1) s / 5 requests
    np.testing.assert_allclose(y(series, "gateway overhead"), [6.0])  # a tenth of it, probes left out too
    np.testing.assert_allclose(y(series, "backend triton-0 call time"), [30.0])  # 0.12 s / 4
    np.testing.assert_allclose(y(series, "gateway in flight"), [3.0, 4.0])
    np.testing.assert_allclose(y(series, "gateway queued"), [1.0, 0.0])
    np.testing.assert_allclose(y(series, "gateway shed/s"), [2.0])


def test_same_series_from_two_targets_is_named_by_host():
    text = [(0, vllm_text(1, 0, 0.1, 0, 0, 0))]
    series = derive(rows("http://a:8001/metrics", text) + rows("http://b:8001/metrics", text), T0)
    assert {"vllm tiny-llama running [a:8001]", "vllm tiny-llama running [b:8001]"} <= set(series)


def test_summary_weighs_means_by_requests_and_skips_the_warmup():
    series = {"gateway request time": sm.Series(np.array([1.0, 2.0, 3.0]), np.array([500.0, 10.0, 40.0]),
                                                 "ms/request", "time", "gateway", w=np.array([9.0, 1.0, 3.0])),
              "vllm m KV cache": sm.Series(np.array([0.0, 5.0]), np.array([90.0, 30.0]), "%", "kv", "kv")}
    table = summary(series, warmup_s=1.5)
    assert table["gateway request time"] == {"mean": 32.5, "max": 40.0, "unit": "ms/request"}
    assert table["vllm m KV cache"]["max"] == 30.0


def synthetic(seconds=60):
    """A minute of load: the gateway adds ~2 ms to its backend, Triton queues as load rises."""
    t = np.arange(seconds, dtype=float)
    load_ = np.clip(t / 30, 0.1, 1.0)
    out = {}
    for i, model in enumerate(("reviews_model", "classifier_model")):
        n = (40 - 25 * i) * load_
        out[f"triton {model} requests/s"] = sm.Series(t, n, "req/s", "throughput", "rps", model)
        out[f"triton {model} queue"] = sm.Series(t, 0.5 + 8 * load_**3 + i, "ms/request", "triton", "queue", model)
        out[f"triton {model} compute"] = sm.Series(t, 6.0 + 2 * i + np.sin(t / 5), "ms/request", "triton",
                                                   "compute", model)
        out[f"triton {model} batch size"] = sm.Series(t, 1 + 3 * load_, "requests/batch", "triton", "batch", model)
    out["triton reviews requests/s"] = sm.Series(t, 40 * load_, "req/s", "throughput", "rps", "reviews")
    backend = out["triton reviews_model queue"].y + out["triton reviews_model compute"].y + 1.5
    out["backend triton-0 call time"] = sm.Series(t, backend, "ms/request", "time", "backend", "triton-0")
    out["gateway request time"] = sm.Series(t, backend + 2, "ms/request", "time", "gateway")
    out["gateway in flight"] = sm.Series(t, 8 * load_, "requests", "queues", "in flight")
    out["gateway queued"] = sm.Series(t, np.maximum(0, 10 * load_ - 6), "requests", "queues", "queued")
    out["vllm tiny-llama running"] = sm.Series(t, 4 * load_, "requests", "queues", "running", "tiny-llama")
    out["vllm tiny-llama KV cache"] = sm.Series(t, 70 * load_, "%", "kv", "kv", "tiny-llama")
    out["vllm tiny-llama generated tokens/s"] = sm.Series(t, 300 * load_, "tokens/s", "throughput", "tokens")
    out["GPU 0 utilization"] = sm.Series(t, 90 * load_, "%", "gpu", "util", "0")
    out["GPU 0 memory used"] = sm.Series(t, 10 + 6 * load_, "GiB", "gpu", "memory", "0")
    p50 = out["gateway request time"].y + 3
    client = {"t": t, "p50": p50, "p99": p50 * 2.5, "qps": 40 * load_}
    return out, client


def test_plot_draws_every_panel_with_data_and_nothing_without(tmp_path):
    series, client = synthetic()
    path = plot(series, client, tmp_path / "server.png", "reviews @ 40 users: where time goes", warmup_s=10)
    assert path.is_file() and {p for p, lines in panel_lines(series, client).items() if lines} == set(PANELS)
    without_gpu = {n: s for n, s in series.items() if s.panel != "gpu"}
    assert not panel_lines(without_gpu, client).get("gpu")  # a panel only where there is data for it
    assert plot({}, {"t": [], "p50": [], "p99": [], "qps": []}, tmp_path / "none.png", "empty") is None
    assert not (tmp_path / "none.png").exists()


def test_plot_of_client_figures_only_still_draws(tmp_path):
    from PIL import Image

    t = np.arange(5.0)
    path = plot({}, {"t": t, "p50": t + 1, "p99": t + 2, "qps": t}, tmp_path / "c.png", "client only")
    pixels = np.asarray(Image.open(path).convert("RGB")).astype(int)
    coloured = (pixels.max(axis=2) - pixels.min(axis=2)) > 80  # the data's lines; text, axes and grid are grey
    assert coloured.sum() > 500



def test_the_report_splits_the_gateways_time_into_its_own_and_its_backends():
    from loadtest.report.pages import _split

    figures = {"gateway request time": {"mean": 20.0, "max": 30.0, "unit": "ms/request"},
               "gateway overhead": {"mean": 1.5, "max": 2.0, "unit": "ms/request"}}
    assert "1.50 ms of the 20.00 ms it held each request (8%); the other 18.50 ms were its backends'" in _split(figures)
    assert _split({"gateway request time": figures["gateway request time"]}) == ""  # an older gateway: no figure
