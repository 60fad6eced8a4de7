"""Tool calls without a server (function_call/): the streaming parser, the formats' grammars and the prompt.

Any split of a model's text into stream deltas gives the same content and calls as the whole text at once,
and the calls' arguments are the model's own JSON text; each format's grammar (compiled by xgrammar on the
default model's tokenizer) accepts the very text that format's parser reads and refuses a wrong name or
argument; the chat template is chosen and fed as each family expects."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.function_call.chat_tools import ToolError, plan_tools, template_messages
from radixserve.function_call.formats import FORMATS, SMOLLM2, choose_format
from radixserve.function_call.parser import ToolCallParser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}


def parse(fmt: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[tuple[str, str]]]:
    """Content and calls as a stream client reassembles them, and the parser's own final calls."""
    parser = ToolCallParser(FORMATS[fmt])
    content, calls = "", {}
    for out in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += out.content
        for piece in out.calls:
            call = calls.setdefault(piece.index, {"name": None, "arguments": ""})
            call["name"] = piece.name or call["name"]
            call["arguments"] += piece.arguments
    return content, [(c["name"], c["arguments"]) for c in calls.values()], [(c.name, c.arguments) for c in
                                                                           parser.calls]


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                  max_size=3), max_leaves=8)
_args = st.dictionaries(st.text(alphabet="abcxyz_", min_size=1, max_size=6), _json, max_size=4)
_calls = st.lists(st.tuples(st.sampled_from(["get_weather", "add", "f.x-1"]), _args), min_size=0, max_size=3)


@settings(max_examples=150, deadline=None)
@given(fmt=st.sampled_from(sorted(FORMATS)), before=st.text(alphabet="ab <{}[]\n_.", max_size=12), calls=_calls,
       cuts=st.lists(st.integers(0, 400), max_size=12), spacing=st.sampled_from(["", " ", "\n  "]))
def test_any_split_of_the_stream_gives_the_whole_texts_content_and_calls(fmt, before, calls, cuts, spacing):
    f = FORMATS[fmt]
    written = [(name, json.dumps(args, separators=(",", ":") if spacing else (", ", ": "))) for name, args in calls]
    text = before + spacing + f.render_calls(written)
    whole = parse(fmt, [text])
    assert parse(fmt, split(text, cuts)) == whole
    if calls and f.trigger not in before and "<|python_tag|>" not in before:
        content, streamed, final = whole
        assert streamed == final == written  # the arguments are the model's own text, name for name
        assert content == before.rstrip()


def test_calls_written_another_way_come_whole_and_text_that_is_no_call_stays_content():
    hermes = '<tool_call>\n{"arguments": {"a": 1}, "name": "add"}\n</tool_call>'
    assert parse("hermes", [hermes[:20], hermes[20:]])[1] == [("add", '{"a": 1}')]
    llama = 'I think {"x": 1} is {"name": 2} fine'
    assert parse("llama3", [llama]) == (llama, [], [])
    mistral = '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": "f", "arguments": {}}]'
    assert parse("mistral", list(mistral))[1] == [("add", '{"a": 1}'), ("f", "{}")]
    cut = 'Sure. <tool_call>[{"name": "add", "arguments": {"a": 1'  # max_tokens ran out inside the arguments
    assert parse("smollm2", list(cut)) == ("Sure.", [("add", '{"a": 1')], [("add", '{"a": 1')])


@pytest.fixture(scope="module")
def backend():
    import torch

    from radixserve.constrained.grammar_backend import GrammarBackend, GrammarSpec
    from radixserve.model_loader.gguf_loader import gguf_to_hf_folder
    from radixserve.model_loader.model_folder import load_tokenizer
    from radixserve.models.loader import embedded_model_path

    tokenizer = load_tokenizer(gguf_to_hf_folder(embedded_model_path(), torch.float32))
    grammars = GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    return lambda source: grammars.matcher(grammars.submit(GrammarSpec("structural_tag", source)).result(60))


def _whole(matcher, text: str) -> bool:
    """The grammar takes `text` and may end right after it (the stop token)."""
    return matcher.matcher.accept_string(text) and matcher.matcher.accept_token(EOS) and matcher.is_terminated()


