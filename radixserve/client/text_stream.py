"""Token ids to text, incrementally, with stop-string trimming (used by the Engine; reusable by a server).

Streaming detokenization decodes a small window (`prefix_offset:`) and emits only text that is
stable: never half a UTF-8 character (U+FFFD at the end means "wait for the next token"), and never
the last `len(longest stop string) - 1` characters, which could be the start of a stop string the
next token completes. The final text of a request is decoded from all its ids at once.
"""

from __future__ import annotations

from typing import Any


def final_text(tokenizer: Any, output_ids: list[int], finish_reason: dict[str, Any] | None,
               skip_special_tokens: bool = True) -> str:
    """The text of a finished request: a matched stop token is dropped, a stop string cut off."""
    ids = output_ids
    matched = (finish_reason or {}).get("matched") if (finish_reason or {}).get("type") == "stop" else None
    if isinstance(matched, int) and ids and ids[-1] == matched:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if isinstance(matched, str):
        cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    return text


class IncrementalDetokenizer:
    """Feeds token ids in, gives text deltas out; `finish` returns the rest of the final text."""

    def __init__(self, tokenizer: Any, stop: list[str] | tuple[str, ...] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # stable decoded text so far
        self.sent = 0  # characters of `text` already emitted
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def feed(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        end = max(len(self.text) - self.holdback, self.sent)
        delta = self.text[self.sent:end]
        self.sent = end
        return delta

    def finish(self, new_ids: list[int], finish_reason: dict[str, Any] | None) -> str:
        """The last ids and the finish reason in; the rest of the final text out."""
        self.ids.extend(new_ids)
        full = final_text(self.tokenizer, self.ids, finish_reason, self.skip_special_tokens)
        emitted = self.text[:self.sent]
        # NOTE: emitted text never reaches into a stop string (held back), so `full` extends it.
        delta = full[len(emitted):] if full.startswith(emitted) else full[min(self.sent, len(full)):]
        self.sent = len(emitted) + len(delta)
        return delta


def max_prompt_chars(tokenizer: Any, context_len: int) -> int | None:
    """Characters beyond which a text cannot fit the context however it is tokenized, or None if unknown.

    NOTE: sound for byte-level BPE without a normalizer (GPT-2, SmolLM2, Llama 3, Qwen): every token
    stands for at least one byte of the text and at most as many characters as its vocabulary entry
    is long, so a text over context_len x the longest entry has more than context_len tokens. A
    normalizer could shrink the text (collapse whitespace), so then there is no bound.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    from tokenizers import decoders

    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    return context_len * max(len(token) for token in tokenizer.get_vocab())


def decode_all(tokenizer: Any, ids: list[int]) -> str:
    """`tokenizer.decode(ids)` for a long id list (an echoed prompt, /detokenize) with the GIL released.

    NOTE: the fast tokenizer's backend decodes without holding the GIL; transformers' `decode` first walks
    every id in Python in one call (0.37 s of GIL for 500,000 ids: /health waited that long). Where the
    wrapper would change the text (its clean-up of spaces), it is used as it is."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return tokenizer.decode(ids)
    return backend.decode(ids, skip_special_tokens=False)
