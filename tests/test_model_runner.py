"""ModelRunner: pool sizing, defaults, paged KV, and errors; on a tiny random Llama."""

from __future__ import annotations

import logging

import pytest
import torch
from direct_driver import DirectDriver
from test_model_support import make_tiny_model, one_torch_thread

from radixserve import platform
from radixserve.forward_batch import ForwardBatch, ForwardMode
from radixserve.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixserve.mem_cache.conservation import check_conservation
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.models.loader import load_model
from radixserve.server_args import ServerArgs

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny_model(folder, "llama")
    return folder


def _runner(folder, **kw) -> ModelRunner:
    # NOTE: a fresh LoadedModel each time: the runner casts the model it is given in place.
    loaded = load_model(str(folder), torch.float32, "cpu")
    return ModelRunner(ServerArgs(model_path=str(folder), device="cpu", **kw), loaded=loaded)


def test_defaults_and_startup_log(tiny, caplog):
    with caplog.at_level(logging.INFO, logger="radixserve.model_executor.model_runner"):
        runner = _runner(tiny, max_total_tokens=512)
    auto = platform.choose_dtype("auto", "cpu")  # bfloat16 where bf16 matmuls are native (or measured fast)
    assert runner.dtype == getattr(torch, auto.dtype) and next(runner.model.parameters()).dtype == runner.dtype
    assert runner.max_total_num_tokens == 512 and runner.context_len == 512
    assert runner.max_running_requests == 64
    assert runner.req_to_token_pool.req_to_token.shape == (65, 516)
    assert type(runner.token_to_kv_pool_allocator) is TokenToKVPoolAllocator
    assert runner.token_to_kv_pool.k_buffer[0].shape == (513, 2, 16)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("model "))
    for part in (f"dtype {auto.dtype} ({auto.reason})", "KV pool 512 tokens", "page size 1", "max running requests 64", "max context 512"):
        assert part in line


def test_pool_from_memory_fraction(tiny):
    runner = _runner(tiny, dtype="float32", mem_fraction_static=0.001)
    per_token = 2 * 2 * 16 * 2 * 4  # K and V, kv heads, head dim, layers, float32 bytes
    assert runner.max_total_num_tokens > 100
    assert runner.max_total_num_tokens * per_token < 0.0011 * _available()


def _available() -> int:
    from radixserve.model_executor.model_runner import _cpu_available_bytes

    return _cpu_available_bytes()


def test_context_length_override_and_limit(tiny):
    assert _runner(tiny, max_total_tokens=256, context_length=100).context_len == 100
    with pytest.raises(ValueError, match="longer than the model's 512"):
        _runner(tiny, max_total_tokens=256, context_length=4096)


def test_paged_pool_gives_the_same_logits(tiny):
    """page_size 4 changes where K/V live, not what attention sees."""
    prompts = [list(range(3, 12)), list(range(40, 45))]
    results = []
    for page_size in (1, 4):
        runner = _runner(tiny, dtype="float32", max_total_tokens=256, page_size=page_size)
        driver = DirectDriver(runner)
        reqs = [driver.new_request() for _ in prompts]
        steps = [driver.extend(reqs, prompts)]
        for _ in range(6):
            steps.append(driver.decode(reqs, steps[-1].argmax(-1).tolist()))
        driver.release(reqs)
        check_conservation(runner.token_to_kv_pool_allocator, None, runner.req_to_token_pool, [])
        if page_size == 4:
            assert type(runner.token_to_kv_pool_allocator) is PagedTokenToKVPoolAllocator
        results.append(torch.stack(steps))
    assert torch.allclose(results[0], results[1], atol=1e-5)


def test_idle_forward_and_sample(tiny):
    runner = _runner(tiny, dtype="float32", max_total_tokens=64)
    idle = ForwardBatch(ForwardMode.IDLE, 0, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long),
                        torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long),
                        torch.empty(0, dtype=torch.long), [])
    assert runner.forward(idle).shape == (0, 256)
    from radixserve.layers.sampler import SamplingBatchInfo
    from radixserve.sampling_params import SamplingParams

    logits = torch.randn(3, 256)
    info = SamplingBatchInfo.from_params([SamplingParams(temperature=0)] * 3, [0, 0, 0], "cpu")
    assert runner.sample(logits, info).tolist() == logits.argmax(-1).tolist()


def test_pool_too_small(tiny):
    with pytest.raises(ValueError, match="raise --max-total-tokens"):
        _runner(tiny, mem_fraction_static=1e-12)


def test_torch_threads_is_applied_only_when_asked(tiny):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _runner(tiny, max_total_tokens=64)
        assert torch.get_num_threads() == 2
        _runner(tiny, max_total_tokens=64, torch_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
