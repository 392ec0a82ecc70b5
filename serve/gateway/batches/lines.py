"""A batch's input file, read and checked whole before the batch is made: a file that would fail is refused at
creation, naming its first bad line, and nothing runs.

Each line is OpenAI's request object: `{"custom_id": "...", "method": "POST", "url": "/v1/...", "body": {...}}`,
`custom_id` unique in the file, `url` the batch's endpoint, `body` what the endpoint's route accepts (checked by the
route's own request model, with its bounds) and never a stream, and every line for one model (OpenAI's rule).
What only running can tell (a line the engine refuses, a model that went away) goes to the error file instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from ..exceptions import InvalidRequest, validation_message


SLICE = 20  # lines checked between two turns of the event loop (about 10 ms of pydantic on a slow core)


@dataclass(frozen=True)
class Line:
    number: int  # in the file, from 1 (blank lines are counted and skipped)
    custom_id: str
    body: dict


class BadLine(InvalidRequest):
    code = "invalid_batch_line"

    def __init__(self, number: int, why: str):
        super().__init__(f"input file line {number}: {why}", param="input_file_id")
        self.line = number


def objects(path: Path) -> Iterator[tuple[int, dict]]:
    """Each non-blank line of a JSONL file as (line number, its JSON object); BadLine where one is not."""
    with open(path, "rb") as lines:
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                value = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise BadLine(number, f"not valid JSON ({exc.msg.split(':')[0]})") from None
            if not isinstance(value, dict):
                raise BadLine(number, "not a JSON object")
            yield number, value


async def count(path: Path) -> int:
    """The JSON lines of a file (BadLine where one is not a JSON object), counted on the event loop in slices."""
    n = 0
    for n, _ in enumerate(objects(path), 1):
        if n % (SLICE * 50) == 0:  # parsing alone: about 50 times a check's speed
            await asyncio.sleep(0)
    return n


async def read(path: Path, endpoint: str, request_type: type[BaseModel], max_lines: int) -> tuple[list[Line], str]:
    """The file's lines, checked, and the one model they name. BadLine (400) names the first line that fails.

    Checked on the event loop, SLICE lines at a time: in a thread, the checks' hold on the GIL made every other
    request of the gateway wait on each of its turns (B14: a 1,000-line batch's creation held the people's first
    tokens back by 480 ms)."""
    lines: list[Line] = []
    seen: set[str] = set()
    model = None
    for count, (number, value) in enumerate(objects(path), 1):
        if len(lines) == max_lines:
            raise BadLine(number, f"more than this gateway's {max_lines} requests per batch")
        line = _check(number, value, endpoint, request_type, seen)
        if model is None:
            model = line.body["model"]
        elif line.body["model"] != model:
            raise BadLine(number, f"model {line.body['model']!r} is not the file's model {model!r}: one batch, one "
                                  "model")
        lines.append(line)
        if count % SLICE == 0:
            await asyncio.sleep(0)
    if not lines:
        raise InvalidRequest("the input file holds no requests", param="input_file_id")
    return lines, model


def _check(number: int, value: dict, endpoint: str, request_type: type[BaseModel], seen: set[str]) -> Line:
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BadLine(number, "custom_id must be a non-empty string")
    if custom_id in seen:
        raise BadLine(number, f"custom_id {custom_id!r} is used by an earlier line; each must be unique")
    seen.add(custom_id)
    if value.get("method") != "POST":
        raise BadLine(number, 'method must be "POST"')
    if value.get("url") != endpoint:
        raise BadLine(number, f"url {str(value.get('url'))[:100]!r} is not the batch's endpoint {endpoint}")
    body = value.get("body")
    if not isinstance(body, dict):
        raise BadLine(number, "body must be a JSON object, the request for the endpoint")
    try:
        request = request_type.model_validate(body)
    except ValidationError as exc:
        message, _ = validation_message(RequestValidationError(exc.errors()))
        raise BadLine(number, message) from None
    if getattr(request, "stream", False):
        raise BadLine(number, "a batch request cannot stream; leave stream out")
    return Line(number, custom_id, body)
