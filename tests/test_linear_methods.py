"""Linear methods: oneDNN's prepacked weight against F.linear, weight release and re-packing, the
per-shape choice by measurement (scored, cached), forcing a method, and registering a new one."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from radixserve.layers import gemv, linear_tuning
from radixserve.layers.linear import (
    LINEAR_METHODS,
    LinearBase,
    LinearMethod,
    OneDNNLinearMethod,
    process_weights_after_loading,
    register_linear_method,
)
from radixserve.layers.linear_tuning import Timing, best_method, choose_methods, configure_linear_methods

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not OneDNNLinearMethod.supports(CPU, torch.float32),
                                  reason="torch was built without oneDNN (mkldnn)")


def _layer(in_features: int, out_features: int, dtype: torch.dtype, bias: bool = False, seed: int = 0) -> LinearBase:
    g = torch.Generator().manual_seed(seed)
    layer = LinearBase(in_features, out_features, bias=bias)
    layer.weight.data = torch.randn(out_features, in_features, generator=g).to(dtype)
    if bias:
        layer.bias.data = torch.randn(out_features, generator=g).to(dtype)
    return layer


class TiedModel(nn.Module):
    """An embedding whose weight the head shares, and two untied layers of different shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.up = _layer(16, 24, torch.float32, bias=True, seed=1)
        self.down = _layer(24, 16, torch.float32, seed=2)
        self.head = LinearBase(16, 40)
        self.head.weight = self.embed.weight


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_onednn_matches_dense(dtype, tokens):
    if not OneDNNLinearMethod.supports(CPU, dtype):
        pytest.skip(f"oneDNN has no {dtype} path on this CPU")
    layer = _layer(96, 160, dtype, bias=True)
    x = torch.randn(tokens, 96).to(dtype)
    want = layer(x)  # dense until a method is chosen
    process_weights_after_loading(layer, {(160, 96): "onednn"})
    assert layer.method.name == "onednn" and layer.weight.numel() == 0  # the dense copy was freed
    got = layer(x)
    assert got.dtype == dtype and got.shape == (tokens, 160)
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1.6e-2,
                               atol=1e-4 if dtype == torch.float32 else 1e-2)


@needs_onednn
def test_tied_weight_kept_and_repacking_restores():
    model = TiedModel()
    originals = {name: p.detach().clone() for name, p in model.named_parameters()}
    x = torch.randn(3, 16)
    before = model.head(model.down(model.up(x)))
    counts = process_weights_after_loading(model, dict.fromkeys([(24, 16), (16, 24), (40, 16)], "onednn"))
    assert counts == {"onednn": 3}
    assert model.up.weight.numel() == 0 and model.down.weight.numel() == 0
    assert torch.equal(model.embed.weight, originals["embed.weight"])  # shared with the head: never freed
    # NOTE: oneDNN sums in another order than MKL's sgemm: close, not equal
    torch.testing.assert_close(model.head(model.down(model.up(x))), before, rtol=1e-4, atol=1e-4)
    # a second runner on the same loaded model: nothing to redo; asking for dense unpacks the weights
    assert process_weights_after_loading(model, dict.fromkeys([(24, 16), (16, 24), (40, 16)], "onednn")) == counts
    process_weights_after_loading(model, {})
    assert model.up.method.name == "dense" and model.up.method.own_weight() is None
    assert torch.equal(model.up.weight, originals["up.weight"]) and torch.equal(model.down.weight, originals["down.weight"])


