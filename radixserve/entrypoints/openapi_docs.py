"""What the served OpenAPI schema (`/openapi.json`) says about each route: its request body and every
status it can answer with. The handlers parse their bodies themselves (size, nesting and Unicode are
checked before pydantic sees them), so FastAPI cannot infer either; they are declared here.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from radixserve.entrypoints.openai_protocol import ErrorResponse

_REF = "#/components/schemas/{model}"

_ERRORS = {
    400: "invalid request: a field's type, range, or value against the model (vocabulary, context, pool)",
    401: "missing or wrong API key",
    403: "needs the admin API key (--admin-api-key)",
    404: "unknown model",
    409: "requests hold KV: the cache was not flushed",
    413: "request body over --max-body-bytes",
    429: "a keyless call over --keyless-rate-limit (with Retry-After); a valid API key is not limited",
    500: "the scheduler aborted the request (a failure while running it; the server goes on)",
    503: "the scheduler is restarting, dead, or its queue (or the front end's) is full (then with Retry-After)",
}


def ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` of a route whose JSON body is `model`."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref(model)}}}}


def responses(ok: dict[str, Any], *errors: int, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """The 200 (JSON schema `ok`, or also server-sent events) and the listed error statuses."""
    content: dict[str, Any] = {"application/json": {"schema": ok}}
    if stream:
        # NOTE: one server-sent event: `data` is a chunk as JSON (or an error object, then "[DONE]")
        content["text/event-stream"] = {"schema": {"type": "object", "required": ["data"], "properties": {
            "data": {"type": "string"}, "event": {"type": "string"}}}}
    out: dict[int | str, dict[str, Any]] = {200: {"description": "success", "content": content}}
    for status in errors:
        entry: dict[str, Any] = {"description": _ERRORS[status], "model": ErrorResponse}
        if status in (429, 503):
            entry["headers"] = {"Retry-After": {"description": "seconds to wait (rate spent or queue full only)",
                                                "schema": {"type": "string"}}}
        out[status] = entry
    return out


def text_response(*errors: int, media_type: str = "text/plain") -> dict[int | str, dict[str, Any]]:
    """A 200 that is not JSON (Prometheus text, an HTML page) and the listed error statuses."""
    out = responses({}, *errors)
    out[200] = {"description": "success", "content": {media_type: {"schema": {"type": "string"}}}}
    return out


def install(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Adds the request and response models the routes refer to (see `ref`) to the schema's components."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description=app.description)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                body = model.model_json_schema(ref_template=_REF)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
