"""Multi-LoRA on the REAL embedded model (SmolLM2-135M-Instruct, float32): PEFT adapters made here on
transformers' reading of the same GGUF file; our logits equal PEFT's `merge_and_unload()` model's (relative
error < 1e-4) for each adapter alone and for a batch mixing four adapters and the base model, and the greedy
tokens are equal. Long: it builds five 135M-parameter models."""

from __future__ import annotations

import pytest
import torch
from direct_driver import DirectDriver
from lora_support import SPECS, make_peft_adapter
from test_model_smollm2 import hf_model_from_gguf
from test_model_support import hf_last_logits, one_torch_thread, rel_err

from radixserve.mem_cache.conservation import check_conservation
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)
pytestmark = pytest.mark.long

TOL = 1e-4
GREEDY_STEPS = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory, loaded):
    root = tmp_path_factory.mktemp("lora_smollm2")
    base = hf_model_from_gguf(torch.float32)
    merged = {spec.name: make_peft_adapter(base, root / spec.name, spec, b_scale=0.25) for spec in SPECS}
    paths = tuple(f"{spec.name}={root / spec.name}" for spec in SPECS)
    runner = ModelRunner(ServerArgs(dtype="float32", device="cpu", max_total_tokens=2048, lora_paths=paths,
                                    max_loras_per_batch=4), loaded)
    return base, merged, runner, root


def _chat(runner, text: str) -> list[int]:
    tok = runner.tokenizer
    return list(tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True), add_special_tokens=False))


def test_each_adapter_and_a_mixed_batch_match_peft(setup):
    base, merged, runner, _ = setup
    driver = DirectDriver(runner)
    names = ["sql", None, "chat", "code", "math"]
    texts = ["Write a SQL query.", "What is the capital of France?", "Say hello.", "Sort a list in Python.",
             "What is 12 times 7?"]
    prompts = [_chat(runner, t) for t in texts]
    refs = [base if n is None else merged[n] for n in names]
    adapters = [None if n is None else runner.lora.get(n) for n in names]
    moved = rel_err(hf_last_logits(merged["chat"], prompts[2]), hf_last_logits(base, prompts[2]))
    assert moved > 100 * TOL  # NOTE: the adapters change the logits: the comparison is not vacuous
    try:
        reqs = [driver.new_request() for _ in prompts]
        logits = driver.extend(reqs, prompts, adapters)
        seqs = [list(p) for p in prompts]
        for step in range(GREEDY_STEPS):
            for row, seq in enumerate(seqs):
                ref = hf_last_logits(refs[row], seq)
                assert rel_err(logits[row], ref) < TOL, (names[row], step)
                assert int(logits[row].argmax()) == int(ref.argmax()), (names[row], step)  # the greedy token
            next_ids = [int(row.argmax()) for row in logits]
            for seq, token in zip(seqs, next_ids, strict=True):
                seq.append(token)
            logits = driver.decode(reqs, next_ids, adapters)
    finally:
        driver.release_all()
    assert check_conservation(runner.token_to_kv_pool_allocator, None, runner.req_to_token_pool, []) is not None
    assert runner.token_to_kv_pool_allocator.available_size() == runner.max_total_num_tokens


def test_the_lora_benchmark_runs_on_tiny_settings(capsys):
    """benchmarks/bench_lora.py end to end on a tiny model (a smoke run: the figures mean nothing here)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_lora.py"
    spec = importlib.util.spec_from_file_location("bench_lora", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--tiny", "--dtype", "float32", "--requests", "4", "--prompt-len", "16", "--new-tokens", "4",
                "--adapters", "1,4", "--ranks", "8", "--rounds", "1", "--no-docs"])
    out = capsys.readouterr().out
    assert "| none (base model, LoRA off) |" in out and "| 4 | 8 |" in out


def test_structured_output_under_an_adapter(setup, loaded):
    """A JSON schema constrains a LoRA request like any other (the grammar masks the adapter's logits)."""
    import json

    from radixserve import Engine

    root = setup[3]
    engine = Engine(dtype="float32", max_total_tokens=2048, loaded_model=loaded, log_level="warning",
                    lora_paths=[f"chat={root / 'chat'}"])
    try:
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                  "required": ["city"], "additionalProperties": False}
        out = engine.chat([{"role": "user", "content": "Name a city as JSON."}],
                          {"max_new_tokens": 32, "temperature": 0, "json_schema": json.dumps(schema)},
                          lora_path="chat")
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert set(json.loads(out["text"])) == {"city"}
        state = engine.get_internal_state()
        assert state["kv_conservation"] is not None and "error" not in state["kv_conservation"], state
    finally:
        engine.shutdown()
