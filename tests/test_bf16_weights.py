"""bf16 weights with float32 compute (layers/bf16_weights.py, csrc/bf16w_gemv.c): the kernel at every level this
CPU runs against a float64 product of the bf16-rounded weight; the method on both sides of its widening
threshold; a model on it against transformers with the same rounded weights; timing never picks it."""

from __future__ import annotations

import pytest
import torch
from direct_driver import DirectDriver
from kernel_levels import LEVELS, skip_unless_runnable
from test_model_support import hf_last_logits, make_tiny_model, one_torch_thread, rel_err

from radixserve import envs, platform
from radixserve.configs.row_table import DEFAULT_ROWS
from radixserve.kernels.gemv import BF16W_TILE, load_bf16w_kernel, pack_gemv_weight, unpack_gemv_weight
from radixserve.layers import bf16_weights
from radixserve.layers.bf16_weights import Bf16WeightLinearMethod
from radixserve.layers.linear import LinearBase
from radixserve.layers.linear_tuning import candidates
from radixserve.mem_cache.conservation import check_conservation
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

WIDEN_FROM = DEFAULT_ROWS.bf16_weights_rows + 1  # the first row count the widened weight and oneDNN take

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

# (N, K, rows): N not a multiple of the 16-row tile, K from 2 up, rows past every row group (4 on AVX2, 8 on
# AVX-512) and past a tile's reuse
SHAPES = [(1, 2, 1), (17, 64, 3), (100, 38, 9), (576, 576, 1), (1536, 576, 5), (33, 130, 70)]


def _reference(x: torch.Tensor, w_bf16: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w_bf16.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("n, k, rows", SHAPES, ids=[f"{n}x{k}-rows{r}" for n, k, r in SHAPES])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_kernel_matches_float64(isa, n, k, rows, with_bias, monkeypatch):
    skip_unless_runnable(isa)
    monkeypatch.setenv(envs.CPU_ISA.name, isa)
    kernel = load_bf16w_kernel()
    if kernel is None:
        pytest.skip("no C compiler here")
    assert kernel.level == isa
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    packed = pack_gemv_weight(w, BF16W_TILE)
    assert torch.equal(unpack_gemv_weight(packed, n), w)
    got = kernel(packed, x, bias, n)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), _reference(x, w, bias), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("isa", [isa for isa in platform.KERNEL_ISAS if isa != "portable"])
def test_prefetch_into_l2_or_l1_gives_the_same_product(isa, monkeypatch):
    """The prefetch hint is the CPU's choice (platform.weight_prefetch); both builds compute the same bits."""
    skip_unless_runnable(isa)
    monkeypatch.setenv(envs.CPU_ISA.name, isa)
    n, k = 200, 576
    g = torch.Generator().manual_seed(5)
    w, x = (torch.randn(n, k, generator=g) * 0.05).bfloat16(), torch.randn(3, k, generator=g)
    packed = pack_gemv_weight(w, BF16W_TILE)
    products = {}
    for where in ("l1", "l2"):
        monkeypatch.setenv(envs.WEIGHT_PREFETCH.name, where)
        kernel = load_bf16w_kernel()
        if kernel is None:
            pytest.skip("no C compiler here")
        assert (kernel.level, kernel.prefetch) == (isa, where)
        products[where] = kernel(packed, x, None, n)
    assert torch.equal(products["l1"], products["l2"])