@needs_onednn
def test_dtype_change_repacks():
    layer = _layer(32, 48, torch.float32)
    process_weights_after_loading(layer, {(48, 32): "onednn"})
    layer.to(torch.bfloat16)  # the runner casts a loaded model in place; the packed copy is still float32
    if not OneDNNLinearMethod.supports(CPU, torch.bfloat16):
        pytest.skip("oneDNN has no bf16 path on this CPU")
    process_weights_after_loading(layer, {(48, 32): "onednn"})
    assert layer.method.packed_weight.dtype == torch.bfloat16
    x = torch.randn(2, 32).to(torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16


def test_best_method_is_lowest_relative_sum():
    timings = [Timing("a", 1, 1.0), Timing("b", 1, 2.0),  # a twice as fast at 1 token
               Timing("a", 32, 3.0), Timing("b", 32, 1.0)]  # b three times as fast at 32
    assert best_method(timings) == "b"  # a: 1 + 3 = 4, b: 2 + 1 = 3
    assert best_method([Timing("a", 1, 1.0), Timing("b", 1, 1.5)]) == "a"


def test_a_timing_tie_goes_to_the_preferred_method():
    """Within 5% the preferred method wins (onednn_gemv runs onednn's own product above its decode rows, so
    their prefill times differ by noise); outside it, the faster one."""
    tie = [Timing("onednn", 1, 0.29), Timing("onednn_gemv", 1, 0.26), Timing("onednn", 32, 0.31),
           Timing("onednn_gemv", 32, 0.34), Timing("onednn", 512, 2.72), Timing("onednn_gemv", 512, 2.84)]
    assert best_method(tie) == "onednn_gemv"  # 3.115 vs 3.141: within 5%
    clear = [Timing("onednn", 1, 0.20), Timing("onednn_gemv", 1, 0.26), Timing("onednn", 32, 0.31),
             Timing("onednn_gemv", 32, 0.40)]
    assert best_method(clear) == "onednn"
    assert best_method([Timing("dense", 1, 1.0), Timing("onednn", 1, 1.01)]) == "dense"  # same preference


def test_only_the_decode_rows_decide_between_onednn_and_the_gemv():
    """Above its decode rows `onednn_gemv` runs oneDNN's product, so a slow prefill-point sample (noise) cannot
    hand a shape to `onednn`, which would turn the C decoder off for the whole model. The cached timings of
    Qwen2.5-0.5B's 9728x896 on the AMX Xeon, which did that, now choose the GEMV; `dense` keeps its own time."""
    cached = [Timing("dense", 1, 1.10e-3), Timing("onednn", 1, 0.761e-3), Timing("onednn_gemv", 1, 0.705e-3),
              Timing("dense", 32, 1.41e-3), Timing("onednn", 32, 0.893e-3), Timing("onednn_gemv", 32, 0.934e-3),
              Timing("dense", 512, 7.48e-3), Timing("onednn", 512, 5.63e-3), Timing("onednn_gemv", 512, 7.15e-3)]
    assert best_method(cached) == "onednn_gemv"
    slower_at_decode = [Timing("onednn", 1, 0.50e-3), Timing("onednn_gemv", 1, 0.70e-3), Timing("onednn", 32, 0.80e-3),
                        Timing("onednn_gemv", 32, 1.00e-3), Timing("onednn", 512, 5.0e-3), Timing("onednn_gemv", 512, 4.0e-3)]
    assert best_method(slower_at_decode) == "onednn"  # the decode rows decide
    dense_prefill = [Timing("dense", 1, 1.0), Timing("onednn_gemv", 1, 1.0), Timing("dense", 512, 1.0),
                     Timing("onednn_gemv", 512, 3.0)]
    assert best_method(dense_prefill) == "dense"  # only onednn's own product stands in for the GEMV's


def test_choice_measured_once_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    measured = []

    def fake_measure(shape, names, dtype, token_counts=linear_tuning.TOKEN_COUNTS):
        measured.append(shape)
        fast = "dense" if shape[0] < 100 else names[-1]
        return [Timing(n, t, 1.0 if n == fast else 2.0) for n in names for t in token_counts]

    monkeypatch.setattr(linear_tuning, "measure", fake_measure)
    monkeypatch.setattr(linear_tuning, "candidates", lambda device, dtype: ["dense", "onednn"])
    shapes = [(64, 32), (512, 32)]
    first = choose_methods(shapes, CPU, torch.float32)
    assert first == {(64, 32): "dense", (512, 32): "onednn"} and measured == shapes
    assert choose_methods(shapes, CPU, torch.float32) == first and measured == shapes  # read from the file
    keys = json.loads((tmp_path / linear_tuning.CACHE_FILE).read_text())
    assert len(keys) == 2 and all("float32" in k and torch.__version__ in k for k in keys)
    choose_methods(shapes, CPU, torch.bfloat16)  # another dtype is another measurement
    assert len(measured) == 4


def test_a_shape_only_lm_heads_have_is_timed_at_decode_rows(tmp_path, monkeypatch):
    """The LM head multiplies one row per sampled sequence, so its shape is timed at 1 and 32 rows, not 512 (on a
    vocabulary-sized weight that point was most of a first start's timing); a shape it shares with another layer
    keeps all three counts."""
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    counts: dict[tuple[int, int], tuple[int, ...]] = {}

    def fake_measure(shape, names, dtype, token_counts=linear_tuning.TOKEN_COUNTS):
        counts[shape] = tuple(token_counts)
        return [Timing(n, t, 1.0 if n == names[-1] else 2.0) for n in names for t in token_counts]

    monkeypatch.setattr(linear_tuning, "measure", fake_measure)
    monkeypatch.setattr(linear_tuning, "candidates", lambda device, dtype: ["dense", "onednn"])

    class Tiny(nn.Module):
        def __init__(self, vocab: int) -> None:
            super().__init__()
            self.proj, self.up = LinearBase(32, 64), LinearBase(32, 48)
            self.lm_head = LinearBase(32, vocab)

    linear_tuning.plan_linear_methods(Tiny(500), CPU, torch.float32)
    assert counts == {(64, 32): (1, 32, 512), (48, 32): (1, 32, 512), (500, 32): (1, 32)}
    counts.clear()
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "other"))
    linear_tuning.plan_linear_methods(Tiny(64), CPU, torch.float32)  # the head's shape is also proj's
    assert counts == {(64, 32): (1, 32, 512), (48, 32): (1, 32, 512)}


