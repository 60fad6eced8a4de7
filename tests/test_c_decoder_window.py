"""Sliding windows on Llama-family models (Mistral's and Qwen2's `sliding_window`): read per layer from the
config, served as window layers (no longer a context cap), equal to transformers; and the one-call C decode
step with attention groups (csrc/decode_loop.h): full layers read the full table, window layers their window's,
with a hybrid KV pool and without. Prompts run past the window; the pool is conserved after every run."""

from __future__ import annotations

import pytest
import torch
from direct_driver import DirectDriver
from kernel_levels import force_level
from test_c_decoder import Recorder
from test_model_support import TINY_VOCAB, one_torch_thread, rel_err, save_tiny_tokenizer

from radixserve.configs.model_config import ModelConfig
from radixserve.kernels.c_decoder import F32_LEVELS
from radixserve.layers.gemv import load_gemv_kernel
from radixserve.mem_cache.conservation import check_conservation
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

WINDOW = 8


def _save(config, folder, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(str(folder))
    save_tiny_tokenizer(folder)
    return model


def qwen2_window_config(vocab: int = 256):
    """Layer 0 full, layers 1-2 sliding (Qwen2: windows from `max_window_layers` on); a QKV bias."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       initializer_range=0.1, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2,
                       use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


def mistral_window_config(vocab: int = 256):
    """Every layer sliding (Mistral 7B v0.1's form)."""
    from transformers import MistralConfig

    return MistralConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                         initializer_range=0.1, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2,
                         sliding_window=WINDOW)


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2-window")
    _save(qwen2_window_config(), folder)
    return folder


def test_llama_family_windows_are_read_per_layer_and_do_not_cap_the_context():
    qwen = ModelConfig.from_hf_dict(qwen2_window_config().to_dict())
    assert qwen.layer_windows == (None, WINDOW, WINDOW) and qwen.context_len == 512
    mistral = ModelConfig.from_hf_dict(mistral_window_config().to_dict())
    assert mistral.layer_windows == (WINDOW, WINDOW) and mistral.windows == (WINDOW,)
    off = qwen2_window_config().to_dict() | {"use_sliding_window": False}
    assert ModelConfig.from_hf_dict(off).layer_windows == ()
    no_window = mistral_window_config().to_dict() | {"sliding_window": None}
    assert ModelConfig.from_hf_dict(no_window).layer_windows == ()


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "one-pool"])
def test_window_models_match_transformers(tmp_path, kind, hybrid):
    """float32, torch layers: greedy tokens equal to transformers' (which masks the window itself) for 24 tokens
    of prompts shorter and longer than the window, first-step logits to 1e-4; the pool conserved after."""
    config = (qwen2_window_config if kind == "qwen2" else mistral_window_config)(TINY_VOCAB)
    hf_model = _save(config, tmp_path)
    runner = ModelRunner(ServerArgs(model_path=str(tmp_path), dtype="float32", device="cpu", max_total_tokens=1024,
                                    attention_backend="cpu", disable_hybrid_swa_memory=not hybrid))
    assert runner.model.model.layers[-1].self_attn.attn.sliding_window == WINDOW
    assert (runner.swa_window is not None) == hybrid
    driver = DirectDriver(runner)
    prompts = _prompts([5, 13, 30], seed=1)
    reqs = [driver.new_request() for _ in prompts]
    logits = driver.extend(reqs, prompts)
    tokens = [[int(t)] for t in logits.argmax(-1)]
    for i, prompt in enumerate(prompts):
        ref = hf_model(input_ids=torch.tensor([prompt])).logits[0, -1].detach()
        assert rel_err(logits[i], ref) < 1e-4
    for _ in range(23):
        logits = driver.decode(reqs, [t[-1] for t in tokens])
        for row, t in zip(tokens, logits.argmax(-1).tolist(), strict=True):
            row.append(t)
    driver.release_all()
    check_conservation(runner.token_to_kv_pool_allocator, None, runner.req_to_token_pool, [])
    assert runner.token_to_kv_pool_allocator.available_size() == runner.max_total_num_tokens
    for prompt, ours in zip(prompts, tokens, strict=True):
        assert ours == _hf_greedy(hf_model, prompt, 24)


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """transformers' argmax tokens, the whole sequence recomputed each step (no stop on EOS, as ours here)."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _step_run(runner: ModelRunner, bs: int) -> tuple[list[torch.Tensor], list[int], list[list[int]]]:
    """Ragged prompts (most past the window), then five greedy decode steps: the logits, the C calls, the tokens."""
    driver = DirectDriver(runner)
    reqs = [driver.new_request() for _ in range(bs)]
    lens = [5 + 11 * i % 40 for i in range(bs)]
    logits = [driver.extend(reqs, [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate(lens)])]
    recorder = None
    if runner.model.c_decoder is not None:
        recorder = runner.model.c_decoder = Recorder(runner.model.c_decoder)
    tokens = [logits[-1].argmax(-1).tolist()]
    for _ in range(5):
        logits.append(driver.decode(reqs, tokens[-1]))
        tokens.append(logits[-1].argmax(-1).tolist())
    driver.release_all()
    check_conservation(runner.token_to_kv_pool_allocator, None, runner.req_to_token_pool, [])
    assert runner.token_to_kv_pool_allocator.available_size() == runner.max_total_num_tokens
    return logits, [] if recorder is None else recorder.calls, tokens


def _runner(folder, monkeypatch, on: bool, dtype: str, linear_method: str, hybrid: bool) -> ModelRunner:
    monkeypatch.setenv("RADIXSERVE_DECODE_STEP", "1" if on else "0")
    runner = ModelRunner(ServerArgs(model_path=str(folder), dtype=dtype, device="cpu", max_total_tokens=2048,
                                    attention_backend="cpu", linear_method=linear_method,
                                    disable_hybrid_swa_memory=not hybrid))
    assert (runner.model.c_decoder is not None) == on
    return runner


@pytest.mark.skipif(load_gemv_kernel() is None, reason="needs AVX512-BF16 (the bf16 C decoder)")
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "one-pool"])
@pytest.mark.parametrize("bs", [1, 4])
def test_bf16_step_with_windows_is_bit_equal(qwen2_folder, monkeypatch, hybrid, bs):
    """The bf16 step over a full layer and two window layers: every decode step in C, logits bit-equal to the
    Python layers (which attend through the window tables) at every step."""
    runs = {on: _step_run(_runner(qwen2_folder, monkeypatch, on, "bfloat16", "onednn_gemv", hybrid), bs)
            for on in (False, True)}
    (off_logits, _, off_tokens), (on_logits, calls, on_tokens) = runs[False], runs[True]
    assert calls == [bs] * 5
    for off, on in zip(off_logits, on_logits, strict=True):
        assert torch.equal(on, off)
    assert on_tokens == off_tokens


LEVELS = [pytest.param(isa, id=isa) for isa in reversed(F32_LEVELS) if isa != "avx512_bf16"]


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "one-pool"])
def test_f32_step_with_windows_matches_python_layers(qwen2_folder, monkeypatch, isa, hybrid):
    """The float32 step (bf16 weights) at each vector level: to float32 rounding of the Python layers, same tokens;
    a window layer reading the full table (a wrong group) moves the logits by far more than that."""
    force_level(isa, monkeypatch)
    runs = {on: _step_run(_runner(qwen2_folder, monkeypatch, on, "float32", "bf16_weights", hybrid), 5)
            for on in (False, True)}
    (off_logits, _, off_tokens), (on_logits, calls, on_tokens) = runs[False], runs[True]
    assert calls == [5] * 5
    for off, on in zip(off_logits[1:], on_logits[1:], strict=True):
        assert rel_err(on, off) < 1e-5
    assert on_tokens == off_tokens


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_engine_serves_an_all_window_mistral_with_prefix_reuse(tmp_path, overlap):
    """Every layer a window layer (no full layer holds KV at all): the scheduler's hybrid pool frees window KV as
    requests slide, a shared 24-token prefix (3x the window) is reused, greedy tokens equal transformers', and
    both pools are conserved."""
    from radixserve import Engine

    hf_model = _save(mistral_window_config(TINY_VOCAB), tmp_path)
    system = _prompts([24], seed=5)[0]
    prompts = [system + tail for tail in _prompts([3, 11, 6], seed=6)]
    expected = [_hf_greedy(hf_model, p, 16) for p in prompts]
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    with Engine(model_path=str(tmp_path), dtype="float32", device="cpu", max_total_tokens=1024,
                disable_overlap_schedule=not overlap, log_level="warning") as engine:
        first = engine.generate(input_ids=prompts[0], sampling_params=params)
        rest = engine.generate(input_ids=prompts[1:], sampling_params=params)
        state = engine.get_internal_state()
    assert [r["output_ids"] for r in [first, *rest]] == expected
    assert min(r["meta_info"]["cached_tokens"] for r in rest) >= 16
    report = state["kv_conservation"]
    assert report is not None and "error" not in report, state
    assert state["sliding_window"] == WINDOW and state["num_running_reqs"] == 0
