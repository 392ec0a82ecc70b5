"""`/v1/files` and `/v1/batches`, as OpenAI serves them (the `openai` SDK's `files` and `batches` work as they are).

Everything belongs to the key that made it: another key's file or batch answers 404, as if absent. A gateway without
keys keeps everything under one anonymous owner. Only `purpose="batch"` uploads are taken; a batch's output and
error files have purpose `batch_output`. Files expire as OpenAI's do: `expires_after` on upload, a batch's
`output_expires_after` for its files, else the gateway's `batch_files_expire_s` (30 days).
"""

from __future__ import annotations

import asyncio
import time
from typing import Literal

from fastapi import Depends, FastAPI, File, Form, Query, Request, Response, UploadFile
from fastapi.responses import FileResponse, StreamingResponse
from pydantic import ValidationError
from sqlalchemy import exc as sa_exc
from starlette.concurrency import iterate_in_threadpool

from ..access.auth import authenticate, request_key
from ..edge.orjson_route import gateway_router
from ..exceptions import Forbidden, GatewayError, InvalidRequest, NotFound, gateway_error
from . import lines as batch_lines
from .protocol import Batch, BatchCreate, BatchList, ExpiresAfter, FileDeleted, FileList, FileObject
from .runner import ANONYMOUS, BatchRunner
from .store import new_id

router = gateway_router(tags=["batch"], dependencies=[Depends(authenticate)])
COMPLETION_WINDOW_S = 24 * 3600
CHUNK = 1 << 20


class FileTooLarge(GatewayError):
    status, type, code = 413, "invalid_request_error", "file_too_large"


class StoreUnavailable(GatewayError):
    status, type, code = 503, "service_unavailable", "store_unavailable"


def install_store_errors(app: FastAPI) -> None:
    """The store's database unreachable: 503 with Retry-After, what a client's retry policy waits on (not a 500)."""
    @app.exception_handler(sa_exc.OperationalError)
    async def _store_down(request: Request, exc: sa_exc.OperationalError):
        return gateway_error(StoreUnavailable("the Files and Batch APIs' store is unreachable; try again later",
                                              retry_after=5), getattr(request.state, "request_id", "-"))


async def _runner(request: Request) -> BatchRunner:
    """The gateway's batch runner, its store open (off the event loop; 503 while its database does not answer)."""
    runner = request.app.state.gateway.batches
    if runner is None:
        raise NotFound("the Files and Batch APIs are off on this gateway: set batch_dir (RTXSERVE_BATCH_DIR) to a "
                       "directory it keeps, or batch_store_url (RTXSERVE_BATCH_STORE_URL) to a PostgreSQL database")
    await runner.open()
    return runner


def _owner(request: Request) -> str:
    key = request_key(request)
    return key.name if key is not None else ANONYMOUS


async def _file(runner: BatchRunner, file_id: str, owner: str) -> dict:
    found = await asyncio.to_thread(runner.store.file, file_id, owner)
    if found is None:
        raise NotFound(f"no file {file_id!r}", param="file_id")
    return found


async def _batch(runner: BatchRunner, batch_id: str, owner: str) -> Batch:
    found = await asyncio.to_thread(runner.store.batch, batch_id, owner)
    if found is None:
        raise NotFound(f"no batch {batch_id!r}", param="batch_id")
    return Batch.model_validate(found)


def _chunks(upload, limit: int):
    size = 0
    while chunk := upload.read(CHUNK):
        size += len(chunk)
        if size > limit:
            raise FileTooLarge(f"the file is larger than this gateway's limit of {limit} bytes per file")
        yield chunk


@router.post("/v1/files", response_model=FileObject)
async def upload_file(request: Request, file: UploadFile = File(...),
                      purpose: str = Form(..., min_length=1),  # FastAPI reads an empty field as none
                      anchor: str | None = Form(None, alias="expires_after[anchor]"),
                      seconds: str | None = Form(None, alias="expires_after[seconds]")) -> FileObject:
    """Upload a JSONL file of batch requests (`purpose="batch"`), up to `batch_max_file_bytes`. Each line must be a
    JSON object; the lines are checked against their endpoint when a batch is made from the file. `expires_after`
    (the SDK sends it as the form fields expires_after[anchor] and expires_after[seconds]) says when it is deleted."""
    runner, owner = await _runner(request), _owner(request)
    if purpose != "batch":
        raise InvalidRequest(f"purpose {purpose[:40]!r} is not taken here; upload batch input with purpose 'batch'",
                             param="purpose")
    expires_s = runner.settings.batch_files_expire_s
    if anchor is not None or seconds is not None:
        try:
            expires_s = ExpiresAfter.model_validate({"anchor": anchor, "seconds": seconds}).seconds
        except ValidationError:
            raise InvalidRequest("expires_after needs anchor 'created_at' and seconds from 3600 (1 hour) to 2592000 "
                                 "(30 days)", param="expires_after") from None
    file_id, store = new_id("file-"), runner.store
    size = await asyncio.to_thread(store.write_file, file_id, _chunks(file.file, runner.settings.batch_max_file_bytes))
    try:
        async with store.local_async(file_id) as path:
            if not await batch_lines.count(path):
                raise InvalidRequest("the file holds no JSON lines", param="file")
    except InvalidRequest:
        await asyncio.to_thread(store.discard_bytes, file_id)
        raise
    row = await asyncio.to_thread(runner.store.add_file, file_id, owner, file.filename or "upload.jsonl", purpose,
                                  size, expires_s)
    return FileObject.model_validate(row)


