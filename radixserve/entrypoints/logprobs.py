"""Logprobs of generated (and prompt) tokens in the server's three shapes: OpenAI chat, OpenAI legacy
completions and SGLang's native `meta_info`.

The scheduler sends, per generated token, its logprob and its `top_logprobs_num` most likely
alternatives as (token id, logprob) (`GenerateOutput.logprobs`, `.top_logprobs`), and once, when
asked (`logprob_start_len`), the same for the prompt from that position (`.input_logprobs`, None at
position 0, which has no context); this module turns ids into text. A token's text is
`tokenizer.decode([id])`; its `bytes` are the UTF-8 bytes it stands for, which with byte-level BPE
(GPT-2, SmolLM2, Llama 3, Qwen) can be part of a character (the text then reads U+FFFD), so a
client can join the bytes of consecutive tokens to get exact text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from itertools import accumulate
from typing import Any, Protocol

from radixserve.client import shaping
from radixserve.client.shaping import LOGPROB_FLOOR, finite, maybe_finite  # noqa: F401 - LOGPROB_FLOOR re-exported
from radixserve.entrypoints.http_errors import bad_request
from radixserve.entrypoints.openai_protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)
from radixserve.frontend.tokenizer_manager import GenerateOutput, TopLogprobs
from radixserve.protocol.io_struct import MAX_TOP_LOGPROBS


class HasLogprobs(Protocol):
    """One step's output (`GenerateOutput`) or a whole choice (`ChoiceResult`)."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[TopLogprobs] | None
    input_logprobs: list[float | None] | None
    input_top_logprobs: list[TopLogprobs] | None


def check_top_logprobs(value: int, param: str) -> None:
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad_request(f"'{param}' must be between 0 and {MAX_TOP_LOGPROBS}, got {value}", param=param,
                          code="invalid_value")


def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte, reversed: printable Latin-1 bytes (but space and soft
    hyphen) stand for themselves, the other 68 bytes are U+0100 onwards in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = sorted(set(range(256)) - set(printable))
    return {chr(b): b for b in printable} | {chr(0x100 + i): b for i, b in enumerate(others)}


def _is_byte_level(tokenizer: Any) -> bool:
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    return isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)


class TokenTexts:
    """Text and UTF-8 bytes of single tokens, cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._alphabet = byte_level_alphabet() if _is_byte_level(tokenizer) else None
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}))
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int) -> str:
        return self._entry(token_id)[0]

    def utf8(self, token_id: int) -> list[int]:
        return self._entry(token_id)[1]

    def _entry(self, token_id: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token_id)
        if entry is None:
            text = self.tokenizer.decode([token_id])
            entry = self._cache[token_id] = (text, self._bytes(token_id, text))
        return entry

    def _bytes(self, token_id: int, text: str) -> list[int]:
        if self._alphabet is not None and token_id not in self._added:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if all(c in self._alphabet for c in piece):
                return [self._alphabet[c] for c in piece]
        # Other tokenizers: exact for whole characters; part of one reads as U+FFFD's bytes.
        return list(text.encode())


def _entries(out: HasLogprobs) -> list[tuple[int, float, TopLogprobs]]:
    """(token id, logprob, alternatives) per token; the scheduler sends one of each per token id."""
    logprobs = out.logprobs or []
    tops = out.top_logprobs or [[] for _ in logprobs]
    return list(zip(out.token_ids, logprobs, tops, strict=True))


def _prompt_entries(ids: list[int], out: HasLogprobs) -> list[tuple[int, float | None, TopLogprobs | None]]:
    """(token id, logprob, alternatives) per scored prompt token `ids`: (id, None, None) where there is no
    value (position 0, or every position of a request aborted before its prompt was computed)."""
    values = out.input_logprobs if out.input_logprobs is not None else [None] * len(ids)
    tops = out.input_top_logprobs if out.input_top_logprobs is not None else [[] for _ in ids]
    return [(t, v, None if v is None else top) for t, v, top in zip(ids, values, tops, strict=True)]


def chat_logprobs(texts: TokenTexts, out: HasLogprobs) -> ChatLogprobs:
    """OpenAI chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(token: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=texts.text(token), logprob=finite(logprob), bytes=texts.utf8(token))

    content = [ChatTokenLogprob(token=texts.text(token), logprob=finite(lp), bytes=texts.utf8(token),
                                top_logprobs=[entry(t, v) for t, v in top])
               for token, lp, top in _entries(out)]
    return ChatLogprobs(content=content)


