"""SGLang's native POST /generate: `text` or `input_ids`, a `sampling_params` dict, `meta_info` per output."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from radixserve.entrypoints import openapi_docs as docs
from radixserve.entrypoints.http_errors import ApiError, bad_request, check_text
from radixserve.entrypoints.logprobs import TokenTexts, check_top_logprobs, native_logprobs
from radixserve.entrypoints.lora_api import check_adapter
from radixserve.entrypoints.openai_protocol import (
    CloseSessionRequest,
    GenerateRequest,
    NativeSamplingParams,
    OpenSessionRequest,
)
from radixserve.entrypoints.serving_common import (
    CLIENT_CLOSED,
    ChoiceResult,
    ClientDisconnected,
    DisconnectWatcher,
    check_fanout,
    check_prompt,
    check_request_items,
    collect,
    generate_all,
    guarded,
    make_sampling_params,
    raise_if_aborted,
    resolve_max_tokens,
    stream_response,
    token_id_keys,
    tokenize_text,
)
from radixserve.frontend.tenant_namespace import namespace_owner
from radixserve.frontend.tokenizer_manager import GenerateOutput, TokenizerManager
from radixserve.mem_cache.tiers import tier_details
from radixserve.protocol.io_struct import CheckSessionReq, CloseSessionReq, OpenSessionReq
from radixserve.protocol.requests import per_choice_params
from radixserve.sampling_params import SamplingParams

_MAX_PARAM = "sampling_params.max_new_tokens"


def _prompts(tm: TokenizerManager, req: GenerateRequest) -> tuple[list[list[int]], bool, str]:
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("give exactly one of 'text' and 'input_ids'", param="text")
    if req.text is not None:
        texts = req.text if isinstance(req.text, list) else [req.text]
        prompts = [tokenize_text(tm, t, "text") for t in texts]
        batch, param = isinstance(req.text, list), "text"
    else:
        ids = req.input_ids
        batch = bool(ids) and isinstance(ids[0], list)
        prompts, param = ([list(p) for p in ids] if batch else [list(ids)]), "input_ids"
    if batch and not prompts:
        raise bad_request(f"'{param}' is an empty batch", param=param, code="empty_prompt")
    for ids in prompts:
        check_prompt(tm, ids, param)
    return prompts, batch, param


def _client_rids(req: GenerateRequest, num_prompts: int, batch: bool) -> list[str | None]:
    """SGLang's `rid`: one string for one prompt, a list with one per prompt for a batch."""
    rids = req.rid if isinstance(req.rid, list) else [req.rid] * num_prompts
    if isinstance(req.rid, list) and (not batch or len(rids) != num_prompts):
        raise bad_request(f"'rid' lists {len(rids)} ids for {num_prompts} prompt(s); give one per prompt",
                          param="rid")
    for rid in rids:
        if rid is not None:
            check_text(rid, "rid")
    return rids


def _logprob_start(req: GenerateRequest, prompts: list[list[int]]) -> int:
    """SGLang's `logprob_start_len` (-1 when not asked, or without return_logprob), checked for each prompt."""
    start = req.logprob_start_len if req.return_logprob else -1
    for ids in prompts:
        if not -1 <= start < len(ids):
            raise bad_request(f"'logprob_start_len' must be -1 or a prompt position (0 to {len(ids) - 1}), "
                              f"got {start}", param="logprob_start_len", code="invalid_value")
    return start


def _sampling(tm: TokenizerManager, values: NativeSamplingParams, prompt_len: int, param: str) -> SamplingParams:
    fields = values.model_dump()
    resolved = resolve_max_tokens(tm, prompt_len, fields["max_new_tokens"], param, _MAX_PARAM, allow_zero=True)
    bias = token_id_keys(fields["logit_bias"], tm.info.vocab_size, "sampling_params.logit_bias")
    return make_sampling_params(False, tm.info.vocab_size, **{**fields, "max_new_tokens": resolved,
                                                                "logit_bias": bias})


