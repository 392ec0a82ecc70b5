"""The shadow step: a share of the current model's requests sent again to the candidate, after the client has its
answer, with the candidate's answer compared and dropped. Nothing of it reaches the client: it costs the box the
candidate's work on that share, and it tells how often the two agree, how fast the candidate answers and whether it
fails (rtxserve_rollout_* metrics, role "shadow")."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import numpy as np

from ... import metrics
from ...backends.base import Classification, Detections, Embedding, Stream, Tagging

log = logging.getLogger("rtxserve.gateway.rollout")
MIN_COSINE = 0.99  # embeddings closer than this are the same answer


def agreement(primary, shadow) -> bool | None:
    """Whether the candidate's answer is the current model's (the same labels, entities, detections, text; vectors
    within MIN_COSINE); None where answers of that kind are not compared (streams, sampled text)."""
    if isinstance(primary, list) and isinstance(shadow, list) and primary and len(primary) == len(shadow):
        first = primary[0]
        if isinstance(first, Classification):
            return all(a.label == b.label for a, b in zip(primary, shadow))
        if isinstance(first, Tagging):
            spans = lambda t: [(e.get("entity"), e.get("start"), e.get("end")) for e in t.entities]  # noqa: E731
            return all(spans(a) == spans(b) for a, b in zip(primary, shadow))
        if isinstance(first, Embedding):
            return all(_cosine(a.vector, b.vector) >= MIN_COSINE for a, b in zip(primary, shadow))
        if isinstance(first, Detections):
            classes = lambda d: sorted(int(c) for c in d.rows[:, 5]) if len(d.rows) else []  # noqa: E731
            return all(classes(a) == classes(b) for a, b in zip(primary, shadow))
    return None


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b / norms) if norms else float(np.array_equal(a, b))


async def mirror(call: Callable[[], Awaitable[object]], primary, model: str, candidate: str) -> None:
    """Run `call` (the request, on the candidate), drain a stream it opens, compare with `primary`, count the
    outcome; never raises (a shadow is the box's business, not a client's)."""
    started = time.perf_counter()
    took = None
    try:
        answer = await call()
        took = time.perf_counter() - started  # as the client's own calls are timed: to the answer, or a stream's start
        if isinstance(answer, Stream):  # run to its end (the work a client's stream costs), not timed to it
            try:
                async for _ in answer:
                    pass
            finally:
                await answer.aclose()
            outcome = "ok"
        else:
            same = agreement(primary, answer)
            outcome = "ok" if same is None else "agree" if same else "disagree"
    except Exception as exc:  # a failed shadow is a figure of the candidate's, nothing more
        log.info("shadow request to %s (promotion of %s) failed: %s", candidate, model,
                 getattr(exc, "message", type(exc).__name__))
        outcome = "error"
    if took is not None:
        metrics.ROLLOUT_SECONDS.labels(model, candidate, "shadow").observe(took)
    metrics.ROLLOUT_REQUESTS.labels(model, candidate, "shadow", outcome).inc()