def _alternatives(texts: TokenTexts, top: TopLogprobs) -> dict[str, float]:
    alternatives: dict[str, float] = {}
    for t, v in top:
        alternatives.setdefault(texts.text(t), finite(v))  # two tokens with one text: the likelier
    return alternatives


def completion_logprobs(texts: TokenTexts, out: HasLogprobs, offset: int = 0,
                        echo: list[int] | None = None) -> CompletionLogprobs:
    """OpenAI legacy completions' `logprobs`; `offset` is the text's length before these tokens.

    With `echo` (the prompt's ids, scored from position 0) the prompt's tokens come first; the first
    one has no context, so its `token_logprobs` and `top_logprobs` entries are null (as OpenAI's)."""
    entries: list[tuple[int, float | None, TopLogprobs | None]] = [*_entries(out)]
    if echo is not None:
        entries = _prompt_entries(echo, out) + entries
    tokens = [texts.text(t) for t, _, _ in entries]
    offsets = list(accumulate(map(len, tokens[:-1]), initial=offset)) if tokens else []
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=[maybe_finite(lp) for _, lp, _ in entries],
        top_logprobs=[None if top is None else _alternatives(texts, top) for _, _, top in entries],
        text_offset=offsets)


def native_logprobs(texts: TokenTexts, out: HasLogprobs, input_ids: list[int] | None = None) -> dict[str, Any]:
    """SGLang's `meta_info` fields (client/shaping.py, the Engine's too): [logprob, token id, text] per token, and
    per token its alternatives; with `input_ids` (the prompt from logprob_start_len on) also the prompt's."""
    return shaping.native_logprobs(texts.text, out.token_ids, out.logprobs, out.top_logprobs, input_ids,
                                   out.input_logprobs, out.input_top_logprobs)


async def share_prompt_logprobs(outputs: AsyncIterator[tuple[int, GenerateOutput]],
                                n: int) -> AsyncIterator[tuple[int, GenerateOutput]]:
    """Prompt logprobs computed once per prompt, not once per choice: only choice 0 of each prompt scores it
    (generate_all asks so), and each sibling's first output carries choice 0's prompt logprobs. A sibling's
    outputs wait until choice 0's have arrived (or choice 0 ended without them). Scoring in every choice made
    echo + logprobs 20 on a 2,000-token prompt take 12x as long with n=16 as with n=1 (1.4x now)."""
    leaders: dict[int, GenerateOutput] = {}  # prompt index -> choice 0's output that brought its logprobs
    held: dict[int, list[tuple[int, GenerateOutput]]] = {}
    started: set[int] = set()

    def with_prompt(index: int, out: GenerateOutput) -> tuple[int, GenerateOutput]:
        if index in started:
            return index, out
        started.add(index)
        leader = leaders[index // n]
        return index, replace(out, input_logprobs=leader.input_logprobs, input_top_logprobs=leader.input_top_logprobs)

    async with aclosing(outputs) as merged:
        async for index, out in merged:
            prompt, choice = divmod(index, n)
            if choice == 0:
                if prompt not in leaders and (out.input_logprobs is not None or out.finish_reason is not None):
                    leaders[prompt] = out
                    yield index, out
                    for item in held.pop(prompt, []):
                        yield with_prompt(*item)
                    continue
                yield index, out
            elif prompt in leaders:
                yield with_prompt(index, out)
            else:
                held.setdefault(prompt, []).append((index, out))
    for items in held.values():  # NOTE: only where choice 0 never ended (the stream was cut short)
        for item in items:
            yield item
