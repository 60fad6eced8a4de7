"""The HTTP server: FastAPI app over a TokenizerManager, with the scheduler in a child process.

`launch_server(server_args)` spawns the scheduler process, waits for its model, then serves with
uvicorn until interrupted, or until the scheduler has died more often than its restart budget allows
(then it exits with status 1). `create_app(tm, server_args)` builds the app alone (tests, embedding).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from radixserve.entrypoints import openapi_docs as docs
from radixserve.entrypoints import serving_native
from radixserve.entrypoints.cache_explorer import register_cache_explorer
from radixserve.entrypoints.coalesce import Coalesced, TokenBucket
from radixserve.entrypoints.embeddings_protocol import EMBEDDING_SCHEMAS
from radixserve.entrypoints.gateway_api import install_gateway_routes
from radixserve.entrypoints.http_auth import Auth, Principal
from radixserve.entrypoints.http_errors import (
    ApiError,
    bad_request,
    install_error_handlers,
    overloaded,
    parse_request,
    unavailable,
)
from radixserve.entrypoints.keyless_gate import KeylessGate, KeylessGateMiddleware, keyless_h11_protocol
from radixserve.entrypoints.logprobs import TokenTexts
from radixserve.entrypoints.lora_api import LORA_SCHEMAS, install_lora_routes, model_cards
from radixserve.entrypoints.openai_protocol import (
    AbortRequest,
    AbortResponse,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    FlushCacheResponse,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from radixserve.entrypoints.serving_anthropic import register_anthropic_routes
from radixserve.entrypoints.serving_common import guarded
from radixserve.entrypoints.serving_embeddings import register_embedding_routes, with_pooling
from radixserve.entrypoints.serving_openai import OpenAIServing
from radixserve.entrypoints.serving_responses import register_responses_routes
from radixserve.frontend.scheduler_link import SchedulerLink
from radixserve.frontend.tokenizer_manager import (
    FrontendBusy,
    FrontendConfig,
    GenerateReq,
    SchedulerUnavailable,
    TokenizerManager,
    cache_namespace,
)
from radixserve.managers.scheduler_process import launch_scheduler_process
from radixserve.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

# NOTE: health_generate runs in its own namespace so probes never share KV with user requests.
_HEALTH_NAMESPACE = (("health", "probe"),)
_GENERATE_ERRORS = (400, 401, 413, 500, 503)
_KEYLESS_ERRORS = (429, 503)
_SCHEMA_MODELS = [CompletionRequest, ChatCompletionRequest, GenerateRequest, AbortRequest, TokenizeRequest,
                  DetokenizeRequest, CompletionResponse, ChatCompletionResponse, GenerateResponse, ModelList,
                  TokenizeResponse, DetokenizeResponse, AbortResponse, FlushCacheResponse, HealthResponse, *LORA_SCHEMAS,
                  *serving_native.SESSION_SCHEMAS,
                  *EMBEDDING_SCHEMAS]


def create_app(tm: TokenizerManager, server_args: ServerArgs) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await tm.start()
        yield
        await tm.shutdown()

    app = FastAPI(title="radixserve", version=_version(), lifespan=lifespan,
                  description="OpenAI-compatible and SGLang-native LLM server over a radix prefix cache.")
    install_error_handlers(app)

    @app.exception_handler(FrontendBusy)
    async def _busy(_: Request, exc: FrontendBusy) -> Response:
        return overloaded(str(exc)).response()

    docs.install(app, _SCHEMA_MODELS)
    auth = Auth(server_args.api_keys, server_args.admin_api_key)
    texts = TokenTexts(tm.tokenizer)
    openai = OpenAIServing(tm, texts)
    limit = tm.config.max_body_bytes
    app.state.tokenizer_manager = tm

    def namespace(principal: Principal, req: Any) -> Any:
        return cache_namespace(principal.key_id, req.cache_salt, req.extra_key)

    def work_key(principal: Principal, request: Request) -> Any:
        """Whose turn a request's CPU work takes (fair_work): its key, or on an open server (no identities) its
        connection, so one connection's stack of expensive requests never delays another's."""
        if principal.key_id is not None:
            return principal.key_id
        return ("connection", *(request.client or ()))

    async def parse(request: Request, model: Any, principal: Principal) -> tuple[Any, Any]:
        """The validated body, and whose turn its CPU work takes (computed once per request)."""
        key = work_key(principal, request)
        return await parse_request(request, model, limit, tm.config.bounds, partial(tm.run_parse, key)), key

    # NOTE: what a call without a valid key may cost is bounded twice: by this rate (refused before routing,
    # keyless_gate.py), and by sharing one run (Coalesced).
    keyless = app.state.keyless_gate = KeylessGate(auth.valid_key, TokenBucket(tm.config.keyless_rate_limit))
    app.add_middleware(KeylessGateMiddleware, gate=keyless)

    @app.post("/v1/completions", openapi_extra=docs.json_body(CompletionRequest),
              responses=docs.responses(docs.ref(CompletionResponse), *_GENERATE_ERRORS, 404, stream=True))
    async def completions(request: Request) -> Response:
        principal = auth.principal(request)
        req, key = await parse(request, CompletionRequest, principal)
        return await guarded(lambda: openai.completions(req, namespace(principal, req), request, key))

    @app.post("/v1/chat/completions", openapi_extra=docs.json_body(ChatCompletionRequest),
              responses=docs.responses(docs.ref(ChatCompletionResponse), *_GENERATE_ERRORS, 404, stream=True))
    async def chat_completions(request: Request) -> Response:
        principal = auth.principal(request)
        req, key = await parse(request, ChatCompletionRequest, principal)
        return await guarded(lambda: openai.chat(req, namespace(principal, req), request, key))

    generate_ok = {"anyOf": [docs.ref(GenerateResponse), {"type": "array", "items": docs.ref(GenerateResponse)}]}

    @app.post("/generate", openapi_extra=docs.json_body(GenerateRequest),
              responses=docs.responses(generate_ok, *_GENERATE_ERRORS, 404, stream=True))  # 404: a LoRA adapter
    async def generate(request: Request) -> Response:
        principal = auth.principal(request)
        req, key = await parse(request, GenerateRequest, principal)
        return await guarded(lambda: serving_native.generate(tm, texts, req, namespace(principal, req), request, key))

    @app.post("/abort_request", openapi_extra=docs.json_body(AbortRequest),
              responses=docs.responses(docs.ref(AbortResponse), 400, 401, 413))
    async def abort_request(request: Request) -> JSONResponse:
        principal = auth.principal(request)
        req, _ = await parse(request, AbortRequest, principal)
        if req.rid is None and not req.abort_all:
            raise bad_request("give the 'rid' to abort, or 'abort_all': true", param="rid")
        aborted = tm.abort_request(req.rid, principal.key_id, req.abort_all, admin=principal.admin)
        return JSONResponse(AbortResponse(success=True, aborted=aborted).model_dump())

    @app.post("/tokenize", openapi_extra=docs.json_body(TokenizeRequest),
              responses=docs.responses(docs.ref(TokenizeResponse), 400, 401, 404, 413))
    async def tokenize(request: Request) -> JSONResponse:
        principal = auth.principal(request)
        req, key = await parse(request, TokenizeRequest, principal)
        return JSONResponse(await openai.tokenize(req, key))

    @app.post("/detokenize", openapi_extra=docs.json_body(DetokenizeRequest),
              responses=docs.responses(docs.ref(DetokenizeResponse), 400, 401, 404, 413))
    async def detokenize(request: Request) -> JSONResponse:
        principal = auth.principal(request)
        req, key = await parse(request, DetokenizeRequest, principal)
        return JSONResponse(await openai.detokenize(req, key))

    @app.get("/v1/models", responses=docs.responses(docs.ref(ModelList), 401))
    async def models(request: Request) -> JSONResponse:
        auth.principal(request)
        cards = with_pooling(await model_cards(tm), server_args.embedding_pooling)  # the base, then its LoRA adapters
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/health", responses=docs.responses(docs.ref(HealthResponse), 503))
    async def health() -> JSONResponse:
        ok, reason = tm.health()
        if not ok:
            raise unavailable(reason)
        return JSONResponse({"status": "ok"})

    # NOTE: keyless, so a flood of probes shares one generation instead of queueing one each.
    probe = Coalesced(lambda: asyncio.wait_for(_one_token(tm), tm.config.control_timeout_s))

    @app.get("/health_generate", responses=docs.responses(docs.ref(HealthResponse), *_KEYLESS_ERRORS))
    async def health_generate() -> JSONResponse:
        ok, reason = tm.health()
        if not ok:
            raise unavailable(reason)
        started = time.monotonic()
        await guarded(probe.get)
        return JSONResponse({"status": "ok", "latency_s": round(time.monotonic() - started, 4)})

    @app.get("/get_server_info", responses=docs.responses({"type": "object"}, 401))
    async def server_info(request: Request) -> JSONResponse:
        principal = auth.principal(request)
        if not principal.admin:
            return JSONResponse(_tenant_info(tm))
        return JSONResponse(await _server_info(tm, server_args))

    @app.api_route("/flush_cache", methods=["GET", "POST"],
                   responses=docs.responses(docs.ref(FlushCacheResponse), 401, 403, 409, 503))
    async def flush_cache(request: Request) -> JSONResponse:
        auth.admin(request, "flushing the cache")
        out = await guarded(tm.flush_cache)
        if out.success:
            return JSONResponse(FlushCacheResponse(success=True, tokens_freed=out.tokens_freed,
                                                   message=out.message, cache_epoch=out.cache_epoch).model_dump())
        raise ApiError(409, f"cache not flushed: {out.message or 'requests are running'}; "
                            f"{tm.num_in_flight} request(s) in flight", code="requests_running",
                       extra={"in_flight_requests": tm.num_in_flight, "rids": tm.in_flight_rids()})

    @app.get("/metrics", response_class=PlainTextResponse, responses=docs.text_response(401, 403))
    async def metrics(request: Request) -> Response:
        if not server_args.metrics_public:
            auth.admin(request, "/metrics")
        try:
            await tm.get_internal_state(timeout_s=2.0)  # fresh scheduler counters when it answers
        except SchedulerUnavailable:
            pass
        return Response(tm.metrics.expose(), media_type=CONTENT_TYPE_LATEST)

    install_lora_routes(app, tm, auth, parse)  # /load_lora_adapter, /unload_lora_adapter (docs/lora.md)
    serving_native.install_session_routes(app, tm, auth, parse)  # /open_session, /close_session (radix_cache.md)
    install_gateway_routes(app, tm, server_args, auth)  # what SGLang's model gateway calls (docs/scale_out.md)
    register_cache_explorer(app, tm, server_args)  # /cache/tree, /cache/view (docs/server.md)
    register_responses_routes(app, tm, auth, parse, openai, server_args)  # /v1/responses (docs/server.md)
    register_anthropic_routes(app, tm, auth, texts, work_key)  # /v1/messages (docs/server.md)
    register_embedding_routes(app, tm, auth, parse, namespace, server_args.embedding_pooling)  # /v1/embeddings
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


def _tenant_info(tm: TokenizerManager) -> dict[str, Any]:
    """What a tenant key may know: the model and whether the server is healthy, nothing about others."""
    ok, reason = tm.health()
    info = tm.info
    return {"version": _version(), "model": {"model_name": info.model_name, "context_len": info.context_len,
                                             "effective_max_context": info.effective_max_context},
            "scheduler_alive": ok, "health": reason}


async def _server_info(tm: TokenizerManager, server_args: ServerArgs) -> dict[str, Any]:
    try:
        state = await tm.get_internal_state()
        alive = True
    except SchedulerUnavailable:
        state, alive = tm.scheduler_state, False
    redacted = {name: "<redacted>" if getattr(server_args, name) else None for name in ("api_key", "admin_api_key")}
    ok, reason = tm.health()
    return {
        "version": _version(),
        "model": tm.info.describe(),
        "platform": tm.info.platform,  # dtype and its reason, the C kernels in use, the CPU
        "server_args": dataclasses.asdict(server_args) | redacted,
        "frontend": dataclasses.asdict(tm.config),
        "scheduler_alive": alive and ok,
        "health": reason,
        "in_flight_requests": tm.num_in_flight,
        "admission": {"waiting": tm.admission.num_waiting, "queued": tm.admission.num_queued,
                      "outstanding": tm.admission.num_outstanding},
        "frontend_work": {w.name: w.stats() for w in (tm.parse_work, tm.cpu_work, tm.tokenize_work)},
        "scheduler_state": state,
    }


def _version() -> str:
    from radixserve.version import __version__

    return __version__


def _launcher(server_args: ServerArgs) -> Any:
    """Starts a scheduler process behind a fresh link: (link, process, info); blocking."""

    def launch() -> tuple[SchedulerLink, Any, Any]:
        # NOTE: bind before the scheduler process starts, so its connects succeed at once (SchedulerLink).
        link = SchedulerLink()
        try:
            proc, info = launch_scheduler_process(server_args, link.port_args)
        except BaseException:
            link.close()
            raise
        return link, proc, info
    return launch


def launch_server(server_args: ServerArgs, config: FrontendConfig | None = None) -> None:
    """Starts the scheduler process, then serves HTTP on server_args.host:port until stopped.

    Raises SystemExit(1) once the scheduler has died more often than the restart budget allows."""
    import uvicorn

    logging.basicConfig(level=server_args.log_level.upper(),
                        format="[%(asctime)s http] %(levelname)s %(name)s: %(message)s")
    launch = _launcher(server_args)
    link, proc, info = launch()
    logger.info("serving model=%s dtype=%s device=%s kv_pool_tokens=%d page_size=%d max_running_requests=%d "
                "context_len=%d effective_max_context=%d on http://%s:%d", info.model_name, info.dtype,
                info.device, info.max_total_num_tokens, info.page_size, info.max_running_requests,
                info.context_len, info.effective_max_context, server_args.host, server_args.port)
    tm = TokenizerManager(info, link, proc, config or FrontendConfig.from_server_args(server_args), launcher=launch)
    app = create_app(tm, server_args)
    # NOTE: h11 with the keyless routes' refusals answered from the raw request (keyless_gate.py); no access
    # log, so a flood of them writes nothing either.
    server = uvicorn.Server(uvicorn.Config(app, host=server_args.host, port=server_args.port,
                                           log_level=server_args.log_level, timeout_keep_alive=5, access_log=False,
                                           http=keyless_h11_protocol(app.state.keyless_gate)))

    def stop(reason: str) -> None:
        server.should_exit = True

    tm.supervisor.on_fatal = stop
    try:
        server.run()
    finally:
        _stop_process(tm.process)
        tm.link.close()
    if tm.fatal is not None:
        raise SystemExit(1)


def _stop_process(proc: Any) -> None:
    if proc is None:
        return
    proc.terminate()
    proc.join(5)
    if proc.is_alive():
        proc.kill()
