"""Service-level objectives as the load tester, the tuner, the deployment file and the rendered alerts read
them: `ttft:500,e2el:2000`, limits in milliseconds."""

from __future__ import annotations

SLO_FIGURES = {"e2el": "end-to-end latency", "ttft": "time to first token", "tpot": "time per output token",
               "itl": "largest inter-token gap"}


def parse_slo(text: str) -> dict[str, float]:
    """`ttft:500,e2el:2000` (ms, the names of `vllm bench serve --goodput` plus itl) as {figure: limit}."""
    slo = {}
    for item in filter(None, (i.strip() for i in text.replace(" ", ",").split(","))):
        name, _, value = item.replace("=", ":").partition(":")
        try:
            limit = float(value)
        except ValueError:
            limit = -1.0
        if name not in SLO_FIGURES or limit <= 0:
            raise ValueError(f"SLO: expected NAME:MS with NAME one of {', '.join(SLO_FIGURES)} and MS > 0, not {item!r}")
        slo[name] = limit
    return slo
