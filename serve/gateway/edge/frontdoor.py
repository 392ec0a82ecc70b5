"""The front door: what every request passes before any route runs (a pure ASGI middleware).

- `x-request-id`: honoured when the client sends a sane one, generated otherwise, echoed on every
  response and bound to the log context, so one id follows a request through the logs.
- Headers over `max_header_bytes` get 431, and a declared Content-Length over `max_body_bytes` 413,
  before any route runs or one byte of the body is read. A chunked body, with no length to judge, is
  counted as it arrives and refused the moment it passes the cap, so memory stays bounded by the cap.
  (Starlette's own `max_body_size` would answer in plain text, not in our error shape.)
"""

from __future__ import annotations

import os
import re

import structlog
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..exceptions import error_response

_SANE_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")
HEADER = b"x-request-id"


class FrontDoor:
    def __init__(self, app, *, max_header_bytes: int, max_body_bytes: int):
        self.app, self.max_headers, self.max_body = app, max_header_bytes, max_body_bytes

    def _refusal(self, headers) -> JSONResponse | None:
        if sum(len(k) + len(v) for k, v in headers) > self.max_headers:
            return error_response(431, f"the request headers are larger than this gateway's limit of "
                                       f"{self.max_headers} bytes", "invalid_request_error", code="431")
        declared = next((v for k, v in headers if k == b"content-length"), b"")
        if declared.isdigit() and int(declared) > self.max_body:
            return error_response(413, f"the request body is larger than this gateway's limit of "
                                       f"{self.max_body} bytes", "invalid_request_error", code="413")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope["headers"]
        given = next((v for k, v in headers if k == HEADER), b"")
        request_id = given if _SANE_ID.match(given) else os.urandom(16).hex().encode()  # as uuid4().hex, less work
        scope.setdefault("state", {})["request_id"] = request_id.decode()
        structlog.contextvars.bind_contextvars(request_id=request_id.decode())

        received = 0

        async def capped_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body:  # the route's handler maps this to our 413
                raise HTTPException(413, "body too large")
            return message

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (HEADER, request_id)]
            await send(message)

        try:
            refusal = self._refusal(headers)
            if refusal is not None:
                refusal.headers["connection"] = "close"  # the unread body must not be taken for the next request
                return await refusal(scope, receive, send_with_id)
            await self.app(scope, capped_receive, send_with_id)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")
