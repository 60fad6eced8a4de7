"""The float32 decode linear method (layers/f32_gemv.py, csrc/f32_gemv.c): the kernel at every level this CPU
runs against a float64 product, the method on both sides of its oneDNN threshold, and timing may pick it
(it keeps the weights' values)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_levels import LEVELS, skip_unless_runnable
from test_model_support import one_torch_thread

from radixserve import envs
from radixserve.configs.row_table import DEFAULT_ROWS
from radixserve.kernels.gemv import load_f32_kernel
from radixserve.layers.f32_gemv import F32GemvLinearMethod
from radixserve.layers.linear import LinearBase
from radixserve.layers.linear_tuning import candidates

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

# (N, K, rows): N not a multiple of the 4-row block, K not a multiple of the vector width, rows past every row
# group (2 on AVX2, 4 on AVX-512)
SHAPES = [(1, 1, 1), (3, 7, 2), (17, 64, 3), (100, 38, 9), (576, 576, 1), (1536, 576, 5), (33, 130, 70)]


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("n, k, rows", SHAPES, ids=[f"{n}x{k}-rows{r}" for n, k, r in SHAPES])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_kernel_matches_float64(isa, n, k, rows, with_bias, monkeypatch):
    skip_unless_runnable(isa)
    monkeypatch.setenv(envs.CPU_ISA.name, isa)
    kernel = load_f32_kernel()
    if kernel is None:
        pytest.skip("no C compiler here")
    assert kernel.level == isa
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    got = kernel(w, x, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    want = x.double() @ w.double().T + (0 if bias is None else bias.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5)


def test_kernel_refuses_an_empty_product():
    kernel = load_f32_kernel()
    if kernel is None:
        pytest.skip("no C compiler here")
    with pytest.raises(ValueError, match="f32_gemv rejected"):
        kernel(torch.zeros(4, 0), torch.zeros(1, 0), None)


@pytest.mark.parametrize("rows", [1, 3, DEFAULT_ROWS.f32_gemv_rows, DEFAULT_ROWS.f32_gemv_rows + 1, 300])
def test_method_on_both_sides_of_its_threshold(rows):
    if not F32GemvLinearMethod.supports(torch.device("cpu"), torch.float32):
        pytest.skip("no C compiler here")
    torch.manual_seed(rows)
    layer = LinearBase(96, 40, bias=True)
    with torch.no_grad():
        layer.weight.normal_(0, 0.1)
        layer.bias.normal_(0, 0.1)
    x = torch.randn(rows, 96)
    want = x.double() @ layer.weight.double().T + layer.bias.double()
    method = F32GemvLinearMethod()
    layer.method = method
    method.process_weights_after_loading(layer)
    got = layer(x)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5)
    # NOTE: the C decoder calls the same function the method runs below the threshold, and none above
    assert (method.c_linear(rows, torch.float32) is not None) == (rows <= DEFAULT_ROWS.f32_gemv_rows)
    assert method.c_linear(1, torch.bfloat16) is None
    # NOTE: the layer's parameter is emptied by the loader (oneDNN's copy is the method's own weight); the GEMV
    # keeps the loaded storage
    assert method.own_weight() is not None and method.c_weight.data_ptr() == layer.weight.data_ptr()
    assert len(method.own_forms()) == 2


def test_timing_may_pick_it():
    """It keeps the weights' values, so it is a timed candidate for float32 (not for bf16)."""
    if not F32GemvLinearMethod.supports(torch.device("cpu"), torch.float32):
        pytest.skip("no C compiler here")
    assert "f32_gemv" in candidates(torch.device("cpu"), torch.float32)
    assert "f32_gemv" not in candidates(torch.device("cpu"), torch.bfloat16)


def test_the_method_reads_its_threshold_from_the_row_table_it_is_given():
    """The plan's table decides (configs/row_table.py): a table with another f32_gemv limit moves the switch."""
    if not F32GemvLinearMethod.supports(torch.device("cpu"), torch.float32):
        pytest.skip("no C compiler here")
    layer = LinearBase(96, 40, bias=False)
    method = F32GemvLinearMethod()
    layer.method = method
    method.process_weights_after_loading(layer)
    method.rows = dataclasses.replace(DEFAULT_ROWS, f32_gemv_rows=2)
    assert method.c_linear(2, torch.float32) is not None and method.c_linear(3, torch.float32) is None
    assert method.row_kernels(96).startswith("1-2 rows f32_gemv")
    x = torch.randn(3, 96)
    torch.testing.assert_close(layer(x), x @ layer.weight.T, rtol=1e-5, atol=2e-5)  # oneDNN from 3 rows