@pytest.mark.parametrize("isa", [isa for isa in platform.KERNEL_ISAS if isa != "portable"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_row_in_lockstep_equals_the_tiles_sums(isa, threads, monkeypatch):
    """One row walks up to four tiles per thread in lockstep (csrc/bf16w_gemv.c's one_row): row r of a 2-row product
    equals the 1-row product of x[r], bit for bit, over tile counts of 1, 2, 7 and 13 split over 1-3 threads."""
    skip_unless_runnable(isa)
    monkeypatch.setenv(envs.CPU_ISA.name, isa)
    kernel = load_bf16w_kernel()
    if kernel is None:
        pytest.skip("no C compiler here")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in ((16, 64), (17, 2), (100, 38), (200, 576)):
            g = torch.Generator().manual_seed(n)
            w, x = (torch.randn(n, k, generator=g) * 0.05).bfloat16(), torch.randn(2, k, generator=g)
            bias, packed = torch.randn(n, generator=g), pack_gemv_weight(w, BF16W_TILE)
            pair = kernel(packed, x, bias, n)
            for r in range(2):
                assert torch.equal(kernel(packed, x[r : r + 1].contiguous(), bias, n), pair[r : r + 1]), (n, k, r)
    finally:
        torch.set_num_threads(before)


def test_the_portable_build_prefetches_nothing_whatever_the_switch(monkeypatch):
    monkeypatch.setenv(envs.CPU_ISA.name, "portable")
    monkeypatch.setenv(envs.WEIGHT_PREFETCH.name, "l2")
    kernel = load_bf16w_kernel()
    if kernel is None:
        pytest.skip("no C compiler here")
    assert (kernel.level, kernel.prefetch) == ("portable", "none")


@pytest.mark.parametrize("vendor, want", [("GenuineIntel", "l2"), ("AuthenticAMD", "l1"), (None, "l1")])
def test_auto_prefetches_into_l2_on_intel_only(vendor, want, monkeypatch):
    info = platform.CpuInfo("x86_64", "test CPU", frozenset({"avx2", "fma"}), 2, 2, "AVX2", vendor or "")
    monkeypatch.setattr(platform, "cpu_info", lambda: info)
    monkeypatch.delenv(envs.WEIGHT_PREFETCH.name, raising=False)
    assert platform.weight_prefetch() == want
    monkeypatch.setenv(envs.WEIGHT_PREFETCH.name, "l1" if want == "l2" else "l2")
    assert platform.weight_prefetch() != want  # the switch overrides the vendor


def test_pack_refuses_an_odd_width():
    with pytest.raises(ValueError, match="even number"):
        pack_gemv_weight(torch.zeros(4, 5, dtype=torch.bfloat16), BF16W_TILE)


def _layer(n: int, k: int, bias: bool = True) -> tuple[LinearBase, torch.Tensor]:
    layer = LinearBase(k, n, bias=bias)
    torch.nn.init.normal_(layer.weight, std=0.05)
    dense = layer.weight.detach().clone()
    layer.method = Bf16WeightLinearMethod()
    layer.method.process_weights_after_loading(layer)
    return layer, dense


@pytest.mark.parametrize("rows", [1, 7, WIDEN_FROM - 1, WIDEN_FROM, 300])
def test_method_on_both_sides_of_the_widening(rows):
    big, big_dense = _layer(200, 96)
    small, small_dense = _layer(40, 64)
    for layer, dense in ((big, big_dense), (small, small_dense), (big, big_dense)):  # the scratch shrinks, grows
        x = torch.randn(rows, layer.in_features)
        want = _reference(x, dense.bfloat16(), layer.bias.detach())
        torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=2e-5)
    x3 = torch.randn(2, 3, 96)
    assert torch.allclose(big(x3), big(x3.reshape(6, 96)).view(2, 3, 200))


@pytest.mark.parametrize(("onednn", "blocked"), [(True, True), (True, False), (False, True)])
def test_prefill_product_on_each_path(onednn, blocked, monkeypatch):
    """A prefill chunk's product over the widened weight: widened into oneDNN's blocked order (default), widened plain
    for oneDNN (RADIXSERVE_BF16W_BLOCKED_PREFILL=0), or F.linear (RADIXSERVE_BF16W_ONEDNN_PREFILL=0); each the
    float64 reference's numbers, bias or none, a shape oneDNN pads (120 rows: two blocks of 64) and one whose order
    does not hold (30 input features), which takes the plain widening."""
    monkeypatch.setenv("RADIXSERVE_BF16W_ONEDNN_PREFILL", "1" if onednn else "0")
    monkeypatch.setenv("RADIXSERVE_BF16W_BLOCKED_PREFILL", "1" if blocked else "0")
    bf16_weights.prefill_path.cache_clear()
    mkldnn = torch.backends.mkldnn.is_available()
    try:
        expect = "linear" if not (onednn and mkldnn) else "blocked" if blocked else "onednn"
        assert bf16_weights.prefill_path(120, 64) == expect
        assert bf16_weights.prefill_path(40, 30) == ("onednn" if expect == "blocked" else expect)
        for n, k in ((120, 64), (40, 30)):
            for bias in (True, False):
                layer, dense = _layer(n, k, bias=bias)
                x = torch.randn(WIDEN_FROM + 5, k)
                want = _reference(x, dense.bfloat16(), layer.bias.detach() if bias else None)
                torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=2e-5)
    finally:
        bf16_weights.prefill_path.cache_clear()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN's packed weights need mkldnn")
