"""LoRA adapters over packed int4 / int8 base weights (tiny Llama in the C decoder's shapes, two PEFT adapters):

- a row's decode logits do not depend on the rows beside it: a base row between adapter rows, and each adapter's rows
  (one contiguous run or scattered: an index segment), equal the same request decoded alone, bit for bit, at 1 row, at
  2-4 rows (the tiled kernel's lockstep group) and up to the C decoder's row limit (`CDecoder.max_rows`); above
  it the Python layers run the batch (the weights expanded, float activations), where a row equals itself alone on
  that path and a base row equals itself in a batch without adapters;
- the C step adds the deltas the Python layers add (after the packed product, to the same rows);
- the adapter's effect is PEFT's on the dequantized weights: with every product on float activations (the tiled
  kernel off), our logits equal those of an HF model holding the dequantized weights with the adapter merged.

NOTE: every request is prefilled alone. A prefill's own rows are not batch-invariant by design: its row count picks
the product (the tiled kernel on int8-rounded activations up to `RowTable.tiled_rows` rows, float GEMM above) and the passes
between products (`RowTable.prefill_passes_from`), and the decode steps' int8 activation rounding turns the float32-rounding
difference this leaves in the KV into ~0.3 nats (docs/quantization.md, "Batch invariance").
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from direct_driver import DirectDriver
from lora_support import SPECS, make_peft_adapter
from test_model_support import hf_last_logits, one_torch_thread, rel_err, save_tiny_tokenizer

from radixserve.layers.linear import linear_layers
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

ADAPTERS = SPECS[:2]  # "sql" (q, v, down; rank 4) and "chat" (every module; rank 8)
STEPS = 3
# A base row between adapter rows, "chat" on scattered rows (an index segment) and in runs; cycled to any size
PATTERN = ("sql", None, "chat", "chat", None, "sql", "chat", None, "sql")
SMALL_SIZES = (1, 2, 3, 4, 9)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A tiny Llama whose widths the tiled kernels and the C decoder take, saved with the two adapters; returns
    (root, the HF base model)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("lora-quantized")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.05, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    base.save_pretrained(str(root / "base"))
    save_tiny_tokenizer(root / "base")
    for spec in ADAPTERS:
        make_peft_adapter(base, root / spec.name, spec, b_scale=0.3)
    return root, base


def _runner(root: Path, quantization: str) -> ModelRunner:
    paths = tuple(f"{spec.name}={root / spec.name}" for spec in ADAPTERS)
    return ModelRunner(ServerArgs(model_path=str(root / "base"), dtype="float32", device="cpu", max_total_tokens=4096,
                                  attention_backend="cpu", quantization=quantization, lora_paths=paths,
                                  max_loras_per_batch=2))


class _Recorder:
    """Stands in for the C decoder and notes the batch size of each forward it ran."""

    def __init__(self, step: Any) -> None:
        self.step, self.calls = step, []
        self.max_rows = step.max_rows

    def takes(self, fb: Any) -> bool:
        return self.step.takes(fb)

    def __call__(self, hidden: torch.Tensor, fb: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append(fb.batch_size)
        return self.step(hidden, fb)


def _prompt(i: int) -> list[int]:
    return [(7 * i + 5 * j) % 250 + 3 for j in range(5 + i % 7)]


def _decode_rows(runner: ModelRunner, rows: list[int], names: list[str | None],
                 expand: bool = False) -> list[torch.Tensor]:
    """Requests `rows` (prompt and tokens by row number) under `names`, each prefilled alone, then STEPS decode steps
    of all of them in one batch: each step's logits [len(rows), vocab]. `expand`: the decode steps' packed products
    on the expanded weights (float activations) at any row count."""
    driver = DirectDriver(runner)
    adapters = [None if n is None else runner.lora.get(n) for n in names]
    reqs = [driver.new_request() for _ in rows]
    try:
        for req, row, adapter in zip(reqs, rows, adapters, strict=True):
            driver.extend([req], [_prompt(row)], [adapter])  # NOTE: alone: the same KV whatever the batch
        # NOTE: fixed tokens (not each row's argmax): a row's inputs never depend on another row's outputs
        with _expanded(runner) if expand else contextlib.nullcontext():
            return [driver.decode(reqs, [(11 * row + 3 * s) % 250 + 3 for row in rows], adapters)
                    for s in range(STEPS)]
    finally:
        driver.release_all()


def _pattern(size: int) -> list[str | None]:
    return [PATTERN[i % len(PATTERN)] for i in range(size)]


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_a_row_of_a_mixed_decode_batch_equals_the_row_alone(models, monkeypatch, quantization):
    """Base rows between adapter rows and adapters on scattered rows, at every batch size the C step takes and one
    above: each row's logits at every step are those of the same request decoded alone on the same path."""
    root, _ = models
    monkeypatch.setenv("RADIXSERVE_DECODE_STEP", "1")
    runner = _runner(root, quantization)
    assert runner.model.model.layers[0].mlp.down_proj.method.chosen_by_format  # NOTE: packed weights, truly
    step = runner.model.c_decoder
    if step is None:
        pytest.skip("no C decoder here (no tiled kernels): the product path changes with the batch size")
    recorder = _Recorder(step)
    runner.model.set_decoder(recorder)
    alone: dict[tuple[int, str | None], list[torch.Tensor]] = {}
    for size in (*SMALL_SIZES, step.max_rows):
        names = _pattern(size)
        for row, name in enumerate(names):
            if (row, name) not in alone:
                alone[row, name] = [logits[0] for logits in _decode_rows(runner, [row], [name])]
        recorder.calls.clear()
        batch = _decode_rows(runner, list(range(size)), names)
        assert recorder.calls == [size] * STEPS  # NOTE: the C step ran every step, as it ran each row alone
        for row, name in enumerate(names):
            for s in range(STEPS):
                assert torch.equal(batch[s][row], alone[row, name][s]), (size, row, name, s)
    # Not vacuous: each adapter moves its rows (the same request under the base model differs)
    for row, name in enumerate(_pattern(3)):
        if name is not None:
            assert rel_err(alone[row, name][0], _decode_rows(runner, [row], [None])[0][0]) > 1e-2

    # Above the step's limit the Python layers run the batch, on the expanded weights and float activations: a row
    # equals itself alone on that path (to the dense GEMM's rounding, which may differ with the row count), and a base
    # row is bit-equal to itself in a batch without adapters
    size = step.max_rows + 8
    names, rows = _pattern(size), list(range(size))
    recorder.calls.clear()
    mixed = _decode_rows(runner, rows, names)
    without = _decode_rows(runner, rows, [None] * size)
    assert recorder.calls == []
    runner.model.set_decoder(None)
    for row, name in enumerate(names):
        expanded = _decode_rows(runner, [row], [name], expand=True)
        for s in range(STEPS):
            assert rel_err(mixed[s][row], expanded[s][0]) < 1e-5, (row, name, s)
            if name is None:
                assert torch.equal(mixed[s][row], without[s][row]), (row, s)


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_the_c_step_adds_the_deltas_the_python_layers_add(models, monkeypatch, quantization):
    """The C step's LoRA rows (c_decoder_lora.py) against the Python layers' (LoraLinear.add_to after the packed
    method), for one adapter row and for mixed batches."""
    root, _ = models
    logits = {}
    for on in (True, False):
        monkeypatch.setenv("RADIXSERVE_DECODE_STEP", "1" if on else "0")
        runner = _runner(root, quantization)
        if on and runner.model.c_decoder is None:
            pytest.skip("no C decoder here (no tiled kernels)")
        assert (runner.model.c_decoder is None) != on
        logits[on] = {size: _decode_rows(runner, list(range(size)), _pattern(size)) for size in (1, 4, 9)}
    for size, c_step in logits[True].items():
        for s, (ours, theirs) in enumerate(zip(c_step, logits[False][size], strict=True)):
            for row, name in enumerate(_pattern(size)):
                # NOTE: the passes between the products round differently (C loops against inductor's), and such a
                # difference can flip one int8 rounding of an activation: up to ~5e-3 measured; an adapter's delta
                # moves these rows by 0.5-1.1
                assert rel_err(ours[row], theirs[row]) < 2e-2, (size, row, name, s)


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_the_adapter_is_peft_on_the_dequantized_weights(models, quantization):
    """With float activations in every product, our int4/int8 + LoRA logits are the float model of the dequantized
    weights with the adapter merged (PEFT's `merge_and_unload`), so the deltas are the adapter's, added once."""
    from peft import PeftModel

    root, base = models
    runner = _runner(root, quantization)
    reference = _dequantized_hf(runner, base)
    prompts = [_prompt(i) for i in range(3)]
    driver = DirectDriver(runner)
    reqs = [driver.new_request() for _ in prompts]
    names = [None, "sql", "chat"]
    try:
        with _expanded(runner):
            logits = driver.extend(reqs, prompts, [None if n is None else runner.lora.get(n) for n in names])
    finally:
        driver.release_all()
    assert rel_err(logits[0], hf_last_logits(reference, prompts[0])) < 1e-4
    for row, name in enumerate(names[1:], start=1):
        merged = PeftModel.from_pretrained(_dequantized_hf(runner, base), str(root / name)).merge_and_unload()
        ref = hf_last_logits(merged, prompts[row])
        assert rel_err(logits[row], ref) < 1e-4, name
        assert rel_err(ref, hf_last_logits(reference, prompts[row])) > 1e-2  # NOTE: the adapter moves it


