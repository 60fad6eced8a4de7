"""Pydantic models of the OpenAI-compatible API (the subset radixserve serves) and the native /generate API.

Requests validate strictly (a string where a number belongs is an error, not a coercion); unknown
fields are ignored. Range checks that need the model (context, vocabulary) happen in the server.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixserve.entrypoints.protocol_base import RequestModel as _Request
from radixserve.entrypoints.protocol_base import ResponseModel as _Response
from radixserve.entrypoints.tool_protocol import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    FunctionCallOut,
    FunctionDefinition,
    LegacyFunctionChoice,
    ToolCall,
    ToolCallOut,
    ToolChoice,
    ToolDefinition,
)
from radixserve.mem_cache.tiers import tier_details


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------------------------------- requests


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # accepted; the grammar always enforces the schema


class ResponseFormat(_Request):
    """OpenAI's `response_format` (vLLM accepts it on /v1/completions too): text, any JSON object, or a schema."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # structural_tag (SGLang's): `structures` + `triggers`, or xgrammar's `format`
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None

    def grammar(self) -> dict[str, str]:
        """The grammar sampling parameter this format means ({} for text)."""
        if self.type == "json_object":
            return {"json_schema": '{"type": "object"}'}
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("'response_format' of type json_schema needs a 'json_schema' object")
            return {"json_schema": json.dumps(self.json_schema.schema_)}
        if self.type == "structural_tag":
            if self.format is not None:
                return {"structural_tag": json.dumps({"type": "structural_tag", "format": self.format})}
            if self.structures is None:
                raise ValueError("'response_format' of type structural_tag needs 'structures' and 'triggers', "
                                 "or a 'format'")
            return {"structural_tag": json.dumps({"structures": self.structures, "triggers": self.triggers or []})}
        return {}


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None  # None: the rest of the (effective) context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # vLLM's and SGLang's extension
    seed: int | None = None
    rid: str | None = None  # SGLang's extension: a name for the request, for /abort_request
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Cache namespaces: vLLM's cache_salt and SGLang's extra_key; both only narrow the namespace.
    cache_salt: str | None = None
    extra_key: str | None = None
    session_id: str | None = None  # an open agent session (POST /open_session) whose context stays cached
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    logit_bias: dict[str, float] | None = None  # token id (a string key) -> [-100, 100]
    repetition_penalty: float = 1.0  # vLLM's and SGLang's extension, [1e-6, 2]
    min_tokens: int = 0  # vLLM's extension: EOS and stop token ids are banned before this many tokens
    response_format: ResponseFormat | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # the alternatives per token (0-20); None: no logprobs
    echo: bool = False  # the prompt first in the text (and, with logprobs, in the logprobs); allows max_tokens 0
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """A turn of the chat; its tool calls and answers are checked by entrypoints/chat_history.py."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # function: legacy tool answer
    content: str | list[TextPart] | None = None
    name: str | None = None  # a function message: the function it answers; other roles: not rendered
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    function_call: FunctionCall | None = None  # legacy: an assistant turn's one call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None  # 0-20, only with logprobs
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool = True
    # the legacy function calling, served as tools (function_call/legacy.py); not together with the above
    functions: list[FunctionDefinition] | None = None
    function_call: LegacyFunctionChoice | None = None  # None: auto with functions
    echo: bool = False  # vLLM's (the last message first in the reply): refused when true
    separate_reasoning: bool = True  # SGLang's: false keeps the think block in `content` (--reasoning-parser)
    reasoning_effort: str | None = None  # OpenAI's: low / medium / high: a think-block budget (chat_reasoning.py)
    thinking_budget: int | None = None  # the budget in tokens, instead of reasoning_effort


class NativeSamplingParams(_Request):
    """/generate's `sampling_params`, SGLang's names (radixserve's `SamplingParams`); unknown names are refused."""

    model_config = ConfigDict(strict=True, extra="forbid")

    max_new_tokens: int | None = None  # None: the rest of the (effective) context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # SGLang's name
    seed: int | None = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logit_bias: dict[str, float] | None = None  # token id (a string key) -> [-100, 100]
    # Constrained decoding, SGLang's names: at most one (docs/structured_outputs.md)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None


class GenerateRequest(_Request):
    """SGLang's native /generate: `text` or `input_ids`, a `sampling_params` dict, `stream`."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    rid: str | list[str] | None = None  # one per prompt; for /abort_request
    top_logprobs_num: int = 0  # 0-20, used only with return_logprob
    logprob_start_len: int = -1  # with return_logprob: also the prompt's logprobs from this position (-1: no)
    return_text_in_logprobs: bool = False  # accepted for SGLang clients; the text is always included
    cache_salt: str | None = None
    extra_key: str | None = None
    lora_path: str | None = None  # SGLang's name: the LoRA adapter to run (docs/lora.md); None: the base model
    session_params: SessionParams | None = None  # SGLang's: the open agent session this request belongs to


class SessionParams(_Request):
    """SGLang's `session_params` of /generate: `id` names an open session; `rid`, `offset` and `replace` (its
    branching) are accepted and not used here (docs/radix_cache.md, "Agent sessions")."""

    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool | None = None


class OpenSessionRequest(_Request):
    """SGLang's /open_session: an optional `session_id` (else one is made), `capacity_of_str_len` (accepted; the
    token bounds of the server apply), `ttl_s` (this session's idle timeout)."""

    session_id: str | None = None
    capacity_of_str_len: int | None = None
    ttl_s: float | None = None


class CloseSessionRequest(_Request):
    session_id: str


class AbortRequest(_Request):
    """SGLang's /abort_request: the `rid` given at generation, or every request of the caller."""

    rid: str | None = None
    abort_all: bool = False


class TokenizeRequest(_Request):
    """vLLM-compatible /tokenize: a text `prompt`, or chat `messages` (with the chat template applied)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------------------- responses


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error: OpenAI's shape (a 409 from /flush_cache adds `in_flight_requests` and `rids`)."""

    model_config = ConfigDict(extra="allow")

    error: ErrorDetail


class PromptTokensDetails(_Response):
    """`cached_tokens` (every tier); with the hierarchical cache also `cached_tokens_details`, the same tokens by
    tier ({"device", "host", "storage"}, an extension; absent otherwise, so it is an extra field here)."""

    model_config = ConfigDict(extra="allow")

    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int, details: dict[str, int] | None = None) -> UsageInfo:
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached, **tier_details(details)))


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's UTF-8 bytes (a token may hold part of a character)


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(_Response):
    """The legacy completions shape: parallel lists, one entry per token (with echo, the prompt's first).

    The first prompt token has no context: its `token_logprobs` and `top_logprobs` entries are null."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)  # characters into the choice's text


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # with --reasoning-parser only (else left out): the think block
    tool_calls: list[ToolCallOut] | None = None
    function_call: FunctionCallOut | None = None  # legacy requests' answer (no tool_calls then), else left out


ChatFinishReason = Literal["stop", "length", "abort", "tool_calls", "function_call"]  # function_call: legacy


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser only (else left out)
    tool_calls: list[DeltaToolCall] | None = None
    function_call: DeltaFunctionCall | None = None  # legacy requests' call pieces (no tool_calls then)


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "radixserve"
    max_model_len: int
    root: str | None = None  # a LoRA adapter's folder (vLLM's field)
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    embedding_pooling: str | None = None  # how /v1/embeddings pools (--embedding-pooling): last or mean


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ------------------------------------------------------------------------- other endpoints' responses


class GenerateResponse(_Response):
    """One /generate result (a batch or n > 1 answers a list of these)."""

    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]


class TokenizeResponse(_Response):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Response):
    prompt: str


class AbortResponse(_Response):
    success: bool
    aborted: int


class FlushCacheResponse(_Response):
    success: bool
    tokens_freed: int
    message: str
    cache_epoch: int


class LoadLoraAdapterRequest(_Request):
    """SGLang's /load_lora_adapter: a PEFT LoRA folder, registered under `lora_name`."""

    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(_Request):
    lora_name: str


class LoraAdapterResponse(_Response):
    success: bool
    message: str
    adapters: list[dict[str, Any]]
    freed_tokens: int = 0


class HealthResponse(_Response):
    status: Literal["ok"]
    latency_s: float | None = None
