"""Thinking on the Messages API (`--reasoning-parser`; docs/server.md, "Anthropic Messages API" and "Reasoning
output"): the request's `thinking` as the chat request's reasoning fields, thinking blocks replayed in the
input, and the thinking block of an answer.

- `thinking_fields(thinking, max_tokens, reasoning)`: `{"type": "enabled", "budget_tokens": N}` is the chat
  request's `thinking_budget` (chat_reasoning.py: the scheduler closes a block still open after N output
  tokens); `{"type": "disabled"}` is `separate_reasoning: false` (no split: the raw text is the text block);
  `{"type": "adaptive"}` is the default (the split runs, no budget). `enabled` on a server without
  `--reasoning-parser` is a 400 naming `thinking`, as the chat path's `thinking_budget` is.
- `check_replayed(block, at)`: a `thinking` / `redacted_thinking` block of an assistant turn, checked and
  dropped (the chat templates of reasoning models leave earlier turns' reasoning out of the prompt).
- `thinking_block(text)`: the answer's content block; its `signature` is "" (nothing is signed here).
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.entrypoints.http_errors import bad_request

THINKING_BLOCKS = ("thinking", "redacted_thinking")
_DISPLAYS = (None, "summarized")  # NOTE: "omitted" (a signature without the text) is refused: nothing is signed


def thinking_fields(thinking: Any, max_tokens: int | None, reasoning: bool) -> dict[str, Any]:
    """The chat request's fields for a Messages request's `thinking` (None: absent); `max_tokens`: the request's
    (None for count_tokens); `reasoning`: whether the server runs a reasoning parser. A 400 naming the field."""
    if thinking is None:
        return {}
    if not isinstance(thinking, dict) or not isinstance(thinking.get("type"), str):
        raise bad_request("'thinking' must be an object with a 'type'", param="thinking")
    kind = thinking["type"]
    if kind == "disabled":
        _only(thinking, "thinking", {"type"})
        return {"separate_reasoning": False}
    if kind not in ("enabled", "adaptive"):
        raise bad_request(f"'thinking.type' must be enabled, disabled or adaptive, got {json.dumps(kind)[:66]}",
                          param="thinking.type", code="invalid_value")
    _only(thinking, "thinking", {"type", "display"} | ({"budget_tokens"} if kind == "enabled" else set()))
    if thinking.get("display") not in _DISPLAYS:
        raise bad_request("'thinking.display': only 'summarized' is served (this server signs no thinking, so it "
                          "cannot omit its text)", param="thinking.display", code="unsupported_parameter")
    if kind == "adaptive":
        return {}  # NOTE: the model decides: the split runs (with a parser) and nothing bounds the block
    if not reasoning:
        raise bad_request("'thinking' enabled needs a server started with --reasoning-parser", param="thinking",
                          code="unsupported_parameter")
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise bad_request(f"'thinking.budget_tokens' must be an integer >= 1, got {json.dumps(budget)[:40]}",
                          param="thinking.budget_tokens", code="invalid_value")
    # NOTE: Anthropic's minimum of 1024 is not enforced (a small local model thinks usefully in fewer tokens);
    # its rule that the budget is below max_tokens is: the block and an answer both fit
    if max_tokens is not None and budget >= max_tokens:
        raise bad_request(f"'thinking.budget_tokens' ({budget}) must be less than 'max_tokens' ({max_tokens})",
                          param="thinking.budget_tokens", code="invalid_value")
    return {"thinking_budget": budget}


def check_replayed(block: dict[str, Any], at: str) -> None:
    """Checks a replayed `thinking` (`thinking`, `signature`) or `redacted_thinking` (`data`) block of an
    assistant message; the caller drops it."""
    fields = ("thinking", "signature") if block["type"] == "thinking" else ("data",)
    _only(block, at, {"type", "cache_control", *fields})
    for name in fields:
        value = block.get(name, "" if name == "signature" else None)  # NOTE: ours are "", a client may drop it
        if not isinstance(value, str):
            raise bad_request(f"'{at}.{name}' must be a string", param=f"{at}.{name}")


def thinking_block(text: str) -> dict[str, Any]:
    """An answer's thinking block (the shape of the SDK's ThinkingBlock)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def _only(block: dict[str, Any], at: str, allowed: set[str]) -> None:
    unknown = sorted(set(block) - allowed)
    if unknown:
        raise bad_request(f"'{at}.{unknown[0]}' is not supported here", param=f"{at}.{unknown[0]}",
                          code="unsupported_parameter")
