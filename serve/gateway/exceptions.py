"""Gateway errors and the one place that maps every error to an HTTP response.

Bodies are OpenAI-shaped ({"error": {"message", "type", "param", "code"}}) so the `openai` SDK
raises its usual exceptions. Messages are written for the client: no stack traces, paths or
backend internals; the cause is logged with the request id instead.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

log = logging.getLogger("rtxserve.gateway")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error the gateway answers, in OpenAI's shape."""

    error: ErrorDetail


# Documented on every model route, so that clients (and schemathesis) know each answer's shape.
ERROR_RESPONSES = {
    status: {"model": ErrorBody, "description": description}
    for status, description in {
        400: "a limit of this gateway, or the backend's own refusal of the request",
        401: "missing or invalid API key", 403: "the API key may not use this model", 404: "no such model",
        413: "body over the cap", 422: "malformed body", 429: "the key's quota is spent (Retry-After)",
        431: "headers over the cap", 502: "the backend failed", 503: "overloaded or backend unavailable (Retry-After)",
        504: "the backend did not answer within the deadline",
    }.items()
}


class GatewayError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None
    headers: dict[str, str] | None = None

    def __init__(self, message: str, *, param: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.message, self.param, self.retry_after = message, param, retry_after


class InvalidRequest(GatewayError):
    status, type, code = 400, "invalid_request_error", "invalid_request"


class Conflict(GatewayError):
    """A change the state it would change does not allow (a promotion running, a step backwards)."""

    status, type, code = 409, "invalid_request_error", "conflict"


class Unauthenticated(GatewayError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"
    headers = {"WWW-Authenticate": "Bearer"}


class Forbidden(GatewayError):
    status, type, code = 403, "invalid_request_error", "model_not_allowed"


class ModelNotFound(GatewayError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class NotFound(GatewayError):
    """Something other than a model that the path names and that does not exist (a promotion, a file, a batch)."""
    status, type, code = 404, "invalid_request_error", "not_found"


class BackendUnavailable(GatewayError):
    status, type, code = 503, "service_unavailable", "backend_unavailable"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kw):
        super().__init__(message, retry_after=retry_after, **kw)


class BackendConnectFailed(BackendUnavailable):
    """No connection could be made: nothing was sent, so another replica may be tried."""


class Overloaded(GatewayError):
    """Admission control refused the request (Retry-After)."""
    status, type, code = 503, "service_unavailable", "overloaded"


class BackendTimeout(GatewayError):
    status, type, code = 504, "timeout", "backend_timeout"


class BackendError(GatewayError):
    """The backend answered with an error the client cannot fix by changing the request."""

    status, type, code = 502, "server_error", "backend_error"


class ClientGone(GatewayError):
    """The client left before its answer was ready, and the work for it was cancelled: nginx's 499, which only the
    metrics and the log see."""

    status, type, code = 499, "invalid_request_error", "client_closed_request"


def error_response(status: int, message: str, type_: str, *, param=None, code=None, retry_after=None,
                   headers: dict | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, round(retry_after)))
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


_UNION_TAG = re.compile(r"[\[-]|^(str|int|float|bool|list|dict|none)$")


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, first = [], None
    for err in exc.errors()[:5]:
        if err.get("type") == "json_invalid":
            reason = str((err.get("ctx") or {}).get("error", "")).split(":")[0]  # orjson's reason, not the input
            return "the request body is not valid JSON" + (f" ({reason})" if reason else ""), None
        # Union members tag the location with their type ("list[str]", "constrained-str", "str"): the client's
        # field path has no such part.
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body" and not _UNION_TAG.search(str(p))) or "body"
        first = first or loc
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")  # never echo the input back
    return "; ".join(parts) or "invalid request", first


def gateway_error(exc: GatewayError, request_id: str) -> JSONResponse:
    if exc.status >= 500:  # 503s are expected under overload and outages: counted in metrics, logged quietly
        log.log(logging.DEBUG if exc.status == 503 else logging.WARNING, "request %s: %s %s", request_id, exc.status,
                exc.message)
    return error_response(exc.status, exc.message, exc.type, param=exc.param, code=exc.code,
                          retry_after=exc.retry_after, headers=exc.headers)


def validation_error(exc: RequestValidationError) -> JSONResponse:
    message, param = validation_message(exc)
    return error_response(422, message, "invalid_request_error", param=param, code="invalid_value")


def http_error(status: int, detail: str, max_body_bytes: int, headers: dict | None = None) -> JSONResponse:
    message = {404: "no such route", 405: "method not allowed",
               413: f"the request body is larger than this gateway's limit of {max_body_bytes} bytes"}.get(status, detail)
    return error_response(status, message, "invalid_request_error", code=str(status), headers=headers)


def unexpected_error(request_id: str) -> JSONResponse:
    log.exception("request %s: unhandled error", request_id)
    return error_response(500, "internal error; the gateway logged the cause", "server_error")


def _allowed(app: FastAPI, path: str) -> dict[str, str]:
    """{"Allow": the methods the API documents for `path`} (/v1/files: GET and POST, two routes), or {}."""
    for template, operations in app.openapi()["paths"].items():
        if compile_path(template)[0].match(path):
            return {"Allow": ", ".join(sorted(m.upper() for m in operations))}
    return {}


def install_handlers(app: FastAPI) -> None:
    request_id = lambda request: getattr(request.state, "request_id", "-")  # noqa: E731

    @app.exception_handler(GatewayError)
    async def _gateway(request: Request, exc: GatewayError):
        return gateway_error(exc, request_id(request))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        headers = exc.headers
        if exc.status_code == 405:  # every method the path has (Starlette's Allow names the first route's only)
            headers = {**(headers or {}), **_allowed(request.app, request.url.path)}
        return http_error(exc.status_code, str(exc.detail), request.app.state.gateway.settings.max_body_bytes,
                          headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return unexpected_error(request_id(request))
