"""The mixed-adapter forward against PEFT: adapters made here with `peft` (seeded random A and B, several ranks
and target sets, rslora) on a tiny random Llama; our float32 logits equal those of PEFT's `merge_and_unload()`
model (relative error < 1e-4), for each adapter alone and for one batch mixing the four adapters and the base
model, in a prefill over a cached prefix and in decode steps, on both attention backends."""

from __future__ import annotations

import pytest
import torch
from direct_driver import DirectDriver
from lora_support import SPECS, make_peft_adapter, tiny_peft_models
from test_model_support import hf_last_logits, one_torch_thread, rel_err

from radixserve.mem_cache.conservation import check_conservation
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

TOL = 1e-4


models = pytest.fixture(scope="module", name="models")(tiny_peft_models)


@pytest.fixture(scope="module", params=["torch", "cpu"])
def runner(request, models):
    root, _, _ = models
    paths = tuple(f"{spec.name}={root / spec.name}" for spec in SPECS)
    args = ServerArgs(model_path=str(root / "base"), dtype="float32", device="cpu", max_total_tokens=1024,
                      attention_backend=request.param, lora_paths=paths, max_loras_per_batch=4)
    return ModelRunner(args)


@pytest.fixture
def driver(runner):
    driver = DirectDriver(runner)
    yield driver
    driver.release_all()
    assert check_conservation(runner.token_to_kv_pool_allocator, None, runner.req_to_token_pool, []) is not None
    assert runner.token_to_kv_pool_allocator.available_size() == runner.max_total_num_tokens


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def test_the_adapters_change_the_output(models):
    """Not a vacuous comparison: every adapter moves the logits well beyond the tolerance."""
    _, base, merged = models
    ids = _prompts([9], seed=1)[0]
    for model in merged.values():
        assert rel_err(hf_last_logits(model, ids), hf_last_logits(base, ids)) > 100 * TOL


@pytest.mark.parametrize("name", [spec.name for spec in SPECS])
def test_each_adapter_alone_matches_peft(runner, driver, models, name):
    _, _, merged = models
    adapter = runner.lora.get(name)
    prompts = _prompts([7, 12], seed=2)
    reqs = [driver.new_request() for _ in prompts]
    logits = driver.extend(reqs, prompts, [adapter, adapter])
    for row, ids in enumerate(prompts):
        assert rel_err(logits[row], hf_last_logits(merged[name], ids)) < TOL


def test_mixed_batch_of_four_adapters_and_the_base_matches_peft(runner, driver, models):
    """One batch: the base model's rows between adapter rows, an adapter twice (non-contiguous rows: an index
    segment), a prefill over a cached prefix, then decode steps of the same mixed batch."""
    _, base, merged = models
    names = ["sql", None, "chat", "code", "sql", None, "math"]
    refs = [base if n is None else merged[n] for n in names]
    adapters = [None if n is None else runner.lora.get(n) for n in names]
    prompts = _prompts([5, 9, 3, 11, 6, 4, 8], seed=3)
    reqs = [driver.new_request() for _ in prompts]
    heads = [p[:2] for p in prompts]
    driver.extend(reqs, heads, adapters)  # NOTE: a cached prefix, computed under each row's own adapter
    logits = driver.extend(reqs, [p[2:] for p in prompts], adapters)
    for row, ids in enumerate(prompts):
        assert rel_err(logits[row], hf_last_logits(refs[row], ids)) < TOL, names[row]
    seqs = [list(p) for p in prompts]
    for _ in range(3):
        next_ids = [int(row.argmax()) for row in logits]
        for seq, token in zip(seqs, next_ids, strict=True):
            seq.append(token)
        logits = driver.decode(reqs, next_ids, adapters)
        for row, seq in enumerate(seqs):
            assert rel_err(logits[row], hf_last_logits(refs[row], seq)) < TOL, names[row]


def test_base_rows_alone_take_no_lora_path(runner, driver, models):
    _, base, _ = models
    prompts = _prompts([6, 10], seed=4)
    reqs = [driver.new_request() for _ in prompts]
    logits = driver.extend(reqs, prompts, [None, None])
    assert runner.lora.batch.segments == []  # NOTE: cleared after every forward
    for row, ids in enumerate(prompts):
        assert rel_err(logits[row], hf_last_logits(base, ids)) < TOL


