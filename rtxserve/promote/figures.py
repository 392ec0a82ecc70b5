"""Each step's figures, from the gateway's /metrics (aggregated over its workers): the requests to the name under
promotion, by role (current, candidate, shadow), their errors and their backend latency. A step's figures are the
difference of two scrapes, its start and its end; percentiles are read off the histogram's buckets as Prometheus'
histogram_quantile reads them (linear within the bucket the rank falls in)."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from core import metric_names

SECONDS, REQUESTS = metric_names.ROLLOUT_SECONDS, metric_names.ROLLOUT_REQUESTS


@dataclass
class Scrape:
    """The rollout series of one name at one moment: per (target, role) its bucket counts and outcomes."""

    buckets: dict[tuple[str, str], dict[float, float]] = field(default_factory=lambda: defaultdict(dict))
    outcomes: dict[tuple[str, str], dict[str, float]] = field(default_factory=lambda: defaultdict(dict))


def scrape(client: httpx.Client, model: str) -> Scrape:
    """The gateway's rollout figures for `model` now."""
    text = client.get("/metrics", timeout=30).text
    out = Scrape()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model") != model:
                continue
            key = (s.labels.get("target", ""), s.labels.get("role", ""))
            if s.name == SECONDS + "_bucket":
                out.buckets[key][float(s.labels["le"])] = s.value
            elif s.name == REQUESTS + "_total" or (s.name == REQUESTS and "outcome" in s.labels):
                out.outcomes[key][s.labels["outcome"]] = s.value
    return out


@dataclass(frozen=True)
class RoleFigures:
    """One role's requests in a window: how many, how they ended, and their backend latency's percentiles (ms)."""

    target: str
    role: str
    requests: int
    outcomes: dict[str, int]
    p50_ms: float
    p90_ms: float
    p99_ms: float
    buckets: dict[float, float] = field(default_factory=dict, repr=False)  # the window's histogram, for pooling

    @property
    def errors(self) -> int:
        return self.outcomes.get("error", 0)

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def agreement(self) -> float | None:
        """A shadow's share of compared answers that agreed (None: none compared)."""
        compared = self.outcomes.get("agree", 0) + self.outcomes.get("disagree", 0)
        return self.outcomes.get("agree", 0) / compared if compared else None


def window(before: Scrape, after: Scrape) -> dict[str, RoleFigures]:
    """role -> its figures between two scrapes."""
    out = {}
    for key in set(after.outcomes) | set(after.buckets):
        target, role = key
        outcomes = {k: int(v - before.outcomes.get(key, {}).get(k, 0.0)) for k, v in after.outcomes.get(key, {}).items()}
        outcomes = {k: v for k, v in outcomes.items() if v}
        counts = {le: v - before.buckets.get(key, {}).get(le, 0.0) for le, v in after.buckets.get(key, {}).items()}
        requests = sum(outcomes.values())
        if requests:
            out[role] = _figures(target, role, outcomes, counts)
    return out


def _figures(target: str, role: str, outcomes: dict[str, int], buckets: dict[float, float]) -> RoleFigures:
    return RoleFigures(target, role, sum(outcomes.values()), outcomes, 1e3 * quantile(0.5, buckets),
                       1e3 * quantile(0.9, buckets), 1e3 * quantile(0.99, buckets), buckets)


P99_FROM = 100  # requests a window needs for its P99 to be more than its slowest request or two


def tail(candidate: RoleFigures, current: RoleFigures) -> tuple[str, float, float]:
    """The tail percentile both windows hold enough requests for: P99 from P99_FROM requests each, else P90 (a P99 of
    fewer is their slowest request, noise on a shared box). (Its name, the candidate's, the current's, ms.)"""
    if min(candidate.requests, current.requests) >= P99_FROM:
        return "P99", candidate.p99_ms, current.p99_ms
    return "P90", candidate.p90_ms, current.p90_ms


def pooled(figures: list[RoleFigures]) -> RoleFigures | None:
    """Several windows of one role as one: their requests, outcomes and histograms added up."""
    if not figures:
        return None
    outcomes: dict[str, int] = defaultdict(int)
    buckets: dict[float, float] = defaultdict(float)
    for f in figures:
        for k, v in f.outcomes.items():
            outcomes[k] += v
        for le, v in f.buckets.items():
            buckets[le] += v
    return _figures(figures[0].target, figures[0].role, dict(outcomes), dict(buckets))


def quantile(q: float, buckets: dict[float, float]) -> float:
    """The q-quantile of a cumulative histogram (upper bound -> count), as PromQL's histogram_quantile: the bucket the
    rank falls in, linearly between its bounds (the first bucket from 0; the +Inf bucket: its lower bound)."""
    ordered = sorted(buckets.items())
    total = ordered[-1][1] if ordered else 0.0
    if total <= 0:
        return math.nan
    rank, lower, below = q * total, 0.0, 0.0
    for upper, count in ordered:
        if count >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * ((rank - below) / (count - below) if count > below else 0.0)
        lower, below = upper, count
    return lower
