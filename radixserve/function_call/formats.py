"""The tool-call formats of the common model families, each as the strings around one call.

Every family writes a call as `open`, a JSON object `{"name": ..., "<arguments key>": {...}}` (some inside a
JSON list), then `close`. One description per family serves the grammar (what a call must look like: the
begin string fixes the name, the function's parameter schema constrains the arguments) and the parser (where
calls start and end in the text). `--tool-call-parser` picks one; `auto` reads the chat template.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    trigger: str  # free text runs until this; every call's text begins with it
    open: str  # what starts a call region (empty: the JSON object itself starts it)
    close: str  # what ends a call region (empty: the JSON value's end does)
    list_body: bool  # the calls of a region are a JSON list, not one object
    arguments_key: str  # "arguments", or Llama 3's "parameters"
    separator: str  # between two calls of a parallel answer
    native_in_template: bool  # True: the model's template renders tools; False: radixserve writes the prompt

    def call_begin(self, function: str) -> str:
        """The text of a call up to its arguments: the grammar's tag begin, so the name is fixed by then."""
        head = "{" + f'"name": {json.dumps(function)}, "{self.arguments_key}": '
        return self.open + ("[" if self.list_body else "") + head

    def call_end(self) -> str:
        return "}" + ("]" if self.list_body else "") + self.close

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        """An assistant turn's earlier calls (name, arguments as JSON text) as the model writes them.

        NOTE: the same strings as the grammar's (call_begin, the arguments as sent back, call_end), so a turn the
        model generated renders to the very text it generated, and the next turn finds all of it cached."""
        return self.separator.join(self.call_begin(name) + arguments + self.call_end() for name, arguments in calls)


HERMES = ToolCallFormat("hermes", "<tool_call>", "<tool_call>\n", "\n</tool_call>", False, "arguments", "\n", True)
LLAMA3 = ToolCallFormat("llama3", '{"name":', "", "", False, "parameters", "; ", True)
MISTRAL = ToolCallFormat("mistral", "[TOOL_CALLS]", "[TOOL_CALLS] ", "", True, "arguments", "", True)
# SmolLM2's own: a list of calls in one <tool_call> region. The default model's template knows no tools, so
# radixserve writes the tool prompt itself (chat_tools.py).
SMOLLM2 = ToolCallFormat("smollm2", "<tool_call>", "<tool_call>", "</tool_call>", True, "arguments", "\n", False)

FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, SMOLLM2)}
ALIASES = {"qwen25": "hermes", "qwen": "hermes", "llama3_json": "llama3", "llama": "llama3"}
TOOL_CALL_PARSERS = ("auto", *FORMATS, *ALIASES)


def trigger_is_special(fmt: ToolCallFormat, tokenizer: Any) -> bool:
    """Whether the tokenizer holds the format's trigger as one special token (Mistral's `[TOOL_CALLS]`).

    NOTE: then a tool request's text is decoded with its special tokens: xgrammar lets the model write that
    token (its text is the trigger), and text decoded without special tokens would hide the call from the
    parser."""
    ids = tokenizer.encode(fmt.trigger, add_special_tokens=False)
    return len(ids) == 1 and ids[0] in set(tokenizer.all_special_ids)


def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def choose_format(parser: str, chat_template: str | None) -> ToolCallFormat:
    """`--tool-call-parser`'s format; `auto`: the one the chat template writes, else SmolLM2's (with our prompt)."""
    if parser != "auto":
        chosen = FORMATS[ALIASES.get(parser, parser)]
        if chosen.native_in_template and not template_supports_tools(chat_template):
            return dataclasses.replace(chosen, native_in_template=False)
        return chosen
    template = chat_template or ""
    if not template_supports_tools(template):
        return SMOLLM2
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or '"parameters"' in template:
        return LLAMA3
    return HERMES
