"""OpenAI-shaped errors and strict request-body parsing for the HTTP server."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.frontend.request_bounds import BoundError, RequestBounds, check_fields

logger = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound=BaseModel)

MAX_JSON_DEPTH = 32  # the deepest request (chat content parts) nests 4 levels
# NOTE: a string literal, or an unterminated one up to the end (a lone backslash included): every quote that
# opens a match is consumed by it, so the scan is linear. Requiring the closing quote made an unterminated
# string of escaped quotes rescan from each of them (64 KB of them: 24 s with the GIL held).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, extra: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.extra = extra or {}
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _STATUS_TYPES.get(status, "invalid_request_error")

    def __reduce__(self) -> tuple[Any, ...]:
        # NOTE: raised in a parser process and re-raised here: pickled with every field, not just the message.
        return (_rebuild, (self.status, self.message, self.param, self.code, self.type, self.extra, self.headers))

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": error, **self.extra}

    def content(self) -> bytes:
        """The body as sent: compact JSON, ASCII-escaped, so no client-chosen text (a lone surrogate) can make
        the error itself fail."""
        return json.dumps(self.body(), ensure_ascii=True, separators=(",", ":")).encode()

    def response(self) -> JSONResponse:
        return Response(self.content(), status_code=self.status, headers=self.headers, media_type="application/json")


def _rebuild(status: int, message: str, param: str | None, code: str | None, type: str | None,
             extra: dict[str, Any], headers: dict[str, str] | None) -> ApiError:
    return ApiError(status, message, param=param, code=code, type=type, extra=extra, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, code="scheduler_unavailable")


def rate_limited(message: str, retry_after_s: int = 1) -> ApiError:
    """429 with Retry-After: a keyless route's rate is spent; a request with a valid key is not limited."""
    return ApiError(429, message, code="rate_limited", headers={"Retry-After": str(retry_after_s)})


def overloaded(message: str, retry_after_s: int = 1) -> ApiError:
    """503 with Retry-After: the scheduler's queue is full; the same request may succeed a moment later."""
    return ApiError(503, message, code="server_overloaded", headers={"Retry-After": str(retry_after_s)})


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"request body of {size} bytes or more is over the limit of {limit} bytes",
                    code="request_too_large")


def parse_json(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8 (invalid byte at offset {e.start})",
                          code="invalid_utf8") from None
    if not text.strip():
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    check_depth(raw)
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise bad_request(f"could not parse the JSON body: {e.msg} (line {e.lineno}, column {e.colno})",
                          code="invalid_json") from None
    except ValueError as e:
        raise bad_request(f"could not parse the JSON body: {e}", code="invalid_json") from None


def check_depth(raw: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuses a body nested deeper than `limit` arrays/objects, before the recursive parser sees it."""
    brackets = np.frombuffer(_JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS), dtype=np.uint8)
    if brackets.size == 0:
        return
    opens = (brackets == ord("[")) | (brackets == ord("{"))
    depth = np.cumsum(np.where(opens, 1, -1)).max()
    if depth > limit:
        raise bad_request(f"request body nests {int(depth)} levels deep; at most {limit} are accepted",
                          code="invalid_json")


def check_strings(data: Any) -> None:
    """Every string of a parsed body, keys included, must be valid Unicode (JSON allows lone surrogates)."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            check_text(value, path or "body")
        elif isinstance(value, dict):
            for key, item in value.items():
                name = f"{path}.{key}" if path else str(key)
                if not _is_text(key):
                    raise bad_request(f"a key of '{path or 'body'}' is not valid UTF-8 text (lone surrogate)",
                                      param=path or None, code="invalid_utf8")
                stack.append((item, name))
        elif isinstance(value, list):
            stack.extend((item, f"{path}.{i}") for i, item in enumerate(value) if isinstance(item, (str, dict, list)))


def decode_body(raw: bytes, model: type[ModelT], bounds: RequestBounds | None = None) -> ModelT:
    """UTF-8-decodes, depth-checks, JSON-parses, size-checks (`bounds`), Unicode-checks and validates a body.

    CPU work: run in a parser process (TokenizerManager.run_parse), so it never holds the event loop's GIL."""
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    if bounds is not None:
        try:
            check_fields(data, bounds)
        except BoundError as e:
            raise bad_request(str(e), param=e.param, code="over_limit") from None
    if _SURROGATE_ESCAPE.search(raw):  # NOTE: the only way a lone surrogate gets into valid UTF-8 JSON
        check_strings(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


async def parse_request(request: Request, model: type[ModelT], limit: int, bounds: RequestBounds | None = None,
                        offload: Callable[..., Awaitable[Any]] | None = None) -> ModelT:
    """Reads and size-checks a request body, then decodes it (decode_body): with `offload(fn, *args)`, a body
    over a few KB in a parser process when its key's turn comes (TokenizerManager.run_parse), never on the loop."""
    raw = await read_body(request, limit)
    if len(raw) < _INLINE_BODY_BYTES:
        return decode_body(raw, model, bounds)
    return await (offload or asyncio.to_thread)(decode_body, raw, model, bounds)


def validation_error(e: ValidationError) -> ApiError:
    first = e.errors()[0]
    loc = [str(p) for p in first["loc"] if not _is_union_tag(p)]
    if first["type"] == "extra_forbidden" and len(loc) > 1:
        parent = ".".join(loc[:-1])
        return bad_request(f"unknown parameter '{loc[-1]}' in '{parent}'"[:300], param=parent,
                           code="unknown_parameter")
    param = ".".join(loc) or None
    got = first.get("input")
    shown = json.dumps(got)[:80] if _json_safe(got) else type(got).__name__
    extra = f" ({len(e.errors())} errors)" if len(e.errors()) > 1 else ""
    return bad_request(f"invalid value for '{param}': {first['msg']}, got {shown}{extra}", param=param,
                       code="invalid_type" if first["type"].endswith("_type") else "invalid_value")


def _is_union_tag(part: Any) -> bool:
    # NOTE: pydantic names the union member it tried ("str", "list[int]") in the location; drop it.
    return isinstance(part, str) and (part in {"str", "int", "float", "bool"} or "[" in part)


def _json_safe(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


_INLINE_BODY_BYTES = 4 * 1024  # smaller bodies parse in microseconds: a thread hop would cost more


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def check_text(text: str, param: str) -> None:
    """Rejects strings that are not valid Unicode (lone surrogates from JSON escapes such as \\ud800)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"'{param}' is not valid UTF-8 text (lone surrogate at character {e.start})",
                          param=param, code="invalid_utf8") from None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        # NOTE: keeps the exception's headers: a 405 must say which methods are allowed (Allow).
        return ApiError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        return bad_request(f"invalid request: {exc.errors()[0].get('msg', exc)}").response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in a request")
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()
