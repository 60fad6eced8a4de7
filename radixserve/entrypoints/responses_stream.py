"""The typed events of a streamed Response, in OpenAI's order, each with its `sequence_number`.

`response.created`, `response.in_progress`; first, with --reasoning-parser, the think block's reasoning item
`response.output_item.added`, `response.reasoning_text.delta`..., `response.reasoning_text.done`,
`response.output_item.done`; per message item `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done`, `response.output_item.done`; per function call `response.output_item.added`,
`response.function_call_arguments.delta`..., `response.function_call_arguments.done`, `response.output_item.done`;
then `response.completed` (or `response.incomplete`). One item is open at a time: a new one closes the last.
"""

from __future__ import annotations

from typing import Any

from radixserve.entrypoints.responses_protocol import call_item, message_item, new_id, reasoning_item


class ResponseEvents:
    """Builds one stream's events from text and call pieces (function_call/answer.StreamedCalls' shape)."""

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response  # the Response object in progress
        self.output: list[dict[str, Any]] = []
        self.status = "completed"
        self._seq = 0
        self._started = False
        self._open: int | None = None  # output index of the open item
        self._calls: dict[int, int] = {}  # a call's index in the answer -> its output index
        self._ending = False  # close() has begun

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        # NOTE: sequence numbers count every event of the stream from 0, without gaps
        out = {"type": kind, **fields, "sequence_number": self._seq}
        self._seq += 1
        return out

    def start(self) -> list[dict[str, Any]]:
        if self._started:
            return []
        self._started = True
        return [self.event("response.created", response=self.response),
                self.event("response.in_progress", response=self.response)]

    def text(self, delta: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._open is None or self.output[self._open]["type"] != "message":
            out += self._close_open()
            item = message_item(new_id("msg"), "", "in_progress")
            out += self._add(item)
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=self._open,
                                  content_index=0, part=_part("")))
        item = self.output[self._open]
        item["content"][0]["text"] += delta
        out.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self._open,
                              content_index=0, delta=delta, logprobs=[]))
        return out

    def reasoning(self, delta: str) -> list[dict[str, Any]]:
        """A piece of the think block (it comes before the answer: the first answer piece closes its item)."""
        out: list[dict[str, Any]] = []
        if self._open is None or self.output[self._open]["type"] != "reasoning":
            out += self._close_open()
            out += self._add(reasoning_item(new_id("rs"), "", "in_progress"))
        item = self.output[self._open]
        item["content"][0]["text"] += delta
        out.append(self.event("response.reasoning_text.delta", item_id=item["id"], output_index=self._open,
                              content_index=0, delta=delta))
        return out

    def call(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        """A tool-call piece: the first of a call has `id` and the name, later ones argument text."""
        out: list[dict[str, Any]] = []
        if piece.get("id") is not None:
            out += self._close_open()
            function = piece["function"]
            out += self._add(call_item(new_id("fc"), piece["id"], function["name"], "", "in_progress"))
            self._calls[piece["index"]] = self._open
        at = self._calls.get(piece["index"])
        arguments = piece["function"].get("arguments") or ""
        if at is not None and arguments:
            item = self.output[at]
            item["arguments"] += arguments
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                                  delta=arguments))
        return out

    def close(self) -> list[dict[str, Any]]:
        """The end of the answer: the open item closes; an answer of nothing (a think block alone, too) is one
        empty message, as in the whole answer."""
        self._ending = True
        out = self._close_open()
        if all(o["type"] == "reasoning" for o in self.output):
            out += self.text("") + self._close_open()
        return out

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self._open = len(self.output) - 1
        shown = {**item, "content": []} if item["type"] in ("message", "reasoning") else dict(item)
        return [self.event("response.output_item.added", output_index=self._open, item=shown)]

    def _close_open(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        at, self._open = self._open, None
        item = self.output[at]
        out = []
        if item["type"] == "message":
            item["status"] = "incomplete" if self.status == "incomplete" else "completed"
            text = item["content"][0]["text"]
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                                  text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=at,
                                  content_index=0, part=_part(text)))
        elif item["type"] == "reasoning":
            # NOTE: closed by the answer's first piece the block ended; closed by the end, it is as the response
            item["status"] = "incomplete" if self._ending and self.status == "incomplete" else "completed"
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=at,
                                  content_index=0, text=item["content"][0]["text"]))
        else:
            item["status"] = "completed"
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                  name=item["name"], arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=at, item=dict(item)))
        return out


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