def _num_prompts(req: GenerateRequest) -> int:
    prompt = req.text if req.text is not None else req.input_ids
    if isinstance(prompt, list) and (req.text is not None or (prompt and isinstance(prompt[0], list))):
        return len(prompt)
    return 1


def _meta(rid: str, r: ChoiceResult | GenerateOutput, started: float) -> dict[str, Any]:
    # NOTE: the scheduler's finish reason as it is (SGLang's: the stop token or string matched, the length
    # reached, an abort's message and status), the same dict the Engine returns.
    return {"id": rid, "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "cached_tokens": r.cached_tokens, **tier_details(r.cached_tokens_details), "finish_reason": r.finish, "e2e_latency": time.monotonic() - started,
            **(r.figures or {})}


async def generate(tm: TokenizerManager, texts: TokenTexts, req: GenerateRequest, extra_key: Any,
                   request: Request, key: Any = None) -> Response:
    """`key`: whose turn its CPU work takes (fair_work): the API key's id, or the connection on an open server."""
    started = time.monotonic()
    if req.return_logprob:
        check_top_logprobs(req.top_logprobs_num, "top_logprobs_num")
    # NOTE: as SGLang, top_logprobs_num without return_logprob is ignored.
    top_logprobs = req.top_logprobs_num if req.return_logprob else None
    check_fanout(tm, _num_prompts(req), req.sampling_params.n, "input_ids" if req.text is None else "text")
    given = req.sampling_params
    check_request_items(tm, sequences=_num_prompts(req) * given.n, stop=given.stop,
                        stop_token_ids=given.stop_token_ids, logit_bias=given.logit_bias, prefix="sampling_params.")
    lora = await check_adapter(tm, req.lora_path, "lora_path")
    session = await check_session(tm, extra_key, req.session_params.id if req.session_params else None,
                                  "session_params.id")
    prompts, batch, param = await tm.run_tokenizer(key, _prompts, tm, req)
    start = _logprob_start(req, prompts)
    # NOTE: max_new_tokens 0 computes the prompt and generates nothing: it scores the prompt (with
    # logprob_start_len), or prewarms the radix cache with it (as SGLang allows).
    params = [_sampling(tm, req.sampling_params, len(p), param) for p in prompts]
    n = params[0].n
    choice_params = [per_choice_params(p, n) for p in params]
    outputs = generate_all(tm, prompts, choice_params, extra_key, top_logprobs, _client_rids(req, len(prompts), batch),
                           logprob_start_len=start, lora_name=lora, session=session)
    logprob_texts = texts if req.return_logprob else None  # None: no logprobs
    scored = [ids[start:] if start >= 0 else None for ids in prompts]  # the prompt tokens that get logprobs
    if req.stream:
        if batch or n > 1:
            await outputs.aclose()
            raise bad_request("streaming is supported for one prompt with n = 1", param="stream")
        return await stream_response(request, outputs, _stream_renderer(started, logprob_texts, scored[0]),
                                     lambda: [], partial(tm.run_cpu, key, admit=False))
    watcher = DisconnectWatcher(request.receive)
    try:
        results = await guarded(lambda: watcher.run(collect(outputs, len(prompts) * n)))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        watcher.close()
    for r in results:
        raise_if_aborted(r)
    # NOTE: built and JSON-encoded on a front-end thread: with prompt logprobs it holds every prompt token.
    return await tm.run_cpu(key, _response, results, started, logprob_texts, scored, n, batch, admit=False)


