"""The reasoning parser (function_call/reasoning.py) and its chat shaping (entrypoints/chat_reasoning.py):
every style over texts with and without tags; each text split into stream deltas at every character boundary
(all 2-splits, all 3-splits of the short texts, random splits by hypothesis) gives what the whole-text parse
gives, and no delta ever sends a tag, or text of one side, to the other; `--reasoning-parser` is validated."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.constrained.reasoning_budget import ReasoningBudgets
from radixserve.entrypoints.chat_reasoning import (
    ReasoningPlan,
    StreamedReasoning,
    add_reasoning_usage,
    plan_reasoning,
    reasoning_tokens,
    without_reasoning,
)
from radixserve.function_call.reasoning import (
    REASONING_PARSERS,
    STYLES,
    ReasoningParser,
    ThinkBudget,
    closing_tag,
    closing_tag_ids,
    parse,
    prompt_opens_think,
)
from radixserve.sampling_params import SamplingParams, SamplingParamsError
from radixserve.server_args import ServerArgs

# (style, started_in_prompt, text, reasoning, answer)
CASES = [
    ("qwen3", False, "<think>plan it</think>\n\nThe answer.", "plan it", "The answer."),
    ("qwen3", False, "  \n<think>a</think>b", "a", "b"),
    ("qwen3", False, "No thinking here.", None, "No thinking here."),
    ("qwen3", False, "  leading space kept", None, "  leading space kept"),
    ("qwen3", False, "answer then <think>not a block</think>", None, "answer then <think>not a block</think>"),
    ("qwen3", False, "<think>cut short, never closed", "cut short, never closed", ""),
    ("qwen3", False, "<think>x</thi", "x</thi", ""),
    ("qwen3", False, "<thin", None, "<thin"),
    ("qwen3", False, "<think></think>", "", ""),
    ("qwen3", False, "<think>a < b and </ > too</think>ok", "a < b and </ > too", "ok"),
    ("qwen3", False, "<think>one</think>two</think>", "one", "two</think>"),
    ("qwen3", False, "", None, ""),
    ("qwen3", True, "thought in the prompt's block</think> answer", "thought in the prompt's block", "answer"),
    ("qwen3", True, "no close at all", "no close at all", ""),
    ("deepseek-r1", False, "step 1, step 2</think>\n\nDone.", "step 1, step 2", "Done."),
    ("deepseek-r1", False, "<think>tagged anyway</think>Done.", "tagged anyway", "Done."),
    ("deepseek-r1", False, "\n<think>\nx\n</think>\n\nDone.", "\nx\n", "Done."),
    ("deepseek-r1", False, "never closed <think>", "never closed <think>", ""),
    ("deepseek-r1", False, "<thin", "<thin", ""),
    ("deepseek-r1", False, "</think>", "", ""),
    ("deepseek-r1", False, "</think>   ", "", ""),
    ("deepseek-r1", False, "", "", ""),
    ("deepseek-r1", True, "r</think>a", "r", "a"),
]


def _stream(style: str, started: bool, pieces: list[str]) -> tuple[str, str, bool]:
    """Feeds the pieces one by one; checks every delta is a piece of the whole answer's side."""
    parser = ReasoningParser(style, started_in_prompt=started)
    reasoning, answer = [], []
    for piece in pieces:
        r, a = parser.feed(piece)
        reasoning.append(r)
        answer.append(a)
    r, a = parser.finish()
    return "".join(reasoning) + r, "".join(answer) + a, parser.saw_reasoning


@pytest.mark.parametrize(("style", "started", "text", "reasoning", "answer"), CASES)
def test_whole_text_parse(style: str, started: bool, text: str, reasoning: str | None, answer: str) -> None:
    assert parse(style, text, started) == (reasoning, answer)


@pytest.mark.parametrize(("style", "started", "text", "reasoning", "answer"), CASES)
def test_every_two_and_three_way_split_matches_the_whole_parse(style: str, started: bool, text: str,
                                                               reasoning: str | None, answer: str) -> None:
    whole = (reasoning or "", answer, reasoning is not None)
    for i in range(len(text) + 1):
        assert _stream(style, started, [text[:i], text[i:]]) == whole, i
    step = 1 if len(text) <= 40 else 3  # NOTE: every 3-split of the short texts, a third of the long ones'
    for i, j in itertools.combinations_with_replacement(range(0, len(text) + 1, step), 2):
        assert _stream(style, started, [text[:i], text[i:j], text[j:]]) == whole, (i, j)


@pytest.mark.parametrize("style", REASONING_PARSERS)
def test_one_character_deltas_never_show_a_tag(style: str) -> None:
    text = "<think>abc</think>\n\nxyz"
    parser = ReasoningParser(style)
    for ch in text:
        r, a = parser.feed(ch)
        assert "<" not in r + a and ">" not in r + a  # NOTE: a tag piece is held, then dropped whole
    assert parser.finish() == ("", "")


_ALPHABET = st.sampled_from(["<think>", "</think>", "<", "</", "<th", "think", ">", "/", "a", "b c", " ", "\n"])


