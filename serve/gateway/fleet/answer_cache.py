"""The gateway's answer cache (`response_cache_mb`): a model's answers for classify, embeddings and NER kept row by
row, so that an input seen before is answered without leaving the gateway, and only the rows never seen go to the
backend (coalesced with other requests' rows, backends/triton.py, which Triton's own cache would forbid: B9 in
../shared/BENCH.md).

An answer is kept under everything that decides it: the model that answered (not the name asked for: an alias, a
fallback or a promotion may send the request elsewhere), the call and its options (NER's aggregation), the input
exactly as the backend receives it (an image by its BLAKE2 digest), and the scope of the key that asked (its model
patterns): keys of different scopes never share an answer, so no key learns from a fast answer what another sent.
Each model's cache is bounded by bytes (cachetools' LRU, least recently used out first), one per gateway worker;
hits, misses, evictions and bytes are in /metrics (rtxserve_answer_cache_*). A model that stops being ready loses its
answers: whatever is loaded under its name next may answer differently.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from cachetools import LRUCache

from .. import metrics
from ..access.caller import CALLER_SCOPE
from ..backends.base import Backend, Classification, Embedding, ModelInfo, Tagging

log = logging.getLogger("rtxserve.gateway")

_ENTRY_BYTES = 200  # what a kept row costs beyond its input and answer: the key tuple, the LRU's links, the dicts


@dataclass(frozen=True)
class Rows:
    """A call answered one row per input, in order: `run(backend, model, inputs)`. Called as dispatch.py calls
    anything, `rows(backend, model)`, it runs for all of `inputs`; the answer cache runs it for those it lacks."""

    options: tuple  # what besides the input decides a row's answer: the call's name and its options
    inputs: list
    run: Callable[[Backend, ModelInfo, list], Awaitable[list]] = field(compare=False)

    def __call__(self, backend: Backend, model: ModelInfo) -> Awaitable[list]:
        return self.run(backend, model, self.inputs)

    def only(self, inputs: list) -> Rows:
        return Rows(self.options, inputs, self.run)


def _input_key(item: str | bytes) -> str | bytes:
    """A text as it is (hashing it costs more than the dict's own hash); an image by its digest."""
    return item if isinstance(item, str) else hashlib.blake2b(item, digest_size=16).digest()


def _row_bytes(key: tuple, answer) -> int:
    item = key[-1]
    size = _ENTRY_BYTES + (len(item) * (4 if isinstance(item, str) and not item.isascii() else 1))
    if isinstance(answer, Classification):
        return size + 100 * (1 + len(answer.scores))
    if isinstance(answer, Embedding):
        return size + answer.vector.nbytes
    if isinstance(answer, Tagging):
        return size + sum(100 + len(str(e.get("word", ""))) * 2 for e in answer.entities)
    return size + 256


class _ModelCache:
    def __init__(self, model: str, max_bytes: int):
        self.model = model
        self.lru = LRUCache(maxsize=max_bytes, getsizeof=self._sizeof)
        lookups = metrics.ANSWER_CACHE_LOOKUPS
        self.hits, self.misses = lookups.labels(model, "hit"), lookups.labels(model, "miss")
        self.evicted = metrics.ANSWER_CACHE_EVICTIONS.labels(model)
        self.bytes = metrics.ANSWER_CACHE_BYTES.labels(model)

    def _sizeof(self, value) -> int:
        return value[1]

    def get(self, key: tuple):
        found = self.lru.get(key)
        return None if found is None else found[0]

    def put(self, key: tuple, answer) -> None:
        size = _row_bytes(key, answer)
        if size > self.lru.maxsize:
            return  # one row larger than the whole cache: not kept
        evicted = 0
        while self.lru.currsize + size > self.lru.maxsize:  # cachetools would evict the same; counted here
            self.lru.popitem()
            evicted += 1
        self.lru[key] = (answer, size)
        if evicted:
            self.evicted.inc(evicted)
        self.bytes.set(self.lru.currsize)

    def clear(self) -> None:
        self.lru.clear()
        self.bytes.set(0)


class AnswerCache:
    """Each model's cache of `response_cache_mb` (settings.py): none for a model not named there."""

    def __init__(self, sizes_mb: dict[str, float]):
        self.models = {name: _ModelCache(name, int(mb * 2**20)) for name, mb in sizes_mb.items() if mb > 0}

    def __contains__(self, model: str) -> bool:
        return model in self.models

    async def rows(self, model: str, rows: Rows, fetch: Callable[[Rows], Awaitable[list]]) -> list:
        """`rows`' answers: those kept, and `fetch(rows.only(the others))` for the rest (each input once), which are
        kept. A failed fetch keeps nothing and raises, as the call would have."""
        cache = self.models[model]
        scope = CALLER_SCOPE.get()
        keys = [(scope, rows.options, _input_key(item)) for item in rows.inputs]
        answers = [cache.get(key) for key in keys]
        missing = {}  # key -> its first input's index: an input repeated within the request is fetched once
        for i, (key, answer) in enumerate(zip(keys, answers)):
            if answer is None:
                missing.setdefault(key, i)
        hits = len(answers) - sum(1 for a in answers if a is None)
        if hits:
            cache.hits.inc(hits)
        if not missing:
            return answers
        cache.misses.inc(len(answers) - hits)
        fetched = await fetch(rows.only([rows.inputs[i] for i in missing.values()]))
        found = dict(zip(missing, fetched))
        for key, answer in found.items():
            cache.put(key, answer)
        return [answer if answer is not None else found[key] for key, answer in zip(keys, answers)]

    def forget(self, model: str) -> None:
        """The model stopped being ready: whatever answers under its name next may answer differently."""
        cache = self.models.get(model)
        if cache is not None and cache.lru.currsize:
            log.info("model %s is not ready: its %d cached answers are dropped", model, len(cache.lru))
            cache.clear()
