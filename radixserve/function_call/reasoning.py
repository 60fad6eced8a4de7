"""Reasoning output: a model's thinking (a `<think>...</think>` block) told apart from its answer.

Interface (the chat, Responses and Messages front ends all call it this way):

- `ReasoningParser(style, *, started_in_prompt=False)`: one per generated sequence.
  `feed(delta) -> (reasoning_delta, answer_delta)` for each streamed text delta, in order, then
  `finish() -> (reasoning_delta, answer_delta)` once for what was held back. A tag split across deltas at any
  character boundary is held back until it is known to be a tag or not, and never reaches the wrong side.
  After `finish`, `saw_reasoning` tells whether the sequence had a think block at all and `closed` whether
  its closing tag came; `in_reasoning` tells whether text fed now would be reasoning.
- `parse(style, text, started_in_prompt=False) -> (reasoning | None, answer)`: a whole text; the same parser
  fed it at once, so a stream's deltas always join to this. `reasoning` is None when there was no think block.
- `prompt_opens_think(style, prompt_text)`: whether a rendered prompt ends inside an opened think block (a
  template that opens `<think>` itself): the `started_in_prompt` of that prompt's sequences.
- `closing_tag(style)` / `closing_tag_ids(style, tokenizer)`: the text and token ids that end a think block
  (what a reasoning budget, `ThinkBudget`, forces).

Styles (`STYLES`, one table of tags):
- `deepseek-r1`: the chat template opens `<think>` itself, so the output starts inside the block, usually
  with no opening tag (one at its start, after any whitespace, is dropped with that whitespace); everything
  up to `</think>` is reasoning, and an output that never closes the block is all reasoning.
- `qwen3`: the block is in the output: `<think>` at its start (after any whitespace) opens it; an output
  without it is all answer. A prompt that ends inside an opened block (`started_in_prompt`) starts inside.
In both, whitespace right after the closing tag is not part of the answer; the reasoning is kept as written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReasoningStyle:
    """The tags of one reasoning format, and whether its outputs start inside the think block."""

    open: str
    close: str
    starts_inside: bool


STYLES: dict[str, ReasoningStyle] = {
    "deepseek-r1": ReasoningStyle(open="<think>", close="</think>", starts_inside=True),
    "qwen3": ReasoningStyle(open="<think>", close="</think>", starts_inside=False),
}
REASONING_PARSERS = tuple(STYLES)
# OpenAI's `reasoning_effort` as a budget of output tokens in the think block (docs/server.md)
EFFORT_BUDGETS = {"low": 256, "medium": 1024, "high": 4096}


@dataclass(frozen=True)
class ThinkBudget:
    """A request's reasoning budget (`SamplingParams.reasoning_budget`): once `tokens` output tokens were
    generated and the think block of `style` is still open, the scheduler forces its closing tag
    (constrained/reasoning_budget.py)."""

    tokens: int
    style: str
    started_in_prompt: bool = False


_START, _OPENING, _INSIDE, _AFTER_CLOSE, _ANSWER = "start", "opening", "inside", "after_close", "answer"


def style_of(style: str) -> ReasoningStyle:
    """The style's tags; ValueError naming the known styles for an unknown one."""
    try:
        return STYLES[style]
    except KeyError:
        raise ValueError(f"unknown reasoning style {style!r}; known: {', '.join(STYLES)}") from None


class ReasoningParser:
    """Splits one sequence's streamed text into reasoning and answer (see the module docstring)."""

    def __init__(self, style: str, *, started_in_prompt: bool = False) -> None:
        self.style = style_of(style)
        inside = self.style.starts_inside or started_in_prompt
        # NOTE: states: start (qwen3: may a block open here?), opening (inside, an opening tag may still come
        # and is dropped), inside, after_close (whitespace after the close is dropped), answer.
        self._state = _OPENING if inside else _START
        self._held = ""  # text not yet handed out: a possible tag cut short, or whitespace
        self.saw_reasoning = inside  # a think block was (or is being) read
        self.closed = False  # its closing tag was read

    @property
    def in_reasoning(self) -> bool:
        """Whether text fed now would be reasoning (the block is open, or may open at the start)."""
        return self._state in (_OPENING, _INSIDE)

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning_delta, answer_delta) for the next piece of text; either may be empty."""
        text = self._held + delta
        self._held = ""
        reasoning, answer = [], []
        while text:
            text = self._step(text, reasoning, answer)
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """What was held back: a cut-short tag was never a tag, so it goes to the side it was read on."""
        held, self._held = self._held, ""
        if self._state in (_OPENING, _INSIDE):
            return held, ""
        if self._state == _AFTER_CLOSE:
            return "", ""  # NOTE: only whitespace is held after the close, and it is not part of the answer
        return "", held

    # ------------------------------------------------------------------ states

    def _step(self, text: str, reasoning: list[str], answer: list[str]) -> str:
        """Consumes some of `text` (or holds it all in `_held`); returns the rest."""
        style = self.style
        if self._state == _START:
            body = text.lstrip()
            if body.startswith(style.open):
                self._state, self.saw_reasoning = _INSIDE, True
                return body[len(style.open):]  # NOTE: the whitespace before the opening tag is dropped
            if not body or style.open.startswith(body):
                self._held = text  # whitespace so far, or the opening tag cut short
                return ""
            self._state = _ANSWER
            return text
        if self._state == _OPENING:
            body = text.lstrip()
            if body.startswith(style.open):
                self._state = _INSIDE
                return body[len(style.open):]  # NOTE: the block was open already: the tag is dropped
            if not body or style.open.startswith(body):
                self._held = text
                return ""
            self._state = _INSIDE
            return text
        if self._state == _INSIDE:
            at = text.find(style.close)
            if at >= 0:
                reasoning.append(text[:at])
                self._state, self.closed = _AFTER_CLOSE, True
                return text[at + len(style.close):]
            keep = _partial_suffix(text, style.close)
            reasoning.append(text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            return ""
        if self._state == _AFTER_CLOSE:
            body = text.lstrip()
            if not body:
                self._held = text
                return ""
            self._state = _ANSWER
            return body
        answer.append(text)
        return ""


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of `text` are a proper prefix of `tag` (the tag may be cut there)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse(style: str, text: str, started_in_prompt: bool = False) -> tuple[str | None, str]:
    """(reasoning, answer) of a whole text; reasoning is None when it had no think block."""
    parser = ReasoningParser(style, started_in_prompt=started_in_prompt)
    r1, a1 = parser.feed(text)
    r2, a2 = parser.finish()
    return (r1 + r2 if parser.saw_reasoning else None), a1 + a2


def prompt_opens_think(style: str, prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an opened think block: its last opening tag comes after its
    last closing tag (a template that writes `<think>` at the start of the assistant turn)."""
    tags = style_of(style)
    opened = prompt_text.rfind(tags.open)
    return opened >= 0 and opened > prompt_text.rfind(tags.close)


def closing_tag(style: str) -> str:
    """The text that ends the style's think block."""
    return style_of(style).close


def closing_tag_ids(style: str, tokenizer: Any) -> list[int]:
    """The token ids of the closing tag as the tokenizer writes it on its own (one id where the tag is a token
    of the vocabulary, as in Qwen3 and DeepSeek-R1; several in a vocabulary without it)."""
    return list(tokenizer.encode(closing_tag(style), add_special_tokens=False))
