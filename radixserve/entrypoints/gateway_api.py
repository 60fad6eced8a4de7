"""The endpoints SGLang's model gateway (PyPI `sglang-router`) calls on a worker, in SGLang's shapes.

The gateway registers a worker by reading `/server_info` (falling back to `/get_server_info`) and
`/model_info` (falling back to `/get_model_info`), polls `/get_load` for its `power_of_two` policy and
its `/get_loads` view, and forwards its own `/get_model_info` to a worker. The rest of what it calls
(`/health`, `/generate`, `/v1/*`, `/flush_cache`, `/metrics`) is served by http_server.py already.
docs/scale_out.md lists every call with what it returns.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from radixserve.entrypoints import openapi_docs as docs
from radixserve.entrypoints.coalesce import Coalesced
from radixserve.entrypoints.http_auth import Principal
from radixserve.frontend.tokenizer_manager import SchedulerUnavailable, TokenizerManager
from radixserve.server_args import ServerArgs

# NOTE: /get_load is polled by the gateway without the client's key (it sends only a key it was
# configured with), so like /health and /metrics it answers without one; it reveals counts only. Keyless
# calls are rate-limited (--keyless-rate-limit); a gateway given a key (its --api-key) is not.
LOAD_TIMEOUT_S = 2.0
LOAD_TTL_S = 0.25
# NOTE: the gateway fills an omitted "model" with this name before forwarding; it means unset here too.
GATEWAY_UNSET_MODEL = "unknown"


class _KeyCheck(Protocol):
    def key_id(self, request: Request) -> str | None: ...

    def principal(self, request: Request) -> Principal: ...


def install_gateway_routes(app: FastAPI, tm: TokenizerManager, server_args: ServerArgs, auth: _KeyCheck) -> None:
    """Adds /server_info, /model_info, /get_model_info and /get_load to the server's app.

    A keyless call to /get_load over the keyless rate never reaches its handler: the app's KeylessGate
    answers it 429 (keyless_gate.py)."""

    @app.get("/server_info")
    async def server_info(request: Request) -> JSONResponse:
        if not auth.principal(request).admin:
            return JSONResponse(_flat_tenant_info(tm, server_args))
        return JSONResponse(await _flat_server_info(tm, server_args))

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info(request: Request) -> JSONResponse:
        auth.key_id(request)
        return JSONResponse(model_info_body(tm, server_args))

    # NOTE: keyless and polled: concurrent polls share one scheduler round trip, reused for LOAD_TTL_S.
    state = Coalesced(lambda: _fresh_state(tm), ttl_s=LOAD_TTL_S)

    @app.get("/get_load", responses=docs.responses({"type": "array", "items": {"type": "object"}}, 429))
    async def get_load() -> JSONResponse:
        return JSONResponse([load_entry(tm.num_in_flight, await state.get())])


def model_info_body(tm: TokenizerManager, server_args: ServerArgs) -> dict[str, Any]:
    """SGLang's /model_info: what the model is; the gateway labels the worker with model_type and architectures."""
    config = _hf_config(server_args.model_path)
    return {
        "model_path": server_args.model_path,
        "tokenizer_path": server_args.model_path,
        "served_model_name": tm.info.model_name,
        "is_generation": True,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
        "max_context_length": tm.info.effective_max_context,
    }


def load_entry(num_in_flight: int, state: dict[str, Any]) -> dict[str, Any]:
    """One SGLang /get_load entry (one per data-parallel rank; a radixserve worker is one rank).

    `num_tokens` is the KV the worker's requests hold now (pool minus free and evictable slots), the
    figure the gateway sums into a worker's load."""
    size = int(state.get("max_total_num_tokens") or 0)
    in_use = round(float(state.get("token_usage") or 0.0) * size)
    return {"dp_rank": 0, "num_reqs": num_in_flight, "num_waiting_reqs": int(state.get("num_waiting_reqs") or 0),
            "num_tokens": in_use}


async def _fresh_state(tm: TokenizerManager) -> dict[str, Any]:
    try:
        return await tm.get_internal_state(timeout_s=LOAD_TIMEOUT_S)
    except SchedulerUnavailable:
        return tm.scheduler_state  # the last answer; /health reports a dead scheduler


async def _flat_server_info(tm: TokenizerManager, server_args: ServerArgs) -> dict[str, Any]:
    """SGLang's /server_info: the server arguments at the top level, then the scheduler's state.

    NOTE: no top-level "model" key: the gateway reads "model" as a model id string, and an object
    there makes it drop the whole answer."""
    try:
        state, alive = await tm.get_internal_state(), True
    except SchedulerUnavailable:
        state, alive = tm.scheduler_state, False
    args = dataclasses.asdict(server_args) | {name: "<redacted>" if getattr(server_args, name) else None
                                              for name in ("api_key", "admin_api_key")}
    from radixserve.version import __version__

    return args | {
        "served_model_name": tm.info.model_name,
        "tokenizer_path": server_args.model_path,
        "dp_size": 1,
        "tp_size": 1,
        "version": __version__,
        "max_total_num_tokens": tm.info.max_total_num_tokens,
        "max_running_requests": tm.info.max_running_requests,
        "context_len": tm.info.context_len,
        "effective_max_context": tm.info.effective_max_context,
        "scheduler_alive": alive and tm.health()[0],
        "in_flight_requests": tm.num_in_flight,
        "internal_states": [state],
    }


def _flat_tenant_info(tm: TokenizerManager, server_args: ServerArgs) -> dict[str, Any]:
    """/server_info for a tenant key (a gateway holding one registers the worker with it): what the model is
    and whether it serves, nothing of the scheduler or the other tenants, as /get_server_info does."""
    from radixserve.version import __version__

    return {"served_model_name": tm.info.model_name, "tokenizer_path": server_args.model_path, "dp_size": 1,
            "tp_size": 1, "version": __version__, "context_len": tm.info.context_len,
            "effective_max_context": tm.info.effective_max_context, "scheduler_alive": tm.health()[0]}


def _hf_config(model_path: str | None) -> dict[str, Any]:
    """config.json of a Hugging Face model folder; {} for a GGUF file or the embedded model."""
    if not model_path:
        return {}
    path = Path(model_path) / "config.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
