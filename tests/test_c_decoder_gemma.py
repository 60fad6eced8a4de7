"""The one-call C decoder on Gemma 3's layers (csrc/decode_gemma.h): q/k norms, four (1 + w) norms per layer,
GeGLU, a rotary per layer type, window and full layers in their attention groups, with a hybrid KV pool and
without. Against the Python layers on a tiny random Gemma 3 (window 8, prompts past it); Gemma 2's soft-capped
attention is declined with its reason. The pool is conserved after every run (`_step_run`)."""

from __future__ import annotations

import pytest
import torch
from kernel_levels import force_level
from test_c_decoder_window import _step_run
from test_model_gemma3 import make_tiny_gemma3
from test_model_support import one_torch_thread, rel_err

from radixserve.kernels.c_decoder import F32_LEVELS
from radixserve.layers.gemv import load_gemv_kernel
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3-step")
    make_tiny_gemma3(folder)
    return folder


def _runner(folder, monkeypatch, on: bool, dtype: str, linear_method: str, hybrid: bool = True) -> ModelRunner:
    monkeypatch.setenv("RADIXSERVE_DECODE_STEP", "1" if on else "0")
    runner = ModelRunner(ServerArgs(model_path=str(folder), dtype=dtype, device="cpu", max_total_tokens=2048,
                                    attention_backend="cpu", linear_method=linear_method,
                                    disable_hybrid_swa_memory=not hybrid))
    assert (runner.model.c_decoder is not None) == on, runner.execution_plan.as_dict()["decoder"]
    return runner


@pytest.mark.skipif(load_gemv_kernel() is None, reason="needs AVX512-BF16 (the bf16 C decoder)")
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "one-pool"])
@pytest.mark.parametrize("bs", [1, 4])
def test_bf16_gemma_step_matches_python_layers(folder, monkeypatch, hybrid, bs):
    runs = {on: _step_run(_runner(folder, monkeypatch, on, "bfloat16", "onednn_gemv", hybrid), bs)
            for on in (False, True)}
    (off_logits, _, off_tokens), (on_logits, calls, on_tokens) = runs[False], runs[True]
    assert calls == [bs] * 5
    # NOTE: bit-equal, as the Llama loop: every pass rounds to bf16 where the eager layers store a bf16 tensor, and
    # the float32 parts (the norms' sum of squares, GeGLU's exponential) agree with torch's to the last bit here
    for off, on in zip(off_logits, on_logits, strict=True):
        assert torch.equal(on, off)
    assert on_tokens == off_tokens


LEVELS = [pytest.param(isa, id=isa) for isa in reversed(F32_LEVELS) if isa != "avx512_bf16"]


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "one-pool"])
def test_f32_gemma_step_matches_python_layers(folder, monkeypatch, isa, hybrid):
    force_level(isa, monkeypatch)
    runs = {on: _step_run(_runner(folder, monkeypatch, on, "float32", "bf16_weights", hybrid), 5)
            for on in (False, True)}
    (off_logits, _, off_tokens), (on_logits, calls, on_tokens) = runs[False], runs[True]
    assert calls == [5] * 5
    # NOTE: not bit-equal (torch's exp and summation order differ in the last bits): ~3e-7 on this model
    for off, on in zip(off_logits[1:], on_logits[1:], strict=True):
        assert rel_err(on, off) < 1e-5
    assert on_tokens == off_tokens


def test_the_plan_runs_gemma3_in_c_and_says_why_gemma2_stays_in_python(folder, tmp_path, monkeypatch):
    from test_model_gemma2 import make_tiny_gemma2

    monkeypatch.setenv("RADIXSERVE_DECODE_STEP", "1")
    args = {"dtype": "float32", "device": "cpu", "max_total_tokens": 512, "attention_backend": "cpu",
            "linear_method": "bf16_weights"}
    gemma3 = ModelRunner(ServerArgs(model_path=str(folder), **args)).execution_plan.as_dict()["decoder"]
    assert gemma3["choice"] == "C decoder", gemma3
    make_tiny_gemma2(tmp_path)
    gemma2 = ModelRunner(ServerArgs(model_path=str(tmp_path), **args)).execution_plan.as_dict()["decoder"]
    assert gemma2["choice"] == "python layers" and "soft-capped attention" in gemma2["reason"], gemma2