EOS = 2  # SmolLM2's <|im_end|>


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_formats_grammar_accepts_its_own_calls_and_refuses_wrong_ones(backend, fmt):
    f = FORMATS[fmt]
    good = f.render_calls([("get_weather", '{"city": "Paris", "unit": "celsius"}')])
    two = f.render_calls([("get_weather", '{"city": "Rome", "unit": "fahrenheit"}'), ("add", '{"a": 1, "b": 2}')])
    cases = {  # (choice, parallel) -> texts accepted in full, texts refused
        ("required", False): ([good], [two, "Hello " + good, good.replace("celsius", "kelvin")]),
        ("required", True): ([good, two], ["Hello", good.replace('"Paris"', "3")]),
        ("auto", True): ([good, "No call needed.", "Let me look. " + good], [good.replace("get_weather", "rain")]),
    }
    for (choice, parallel), (accepted, refused) in cases.items():
        plan = plan_tools(f, [WEATHER, ADD], choice, parallel)
        source = plan.grammar()["structural_tag"]
        for text in accepted:
            assert _whole(backend(source), text), (choice, text)
        for text in refused:
            assert not _whole(backend(source), text), (choice, text)
    named = plan_tools(f, [WEATHER, ADD], {"type": "function", "function": {"name": "add"}}, True)
    source = named.grammar()["structural_tag"]
    assert _whole(backend(source), f.render_calls([("add", '{"a": 1, "b": 2}')]))
    assert not _whole(backend(source), good)


def test_the_tool_choice_is_checked():
    with pytest.raises(ToolError, match="needs 'tools'"):
        plan_tools(SMOLLM2, None, "required", True)
    with pytest.raises(ToolError, match="not in 'tools'"):
        plan_tools(SMOLLM2, [WEATHER], {"type": "function", "function": {"name": "add"}}, True)
    with pytest.raises(ToolError, match="same name"):
        plan_tools(SMOLLM2, [WEATHER, WEATHER], "auto", True)
    with pytest.raises(ToolError, match="1-64 letters"):
        plan_tools(SMOLLM2, [{"type": "function", "function": {"name": "a b"}}], "auto", True)
    assert plan_tools(SMOLLM2, None, "none", True) is None and plan_tools(SMOLLM2, [WEATHER], None, True).choice == "auto"


QWEN_LIKE = "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}... <tool_call> ..."
LLAMA_LIKE = '{% if tools %}{{ tools }} respond as {"name": function name, "parameters": ...} <|python_tag|>{% endif %}'


def test_the_format_follows_the_chat_template_or_the_flag():
    assert choose_format("auto", "{{ messages }}").name == "smollm2"  # no tools in the template: ours
    assert choose_format("auto", QWEN_LIKE).name == "hermes" and choose_format("auto", QWEN_LIKE).native_in_template
    assert choose_format("auto", LLAMA_LIKE).name == "llama3"
    assert choose_format("auto", "{% if tools %}[TOOL_CALLS]{% endif %}").name == "mistral"
    forced = choose_format("qwen25", "{{ messages }}")  # a family's format, on a template that knows no tools
    assert forced.name == "hermes" and not forced.native_in_template