def test_blocked_scratch_serves_layers_of_one_shape_in_turn():
    """Layers of one shape share this thread's blocked scratch: each product sees its own weight, the same numbers as
    the plain widening's, and the scratch stays one buffer per shape."""
    assert bf16_weights.blocked_order_holds(128, 64) and not bf16_weights.blocked_order_holds(128, 30)
    layers = [_layer(128, 64) for _ in range(3)]
    x = torch.randn(WIDEN_FROM + 1, 64)
    for layer, dense in layers + layers[::-1]:
        want = _reference(x, dense.bfloat16(), layer.bias.detach())
        got = layer(x)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5)
        plain = bf16_weights.dense_product(x, layer.method.kernel.widen(layer.method.packed, 128,
                                                                        torch.empty(128 * 64)), layer.bias)
        assert torch.equal(got, plain)
    assert sum(shape == (128, 64) for shape in bf16_weights.SCRATCH.blocked) == 1


def test_method_keeps_half_the_bytes_and_rebuilds_the_dense_weight():
    layer, dense = _layer(64, 32, bias=False)
    assert layer.method.own_forms() and sum(layer.method.own_forms().values()) == 64 * 32 * 2
    layer.weight.data = layer.weight.data.new_empty(0)  # what process_weights_after_loading does
    assert torch.equal(layer.dense_weight(), dense.bfloat16().float())


def test_timing_never_picks_it():
    cpu = torch.device("cpu")
    assert Bf16WeightLinearMethod.supports(cpu, torch.float32) == (load_bf16w_kernel() is not None)
    assert not Bf16WeightLinearMethod.supports(cpu, torch.bfloat16)
    assert Bf16WeightLinearMethod.name not in candidates(cpu, torch.float32)


