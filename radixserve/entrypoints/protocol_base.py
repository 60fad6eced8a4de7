"""The base models of every request and response model of the HTTP API (openai_protocol.py, tool_protocol.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class RequestModel(BaseModel):
    """A request body or a part of one: strict types (a string where a number belongs is an error, not a
    coercion); unknown fields are ignored (OpenAI clients send extras)."""

    model_config = ConfigDict(strict=True, extra="ignore")


class ResponseModel(BaseModel):
    """An answer or a part of one: only its declared fields."""

    model_config = ConfigDict(extra="forbid")
