"""A chat request's tools: checked, written into the prompt, and turned into the grammar that enforces calls.

`tool_choice` `required` and a named function are enforced from the first token (the answer is the call(s)
and nothing else); `auto` lets the model write text and constrains a call once it begins one (its trigger);
`none` parses nothing. Arguments always match the function's `parameters` schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from radixserve.function_call.formats import ToolCallFormat

_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its prompt, its grammar and its answer."""

    fmt: ToolCallFormat
    tools: tuple[dict[str, Any], ...]  # OpenAI's shape: {"type": "function", "function": {...}}
    choice: str  # none | auto | required | named
    named: str | None = None  # the function of a named choice
    parallel: bool = True
    legacy: bool = False  # from the legacy `functions` / `function_call`: answered as `function_call`

    @property
    def names(self) -> frozenset[str]:
        """The declared functions' names."""
        return frozenset(t["function"]["name"] for t in self.tools)

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def grammar(self, answer_schema: dict[str, Any] | None = None) -> dict[str, str]:
        """The `structural_tag` sampling parameter that enforces this choice; with `answer_schema` (an `auto`
        request that also has a JSON response_format), the answer is either that JSON or calls."""
        if self.choice == "none":
            return {}
        functions = [t["function"] for t in self.tools]
        if self.choice == "named":
            functions = [f for f in functions if f["name"] == self.named]
        tags = [{"type": "tag", "begin": self.fmt.call_begin(f["name"]),
                 # NOTE: one whitespace character at most between tokens: a small model given free whitespace
                 # may write newlines until max_tokens
                 "content": {"type": "json_schema", "json_schema": f.get("parameters") or _ANY_OBJECT,
                             "max_whitespace_cnt": 1},
                 "end": self.fmt.call_end()} for f in functions]
        stop_after_first = not self.parallel or self.choice == "named"
        if self.choice == "auto" and answer_schema is None:
            body: dict[str, Any] = {"type": "triggered_tags", "triggers": [self.fmt.trigger], "tags": tags,
                                    "stop_after_first": stop_after_first}
        else:
            body = {"type": "tags_with_separator", "tags": tags, "separator": self.fmt.separator,
                    "at_least_one": True, "stop_after_first": stop_after_first}
            if answer_schema is not None:
                body = {"type": "or", "elements": [{"type": "json_schema", "json_schema": answer_schema}, body]}
        return {"structural_tag": json.dumps({"type": "structural_tag", "format": body})}


class ToolError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolFields:
    """What a request calls its tool fields, for the errors: OpenAI's, or the legacy ones (function_call/legacy.py)."""

    tools: str = "tools"
    choice: str = "tool_choice"
    name: str = "tools.{i}.function.name"  # the path of the i-th tool's name


def plan_tools(fmt: ToolCallFormat, tools: list[Any] | None, tool_choice: Any, parallel: bool,
               fields: ToolFields = ToolFields()) -> ToolPlan | None:
    """Checks `tools` and `tool_choice` (pydantic models or dicts); None when the request has no tools."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError(f"'{fields.choice}' needs '{fields.tools}'", fields.choice)
        return None
    specs = tuple(_dump(t) for t in tools)
    names = [t["function"]["name"] for t in specs]
    for i, name in enumerate(names):
        if not name or len(name) > 64 or not all(c.isalnum() or c in "_-." for c in name):
            param = fields.name.format(i=i)
            raise ToolError(f"'{param}': function name {name!r} must be 1-64 letters, digits, '_', '-' or '.'",
                            param)
    if len(set(names)) != len(names):
        raise ToolError(f"two entries of '{fields.tools}' have the same name", fields.tools)
    choice = _dump(tool_choice) if tool_choice is not None else "auto"
    if isinstance(choice, dict):
        named = choice["function"]["name"]
        if named not in names:
            raise ToolError(f"'{fields.choice}' names the function {named!r}, which is not in '{fields.tools}'",
                            fields.choice)
        return ToolPlan(fmt, specs, "named", named, parallel)
    return ToolPlan(fmt, specs, choice, None, parallel)


def template_messages(chat: list[Any], fmt: ToolCallFormat, plan: ToolPlan | None) -> list[dict[str, Any]]:
    """The chat as the template takes it. A template that renders tools gets OpenAI's fields (the calls'
    arguments as objects); for one that does not, the earlier calls are written in the format's own text and
    the tools go into the system message, so the history renders the same every turn (and stays cached)."""
    native = fmt.native_in_template
    messages = []
    for m in chat:
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            if native:
                message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
            else:
                calls = fmt.render_calls([(c.function.name, c.function.arguments) for c in m.tool_calls])
                message["content"] = "\n".join(filter(None, (message["content"], calls)))
        if m.role == "tool":
            if native:
                message["tool_call_id"] = m.tool_call_id
            else:
                message["content"] = f"<tool_response>\n{message['content']}\n</tool_response>"
        messages.append(message)
    if plan is not None and not native:
        prompt = tools_prompt(fmt, plan.tools)
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages


def template_tools(fmt: ToolCallFormat, plan: ToolPlan | None) -> list[dict[str, Any]] | None:
    """The `tools` argument of the chat template: the tools for a template that renders them, else None (they
    are in the system message; template_messages)."""
    return [dict(t) for t in plan.tools] if plan is not None and fmt.native_in_template else None


def tools_prompt(fmt: ToolCallFormat, tools: tuple[dict[str, Any], ...]) -> str:
    """The system text that offers tools to a model whose template has no place for them."""
    functions = json.dumps([t["function"] for t in tools])
    example = fmt.render_calls([("<function name>", '{"<parameter>": "<value>"}')])
    return (f"You can call functions. These are the functions you may call, as JSON schemas:\n<tools>{functions}"
            f"</tools>\nTo call functions, answer with {example} and nothing else. When no call is needed, "
            "answer in plain text.")


def _dump(value: Any) -> Any:
    return value.model_dump(exclude_none=True) if hasattr(value, "model_dump") else value


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
