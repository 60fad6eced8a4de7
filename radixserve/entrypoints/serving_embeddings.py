"""POST /v1/embeddings: OpenAI's embeddings over the scheduler that serves generation (docs/server.md#embeddings).

Each input runs as one request of the scheduler, beside generation in the same continuous batches: a prefill that
generates no token (`max_new_tokens` 0) and returns the model's final norm output pooled over its prompt (`last`
token or `mean`, --embedding-pooling; layers/pooler.py), L2-normalised. Its KV is then cached like a
finished request's, so a later request sharing the prompt's prefix reuses it (`last` only: `mean` needs every
token's hidden state, so it matches no prefix and computes its prompt whole).
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixserve.entrypoints import openapi_docs as docs
from radixserve.entrypoints.embeddings_protocol import (
    ENCODING_FORMATS,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from radixserve.entrypoints.gateway_api import GATEWAY_UNSET_MODEL
from radixserve.entrypoints.http_auth import Principal
from radixserve.entrypoints.http_errors import ApiError, bad_request, check_text, overloaded
from radixserve.entrypoints.lora_api import adapter_of_model, check_adapter
from radixserve.entrypoints.serving_common import (
    CLIENT_CLOSED,
    ClientDisconnected,
    DisconnectWatcher,
    check_fanout,
    check_prompt,
    guarded,
    merge_outputs,
    raise_if_aborted,
    tokenize_text,
)
from radixserve.frontend.tokenizer_manager import GenerateOutput, GenerateReq, SchedulerBusy, TokenizerManager
from radixserve.protocol.io_struct import NO_LOGPROBS
from radixserve.protocol.requests import check_request
from radixserve.sampling_params import SamplingParams

_ERRORS = (400, 401, 404, 413, 500, 503)
Parse = Callable[[Request, Any, Any], Awaitable[tuple[Any, Any]]]


def register_embedding_routes(app: FastAPI, tm: TokenizerManager, auth: Any, parse: Parse,
                              namespace: Callable[[Any, Any], Any], pooling: str) -> None:
    """POST /v1/embeddings. `parse(request, model, principal)`: the validated body and whose turn its CPU work takes;
    `namespace(principal, req)`: its cache namespace; `pooling`: --embedding-pooling."""

    @app.post("/v1/embeddings", openapi_extra=docs.json_body(EmbeddingRequest),
              responses=docs.responses(docs.ref(EmbeddingResponse), *_ERRORS))
    async def embeddings(request: Request) -> Response:
        principal: Principal = auth.principal(request)
        req, key = await parse(request, EmbeddingRequest, principal)
        return await guarded(lambda: create_embeddings(tm, req, namespace(principal, req), request, key, pooling))


def with_pooling(cards: list[Any], pooling: str) -> list[Any]:
    """The /v1/models cards, each stating how /v1/embeddings pools (every card is served the same way)."""
    for card in cards:
        card.embedding_pooling = pooling
    return cards


async def create_embeddings(tm: TokenizerManager, req: EmbeddingRequest, extra_key: Any, request: Request,
                            key: Any, pooling: str) -> Response:
    """Checks the request (each refusal a 400 naming its field, before any work), runs one scheduler request per
    input, and answers in OpenAI's shape."""
    lora = await _check_fields(tm, req)
    inputs = req.input
    count = 1 if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)) else len(inputs)
    if count == 0:
        raise bad_request("'input' is empty; give a string, a list of strings, a list of token ids or a list of "
                          "token-id lists", param="input", code="empty_input")
    check_fanout(tm, count, 1, "input")  # NOTE: the number of inputs is bounded by --max-request-fanout
    prompts = await tm.run_tokenizer(key, _prompts, tm, inputs)
    try:
        tm.check_capacity(len(prompts), extra_key)
    except SchedulerBusy as e:
        raise overloaded(str(e)) from None
    group = object()  # NOTE: its inputs share one turn in fair admission
    params = SamplingParams(max_new_tokens=0)
    gens = [tm.generate(GenerateReq(ids, params, extra_key, group=group, lora_name=lora, embed=pooling))
            for ids in prompts]
    watcher = DisconnectWatcher(request.receive)
    try:
        finals = await guarded(lambda: watcher.run(_collect(merge_outputs(gens), len(prompts))))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        watcher.close()
    data = [EmbeddingData(index=i, embedding=_encode(_vector(out), req.dimensions, req.encoding_format))
            for i, out in enumerate(finals)]
    tokens = sum(len(p) for p in prompts)
    body = EmbeddingResponse(data=data, model=req.model or tm.info.model_name,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
    return JSONResponse(body.model_dump())


async def _check_fields(tm: TokenizerManager, req: EmbeddingRequest) -> str | None:
    """The LoRA adapter `model` names (None: the base model); a 400 (404: an unknown model) naming a bad field."""
    if req.encoding_format not in ENCODING_FORMATS:
        raise bad_request(f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}, got "
                          f"{req.encoding_format!r}", param="encoding_format", code="invalid_value")
    width = tm.info.hidden_size
    if req.dimensions is not None and not 1 <= req.dimensions <= width:
        raise bad_request(f"'dimensions' must be between 1 and this model's hidden size {width}, got {req.dimensions}",
                          param="dimensions", code="invalid_value")
    for name in ("user", "cache_salt", "model"):
        value = getattr(req, name)
        if value is not None:
            check_text(value, name)
    if req.model == GATEWAY_UNSET_MODEL:
        return None
    return await check_adapter(tm, adapter_of_model(req.model, tm.info.model_name), "model")


