"""Our Llama-family forward against transformers on tiny random models, float32 (rel. error < 1e-4)."""

from __future__ import annotations

import pytest
import torch
from direct_driver import DirectDriver
from test_model_support import hf_last_logits, make_tiny_model, one_torch_thread, rel_err

from radixserve.mem_cache.conservation import check_conservation
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

TOL = 1e-4
# (architecture, attention backend): every architecture on the portable torch backend, two on the
# CPU backend, whose decode runs in the native kernel (or falls back to torch without a compiler).
CASES = [("llama", "torch"), ("llama3", "torch"), ("mistral", "torch"), ("qwen2", "torch"), ("qwen3", "torch"),
         ("llama", "cpu"), ("qwen3", "cpu")]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def setup(request, tmp_path_factory):
    arch, backend = request.param
    folder = tmp_path_factory.mktemp(arch)
    hf_model = make_tiny_model(folder, arch)
    args = ServerArgs(model_path=str(folder), dtype="float32", device="cpu", max_total_tokens=1024,
                      attention_backend=backend)
    runner = ModelRunner(args)
    return arch, hf_model, runner


@pytest.fixture
def driver(setup):
    _, _, runner = setup
    driver = DirectDriver(runner)
    yield driver
    driver.release_all()
    report = check_conservation(runner.token_to_kv_pool_allocator, None, runner.req_to_token_pool, [])
    assert report is not None
    assert runner.token_to_kv_pool_allocator.available_size() == runner.max_total_num_tokens


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def test_loaded_config_matches(setup):
    arch, hf_model, runner = setup
    cfg = runner.model_config
    assert cfg.num_layers == hf_model.config.num_hidden_layers
    assert cfg.qk_norm == (arch == "qwen3")
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.eos_token_ids == (1,)


def test_prefill_batch_of_three(setup, driver):
    _, hf_model, _ = setup
    prompts = _prompts([5, 17, 11], seed=1)
    reqs = [driver.new_request() for _ in prompts]
    logits = driver.extend(reqs, prompts)
    assert logits.shape == (3, 256) and logits.dtype == torch.float32
    for i, prompt in enumerate(prompts):
        assert rel_err(logits[i], hf_last_logits(hf_model, prompt)) < TOL
    driver.release(reqs)


def test_extend_over_cached_prefix(setup, driver):
    """The prefix KV is already in the pool (computed by another request); only the tail is computed."""
    _, hf_model, _ = setup
    shared, tail_a, tail_b, other = _prompts([12, 7, 1, 9], seed=2)
    owner = driver.new_request()
    driver.extend([owner], [shared + [5, 6]])
    a = driver.new_request(share_prefix_of=owner, prefix_len=12)
    b = driver.new_request(share_prefix_of=owner, prefix_len=8)
    fresh = driver.new_request()
    logits = driver.extend([a, fresh, b], [tail_a, other, shared[8:] + tail_b])
    assert rel_err(logits[0], hf_last_logits(hf_model, shared + tail_a)) < TOL
    assert rel_err(logits[1], hf_last_logits(hf_model, other)) < TOL
    assert rel_err(logits[2], hf_last_logits(hf_model, shared + tail_b)) < TOL
    driver.release([owner, a, b, fresh])


def test_twenty_decode_steps_batch_of_four(setup, driver):
    _, hf_model, _ = setup
    prompts = _prompts([3, 14, 8, 21], seed=3)
    reqs = [driver.new_request() for _ in prompts]
    logits = driver.extend(reqs, prompts)
    worst = 0.0
    for _ in range(20):
        tokens = logits.argmax(-1).tolist()
        logits = driver.decode(reqs, tokens)
        for i, req in enumerate(reqs):
            worst = max(worst, rel_err(logits[i], hf_last_logits(hf_model, req.token_ids)))
    assert worst < TOL
    assert [len(r.token_ids) for r in reqs] == [23, 34, 28, 41]
    driver.release(reqs)
