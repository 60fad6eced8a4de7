"""The execution plan: built once at start-up, one entry per choice with its reason, true to what runs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from radixserve import Engine
from radixserve.layers.linear import LinearBase


@pytest.fixture(scope="module")
def float32_engine():
    engine = Engine(dtype="float32", max_total_tokens=1024, log_level="warning")
    yield engine
    engine.shutdown()


def test_the_plan_says_what_each_linear_layer_runs(float32_engine: Engine) -> None:
    runner = float32_engine.model_runner
    plan = runner.execution_plan
    actual = Counter((f"{m.out_features}x{m.in_features}", m.method.name) for _, m in runner.model.named_modules()
                     if isinstance(m, LinearBase))
    planned = Counter()
    for entry in plan.entries:
        if entry.part.startswith("linear "):
            method, count = entry.choice.rsplit(" x", 1)
            planned[(entry.part.removeprefix("linear "), method)] += int(count)
            assert "timed here" in entry.reason  # --linear-method auto
    assert planned == actual and sum(actual.values()) == 4 * runner.model_config.num_layers + 1


def test_the_plan_gives_a_reason_for_every_choice(float32_engine: Engine) -> None:
    plan = float32_engine.model_runner.execution_plan
    parts = [e.part for e in plan.entries]
    for part in ("dtype", "attention backend", "attention decode", "attention extend", "attention shared prefix",
                 "fused ops", "decoder"):
        assert part in parts
    assert all(e.reason for e in plan.entries)
    assert plan.choice("dtype") == "float32"
    # float32 weights (--dtype float32): every decoder layer on our float32 GEMV (f32_gemv), so the C decoder runs,
    # whether timing chose it shape by shape or the plan gave it (test below)
    decoder_methods = {method for shape, method in plan.linear_methods.items()
                       if shape[0] != float32_engine.model_runner.model_config.vocab_size}
    reason = plan.as_dict()["decoder"]["reason"]
    assert decoder_methods == {"f32_gemv"}
    assert plan.choice("decoder") == "C decoder" and reason.startswith("float32 on the float32 GEMV")
    assert float32_engine.model_runner.model.c_decoder is not None
    assert float32_engine.model_runner.platform_info()["execution_plan"] == plan.as_dict()


def test_switches_show_in_the_plan() -> None:
    engine = Engine(dtype="float32", max_total_tokens=1024, log_level="warning", linear_method="dense",
                    disable_fused_ops=True, disable_cascade_attention=True, attention_backend="torch")
    try:
        plan = engine.model_runner.execution_plan.as_dict()
    finally:
        engine.shutdown()
    linear = {p: e for p, e in plan.items() if p.startswith("linear ")}
    assert linear and all(e["choice"].startswith("dense x")
                          and e["reason"] == "--linear-method dense; F.linear at every row count" for e in linear.values())
    assert plan["fused ops"] == {"choice": "off", "reason": "--disable-fused-ops"}
    assert plan["attention shared prefix"] == {"choice": "off", "reason": "--disable-cascade-attention"}
    assert plan["attention decode"]["choice"] == "torch" and "no C kernels" in plan["attention decode"]["reason"]


@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX512"), reason="needs AVX-512")
def test_bfloat16_on_an_avx512_bf16_cpu_plans_the_c_decode_step_where_it_runs() -> None:
    from radixserve import platform

    if platform.kernel_isa() != "avx512_bf16":
        pytest.skip(f"the C decoder needs the avx512_bf16 level; this CPU runs {platform.kernel_isa()}")
    engine = Engine(dtype="bfloat16", max_total_tokens=1024, log_level="warning")
    try:
        plan = engine.model_runner.execution_plan
        assert (plan.choice("decoder") == "C decoder") == (engine.model_runner.model.c_decoder is not None)
    finally:
        engine.shutdown()


def test_the_parts_receive_the_plan_and_decide_nothing_again(float32_engine: Engine, monkeypatch) -> None:
    """The plan is made before anything is prepared; the layers' methods, the fused ops, the decoder and the
    attention backend are what it says, and the backend asks its plan, not the kernels' table, what to run."""
    from radixserve.kernels import attention as attention_kernels
    from radixserve.layers.linear import linear_layers

    runner = float32_engine.model_runner
    plan = runner.execution_plan
    entries = plan.as_dict()
    for _, layer in linear_layers(runner.model):
        assert layer.method.name == plan.linear_methods[layer.shape]
        # the entry merges the method's row thresholds and its timed choices into one row-count table
        rows = layer.method.row_kernels(layer.in_features, plan.large_rows.get(layer.shape, frozenset()))
        assert entries[f"linear {layer.out_features}x{layer.in_features}"]["reason"].endswith("; " + rows)
    assert runner.model.fused_ops is plan.fused_ops and runner.attn_backend.plan is plan.attention
    kernels = runner.platform_info()["attention_kernels"]
    assert kernels is None or kernels["used"] == plan.attention.used(torch.float32)
    if plan.attention.uses("decode", torch.float32):
        q = torch.empty(1, 9, 64)
        assert runner.attn_backend.decode_kernel_for(q, 3) is not None
        # NOTE: the table is read once, by the planner; changing it now changes nothing that runs
        monkeypatch.setattr(attention_kernels, "SELECTED", {})
        assert runner.attn_backend.decode_kernel_for(q, 3) is not None


