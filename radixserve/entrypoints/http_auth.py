"""API keys and roles of the HTTP server.

* no `--api-key` and no `--admin-api-key`: an open, single-user server; every caller may do everything.
* `--api-key k1,k2`: tenant keys. Each key is its own cache namespace and sees only its own requests
  (`/abort_request` reaches only them; `/get_server_info` shows the model, not the server's internals).
* `--admin-api-key a`: the operator's key, needed for what affects every tenant: `/flush_cache`,
  aborting any tenant's request, the server's internals in `/get_server_info`, and `/metrics` (unless
  `--metrics-public`). It generates in a namespace of its own. Without it, a server with tenant keys
  refuses those operations (403) to everyone.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import Request

from radixserve.entrypoints.http_errors import ApiError
from radixserve.frontend.tokenizer_manager import api_key_id


@dataclass(frozen=True)
class Principal:
    """Who is calling: the key's namespace id (None on an open server) and whether it is the admin."""

    key_id: str | None
    admin: bool


class Auth:
    def __init__(self, keys: list[str], admin_key: str | None) -> None:
        self._keys = [(k, api_key_id(k)) for k in keys]
        if admin_key:
            self._keys.insert(0, (admin_key, api_key_id(admin_key)))
        self._admin_key = admin_key or None
        self.open = not self._keys

    def principal(self, request: Request) -> Principal:
        if self.open:
            return Principal(None, True)
        principal = self._from_headers(request)
        if principal is None:
            raise ApiError(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>' (or "
                                "'x-api-key: <key>')", code="invalid_api_key")
        return principal

    def _from_headers(self, request: Request) -> Principal | None:
        """The key of `Authorization: Bearer`, else of `x-api-key` (Anthropic's header): one key, one namespace."""
        principal = self._match(request.headers.get("authorization", ""))
        x_api_key = request.headers.get("x-api-key")
        if principal is None and x_api_key is not None:
            principal = self._match(f"Bearer {x_api_key}")
        return principal

    def _match(self, authorization: str) -> Principal | None:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        supplied = token.strip().encode("utf-8", "surrogateescape")
        # NOTE: every key is compared (each in constant time), so timing does not tell which one matched.
        matches = [(key, key_id) for key, key_id in self._keys if hmac.compare_digest(supplied, key.encode())]
        if not matches:
            return None
        key, key_id = matches[0]
        return Principal(key_id, key == self._admin_key)

    def valid_key(self, authorization: str) -> bool:
        """Whether an Authorization header's value carries a valid key (never on an open server: there are
        none); what the keyless gate (keyless_gate.py) reads from raw headers, before any Request exists."""
        return not self.open and self._match(authorization) is not None

    def has_key(self, request: Request) -> bool:
        """Whether the caller sent a valid key (never on an open server: there are none); never raises."""
        return not self.open and self._from_headers(request) is not None

    def key_id(self, request: Request) -> str | None:
        """The caller's namespace id (routes that only need a valid key: the gateway's, http.gateway_api)."""
        return self.principal(request).key_id

    def admin(self, request: Request, what: str) -> Principal:
        """The caller, who must hold the admin key (403 otherwise)."""
        principal = self.principal(request)
        if not principal.admin:
            hint = "the admin API key" if self._admin_key else "an admin API key, and this server has none"
            raise ApiError(403, f"{what} affects every tenant and needs {hint} (--admin-api-key)",
                           code="admin_key_required")
        return principal
