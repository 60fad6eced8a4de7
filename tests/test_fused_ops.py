"""Fused CPU ops (AOTInductor): each equals its eager definition (bf16: the same rounding, bit for bit but
for the float32 sum order of RMSNorm), any token count, the KV write touches only its slots, compiled
packages are reused across loads, and the model gives the same logits with the ops on and off."""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
from direct_driver import DirectDriver
from test_model_support import make_tiny_model, one_torch_thread, rel_err

from radixserve.layers import aot_cache
from radixserve.layers.fused_ops import AddRMSNorm, RotaryKV, SiluAndMul, load_fused_ops
from radixserve.mem_cache.memory_pool import SLOT_DTYPE
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)
CPU = torch.device("cpu")
# the shapes of the tiny test models (test_model_support.tiny_hf_config), so the compiled ops are shared
TINY = SimpleNamespace(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                       rms_norm_eps=1e-6, qk_norm=False)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def ops(request):
    fused = load_fused_ops(TINY, request.param, CPU)
    assert fused is not None, "compiling the fused ops failed (see the warning in the log)"
    return fused


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # NOTE: a different float32 summation order may flip a bf16 rounding, by one unit in the last place
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 3, 257])
def test_add_rmsnorm_and_silu_equal_eager(ops, tokens):
    g = torch.Generator().manual_seed(tokens)
    x, residual = (torch.randn(tokens, 64, generator=g).to(ops.dtype) for _ in range(2))
    weight = (torch.rand(64, generator=g) + 0.5).to(ops.dtype)
    normed, summed = ops.add_rmsnorm(x, residual, weight)
    want_normed, want_summed = AddRMSNorm(TINY.rms_norm_eps)(x, residual, weight)
    assert torch.equal(summed, want_summed)
    _close(normed, want_normed)
    gate_up = torch.randn(tokens, 256, generator=g).to(ops.dtype)
    assert torch.equal(ops.silu_and_mul(gate_up), SiluAndMul()(gate_up))


@pytest.mark.parametrize("tokens", [1, 40])
def test_rotary_kv_equals_eager_and_writes_only_its_slots(ops, tokens):
    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads, dim = TINY.num_heads, TINY.num_kv_heads, TINY.head_dim
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(ops.dtype)
    positions = torch.randint(0, 500, (tokens,), generator=g)
    angles = torch.outer(torch.arange(512.0), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    cos, sin = angles.cos(), angles.sin()
    loc = (torch.randperm(99, generator=g)[:tokens] + 1).to(SLOT_DTYPE)  # as the allocator hands slots out
    k_cache, v_cache = (torch.randn(100, kv_heads, dim, generator=g).to(ops.dtype) for _ in range(2))
    k_want, v_want = k_cache.clone(), v_cache.clone()
    got = ops.rotary_kv(qkv, positions, cos, sin, k_cache, v_cache, loc)
    want = RotaryKV(heads, kv_heads, dim)(qkv, positions, cos, sin, k_want, v_want, loc)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)  # untouched rows too
    assert torch.equal(k_cache[loc], got[1]) and torch.equal(v_cache[loc], got[2])


def test_packages_reused_not_recompiled(ops, monkeypatch):
    again = load_fused_ops(TINY, ops.dtype, CPU)
    assert again.add_rmsnorm is ops.add_rmsnorm  # the same loaded package within a process
    # NOTE: an earlier test may have loaded these ops from another cache folder; start from this one
    monkeypatch.setattr(aot_cache, "_loaded", {})
    first = load_fused_ops(TINY, ops.dtype, CPU)
    monkeypatch.setattr(aot_cache, "_loaded", {})  # a new process: loads the file, compiles nothing
    monkeypatch.setattr(aot_cache, "_compile", lambda *a: pytest.fail("compiled again"))
    fresh = load_fused_ops(TINY, ops.dtype, CPU)
    assert fresh.add_rmsnorm.path == first.add_rmsnorm.path and fresh.add_rmsnorm.path.exists()


def test_loading_leaves_nothing_unpacked(ops, monkeypatch, tmp_path):
    """A killed process never runs the loader's clean-up, so nothing it unpacked may outlive the load."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # NOTE: Python caches the temp folder it found first
    monkeypatch.setattr(aot_cache, "_loaded", {})
    fresh = load_fused_ops(TINY, ops.dtype, CPU)
    assert list(tmp_path.iterdir()) == [] and os.environ["TMPDIR"] == str(tmp_path)
    gate_up = torch.randn(3, 256).to(ops.dtype)
    assert torch.equal(fresh.silu_and_mul(gate_up), SiluAndMul()(gate_up))  # the mapped library still runs


def test_not_on_other_devices():
    assert load_fused_ops(TINY, torch.float32, torch.device("meta")) is None


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    make_tiny_model(folder, "llama")
    return folder


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_model_logits_fused_on_equal_off(tiny_folder, backend):
    """Prefill of a batch, extension over a cached prefix, decode: float32 logits with the ops on and off."""
    outputs = []
    for disable in (True, False):
        runner = ModelRunner(ServerArgs(model_path=str(tiny_folder), dtype="float32", device="cpu",
                                        max_total_tokens=512, attention_backend=backend, disable_fused_ops=disable))
        assert (runner.model.fused_ops is None) == disable
        assert bool(runner.device_setup.fused_ops) != disable
        driver = DirectDriver(runner)
        a, b = driver.new_request(), driver.new_request()
        logits = [driver.extend([a, b], [list(range(3, 40)), list(range(50, 61))])]
        c = driver.new_request(share_prefix_of=a, prefix_len=20)
        logits.append(driver.extend([c], [list(range(70, 75))]))
        for step in range(3):
            logits.append(driver.decode([a, b, c], [5 + step, 6, 7]))
        driver.release_all()
        outputs.append(logits)
    for off, on in zip(*outputs, strict=True):
        assert rel_err(on, off) < 1e-5