def test_one_row_table_built_by_the_plan_reaches_every_part(monkeypatch) -> None:
    """The plan builds the row table once (RADIXSERVE_GEMV_MAX_ROWS applied), shows it, and every part that switches
    kernels by row count holds that same table: each linear method, the C decoder (its row limit is one of the
    table's), the attention backend (extend limit, cascade policy) and the LoRA manager's segments."""
    from radixserve.configs.row_table import DEFAULT_ROWS
    from radixserve.layers.linear import linear_layers

    monkeypatch.setenv("RADIXSERVE_GEMV_MAX_ROWS", "16")
    engine = Engine(dtype="float32", max_total_tokens=1024, log_level="warning", enable_lora=True,
                    max_loras_per_batch=1)
    try:
        runner = engine.model_runner
        plan = runner.execution_plan
        rows = plan.rows
        assert rows.bf16_gemv_rows == 16 and rows != DEFAULT_ROWS
        assert plan.as_dict()["rows"]["reason"] == rows.describe() and "bf16_gemv_rows 16" in rows.describe()
        assert all(layer.method.rows is rows for _, layer in linear_layers(runner.model))
        assert runner.attn_backend.plan.rows is rows and runner.attn_backend.cascade is rows.cascade
        assert runner.lora.batch.rows is rows
        step = runner.model.c_decoder
        assert step is None or step.max_rows in rows.linear_row_limits()
    finally:
        engine.shutdown()


def test_auto_keeps_bf16_weights_where_it_picks_float32_on_a_cpu(monkeypatch) -> None:
    """A dtype choice of float32 compute over bf16 weights (what `--dtype auto` makes on a CPU without bf16
    products) gives every float linear shape the bf16_weights method, and says why; an explicit
    --linear-method still wins."""
    from radixserve import platform
    from radixserve.kernels.gemv import load_bf16w_kernel
    from radixserve.layers.bf16_weights import Bf16WeightLinearMethod

    if load_bf16w_kernel() is None:
        pytest.skip("no C compiler here: the bf16-weight kernel does not build")
    choice = platform.DtypeChoice("float32", "no native bf16 (test)" + platform.BF16_WEIGHTS_REASON, "bfloat16")
    monkeypatch.setattr(platform, "choose_dtype", lambda name, device_type: choice)
    for requested, expected in (("auto", Bf16WeightLinearMethod.name), ("onednn", "onednn")):
        engine = Engine(dtype="auto", max_total_tokens=1024, log_level="warning", linear_method=requested)
        try:
            runner = engine.model_runner
            methods = {m.method.name for _, m in runner.model.named_modules() if isinstance(m, LinearBase)}
            plan = runner.execution_plan.as_dict()
            out = engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params={"max_new_tokens": 4, "temperature": 0})
        finally:
            engine.shutdown()
        assert methods == {expected} and len(out[0]["output_ids"]) == 4
        linear = [e for p, e in plan.items() if p.startswith("linear ")]
        reason = "--dtype auto: bf16 weights" if requested == "auto" else f"--linear-method {requested}"
        assert linear and all(e["reason"].startswith(reason) for e in linear)
        assert plan["dtype"]["reason"].endswith(platform.BF16_WEIGHTS_REASON)