@contextlib.contextmanager
def _expanded(runner: ModelRunner) -> Iterator[None]:
    """Every packed product of `runner` on the expanded weight and float activations, at any row count, while it lasts
    (the tiled kernel and the row layout's small-batch kernel round activations to int8)."""
    methods = [layer.method for _, layer in linear_layers(runner.model)]
    saved = [m.rows for m in methods]
    for m in methods:
        m.rows = dataclasses.replace(m.rows, tiled_rows=0, packed_rows=0)
    try:
        yield
    finally:
        for m, rows in zip(methods, saved, strict=True):
            m.rows = rows


def _dequantized_hf(runner: ModelRunner, base: torch.nn.Module) -> torch.nn.Module:
    """A copy of the HF base model holding the runner's packed weights, dequantized to float32."""
    model = copy.deepcopy(base)
    ours, cfg = runner.model.model, runner.model_config
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    with torch.no_grad():
        for mine, theirs in zip(ours.layers, model.model.layers, strict=True):
            qkv, gate_up = mine.self_attn.qkv_proj.dense_weight(), mine.mlp.gate_up_proj.dense_weight()
            attn, mlp = theirs.self_attn, theirs.mlp
            for target, weight in ((attn.q_proj, qkv[:q]), (attn.k_proj, qkv[q:q + kv]), (attn.v_proj, qkv[q + kv:]),
                                   (attn.o_proj, mine.self_attn.o_proj.dense_weight()), (mlp.gate_proj, gate_up[:inter]),
                                   (mlp.up_proj, gate_up[inter:]), (mlp.down_proj, mine.mlp.down_proj.dense_weight())):
                target.weight.copy_(weight.float())
        embed = runner.model.model.embed_tokens
        if hasattr(embed, "packed"):
            model.model.embed_tokens.weight.copy_(embed.packed.dequantize(torch.float32))
        head = runner.model.lm_head
        if hasattr(head, "method") and head.method.chosen_by_format:
            model.lm_head.weight.copy_(head.dense_weight().float())
    return model.eval()
