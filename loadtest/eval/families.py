"""Per task: the request a reference input becomes, and how the served answer is held to the framework's.

Each family compares one input at a time (`compare` -> an `Answer`: whether it agrees, its drift figure, what was
served and expected) and then the whole set (`gates`: agreement and drift against the thresholds). The thresholds
have defaults per family, tight for an artifact export kept exact (fp32, fused) and, for a lossy one (int8, fp16),
what export itself measured on the same inputs with room to spare (`ReferenceSet.drift`); every one has a flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.reference import Item, ReferenceSet
from core.tasks import (FEATURE_EXTRACTION, IMAGE_CLASSIFICATION, OBJECT_DETECTION, TEXT_CLASSIFICATION,
                        TOKEN_CLASSIFICATION)

LOSSLESS = ("fp32", "optimized", "tensorrt-fp32")


@dataclass
class Answer:
    """One input's comparison: `agrees` (the same label, entities, detections, continuation, transcript), `drift` (the
    family's figure: max |Δlogit|, 1 - cosine, mean |Δlogprob|, WER, ...), what was served and expected (short)."""

    agrees: bool
    drift: float
    served: str
    expected: str
    detail: str = ""
    gold: dict[str, bool] | None = None  # the served and the framework's answer against the right one
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Gate:
    name: str
    value: float
    limit: float
    at_least: bool  # value >= limit passes (else value <= limit)

    @property
    def passed(self) -> bool:
        return self.value >= self.limit if self.at_least else self.value <= self.limit + 1e-12

    def describe(self) -> str:
        return f"{self.name} {self.value:.6g} ({'>=' if self.at_least else '<='} {self.limit:.6g})"


class Family:
    """What every family shares; the subclasses say what differs."""

    task: tuple[str, ...]
    route: str
    drift_name: str  # what `Answer.drift` measures
    drift_flag: str  # its command-line flag
    
    def request(self, model: str, item: Item, ref: ReferenceSet) -> dict:
        """The request's httpx arguments (json=, or files= and data=)."""
        return {"json": self.body(model, item, ref)}

    def path(self, item: Item) -> str:
        return self.route

    def body(self, model: str, item: Item, ref: ReferenceSet) -> dict:
        raise NotImplementedError

    def compare(self, item: Item, answer: dict, ref: ReferenceSet) -> Answer:
        raise NotImplementedError

    def served_answer(self, answer: dict) -> Any:
        """What the box answered, as an eval set's right answer is written (a label, entities, a text)."""
        raise ValueError(f"{self.task[0]} answers have no right answer to be held to")

    def compare_gold(self, item: Item, answer: dict) -> Answer:
        """An input of an eval set without the framework's answer (a model exported before reference sets): the served
        answer against the right one only."""
        served = self.served_answer(answer)
        right = self.gold_matches(served, item.gold)
        return Answer(right, 0.0, _short(str(served)), _short(str(item.gold)), gold={"served": right})

    @staticmethod
    def gold_matches(served: Any, gold: Any) -> bool:
        return served == gold

    def default_limits(self, ref: ReferenceSet) -> dict[str, float]:
        """{"agreement": the least share of inputs that agree, "drift": the largest drift of any input}."""
        raise NotImplementedError

    def gates(self, answers: list[Answer], limits: dict[str, float]) -> list[Gate]:
        agreement = sum(a.agrees for a in answers) / len(answers)
        worst = max(a.drift for a in answers)
        return [Gate("agreement", agreement, limits["agreement"], True),
                Gate(self.drift_name, worst, limits["drift"], False)]

    @staticmethod
    def lossy(ref: ReferenceSet) -> bool:
        return ref.variant not in LOSSLESS


def _short(text: str, n: int = 60) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _exported(ref: ReferenceSet, key: str, default: float) -> float:
    value = ref.drift.get(key)
    return default if value is None or not math.isfinite(value) else value


class Classification(Family):
    task = (TEXT_CLASSIFICATION, IMAGE_CLASSIFICATION)
    route = "/v1/classify"
    drift_name, drift_flag = "max |Δlogit|", "--max-logit-diff"

    def body(self, model, item, ref):
        return {"model": model, "input": [item.input]}

    def served_answer(self, answer):
        return answer["data"][0]["label"]

    def compare(self, item, answer, ref):
        served = answer["data"][0]
        scores = served["scores"]
        missing = [label for label in ref.labels if label not in scores]
        if missing:
            return Answer(False, math.inf, served["label"], item.expect["label"],
                          f"the served labels are not the model's: {', '.join(missing[:3])} missing")
        p = np.clip(np.array([scores[label] for label in ref.labels], dtype=np.float64), 1e-45, 1.0)
        want = np.array(item.expect["logits"], dtype=np.float64)
        if ref.settings.get("multi_label"):  # a sigmoid per label: its logit, absolute
            got = np.log(p) - np.log1p(-np.minimum(p, 1 - 1e-7))
        else:  # softmax: logits known up to a constant, so both are centred
            got, want = np.log(p) - np.log(p).mean(), want - want.mean()
        drift = float(np.abs(got - want).max())
        gold = None if item.gold is None else {"served": served["label"] == item.gold,
                                               "framework": item.expect["label"] == item.gold}
        return Answer(served["label"] == item.expect["label"], drift, served["label"], item.expect["label"], gold=gold)

    def default_limits(self, ref):
        if self.lossy(ref):
            return {"agreement": 0.9, "drift": max(1e-3, 2 * _exported(ref, "max_abs_diff", 0.5))}
        return {"agreement": 1.0, "drift": 1e-3}