@router.get("/v1/files", response_model=FileList)
async def list_files(request: Request, purpose: str | None = None, limit: int = Query(10_000, ge=1, le=10_000),
                     after: str | None = None, order: Literal["asc", "desc"] = "desc") -> FileList:
    runner = await _runner(request)
    rows = await asyncio.to_thread(runner.store.files, _owner(request), purpose, after, limit, order == "desc")
    data = [FileObject.model_validate(r) for r in rows[:limit]]
    return FileList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                    has_more=len(rows) > limit)


@router.get("/v1/files/{file_id}", response_model=FileObject)
async def retrieve_file(file_id: str, request: Request) -> FileObject:
    return FileObject.model_validate(await _file(await _runner(request), file_id, _owner(request)))


@router.get("/v1/files/{file_id}/content", response_class=FileResponse)
async def file_content(file_id: str, request: Request) -> Response:
    """The file's bytes: an upload as it was sent, or a batch's output or error lines."""
    runner = await _runner(request)
    found = await _file(runner, file_id, _owner(request))
    if runner.store.on_disk:
        return FileResponse(runner.store.path(file_id), media_type="application/jsonl", filename=found["filename"])
    return StreamingResponse(iterate_in_threadpool(runner.store.read_chunks(file_id)), media_type="application/jsonl",
                             headers={"content-disposition": f'attachment; filename="{found["filename"]}"'})


@router.delete("/v1/files/{file_id}", response_model=FileDeleted)
async def delete_file(file_id: str, request: Request) -> FileDeleted:
    runner = await _runner(request)
    try:
        deleted = await asyncio.to_thread(runner.store.delete_file, file_id, _owner(request))
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="file_id") from None
    if not deleted:
        raise NotFound(f"no file {file_id!r}", param="file_id")
    return FileDeleted(id=file_id)


@router.post("/v1/batches", response_model=Batch)
async def create_batch(body: BatchCreate, request: Request) -> Batch:
    """Run every request of an uploaded file at batch priority. The file is checked whole first: a bad line refuses
    the batch (400 naming the line), and nothing runs."""
    runner, owner, key = await _runner(request), _owner(request), request_key(request)
    if body.endpoint not in runner.endpoints:
        raise InvalidRequest(f"endpoint {body.endpoint[:100]!r} cannot run in a batch; these can: "
                             f"{', '.join(runner.endpoints)}", param="endpoint")
    found = await _file(runner, body.input_file_id, owner)
    if found["purpose"] != "batch":
        raise InvalidRequest(f"file {body.input_file_id} has purpose {found['purpose']!r}, not 'batch'",
                             param="input_file_id")
    async with runner.store.local_async(body.input_file_id) as path:
        lines, model = await batch_lines.read(path, body.endpoint, runner.endpoints[body.endpoint],
                                              runner.settings.batch_max_requests)
    if key is not None and not key.allows(model):
        raise Forbidden(f"this API key may not use model {model!r}, which the file's requests name", param="model")
    request.app.state.gateway.dispatch.check_served(model)
    now = int(time.time())
    batch_id = new_id("batch_")
    await asyncio.to_thread(runner.store.add_batch, {
        "id": batch_id, "owner": owner, "endpoint": body.endpoint, "input_file_id": body.input_file_id,
        "completion_window": body.completion_window, "model": model, "status": "validating", "total": len(lines),
        "metadata": body.metadata, "created_at": now, "expires_at": now + COMPLETION_WINDOW_S,
        "output_expires_s": body.output_expires_after.seconds if body.output_expires_after else None})
    runner.wake()
    return await _batch(runner, batch_id, owner)


@router.get("/v1/batches", response_model=BatchList)
async def list_batches(request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None) -> BatchList:
    runner = await _runner(request)
    rows = await asyncio.to_thread(runner.store.batches, _owner(request), after, limit)
    data = [Batch.model_validate(r) for r in rows[:limit]]
    return BatchList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                     has_more=len(rows) > limit)


@router.get("/v1/batches/{batch_id}", response_model=Batch)
async def retrieve_batch(batch_id: str, request: Request) -> Batch:
    return await _batch(await _runner(request), batch_id, _owner(request))


@router.post("/v1/batches/{batch_id}/cancel", response_model=Batch)
async def cancel_batch(batch_id: str, request: Request) -> Batch:
    """Stop sending the batch's requests: it is `cancelling` while those in flight finish, then `cancelled`, its
    files holding what ran (and, in the error file, each request that did not, as `batch_cancelled`)."""
    runner, owner = await _runner(request), _owner(request)
    batch = await _batch(runner, batch_id, owner)
    if not await asyncio.to_thread(runner.store.set_status, batch_id, "cancelling",
                                   only_from=("validating", "in_progress")):
        if batch.status not in ("cancelling", "cancelled"):
            raise InvalidRequest(f"batch {batch_id} is {batch.status}: only a batch that has not ended can be cancelled",
                                 param="batch_id")
    runner.wake()
    return await _batch(runner, batch_id, owner)
