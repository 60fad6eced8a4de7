import pytest
import torch

from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


def test_req_to_token_pool_reserves_row_zero_and_reuses_fifo():
    pool = ReqToTokenPool(size=3, max_context_len=8)
    assert pool.req_to_token.shape == (4, 8) and pool.req_to_token.dtype == torch.int32
    assert pool.alloc(2) == [1, 2]
    assert pool.alloc(2) is None and pool.available_size() == 1
    pool.free(1)
    assert pool.alloc(2) == [3, 1]
    with pytest.raises(ValueError, match="twice"):
        pool.free([2, 2])
    with pytest.raises(ValueError, match="outside"):
        pool.free(0)


def test_kv_pool_shapes_and_writes():
    pool = MHATokenToKVPool(size=16, page_size=4, dtype=torch.float32, head_num=2, head_dim=8, layer_num=3)
    k, v = pool.get_kv_buffer(2)
    assert k.shape == (20, 2, 8) and v.shape == (20, 2, 8)
    loc = torch.tensor([5, 9])
    pool.set_kv_buffer(1, loc, torch.ones(2, 2, 8), torch.full((2, 2, 8), 2.0))
    assert pool.k_buffer[1][loc].eq(1).all() and pool.v_buffer[1][loc].eq(2).all()
    assert pool.k_buffer[0].abs().sum() == 0
    assert MHATokenToKVPool.bytes_per_token(3, 64, 30, torch.bfloat16) == 2 * 3 * 64 * 30 * 2
