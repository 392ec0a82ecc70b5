"""Send a reference set through the gateway, one input per request as a client would, and judge the answers."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx
from tenacity import Retrying, retry_if_result, stop_after_delay, wait_exponential

from core.reference import Item, ReferenceSet

from .families import FAMILIES, Answer, Family, Gate, _short
from .generation import GENERATIVE

# A model loading on demand answers 503 with Retry-After meanwhile; so does a box at its admission limit (429).
RETRIED = {429, 503}


def family(task: str) -> Family:
    """The family comparing answers of `task`; ValueError naming the tasks eval knows."""
    for f in [*FAMILIES, *GENERATIVE]:
        if task in f.task:
            return f
    known = sorted(t for f in [*FAMILIES, *GENERATIVE] for t in f.task)
    raise ValueError(f"eval does not compare {task} models yet; it does {', '.join(known)}")


@dataclass
class EvalResult:
    model: str
    url: str
    reference: ReferenceSet
    family: Family
    inputs: list[str]
    answers: list[Answer]
    limits: dict[str, float]
    gates: list[Gate]
    seconds: float
    gold: dict[str, float] = field(default_factory=dict)  # the share right, served and framework, where gold was given

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    def verdict(self) -> str:
        failed = [g.describe() for g in self.gates if not g.passed]
        return ("PASSED: " + "; ".join(g.describe() for g in self.gates) if not failed
                else "DRIFTED: " + "; ".join(failed))

    def to_dict(self) -> dict:
        ref = self.reference
        return {
            "model": self.model, "url": self.url, "task": ref.task, "passed": self.passed, "verdict": self.verdict(),
            "reference": {"framework": ref.framework, "source": ref.source, "made_from": ref.made_from,
                          "variant": ref.variant, "items": len(ref.items)},
            "limits": self.limits, "gates": [{"name": g.name, "value": g.value, "limit": g.limit,
                                              "at_least": g.at_least, "passed": g.passed} for g in self.gates],
            "gold": self.gold, "seconds": self.seconds,
            "inputs": [{"input": i, "agrees": a.agrees, "drift": a.drift, "served": a.served, "expected": a.expected,
                        "detail": a.detail, "gold": a.gold, **a.extra} for i, a in zip(self.inputs, self.answers)],
        }


def describe(item: Item) -> str:
    """An input, short, for the report."""
    value = item.input
    if isinstance(value, str):
        return _short(value)
    if "messages" in value:
        return _short(str(value["messages"][-1].get("content", "")))
    for key in ("prompt", "filename"):
        if key in value:
            return _short(str(value[key]))
    return "image" if "image" in value else "input"


def evaluate(url: str, model: str, ref: ReferenceSet, *, limits: dict[str, float] | None = None, api_key: str = "",
             timeout_s: float = 120.0, retry_s: float = 120.0, settings: dict | None = None,
             progress: Callable[[int, int], None] | None = None) -> EvalResult:
    """Every input of `ref` sent to `model` at the gateway `url` and compared with what the framework answered.
    `limits` overrides the family's defaults ("agreement", "drift"); `settings` the reference's own (tie_logprob)."""
    fam = family(ref.task)
    if settings:
        ref = ref.model_copy(update={"settings": {**ref.settings, **settings}})
    # Without the framework's answers (an eval set's right answers only) there is no drift to measure: the share right
    # is reported, and held to --min-agreement where it is given.
    defaults = fam.default_limits(ref) if any(i.expect for i in ref.items) else {"agreement": 0.0, "drift": math.inf}
    limits = defaults | {k: v for k, v in (limits or {}).items() if v is not None}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    started = time.perf_counter()
    answers = []
    with httpx.Client(base_url=url, headers=headers, timeout=timeout_s) as client:
        for i, item in enumerate(ref.items):
            answers.append(_ask(client, fam, model, item, ref, retry_s))
            if progress is not None:
                progress(i + 1, len(ref.items))
    result = EvalResult(model, url, ref, fam, [describe(i) for i in ref.items], answers, limits,
                        fam.gates(answers, limits), time.perf_counter() - started)
    judged = [a.gold for a in answers if a.gold is not None]
    if judged:
        result.gold = {who: sum(g[who] for g in judged) / len(judged) for who in ("served", "framework")
                       if all(who in g for g in judged)} | {"inputs": len(judged)}
    return result


def _ask(client: httpx.Client, fam: Family, model: str, item: Item, ref: ReferenceSet, retry_s: float) -> Answer:
    """One input's request (tried again while the box answers 503 / 429, up to `retry_s`) and its comparison; an
    answer the box refused, or one that cannot be read, is an input that does not agree, with the reason."""
    def send() -> httpx.Response:
        return client.post(fam.path(item), **fam.request(model, item, ref))

    try:
        response = Retrying(retry=retry_if_result(lambda r: r.status_code in RETRIED), stop=stop_after_delay(retry_s),
                            wait=wait_exponential(multiplier=0.5, max=5), retry_error_callback=lambda s: s.outcome.result(),
                            )(send)
    except httpx.HTTPError as exc:
        return Answer(False, float("inf"), "(no answer)", "", f"{type(exc).__name__}: {exc}")
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        return Answer(False, float("inf"), f"HTTP {response.status_code}", "", _short(message, 160))
    try:
        return fam.compare(item, response.json(), ref) if item.expect else fam.compare_gold(item, response.json())
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        return Answer(False, float("inf"), "(unreadable)", "", f"the answer could not be read: {type(exc).__name__}: {exc}")
