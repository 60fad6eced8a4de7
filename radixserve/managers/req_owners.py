"""Who writes each field of a `Req`: its own module, but for the few fields listed in `FIELD_WRITERS`.

A request's state has one owner so that its lifecycle reads in one place (managers/req.py): the scheduler's
parts call its methods instead of setting its fields. The exceptions are a forward's progress, written by the
batch that runs it, and the KV handle, replaced by the KV manager when it releases the request's KV.

The tests hold every write to this (`guard_field_writes`, on under RADIXSERVE_CHECK_REQ_WRITES=1, which
tests/conftest.py sets): a write of a field from a module of the package that is not its writer raises, and so
does a new attribute set outside `Req.__init__`. The field list is the class's own (what `__init__` sets), so a
field added later is covered without a list to keep up to date.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REQ_MODULE = "managers/req.py"
_PROGRESS = frozenset({REQ_MODULE, "managers/schedule_batch.py"})
FIELD_WRITERS: dict[str, frozenset[str]] = {
    # NOTE: a forward's progress: which prompt positions it scored, what it found cached, a row's fresh penalties
    "penalty_reset": _PROGRESS, "input_logprob_next": _PROGRESS, "cached_tokens": _PROGRESS,
    "cached_tokens_details": _PROGRESS, "already_computed": _PROGRESS,
    "kv": frozenset({REQ_MODULE, "mem_cache/kv_manager.py"}),  # NOTE: a new empty handle once its KV is released
}
_PACKAGE = str(Path(__file__).resolve().parents[1]) + "/"


class FieldOwnerError(AttributeError):
    """A field of a request was written by a module that does not own it."""


def writers_of(field: str) -> frozenset[str]:
    """The package modules (paths under radixserve/) that may write `field`."""
    return FIELD_WRITERS.get(field, frozenset({REQ_MODULE}))


def guard_field_writes(cls: type) -> None:
    """Make `cls` (Req) check the writer of every attribute write: a module of the package other than the field's
    writers raises FieldOwnerError, as does a new attribute set outside `__init__`. Writes from outside the package
    (tests, user code) pass. Costs a frame lookup per write: for tests, not for serving."""
    if getattr(cls, "_fields_guarded", False):
        return
    init_code = cls.__init__.__code__

    def checked_setattr(self: Any, name: str, value: Any) -> None:
        frame = sys._getframe(1)
        if frame.f_code is not init_code:
            path = frame.f_code.co_filename
            if path.startswith(_PACKAGE) and path[len(_PACKAGE):] not in writers_of(name):
                raise FieldOwnerError(f"Req.{name} written by radixserve/{path[len(_PACKAGE):]} (line "
                                      f"{frame.f_lineno}); its writers: {', '.join(sorted(writers_of(name)))}")
            if name not in self.__dict__:
                raise FieldOwnerError(f"Req.{name} is not a field of Req (set in Req.__init__): "
                                      f"written by {path}:{frame.f_lineno}")
        object.__setattr__(self, name, value)

    cls.__setattr__ = checked_setattr
    cls._fields_guarded = True