def _prompts(tm: TokenizerManager, inputs: str | list[Any]) -> list[list[int]]:
    """On the tokenizer thread: each input's token ids, each checked as the scheduler will (empty, vocabulary,
    context and pool): a 400 naming `input`."""
    if isinstance(inputs, str):
        prompts = [tokenize_text(tm, inputs, "input")]
    elif isinstance(inputs[0], int):
        prompts = [list(inputs)]
    elif isinstance(inputs[0], str):
        prompts = [tokenize_text(tm, text, "input") for text in inputs]
    else:
        prompts = [list(ids) for ids in inputs]
    for i, ids in enumerate(prompts):
        where = "input" if len(prompts) == 1 else f"input[{i}]"
        try:
            check_prompt(tm, ids, where)
        except ApiError as e:
            e.param = "input"  # NOTE: the field; the message names the item
            raise
        # NOTE: the scheduler's own rule, so it never refuses an input this let through
        error = check_request(ids, NO_LOGPROBS, None, tm.info.limits)
        if error is not None:
            raise bad_request(f"'{where}': {error}", param="input", code="context_length_exceeded")
    return prompts


async def _collect(outputs: Any, count: int) -> list[GenerateOutput]:
    """Each input's finishing output (the one that carries its embedding)."""
    finals: list[GenerateOutput | None] = [None] * count
    async with aclosing(outputs) as stream:
        async for index, out in stream:
            finals[index] = out
    for out in finals:
        raise_if_aborted(out)
    return finals  # type: ignore[return-value]


def _vector(out: GenerateOutput) -> list[float]:
    if out.embedding is None:
        # NOTE: an abort the client asked for (/abort_request) ends it without a vector
        raise ApiError(500, f"the request ended without an embedding ({out.finish_reason}: "
                            f"{out.finish_message or 'no reason given'})", code="request_aborted")
    return out.embedding


def _encode(vector: list[float], dimensions: int | None, encoding_format: str) -> list[float] | str:
    """Truncated to `dimensions` and re-normalised (L2), as floats or base64 of little-endian float32."""
    if dimensions is not None and dimensions < len(vector):
        vector = vector[:dimensions]
        norm = math.sqrt(math.fsum(v * v for v in vector))
        vector = [v / norm for v in vector] if norm > 0 else vector
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector
