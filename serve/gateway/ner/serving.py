"""POST /v1/ner logic, testable without a server."""

from __future__ import annotations

from core.contract import TOKEN_CLASSIFICATION

from ..fleet.answer_cache import Rows
from ..inputs.text import check_texts
from ..state import GatewayState
from .protocol import Entity, NerRequest, NerResponse, NerResult

TASK = TOKEN_CLASSIFICATION


async def tag(state: GatewayState, request: NerRequest) -> NerResponse:
    texts = check_texts(state.settings, request.input)
    info = await state.dispatch.resolve(request.model, TASK)
    aggregation = request.aggregation or info.extra.get("aggregation") or "first"
    results = await state.dispatch.call(info, Rows(("tag", aggregation), texts, lambda b, m, texts:
                                                   b.tag(m, texts, aggregation, state.settings.request_timeout_s)))
    data = [
        NerResult(
            index=i,
            entities=[Entity(entity=e.get("entity_group", e.get("entity")), **{k: e[k] for k in ("score", "start", "end", "word")},
                             index=e.get("index")) for e in r.entities],
            truncated=r.truncated,
            tokens=r.tokens,
        )
        for i, r in enumerate(results)
    ]
    return NerResponse(model=info.name, aggregation=aggregation, data=data)


# Deep readiness (state.py): the first request each model answers before it takes traffic.
CANARIES = {TOKEN_CLASSIFICATION: lambda backend, model, timeout: backend.tag(
    model, ["ok"], model.extra.get("aggregation", "first"), timeout)}
