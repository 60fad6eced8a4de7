"""The cache explorer: `/cache/tree` (a JSON snapshot of the radix tree) and `/cache/view` (a page drawing it).

The snapshot comes from the scheduler (`CacheTreeReq`, answered between two steps, bounded by the
query's limits); this process adds each node's decoded text. With API keys set, every route asks
for one (`Authorization: Bearer <key>`, or HTTP Basic with the key as password, so a browser can
open the page), and a key sees only its own namespaces' nodes, requests and events: the tree holds
other tenants' prompts. Namespaces appear as their kind and a short keyed hash, never their value.
The page is plain HTML, CSS and JavaScript shipped in `entrypoints/static/` (no CDN, no build step).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response

from radixserve.entrypoints import openapi_docs as docs
from radixserve.entrypoints.http_errors import ApiError, bad_request
from radixserve.entrypoints.serving_common import guarded
from radixserve.frontend.tokenizer_manager import TokenizerManager, api_key_id
from radixserve.protocol.io_struct import CacheTreeOut, CacheTreeReq
from radixserve.server_args import ServerArgs

STATIC_DIR = Path(__file__).with_name("static")
STATIC_FILES = {"cache_view.js": "text/javascript", "cache_view.css": "text/css"}
_REALM = 'Basic realm="radixserve cache explorer", charset="UTF-8"'
# query parameter -> (default, most allowed); the scheduler clamps again
QUERY_LIMITS = {"max_nodes": (400, 5000), "max_tokens": (48, 4096), "since": (0, 2 ** 62),
                "max_events": (300, 4096)}


class ExplorerAuth:
    """The server's API keys, accepted as a Bearer token or as an HTTP Basic password."""

    def __init__(self, keys: list[str]) -> None:
        self._keys = [(k.encode(), api_key_id(k)) for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def key_id(self, request: Request) -> str | None:
        """The caller's key id (None without keys); ApiError 401 when no valid key was sent."""
        if not self._keys:
            return None
        presented = presented_key(request.headers.get("authorization", ""))
        for key, key_id in self._keys:
            if presented is not None and hmac.compare_digest(presented, key):
                return key_id
        raise ApiError(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>' (or the key as "
                            "the HTTP Basic password)", code="invalid_api_key")


def presented_key(header: str) -> bytes | None:
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() == "bearer":
        return value.strip().encode()
    if scheme.lower() == "basic":
        try:
            user, _, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return (password or user).encode()
    return None


def register_cache_explorer(app: FastAPI, tm: TokenizerManager, server_args: ServerArgs) -> None:
    # NOTE: the admin key (http_auth.py) sees every namespace; a tenant key only its own.
    admin = server_args.admin_api_key
    auth = ExplorerAuth(server_args.api_keys + ([admin] if admin else []))
    admin_id = api_key_id(admin) if admin else None

    def authorized(request: Request) -> str | None:
        try:
            return auth.key_id(request)
        except ApiError as e:
            raise _Challenge(e) from None

    @app.get("/cache/tree", responses=docs.responses({"type": "object"}, 400, 401, 503))
    async def cache_tree(request: Request) -> Response:
        try:
            owner = authorized(request)
            query = parse_query(request.query_params)
            out = await guarded(lambda: tm.request_reply(CacheTreeReq(**query), CacheTreeOut))
        except _Challenge as c:
            return c.response()
        start = time.perf_counter()
        snapshot = visible_to(out.snapshot, owner) if auth.enabled and owner != admin_id else out.snapshot
        add_texts(snapshot, tm.tokenizer)
        snapshot = public(snapshot)
        snapshot["http_ms"] = round((time.perf_counter() - start) * 1000, 3)  # this process's share of the work
        return JSONResponse(snapshot, headers={"Cache-Control": "no-store"})

    @app.get("/cache/view", response_class=HTMLResponse, responses=docs.text_response(401, media_type="text/html"))
    async def cache_view(request: Request) -> Response:
        try:
            authorized(request)
        except _Challenge as c:
            return c.response()
        return FileResponse(STATIC_DIR / "cache_view.html", media_type="text/html",
                            headers={"Cache-Control": "no-store"})

    @app.get("/cache/static/{name}", include_in_schema=False)  # the page's own files, not an API
    async def cache_static(name: str, request: Request) -> Response:
        try:
            authorized(request)
        except _Challenge as c:
            return c.response()
        if name not in STATIC_FILES:
            raise ApiError(404, f"no such file: {name}", code="not_found")
        return FileResponse(STATIC_DIR / name, media_type=STATIC_FILES[name])


class _Challenge(Exception):
    """A 401 that also asks a browser for the key (WWW-Authenticate: Basic)."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error

    def response(self) -> JSONResponse:
        return JSONResponse(self.error.body(), status_code=401, headers={"WWW-Authenticate": _REALM})


def parse_query(params: Any) -> dict[str, int]:
    out = {}
    for name, (default, most) in QUERY_LIMITS.items():
        raw = params.get(name)
        if raw is None or raw == "":
            out[name] = default
            continue
        try:
            value = int(raw)
        except ValueError:
            raise bad_request(f"'{name}' must be an integer, got {raw!r}", param=name) from None
        if not (0 if name == "since" else 1) <= value <= most:
            raise bad_request(f"'{name}' must be between {0 if name == 'since' else 1} and {most}, got {value}",
                              param=name)
        out[name] = value
    return out


def visible_to(snapshot: dict[str, Any], owner: str | None) -> dict[str, Any]:
    """The part of a snapshot one API key may see: its own namespaces and the server's shared ones.

    NOTE: namespaces partition the tree below the root, so dropping a namespace drops whole subtrees.
    """
    namespaces = snapshot["namespaces"]
    allowed = {i for i, ns in enumerate(namespaces) if ns["owner"] in (None, owner)}
    nodes = [n for n in snapshot["nodes"] if n["parent"] is None or n["ns"] in allowed]
    events = []
    for event in snapshot["events"]:
        if event["kind"] == "evict":
            victims = [v for v in event["victims"] if v["ns"] in allowed]
            if victims:
                events.append(event | {"victims": victims, "tokens": sum(v["tokens"] for v in victims)})
        elif event["ns"] in allowed:
            events.append(event)
    hidden = {"kind": "another key's", "hash": None, "owner": None, "value": None}
    return snapshot | {
        "nodes": nodes, "events": events, "hidden_nodes": len(snapshot["nodes"]) - len(nodes),
        "requests": [r for r in snapshot["requests"] if r["ns"] in allowed],
        "namespaces": [ns if i in allowed else hidden for i, ns in enumerate(namespaces)],
    }


def add_texts(snapshot: dict[str, Any], tokenizer: Any) -> None:
    """Each node's shown tokens, decoded (one batch call)."""
    nodes = [n for n in snapshot["nodes"] if n["tokens"]]
    if tokenizer is None or not nodes:
        return
    for node, text in zip(nodes, tokenizer.batch_decode([n["tokens"] for n in nodes]), strict=True):
        node["text"] = text


def public(snapshot: dict[str, Any]) -> dict[str, Any]:
    """Drop what only served the filtering (API key ids) and shorten request ids."""
    return snapshot | {
        "namespaces": [{k: v for k, v in ns.items() if k != "owner"} for ns in snapshot["namespaces"]],
        "requests": [r | {"rid": r["rid"][:8]} for r in snapshot["requests"]],
    }
