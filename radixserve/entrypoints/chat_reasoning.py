"""Reasoning output on /v1/chat/completions (`--reasoning-parser`): a choice's think block as the message's
`reasoning_content` (stream deltas: `delta.reasoning_content`), its answer as `content`; the tool-call parser
reads the answer only. `usage.completion_tokens_details.reasoning_tokens` counts the output tokens up to and
including the one that ends the block. A request's `separate_reasoning: false` turns it off. A reasoning budget
(`thinking_budget`, or OpenAI's `reasoning_effort`) becomes the sampling parameter `reasoning_budget`: the
scheduler ends a block still open after that many output tokens (constrained/reasoning_budget.py).

The split itself is function_call/reasoning.py's `ReasoningParser`; this module decides per request whether it
runs and where its sequences start (inside a block the prompt opened, or not), and shapes its results.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from radixserve.entrypoints.http_errors import bad_request
from radixserve.function_call.reasoning import (
    EFFORT_BUDGETS,
    ReasoningParser,
    ThinkBudget,
    closing_tag,
    prompt_opens_think,
)

# NOTE: an opened block at the end of a prompt is in its last tokens (the template's assistant header, then
# `<think>` and perhaps a prefilled start of thought); only these are decoded to look for it.
_PROMPT_TAIL_TOKENS = 256
_FIELD = "reasoning_content"


@dataclass(frozen=True)
class ReasoningPlan:
    """One request's reasoning split: the style and whether its sequences start inside a think block."""

    style: str
    started_in_prompt: bool

    def parser(self) -> ReasoningParser:
        return ReasoningParser(self.style, started_in_prompt=self.started_in_prompt)

    def split(self, text: str) -> tuple[str | None, str, bool]:
        """(reasoning or None without a block, answer, whether the block was closed) of a whole text."""
        parser = self.parser()
        r1, a1 = parser.feed(text)
        r2, a2 = parser.finish()
        return (r1 + r2 if parser.saw_reasoning else None), a1 + a2, parser.closed


def plan_reasoning(style: str | None, req: Any, tools: Any, tokenizer: Any, prompt_ids: list[int]) -> ReasoningPlan | None:
    """The plan of a chat request (None: no split: no `--reasoning-parser`, `separate_reasoning: false`, or a
    grammar that writes the output from its first token); `tools`: its ToolPlan or None; `prompt_ids`: the
    rendered prompt, whose end tells whether the template opened the block."""
    if style is None or not req.separate_reasoning or grammar_from_start(req, tools):
        return None
    tail = tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return ReasoningPlan(style, prompt_opens_think(style, tail))


def grammar_from_start(req: Any, tools: Any) -> bool:
    """Whether the request's grammar fixes its output from the first token (a JSON `response_format`, or
    `tool_choice` required or named): such an output holds no think block, and under `deepseek-r1` it would
    otherwise all be read as reasoning. NOTE: a structural-tag format or `auto` tools allow free text first."""
    fmt = req.response_format
    if fmt is not None and fmt.type in ("json_object", "json_schema"):
        return True
    return tools is not None and tools.choice in ("required", "named")


def reasoning_tokens(plan: ReasoningPlan, tokenizer: Any, token_ids: list[int], text: str) -> int:
    """Output tokens spent in the think block: all of them while it is open, none without one, else up to the
    first token whose text completes the closing tag (a binary search over decoded prefixes)."""
    reasoning, _, closed = plan.split(text)
    if reasoning is None:
        return 0
    if not closed:
        return len(token_ids)
    tag = closing_tag(plan.style)
    lo, hi = 1, len(token_ids)  # NOTE: the whole output holds the tag; find the shortest prefix that does
    while lo < hi:
        mid = (lo + hi) // 2
        if tag in tokenizer.decode(token_ids[:mid], skip_special_tokens=False):
            hi = mid
        else:
            lo = mid + 1
    return lo


def whole_fields(plan: ReasoningPlan | None, text: str) -> tuple[str | None, str]:
    """A finished choice's (reasoning_content, the text the answer and tool calls are read from)."""
    if plan is None:
        return None, text
    reasoning, answer, _ = plan.split(text)
    return reasoning, answer


