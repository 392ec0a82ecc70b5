"""What watches a deployment: Prometheus' scrape config and alert rules, and Grafana dashboards for the
gateway, Triton and vLLM, built with Grafana's own SDK (grafana-foundation-sdk).

Every metric named here is one the servers really emit (the gateway's `rtxserve_*`, Triton's `nv_*`,
vLLM's `vllm:*`); tests/integration/test_deploy_render.py scrapes the real servers to keep it so. Alert rules
come from each model's SLO: the P99 of the figure the SLO names, over 5 minutes, above its limit.
"""

from __future__ import annotations

import json

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

from core import metric_names
from core.slo import parse_slo

from .spec import Deployment

DATASOURCE_UID = "rtxserve-prometheus"
_DS = DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)

# SLO figure -> (histogram in seconds, its model label): what each SLO is checked against in production.
SLO_HISTOGRAMS = {
    "e2el": (f"{metric_names.REQUEST_SECONDS}_bucket", "model"),  # what the client sees, through the gateway
    "ttft": ("vllm:time_to_first_token_seconds_bucket", "model_name"),
    "tpot": ("vllm:request_time_per_output_token_seconds_bucket", "model_name"),
    "itl": ("vllm:inter_token_latency_seconds_bucket", "model_name"),
}


def _p(q: str, expr: str, legend: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().ref_id(q).expr(expr).legend_format(legend).datasource(_DS)


def _series(title: str, unit: str, *queries: prometheus.Dataquery, width: int = 12) -> timeseries.Panel:
    panel = timeseries.Panel().title(title).unit(unit).datasource(_DS).height(8).span(width)
    for q in queries:
        panel = panel.with_target(q)
    return panel


def _quantiles(metric: str, by: str, scale: str = "") -> list[prometheus.Dataquery]:
    return [_p(chr(65 + i), f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}[1m]))){scale}", f"P{int(q * 100)} {{{{{by}}}}}")
            for i, q in enumerate((0.5, 0.99))]