@pytest.mark.long
def test_the_c_decode_step_runs_lora_rows(tmp_path, monkeypatch):
    """bf16 with the C decoder on: a decode batch with an adapter row runs in the C step too (its LoRA rows:
    models/c_decoder_lora.py) and matches PEFT within bf16 rounding; a base-only batch as well. Long: a bf16
    start times and builds the kernels for its shapes."""
    from test_model_support import save_tiny_tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig

    from radixserve.layers.gemv import load_gemv_kernel

    if load_gemv_kernel() is None:
        pytest.skip("needs AVX512-BF16 (the GEMV kernel): no bf16 C decoder here")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    base.save_pretrained(str(tmp_path / "base"))
    save_tiny_tokenizer(tmp_path / "base")
    merged = make_peft_adapter(base, tmp_path / "a", SPECS[1])
    monkeypatch.setenv("RADIXSERVE_DECODE_STEP", "1")
    runner = ModelRunner(ServerArgs(model_path=str(tmp_path / "base"), dtype="bfloat16", device="cpu",
                                    max_total_tokens=512, attention_backend="cpu", linear_method="onednn_gemv",
                                    lora_paths=(f"chat={tmp_path / 'a'}",)))
    step = runner.model.c_decoder
    assert step is not None
    calls: list[int] = []

    class Recorder:
        def takes(self, fb):
            return step.takes(fb)

        def __call__(self, hidden, fb):
            calls.append(fb.batch_size)
            return step(hidden, fb)

    runner.model.set_decoder(Recorder())
    driver = DirectDriver(runner)
    adapter = runner.lora.get("chat")
    prompts = _prompts([6, 9], seed=5)
    reqs = [driver.new_request() for _ in prompts]
    logits = driver.extend(reqs, prompts, [adapter, None])
    token = [int(row.argmax()) for row in logits]
    logits = driver.decode(reqs, token, [adapter, None])
    assert calls == [2]  # NOTE: the adapter row runs in the C step (its SGMV call after each base product)
    for row, (model, ids) in enumerate(zip([merged, base], prompts, strict=True)):
        assert rel_err(logits[row], hf_last_logits(model, [*ids, token[row]])) < 0.05
    driver.decode(reqs, [int(row.argmax()) for row in logits], None)
    assert calls == [2, 2]  # NOTE: a base-only batch runs in C
    driver.release_all()
    check_conservation(runner.token_to_kv_pool_allocator, None, runner.req_to_token_pool, [])


def test_adapters_on_packed_int8_base_weights(models):
    """LoRA over a quantized base: the base product is the packed int8 method's, the adapter's product is added
    in float; logits stay within int8 rounding of PEFT's float model and far from the base's."""
    root, base, merged = models
    runner = ModelRunner(ServerArgs(model_path=str(root / "base"), dtype="float32", device="cpu",
                                    max_total_tokens=512, quantization="int8", lora_paths=(f"chat={root / 'chat'}",)))
    assert runner.model.model.layers[0].self_attn.qkv_proj.method.chosen_by_format  # NOTE: packed, truly
    driver = DirectDriver(runner)
    prompts = _prompts([8, 8], seed=6)
    reqs = [driver.new_request() for _ in prompts]
    try:
        logits = driver.extend(reqs, [prompts[0], prompts[0]], [runner.lora.get("chat"), None])
    finally:
        driver.release_all()
    lora_ref, base_ref = hf_last_logits(merged["chat"], prompts[0]), hf_last_logits(base, prompts[0])
    # NOTE: int8 rounding of this tiny random model moves its logits by 2-4%; the adapter moves them by ~90%
    assert rel_err(logits[0], lora_ref) < 0.06 and rel_err(logits[1], base_ref) < 0.06
    assert rel_err(logits[0] - logits[1], lora_ref - base_ref) < 0.06
    assert rel_err(lora_ref, base_ref) > 0.5
