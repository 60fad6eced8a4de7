"""The tiled layout of packed weights (layers/quantization/tiled.py): the same values as the row layout,
the kernel against the row kernel and the float product at every level this CPU runs (AVX-512 VNNI, AVX-VNNI,
AVX2), the levels equal to each other, the expansion path for many rows, the model-level re-lay (a tied table
tiled once), and where it must not run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from radixserve.configs.row_table import DEFAULT_ROWS
from radixserve.kernels import quant_tiled
from radixserve.kernels.quant import load_quant_kernel, runnable_isas
from radixserve.layers.quantization import linear as qlinear
from radixserve.layers.quantization import tiled
from radixserve.layers.quantization.formats import PackedWeight, quantize
from radixserve.layers.quantization.linear import QuantizedEmbedding, packed_layer
from radixserve.layers.quantization.model_quant import tile_packed_weights

HAS_TILED = quant_tiled.load_tiled_kernel() is not None
needs_tiled = pytest.mark.skipif(not HAS_TILED, reason="needs AVX2 (other CPUs: test_not_offered_below_avx2)")
FORMATS = [(4, False), (8, False), (8, True)]  # int4 g32, int8 g32, int8 per-channel


@pytest.fixture(params=quant_tiled.LEVELS)
def level(request, monkeypatch):
    """Each tiled level this CPU runs (a forced RADIXSERVE_CPU_ISA hides those above it), made the one
    `load_tiled_kernel` returns."""
    if request.param not in runnable_isas():
        pytest.skip(f"this CPU (or RADIXSERVE_CPU_ISA) does not run the {request.param} packed kernels")
    kernel = quant_tiled._built(request.param)
    if kernel is None:
        pytest.skip("no C compiler here")
    monkeypatch.setattr(quant_tiled, "load_tiled_kernel", lambda: kernel)
    return request.param


def _packed(bits: int, per_channel: bool, n: int, k: int, seed: int = 0) -> PackedWeight:
    return quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), bits, per_channel)


@pytest.mark.parametrize(("bits", "per_channel"), FORMATS)
@pytest.mark.parametrize(("n", "k"), [(64, 32), (100, 96), (130, 576)])
def test_tiled_holds_the_same_values(level, bits, per_channel, n, k):
    packed = _packed(bits, per_channel, n, k)
    t = tiled.tile_weight(packed)
    ref = packed.dequantize()
    assert t.shape == (n, k) and t.format_name == packed.format_name
    assert torch.equal(t.dequantize(), ref)
    ids = torch.tensor([[n - 1, 0], [n // 2, 63]])
    assert torch.equal(t.dequantize(torch.bfloat16, rows=ids), ref[ids.reshape(-1)].bfloat16())
    with pytest.raises(IndexError):
        t.dequantize(rows=torch.tensor([n]))


@pytest.mark.parametrize(("bits", "per_channel"), FORMATS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 16, 32])
def test_tiled_kernel_matches_the_row_kernel(level, bits, per_channel, m):
    packed = _packed(bits, per_channel, 100, 96, seed=m)
    t = tiled.tile_weight(packed)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(1))
    got = quant_tiled.load_tiled_kernel().matmul(t, x, torch.float32)
    rows = load_quant_kernel().matmul(packed, x, torch.float32)  # same arithmetic, other summation order
    assert torch.linalg.norm(got - rows) / torch.linalg.norm(rows) < 1e-5
    want = x @ packed.dequantize().T  # activations rounded to int8 per block: ~1% of the norm
    assert torch.linalg.norm(got - want) / torch.linalg.norm(want) < 2e-2
    got16 = quant_tiled.load_tiled_kernel().matmul(t, x.bfloat16(), torch.bfloat16)
    assert got16.dtype == torch.bfloat16 and torch.linalg.norm(got16.float() - want) / torch.linalg.norm(want) < 3e-2


@pytest.mark.parametrize(("bits", "per_channel"), FORMATS)
@pytest.mark.parametrize("n", [64, 130, 64 * 9 + 5, 64 * 17])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_few_rows_read_tiles_in_lockstep_with_the_same_sums(level, bits, per_channel, n, threads):
    """A decode batch of 1-4 rows walks up to four tiles per thread in lockstep; each tile's sums still run over
    its records in order, so its rows equal, bit for bit, the same rows at the tail of a longer product (above
    four rows, one tile at a time), for any count of tiles against threads (a partial last tile,
    fewer tiles than four per thread, several groups)."""
    t = tiled.tile_weight(_packed(bits, per_channel, n, 576, seed=n))
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(3)) * 2
    kernel = quant_tiled.load_tiled_kernel()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for m in (1, 2, 3, 4):
                few = kernel.matmul(t, x[4:4 + m].to(dtype).contiguous(), dtype)
                tail = kernel.matmul(t, x[:4 + m].to(dtype).contiguous(), dtype)[4:]
                assert few.shape == (m, n) and torch.equal(few, tail), (dtype, m)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("bits", "per_channel"), FORMATS)
def test_every_level_computes_the_same(bits, per_channel):
    """The levels differ in how they form each block's integer dot (vpdpbusd, or maddubs/madd with int8's
    unsigned offset added back), not in its value, and share the float steps after it: equal results."""
    levels = [lv for lv in quant_tiled.LEVELS if lv in runnable_isas()]
    if len(levels) < 2:
        pytest.skip(f"this CPU runs one tiled level ({', '.join(levels) or 'none'})")
    t = tiled.tile_weight(_packed(bits, per_channel, 200, 576, seed=7))
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(2)) * 3
    results = [quant_tiled._built(lv).matmul(t, x, torch.float32) for lv in levels]
    assert all(torch.equal(results[0], r) for r in results[1:])
    expanded = [quant_tiled._built(lv).expand_t(t, 0, 200, torch.float32) for lv in levels]
    assert all(torch.equal(expanded[0], e) for e in expanded[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_expand_in_pieces(level, dtype, monkeypatch):
    packed = _packed(4, False, 300, 128)
    t = tiled.tile_weight(packed)
    x = torch.randn(40, 128).to(dtype)
    want = x.float() @ packed.dequantize().T
    whole = qlinear.tiled_linear(t, x, DEFAULT_ROWS.tiled_rows)
    monkeypatch.setattr(qlinear, "DEQUANT_CHUNK", 64 * 128)  # pieces of 64 rows: 5 pieces, the last of 44
    pieces = qlinear.tiled_linear(t, x, DEFAULT_ROWS.tiled_rows)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got in (whole, pieces):
        assert got.shape == (40, 300) and got.dtype == dtype
        assert torch.linalg.norm(got.float() - want) / torch.linalg.norm(want) < tol


class TiedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = QuantizedEmbedding(200, 64, torch.float32)
        self.embed.packed = _packed(8, False, 200, 64, seed=3)
        self.head = packed_layer(64, 200, self.embed.packed)
        self.up = packed_layer(64, 96, _packed(4, False, 96, 64, seed=4))


def test_model_weights_are_tiled_once_and_compute_the_same(level):
    model = TiedHead()
    ids, x = torch.tensor([5, 199, 0]), torch.randn(3, 64)
    before = (model.embed(ids), model.head(x), model.up(x), model.up(torch.randn(30, 64, generator=torch.Generator().manual_seed(0))))
    assert tile_packed_weights(model) == 2  # the tied table once, and `up`
    assert isinstance(model.embed.packed, tiled.TiledWeight) and model.head.method.packed is model.embed.packed
    after = (model.embed(ids), model.head(x), model.up(x), model.up(torch.randn(30, 64, generator=torch.Generator().manual_seed(0))))
    assert torch.equal(before[0], after[0])
    for a, b in zip(before[1:3], after[1:3], strict=True):  # both round the activations to int8
        assert torch.linalg.norm(a - b) / torch.linalg.norm(a) < 1e-5
    # 30 rows: float activations (expansion) before, the tiled kernel's int8 activations after
    assert torch.linalg.norm(before[3] - after[3]) / torch.linalg.norm(before[3]) < 2e-2
    assert tile_packed_weights(model) == 0  # already tiled


@needs_tiled
def test_a_scale_too_large_for_float16_keeps_the_row_layout():
    packed = _packed(8, True, 64, 32)
    packed.scales.fill_(1000.0)  # -128 * 1000 overflows float16
    with pytest.raises(ValueError, match="too large"):
        tiled.tile_weight(packed)
    layer = packed_layer(32, 64, packed)
    holder = nn.Sequential(layer)
    assert tile_packed_weights(holder) == 0 and layer.method.packed is packed


def test_not_offered_below_avx2(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CPU_ISA", "portable")
    assert quant_tiled.load_tiled_kernel() is None
    layer = packed_layer(32, 64, _packed(4, False, 64, 32))
    assert tile_packed_weights(nn.Sequential(layer)) == 0