class StreamedReasoning:
    """Per choice of a streamed chat answer: its parser, and its token ids for the usage figure."""

    def __init__(self, plan: ReasoningPlan, tokenizer: Any) -> None:
        self.plan = plan
        self.tokenizer = tokenizer
        self._parsers: dict[int, ReasoningParser] = {}
        self._ids: dict[int, list[int]] = {}
        self._texts: dict[int, list[str]] = {}
        self.tokens: dict[int, int] = {}  # per finished choice: its reasoning tokens

    def delta(self, index: int, text: str, token_ids: list[int], finished: bool) -> tuple[str, str]:
        """(reasoning_delta, answer_delta) of one output step of choice `index`; a finished one flushes."""
        parser = self._parsers.setdefault(index, self.plan.parser())
        self._ids.setdefault(index, []).extend(token_ids)
        self._texts.setdefault(index, []).append(text)
        reasoning, answer = parser.feed(text)
        if finished:
            tail_r, tail_a = parser.finish()
            reasoning, answer = reasoning + tail_r, answer + tail_a
            self.tokens[index] = reasoning_tokens(self.plan, self.tokenizer, self._ids.pop(index),
                                                  "".join(self._texts.pop(index)))
        return reasoning, answer


def add_reasoning_usage(body: dict[str, Any], tokens: int | None) -> dict[str, Any]:
    """A dumped response or usage chunk with `usage.completion_tokens_details.reasoning_tokens` (OpenAI's
    field) when `tokens` is not None."""
    if tokens is not None and body.get("usage") is not None:
        body["usage"]["completion_tokens_details"] = {"reasoning_tokens": tokens}
    return body


def without_reasoning(exclude: dict[str, Any], part: str) -> dict[str, Any]:
    """A `model_dump` exclude spec that also leaves out `reasoning_content` of each choice's `part` (`message`
    or `delta`): a server or request without the split answers exactly as before."""
    fields = exclude["choices"]["__all__"][part] | {_FIELD}
    return {"choices": {"__all__": {part: fields}}}


def budget_of(style: str | None, req: Any, tokenizer: Any, prompt_ids: list[int]) -> ThinkBudget | None:
    """The request's reasoning budget: `thinking_budget` tokens, or OpenAI's `reasoning_effort` as
    EFFORT_BUDGETS; None without either. A 400 naming the field for a bad value, for both together, or for
    `thinking_budget` on a server without `--reasoning-parser` (`reasoning_effort` is ignored there, as by a
    model that does not reason)."""
    effort, tokens = req.reasoning_effort, req.thinking_budget
    if effort is not None and tokens is not None:
        raise bad_request("give 'thinking_budget' or 'reasoning_effort', not both", param="thinking_budget",
                          code="invalid_value")
    if tokens is not None:
        if style is None:
            raise bad_request("'thinking_budget' needs a server started with --reasoning-parser",
                              param="thinking_budget", code="unsupported_parameter")
        if isinstance(tokens, bool) or tokens < 1:
            raise bad_request(f"'thinking_budget' must be an integer >= 1, got {tokens!r}", param="thinking_budget",
                              code="invalid_value")
    elif effort is not None:
        if effort not in EFFORT_BUDGETS:
            raise bad_request(f"'reasoning_effort' must be one of {', '.join(EFFORT_BUDGETS)}, got {effort!r}",
                              param="reasoning_effort", code="invalid_value")
        if style is None:
            return None
        tokens = EFFORT_BUDGETS[effort]
    else:
        return None
    tail = tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return ThinkBudget(tokens, style, prompt_opens_think(style, tail))


def with_budget(params: list[Any], budget: ThinkBudget | None) -> list[Any]:
    """The sampling parameters with the reasoning budget set (checked again by SamplingParams)."""
    return params if budget is None else [dataclasses.replace(p, reasoning_budget=budget) for p in params]


def dump_chat(body: Any, exclude: dict[str, Any], plan: ReasoningPlan | None, tokenizer: Any,
              results: list[Any]) -> dict[str, Any]:
    """A non-streamed chat response as JSON data: without `reasoning_content` when the split is off, else with
    the reasoning tokens of its choices (`results`: each with `token_ids` and `text`) in its usage."""
    if plan is None:
        return body.model_dump(exclude=without_reasoning(exclude, "message"))
    spent = sum(reasoning_tokens(plan, tokenizer, r.token_ids, r.text) for r in results)
    return add_reasoning_usage(body.model_dump(exclude=exclude), spent)
