"""The streaming tool-call parser: a model's text in, pieces of content and of `tool_calls` out.

One parser serves both answers: a non-streamed one is the same parser fed the whole text at once, so the
streamed deltas always reassemble to the non-streamed message. A call's arguments stream as the model's raw
JSON text once its header (`{"name": "...", "arguments": `) has been read; a call written some other way (keys
in another order) comes whole, when its object ends. Text that may be the start of a call is held back until
it is known not to be; whitespace between calls is not content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from radixserve.function_call.formats import ToolCallFormat

_HEADER = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_PYTHON_TAG = "<|python_tag|>"  # Llama 3's marker before a call; not part of the call


@dataclass
class CallDelta:
    """One piece of a call, as OpenAI streams it: the first piece has `id` and `name`, later ones argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str


@dataclass
class ParseOut:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class _JsonScanner:
    """Finds where one JSON value ends, a character at a time (strings and escapes respected)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False
        self.outside = False  # the value just ended before `ch` (a number, true, false, null): `ch` is not its

    def feed(self, ch: str) -> bool:
        """True when the value ends at `ch` (`outside`: just before it)."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                return self.depth == 0
            return False
        if not self.started and ch.isspace():
            return False
        self.started = True
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            if self.depth == 0:  # a number, true, false or null ended just before
                self.outside = True
                return True
            self.depth -= 1
            return self.depth == 0
        elif self.depth == 0 and ch in ", \n\t\r":
            self.outside = True
            return True
        return False


