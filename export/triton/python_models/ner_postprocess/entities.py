"""Token-classification logits -> entity spans with character offsets, as transformers'
token-classification pipeline computes them (strategies none / simple / first / average / max).

Pure Python + NumPy, no imports of ours: it runs beside model.py inside Triton's python backend,
and the export and the tests import it to check it against the transformers pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

STRATEGIES = ("none", "simple", "first", "average", "max")
WORD_STRATEGIES = ("first", "average", "max")


@dataclass(frozen=True)
class Token:
    """One token of a text as the tokenizer produced it (tokenizers.Encoding gives all of these)."""

    id: int
    text: str  # the vocabulary string, e.g. "##ing"
    start: int
    end: int
    special: bool


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def _is_subword(token: Token, text: str, word_aware: bool) -> bool:
    piece = text[token.start:token.end]
    if word_aware:  # a tokenizer with a continuing-subword prefix ("##"): the token is longer than its text
        return len(token.text) != len(piece)
    # Otherwise the pipeline's heuristic: a token glued to the previous character starts no word.
    return token.start > 0 and " " not in text[token.start - 1:token.start + 1]


def _tag(label: str) -> tuple[str, str]:
    if label.startswith("B-"):
        return "B", label[2:]
    if label.startswith("I-"):
        return "I", label[2:]
    return "I", label  # not in B-/I- form: a continuation


def _word_entities(tokens: list[dict], strategy: str, labels: list[str]) -> list[dict]:
    """Merge sub-word tokens into words; each word takes one label by the strategy."""
    words, group = [], []
    for token in tokens:
        if group and not token["subword"]:
            words.append(group)
            group = []
        group.append(token)
    if group:
        words.append(group)
    out = []
    for group in words:
        if strategy == "first":
            scores = group[0]["scores"]
        elif strategy == "max":
            scores = max(group, key=lambda t: t["scores"].max())["scores"]
        else:  # average
            scores = np.nanmean(np.stack([t["scores"] for t in group]), axis=0)
        idx = int(scores.argmax())
        out.append({"entity": labels[idx], "score": float(scores[idx]), "start": group[0]["start"],
                    "end": group[-1]["end"], "index": group[0]["index"]})
    return out


def _group(entities: list[dict]) -> list[dict]:
    """Adjacent entities of one type (a B- starts a new one) become one span with their mean score."""
    groups, current = [], []
    for entity in entities:
        if current:
            bi, tag = _tag(entity["entity"])
            _, last_tag = _tag(current[-1]["entity"])
            if tag != last_tag or bi == "B":
                groups.append(current)
                current = []
        current.append(entity)
    if current:
        groups.append(current)
    return [{"entity_group": g[0]["entity"].split("-", 1)[-1], "score": float(np.nanmean([e["score"] for e in g])), "start": g[0]["start"],
             "end": g[-1]["end"]} for g in groups]


def entities(text: str, tokens: list[Token], logits: np.ndarray, labels: list[str], strategy: str, *,
             word_aware: bool, unk_id: int | None, ignore: tuple[str, ...] = ("O",)) -> list[dict]:
    """The entities of `text`. `logits` [tokens, labels] belong to `tokens` (padding already cut off).

    Each entity: `entity` (none) or `entity_group` (the others), `score`, `start`, `end` (character
    offsets into `text`), `word` (= text[start:end]); `index` (token position) with strategy none.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown aggregation {strategy!r}; valid: {', '.join(STRATEGIES)}")
    if len(logits) < len(tokens):
        raise ValueError(f"{len(logits)} logit rows for {len(tokens)} tokens")
    scores = softmax(np.asarray(logits[:len(tokens)], dtype=np.float32))
    pre = []
    for i, token in enumerate(tokens):
        if token.special:
            continue
        subword = False if token.id == unk_id else _is_subword(token, text, word_aware)
        pre.append({"scores": scores[i], "start": token.start, "end": token.end, "index": i, "subword": subword})
    if strategy in WORD_STRATEGIES:
        found = _word_entities(pre, strategy, labels)
    else:
        found = []
        for p in pre:
            idx = int(p["scores"].argmax())
            found.append({"entity": labels[idx], "score": float(p["scores"][idx]), "start": p["start"],
                          "end": p["end"], "index": p["index"]})
    if strategy != "none":
        found = _group(found)
    key = "entity" if strategy == "none" else "entity_group"
    result = []
    for e in found:
        if e[key] in ignore:
            continue
        e["word"] = text[e["start"]:e["end"]]
        if strategy != "none":
            e.pop("index", None)
        result.append(e)
    return result
