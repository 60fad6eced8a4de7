"""Pydantic models of OpenAI's /v1/embeddings (request and answer), served by serving_embeddings.py."""

from __future__ import annotations

from typing import Literal

from radixserve.entrypoints.protocol_base import RequestModel, ResponseModel

ENCODING_FORMATS = ("float", "base64")


class EmbeddingRequest(RequestModel):
    """OpenAI's embeddings request, plus the cache namespaces of the other routes (cache_salt, extra_key)."""

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: str = "float"  # float, or base64: little-endian float32 bytes (checked by the handler)
    dimensions: int | None = None  # truncate to this many, then re-normalise (1 to the hidden size)
    user: str | None = None  # accepted, not used
    cache_salt: str | None = None
    extra_key: str | None = None


class EmbeddingData(ResponseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(ResponseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


EMBEDDING_SCHEMAS = [EmbeddingRequest, EmbeddingResponse]
