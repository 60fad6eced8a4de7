"""LoRA rows inside the one-call C decoder (models/c_decoder_lora.py, csrc/decode_lora.h): decode batches
mixing rows of the base model with rows of two to four PEFT adapters (ranks 2-16, different target sets,
rslora; lora_support.SPECS), an adapter on non-contiguous rows, run in the C step, against the Python layers:
bf16 logits bit-equal (both add the deltas with the same SGMV kernel on the same inputs), float32 at each vector
level to 1e-5, greedy tokens identical, the pool conserved after every run. Llama and Gemma 3 layers; a segment
the Python layers would multiply with torch is declined."""

from __future__ import annotations

import pytest
import torch
from direct_driver import DirectDriver
from kernel_levels import force_level
from lora_support import SPECS, make_peft_adapter
from test_c_decoder import Recorder
from test_model_gemma3 import make_tiny_gemma3
from test_model_support import one_torch_thread, rel_err, save_tiny_tokenizer

from radixserve.configs.row_table import DEFAULT_ROWS
from radixserve.kernels.c_decoder import F32_LEVELS
from radixserve.kernels.lora import load_lora_kernel
from radixserve.layers.gemv import load_gemv_kernel
from radixserve.mem_cache.conservation import check_conservation
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

pytestmark = pytest.mark.skipif(load_lora_kernel() is None, reason="the C LoRA kernel does not build here")
_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)
needs_bf16 = pytest.mark.skipif(load_gemv_kernel() is None, reason="needs AVX512-BF16 (the bf16 C decoder)")
F32 = [pytest.param(isa, id=isa) for isa in reversed(F32_LEVELS) if isa != "avx512_bf16"]

# Four adapters and the base model; "sql" and "chat" on non-contiguous rows (index segments)
MIXED = ["sql", None, "chat", "code", "sql", None, "math", "chat"]
# The bf16 step takes 4 rows on the GEMV (32 with AMX): two adapters, a base row, "sql" on rows 0 and 3
MIXED4 = ["sql", "chat", None, "sql"]
STEPS = 4


def _with_adapters(root, base) -> None:
    for spec in SPECS:
        make_peft_adapter(base, root / spec.name, spec, b_scale=0.3)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama in the shapes the step takes (head_dim 32, widths multiples of 32) and the SPECS adapters."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("lora-step")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    base.save_pretrained(str(root / "base"))
    save_tiny_tokenizer(root / "base")
    _with_adapters(root, base)
    return root


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-step-gemma3")
    _with_adapters(root, make_tiny_gemma3(root / "base"))
    return root


def _runner(root, monkeypatch, on: bool, dtype: str, linear_method: str) -> ModelRunner:
    monkeypatch.setenv("RADIXSERVE_DECODE_STEP", "1" if on else "0")
    paths = tuple(f"{spec.name}={root / spec.name}" for spec in SPECS)
    runner = ModelRunner(ServerArgs(model_path=str(root / "base"), dtype=dtype, device="cpu", max_total_tokens=4096,
                                    attention_backend="cpu", linear_method=linear_method, lora_paths=paths,
                                    max_loras_per_batch=4))
    assert (runner.model.c_decoder is not None) == on, runner.execution_plan.as_dict()["decoder"]
    return runner


def _lora_run(runner: ModelRunner, names: list[str | None],
              lora: bool = True) -> tuple[list[torch.Tensor], list[int], list[list[int]]]:
    """Ragged prompts under each row's adapter (`lora` False: the base model for every row), then STEPS greedy
    decode steps: the logits, the C calls, the tokens; the pool conserved after."""
    driver = DirectDriver(runner)
    adapters = [None if n is None else runner.lora.get(n) for n in names] if lora else None
    reqs = [driver.new_request() for _ in names]
    lens = [5 + 11 * i % 40 for i in range(len(names))]
    logits = [driver.extend(reqs, [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate(lens)], adapters)]
    recorder = None
    if runner.model.c_decoder is not None:
        recorder = runner.model.c_decoder = Recorder(runner.model.c_decoder)
    tokens = [logits[-1].argmax(-1).tolist()]
    for _ in range(STEPS):
        logits.append(driver.decode(reqs, tokens[-1], adapters))
        tokens.append(logits[-1].argmax(-1).tolist())
    driver.release_all()
    check_conservation(runner.token_to_kv_pool_allocator, None, runner.req_to_token_pool, [])
    assert runner.token_to_kv_pool_allocator.available_size() == runner.max_total_num_tokens
    return logits, [] if recorder is None else recorder.calls, tokens


def _bf16_max_rows(root, monkeypatch) -> int:
    return _runner(root, monkeypatch, True, "bfloat16", "onednn_gemv").model.c_decoder.max_rows


def _both(root, monkeypatch, names, dtype: str, linear_method: str):
    return [_lora_run(_runner(root, monkeypatch, on, dtype, linear_method), names) for on in (False, True)]


CASES = {"mixed": MIXED4, "four-adapters": ["math", "code", "chat", "sql"], "one-row": ["chat"],
         "eight": MIXED, "two-of-16": ["sql", "math"] * 16}


