"""What the HTTP front ends share (gateway/openai_api.py, gateway/responses_api.py): OpenAI's error
body and how the core's refusals map to it, and the wait that notices a client leaving before its
answer is ready."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from pipeserve.gateway.requests import ErrorCode, Refusal

RETRY_AFTER = "1"  # seconds a client refused for capacity should wait
CLIENT_CLOSED = 499  # the status a request whose client left is logged with (nobody reads it)
ROUTING_CODES = {404: "not_found", 405: "method_not_allowed"}
# How the core's error codes reach an HTTP client: (status, OpenAI error type).
STATUS = {
    ErrorCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    ErrorCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    ErrorCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    ErrorCode.NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.UNAUTHENTICATED: (401, "authentication_error"),
    ErrorCode.RESOURCE_EXHAUSTED: (503, "server_error"),
    ErrorCode.UNAVAILABLE: (503, "server_error"),
    ErrorCode.DEADLINE_EXCEEDED: (504, "server_error"),
}
# Gateway field names in messages, as an OpenAI client calls them.
PARAM_NAMES = {"prompt_token_ids": "prompt", "logprobs": "logprobs", "messages": "messages"}
PARAM = re.compile(r"^([a-z_]+)")


class RequestBody(BaseModel):
    """A generation request's body: check_supported refuses (HTTPError) the fields the server would
    otherwise ignore though they change the result (pipeserve/gateway/openai_fields.py)."""

    def check_supported(self) -> None:
        return None


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": RETRY_AFTER} if self.status == 503 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def invalid_body(errors: list[Any]) -> HTTPError:
    """A request body's first validation error as a 400 naming its parameter (never a bare 422)."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param or 'request body'}: {first.get('msg', 'invalid')}"
    return HTTPError(400, message, param.split(".")[0] if param else None)


def from_refusal(refusal: Refusal) -> HTTPError:
    """The core's refusal as an HTTP error; param is the field the message names first."""
    status, kind = STATUS.get(refusal.code, (500, "server_error"))
    match = PARAM.match(refusal.message) if status == 400 else None
    param = PARAM_NAMES.get(match.group(1), match.group(1)) if match else None
    return HTTPError(status, refusal.message, param, refusal.code.name.lower(), kind)


class Disconnected(Exception):
    """The client left before its answer was ready (its requests are closed: the engine aborts them)."""


T = TypeVar("T")


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """work's result, or Disconnected when the client disconnects first (a request whose response
    has not started notices nothing otherwise and would keep its requests running in the engine)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(disconnected())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise Disconnected
    return task.result()
