"""The C LoRA kernel (csrc/lora_sgmv.c, kernels/lora.py) against the torch path of lora/layers.py and a float64
product, at every kernel level this CPU runs: ranks 5/8/16/64, segment layouts from one slice to interleaved index
segments with base-model rows between them, an adapter that skips the layer, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
from kernel_levels import LEVELS, skip_unless_runnable
from test_model_support import one_torch_thread

from radixserve import envs
from radixserve.configs.row_table import DEFAULT_ROWS, RowTable
from radixserve.kernels.lora import load_lora_kernel
from radixserve.lora.layers import LoraLinear, LoraSegments, PackedLora, group_rows

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

K, N = 100, 109  # NOTE: the last 64-column block has 45: whole blocks of vectors, single vectors and a tail
KEY = (0, "qkv_proj")
# per request: (adapter or None, rows); "c" targets no module of this layer
LAYOUTS = {
    "one_slice": [("a", 5)],
    "base_between": [("a", 3), (None, 2), ("b", 6), (None, 1), ("a", 2)],
    "interleaved": [(None, 1), ("a", 1), ("b", 1), ("c", 1), ("a", 1), ("b", 1), ("c", 1), (None, 1), ("a", 1)],
    "prefill": [("a", 37), (None, 3), ("b", 9), ("c", 4), ("b", 2)],
    "decode_one": [(None, 4), ("b", 1), (None, 3)],
    "base_only": [(None, 6)],
}


def _kernel_at(isa: str, monkeypatch: pytest.MonkeyPatch):
    skip_unless_runnable(isa)
    monkeypatch.setenv(envs.CPU_ISA.name, isa)
    kernel = load_lora_kernel()
    if kernel is None:
        pytest.skip("no C compiler here")
    assert kernel.level == isa
    return kernel


def _packed(rank: int, dtype: torch.dtype, seed: int) -> dict[str, PackedLora]:
    """Three adapters: a (rank r, three modules: 3r), b (2r), c (none of the layer's modules)."""
    g = torch.Generator().manual_seed(seed)

    def pair(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(r, K, generator=g) * 0.1).to(dtype), (torch.randn(r, N, generator=g) * 0.1).to(dtype)

    return {"a": PackedLora(None, {KEY: pair(3 * rank)}), "b": PackedLora(None, {KEY: pair(2 * rank)}),
            "c": PackedLora(None, {(1, "qkv_proj"): pair(rank)})}


def _case(layout: str, rank: int, dtype: torch.dtype):
    reqs = LAYOUTS[layout]
    packed = _packed(rank, dtype, seed=rank)
    segments = group_rows([name for name, _ in reqs], [n for _, n in reqs], packed, torch.device("cpu"))
    m = sum(n for _, n in reqs)
    g = torch.Generator().manual_seed(m)
    x, y = torch.randn(m, K, generator=g).to(dtype), torch.randn(m, N, generator=g).to(dtype)
    want = y.double().clone()
    start = 0
    for name, n in reqs:
        if name is not None and KEY in packed[name].layers:
            a, bt = packed[name].layers[KEY]
            want[start:start + n] += x[start:start + n].double() @ a.double().T @ bt.double()
        start += n
    return segments, x, y, want


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("rank", [5, 8, 16, 64])  # NOTE: 5: sums of ranks that are not multiples of 4
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_kernel_matches_the_torch_path_and_float64(isa, rank, layout, dtype, monkeypatch):
    kernel = _kernel_at(isa, monkeypatch)
    every = RowTable(lora_segment_rows_f32=10 ** 9, lora_segment_rows_bf16=10 ** 9)  # NOTE: every segment on the kernel
    segments, x, y, want = _case(layout, rank, dtype)
    by_c = LoraLinear(*KEY, LoraSegments(segments, kernel=kernel, rows=every)).add_to(x, y.clone())
    by_torch = LoraLinear(*KEY, LoraSegments(segments)).add_to(x, y.clone())
    assert by_c.dtype == dtype and by_c.shape == y.shape
    if dtype == torch.float32:
        torch.testing.assert_close(by_c.double(), want, rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(by_c, by_torch, rtol=1e-5, atol=2e-5)
    else:
        # NOTE: the kernel keeps x @ A^T in float32 and rounds y once; torch rounds each product to bf16
        scale = float(want.abs().max())
        # NOTE: x, A and Bt are bf16, so the float64 sum is the kernel's but for float32 rounding: y is that sum
        # rounded to bf16 once, within one bf16 step of the float64 sum rounded
        torch.testing.assert_close(by_c.float(), want.to(dtype).float(), rtol=2 ** -7, atol=1e-5 * scale)
        assert float((by_c.double() - by_torch.double()).abs().max()) <= 0.02 * scale
    if layout == "base_only":
        assert torch.equal(by_c, y)
    base_rows = [i for i, (name, n) in enumerate(LAYOUTS[layout]) if name in (None, "c")]
    start = [sum(n for _, n in LAYOUTS[layout][:i]) for i in range(len(LAYOUTS[layout]))]
    for i in base_rows:  # NOTE: rows of the base model (and of an adapter skipping the layer) are untouched
        n = LAYOUTS[layout][i][1]
        assert torch.equal(by_c[start[i]:start[i] + n], y[start[i]:start[i] + n])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_large_segments_take_torch_and_the_rest_the_kernel(dtype):
    """A segment over `RowTable.lora_segment_rows` rows runs torch matmuls, the smaller ones the kernel, in one layer."""
    kernel = load_lora_kernel()
    if kernel is None:
        pytest.skip("no C compiler here")
    calls: list[int] = []

    def recording(x, y, index, offsets, pairs):
        calls.append(len(pairs))
        return kernel(x, y, index, offsets, pairs)

    limit = DEFAULT_ROWS.lora_segment_rows(dtype) + 1  # NOTE: the first count torch takes
    packed = _packed(8, dtype, seed=3)
    names, counts = ["a", None, "b", "a"], [limit, 2, 3, 1]  # NOTE: a's rows: limit + 1, in an index segment
    segments = group_rows(names, counts, packed, torch.device("cpu"))
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(sum(counts), K, generator=g).to(dtype), torch.randn(sum(counts), N, generator=g).to(dtype)
    batch = LoraSegments(segments, kernel=recording)
    by_both = LoraLinear(*KEY, batch).add_to(x, y.clone())
    by_torch = LoraLinear(*KEY, LoraSegments(segments)).add_to(x, y.clone())
    assert calls == [1]  # NOTE: b alone went to the kernel
    plan = batch.c_plan(dtype)
    assert [p is packed["b"] for _, p in plan.c_segments] == [True]
    assert [p is packed["a"] for _, p in plan.torch_segments] == [True]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(by_both.float(), by_torch.float(), rtol=tol, atol=tol)


def test_kernel_refuses_mismatched_inputs():
    kernel = load_lora_kernel()
    if kernel is None:
        pytest.skip("no C compiler here")
    x, y = torch.zeros(2, K), torch.zeros(2, N)
    index, offsets = torch.tensor([0, 1]), torch.tensor([0, 2])
    with pytest.raises(ValueError, match="one dtype"):
        kernel(x, y.bfloat16(), index, offsets, [None])
    with pytest.raises(ValueError, match="do not fit"):
        kernel(x, y, index, offsets, [(torch.zeros(4, K + 1), torch.zeros(4, N))])
    with pytest.raises(ValueError, match="int64"):
        kernel(x, y, index.int(), offsets, [None])


def test_the_runner_uses_the_kernel_on_the_cpu(tmp_path):
    """A LoRA runner on the CPU takes the C path when the kernel builds (the forward tests then run it)."""
    from lora_support import SPECS, make_peft_adapter
    from test_model_support import make_tiny_model

    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    base = make_tiny_model(tmp_path / "base", "llama")
    make_peft_adapter(base, tmp_path / "a", SPECS[0])
    runner = ModelRunner(ServerArgs(model_path=str(tmp_path / "base"), dtype="float32", device="cpu",
                                    max_total_tokens=256, lora_paths=(f"a={tmp_path / 'a'}",)))
    assert (runner.lora.batch.kernel is None) == (load_lora_kernel() is None)