def test_cascade_is_planned_off_where_it_measured_slower(monkeypatch) -> None:
    """kernels.attention.CASCADE_LOSES names (kernel class, dtype) pairs where cascade lost end to end; the plan
    turns it off there, says why, and the backend then never splits a shared prefix."""
    from radixserve.kernels import attention as attention_kernels
    from radixserve.model_executor.execution_plan import _cascade_refusal
    from radixserve.server_args import ServerArgs

    kernel = attention_kernels.load_decode_kernel()
    if kernel is None:
        pytest.skip("the C attention kernels did not build here")
    cpu, args = torch.device("cpu"), ServerArgs()
    monkeypatch.setattr(attention_kernels, "CASCADE_LOSES", frozenset({(kernel.kernel_class, torch.float32)}))
    reason = _cascade_refusal(args, cpu, torch.float32, None)
    assert reason is not None and "measured slower" in reason and kernel.kernel_class in reason
    assert _cascade_refusal(args, cpu, torch.bfloat16, None) is None  # another dtype: cascade stays
    assert _cascade_refusal(ServerArgs(attention_backend="torch"), cpu, torch.float32, None) is None
    assert _cascade_refusal(ServerArgs(disable_cascade_attention=True), cpu, torch.float32, None) == \
        "--disable-cascade-attention"
    assert "soft-cap" in _cascade_refusal(args, cpu, torch.bfloat16, 50.0)
    assert _cascade_forwards(monkeypatch, frozenset()) > 0  # the same batches split the prefix where it may
    assert _cascade_forwards(monkeypatch, frozenset({(kernel.kernel_class, torch.float32)}), reason) == 0


def _cascade_forwards(monkeypatch, loses: frozenset, reason: str | None = None) -> int:
    """Forwards that ran cascade in an engine planned with CASCADE_LOSES = `loses`: a 300-token prefix cached
    first, then two requests that share it extend and decode together."""
    from test_model_support import assert_engine_conserved

    from radixserve.kernels import attention as attention_kernels

    monkeypatch.setattr(attention_kernels, "CASCADE_LOSES", loses)
    engine = Engine(dtype="float32", max_total_tokens=1024, log_level="warning")
    try:
        plan = engine.model_runner.execution_plan
        assert plan.attention.cascade == (reason is None)
        if reason is not None:
            assert plan.as_dict()["attention shared prefix"] == {"choice": "off", "reason": reason}
        shared = list(range(300, 600))
        engine.generate(input_ids=[shared], sampling_params={"max_new_tokens": 1})
        engine.generate(input_ids=[shared + [7, 8, 9], shared + [10, 11]], sampling_params={"max_new_tokens": 3})
        assert_engine_conserved(engine)
        return sum(engine.model_runner.attn_backend.cascade_forwards.values())
    finally:
        engine.shutdown()


def test_a_shape_timed_faster_elsewhere_does_not_turn_the_c_decoder_off(monkeypatch) -> None:
    """Timing that picks dense for every float32 shape (as it did for 576x576 and 960x576 on an AVX2 EPYC, by a few
    percent at 512 rows) would run decode in the Python layers; the plan gives the decoder shapes f32_gemv and says
    so, and the LM head keeps its timed method."""
    from radixserve.layers import linear_tuning

    monkeypatch.setattr(linear_tuning, "choose_methods", lambda shapes, *a, **k: dict.fromkeys(shapes, "dense"))
    engine = Engine(dtype="float32", max_total_tokens=1024, log_level="warning")
    try:
        runner = engine.model_runner
        plan = runner.execution_plan
        vocab = runner.model_config.vocab_size
        assert {m for shape, m in plan.linear_methods.items() if shape[0] != vocab} == {"f32_gemv"}
        assert {m for shape, m in plan.linear_methods.items() if shape[0] == vocab} == {"dense"}
        assert plan.choice("decoder") == "C decoder"
        reason = plan.as_dict()["decoder"]["reason"]
        assert "where timing alone chose" in reason and "576x576 dense" in reason
        assert runner.model.c_decoder is not None
        out = engine.generate("The sky is", {"max_new_tokens": 4, "temperature": 0})
        assert out["meta_info"]["completion_tokens"] == 4
    finally:
        engine.shutdown()


