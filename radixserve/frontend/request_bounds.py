"""The bound on every list and string a request can send, checked on the parsed JSON before validation.

A body under the size limit can still hold a million stop token ids or a hundred thousand chat messages;
validating those costs seconds (one pydantic object per message) before any handler could refuse them.
So the body parser (http_errors.decode_body) checks each field's size first, on the plain JSON value,
whatever its type turns out to be; validation and the handlers see only bounded fields. What multiplies
(sequences x per-sequence items) needs the validated request and is checked by the handlers
(serving_common.check_request_items).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.sampling_params import MAX_STOP_STRINGS
from radixserve.server_args import ServerArgs

# The fields that carry sampling options: at the top level (OpenAI routes) and under sampling_params (/generate).
_SAMPLING_HOLDERS = ("", "sampling_params.")
_ID_FIELDS = ("rid", "cache_salt", "extra_key")


@dataclass(frozen=True)
class RequestBounds:
    """The limits of one request's fields; ServerArgs.REQUEST_BOUNDS names the flags."""

    max_stop_string_chars: int = ServerArgs.max_stop_string_chars
    max_stop_token_ids: int = ServerArgs.max_stop_token_ids
    max_logit_bias_entries: int = ServerArgs.max_logit_bias_entries
    max_chat_messages: int = ServerArgs.max_chat_messages
    max_id_chars: int = ServerArgs.max_id_chars
    max_request_items: int = ServerArgs.max_request_items


class BoundError(ValueError):
    """A field over its bound: the field's path, and a message naming the limit and its flag."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_fields(body: dict[str, Any], bounds: RequestBounds) -> None:
    """Raises BoundError for the first field of `body` (parsed JSON) over its bound; ignores wrong types,
    which validation refuses next."""
    for prefix in _SAMPLING_HOLDERS:
        holder = body if not prefix else body.get(prefix.rstrip("."))
        if not isinstance(holder, dict):
            continue
        stop = holder.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        _bound(len(stops), MAX_STOP_STRINGS, f"{prefix}stop", "stop strings", "fixed")
        longest = max((len(s) for s in stops if isinstance(s, str)), default=0)
        _bound(longest, bounds.max_stop_string_chars, f"{prefix}stop", "characters in a stop string",
               "--max-stop-string-chars")
        _bound(_size(holder.get("stop_token_ids")), bounds.max_stop_token_ids, f"{prefix}stop_token_ids",
               "stop token ids", "--max-stop-token-ids")
        _bound(_size(holder.get("logit_bias")), bounds.max_logit_bias_entries, f"{prefix}logit_bias",
               "logit_bias entries", "--max-logit-bias-entries")
    _bound(_size(body.get("messages")), bounds.max_chat_messages, "messages", "messages", "--max-chat-messages")
    for name in _ID_FIELDS:
        value = body.get(name)
        for one in value if isinstance(value, list) else [value]:
            _bound(len(one) if isinstance(one, str) else 0, bounds.max_id_chars, name, "characters", "--max-id-chars")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (list, dict)) else 0


def _bound(size: int, limit: int, param: str, what: str, flag: str) -> None:
    if size > limit:
        raise BoundError(param, f"'{param}' has {size} {what}; the server takes at most {limit} ({flag})")
