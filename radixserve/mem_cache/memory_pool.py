"""The request-to-token table and the KV buffers that attention reads."""

from __future__ import annotations

from typing import ClassVar

import torch

# NOTE: the one dtype of KV slot ids, from the allocator through the tree and `req_to_token` to the
# attention kernels: no conversion on the way (a pool holds far fewer than 2**31 slots).
SLOT_DTYPE = torch.int32


class ReqToTokenPool:
    """Maps (request row, position) to a KV slot. Row 0 is padding and never handed out."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=SLOT_DTYPE, device=self.device)
        self.free_slots: list[int] = list(range(1, size + 1))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int = 1) -> list[int] | None:
        if need_size > len(self.free_slots):
            return None
        taken, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return taken

    def free(self, free_index: int | list[int]) -> None:
        indices = [free_index] if isinstance(free_index, int) else list(free_index)
        free_now = set(self.free_slots)
        for idx in indices:
            if not 1 <= idx <= self.size:
                raise ValueError(f"request row {idx} is outside 1..{self.size}")
            if idx in free_now:
                raise ValueError(f"request row {idx} freed twice")
            free_now.add(idx)
        # NOTE: appended at the tail, so rows are reused in FIFO order, as in SGLang.
        self.free_slots.extend(indices)

    def clear(self) -> None:
        self.free_slots = list(range(1, self.size + 1))


class MHATokenToKVPool:
    """Per-layer K and V buffers of shape [size + page_size, num_kv_heads, head_dim].

    Slot 0 (page 0) is never handed out by an allocator; padded tokens write their K/V there.

    Declared for attention (tiers.py): `is_hybrid` False and `full_to_window` None, every layer reads these
    buffers by full slot; a hybrid pool (`SWAKVPool`) sets both.
    """

    # NOTE: attention reads these, never probes the pool's class (one place per decision)
    is_hybrid: ClassVar[bool] = False
    full_to_window: torch.Tensor | None = None

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 layer_num: int, device: str | torch.device = "cpu") -> None:
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = torch.device(device)
        shape = (size + page_size, head_num, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layer_num)]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        self.k_buffer[layer_id][loc] = cache_k.to(self.dtype)
        self.v_buffer[layer_id][loc] = cache_v.to(self.dtype)

    @staticmethod
    def bytes_per_token(head_num: int, head_dim: int, layer_num: int, dtype: torch.dtype) -> int:
        return 2 * head_num * head_dim * layer_num * torch.tensor([], dtype=dtype).element_size()
