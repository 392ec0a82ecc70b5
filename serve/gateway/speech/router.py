import orjson
from fastapi import Depends, Request, Response
from starlette.datastructures import UploadFile

from ..access.auth import admit, authenticate
from ..backends.base import Upload
from ..edge.orjson_route import gateway_router, unless_client_leaves
from ..exceptions import InvalidRequest
from .serving import transcribe

router = gateway_router(tags=["openai"], dependencies=[Depends(authenticate)])
# Form fields beside the file: OpenAI's are about ten; a form of hundreds is not a client's.
MAX_FIELDS = 64


async def _answer(request: Request, path: str) -> Response:
    form = await request.form(max_files=1, max_fields=MAX_FIELDS)  # a malformed form: Starlette's 400, our shape
    files = [(k, v) for k, v in form.multi_items() if isinstance(v, UploadFile)]
    fields = [(k, v) for k, v in form.multi_items() if isinstance(v, str)]
    if [k for k, _ in files] != ["file"]:
        raise InvalidRequest("the form needs one audio file, in the field `file`", param="file")
    upload = files[0][1]
    audio = Upload(await upload.read(), upload.filename or "audio", upload.content_type or "application/octet-stream")
    await form.close()
    model = dict(fields).get("model", "")
    if model:
        await admit(request, model)
    answer = await unless_client_leaves(request, transcribe(request.app.state.gateway, path, fields, audio))
    if isinstance(answer, str):
        return Response(answer, media_type="text/plain; charset=utf-8")
    return Response(orjson.dumps(answer), media_type="application/json")  # vLLM's answer, relayed as is


@router.post("/v1/audio/transcriptions")
async def transcriptions(request: Request) -> Response:
    """OpenAI audio transcriptions: a multipart form with the audio `file`, `model`, and optionally `language`,
    `prompt`, `response_format` (json, text, verbose_json, srt, vtt), `temperature`, `timestamp_granularities[]`."""
    return await _answer(request, "/v1/audio/transcriptions")


@router.post("/v1/audio/translations")
async def translations(request: Request) -> Response:
    """OpenAI audio translations (into English): the same form as transcriptions."""
    return await _answer(request, "/v1/audio/translations")
