"""The one-call C decoder (models/c_decoder.py): bit-equal logits and KV to the Python layers at every
batch size it takes (the GEMV's and the AMX kernel's), over ragged contexts; what it declines falls back to
the Python layers; the switch turns it off."""

from __future__ import annotations

import pytest
import torch
from direct_driver import DirectDriver
from test_model_support import save_tiny_tokenizer

from radixserve.configs.row_table import DEFAULT_ROWS
from radixserve.layers.gemv import load_gemv_kernel
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.models import c_decoder, prefill_passes
from radixserve.server_args import ServerArgs

pytestmark = pytest.mark.skipif(load_gemv_kernel() is None,
                                reason="needs AVX512-BF16 (the GEMV kernel); the C decoder is not built here")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama whose shapes the C step takes (head_dim 32, widths multiples of 32)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("llama-d32")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(path))
    save_tiny_tokenizer(path)
    return path


def _runner(folder, monkeypatch, on: bool, **kw) -> ModelRunner:
    monkeypatch.setenv("RADIXSERVE_DECODE_STEP", "1" if on else "0")
    runner = ModelRunner(ServerArgs(model_path=str(folder), dtype="bfloat16", device="cpu", max_total_tokens=4096,
                                    attention_backend="cpu", linear_method="onednn_gemv", **kw))
    assert (runner.model.c_decoder is not None) == on
    assert runner.device_setup.c_decoder == on
    return runner


class Recorder:
    """Stands in for the model's decode step and notes the batch size of each forward it ran."""

    def __init__(self, step: c_decoder.CDecoder) -> None:
        self.step, self.calls = step, []

    def takes(self, fb) -> bool:
        return self.step.takes(fb)

    def __call__(self, hidden: torch.Tensor, fb):
        self.calls.append(fb.batch_size)
        return self.step(hidden, fb)


def _decode_run(runner: ModelRunner, bs: int,
                prompt_lens: list[int] | None = None) -> tuple[list[torch.Tensor], torch.Tensor, list[int]]:
    """Ragged prompts (default 5 to 44 tokens), then three decode steps of all of them: the logits, the KV of
    every slot, the C calls."""
    driver = DirectDriver(runner)
    reqs = [driver.new_request() for _ in range(bs)]
    lens = prompt_lens or [5 + 11 * i % 40 for i in range(bs)]
    driver.extend(reqs, [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate(lens)])
    recorder = None
    if runner.model.c_decoder is not None:
        recorder = runner.model.c_decoder = Recorder(runner.model.c_decoder)
    logits = [driver.decode(reqs, [(i + s) % 200 + 3 for i in range(bs)]) for s in range(3)]
    slots = torch.cat([runner.req_to_token_pool.req_to_token[r.row, : len(r.token_ids)] for r in reqs]).long()
    kv = torch.stack([torch.cat([b[slots].float() for b in runner.token_to_kv_pool.get_kv_buffer(i)])
                      for i in range(runner.model.config.num_layers)])
    driver.release_all()
    return logits, kv, [] if recorder is None else recorder.calls