@settings(max_examples=300, deadline=None)
@given(style=st.sampled_from(REASONING_PARSERS), started=st.booleans(), parts=st.lists(_ALPHABET, max_size=12),
       cuts=st.lists(st.integers(0, 80), max_size=6))
def test_random_texts_split_anywhere_match_the_whole_parse(style: str, started: bool, parts: list[str],
                                                           cuts: list[int]) -> None:
    text = "".join(parts)
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    reasoning, answer = parse(style, text, started)
    assert _stream(style, started, pieces) == (reasoning or "", answer, reasoning is not None)
    if reasoning is None:  # NOTE: no block: the text is the answer, unchanged
        assert answer == text


def test_prompt_opens_think() -> None:
    assert prompt_opens_think("qwen3", "<|im_start|>assistant\n<think>\n")
    assert prompt_opens_think("qwen3", "<|im_start|>assistant\n<think>\nI started")
    assert not prompt_opens_think("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_think("qwen3", "<|im_start|>assistant\n")
    assert prompt_opens_think("deepseek-r1", "<｜Assistant｜><think>\n")


def test_closing_tag_and_its_ids() -> None:
    class CharTokenizer:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) for c in text]

    for style in STYLES:
        assert closing_tag(style) == "</think>"
        assert closing_tag_ids(style, CharTokenizer()) == [ord(c) for c in "</think>"]
    with pytest.raises(ValueError, match="known: deepseek-r1, qwen3"):
        closing_tag("gpt-oss")
    with pytest.raises(ValueError, match="unknown reasoning style"):
        ReasoningParser("nope")


def test_reasoning_parser_flag_is_validated() -> None:
    assert ServerArgs().reasoning_parser is None
    assert ServerArgs(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="reasoning_parser='r1' is not one of deepseek-r1, qwen3"):
        ServerArgs(reasoning_parser="r1")
    import argparse

    cli = argparse.ArgumentParser()
    ServerArgs.add_cli_args(cli)
    assert ServerArgs.from_cli_args(cli.parse_args(["--reasoning-parser", "deepseek-r1"])).reasoning_parser == \
        "deepseek-r1"
    with pytest.raises(SystemExit):
        cli.parse_args(["--reasoning-parser", "bogus"])


