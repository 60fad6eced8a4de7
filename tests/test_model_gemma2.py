"""Gemma 2 against transformers' eager attention (which soft-caps scores) on a tiny random model, float32: window
layers (W = 8, even indices) and full layers, one rotary, no q/k norms, a query scale that is not head_dim's,
soft-capped attention scores (a low cap, so that it changes the answer) and logits. Prompts and decodes run
past the window on the torch and the CPU backends; greedy tokens through the Engine with the hybrid KV pool on
and off. The pool is conserved after every test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from direct_driver import DirectDriver
from test_model_support import TINY_VOCAB, hf_last_logits, one_torch_thread, rel_err, save_tiny_tokenizer

from radixserve.mem_cache.conservation import check_conservation
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

TOL = 1e-4
WINDOW = 8
ATTN_CAP, FINAL_CAP = 4.0, 20.0


def tiny_gemma2_config(**overrides):
    from transformers import Gemma2Config

    fields = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  initializer_range=0.2, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2, pad_token_id=0,
                  sliding_window=WINDOW, query_pre_attn_scalar=12, attn_logit_softcapping=ATTN_CAP,
                  final_logit_softcapping=FINAL_CAP, attn_implementation="eager")
    return Gemma2Config(**{**fields, **overrides})


def make_tiny_gemma2(folder: Path, seed: int = 0):
    """A random tiny Gemma 2 saved to `folder` (norm weights random too: they start at zero); the HF model."""
    from transformers import Gemma2ForCausalLM

    torch.manual_seed(seed)
    model = Gemma2ForCausalLM(tiny_gemma2_config()).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(str(folder))
    save_tiny_tokenizer(folder)
    assert model.config._attn_implementation == "eager"  # NOTE: the one transformers path that caps scores
    return model


@pytest.fixture(scope="module", params=["torch", "cpu"])
def setup(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma2")
    hf_model = make_tiny_gemma2(folder)
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


def test_config_and_plan(setup):
    _, runner = setup
    cfg = runner.model_config
    assert cfg.architecture == "Gemma2ForCausalLM" and type(runner.model).__name__ == "Gemma2ForCausalLM"
    assert cfg.layer_windows == (WINDOW, None, WINDOW, None) and cfg.windows == (WINDOW,)
    assert cfg.rope.theta == 10_000.0 and cfg.local_rope is None and not cfg.qk_norm
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.query_pre_attn_scalar) == (4.0, 20.0, 12)
    attns = [layer.self_attn for layer in runner.model.model.layers]
    assert [a.attn.logit_cap for a in attns] == [ATTN_CAP] * 4 and all(a.q_norm is None for a in attns)
    assert runner.model.local_rotary is None
    plan = runner.execution_plan
    assert plan.choice("attention soft-cap") == "4" and plan.choice("attention shared prefix") == "off"
    assert not runner.attn_backend.plan.cascade and runner.attn_backend.cascade is None
    assert plan.choice("fused ops") == "off" and plan.decoder == "python layers"


def test_prefill_past_the_window(setup, driver):
    hf_model, _ = setup
    prompts = _prompts([5, 30, 17, 8], seed=1)
    reqs = [driver.new_request() for _ in prompts]
    logits = driver.extend(reqs, prompts)
    for i, prompt in enumerate(prompts):
        assert rel_err(logits[i], hf_last_logits(hf_model, prompt)) < TOL
    # NOTE: the attention cap changes the answer here (else these tests could not tell capped from plain)
    attns = [layer.self_attn for layer in hf_model.model.layers]
    for attn in attns:
        attn.attn_logit_softcapping = None
    try:
        uncapped = hf_last_logits(hf_model, prompts[1])
    finally:
        for attn in attns:
            attn.attn_logit_softcapping = ATTN_CAP
    assert rel_err(logits[1], uncapped) > 1e-3
    hf_model.config.sliding_window = 10_000  # and so does the window
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
    for _ in range(10):
        logits = driver.decode(reqs, logits.argmax(-1).tolist())
        for i, req in enumerate(reqs):
            worst = max(worst, rel_err(logits[i], hf_last_logits(hf_model, req.token_ids)))
    assert worst < TOL
    assert [len(r.token_ids) for r in reqs] == [13, 24, 16, 31]


def test_configs_pick_their_gemma():
    """Gemma 2's config (caps by default) loads into the Gemma 2 class; attention soft-capping in a Gemma 3
    config is refused (Gemma 3 has none); Gemma 2 with the cap off (null) has none."""
    from test_model_gemma3 import tiny_gemma3_config

    from radixserve.configs.model_config import ModelConfig, ModelLoadError
    from radixserve.models.gemma2 import Gemma2ForCausalLM
    from radixserve.models.gemma3 import Gemma3ForCausalLM
    from radixserve.models.registry import model_class

    hf2 = tiny_gemma2_config().to_dict()
    cfg2 = ModelConfig.from_hf_dict(hf2)
    assert model_class(cfg2) is Gemma2ForCausalLM and cfg2.attn_logit_softcapping == ATTN_CAP
    bare = {k: v for k, v in hf2.items() if k not in ("attn_logit_softcapping", "final_logit_softcapping",
                                                      "layer_types", "architectures")}
    defaults = ModelConfig.from_hf_dict(bare)  # model_type gemma2, transformers' defaults
    assert (defaults.architecture, defaults.attn_logit_softcapping, defaults.final_logit_softcapping) == (
        "Gemma2ForCausalLM", 50.0, 30.0)
    assert defaults.layer_windows == (WINDOW, None, WINDOW, None)
    assert ModelConfig.from_hf_dict({**hf2, "attn_logit_softcapping": None}).attn_logit_softcapping is None
    hf3 = {**tiny_gemma3_config().to_dict(), "architectures": ["Gemma3ForCausalLM"]}
    cfg3 = ModelConfig.from_hf_dict(hf3)
    assert model_class(cfg3) is Gemma3ForCausalLM and cfg3.attn_logit_softcapping is None
    with pytest.raises(ModelLoadError, match="soft-capping is not part of Gemma 3"):
        ModelConfig.from_hf_dict({**hf3, "attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match="not a Gemma 2 config"):
        Gemma2ForCausalLM(cfg3)


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "one-pool"])
def test_engine_greedy_tokens_past_the_window(hybrid, tmp_path):
    """Through the scheduler (chunks of 6 start inside a window; a prompt reused from the radix cache): 32
    greedy tokens per prompt equal transformers' generate with the hybrid KV pool on and off; pools conserved."""
    from radixserve import Engine

    hf_model = make_tiny_gemma2(tmp_path)
    base, other, short = _prompts([30, 13, 4], seed=6)
    prompts = [base, other, short, base + [7, 9]]
    with torch.inference_mode():
        expected = [hf_model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                                      pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    params = {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True}
    with Engine(model_path=str(tmp_path), dtype="float32", device="cpu", max_total_tokens=1024,
                chunked_prefill_size=6, disable_hybrid_swa_memory=not hybrid, log_level="warning") as engine:
        first = engine.generate(input_ids=prompts[:3], sampling_params=params)
        again = engine.generate(input_ids=prompts[3], sampling_params=params)
        state = engine.get_internal_state()
    assert [r["output_ids"] for r in first] + [again["output_ids"]] == expected
    assert again["meta_info"]["cached_tokens"] >= 24
    assert ("window_pool_tokens" in state) == hybrid
    assert state["kv_conservation"] is not None and "error" not in state["kv_conservation"], state
    assert state["protected_tokens"] == 0 and state["num_running_reqs"] == 0