def test_model_on_bf16_weights_matches_transformers_with_rounded_weights(tmp_path):
    """Every linear weight rounded to bf16 in the HF model too (embeddings and norms stay float32; the LM head
    is a linear layer of ours, so it is rounded as well)."""
    hf_model = make_tiny_model(tmp_path, "qwen2")
    with torch.no_grad():
        for module in hf_model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(module.weight.bfloat16().float())
    runner = ModelRunner(ServerArgs(model_path=str(tmp_path), dtype="float32", device="cpu", max_total_tokens=512,
                                    linear_method="bf16_weights"))
    assert "bf16_weights" in runner.device_setup.describe()
    driver = DirectDriver(runner)
    prompts = [[5, 9, 33, 2, 71], list(range(3, 40)), [250] * 3]
    reqs = [driver.new_request() for _ in prompts]
    logits = driver.extend(reqs, prompts)
    for _ in range(6):
        for i, req in enumerate(reqs):
            assert rel_err(logits[i], hf_last_logits(hf_model, req.token_ids)) < 1e-4
        logits = driver.decode(reqs, logits.argmax(-1).tolist())
    driver.release_all()
    assert check_conservation(runner.token_to_kv_pool_allocator, None, runner.req_to_token_pool, []) is not None
    assert runner.token_to_kv_pool_allocator.available_size() == runner.max_total_num_tokens


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN's packed weights need mkldnn")
def test_resident_prefill_copy_is_the_widened_product_bit_for_bit():
    """A layer's resident blocked copy gives a prefill chunk the very numbers of the per-chunk widening, and is
    counted among the layer's weight bytes; below WIDEN_FROM the bf16 kernel still runs."""
    layer, _ = _layer(120, 64)
    x, small = torch.randn(WIDEN_FROM + 5, 64), torch.randn(3, 64)
    widened, kernel = layer(x), layer(small)
    layer.method.keep_prefill_copy(layer)
    assert layer.method.prefill_copy is not None
    assert torch.equal(layer(x), widened) and torch.equal(layer(small), kernel)
    packed = layer.method.packed.numel() * 2  # rows padded to tiles of 16
    assert sum(layer.method.own_forms().values()) == packed + bf16_weights.copy_bytes(120, 64)
    assert bf16_weights.copy_bytes(120, 64) == 128 * 64 * 4  # rows padded to two blocks of 64


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN's packed weights need mkldnn")
def test_plan_keeps_prefill_copies_within_the_budget(tmp_path, monkeypatch):
    """The plan gives the decoder layers (not the LM head) their copies when they fit the budget and says why not
    when they do not (budget 0, or smaller than the copies); a prefill runs to the same logits either way."""
    make_tiny_model(tmp_path, "qwen2")
    prompt = [(7 * i) % 250 + 3 for i in range(WIDEN_FROM + 20)]
    runs = {}
    monkeypatch.setenv("RADIXSERVE_BF16W_PREFILL_COPY_MB", "3")
    assert bf16_weights.copy_budget() == 3 << 20
    monkeypatch.setenv("RADIXSERVE_BF16W_PREFILL_COPY_MB", "-1")
    assert 0 < bf16_weights.copy_budget() <= 2 << 30
    wanted = 0  # the copies' bytes, known after the first run
    for budget in ("-1", "0", "short"):
        monkeypatch.setenv("RADIXSERVE_BF16W_PREFILL_COPY_MB", "0" if budget == "0" else "-1")
        if budget == "short":  # a budget one byte short of the copies
            monkeypatch.setattr(bf16_weights, "copy_budget", lambda short=wanted - 1: short)
        runner = ModelRunner(ServerArgs(model_path=str(tmp_path), dtype="float32", device="cpu",
                                        max_total_tokens=1024, linear_method="bf16_weights"))
        entry = runner.execution_plan.as_dict()["bf16 prefill copies"]
        layers = {name: layer for name, layer in runner.model.named_modules() if isinstance(layer, LinearBase)}
        kept = {name for name, layer in layers.items() if layer.method.prefill_copy is not None}
        decoder = {name for name in layers if not name.endswith("lm_head")}
        wanted = sum(bf16_weights.copy_bytes(*layers[name].shape) for name in decoder)
        if budget == "-1":
            assert kept == decoder and runner.execution_plan.prefill_copy_bytes == wanted
            assert entry["choice"] == bf16_weights.mb(wanted) and "within" in entry["reason"]
        else:
            assert not kept and runner.execution_plan.prefill_copy_bytes == 0 and entry["choice"] == "off"
            assert ("=0" if budget == "0" else "over the") in entry["reason"]
        driver = DirectDriver(runner)
        req = driver.new_request()
        runs[budget] = driver.extend([req], [prompt])
        driver.release_all()
        check_conservation(runner.token_to_kv_pool_allocator, None, runner.req_to_token_pool, [])
        assert runner.token_to_kv_pool_allocator.available_size() == runner.max_total_num_tokens
    assert torch.equal(runs["-1"], runs["0"]) and torch.equal(runs["0"], runs["short"])
