"""The float32 build of the one-call C decoder (csrc/decode_step_f32.c) over bf16 weights (`bf16_weights`,
what `--dtype auto` picks on CPUs without bf16 products), at every vector level this CPU runs: logits and KV
equal to the Python layers' to float32 rounding at every batch size it takes, greedy tokens identical, the
plan's reason, and what it declines."""

from __future__ import annotations

import pytest
import torch
from direct_driver import DirectDriver
from kernel_levels import force_level
from test_c_decoder import Recorder
from test_model_support import rel_err, save_tiny_tokenizer

from radixserve.configs.row_table import DEFAULT_ROWS
from radixserve.kernels.c_decoder import F32_LEVELS
from radixserve.mem_cache.conservation import check_conservation
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.models import c_decoder, prefill_passes
from radixserve.server_args import ServerArgs

LEVELS = [pytest.param(isa, id=isa) for isa in reversed(F32_LEVELS) if isa != "avx512_bf16"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama in the shapes the step takes (head_dim 64, widths multiples of 32), with a QKV bias as
    Qwen2 has."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = tmp_path_factory.mktemp("qwen2-d64")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                         initializer_range=0.1, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.1)
    model.save_pretrained(str(path))
    save_tiny_tokenizer(path)
    return path


def _runner(folder, monkeypatch, on: bool, linear_method: str = "bf16_weights", dtype: str = "float32",
            **kw) -> ModelRunner:
    monkeypatch.setenv("RADIXSERVE_DECODE_STEP", "1" if on else "0")
    return ModelRunner(ServerArgs(model_path=str(folder), dtype=dtype, device="cpu", max_total_tokens=4096,
                                  attention_backend="cpu", linear_method=linear_method, **kw))


def _prompt_lens(bs: int) -> list[int]:
    return [5 + 11 * i % 40 for i in range(bs)]


def _decode_run(runner: ModelRunner, bs: int) -> tuple[list[torch.Tensor], torch.Tensor, list[int], list[list[int]]]:
    """Ragged prompts, then four greedy decode steps: the logits, the KV of every slot, the C calls, the tokens."""
    driver = DirectDriver(runner)
    reqs = [driver.new_request() for _ in range(bs)]
    lens = _prompt_lens(bs)
    logits = [driver.extend(reqs, [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate(lens)])]
    recorder = None
    if runner.model.c_decoder is not None:
        recorder = runner.model.c_decoder = Recorder(runner.model.c_decoder)
    tokens = [logits[-1].argmax(-1).tolist()]
    for _ in range(4):
        logits.append(driver.decode(reqs, tokens[-1]))
        tokens.append(logits[-1].argmax(-1).tolist())
    slots = torch.cat([runner.req_to_token_pool.req_to_token[r.row, : len(r.token_ids)] for r in reqs]).long()
    kv = torch.stack([torch.cat([b[slots] for b in runner.token_to_kv_pool.get_kv_buffer(i)])
                      for i in range(runner.model.config.num_layers)])
    driver.release_all()
    check_conservation(runner.token_to_kv_pool_allocator, None, runner.req_to_token_pool, [])
    assert runner.token_to_kv_pool_allocator.available_size() == runner.max_total_num_tokens
    return logits, kv, [] if recorder is None else recorder.calls, tokens


def _assert_prefill_logits(on: torch.Tensor, off: torch.Tensor, bs: int) -> None:
    """A prefill of fewer than `prefill_passes_from` tokens runs the compiled passes in both runs (bit-equal logits); a larger
    one runs the step's C passes where the step is on (equal to float32 rounding)."""
    if sum(_prompt_lens(bs)) < DEFAULT_ROWS.prefill_passes_from:
        assert torch.equal(on, off)
    else:
        assert rel_err(on, off) < 1e-5


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("bs", [1, 5, 40])
def test_f32_step_matches_python_layers(folder, monkeypatch, isa, bs):
    force_level(isa, monkeypatch)
    runs = {}
    for on in (False, True):
        runner = _runner(folder, monkeypatch, on)
        assert (runner.model.c_decoder is not None) == on
        assert runner.execution_plan.as_dict()["decoder"]["reason"] == (
            "float32 on the bf16-weight kernel: every decoder layer in one C call" if on else "RADIXSERVE_DECODE_STEP=0")
        runs[on] = _decode_run(runner, bs)
    (off_logits, off_kv, _, off_tokens), (on_logits, on_kv, calls, on_tokens) = runs[False], runs[True]
    assert calls == [bs] * 4
    # NOTE: the same linear and attention kernels; the passes between them differ from inductor's in the last
    # bits (exp, the order of a sum), which four decode steps through three layers carry to ~1e-6. The prefill
    # runs the Python layers in both, with the step's passes from DEFAULT_ROWS.prefill_passes_from rows
    _assert_prefill_logits(on_logits[0], off_logits[0], bs)
    for off, on in zip(off_logits[1:], on_logits[1:], strict=True):
        assert rel_err(on, off) < 1e-5
    assert rel_err(on_kv, off_kv) < 1e-5
    assert on_tokens == off_tokens


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_f32_step_runs_tiled_packed_weights(folder, monkeypatch, isa, quantization):
    """int4/int8 weights quantized at load, tiled at this level: the step calls the tiled kernel for each
    linear layer (the qkv bias added after it, as in Python) up to its 32 rows; above, the Python layers."""
    force_level(isa, monkeypatch)
    runs = {}
    for on in (False, True):
        runner = _runner(folder, monkeypatch, on, quantization=quantization)
        assert "packed" in runner.device_setup.describe()
        assert (runner.model.c_decoder is not None) == on
        if on:
            assert runner.model.c_decoder.max_rows == 32
        runs[on] = _decode_run(runner, 5)
    (off_logits, off_kv, _, _), (on_logits, on_kv, calls, _) = runs[False], runs[True]
    assert calls == [5] * 4
    # NOTE: the kernel rounds its input to int8 per block of 32; a float32-rounding difference between the
    # passes can move one value across a rounding boundary (a step of 1/127 of the block's largest), which
    # shows as ~1% in the logits: the size of the activation rounding itself, not more
    errors = [rel_err(on, off) for off, on in zip(off_logits[1:], on_logits[1:], strict=True)]
    assert max(errors) < 3e-2 and rel_err(on_kv, off_kv) < 3e-2


def test_bf16_step_adds_the_qkv_bias_of_packed_layers_as_python_does(folder, monkeypatch):
    """The bf16 build on this Qwen2-style model (a qkv bias) with int4 weights: the tiled product's bias is
    added after the bf16 product is stored, as the Python path adds it, so the step stays bit-equal."""
    from radixserve.kernels.gemv import load_gemv_kernel
    from radixserve.kernels.quant_tiled import load_tiled_kernel

    if load_gemv_kernel() is None or load_tiled_kernel() is None:
        pytest.skip("needs AVX512-BF16 (the bf16 build) and the tiled kernels")
    runs = {}
    for on in (False, True):
        runner = _runner(folder, monkeypatch, on, linear_method="onednn_gemv", dtype="bfloat16", quantization="int4")
        assert runner.model.model.layers[0].self_attn.qkv_proj.bias is not None
        assert (runner.model.c_decoder is not None) == on
        runs[on] = _decode_run(runner, 3)
    (off_logits, off_kv, _, _), (on_logits, on_kv, calls, _) = runs[False], runs[True]
    assert calls == [3] * 4
    assert all(torch.equal(on, off) for off, on in zip(off_logits, on_logits, strict=True))
    assert torch.equal(on_kv, off_kv)


@pytest.mark.parametrize("isa", LEVELS)
def test_f32_step_off_a_bf16_weight_layer_declines(folder, monkeypatch, isa):
    """With float32 weights on F.linear (--linear-method dense) there is no C kernel to call: the layers run in Python,
    and the plan says which layer and method stopped it."""
    force_level(isa, monkeypatch)
    runner = _runner(folder, monkeypatch, True, linear_method="dense")
    assert runner.model.c_decoder is None
    assert runner.execution_plan.decoder_refusal == "layer 0: a linear layer runs dense, not bf16_weights or f32_gemv or packed"


def test_f32_refusals_name_the_dtype_and_level(folder, monkeypatch):
    runner = _runner(folder, monkeypatch, True)
    view, plan = runner.model.decoder_weights(), runner.execution_plan
    assert c_decoder.c_decoder_refusal(view, torch.float16, plan.fused_ops, plan.linear_methods) == (
        "the C decoder is bfloat16 and float32 only (dtype float16)")
    monkeypatch.setenv("RADIXSERVE_CPU_ISA", "portable")
    refusal = c_decoder.c_decoder_refusal(view, torch.float32, plan.fused_ops, plan.linear_methods)
    assert refusal == "the C decoder has no build for this kernel level"


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("bs", [1, 5, 9])
def test_f32_step_runs_float32_weights(folder, monkeypatch, isa, bs):
    """`--dtype float32` weights on the float32 GEMV (`f32_gemv`): the step calls the same GEMV per layer and
    matches the Python layers to float32 rounding; the plan names the kernel."""
    force_level(isa, monkeypatch)
    runs = {}
    for on in (False, True):
        runner = _runner(folder, monkeypatch, on, linear_method="f32_gemv")
        assert (runner.model.c_decoder is not None) == on
        if on:
            assert runner.model.c_decoder.max_rows == DEFAULT_ROWS.f32_gemv_rows
            assert runner.execution_plan.as_dict()["decoder"]["reason"] == (
                "float32 on the float32 GEMV: every decoder layer in one C call")
        runs[on] = _decode_run(runner, bs)
    (off_logits, off_kv, _, off_tokens), (on_logits, on_kv, calls, on_tokens) = runs[False], runs[True]
    # NOTE: above the GEMV's rows the layers run oneDNN, so the step declines and Python runs them
    assert calls == ([bs] * 4 if bs <= DEFAULT_ROWS.f32_gemv_rows else [])
    _assert_prefill_logits(on_logits[0], off_logits[0], bs)
    for off, on in zip(off_logits[1:], on_logits[1:], strict=True):
        assert rel_err(on, off) < 1e-5
    assert rel_err(on_kv, off_kv) < 1e-5
    assert on_tokens == off_tokens


@pytest.mark.parametrize("isa", LEVELS)
def test_f32_prefill_batches_run_the_step_passes(folder, monkeypatch, isa):
    """Where the float32 step runs, a prefill batch of `prefill_passes_from` rows or more runs its add + RMSNorm (the sum
    bit-equal to the compiled op's, the norm to float32 rounding) and SiLU-and-mul; below, and with the step off,
    the compiled ops."""
    force_level(isa, monkeypatch)
    runner = _runner(folder, monkeypatch, True)
    layer = runner.model.model.layers[0]
    fused, act, ops = layer.input_layernorm.fused_add, layer.mlp.act, runner.model.fused_ops
    assert isinstance(fused, prefill_passes.RowAddRMSNorm) and isinstance(act, prefill_passes.RowSiluAndMul)
    assert fused._kernel.dtype == torch.float32
    width, inter = runner.model.config.hidden_size, runner.model.config.intermediate_size
    weight = layer.input_layernorm.weight.detach()
    g = torch.Generator().manual_seed(0)
    calls = []
    for name in ("add_rmsnorm", "silu_mul"):
        real = getattr(type(fused._kernel), name)
        monkeypatch.setattr(type(fused._kernel), name,
                            lambda self, *a, _real=real, _name=name: calls.append(_name) or _real(self, *a))
    for rows in (DEFAULT_ROWS.prefill_passes_from - 1, DEFAULT_ROWS.prefill_passes_from, 300):
        x, residual = ((torch.randn(rows, width, generator=g) * 3) for _ in "xr")
        gate_up = torch.randn(rows, 2 * inter, generator=g) * 4
        calls.clear()
        (normed, total), want = fused(x, residual, weight), ops.add_rmsnorm(x, residual, weight)
        silu = act(gate_up)
        assert calls == (["add_rmsnorm", "silu_mul"] if rows >= DEFAULT_ROWS.prefill_passes_from else [])
        assert torch.equal(total, want[1])
        assert rel_err(normed, want[0]) < 1e-6
        assert rel_err(silu, ops.silu_and_mul(gate_up)) < 1e-6
    off = _runner(folder, monkeypatch, False)
    assert off.model.model.layers[0].input_layernorm.fused_add is off.model.fused_ops.add_rmsnorm
    assert off.model.model.layers[0].mlp.act is off.model.fused_ops.silu_and_mul
