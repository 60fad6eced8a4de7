"""Stored Responses (`store: true`): a bounded, least-recently-used, per-tenant map in the front end's memory.

Each entry is keyed by (tenant, response id): the tenant is the caller's API key id (None on an open server), so
one key can never read, delete or continue another's response; to it, the id does not exist (404). Two bounds
hold after every `put`: at most `max_count` entries and at most `max_bytes` of their estimated size; the least
recently used entries go first (a `get` counts as a use). An entry larger than `max_bytes` alone is not stored.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from radixserve.function_call.chat_tools import ToolPlan

_ID_BYTES = 8  # NOTE: the estimate of a token id held in a Python list (a pointer to a small int)
_ENTRY_BYTES = 512  # NOTE: the fixed cost of an entry (its objects and its key)


@dataclass
class StoredResponse:
    """A finished response and what the next turn (`previous_response_id`) needs to continue it."""

    body: dict[str, Any]  # the Response object as it was answered
    input_items: list[dict[str, Any]]  # this turn's input items, with their ids (GET .../input_items)
    history: list[dict[str, Any]]  # every earlier turn's items, then this turn's input (stored form)
    instructions: str | None
    plan: ToolPlan | None  # this turn's tools, as its prompt rendered them
    prompt_text: str  # the prompt as the chat template wrote it
    prompt_ids: list[int]  # the prompt the model ran
    output_ids: list[int]  # the tokens it generated
    size: int = field(default=0)

    def estimate(self) -> int:
        """Bytes this entry holds, roughly: its JSON, its text and its token ids."""
        text = json.dumps([self.body, self.input_items, self.history, self.instructions], ensure_ascii=False)
        plan = len(json.dumps(self.plan.tools)) if self.plan is not None else 0
        ids = _ID_BYTES * (len(self.prompt_ids) + len(self.output_ids))
        return _ENTRY_BYTES + len(text.encode()) + plan + len(self.prompt_text.encode()) + ids


class ResponseStore:
    """The bounded LRU map of stored responses; every method is O(1) but `put`'s evictions (each O(1))."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tenant: str | None, response_id: str, entry: StoredResponse) -> bool:
        """Stores `entry` (False: larger than the byte bound alone, not stored) and evicts to the bounds."""
        entry.size = entry.estimate()
        if entry.size > self.max_bytes:
            return False
        self.delete(tenant, response_id)
        self._entries[(tenant, response_id)] = entry
        self.bytes += entry.size
        # NOTE: the invariant after every put: len <= max_count and bytes <= max_bytes
        while len(self._entries) > self.max_count or self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.size
            self.evicted += 1
        return True

    def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        entry = self._entries.get((tenant, response_id))
        if entry is not None:
            self._entries.move_to_end((tenant, response_id))
        return entry

    def delete(self, tenant: str | None, response_id: str) -> bool:
        entry = self._entries.pop((tenant, response_id), None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True

    def stats(self) -> dict[str, int]:
        return {"count": len(self._entries), "bytes": self.bytes, "max_count": self.max_count,
                "max_bytes": self.max_bytes, "evicted": self.evicted}
