"""The hybrid KV memory of a sliding-window model: a full pool and a smaller window pool behind one slot id.

Full-attention layers keep every token's K/V in the ordinary pool, indexed by the *full slot* that
`req_to_token`, the radix tree and the allocator's callers deal in. Window layers keep K/V only for the tokens
some window may still read, in their own smaller buffers indexed by *window slots*. `full_to_window[full slot]`
names a token's window slot (0: none, the token's window KV is freed, a *tombstone*).

`SWATokenToKVPoolAllocator` is the one writer of that table: every allocation takes a window slot for each full
slot it hands out, and every free of a full slot frees its window slot too, so the tree and `KVManager` keep
calling `alloc*` / `free` as for a plain model. `free_window` drops only the window KV (a request's tokens that
left its window, a tree node's tombstoning) and `transfer_window` moves window KV between two full slots of the
same token (a request publishing a copy of a tombstoned tree node revives it). `SWAKVPool` gives window layers
their smaller buffers; attention translates full slots through the table (layers/attention/window.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from radixserve.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixserve.mem_cache.memory_pool import SLOT_DTYPE, MHATokenToKVPool
from radixserve.mem_cache.tiers import DEVICE_TIER, WINDOW_TIER


class SWATokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """The full pool's (paged) allocator, plus a token-granular window allocator and `full_to_window`.

    `size`, `page_size`, `available_size()`, `free_pages` and the free group are the full pool's, as before;
    `window` is the window pool's allocator (page size 1: window KV is freed token by token as windows slide).
    Declared (tiers.py): `is_hybrid` True, tiers `device` (the full pool) and `window`.
    """

    is_hybrid: ClassVar[bool] = True
    tier_names: ClassVar[tuple[str, ...]] = (DEVICE_TIER, WINDOW_TIER)

    def __init__(self, size: int, page_size: int, window_size: int, device: str | torch.device = "cpu") -> None:
        if window_size < 1:
            raise ValueError(f"window_size must be positive, got {window_size}")
        self.window = TokenToKVPoolAllocator(window_size, device)
        # NOTE: set before the base __init__, whose clear() resets this table too
        self.full_to_window = torch.zeros(size // page_size * page_size + page_size, dtype=SLOT_DTYPE,
                                          device=torch.device(device))
        super().__init__(size, page_size, device)

    # ------------------------------------------------------------------ state
    def clear(self) -> None:
        super().clear()
        self.window.clear()
        self.full_to_window.zero_()

    def window_available_size(self) -> int:
        return self.window.available_size()

    @property
    def window_size(self) -> int:
        return self.window.size

    def tier_capacity(self, name: str) -> int:
        return self.window.size if name == WINDOW_TIER else super().tier_capacity(name)

    def tier_free(self, name: str) -> int:
        return self.window.available_size() if name == WINDOW_TIER else super().tier_free(name)

    # ------------------------------------------------------------------ alloc: a window slot per full slot
    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self._with_window(super().alloc(need_size))

    def alloc_extend(self, prefix_lens: torch.Tensor | Sequence[int], seq_lens: torch.Tensor | Sequence[int],
                     last_loc: torch.Tensor | Sequence[int], extend_num_tokens: int) -> torch.Tensor | None:
        return self._with_window(super().alloc_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens))

    def alloc_decode(self, seq_lens: torch.Tensor | Sequence[int],
                     last_loc: torch.Tensor | Sequence[int]) -> torch.Tensor | None:
        return self._with_window(super().alloc_decode(seq_lens, last_loc))

    def _with_window(self, full: torch.Tensor | None) -> torch.Tensor | None:
        """Map each new full slot to a new window slot; with too few window slots, undo and return None."""
        if full is None or full.numel() == 0:
            return full
        window = self.window.alloc(full.numel())
        if window is None:
            self._return_new(full)
            return None
        self.full_to_window[full.long()] = window
        return full

    def _return_new(self, full: torch.Tensor) -> None:
        """Give back the pages an allocation just took (a partial page it filled stays with its request)."""
        new_pages = torch.unique(full[full % self.page_size == 0] // self.page_size) if self.page_size > 1 else full
        if self.debug and len(new_pages):
            self._page_is_free[new_pages.cpu().long()] = True
        self._release_pages(new_pages.to(SLOT_DTYPE))

    # ------------------------------------------------------------------ free
    def free(self, free_index: torch.Tensor) -> None:
        """Free full slots (whole pages, as the base allocator does) and the window KV of every slot of them."""
        if free_index.numel() and self.is_not_in_free_group:
            self.free_window(self._slots_of_pages(free_index.to(device=self.device, dtype=SLOT_DTYPE)))
        super().free(free_index)

    def _slots_of_pages(self, slots: torch.Tensor) -> torch.Tensor:
        return self._page_slots(self._pages_of(slots)) if self.page_size > 1 else slots

    def free_window(self, full_slots: torch.Tensor) -> int:
        """Free the window KV of these full slots (those that have it); returns how many window slots were freed."""
        if full_slots.numel() == 0:
            return 0
        index = full_slots.long()
        window = self.full_to_window[index]
        present = window != 0
        count = int(present.sum())
        if count:
            self.window.free(window[present])
            self.full_to_window[index[present]] = 0
        return count

    def transfer_window(self, source: torch.Tensor, target: torch.Tensor) -> int:
        """For each pair (source[i], target[i]) of full slots holding the same token's KV where only the source
        has window KV, move it to the target (same values, so nothing is copied); returns how many moved."""
        src, dst = source.long(), target.long()
        moving = (self.full_to_window[src] != 0) & (self.full_to_window[dst] == 0) & (src != dst)
        count = int(moving.sum())
        if count:
            self.full_to_window[dst[moving]] = self.full_to_window[src[moving]]
            self.full_to_window[src[moving]] = 0
        return count

    # ------------------------------------------------------------------ reads
    def window_present(self, full_slots: torch.Tensor) -> torch.Tensor:
        """bool per full slot: its window KV is there."""
        return self.full_to_window[full_slots.long()] != 0

    def window_count(self, full_slots: torch.Tensor) -> int:
        return int((self.full_to_window[full_slots.long()] != 0).sum()) if full_slots.numel() else 0


class SWAKVPool(MHATokenToKVPool):
    """K/V buffers of a hybrid model: full layers sized for the full pool, window layers for the window pool.

    Buffers are indexed by the slot the layer uses: full slots for full layers, window slots (through
    `full_to_window`, the allocator's table, shared here read-only) for window layers. `is_hybrid` is True.
    """

    is_hybrid: ClassVar[bool] = True

    def __init__(self, size: int, window_size: int, page_size: int, dtype: torch.dtype, head_num: int,
                 head_dim: int, layer_windows: Sequence[int | None], full_to_window: torch.Tensor,
                 device: str | torch.device = "cpu") -> None:
        self.size, self.window_size, self.page_size, self.dtype = size, window_size, page_size, dtype
        self.head_num, self.head_dim, self.layer_num = head_num, head_dim, len(layer_windows)
        self.device = torch.device(device)
        self.full_to_window = full_to_window
        self.is_window_layer = [w is not None for w in layer_windows]
        self.k_buffer, self.v_buffer = [], []
        for windowed in self.is_window_layer:
            rows = window_size + 1 if windowed else size + page_size  # NOTE: row 0 is padding in both
            shape = (rows, head_num, head_dim)
            self.k_buffer.append(torch.zeros(shape, dtype=dtype, device=self.device))
            self.v_buffer.append(torch.zeros(shape, dtype=dtype, device=self.device))

    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffer + self.v_buffer)

    @staticmethod
    def split_bytes_per_token(head_num: int, head_dim: int, layer_windows: Sequence[int | None],
                              dtype: torch.dtype) -> tuple[int, int]:
        """Bytes one token takes in the full layers and in the window layers."""
        windowed = sum(w is not None for w in layer_windows)
        per_layer = MHATokenToKVPool.bytes_per_token(head_num, head_dim, 1, dtype)
        return per_layer * (len(layer_windows) - windowed), per_layer * windowed