@pytest.mark.parametrize("bs", [1, 3, 8, 32])
def test_c_step_matches_python_layers(folder, monkeypatch, bs):
    runs = {}
    for on in (False, True):
        runner = _runner(folder, monkeypatch, on)
        limit = runner.model.c_decoder.max_rows if on else 0
        runs[on] = _decode_run(runner, bs)
        assert runs[on][2] == ([bs] * 3 if bs <= limit else [])
    (off_logits, off_kv, _), (on_logits, on_kv, _) = runs[False], runs[True]
    # NOTE: the same kernels and the same bf16 rounding steps (RMSNorm's float32 sum is 16 lanes wide, as
    # torch's on these CPUs): bit-equal, where the bf16 path differs from float32 by 2-6% on this model
    for off, on in zip(off_logits, on_logits, strict=True):
        assert torch.equal(on, off)
    assert torch.equal(on_kv, off_kv)


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_c_step_on_tiled_packed_weights_is_bit_equal(folder, monkeypatch, quantization):
    """int4/int8 weights (tiled where the tiled kernels run): the step calls the same tiled product per linear
    layer as the Python layers, so logits and KV stay bit-equal, up to the kernel's 32 rows."""
    from radixserve.kernels.quant_tiled import load_tiled_kernel

    if load_tiled_kernel() is None:
        pytest.skip("no tiled packed kernels at this level")
    runs = {}
    for on in (False, True):
        runner = _runner(folder, monkeypatch, on, quantization=quantization)
        assert "packed" in runner.device_setup.describe()
        if on:
            assert runner.model.c_decoder.max_rows == 32
        runs[on] = _decode_run(runner, 6)
    (off_logits, off_kv, _), (on_logits, on_kv, calls) = runs[False], runs[True]
    assert calls == [6] * 3
    assert all(torch.equal(on, off) for off, on in zip(off_logits, on_logits, strict=True))
    assert torch.equal(on_kv, off_kv)


def test_embedded_model_bit_equal(monkeypatch):
    """SmolLM2 (30 layers, 9 query heads over 3 kv heads): the C step picks the same linear kernel as the
    Python layers at each batch size (AMX over the GEMV where both take it), so greedy runs stay identical."""
    runs = {}
    for on in (False, True):
        monkeypatch.setenv("RADIXSERVE_DECODE_STEP", "1" if on else "0")
        runner = ModelRunner(ServerArgs(dtype="bfloat16", device="cpu", max_total_tokens=2048))
        assert (runner.model.c_decoder is not None) == on
        driver = DirectDriver(runner)
        reqs = [driver.new_request() for _ in range(2)]
        logits = [driver.extend(reqs, [list(range(100, 140)), list(range(500, 517))])]
        for _ in range(4):
            logits.append(driver.decode(reqs, logits[-1].argmax(-1).tolist()))
        driver.release_all()
        runs[on] = logits
    for off, on in zip(runs[False], runs[True], strict=True):
        assert torch.equal(on, off)


def test_position_beyond_the_table_is_refused_before_any_write(folder, monkeypatch):
    from radixserve.forward_batch import ForwardBatch

    runner = _runner(folder, monkeypatch, True)
    driver = DirectDriver(runner)
    req = driver.new_request()
    driver.extend([req], [list(range(3, 20))])
    kv_before = [b.clone() for i in range(runner.model.config.num_layers) for b in runner.token_to_kv_pool.get_kv_buffer(i)]
    slots = runner.token_to_kv_pool_allocator.alloc_decode([18], driver._last_locs([req]))
    fb = ForwardBatch.for_decode([5], [req.row], [18], slots, runner.device)
    fb.positions = torch.tensor([runner.model.rotary.max_position])  # one past the cos/sin table
    with pytest.raises(ValueError, match="position beyond the rotary table"):
        runner.forward(fb)
    kv_after = [b for i in range(runner.model.config.num_layers) for b in runner.token_to_kv_pool.get_kv_buffer(i)]
    assert all(torch.equal(a, b) for a, b in zip(kv_before, kv_after, strict=True))
    runner.token_to_kv_pool_allocator.free(slots)
    driver.release_all()


def test_silu_and_mul_of_prefill_batches_is_the_step_loop(folder, monkeypatch):
    """From DEFAULT_ROWS.prefill_passes_from rows the layers' SiLU-and-mul is the step's C loop (same rounding steps as
    the compiled op: a result differs, if at all, by one bf16 unit in a few places); the switch restores
    the compiled op."""
    runner = _runner(folder, monkeypatch, True)
    act, compiled = runner.model.model.layers[0].mlp.act, runner.model.fused_ops.silu_and_mul
    assert isinstance(act, prefill_passes.RowSiluAndMul)
    g = torch.Generator().manual_seed(0)
    for rows in (1, DEFAULT_ROWS.prefill_passes_from - 1, DEFAULT_ROWS.prefill_passes_from, 300):
        gate_up = (torch.randn(rows, 512, generator=g) * 4).bfloat16()
        got, want = act(gate_up), compiled(gate_up)
        assert got.shape == want.shape == (rows, 256)
        assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
        assert (got != want).float().mean() < 0.01
    off = _runner(folder, monkeypatch, False)
    assert not isinstance(off.model.model.layers[0].mlp.act, prefill_passes.RowSiluAndMul)