class _CharTokenizer:
    """One token per character: decode is join."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def test_plan_follows_flag_request_grammar_and_prompt() -> None:
    from types import SimpleNamespace

    from radixserve.entrypoints.openai_protocol import ChatCompletionRequest

    tok = _CharTokenizer()
    ids = [ord(c) for c in "user: hi\nassistant: <think>\n"]

    def req(**fields: Any) -> ChatCompletionRequest:
        return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)

    assert plan_reasoning(None, req(), None, tok, ids) is None
    assert plan_reasoning("qwen3", req(separate_reasoning=False), None, tok, ids) is None
    assert plan_reasoning("qwen3", req(), None, tok, ids) == ReasoningPlan("qwen3", True)
    assert plan_reasoning("qwen3", req(), None, tok, ids[:-8]) == ReasoningPlan("qwen3", False)
    # a grammar that writes the output from its first token leaves no room for a block: no split
    assert plan_reasoning("deepseek-r1", req(response_format={"type": "json_object"}), None, tok, ids) is None
    for choice, split in (("required", False), ("named", False), ("auto", True), ("none", True)):
        planned = plan_reasoning("deepseek-r1", req(), SimpleNamespace(choice=choice), tok, ids)
        assert (planned is not None) == split, choice
    tag = {"type": "structural_tag", "format": {"type": "regex", "pattern": "<think>a</think>b"}}
    assert plan_reasoning("deepseek-r1", req(response_format=tag), None, tok, ids) is not None


@pytest.mark.parametrize(("text", "tokens"), [("<think>ab</think>\n\ncd", 17), ("plain", 0), ("<think>ab", 9)])
def test_reasoning_tokens_count_up_to_the_closing_tag(text: str, tokens: int) -> None:
    ids = [ord(c) for c in text]
    assert reasoning_tokens(ReasoningPlan("qwen3", False), _CharTokenizer(), ids, text) == tokens


def test_streamed_reasoning_reassembles_and_counts() -> None:
    text = "<think>ab</think>\n\ncd"
    streamed = StreamedReasoning(ReasoningPlan("qwen3", False), _CharTokenizer())
    pieces = [streamed.delta(0, ch, [ord(ch)], i == len(text) - 1) for i, ch in enumerate(text)]
    assert "".join(r for r, _ in pieces) == "ab" and "".join(a for _, a in pieces) == "cd"
    assert streamed.tokens == {0: 17}
    assert add_reasoning_usage({"usage": {"completion_tokens": 21}}, 17) == {
        "usage": {"completion_tokens": 21, "completion_tokens_details": {"reasoning_tokens": 17}}}
    assert add_reasoning_usage({"usage": None}, 3) == {"usage": None}
    spec = {"choices": {"__all__": {"delta": {"function_call"}}}}
    assert without_reasoning(spec, "delta") == {"choices": {"__all__": {"delta": {"function_call",
                                                                                  "reasoning_content"}}}}


class _Req:
    """What ReasoningBudgets reads of a scheduler Req."""

    def __init__(self, output: str, budget: ThinkBudget, max_new_tokens: int = 100, grammar: Any = None) -> None:
        self.output_ids = [ord(c) for c in output]
        self.sampling_params = SamplingParams(max_new_tokens=max_new_tokens, reasoning_budget=budget)
        self.max_new_tokens = max_new_tokens
        self.grammar = grammar
        self.to_abort = None

    def finished(self) -> bool:
        return False


class _CharCodec(_CharTokenizer):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


_CLOSE = [ord(c) for c in "</think>"]


def test_a_spent_budget_forces_the_closing_tag_once() -> None:
    budgets = ReasoningBudgets(_CharCodec())
    r1 = ThinkBudget(5, "deepseek-r1")
    early = _Req("abcd", r1)
    assert budgets.forced_tokens(early) == []  # NOTE: under budget: nothing, and not decided yet
    early.output_ids.append(ord("e"))
    assert budgets.forced_tokens(early) == _CLOSE
    early.output_ids += _CLOSE + [ord("x")]
    assert budgets.forced_tokens(early) == []  # decided once
    assert budgets.forced_tokens(_Req("ab</think>c", r1)) == []  # closed by the model itself
    qwen = ThinkBudget(5, "qwen3")
    assert budgets.forced_tokens(_Req("no block here", qwen)) == []
    assert budgets.forced_tokens(_Req(" <think>abc", qwen)) == _CLOSE
    assert budgets.forced_tokens(_Req("abcdef", ThinkBudget(5, "qwen3", started_in_prompt=True))) == _CLOSE
    assert budgets.forced_tokens(_Req("abcdef", r1, max_new_tokens=14)) == []  # no room for tag + one token
    assert budgets.forced_tokens(_Req("abcdef", r1, max_new_tokens=15)) == _CLOSE
    assert budgets.forced_closes == 4


def test_a_budget_forces_only_what_the_grammar_accepts() -> None:
    class Matcher:
        def __init__(self, accepts: int) -> None:
            self.accepts, self.accepted, self.rolled_back = accepts, 0, 0

        def accept_token(self, token: int) -> bool:
            if self.accepted < self.accepts:
                self.accepted += 1
                return True
            return False

        def rollback(self, n: int) -> None:
            self.rolled_back += n

    class Grammar:
        def __init__(self, accepts: int) -> None:
            self.matcher = Matcher(accepts)

    budgets = ReasoningBudgets(_CharCodec())
    refusing = Grammar(3)
    assert budgets.forced_tokens(_Req("abcdef", ThinkBudget(5, "deepseek-r1"), grammar=refusing)) == []
    assert refusing.matcher.rolled_back == 3
    accepting = Grammar(100)
    assert budgets.forced_tokens(_Req("abcdef", ThinkBudget(5, "deepseek-r1"), grammar=accepting)) == _CLOSE
    assert accepting.matcher.accepted == len(_CLOSE) and accepting.matcher.rolled_back == 0


def test_the_budget_sampling_parameter_is_checked() -> None:
    assert SamplingParams(reasoning_budget={"tokens": 3, "style": "qwen3"}).reasoning_budget == ThinkBudget(3, "qwen3")
    for bad in ({"tokens": 0, "style": "qwen3"}, {"tokens": 3, "style": "r1"}, {"tokens": 3, "styles": "qwen3"}, 7):
        with pytest.raises(SamplingParamsError, match="reasoning_budget"):
            SamplingParams(reasoning_budget=bad)


def test_tool_calls_are_read_from_the_answer_only() -> None:
    """A call written inside the think block is reasoning; the one after it is the answer's call, whole and
    streamed (the chat route's order: the reasoning split first, then the tool-call parser on the answer)."""
    from radixserve.entrypoints.chat_reasoning import whole_fields
    from radixserve.function_call.answer import StreamedCalls, whole_message
    from radixserve.function_call.chat_tools import plan_tools
    from radixserve.function_call.formats import FORMATS

    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
    plan = plan_tools(FORMATS["hermes"], [tool], "auto", True)
    inner = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    outer = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    text = f"<think>maybe {inner}</think>\n\n{outer}"
    thinking = ReasoningPlan("qwen3", False)
    reasoning, answer = whole_fields(thinking, text)
    assert reasoning == f"maybe {inner}"
    message, reason = whole_message(plan, answer, "stop")
    assert reason == "tool_calls" and [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        {"a": 2}]
    streamed, calls = StreamedReasoning(thinking, _CharTokenizer()), StreamedCalls(plan)
    thought, args = "", ""
    for i, ch in enumerate(text):
        r, a = streamed.delta(0, ch, [ord(ch)], i == len(text) - 1)
        delta, _ = calls.delta(0, a, "stop" if i == len(text) - 1 else None)
        thought += r
        args += "".join(p["function"].get("arguments") or "" for p in delta["tool_calls"] or [])
    assert thought == reasoning and json.loads(args) == {"a": 2}
