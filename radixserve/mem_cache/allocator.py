"""KV slot allocators: hand out indices into the KV buffers, token by token or page by page.

Slot 0 (page 0) is never handed out: padded tokens write their dummy K/V there. With the
environment switch RADIXSERVE_DEBUG_ALLOC=1 every free is checked at once: freeing a slot that
is free, pending in the current free group, out of range, or never allocated raises ValueError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from radixserve import envs
from radixserve.mem_cache.memory_pool import SLOT_DTYPE
from radixserve.mem_cache.tiers import DEVICE_TIER

DEBUG_ENV = envs.DEBUG_ALLOC.name


def debug_alloc_enabled() -> bool:
    return envs.DEBUG_ALLOC.get()


def _as_list(values: torch.Tensor | Sequence[int]) -> list[int]:
    return values.tolist() if isinstance(values, torch.Tensor) else [int(v) for v in values]


class PagedTokenToKVPoolAllocator:
    """Page-granular allocator: page p covers slots [p*page_size, (p+1)*page_size).

    Free pages are reused LIFO (freed pages go to the head), as in SGLang. `size` is rounded down
    to whole pages. A request's tokens stay contiguous inside a page and two requests never share
    a page; `alloc_extend` / `alloc_decode` fill a request's partial last page before taking new ones.

    What it is, declared (tiers.py): `is_hybrid` False, one tier (`device`); a hybrid allocator overrides both.
    """

    # NOTE: callers read these, never probe for a hybrid pool's attributes (one place per decision)
    is_hybrid: ClassVar[bool] = False
    tier_names: ClassVar[tuple[str, ...]] = (DEVICE_TIER,)

    def __init__(self, size: int, page_size: int, device: str | torch.device = "cpu") -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.num_pages = size // page_size
        self.size = self.num_pages * page_size
        self.device = torch.device(device)
        self.debug = debug_alloc_enabled()
        self.clear()

    # ------------------------------------------------------------------ state
    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=SLOT_DTYPE, device=self.device)
        self.is_not_in_free_group = True
        self.free_group: list[torch.Tensor] = []
        # Debug bookkeeping, on the CPU: page_is_free[p]; pages collected by the open free group.
        self._page_is_free = torch.ones(self.num_pages + 1, dtype=torch.bool)
        self._page_is_free[0] = False
        self._pending_pages: set[int] = set()

    def available_size(self) -> int:
        """Free slots, not counting those collected by an open free group."""
        return len(self.free_pages) * self.page_size

    def tier_capacity(self, name: str) -> int:
        """Slots tier `name` holds in all (slot 0 / page 0 not counted)."""
        self._check_tier(name)
        return self.size

    def tier_free(self, name: str) -> int:
        """Free slots of tier `name` (for `device`, `available_size()`)."""
        self._check_tier(name)
        return self.available_size()

    def _check_tier(self, name: str) -> None:
        if name not in self.tier_names:
            raise KeyError(f"no KV tier {name!r} in {type(self).__name__} (tiers: {', '.join(self.tier_names)})")

    def free_group_begin(self) -> None:
        """Collect the following frees and release them together at `free_group_end`."""
        self.is_not_in_free_group = False
        self.free_group = []

    def free_group_end(self) -> None:
        self.is_not_in_free_group = True
        self._pending_pages = set()
        if self.free_group:
            self.free(torch.cat(self.free_group))
        self.free_group = []

    # ------------------------------------------------------------------ alloc / free
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """`need_size` slots (a multiple of page_size) as a SLOT_DTYPE tensor, or None if not available."""
        if need_size % self.page_size != 0:
            raise ValueError(f"paged alloc of {need_size} slots is not a multiple of page {self.page_size}")
        pages = self._take_pages(need_size // self.page_size)
        if pages is None:
            return None
        return self._page_slots(pages)

    def free(self, free_index: torch.Tensor) -> None:
        """Release every page touched by `free_index` (pages are released whole)."""
        if free_index.numel() == 0:
            return
        free_index = free_index.to(device=self.device, dtype=SLOT_DTYPE)
        if self.debug:
            self._check_free(free_index)
        if not self.is_not_in_free_group:
            # NOTE: a copy: the caller may pass a view of a request row it rewrites before the group ends
            self.free_group.append(free_index.clone())
            return
        pages = self._pages_of(free_index)
        if self.debug:
            self._page_is_free[pages.cpu()] = True
        self._release_pages(pages)

    def _release_pages(self, pages: torch.Tensor) -> None:
        # NOTE: freed pages go to the head, so paged reuse is LIFO, as in SGLang.
        self.free_pages = torch.cat([pages, self.free_pages])

    def _pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            return slots
        return torch.unique(slots // self.page_size)

    def _page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            return pages
        offsets = torch.arange(self.page_size, dtype=SLOT_DTYPE, device=self.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def _take_pages(self, num_pages: int) -> torch.Tensor | None:
        if num_pages > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[:num_pages], self.free_pages[num_pages:]
        if self.debug and num_pages:
            self._page_is_free[pages.cpu()] = False
        return pages

    def _check_free(self, slots: torch.Tensor) -> None:
        slots_cpu = slots.cpu()
        pages = slots_cpu // self.page_size
        bad_range = slots_cpu[(pages < 1) | (pages > self.num_pages)]
        if len(bad_range):
            raise ValueError(f"free of slots outside the pool (slot 0 is reserved): {bad_range.tolist()[:20]}")
        if self.page_size == 1 and len(torch.unique(pages)) != len(pages):
            raise ValueError(f"double free: slots repeated in one free call: {_repeated(pages)[:20]}")
        unique_pages = torch.unique(pages)
        already_free = unique_pages[self._page_is_free[unique_pages]]
        if len(already_free):
            raise ValueError(f"double free (or never allocated): pages {already_free.tolist()[:20]} "
                             f"(page_size={self.page_size})")
        if not self.is_not_in_free_group:
            page_list = unique_pages.tolist()
            pending = sorted(set(page_list) & self._pending_pages)
            if pending:
                raise ValueError(f"double free inside one free group: pages {pending[:20]}")
            self._pending_pages.update(page_list)

    # ------------------------------------------------------------------ per-request helpers
    def alloc_extend(self, prefix_lens: torch.Tensor | Sequence[int], seq_lens: torch.Tensor | Sequence[int],
                     last_loc: torch.Tensor | Sequence[int], extend_num_tokens: int) -> torch.Tensor | None:
        """Slots for positions [prefix_len, seq_len) of each request, concatenated in request order.

        `last_loc` is the slot of each request's last prefix token (-1 when it has none). Each
        request first fills its partial page (last_loc+1, ...), then takes whole new pages.
        Returns None (allocating nothing) when the free pages do not suffice.
        """
        ps = self.page_size
        prefixes, seqs, lasts = _as_list(prefix_lens), _as_list(seq_lens), _as_list(last_loc)
        new_pages = sum(_ceil_div(s, ps) - _ceil_div(p, ps) for p, s in zip(prefixes, seqs, strict=True))
        pages_t = self._take_pages(new_pages)
        if pages_t is None:
            return None
        pages = pages_t.tolist()
        out: list[int] = []
        next_page = 0
        for prefix, seq, last in zip(prefixes, seqs, lasts, strict=True):
            in_partial = min(seq, _ceil_div(prefix, ps) * ps) - prefix
            if in_partial > 0 and last < 0:
                raise ValueError("alloc_extend: a request with a partial page needs its last_loc")
            out.extend(range(last + 1, last + 1 + in_partial))
            remaining = seq - prefix - max(in_partial, 0)
            while remaining > 0:
                take = min(remaining, ps)
                base = pages[next_page] * ps
                out.extend(range(base, base + take))
                next_page += 1
                remaining -= take
        if len(out) != extend_num_tokens:
            raise ValueError(f"alloc_extend: extend_num_tokens={extend_num_tokens} but lengths give {len(out)}")
        return torch.tensor(out, dtype=SLOT_DTYPE, device=self.device)

    def alloc_decode(self, seq_lens: torch.Tensor | Sequence[int],
                     last_loc: torch.Tensor | Sequence[int]) -> torch.Tensor | None:
        """One slot per request for position seq_len-1 (seq_lens already count the new token)."""
        ps = self.page_size
        seqs, lasts = _as_list(seq_lens), _as_list(last_loc)
        starts_page = [(s - 1) % ps == 0 for s in seqs]
        pages_t = self._take_pages(sum(starts_page))
        if pages_t is None:
            return None
        pages = iter(pages_t.tolist())
        out = [next(pages) * ps if new else last + 1 for new, last in zip(starts_page, lasts, strict=True)]
        return torch.tensor(out, dtype=SLOT_DTYPE, device=self.device)


class TokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """Token-granular allocator (page_size 1). Freed slots go to the tail: reuse is FIFO."""

    def __init__(self, size: int, device: str | torch.device = "cpu") -> None:
        super().__init__(size, 1, device)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self._take_pages(need_size)

    def _release_pages(self, pages: torch.Tensor) -> None:
        self.free_pages = torch.cat([self.free_pages, pages])


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _repeated(values: torch.Tensor) -> list[int]:
    uniq, counts = torch.unique(values, return_counts=True)
    return uniq[counts > 1].tolist()
