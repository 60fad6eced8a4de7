"""The bf16 GEMV linear method: the tile-interleaved layout, the GEMV and AMX kernels against a float32
product at every row count and ragged shapes, which kernel takes which row count (and oneDNN above), and
where it must not run (float32, a CPU or forced kernel level without AVX512-BF16, no AMX)."""

from __future__ import annotations

import pytest
import torch

from radixserve import platform as rs_platform
from radixserve.configs.row_table import DEFAULT_ROWS, GEMV_LIMIT, RowTable
from radixserve.kernels import gemv as gemv_kernels
from radixserve.layers import gemv
from radixserve.layers.linear import LinearBase, process_weights_after_loading
from radixserve.layers.linear_tuning import candidates

CPU = torch.device("cpu")
HAS_KERNEL = gemv_kernels.load_gemv_kernel() is not None
HAS_AMX = gemv_kernels.load_amx_kernel() is not None


def _layer(in_features: int, out_features: int, bias: bool, seed: int = 0) -> LinearBase:
    g = torch.Generator().manual_seed(seed)
    layer = LinearBase(in_features, out_features, bias=bias)
    layer.weight.data = torch.randn(out_features, in_features, generator=g).bfloat16()
    if bias:
        layer.bias.data = torch.randn(out_features, generator=g).bfloat16()
    return layer


def test_pack_layout_puts_pairs_of_64_rows_side_by_side():
    w = torch.arange(70 * 6, dtype=torch.float32).view(70, 6).bfloat16()
    packed = gemv_kernels.pack_gemv_weight(w)
    assert packed.shape == (2, 3, gemv_kernels.TILE, 2)  # 70 rows -> two tiles, the second padded with zeros
    for row, pair in ((0, 0), (5, 2), (63, 1), (64, 0), (69, 2)):
        assert torch.equal(packed[row // 64, pair, row % 64], w[row, 2 * pair : 2 * pair + 2])
    assert not packed[1, :, 6:].any()
    with pytest.raises(ValueError, match="even number"):
        gemv_kernels.pack_gemv_weight(torch.zeros(4, 5, dtype=torch.bfloat16))


@pytest.mark.skipif(not HAS_KERNEL, reason="needs AVX512-BF16 at the kernel level (the other CPUs: test below)")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 13, 32, 64])
@pytest.mark.parametrize(("n", "k", "bias"), [(64, 32, False), (100, 78, True), (960, 576, False), (17, 2, True),
                                              (130, 2200, True)])
def test_kernel_matches_float32_product(rows, n, k, bias):
    """Rows in blocks of up to 6 (near-equal), inputs in slices of 1,024 pairs (k 2200: three slices)."""
    layer = _layer(k, n, bias)
    x = torch.randn(rows, k).bfloat16()
    want = torch.nn.functional.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    got = gemv_kernels.load_gemv_kernel()(gemv_kernels.pack_gemv_weight(layer.weight), x, layer.bias, n)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # NOTE: bf16 products summed in float32, then one rounding to bf16 (relative 2^-8) of each output
    assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.skipif(not HAS_KERNEL, reason="needs AVX512-BF16 at the kernel level")
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("n", "k", "bias"), [(64, 32, False), (17, 2, True), (100, 78, True), (448, 96, False),
                                              (960, 576, True), (130, 2200, False)])
def test_one_row_in_lockstep_equals_the_tiles_sums(threads, n, k, bias):
    """M == 1 walks up to 4 tiles per thread in lockstep (csrc/gemv_one_row.h): the same sums in the same order as
    the tiled rows, so row r of a 2-row product equals the 1-row product of x[r], bit for bit; on AMX CPUs the AMX
    entry point takes that path for one row too. Tile counts of 1, 2, 7 and 15 over 1-3 threads: runs of 1-4."""
    layer, before = _layer(k, n, bias, seed=n), torch.get_num_threads()
    packed, x = gemv_kernels.pack_gemv_weight(layer.weight), torch.randn(2, k).bfloat16()
    torch.set_num_threads(threads)
    try:
        kernel = gemv_kernels.load_gemv_kernel()
        pair = kernel(packed, x, layer.bias, n)
        singles = [kernel(packed, x[r : r + 1].contiguous(), layer.bias, n) for r in range(2)]
        amx = gemv_kernels.load_amx_kernel()
        on_amx = [] if amx is None else [amx(packed, x[r : r + 1].contiguous(), layer.bias, n) for r in range(2)]
    finally:
        torch.set_num_threads(before)
    for r in range(2):
        assert torch.equal(singles[r].view(torch.int16), pair[r : r + 1].view(torch.int16))
        if on_amx:
            assert torch.equal(on_amx[r].view(torch.int16), singles[r].view(torch.int16))