def test_add_rmsnorm_of_prefill_batches_is_the_step_loop_bit_for_bit(folder, monkeypatch):
    """From DEFAULT_ROWS.prefill_passes_from rows every norm's add + RMSNorm is the step's C rows, bit-equal to the compiled
    op (the sum of squares in its order); below, and for a width the rows do not take, the compiled op itself; the
    switch restores the compiled op everywhere."""
    runner = _runner(folder, monkeypatch, True)
    norms = [n for layer in runner.model.model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    fused, compiled = norms[0].fused_add, runner.model.fused_ops.add_rmsnorm
    assert isinstance(fused, prefill_passes.RowAddRMSNorm)
    assert all(n.fused_add is fused for n in norms) and runner.model.model.norm.fused_add is fused
    width = runner.model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    weight = norms[0].weight.detach()
    calls, real = [], type(fused._kernel).add_rmsnorm
    monkeypatch.setattr(type(fused._kernel), "add_rmsnorm", lambda self, *a: calls.append(1) or real(self, *a))
    for rows in (1, DEFAULT_ROWS.prefill_passes_from - 1, DEFAULT_ROWS.prefill_passes_from, 300):
        x, residual = ((torch.randn(rows, width, generator=g) * 3).bfloat16() for _ in "xr")
        before = len(calls)
        got, want = fused(x, residual, weight), compiled(x, residual, weight)
        assert len(calls) - before == (rows >= DEFAULT_ROWS.prefill_passes_from)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), rows
    odd = prefill_passes.RowAddRMSNorm(fused._kernel, lambda *a: ("compiled",), fused.eps,
                                       DEFAULT_ROWS.prefill_passes_from)
    x = torch.randn(DEFAULT_ROWS.prefill_passes_from, 48).bfloat16()
    assert odd(x, x.clone(), torch.ones(48, dtype=torch.bfloat16)) == ("compiled",)
    off = _runner(folder, monkeypatch, False)
    assert off.model.model.layers[0].input_layernorm.fused_add is off.model.fused_ops.add_rmsnorm


def test_the_step_reads_the_exported_weight_view_and_says_why_it_declines(folder, monkeypatch):
    """The C decoder is built over `decoder_weights()` (the norms and linear layers of each layer), and the
    refusal names the first thing in that view it cannot run: here a layer left on oneDNN."""
    runner = _runner(folder, monkeypatch, True)
    view = runner.model.decoder_weights()
    assert len(view.layers) == runner.model.config.num_layers
    assert view.layers[1].gate_up is runner.model.model.layers[1].mlp.gate_up_proj
    plan = runner.execution_plan
    assert c_decoder.c_decoder_refusal(view, torch.bfloat16, plan.fused_ops, plan.linear_methods) is None
    monkeypatch.setenv("RADIXSERVE_DECODE_STEP", "1")
    onednn = ModelRunner(ServerArgs(model_path=str(folder), dtype="bfloat16", device="cpu", max_total_tokens=4096,
                                    attention_backend="cpu", linear_method="onednn"))
    assert onednn.model.c_decoder is None
    assert onednn.execution_plan.decoder_refusal == "layer 0: a linear layer runs onednn, not onednn_gemv or packed"
    assert onednn.execution_plan.as_dict()["decoder"]["reason"] == onednn.execution_plan.decoder_refusal
