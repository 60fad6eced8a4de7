"""LoRA over HTTP (docs/lora.md): which adapter a request names, the adapters in `/v1/models`, and the admin's
`/load_lora_adapter` and `/unload_lora_adapter`.

The scheduler holds the registry (lora/manager.py); the front end asks it (a `ListLoraAdaptersReq`) whenever a
request names an adapter, so a name it does not hold is a 404 naming it before any work, and the scheduler
checks again on arrival (an unload in between is a 404 too).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from radixserve.entrypoints import openapi_docs as docs
from radixserve.entrypoints.http_auth import Auth, Principal
from radixserve.entrypoints.http_errors import ApiError
from radixserve.entrypoints.openai_protocol import (
    LoadLoraAdapterRequest,
    LoraAdapterResponse,
    ModelCard,
    UnloadLoraAdapterRequest,
    now,
)
from radixserve.entrypoints.serving_common import guarded
from radixserve.frontend.tokenizer_manager import SchedulerUnavailable, TokenizerManager
from radixserve.protocol.io_struct import (
    ListLoraAdaptersReq,
    LoadLoraAdapterReq,
    LoraAdapterOut,
    UnloadLoraAdapterReq,
)

LORA_SCHEMAS = [LoadLoraAdapterRequest, UnloadLoraAdapterRequest, LoraAdapterResponse]


def adapter_of_model(model: str | None, base: str) -> str | None:
    """The adapter an OpenAI `model` names: "<base>:<adapter>" or "<adapter>" (as vLLM and SGLang accept);
    None for the base model (or no model given)."""
    if model is None or model == base:
        return None
    if model.startswith(base + ":"):
        return model[len(base) + 1:]
    return model


async def adapters(tm: TokenizerManager) -> list[dict[str, Any]]:
    """The scheduler's registered adapters ([] with LoRA off)."""
    if not tm.info.lora_enabled:
        return []
    out: LoraAdapterOut = await tm.request_reply(ListLoraAdaptersReq(), LoraAdapterOut)
    return out.adapters


async def check_adapter(tm: TokenizerManager, name: str | None, param: str) -> str | None:
    """`name` if the scheduler holds that adapter (None passes); else a 404 naming it."""
    if name is None:
        return None
    if not tm.info.lora_enabled:
        raise ApiError(404, f"The model '{name}' does not exist; this server serves '{tm.info.model_name}' and "
                            "no LoRA adapters (start it with --lora-paths or --enable-lora)",
                       param=param, code="model_not_found")
    names = [a["name"] for a in await guarded(lambda: adapters(tm))]
    if name not in names:
        raise ApiError(404, f"The LoRA adapter '{name}' is not loaded; loaded: {', '.join(names) or 'none'}",
                       param=param, code="lora_adapter_not_found")
    return name


async def model_cards(tm: TokenizerManager) -> list[ModelCard]:
    """The base model's card, then one per adapter (id "<adapter>", parent the base), as vLLM lists them."""
    info = tm.info
    base = ModelCard(id=info.model_name, created=now(), max_model_len=info.effective_max_context)
    try:
        held = await adapters(tm)
    except SchedulerUnavailable:
        held = []
    return [base, *(ModelCard(id=a["name"], created=now(), max_model_len=info.effective_max_context,
                              root=a["path"], parent=info.model_name) for a in held)]


def install_lora_routes(app: FastAPI, tm: TokenizerManager, auth: Auth,
                        parse: Callable[[Request, Any, Principal], Awaitable[tuple[Any, Any]]]) -> None:
    """POST /load_lora_adapter and /unload_lora_adapter: admin only (they change what every tenant is served)."""
    answers = docs.responses(docs.ref(LoraAdapterResponse), 400, 401, 403, 404, 409, 503)

    @app.post("/load_lora_adapter", openapi_extra=docs.json_body(LoadLoraAdapterRequest), responses=answers)
    async def load_lora_adapter(request: Request) -> JSONResponse:
        principal = auth.admin(request, "loading a LoRA adapter")
        req, _ = await parse(request, LoadLoraAdapterRequest, principal)
        return await _control(tm, LoadLoraAdapterReq(req.lora_name, req.lora_path))

    @app.post("/unload_lora_adapter", openapi_extra=docs.json_body(UnloadLoraAdapterRequest), responses=answers)
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        principal = auth.admin(request, "unloading a LoRA adapter")
        req, _ = await parse(request, UnloadLoraAdapterRequest, principal)
        return await _control(tm, UnloadLoraAdapterReq(req.lora_name))


async def _control(tm: TokenizerManager, msg: Any) -> JSONResponse:
    out: LoraAdapterOut = await guarded(lambda: tm.request_reply(msg, LoraAdapterOut))
    if not out.success:
        codes = {400: "invalid_lora_adapter", 404: "lora_adapter_not_found", 409: "lora_adapter_in_use"}
        raise ApiError(out.status_code, out.message, param="lora_name" if out.status_code != 400 else None,
                       code=codes.get(out.status_code, "lora_error"))
    return JSONResponse(LoraAdapterResponse(success=True, message=out.message, adapters=out.adapters,
                                            freed_tokens=out.freed_tokens).model_dump())