@pytest.mark.skipif(not HAS_KERNEL, reason="needs AVX512-BF16 at the kernel level")
def test_kernel_refuses_more_rows_than_it_holds():
    layer = _layer(32, 64, bias=False)
    x = torch.randn(GEMV_LIMIT + 1, 32).bfloat16()
    with pytest.raises(ValueError, match="rejected"):
        gemv_kernels.load_gemv_kernel()(gemv_kernels.pack_gemv_weight(layer.weight), x, None, 64)


@pytest.mark.skipif(not HAS_AMX, reason="needs AMX-BF16 (and the OS's permission to use it)")
@pytest.mark.parametrize(("kernel", "rows"), [*(("amx", r) for r in (1, 2, 5, 16, 17, 32)),
                                              *(("large", r) for r in (1, 16, 17, 33, 100, 257, 300))])
@pytest.mark.parametrize(("n", "k", "bias"), [(64, 32, False), (100, 96, True), (960, 576, False), (70, 1536, True)])
def test_amx_kernels_match_float32_product(kernel, rows, n, k, bias):
    """The large product: 32-row blocks in chunks of 256 rows, a last block of 1-31 rows (one or two passes)."""
    layer = _layer(k, n, bias, seed=rows)
    x = torch.randn(rows, k).bfloat16()
    want = torch.nn.functional.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    fn = gemv_kernels.load_amx_kernel() if kernel == "amx" else gemv_kernels.load_amx_large_kernel()
    got = fn(gemv_kernels.pack_gemv_weight(layer.weight), x, layer.bias, n)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.skipif(not HAS_AMX, reason="needs AMX-BF16")