def test_the_history_renders_the_calls_as_generated_and_the_tools_in_the_system_message():
    from radixserve.entrypoints.openai_protocol import ChatMessage

    args = '{"city": "Paris","unit": "celsius"}'  # as the model wrote it, spacing and all
    chat = [ChatMessage.model_validate(m) for m in (
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"})]
    plan = plan_tools(SMOLLM2, [WEATHER], "auto", True)
    ours = template_messages(chat, SMOLLM2, plan)
    assert ours[0]["role"] == "system" and '"get_weather"' in ours[0]["content"] and "<tools>" in ours[0]["content"]
    assert ours[2]["content"] == SMOLLM2.call_begin("get_weather") + args + SMOLLM2.call_end()
    assert ours[3] == {"role": "tool", "content": "<tool_response>\n22 C\n</tool_response>"}
    native = template_messages(chat, FORMATS["hermes"], plan)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}
    assert native[2]["tool_call_id"] == "call_1" and native[0]["role"] == "user"  # the template places the tools


def test_a_trigger_that_is_a_special_token_reaches_the_parser():
    """Mistral's tokenizers hold `[TOOL_CALLS]` as one special token, and xgrammar lets the model write it (its
    text is the trigger). Decoded without special tokens the call would read as content; a tool request on
    such a tokenizer is decoded with them (formats.trigger_is_special), and the parser finds the call, whether
    the model wrote the special token or spelled the trigger in ordinary tokens."""
    import copy

    import torch

    from radixserve.client.text_stream import IncrementalDetokenizer
    from radixserve.constrained.grammar_backend import GrammarBackend, GrammarSpec
    from radixserve.function_call.formats import trigger_is_special
    from radixserve.model_loader.gguf_loader import gguf_to_hf_folder
    from radixserve.model_loader.model_folder import load_tokenizer
    from radixserve.models.loader import embedded_model_path

    plain = load_tokenizer(gguf_to_hf_folder(embedded_model_path(), torch.float32))
    assert not any(trigger_is_special(f, plain) for f in FORMATS.values())
    tokenizer = copy.deepcopy(plain)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    special = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    fmt = FORMATS["mistral"]
    assert trigger_is_special(fmt, tokenizer) and not trigger_is_special(FORMATS["hermes"], tokenizer)
    grammars = GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiled = grammars.submit(GrammarSpec("structural_tag", plan_tools(fmt, [WEATHER], "auto", True)
                                           .grammar()["structural_tag"])).result(60)
    text = fmt.render_calls([("get_weather", '{"city": "Paris", "unit": "celsius"}')])
    as_special = tokenizer.encode(text, add_special_tokens=False)
    spelled = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert as_special[0] == special and special not in spelled
    for ids in (as_special, spelled):
        matcher = grammars.matcher(compiled)
        for token in ids:
            matcher.accept_token(token)
        assert not matcher.rejected
        for skip, found in ((True, ids is spelled), (False, True)):
            detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
            pieces = [detok.feed([t]) for t in ids] + [detok.finish([], None)]
            calls = parse("mistral", pieces)[1]
            assert (calls == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]) == found, (skip, ids)


_ids = st.sampled_from(["call_1", "call_2", "x"])
_names = st.sampled_from(["get_weather", "add", "other"])
_arguments = st.sampled_from(['{"city": "Paris"}', "{}", '{"a', "[1]", "3", "", '{"a": {"b": [1, 2]}}'])
_call_dicts = st.fixed_dictionaries({"id": _ids, "function": st.fixed_dictionaries({"name": _names,
                                                                                     "arguments": _arguments})})
_messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "function"])},
    optional={"content": st.sampled_from(["hi", None]), "name": _names, "tool_call_id": _ids,
              "tool_calls": st.lists(_call_dicts, min_size=1, max_size=3),
              "function_call": st.fixed_dictionaries({"name": _names, "arguments": _arguments})})


@settings(max_examples=400, deadline=None)
@given(chat=st.lists(_messages, min_size=1, max_size=7),
       declared=st.none() | st.sets(_names, max_size=2))
def test_any_history_is_served_or_refused_with_a_400_naming_its_field(chat, declared):
    """A history either passes, with every tool (or legacy function) answer tied to a call of the assistant
    turn before it and every call's arguments a JSON object, or is a 400 naming a field of one message."""
    from radixserve.entrypoints.chat_history import check_history
    from radixserve.entrypoints.http_errors import ApiError
    from radixserve.entrypoints.openai_protocol import ChatMessage

    messages = [ChatMessage.model_validate(m) for m in chat]
    try:
        checked = check_history(messages, declared)
    except ApiError as e:
        assert e.status == 400 and e.param.startswith("messages.") and e.param in e.message, e.message
        index = int(e.param.split(".")[1])
        assert 0 <= index < len(chat)
        return
    assert len(checked) == len(chat)
    open_calls: dict[str, str] = {}
    for m in checked:
        assert m.role != "function" and m.function_call is None
        if m.role == "tool":
            assert m.tool_call_id in open_calls
            continue
        open_calls = {c.id: c.function.name for c in m.tool_calls or []}
        assert (m.role == "assistant") or not open_calls
        for c in m.tool_calls or []:
            assert isinstance(json.loads(c.function.arguments), dict)
            assert declared is None or c.function.name in declared