class Entities(Family):
    task = (TOKEN_CLASSIFICATION,)
    route = "/v1/ner"
    drift_name, drift_flag = "max |Δscore|", "--max-score-diff"

    def body(self, model, item, ref):
        return {"model": model, "input": [item.input], "aggregation": ref.settings.get("aggregation", "first")}

    @staticmethod
    def _spans(entities) -> list[tuple]:
        return [(e["entity"], e["start"], e["end"]) for e in entities]

    def served_answer(self, answer):
        return answer["data"][0]["entities"]

    def gold_matches(self, served, gold) -> bool:
        return set(self._spans(served)) == set(self._spans(gold))

    def compare(self, item, answer, ref):
        served, want = answer["data"][0]["entities"], item.expect["entities"]
        agrees = self._spans(served) == self._spans(want)
        drift = max((abs(a["score"] - b["score"]) for a, b in zip(served, want)), default=0.0) if agrees else math.inf
        show = lambda es: _short(", ".join(f"{e['word']}:{e['entity']}" for e in es) or "(none)")  # noqa: E731
        detail = "" if agrees else f"{len(served)} entities served, {len(want)} expected"
        gold = None if item.gold is None else {"served": self.gold_matches(served, item.gold),
                                               "framework": self.gold_matches(want, item.gold)}
        return Answer(agrees, drift, show(served), show(want), detail, gold)

    def default_limits(self, ref):
        if self.lossy(ref):
            return {"agreement": 0.8, "drift": 0.1}
        return {"agreement": 1.0, "drift": 1e-3}


class Embeddings(Family):
    task = (FEATURE_EXTRACTION,)
    route = "/v1/embeddings"
    drift_name, drift_flag = "1 - cosine", "--max-cosine-distance"

    def body(self, model, item, ref):
        return {"model": model, "input": [item.input], "encoding_format": "float"}

    def compare(self, item, answer, ref):
        got = np.asarray(answer["data"][0]["embedding"], dtype=np.float64)
        want = np.asarray(item.expect["embedding"], dtype=np.float64)
        if got.shape != want.shape:
            return Answer(False, math.inf, f"{got.size} dimensions", f"{want.size} dimensions", "the sizes differ")
        norms = float(np.linalg.norm(got) * np.linalg.norm(want))
        cosine = float(got @ want / norms) if norms else float(np.array_equal(got, want))
        drift = max(0.0, 1.0 - cosine)
        return Answer(True, drift, f"max |Δ| {float(np.abs(got - want).max()):.3g}", f"{want.size} dimensions",
                      extra={"cosine": cosine})

    def default_limits(self, ref):
        if self.lossy(ref):
            return {"agreement": 1.0, "drift": max(1e-4, 2 * (1 - _exported(ref, "min_cosine", 0.99)))}
        return {"agreement": 1.0, "drift": 1e-5}


class Detections(Family):
    task = (OBJECT_DETECTION,)
    route = "/v1/detect"
    drift_name, drift_flag = "max |Δscore| of matched detections", "--max-score-diff"
    iou = 0.5
    near_cut = 0.01  # a detection scoring this close to the conf cut may fall on either side of it

    def body(self, model, item, ref):
        return {"model": model, "input": [item.input], "conf": ref.settings.get("conf", 0.5)}

    def compare(self, item, answer, ref):
        conf = ref.settings.get("conf", 0.5)
        served = [[*d["box"], d["score"], d["class_id"]] for d in answer["data"][0]["detections"]]
        want = item.expect["detections"]
        free, worst, missed = list(served), 0.0, 0
        for row in sorted(want, key=lambda r: -r[4]):
            same = [s for s in free if int(s[5]) == int(row[5]) and _iou(s[:4], row[:4]) >= self.iou]
            if not same:
                missed += row[4] >= conf + self.near_cut
                continue
            best = max(same, key=lambda s: _iou(s[:4], row[:4]))
            free.remove(best)
            worst = max(worst, abs(best[4] - row[4]))
        extra = sum(s[4] >= conf + self.near_cut for s in free)
        agrees = not missed and not extra
        detail = "" if agrees else f"{missed} expected detection(s) not served, {extra} served beyond the expected"
        return Answer(agrees, worst if agrees else math.inf, f"{len(served)} detections", f"{len(want)} detections",
                      detail)

    def default_limits(self, ref):
        if self.lossy(ref):
            return {"agreement": 0.8, "drift": 0.1}
        return {"agreement": 1.0, "drift": 1e-3}


def _iou(a, b) -> float:
    inter = max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


FAMILIES: list[Family] = [Classification(), Entities(), Embeddings(), Detections()]
