import orjson
from fastapi import Depends, Request, Response

from ..access.auth import admit, authenticate, request_key
from ..edge.orjson_route import gateway_router
from .protocol import PoolingRequest, RerankRequest, ScoreRequest
from .serving import rank

router = gateway_router(tags=["rerank"], dependencies=[Depends(authenticate)])

# Each path relayed to the same path of vLLM, which answers each in its own shape; the unversioned ones are vLLM's
# older names, served but not documented.
ROUTES = {
    "/v1/rerank": (RerankRequest, "Documents ranked by relevance to a query, by a cross-encoder (Jina's shape)."),
    "/v2/rerank": (RerankRequest, "Cohere's rerank API (the `cohere` SDK's `ClientV2.rerank`)."),
    "/rerank": (RerankRequest, None),
    "/v1/score": (ScoreRequest, "A relevance score per pair of texts (queries with documents), by a cross-encoder."),
    "/score": (ScoreRequest, None),
    "/pooling": (PoolingRequest, "vLLM's pooling API: each input's pooled hidden states, from a pooling engine."),
    "/classify": (PoolingRequest, "vLLM's classify API: each input's labels and probabilities, from a pooling engine "
                  "(the gateway's /v1/classify serves Triton's classifiers)."),
}


def _route(path: str, request_type: type, description: str | None) -> None:
    async def relay(body: request_type, request: Request) -> Response:
        await admit(request, body.model)
        answer = await rank(request.app.state.gateway, path, body, request_key(request))
        return Response(orjson.dumps(answer), media_type="application/json")  # vLLM's answer, relayed as is

    router.add_api_route(path, relay, methods=["POST"], name=path.strip("/").replace("/", "_"),
                         description=description or "", include_in_schema=description is not None)


for _path, (_type, _description) in ROUTES.items():
    _route(_path, _type, _description)