def test_the_decoder_choice_weighs_the_whole_step(monkeypatch, tmp_path) -> None:
    """decoder_choice.decoder_trade: a decode step's products both ways from the cached timings, plus the Python
    layers' calls; the C decoder loses where its method is slower at 1 row by more than those calls save."""
    from radixserve.layers.linear_tuning import CACHE_FILE, Timing, TimingCache, cache_key
    from radixserve.model_executor import decoder_choice

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    cache = TimingCache(tmp_path / CACHE_FILE)
    a, b = (576, 576), (1536, 576)
    for shape, gemv_1, dense_1 in ((a, 20e-6, 30e-6), (b, 50e-6, 40e-6)):
        cache.put(cache_key(shape, torch.float32), [Timing("f32_gemv", 1, gemv_1), Timing("dense", 1, dense_1),
                                                    Timing("f32_gemv", 512, 1e-3), Timing("dense", 512, 0.9e-3)])
    shapes = Counter({a: 60, b: 30})
    trade = decoder_choice.decoder_trade(shapes, {a: "dense", b: "dense"}, "f32_gemv", 30, torch.float32)
    calls = 30 * decoder_choice.PYTHON_CALLS_PER_LAYER * decoder_choice.PYTHON_CALL_S
    assert trade.c_step_s == pytest.approx(60 * 20e-6 + 30 * 50e-6)
    assert trade.python_step_s == pytest.approx(60 * 30e-6 + 30 * 40e-6 + calls)
    assert trade.c_prefill_s == pytest.approx(90e-3) and trade.python_prefill_s == pytest.approx(81e-3)
    assert trade.c_wins and "ms in the C decoder against" in trade.describe()
    # NOTE: f32_gemv 1 ms slower per product at 1 row: more than the Python calls it would save
    cache.put(cache_key(a, torch.float32), [Timing("f32_gemv", 1, 1e-3), Timing("dense", 1, 30e-6)])
    slow = decoder_choice.decoder_trade(shapes, {a: "dense", b: "dense"}, "f32_gemv", 30, torch.float32)
    assert not slow.c_wins and slow.c_prefill_s is None  # NOTE: a's 512-row timings are gone: no prefill figure
    assert decoder_choice.decoder_trade(Counter({(7, 7): 1}), {}, "f32_gemv", 1, torch.float32) is None  # untimed


def test_a_c_decoder_that_would_be_slower_is_not_taken(monkeypatch) -> None:
    """Where the whole step would be slower with f32_gemv on every decoder shape, the plan keeps timing's methods and
    the Python layers, and says why with both estimates."""
    from test_model_support import assert_engine_conserved

    from radixserve.layers import linear_tuning
    from radixserve.model_executor import decoder_choice

    monkeypatch.setattr(linear_tuning, "choose_methods", lambda shapes, *a, **k: dict.fromkeys(shapes, "dense"))
    slower = decoder_choice.DecoderTrade(c_step_s=9e-3, python_step_s=5e-3, c_prefill_s=None, python_prefill_s=None)
    monkeypatch.setattr(decoder_choice, "decoder_trade", lambda *a, **k: slower)
    engine = Engine(dtype="float32", max_total_tokens=1024, log_level="warning")
    try:
        plan = engine.model_runner.execution_plan
        assert plan.choice("decoder") == "python layers"
        reason = plan.as_dict()["decoder"]["reason"]
        assert "would be slower" in reason and "9.00 ms in the C decoder against 5.00 ms" in reason, reason
        assert set(plan.linear_methods.values()) == {"dense"} and engine.model_runner.model.c_decoder is None
        out = engine.generate("The sky is", {"max_new_tokens": 4, "temperature": 0})
        assert out["meta_info"]["completion_tokens"] == 4
        assert_engine_conserved(engine)
    finally:
        engine.shutdown()
