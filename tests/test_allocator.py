"""KV slot allocators: order of reuse, free groups, paged extend/decode, debug double-free checks."""

import pytest
import torch

from radixserve.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator


def t(values):
    return torch.tensor(values, dtype=torch.int64)


def test_token_allocator_hands_out_from_the_head_and_reuses_fifo():
    alloc = TokenToKVPoolAllocator(8)
    assert alloc.alloc(3).tolist() == [1, 2, 3]
    alloc.free(t([2]))
    assert alloc.free_pages.tolist() == [4, 5, 6, 7, 8, 2]
    assert alloc.available_size() == 6
    assert alloc.alloc(7) is None and alloc.available_size() == 6
    assert alloc.alloc(6).tolist() == [4, 5, 6, 7, 8, 2]
    assert alloc.alloc(1) is None
    assert alloc.alloc(0).numel() == 0


def test_free_group_collects_and_releases_once():
    alloc = TokenToKVPoolAllocator(8)
    slots = alloc.alloc(4)
    alloc.free_group_begin()
    alloc.free(slots[:2])
    alloc.free(slots[2:])
    assert alloc.available_size() == 4  # collected, not yet released
    alloc.free_group_end()
    assert alloc.available_size() == 8
    alloc.free_group_end()  # an empty group is harmless
    assert alloc.available_size() == 8


def test_paged_allocator_uses_whole_pages_and_reuses_lifo():
    alloc = PagedTokenToKVPoolAllocator(32, 4)
    assert alloc.num_pages == 8 and alloc.available_size() == 32
    first = alloc.alloc(8)
    assert first.tolist() == list(range(4, 12))  # pages 1 and 2; page 0 is reserved
    second = alloc.alloc(4)
    alloc.free(first[5:6])  # one slot frees its whole page (page 2)
    assert alloc.free_pages[0].item() == 2 and alloc.available_size() == 32 - 8
    alloc.free(second)
    assert alloc.alloc(4).tolist() == second.tolist()  # last freed, first reused
    with pytest.raises(ValueError):
        alloc.alloc(3)


def test_paged_size_is_rounded_down_to_pages():
    alloc = PagedTokenToKVPoolAllocator(10, 4)
    assert (alloc.size, alloc.num_pages) == (8, 2)
    with pytest.raises(ValueError):
        PagedTokenToKVPoolAllocator(8, 0)


def test_alloc_extend_fills_the_partial_page_then_takes_new_pages():
    alloc = PagedTokenToKVPoolAllocator(64, 4)
    owned = alloc.alloc(4)  # page 1 = slots 4..7; the request's prefix occupies slots 4, 5
    out = alloc.alloc_extend(prefix_lens=[2, 0], seq_lens=[9, 3], last_loc=[5, -1], extend_num_tokens=10)
    pages = alloc.free_pages  # page 2, 3 went to request A, page 4 to request B
    assert out.tolist() == [6, 7] + [8, 9, 10, 11] + [12] + [16, 17, 18]
    assert pages[0].item() == 5 and owned.tolist() == [4, 5, 6, 7]


def test_alloc_extend_is_all_or_nothing():
    alloc = PagedTokenToKVPoolAllocator(16, 4)  # 4 pages
    assert alloc.alloc_extend([0, 0], [9, 5], [-1, -1], 14) is None  # needs 3 + 2 = 5 pages
    assert alloc.available_size() == 16
    with pytest.raises(ValueError):
        alloc.alloc_extend([0], [4], [-1], 5)
    with pytest.raises(ValueError):
        alloc.alloc_extend([2], [4], [-1], 2)  # a partial page without its last slot


def test_alloc_decode_continues_the_page_or_opens_a_new_one():
    alloc = PagedTokenToKVPoolAllocator(32, 4)
    alloc.alloc(8)
    out = alloc.alloc_decode(seq_lens=[5, 6, 1], last_loc=[7, 9, -1])
    assert out.tolist() == [12, 10, 16]  # new page 3; slot after 9; new page 4
    assert alloc.available_size() == 32 - 16
    full = PagedTokenToKVPoolAllocator(4, 4)
    full.alloc(4)
    assert full.alloc_decode([5], [7]) is None


def test_token_allocator_extend_and_decode():
    alloc = TokenToKVPoolAllocator(16)
    assert alloc.alloc_extend([2, 0], [5, 2], [9, -1], 5).tolist() == [1, 2, 3, 4, 5]
    assert alloc.alloc_decode([6, 3], [3, 5]).tolist() == [6, 7]


@pytest.mark.parametrize("make", [lambda: TokenToKVPoolAllocator(8), lambda: PagedTokenToKVPoolAllocator(16, 4)])
def test_debug_mode_refuses_double_and_foreign_frees(make):
    alloc = make()
    assert alloc.debug
    slots = alloc.alloc(alloc.page_size * 2)
    alloc.free(slots[: alloc.page_size])
    with pytest.raises(ValueError, match="double free"):
        alloc.free(slots[: alloc.page_size])
    with pytest.raises(ValueError, match="outside the pool"):
        alloc.free(t([0]))
    with pytest.raises(ValueError, match="outside the pool"):
        alloc.free(t([alloc.size + alloc.page_size]))
    never = alloc.free_pages[-1].item() * alloc.page_size
    with pytest.raises(ValueError, match="never allocated"):
        alloc.free(t([never]))
    alloc.free_group_begin()
    alloc.free(slots[alloc.page_size:])
    with pytest.raises(ValueError, match="free group"):
        alloc.free(slots[alloc.page_size:])
    alloc.free_group_end()
    assert alloc.available_size() == alloc.size


def test_debug_mode_refuses_a_slot_repeated_in_one_call():
    alloc = TokenToKVPoolAllocator(8)
    slots = alloc.alloc(2)
    with pytest.raises(ValueError, match="repeated"):
        alloc.free(torch.cat([slots, slots[:1]]))
    assert alloc.available_size() == 6  # nothing was released by the refused call


def test_without_debug_no_check_is_made(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_DEBUG_ALLOC", "0")
    alloc = TokenToKVPoolAllocator(4)
    slots = alloc.alloc(2)
    alloc.free(slots)
    alloc.free(slots)  # corrupts the free list silently: exactly why the tests turn debug on
    assert alloc.available_size() == 6


def test_clear_restores_everything():
    alloc = PagedTokenToKVPoolAllocator(16, 4)
    alloc.alloc(8)
    alloc.clear()
    assert alloc.available_size() == 16 and alloc.alloc(16).tolist() == list(range(4, 20))