def test_amx_kernel_rejects_what_it_cannot_take():
    amx, packed = gemv_kernels.load_amx_kernel(), gemv_kernels.pack_gemv_weight(torch.zeros(64, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError):  # 48 inputs: not whole 32-input steps
        amx(packed, torch.zeros(2, 48, dtype=torch.bfloat16), None, 64)
    packed = gemv_kernels.pack_gemv_weight(torch.zeros(64, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError):  # more rows than its two A tiles
        amx(packed, torch.zeros(33, 32, dtype=torch.bfloat16), None, 64)


@pytest.mark.skipif(not HAS_AMX, reason="needs AMX-BF16")
def test_large_rows_route_to_the_large_product(monkeypatch):
    layer = _layer(96, 160, bias=True)
    process_weights_after_loading(layer, {(160, 96): "onednn_gemv"})
    calls = []
    large = layer.method.large
    monkeypatch.setattr(layer.method, "large", lambda *a: calls.append(a[1].shape[0]) or large(*a))
    layer.method.large_rows = frozenset({128, 1024})
    assert gemv.grid_point(100) == 128 and gemv.grid_point(1000) == 1024 and gemv.grid_point(5000) == 0
    for rows in (33, 64, 65, 100, 128, 129, 1000, 3000):
        x = torch.randn(rows, 96).bfloat16()
        want = torch.nn.functional.linear(x.float(), layer.dense_weight().float(), layer.bias.float())
        assert torch.allclose(layer(x).float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert calls == [65, 100, 128, 1000]  # the rows whose grid point won; 33-64 and 129-192: oneDNN


def _expected_kernel(tokens: int, in_features: int) -> str:
    if HAS_AMX and in_features % 32 == 0 and tokens <= DEFAULT_ROWS.amx_rows:
        return "amx"
    return "gemv" if tokens <= DEFAULT_ROWS.bf16_gemv_rows else "onednn"


@pytest.mark.skipif(not HAS_KERNEL, reason="needs AVX512-BF16 at the kernel level")
@pytest.mark.parametrize("tokens", [1, 2, 4, 5, 8, 9, 32, 64])
@pytest.mark.parametrize(("in_features", "out_features"), [(96, 160), (96, 1100), (80, 160)])
def test_method_routes_rows_to_gemv_amx_and_onednn(tokens, in_features, out_features, monkeypatch):
    layer = _layer(in_features, out_features, bias=True)
    x = torch.randn(tokens, in_features).bfloat16()
    want = layer(x).float()  # dense
    shape = (out_features, in_features)
    process_weights_after_loading(layer, {shape: "onednn_gemv"})
    assert layer.method.name == "onednn_gemv" and layer.weight.numel() == 0
    forms = 1 if layer.method.shares_onednn_buffer else 2  # one where oneDNN's layout is the GEMV's, else both
    assert layer.weight_nbytes() >= forms * out_features * in_features * 2
    calls = []
    for attr, name in (("kernel", "gemv"), ("amx", "amx")):
        fn = getattr(layer.method, attr)
        if fn is not None:
            monkeypatch.setattr(layer.method, attr, lambda *a, fn=fn, name=name: calls.append(name) or fn(*a))
    got = layer(x).float()
    assert calls == ([] if _expected_kernel(tokens, in_features) == "onednn" else [_expected_kernel(tokens, in_features)])
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    process_weights_after_loading(layer, {shape: "dense"})  # back to one dense copy
    assert layer.method.name == "dense" and layer.method.own_weight() is None
    assert torch.allclose(layer(x).float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.skipif(not HAS_KERNEL, reason="needs the GEMV kernel")
@pytest.mark.parametrize("shape", [(160, 96), (4864, 896), (576, 1536), (100, 64)])
def test_the_gemv_reads_onednns_buffer_when_the_bytes_are_its_layout(shape):
    """Where oneDNN's packed bytes equal the GEMV's tile layout (AB16b64a2b on AVX512-BF16 CPUs without AMX), the
    method keeps one copy of the weight, not two; it shares only then, and the shared form reads as the packing."""
    import ctypes

    out_features, in_features = shape
    layer = _layer(in_features, out_features, bias=False)
    dense = layer.weight.detach().clone()
    process_weights_after_loading(layer, {shape: "onednn_gemv"})
    method = layer.method
    packed = method.packed_weight
    nbytes = torch.ops.mkldnn._nbytes(packed)
    onednn_bytes = bytes((ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed)))
    want = gemv_kernels.pack_gemv_weight(dense)
    same = onednn_bytes == want.view(torch.uint8).numpy().tobytes()
    assert method.shares_onednn_buffer == same
    assert torch.equal(method.gemv_weight, want)
    if same:
        assert method.gemv_weight.data_ptr() == torch.ops.mkldnn.data_ptr(packed)
        assert layer.weight_nbytes() == nbytes
    x = torch.randn(3, in_features).bfloat16()
    assert torch.allclose(layer(x).float(), x.float() @ dense.float().T, rtol=2e-2, atol=0.1)


def test_offered_only_for_bf16_on_avx512_bf16(monkeypatch):
    assert "onednn_gemv" not in candidates(CPU, torch.float32)
    bf16_level = rs_platform.kernel_isa() == "avx512_bf16"
    assert ("onednn_gemv" in candidates(CPU, torch.bfloat16)) == (HAS_KERNEL and bf16_level)
    assert not gemv.GemvLinearMethod.supports(torch.device("cuda"), torch.bfloat16)
    if "avx512" in rs_platform.runnable_isas():  # a forced lower level hides the method
        monkeypatch.setenv("RADIXSERVE_CPU_ISA", "avx512")
        gemv_kernels.load_gemv_kernel.cache_clear()
        try:
            assert gemv_kernels.load_gemv_kernel() is None and gemv_kernels.load_amx_kernel() is None
            assert "onednn_gemv" not in candidates(CPU, torch.bfloat16)
        finally:
            monkeypatch.delenv("RADIXSERVE_CPU_ISA")
            gemv_kernels.load_gemv_kernel.cache_clear()


@pytest.mark.skipif(not HAS_KERNEL or HAS_AMX, reason="the GEMV's row limit applies without AMX at the AVX512-BF16 level")
@pytest.mark.parametrize(("limit", "rows", "kernel"), [(None, 32, "gemv"), (None, 33, "onednn"), ("4", 4, "gemv"),
                                                       ("4", 5, "onednn"), ("100", 64, "gemv"),
                                                       ("100", 65, "onednn")])
def test_gemv_row_limit_comes_from_the_plans_row_table(monkeypatch, limit, rows, kernel):
    if limit is None:
        monkeypatch.delenv("RADIXSERVE_GEMV_MAX_ROWS", raising=False)
    else:
        monkeypatch.setenv("RADIXSERVE_GEMV_MAX_ROWS", limit)
    layer = _layer(96, 160, bias=False)
    process_weights_after_loading(layer, {(160, 96): "onednn_gemv"})
    layer.method.rows = RowTable.from_env()  # NOTE: what the plan builds and device_setup gives every method
    monkeypatch.setenv("RADIXSERVE_GEMV_MAX_ROWS", "1")  # read once, by the plan: a later change does not apply
    assert (layer.method.decode_kernel(rows) is not None) == (kernel == "gemv")