def test_timing_gives_a_slow_product_fewer_calls_and_a_vocabulary_weight_its_first_rows(monkeypatch):
    """A method stops being called at a point once it has spent POINT_BUDGET_S there (after MIN_CALLS timed calls),
    and a weight wider than TIMED_OUT_FEATURES rows is timed on that many: a first start's timing of an LM head
    took most of a minute before."""
    import time

    calls: dict[str, list[int]] = {"slow": [], "fast": []}

    class Fake(LinearMethod):
        def apply(self, layer, x):
            calls[self.name].append(layer.weight.shape[0])
            if self.name == "slow":
                time.sleep(0.12)
            return x.new_zeros(x.shape[0], layer.out_features)

    monkeypatch.setitem(LINEAR_METHODS, "slow", type("Slow", (Fake,), {"name": "slow"}))
    monkeypatch.setitem(LINEAR_METHODS, "fast", type("Fast", (Fake,), {"name": "fast"}))
    timings = linear_tuning.measure((40000, 8), ["slow", "fast"], torch.float32, token_counts=(1,))
    # warm-up, MIN_CALLS timed calls, then one more while under the budget (0.24 s spent), then none
    assert len(calls["slow"]) == 2 + linear_tuning.MIN_CALLS and len(calls["fast"]) == linear_tuning.CALLS_PER_POINT + 1
    assert set(calls["slow"]) == set(calls["fast"]) == {linear_tuning.TIMED_OUT_FEATURES}
    assert {t.method for t in timings} == {"slow", "fast"} and min(t.seconds for t in timings if t.method == "slow") > 0.1


def test_large_rows_are_where_the_large_product_wins_by_the_margin():
    timings = [Timing("onednn", 64, 1.0), Timing("amx_large", 64, 0.5), Timing("onednn", 128, 1.0),
               Timing("amx_large", 128, 0.99), Timing("onednn", 192, 1.0), Timing("amx_large", 192, 2.0)]
    assert linear_tuning.large_rows(timings) == {64}  # 128: faster, but within LARGE_MARGIN


@pytest.mark.skipif(gemv.load_amx_large_kernel() is None, reason="needs AMX-BF16 (the large AMX product)")
def test_large_products_timed_once_per_shape_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    timed = []

    def fake_time(layer):
        timed.append(layer.shape)
        return [Timing(name, rows, (0.5 if rows <= 256 else 2.0) if name == "amx_large" else 1.0)
                for rows in gemv.LARGE_GRID for name in ("onednn", "amx_large")]

    monkeypatch.setattr(linear_tuning, "_time_large", fake_time)
    model = torch.nn.Sequential(LinearBase(64, 96), LinearBase(64, 96), LinearBase(96, 64))
    configure_linear_methods(model, CPU, torch.bfloat16, "onednn_gemv")
    assert sorted(timed) == [(64, 96), (96, 64)]  # once per shape, not per layer
    assert all(m.method.large_rows == {64, 128, 192, 256} for m in model)
    configure_linear_methods(torch.nn.Sequential(LinearBase(64, 96)), CPU, torch.bfloat16, "onednn_gemv")
    assert len(timed) == 2  # read from the file
    keys = json.loads((tmp_path / linear_tuning.CACHE_FILE).read_text())
    assert any(f"large, {torch.get_num_threads()} threads" in k for k in keys)


def test_forced_and_unknown_methods():
    model = TiedModel()
    assert configure_linear_methods(model, CPU, torch.float32, "dense") == {"dense": 3}
    with pytest.raises(ValueError, match="unknown linear method 'nope'"):
        configure_linear_methods(model, CPU, torch.float32, "nope")
    with pytest.raises(ValueError, match="does not run on meta"):
        configure_linear_methods(model, torch.device("meta"), torch.float32, "onednn")


def test_registered_method_is_selectable(monkeypatch):
    class Float64Method(LinearMethod):
        """A stand-in for a quantized method: keeps its own copy of the weight, multiplies in float64."""

        name = "float64-test"

        def process_weights_after_loading(self, layer: LinearBase) -> None:
            self.copy = layer.dense_weight().double()

        def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
            return (x.double() @ self.copy.T).to(x.dtype)

        def own_weight(self) -> torch.Tensor:
            return self.copy

    register_linear_method(Float64Method)
    try:
        layer = _layer(8, 4, torch.float32)
        x = torch.randn(5, 8)
        want = layer(x)
        process_weights_after_loading(layer, {(4, 8): "float64-test"})
        assert layer.weight.numel() == 0 and layer.method.copy.dtype == torch.float64
        torch.testing.assert_close(layer(x), want)
    finally:
        LINEAR_METHODS.pop("float64-test")