def _response(results: list[ChoiceResult], started: float, logprob_texts: TokenTexts | None,
              scored: list[list[int] | None], n: int, batch: bool) -> JSONResponse:
    bodies = [_result_body(r, started, logprob_texts, scored[i // n]) for i, r in enumerate(results)]
    return JSONResponse(bodies if batch or n > 1 else bodies[0])


def _result_body(r: ChoiceResult, started: float, logprob_texts: TokenTexts | None,
                 scored: list[int] | None) -> dict[str, Any]:
    meta = _meta(r.rid, r, started)
    if logprob_texts is not None:
        meta |= native_logprobs(logprob_texts, r, scored)
    return {"text": r.text, "output_ids": r.token_ids, "meta_info": meta}


def _stream_renderer(started: float, logprob_texts: TokenTexts | None, scored: list[int] | None):
    acc = ChoiceResult()

    def render(index: int, out: GenerateOutput) -> list[dict[str, Any]]:
        # NOTE: like SGLang, each event carries the whole text, ids and logprobs so far, not a delta.
        acc.add(out)
        meta = _meta(out.rid, out, started)
        if logprob_texts is not None:
            meta |= native_logprobs(logprob_texts, acc, scored)
        return [{"text": acc.text, "output_ids": list(acc.token_ids), "meta_info": meta}]
    return render


# ---------------------------------------------------------------------------------- agent sessions

async def check_session(tm: TokenizerManager, extra_key: Any, session_id: str | None,
                        param: str) -> tuple[str, str] | None:
    """(session_id, param) if the caller's key has that session open (None passes); else a 404 naming `param`.

    NOTE: the scheduler checks again when the request arrives (a session may close in between: the same 404)."""
    if session_id is None:
        return None
    check_text(session_id, param)
    out = await guarded(lambda: tm.session_control(CheckSessionReq(namespace_owner(extra_key), session_id)))
    if not out.success:
        raise ApiError(404, f"no open session {session_id!r} for this API key (unknown, closed or idle past its "
                            "timeout); open one with POST /open_session", param=param, code="session_not_found")
    return session_id, param


SESSION_SCHEMAS = [OpenSessionRequest, CloseSessionRequest]
_CLOSED = {"type": "object", "required": ["success", "session_id"],
           "properties": {"success": {"type": "boolean"}, "session_id": {"type": "string"}}}


def install_session_routes(app: Any, tm: TokenizerManager, auth: Any, parse: Any) -> None:
    """SGLang's POST /open_session and /close_session, per API key (docs/radix_cache.md, "Agent sessions")."""

    @app.post("/open_session", openapi_extra=docs.json_body(OpenSessionRequest),
              responses=docs.responses({"type": "string"}, 400, 401, 409, 429, 503))
    async def open_session(request: Request) -> JSONResponse:
        principal = auth.principal(request)
        req, _ = await parse(request, OpenSessionRequest, principal)
        if req.session_id is not None:
            check_text(req.session_id, "session_id")
            if not 1 <= len(req.session_id) <= 128:
                raise bad_request("session_id must have 1 to 128 characters", param="session_id")
        if req.capacity_of_str_len is not None and req.capacity_of_str_len < 0:
            raise bad_request("capacity_of_str_len must be >= 0", param="capacity_of_str_len")
        if req.ttl_s is not None and not req.ttl_s > 0:
            raise bad_request("ttl_s must be a positive number of seconds", param="ttl_s")
        out = await guarded(lambda: tm.session_control(
            OpenSessionReq(principal.key_id, req.session_id, req.ttl_s, req.capacity_of_str_len)))
        if not out.success:
            raise ApiError(out.status_code, out.message, param="session_id" if out.status_code == 409 else None,
                           code="session_exists" if out.status_code == 409 else "too_many_sessions")
        return JSONResponse(out.session_id)

    @app.post("/close_session", openapi_extra=docs.json_body(CloseSessionRequest),
              responses=docs.responses(_CLOSED, 400, 401, 404, 503))
    async def close_session(request: Request) -> JSONResponse:
        principal = auth.principal(request)
        req, _ = await parse(request, CloseSessionRequest, principal)
        check_text(req.session_id, "session_id")
        out = await guarded(lambda: tm.session_control(CloseSessionReq(principal.key_id, req.session_id)))
        if not out.success:
            raise ApiError(404, f"no open session {req.session_id!r} for this API key", param="session_id",
                           code="session_not_found")
        return JSONResponse({"success": True, "session_id": req.session_id})
