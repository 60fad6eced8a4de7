"""Gemma 3 against transformers on a tiny random model, float32: window layers (W = 8) and full layers, two
rotary bases, q/k norms with random weights, a query scale that is not head_dim's, soft-capped logits.
Prompts and decodes run past the window, on the torch and the CPU (C kernel) backends, with cascade forced on
too (full and window layers). The pool is conserved after every test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from direct_driver import DirectDriver
from test_model_support import TINY_VOCAB, hf_last_logits, one_torch_thread, rel_err, save_tiny_tokenizer

from radixserve.configs.row_table import CascadePolicy
from radixserve.mem_cache.conservation import check_conservation
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

TOL = 1e-4
WINDOW = 8
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def tiny_gemma3_config(layer_types: list[str] = LAYER_TYPES):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        initializer_range=0.2, rms_norm_eps=1e-6,
        eos_token_id=1, bos_token_id=2, pad_token_id=0, sliding_window=WINDOW, layer_types=layer_types,
        query_pre_attn_scalar=24, final_logit_softcapping=30.0,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})


def make_tiny_gemma3(folder: Path, seed: int = 0, layer_types: list[str] = LAYER_TYPES):
    """A random tiny Gemma 3 saved to `folder` (norm weights random too: they start at zero); the HF model."""
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(tiny_gemma3_config(layer_types)).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(str(folder))
    save_tiny_tokenizer(folder)
    return model


CASES = ["torch", "cpu"]


@pytest.fixture(scope="module", params=CASES)
def setup(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    hf_model = make_tiny_gemma3(folder)
    args = ServerArgs(model_path=str(folder), dtype="float32", device="cpu", max_total_tokens=1024,
                      attention_backend=request.param)
    return hf_model, ModelRunner(args)


@pytest.fixture
def driver(setup):
    _, runner = setup
    driver = DirectDriver(runner)
    yield driver
    driver.release_all()
    assert check_conservation(runner.token_to_kv_pool_allocator, None, runner.req_to_token_pool, []) is not None
    assert runner.token_to_kv_pool_allocator.available_size() == runner.max_total_num_tokens


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in lengths]


def test_config_reads_windows_and_ropes(setup):
    _, runner = setup
    cfg = runner.model_config
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert cfg.layer_windows == (WINDOW, WINDOW, None, WINDOW) and cfg.windows == (WINDOW,)
    assert (cfg.rope.theta, cfg.local_rope.theta) == (1_000_000.0, 10_000.0)
    assert cfg.query_pre_attn_scalar == 24 and cfg.final_logit_softcapping == 30.0
    assert runner.attn_backend.plan.windows == (WINDOW,)
    assert [layer.self_attn.attn.sliding_window for layer in runner.model.model.layers] == [8, 8, None, 8]
    assert runner.execution_plan.choice("fused ops") == "off"


def test_prefill_past_the_window(setup, driver):
    hf_model, _ = setup
    prompts = _prompts([5, 30, 17, 8], seed=1)
    reqs = [driver.new_request() for _ in prompts]
    logits = driver.extend(reqs, prompts)
    for i, prompt in enumerate(prompts):
        assert rel_err(logits[i], hf_last_logits(hf_model, prompt)) < TOL
    # NOTE: the window changes the answer here (else these tests could not tell a window from none)
    hf_model.config.sliding_window = 10_000
    try:
        unwindowed = hf_last_logits(hf_model, prompts[1])
    finally:
        hf_model.config.sliding_window = WINDOW
    assert rel_err(logits[1], unwindowed) > 1e-3


def test_extend_over_cached_prefix_longer_than_window(setup, driver):
    hf_model, _ = setup
    shared, tail_a, tail_b, other = _prompts([20, 6, 1, 9], seed=2)
    owner = driver.new_request()
    driver.extend([owner], [shared + [5, 6]])
    a = driver.new_request(share_prefix_of=owner, prefix_len=20)
    b = driver.new_request(share_prefix_of=owner, prefix_len=11)
    fresh = driver.new_request()
    logits = driver.extend([a, fresh, b], [tail_a, other, shared[11:] + tail_b])
    assert rel_err(logits[0], hf_last_logits(hf_model, shared + tail_a)) < TOL
    assert rel_err(logits[1], hf_last_logits(hf_model, other)) < TOL
    assert rel_err(logits[2], hf_last_logits(hf_model, shared + tail_b)) < TOL


def test_decode_across_the_window(setup, driver):
    hf_model, _ = setup
    prompts = _prompts([3, 14, 6, 21], seed=3)
    reqs = [driver.new_request() for _ in prompts]
    logits = driver.extend(reqs, prompts)
    worst = 0.0
    for _ in range(12):
        logits = driver.decode(reqs, logits.argmax(-1).tolist())
        for i, req in enumerate(reqs):
            worst = max(worst, rel_err(logits[i], hf_last_logits(hf_model, req.token_ids)))
    assert worst < TOL
    assert [len(r.token_ids) for r in reqs] == [15, 26, 18, 33]


def test_cascade_batches_keep_windows(setup, driver):
    """Cascade forced on for tiny prefixes: full layers split the shared prefix, window layers the part of it
    inside their windows (a 16-token prefix, W = 8)."""
    hf_model, runner = setup
    backend = runner.attn_backend
    policy, backend.cascade = backend.cascade, CascadePolicy(min_prefix=4, min_decode_batch=2, min_decode_saved=1)
    before, windows_before = dict(backend.cascade_forwards), dict(backend.window_cascade_forwards)
    try:
        (shared,) = _prompts([16], seed=4)
        owner = driver.new_request()
        driver.extend([owner], [shared])
        reqs = [driver.new_request(share_prefix_of=owner, prefix_len=16) for _ in range(3)]
        tails = _prompts([2, 5, 3], seed=5)
        logits = driver.extend(reqs, tails)
        for _ in range(4):
            logits = driver.decode(reqs, logits.argmax(-1).tolist())
        for i, req in enumerate(reqs):
            assert rel_err(logits[i], hf_last_logits(hf_model, req.token_ids)) < TOL
    finally:
        backend.cascade = policy
    assert backend.cascade_forwards["extend"] > before["extend"]
    assert backend.cascade_forwards["decode"] > before["decode"]
    assert backend.window_cascade_forwards["extend"] > windows_before["extend"]
    assert backend.window_cascade_forwards["decode"] > windows_before["decode"]


def test_gemma_chat_template_renders_turns():
    from transformers import PreTrainedTokenizerFast

    from radixserve.model_loader.model_folder import GEMMA_CHAT_TEMPLATE

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_word_tokenizer(), bos_token="<bos>")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello! "}, {"role": "user", "content": "Bye"}]
    text = tokenizer.apply_chat_template(messages, chat_template=GEMMA_CHAT_TEMPLATE, tokenize=False,
                                         add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!"
                    "<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


def _word_tokenizer():
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<bos>": 1}, unk_token="<unk>"))


def test_unsupported_gemma_variants_are_refused():
    from radixserve.configs.model_config import ModelConfig, ModelLoadError

    hf = tiny_gemma3_config().to_dict()
    hf["architectures"] = ["Gemma3ForCausalLM"]
    assert ModelConfig.from_hf_dict(hf).layer_windows == (WINDOW, WINDOW, None, WINDOW)
    with pytest.raises(ModelLoadError, match="soft-capping"):
        ModelConfig.from_hf_dict({**hf, "attn_logit_softcapping": 50.0})
    with pytest.raises(ModelLoadError, match="layer_types"):
        ModelConfig.from_hf_dict({**hf, "layer_types": ["sliding_attention"]})


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_engine_chunked_prefill_and_prefix_reuse_past_the_window(overlap, tmp_path):
    """Through the scheduler: prompts 5x the window, prefilled in chunks of 6 (chunks start inside a window),
    then reused from the radix cache by a longer prompt; greedy tokens equal transformers' generate, and the
    pool is conserved."""
    from radixserve import Engine

    hf_model = make_tiny_gemma3(tmp_path)
    base, other = _prompts([40, 23], seed=6)
    prompts = [base, other, base + [7, 9, 11]]
    with torch.inference_mode():
        expected = [hf_model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, min_new_tokens=10,
                                      pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    params = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
    with Engine(model_path=str(tmp_path), dtype="float32", device="cpu", max_total_tokens=1024,
                chunked_prefill_size=6, disable_overlap_schedule=not overlap, log_level="warning") as engine:
        first = engine.generate(input_ids=prompts[:2], sampling_params=params)
        again = engine.generate(input_ids=prompts[2], sampling_params=params)
        state = engine.get_internal_state()
    assert [r["output_ids"] for r in first] + [again["output_ids"]] == expected
    assert again["meta_info"]["cached_tokens"] >= 40
    assert state["kv_conservation"] is not None and "error" not in state["kv_conservation"], state
    assert state["protected_tokens"] == 0 and state["num_running_reqs"] == 0