def on_demand_panels(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """What operators of a box with on-demand models watch: what is loaded, the loads and unloads, how long a load
    takes, and the requests that waited for one."""
    return (board
            .with_panel(_series("On-demand models loaded (1) or not (0)", "short",
                                _p("A", f"max by (model) ({metric_names.MODEL_RESIDENT})", "{{model}}")))
            .with_panel(_series("Loads and unloads per minute", "short",
                                _p("A", f"sum by (model, outcome) (increase({metric_names.MODEL_LOADS}[1m]))",
                                   "load {{model}} {{outcome}}"),
                                _p("B", f"sum by (model, reason) (increase({metric_names.MODEL_UNLOADS}[1m]))",
                                   "unload {{model}} ({{reason}})")))
            .with_panel(_series("Load time (to its first answer)", "s",
                                *_quantiles(f"{metric_names.MODEL_LOAD_SECONDS}_bucket", "model")))
            .with_panel(_series("Requests that waited for a load", "reqps",
                                _p("A", f"sum by (model, outcome) (rate({metric_names.LOAD_WAITS}[1m]))",
                                   "{{model}} {{outcome}}"))))


def gateway_dashboard(on_demand: bool = False, answer_cache: bool = False) -> dashboard.Dashboard:
    board = (dashboard.Dashboard("rtxserve gateway").uid("rtxserve-gateway").tags(["rtxserve"]).refresh("10s")
            .time("now-30m", "now")
            .with_panel(stat.Panel().title("Backends up").datasource(_DS).height(4).span(6)
                        .with_target(_p("A", f"sum({metric_names.BACKEND_UP})", "up")))
            .with_panel(stat.Panel().title("Breakers open").datasource(_DS).height(4).span(6)
                        .with_target(_p("A", f"sum({metric_names.BREAKER_OPEN})", "open")))
            .with_panel(stat.Panel().title("In flight").datasource(_DS).height(4).span(6)
                        .with_target(_p("A", f"sum({metric_names.IN_FLIGHT})", "in flight")))
            .with_panel(stat.Panel().title("Queued").datasource(_DS).height(4).span(6)
                        .with_target(_p("A", f"sum({metric_names.QUEUED})", "queued")))
            .with_panel(_series("Requests per second by model and status", "reqps",
                                _p("A", f"sum by (model, status) (rate({metric_names.REQUESTS}[1m]))", "{{model}} {{status}}")))
            .with_panel(_series("Latency by model", "s", *_quantiles(f"{metric_names.REQUEST_SECONDS}_bucket", "model")))
            .with_panel(_series("Backend call time by replica", "s",
                                *_quantiles(f"{metric_names.BACKEND_SECONDS}_bucket", "backend")))
            .with_panel(_series("The gateway's own time per request (backend calls left out)", "s",
                                *_quantiles(f"{metric_names.OVERHEAD_SECONDS}_bucket", "route")))
            .with_panel(_series("Shed (admission control)", "reqps",
                                _p("A", f"sum by (reason) (rate({metric_names.SHED}[1m]))", "{{reason}}")))
            .with_panel(_series("Tokens per second", "short",
                                _p("A", f"sum by (model, kind) (rate({metric_names.TOKENS}[1m]))", "{{model}} {{kind}}")))
            .with_panel(_series("Capacity used: requests/s over each model's confirmed capacity (rtxserve capacity "
                                "--record; stale: measured before the box changed)", "percentunit",
                                _p("A", f"sum by (model, stale) ({metric_names.CAPACITY_USED})",
                                   "{{model}} (stale: {{stale}})"), width=24)))
    if answer_cache:
        lookups = metric_names.ANSWER_CACHE_LOOKUPS
        board = (board.with_panel(_series("Answer cache hits (models with response_cache_mb)", "percentunit", _p(
                     "A", f'sum by (model) (rate({lookups}{{outcome="hit"}}[1m])) / clamp_min(sum by (model) '
                     f"(rate({lookups}[1m])), 1e-9)", "{{model}}")))
                 .with_panel(_series("Answer cache bytes (all workers)", "bytes",
                                     _p("A", f"sum by (model) ({metric_names.ANSWER_CACHE_BYTES})", "{{model}}"))))
    return on_demand_panels(board) if on_demand else board


def triton_dashboard() -> dashboard.Dashboard:
    return (dashboard.Dashboard("Triton Inference Server").uid("rtxserve-triton").tags(["rtxserve", "triton"])
            .refresh("10s").time("now-30m", "now")
            .with_panel(_series("Inferences per second by model", "short",
                                _p("A", "sum by (model) (rate(nv_inference_count[1m]))", "{{model}}")))
            .with_panel(_series("Batches per second by model (inferences / executions = batch size)", "short",
                                _p("A", "sum by (model) (rate(nv_inference_exec_count[1m]))", "{{model}}")))
            .with_panel(_series("Queue time per request", "µs", _p(
                "A", "sum by (model) (rate(nv_inference_queue_duration_us[1m])) / "
                "clamp_min(sum by (model) (rate(nv_inference_request_success[1m])), 1e-9)", "{{model}}")))
            .with_panel(_series("Compute time per request", "µs", _p(
                "A", "sum by (model) (rate(nv_inference_compute_infer_duration_us[1m])) / "
                "clamp_min(sum by (model) (rate(nv_inference_request_success[1m])), 1e-9)", "{{model}}")))
            .with_panel(_series("Response cache hits (models with a cache)", "percentunit", _p(
                "A", "sum by (model) (rate(nv_cache_num_hits_per_model[1m])) / clamp_min(sum by (model) "
                "(rate(nv_cache_num_hits_per_model[1m]) + rate(nv_cache_num_misses_per_model[1m])), 1e-9)", "{{model}}")))
            .with_panel(_series("Failures per second", "reqps",
                                _p("A", "sum by (model, reason) (rate(nv_inference_request_failure[1m]))", "{{model}} {{reason}}")))
            .with_panel(_series("GPU memory used", "bytes", _p("A", "nv_gpu_memory_used_bytes", "{{gpu_uuid}}"),
                                _p("B", "nv_gpu_memory_total_bytes", "total {{gpu_uuid}}")))
            .with_panel(_series("GPU utilisation", "percentunit", _p("A", "nv_gpu_utilization", "{{gpu_uuid}}"))))


def vllm_dashboard() -> dashboard.Dashboard:
    return (dashboard.Dashboard("vLLM").uid("rtxserve-vllm").tags(["rtxserve", "vllm"]).refresh("10s")
            .time("now-30m", "now")
            .with_panel(_series("Requests running / waiting", "short",
                                _p("A", "sum by (model_name) (vllm:num_requests_running)", "running {{model_name}}"),
                                _p("B", "sum by (model_name) (vllm:num_requests_waiting)", "waiting {{model_name}}")))
            .with_panel(_series("KV cache usage", "percentunit",
                                _p("A", "max by (model_name, engine) (vllm:kv_cache_usage_perc)", "{{model_name}} {{engine}}")))
            .with_panel(_series("Time to first token", "s", *_quantiles("vllm:time_to_first_token_seconds_bucket", "model_name")))
            .with_panel(_series("Inter-token latency", "s", *_quantiles("vllm:inter_token_latency_seconds_bucket", "model_name")))
            .with_panel(_series("End-to-end request latency", "s",
                                *_quantiles("vllm:e2e_request_latency_seconds_bucket", "model_name")))
            .with_panel(_series("Tokens per second", "short",
                                _p("A", "sum by (model_name) (rate(vllm:prompt_tokens_total[1m]))", "prompt {{model_name}}"),
                                _p("B", "sum by (model_name) (rate(vllm:generation_tokens_total[1m]))", "generated {{model_name}}")))
            .with_panel(_series("Preemptions per second", "short",
                                _p("A", "sum by (model_name) (rate(vllm:num_preemptions_total[1m]))", "{{model_name}}"))))


def dashboards(d: Deployment) -> dict[str, str]:
    """file name -> the dashboard's JSON, for the servers the deployment runs."""
    boards = {"rtxserve-gateway.json": gateway_dashboard(on_demand=bool(d.on_demand),
                                                         answer_cache=any(m.response_cache_mb for m in d.encoders))}
    if d.encoders:
        boards["triton.json"] = triton_dashboard()
    if d.vllm_models:
        boards["vllm.json"] = vllm_dashboard()
    return {name: JSONEncoder(sort_keys=True, indent=2).encode(board.build()) for name, board in boards.items()}


def queried_metrics(board_json: str) -> set[str]:
    """The metric names a dashboard's queries use (for the test against the servers' /metrics)."""
    import re

    names = set()
    for panel in json.loads(board_json).get("panels", []):
        for target in panel.get("targets", []):
            for name in re.findall(r"(?<![\w:])((?:rtxserve_|nv_|vllm:)[\w:]+)", target.get("expr", "")):
                names.add(name.removesuffix("_bucket"))
    return names


NEAR_CAPACITY = 0.8  # the share of a model's confirmed capacity that warns, held for 5 minutes
HEADROOM_RULES = [
    {"alert": "RtxserveNearCapacity", "for": "5m", "labels": {"severity": "warning"},
     "expr": f'sum by (model) ({metric_names.CAPACITY_USED}{{stale="false"}}) > {NEAR_CAPACITY}',
     "annotations": {"summary": "{{ $labels.model }} runs at {{ $value | humanizePercentage }} of its confirmed "
                                "capacity (rtxserve capacity --record)"}},
    {"alert": "RtxserveCapacityStale", "for": "15m", "labels": {"severity": "info"},
     "expr": f'max by (model) ({metric_names.CAPACITY_RPS}{{stale="true"}}) > 0',
     "annotations": {"summary": "{{ $labels.model }}'s confirmed capacity was measured before the box changed: "
                                "measure and record it again"}}]


def alert_rules(d: Deployment) -> dict:
    """Prometheus rule groups: a model near its confirmed capacity (or that capacity stale), every target down, and
    each model's SLO (P99 over 5 minutes above its limit)."""
    rules = [*HEADROOM_RULES, {"alert": "RtxserveTargetDown", "expr": 'up{job=~"rtxserve-.*"} == 0', "for": "1m",
              "labels": {"severity": "critical"},
              "annotations": {"summary": "{{ $labels.job }} at {{ $labels.instance }} is not answering /metrics"}},
             {"alert": "RtxserveBackendDown", "expr": f"max by (backend) ({metric_names.BACKEND_UP}) == 0", "for": "1m",
              "labels": {"severity": "critical"}, "annotations": {"summary": "the gateway cannot reach {{ $labels.backend }}"}}]
    for m in d.models:
        for figure, limit_ms in (parse_slo(m.slo) if m.slo else {}).items():
            metric, label = SLO_HISTOGRAMS[figure]
            names = [n.replace(".", "\\\\.") for n in (m.name, *getattr(m, "adapters", {}))]  # "." is a regex's any
            selector = f'{label}=~"{"|".join(names)}"'
            rules.append({
                "alert": "RtxserveSLOBreached",
                "expr": f"histogram_quantile(0.99, sum by (le, {label}) (rate({metric}{{{selector}}}[5m]))) > {limit_ms / 1000:g}",
                "for": "5m", "labels": {"severity": "warning", "slo": f"{figure}:{limit_ms:g}ms", "deployment_model": m.name},
                "annotations": {"summary": f"{m.name}: P99 {figure} above {limit_ms:g} ms for 5 minutes"}})
    return {"groups": [{"name": f"rtxserve-{d.name}", "rules": rules}]}


def prometheus_config(targets: dict[str, list[str]], rule_file: str = "/etc/prometheus/rules.yml") -> dict:
    """Scrape config: job -> host:port targets (each server's /metrics), and the rules file."""
    return {"global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
            "rule_files": [rule_file],
            "scrape_configs": [{"job_name": f"rtxserve-{job}", "metrics_path": "/metrics",
                                "static_configs": [{"targets": hosts}]} for job, hosts in targets.items() if hosts]}


GRAFANA_DATASOURCES = {"apiVersion": 1, "datasources": [
    {"name": "Prometheus", "type": "prometheus", "uid": DATASOURCE_UID, "access": "proxy", "url": "http://prometheus:9090",
     "isDefault": True}]}
GRAFANA_DASHBOARDS = {"apiVersion": 1, "providers": [
    {"name": "rtxserve", "type": "file", "disableDeletion": True, "allowUiUpdates": False,
     "options": {"path": "/var/lib/grafana/dashboards", "foldersFromFilesStructure": False}}]}
