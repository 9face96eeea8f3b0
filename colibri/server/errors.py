"""Errors as the OpenAI API shapes them: {"error": {"message", "type", "param", "code"}}.

Status codes: 400 a request that is well formed but cannot be served (prompt + max_tokens
over the context, ids out of the vocabulary, a model without a chat template, malformed
JSON); 401 a missing or wrong api key; 404 an unknown route or model; 413 a body over
--max-body; 422 a body that does not match the schema (a wrong type, a missing field, a
value out of range: pydantic's first complaint, naming the field); 429 the queue is full
(with Retry-After). Any other exception becomes a 500 with a generic message and a log line
(the fuzz tests hold that no input reaches it).
"""
from __future__ import annotations

import json
import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = ["APIError", "error_body", "install_error_handlers", "context_length_error"]

log = logging.getLogger("colibri.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
          413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class ErrorResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message may quote what the
    client sent, lone surrogates included, which UTF-8 cannot encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class APIError(Exception):
    """An error answered to the client as-is: status, message, OpenAI type/param/code."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return ErrorResponse(error_body(self.status, self.message, self.code, self.param),
                            status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, code: str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def context_length_error(ctx: int, prompt_tokens: int, max_tokens: int) -> APIError:
    """The one 400 for prompt + max_tokens over the context, with the numbers."""
    return APIError(
        400, f"This model's context is {ctx} tokens, but the request needs "
             f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
             f"{max_tokens} for max_tokens). Shorten the prompt or lower max_tokens.",
        code="context_length_exceeded", param="max_tokens")


def queue_full_error(retry_after: float) -> APIError:
    seconds = max(1, math.ceil(retry_after)) if math.isfinite(retry_after) else 1
    return APIError(429, f"The server is at capacity (all slots busy and the queue full); "
                         f"retry in {seconds} s.", code="queue_full",
                    headers={"Retry-After": str(seconds)})


_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _loc_name(loc: tuple) -> str:
    """pydantic's location ('body', 'messages', 0, 'content', 'str') -> 'messages[0].content'
    (the names pydantic gives the branches of a union are left out)."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in _UNION_TAGS and not any(c in part for c in "[-("):
            out += f".{part}" if out else part
    return out


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return APIError(400, f"The body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
                             .rstrip(": "), code="invalid_json").response()
    param = _loc_name(tuple(first.get("loc", ()))) or None
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    if "input" in first and first.get("type") not in ("missing", "extra_forbidden"):
        shown = repr(first["input"])
        msg += f" (got {shown[:80]}{'...' if len(shown) > 80 else ''})"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    message = f"{param}: {msg}{more}" if param else f"{msg}{more}"
    return APIError(422, message, code=first.get("type") or "invalid_value",
                    param=param).response()


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app can answer, in the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            detail = f"No route {request.method} {request.url.path}"
        return APIError(exc.status_code, detail, code=None,
                        headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s %s", request.method, request.url.path)
        return APIError(500, "The server met an unexpected error; it is logged.",
                        code="internal_error").response()
