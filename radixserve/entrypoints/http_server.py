"""The HTTP server: FastAPI app over a TokenizerManager, with the scheduler in a child process.

`launch_server(server_args)` spawns the scheduler process, waits for its model, then serves with
uvicorn until interrupted. `create_app(tm, server_args)` builds the app alone (tests, embedding).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from radixserve.entrypoints import serving_native
from radixserve.entrypoints.cache_explorer import register_cache_explorer
from radixserve.entrypoints.gateway_api import install_gateway_routes
from radixserve.entrypoints.http_errors import (
    ApiError,
    bad_request,
    install_error_handlers,
    parse_request,
    unavailable,
)
from radixserve.entrypoints.logprobs import TokenTexts
from radixserve.entrypoints.openai_protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    now,
)
from radixserve.entrypoints.serving_common import guarded
from radixserve.entrypoints.serving_openai import OpenAIServing
from radixserve.managers.scheduler_link import SchedulerLink
from radixserve.managers.scheduler_process import launch_scheduler_process
from radixserve.managers.tokenizer_manager import (
    FrontendConfig,
    GenerateReq,
    SchedulerUnavailable,
    TokenizerManager,
    api_key_id,
    cache_namespace,
)
from radixserve.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

# NOTE: health_generate runs in its own namespace so probes never share KV with user requests.
_HEALTH_NAMESPACE = (("health", "probe"),)


class _Auth:
    """Bearer API keys; each key's namespace id is derived here, on the server side."""

    def __init__(self, keys: list[str]) -> None:
        self._keys = [(k, api_key_id(k)) for k in keys]

    def key_id(self, request: Request) -> str | None:
        if not self._keys:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            for key, key_id in self._keys:
                if hmac.compare_digest(token.strip().encode(), key.encode()):
                    return key_id
        raise ApiError(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


def create_app(tm: TokenizerManager, server_args: ServerArgs) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await tm.start()
        yield
        await tm.shutdown()

    app = FastAPI(title="radixserve", lifespan=lifespan)
    install_error_handlers(app)
    auth = _Auth(server_args.api_keys)
    texts = TokenTexts(tm.tokenizer)
    openai = OpenAIServing(tm, texts)
    limit = tm.config.max_body_bytes
    app.state.tokenizer_manager = tm

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        key_id = auth.key_id(request)
        req = await parse_request(request, CompletionRequest, limit)
        return await guarded(lambda: openai.completions(req, cache_namespace(key_id, req.cache_salt, req.extra_key),
                                                         request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        key_id = auth.key_id(request)
        req = await parse_request(request, ChatCompletionRequest, limit)
        return await guarded(lambda: openai.chat(req, cache_namespace(key_id, req.cache_salt, req.extra_key),
                                                  request))

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        key_id = auth.key_id(request)
        req = await parse_request(request, GenerateRequest, limit)
        extra_key = cache_namespace(key_id, req.cache_salt, req.extra_key)
        return await guarded(lambda: serving_native.generate(tm, texts, req, extra_key, request))

    @app.post("/abort_request")
    async def abort_request(request: Request) -> JSONResponse:
        key_id = auth.key_id(request)
        req = await parse_request(request, AbortRequest, limit)
        if req.rid is None and not req.abort_all:
            raise bad_request("give the 'rid' to abort, or 'abort_all': true", param="rid")
        aborted = tm.abort_request(req.rid, key_id, req.abort_all)
        return JSONResponse({"success": True, "aborted": aborted})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        auth.key_id(request)
        return JSONResponse(openai.tokenize(await parse_request(request, TokenizeRequest, limit)))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        auth.key_id(request)
        return JSONResponse(openai.detokenize(await parse_request(request, DetokenizeRequest, limit)))

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        auth.key_id(request)
        card = ModelCard(id=tm.info.model_name, created=now(), max_model_len=tm.info.effective_max_context)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, reason = tm.health()
        if not ok:
            raise unavailable(reason)
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate() -> JSONResponse:
        ok, reason = tm.health()
        if not ok:
            raise unavailable(reason)
        started = time.monotonic()
        await guarded(lambda: asyncio.wait_for(_one_token(tm), tm.config.control_timeout_s))
        return JSONResponse({"status": "ok", "latency_s": round(time.monotonic() - started, 4)})

    @app.get("/get_server_info")
    async def server_info(request: Request) -> JSONResponse:
        auth.key_id(request)
        return JSONResponse(await _server_info(tm, server_args))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> JSONResponse:
        auth.key_id(request)
        out = await guarded(tm.flush_cache)
        if out.success:
            return JSONResponse({"success": True, "tokens_freed": out.tokens_freed, "message": out.message,
                                 "cache_epoch": out.cache_epoch})
        raise ApiError(409, f"cache not flushed: {out.message or 'requests are running'}; "
                            f"{tm.num_in_flight} request(s) in flight", code="requests_running",
                       extra={"in_flight_requests": tm.num_in_flight, "rids": tm.in_flight_rids()})

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            await tm.get_internal_state(timeout_s=2.0)  # fresh scheduler counters when it answers
        except SchedulerUnavailable:
            pass
        return Response(tm.metrics.expose(), media_type=CONTENT_TYPE_LATEST)

    install_gateway_routes(app, tm, server_args, auth)  # what SGLang's model gateway calls (docs/scale_out.md)
    register_cache_explorer(app, tm, server_args)  # /cache/tree, /cache/view (docs/server.md)
    return app


async def _one_token(tm: TokenizerManager) -> None:
    ids = list(tm.tokenizer.encode("ping", add_special_tokens=False))[:1] or [0]
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    gen = tm.generate(GenerateReq(ids, params, _HEALTH_NAMESPACE))
    try:
        async for out in gen:
            if out.finish_reason == "abort":
                raise SchedulerUnavailable(f"health probe aborted: {out.finish_message}")
    finally:
        await gen.aclose()


async def _server_info(tm: TokenizerManager, server_args: ServerArgs) -> dict[str, Any]:
    try:
        state = await tm.get_internal_state()
        alive = True
    except SchedulerUnavailable:
        state, alive = tm.scheduler_state, False
    args = dataclasses.asdict(server_args) | {"api_key": "<redacted>" if server_args.api_key else None}
    ok, reason = tm.health()
    return {
        "version": _version(),
        "model": tm.info.describe(),
        "server_args": args,
        "frontend": dataclasses.asdict(tm.config),
        "scheduler_alive": alive and ok,
        "health": reason,
        "in_flight_requests": tm.num_in_flight,
        "scheduler_state": state,
    }


def _version() -> str:
    from radixserve import __version__

    return __version__


def launch_server(server_args: ServerArgs, config: FrontendConfig | None = None) -> None:
    """Starts the scheduler process, then serves HTTP on server_args.host:port until stopped."""
    import uvicorn

    logging.basicConfig(level=server_args.log_level.upper(),
                        format="[%(asctime)s http] %(levelname)s %(name)s: %(message)s")
    # NOTE: bind before the scheduler process starts, so its connects succeed at once (SchedulerLink).
    link = SchedulerLink()
    try:
        proc, info = launch_scheduler_process(server_args, link.port_args)
    except BaseException:
        link.close()
        raise
    logger.info("serving model=%s dtype=%s device=%s kv_pool_tokens=%d page_size=%d max_running_requests=%d "
                "context_len=%d effective_max_context=%d on http://%s:%d", info.model_name, info.dtype,
                info.device, info.max_total_num_tokens, info.page_size, info.max_running_requests,
                info.context_len, info.effective_max_context, server_args.host, server_args.port)
    tm = TokenizerManager(info, link, proc, config)
    app = create_app(tm, server_args)
    try:
        uvicorn.run(app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
                    timeout_keep_alive=5, access_log=False)
    finally:
        link.close()
        proc.terminate()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