@needs_bf16
@pytest.mark.parametrize("case", list(CASES))
def test_bf16_step_with_lora_rows_is_bit_equal(llama, monkeypatch, case):
    names = CASES[case]
    (off_logits, _, off_tokens), (on_logits, calls, on_tokens) = _both(llama, monkeypatch, names, "bfloat16",
                                                                       "onednn_gemv")
    # NOTE: 8 and 32 rows run in the step where the AMX kernel takes them (max_rows 32), else the Python layers
    taken = len(names) <= 4 or _bf16_max_rows(llama, monkeypatch) >= len(names)
    assert calls == ([len(names)] * STEPS if taken else [])
    # NOTE: the same linear, attention and SGMV kernels on the same bf16 inputs: bit-equal at every step
    for off, on in zip(off_logits, on_logits, strict=True):
        assert torch.equal(on, off)
    assert on_tokens == off_tokens


@needs_bf16
def test_bf16_step_with_lora_rows_on_two_threads(llama, monkeypatch):
    """The SGMV kernel's OpenMP split of rows and columns changes no sum's order: bit-equal on two threads too."""
    torch.set_num_threads(2)
    try:
        (off_logits, _, _), (on_logits, calls, _) = _both(llama, monkeypatch, MIXED4, "bfloat16", "onednn_gemv")
    finally:
        torch.set_num_threads(1)
    assert calls == [len(MIXED4)] * STEPS
    assert all(torch.equal(on, off) for off, on in zip(off_logits, on_logits, strict=True))


@needs_bf16
def test_the_adapters_move_their_rows_and_leave_the_base_rows(llama, monkeypatch):
    """Not a vacuous comparison: in the step, the adapter rows' logits differ from the base model's on the same
    prompts, and the base rows are bit-equal to a batch without any adapter."""
    runner = _runner(llama, monkeypatch, True, "bfloat16", "onednn_gemv")
    with_lora, calls, _ = _lora_run(runner, MIXED4)
    runner.model.c_decoder = runner.model.c_decoder.step  # NOTE: unwrap the Recorder
    base, _, _ = _lora_run(runner, MIXED4, lora=False)
    assert calls == [len(MIXED4)] * STEPS
    for row, name in enumerate(MIXED4):
        if name is None:
            assert all(torch.equal(a[row], b[row]) for a, b in zip(with_lora, base, strict=True))
        else:
            assert rel_err(with_lora[1][row], base[1][row]) > 1e-2


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_segment_the_python_layers_give_torch_is_declined(llama, monkeypatch, dtype):
    """One adapter on one row more than `RowTable.lora_segment_rows` (bf16 32, float32 128), which the Python layers multiply with torch
    rather than the C kernel: the step declines the batch and the Python layers run it (the same logits both
    ways in bf16, in float32 to rounding); one row fewer runs in the step."""
    torch_dtype, method = (torch.bfloat16, "onednn_gemv") if dtype == "bfloat16" else (torch.float32, "bf16_weights")
    rows = DEFAULT_ROWS.lora_segment_rows(torch_dtype) + 1
    if dtype == "bfloat16" and (load_gemv_kernel() is None or _bf16_max_rows(llama, monkeypatch) < rows):
        pytest.skip(f"the bf16 step takes {rows} rows only with the AMX kernel")
    for names, taken in ((["chat"] * rows, False), (["chat"] * (rows - 1) + [None], True)):
        (off_logits, _, off_tokens), (on_logits, calls, on_tokens) = _both(llama, monkeypatch, names, dtype, method)
        assert calls == ([len(names)] * STEPS if taken else [])
        for off, on in zip(off_logits[1:], on_logits[1:], strict=True):
            # NOTE: float32 batches of `prefill_passes_from` rows or more run the step's passes in the Python layers too
            assert torch.equal(on, off) if dtype == "bfloat16" else rel_err(on, off) < 1e-5
        assert on_tokens == off_tokens


@pytest.mark.parametrize("isa", F32)
def test_f32_step_with_lora_rows_matches_python_layers(llama, monkeypatch, isa):
    force_level(isa, monkeypatch)
    (off_logits, _, off_tokens), (on_logits, calls, on_tokens) = _both(llama, monkeypatch, MIXED, "float32",
                                                                       "bf16_weights")
    assert calls == [len(MIXED)] * STEPS
    # NOTE: the SGMV kernel is the same; the passes between the products differ from inductor's in the last bits
    # (a prefill of `prefill_passes_from` rows or more runs the step's passes too)
    assert rel_err(on_logits[0], off_logits[0]) < 1e-5
    for off, on in zip(off_logits[1:], on_logits[1:], strict=True):
        assert rel_err(on, off) < 1e-5
    assert on_tokens == off_tokens


@needs_bf16
def test_bf16_gemma3_step_with_lora_rows_is_bit_equal(gemma, monkeypatch):
    (off_logits, _, off_tokens), (on_logits, calls, on_tokens) = _both(gemma, monkeypatch, MIXED4, "bfloat16",
                                                                       "onednn_gemv")
    assert calls == [len(MIXED4)] * STEPS
    assert all(torch.equal(on, off) for off, on in zip(off_logits, on_logits, strict=True))
    assert on_tokens == off_tokens


@pytest.mark.parametrize("isa", F32)
def test_f32_gemma3_step_with_lora_rows_matches_python_layers(gemma, monkeypatch, isa):
    force_level(isa, monkeypatch)
    (off_logits, _, off_tokens), (on_logits, calls, on_tokens) = _both(gemma, monkeypatch, MIXED, "float32",
                                                                       "bf16_weights")
    assert calls == [len(MIXED)] * STEPS
    for off, on in zip(off_logits[1:], on_logits[1:], strict=True):
        assert rel_err(on, off) < 1e-5
    assert on_tokens == off_tokens