class ToolCallParser:
    """Feed text deltas in order (`feed`), then `finish()`; `calls` holds every call when done."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.calls: list[ParsedCall] = []
        self._pending = ""  # text not yet handed out
        self._state = "text"  # text | region | object | arguments | after_arguments
        self._spaces = ""  # whitespace held in text: content only when more text follows
        self._gap = ""  # the whitespace before the current region
        self._object = ""  # the current call object's text so far
        self._scanner = _JsonScanner()
        self._args: list[str] = []

    # ------------------------------------------------------------------ interface

    def feed(self, text: str) -> ParseOut:
        self._pending += text
        out = ParseOut()
        while self._step(out):
            pass
        return out

    def finish(self) -> ParseOut:
        """Everything still held: held text becomes content, and so does a call object cut short before its
        name was read; a call cut inside its arguments keeps what it has (already handed out).

        NOTE: the object and arguments states consume all they are fed, so only text and region hold any."""
        out = ParseOut()
        if self._state == "text":
            out.content += self._flush_spaces(self._pending, final=True)
        elif self._state == "object":
            out.content += self._gap + self._object  # never became a call: nothing is lost
        self._pending = ""
        return out

    # ------------------------------------------------------------------ states

    def _step(self, out: ParseOut) -> bool:
        if not self._pending:
            return False
        return getattr(self, f"_on_{self._state}")(out)

    def _on_text(self, out: ParseOut) -> bool:
        trigger = self.fmt.trigger
        at = self._pending.find(trigger)
        if at < 0:
            keep = _held_prefix(self._pending, (trigger, _PYTHON_TAG))
            if self._pending[:len(self._pending) - keep].endswith(_PYTHON_TAG):
                keep += len(_PYTHON_TAG)
            ready, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
            out.content += self._flush_spaces(ready)
            return False
        before = self._pending[:at]
        if before.endswith(_PYTHON_TAG):
            before = before[:-len(_PYTHON_TAG)]
        text = self._spaces + before
        body = text.rstrip()
        out.content += body
        self._gap, self._spaces = text[len(body):], ""  # the whitespace before a call is not content
        self._pending = self._pending[at:]
        self._state = "region"
        if self.fmt.open:  # NOTE: the open string starts with the trigger; without one, the trigger is the JSON
            self._pending = self._pending[len(trigger):]
        return True

    def _on_region(self, out: ParseOut) -> bool:
        stripped = self._pending.lstrip()
        if not stripped:
            self._pending = ""
            return False
        close = self.fmt.close.strip()
        if close and stripped.startswith(close):
            self._pending, self._state = stripped[len(close):], "text"
            return True
        opener = self.fmt.open.strip()
        if opener and stripped.startswith(opener):  # the next region right away (Mistral's)
            self._pending = stripped[len(opener):]
            return True
        if any(m and m.startswith(stripped) for m in (close, opener)):
            self._pending = stripped
            return False  # maybe the close or an opener, cut short
        head = stripped[0]
        if head in "[,;]":
            self._pending = stripped[1:]
            return True
        if head == "{":
            self._pending, self._state, self._object = stripped, "object", ""
            self._scanner = _JsonScanner()
            return True
        self._state = "text"  # not a call after all (a region without a close ends with its JSON)
        self._pending = stripped
        return True

    def _on_object(self, out: ParseOut) -> bool:
        for i, ch in enumerate(self._pending):
            self._object += ch
            if self._scanner.feed(ch):
                self._pending = self._pending[i + 1:]
                self._whole_call(out)
                return True
            header = _HEADER.match(self._object)
            if header is not None:
                self._pending = self._pending[i + 1:]
                self._start_call(out, json.loads(header.group(1)))
                return True
        self._pending = ""
        return False

    def _on_arguments(self, out: ParseOut) -> bool:
        for i, ch in enumerate(self._pending):
            if self._scanner.feed(ch):
                end = i if self._scanner.outside else i + 1
                piece = self._pending[:end].lstrip() if not self._args else self._pending[:end]
                self._emit_args(out, piece)
                self._pending, self._state = self._pending[end:], "after_arguments"
                self._scanner = _JsonScanner()
                self._scanner.depth = 1  # NOTE: inside the call object, past its arguments
                self._scanner.started = True
                return True
        piece = self._pending.lstrip() if not self._args else self._pending
        self._emit_args(out, piece)
        self._pending = ""
        return False

    def _on_after_arguments(self, out: ParseOut) -> bool:
        for i, ch in enumerate(self._pending):
            if self._scanner.feed(ch):
                self._pending, self._state = self._pending[i + 1:], "region"
                return True
        self._pending = ""
        return False

    # ------------------------------------------------------------------ calls

    def _start_call(self, out: ParseOut, name: str) -> None:
        call = ParsedCall(_call_id(), name, "")
        self.calls.append(call)
        self._args = []
        out.calls.append(CallDelta(len(self.calls) - 1, id=call.id, name=name))
        self._state = "arguments"
        self._scanner = _JsonScanner()

    def _emit_args(self, out: ParseOut, piece: str) -> None:
        if not piece:
            return
        self._args.append(piece)
        self.calls[-1].arguments = "".join(self._args)
        out.calls.append(CallDelta(len(self.calls) - 1, arguments=piece))

    def _whole_call(self, out: ParseOut) -> None:
        """A call object whose header did not come first: parsed whole, or content if it is no call."""
        try:
            obj = json.loads(self._object)
            name = obj["name"]
            args = obj.get("arguments", obj.get("parameters", {}))
        except (ValueError, KeyError, TypeError):
            name = None
        if not isinstance(name, str):
            out.content += self._gap + self._object  # no call after all: nothing is lost
            self._state = "text"
            return
        call = ParsedCall(_call_id(), name, args if isinstance(args, str) else json.dumps(args))
        self.calls.append(call)
        out.calls.append(CallDelta(len(self.calls) - 1, id=call.id, name=name, arguments=call.arguments))
        self._state = "region"

    # ------------------------------------------------------------------ content

    def _flush_spaces(self, text: str, final: bool = False) -> str:
        """Whitespace at the end of content waits for more text: between calls, or at the end after a call,
        it is not content."""
        text = self._spaces + text
        body = text.rstrip()
        self._spaces = text[len(body):]
        if final and not self.calls:
            body, self._spaces = body + self._spaces, ""
        if not body and self.calls:
            return ""
        return body


def _held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:n]):
                best = max(best, n)
                break
    return best


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
