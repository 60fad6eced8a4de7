"""llama.cpp GGUF LoRA adapters: each PEFT adapter of the shared fixture rewritten as a GGUF adapter file the way
llama.cpp's converter writes it (q/k B permuted per head), loaded on a GGUF base model (a tiny random Llama
written as a llama.cpp GGUF): float32 logits equal the PEFT folder's (relative error < 1e-4) in one mixed batch,
greedy tokens equal through the Engine (start-up and run-time loads), and malformed files are refused naming
the fault with nothing changed. The embedded SmolLM2 case is long. KV conservation is checked after each test
that runs requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from direct_driver import DirectDriver
from lora_support import SPECS, hf_greedy, make_peft_adapter, tiny_peft_models, write_gguf_adapter
from test_gguf_support import write_gguf
from test_model_support import hf_last_logits, one_torch_thread, rel_err

from radixserve import Engine
from radixserve.configs.model_config import ModelConfig
from radixserve.lora.adapter import LoraLoadError, load_peft_adapter
from radixserve.lora.gguf_adapter import load_gguf_adapter
from radixserve.mem_cache.conservation import check_conservation
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

TOL = 1e-4
STEPS = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(root, base HF model, merged models, GGUF base path); `<root>/<name>.gguf`: each adapter as GGUF."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        root, base, merged = tiny_peft_models(tmp_path_factory)
        write_gguf(root / "base.gguf", base, "llama")
        for spec in SPECS:
            write_gguf_adapter(root / spec.name, root / f"{spec.name}.gguf", base.config)
        yield root, base, merged, root / "base.gguf"


@pytest.fixture(scope="module")
def runner(models):
    root, _, _, gguf_base = models
    paths = tuple(f"{s.name}={root / s.name}" for s in SPECS) + tuple(f"{s.name}_gguf={root / s.name}.gguf"
                                                                       for s in SPECS)
    return ModelRunner(ServerArgs(model_path=str(gguf_base), dtype="float32", device="cpu", max_total_tokens=1024,
                                  lora_paths=paths, max_loras_per_batch=8))


@pytest.fixture
def config(runner) -> ModelConfig:
    return runner.lora.config


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def _conserved(runner: ModelRunner) -> None:
    assert check_conservation(runner.token_to_kv_pool_allocator, None, runner.req_to_token_pool, []) is not None
    assert runner.token_to_kv_pool_allocator.available_size() == runner.max_total_num_tokens


def test_gguf_adapters_hold_the_peft_weights(runner):
    for spec in SPECS:
        peft, gguf = runner.lora.get(spec.name), runner.lora.get(f"{spec.name}_gguf")
        assert gguf.rank == peft.rank and abs(gguf.scaling - peft.scaling) < 1e-6 * peft.scaling
        assert gguf.target_modules == peft.target_modules and gguf.content_hash != peft.content_hash
        for where, (a, b) in peft.weights.items():
            assert torch.equal(gguf.weights[where][0], a) and torch.equal(gguf.weights[where][1], b), where


def test_mixed_batch_logits_equal_the_peft_folders(runner, models):
    """One batch: every adapter as PEFT and as GGUF, the base model between; prefill then decode steps."""
    _, base, merged, _ = models
    names = ["sql", "sql_gguf", None, "chat", "chat_gguf", "code", "code_gguf", None, "math", "math_gguf"]
    adapters = [None if n is None else runner.lora.get(n) for n in names]
    refs = [base if n is None else merged[n.removesuffix("_gguf")] for n in names]
    prompts = _prompts([7] * len(names), seed=21)
    prompts = [prompts[i - 1] if n and n.endswith("_gguf") else prompts[i] for i, n in enumerate(names)]
    driver = DirectDriver(runner)
    try:
        reqs = [driver.new_request() for _ in prompts]
        logits = driver.extend(reqs, prompts, adapters)
        seqs = [list(p) for p in prompts]
        for step in range(3):
            for row, n in enumerate(names):
                assert rel_err(logits[row], hf_last_logits(refs[row], seqs[row])) < TOL, (n, step)
                if n and n.endswith("_gguf"):  # NOTE: the PEFT row just before it ran the same prompt
                    assert rel_err(logits[row], logits[row - 1]) < TOL, (n, step)
            tokens = [int(row.argmax()) for row in logits]
            for seq, token in zip(seqs, tokens, strict=True):
                seq.append(token)
            logits = driver.decode(reqs, tokens, adapters)
    finally:
        driver.release_all()
    _conserved(runner)


def test_without_unpermuting_b_the_logits_differ(models, config):
    """The q/k B un-permutation matters: skipped, an adapter targeting q and k no longer matches PEFT."""
    from radixserve.lora import gguf_adapter

    root = models[0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_adapter, "_unpermute_b", lambda halves, config: None)
        wrong = load_gguf_adapter("x", str(root / "chat.gguf"), config, 64)
    right = load_peft_adapter("x", str(root / "chat"), config, 64)
    assert not torch.equal(wrong.weights[(0, "q_proj")][1], right.weights[(0, "q_proj")][1])
    assert torch.equal(wrong.weights[(0, "v_proj")][1], right.weights[(0, "v_proj")][1])


def test_the_identity_follows_the_file(models, config, tmp_path):
    root, base, _, _ = models
    one = load_gguf_adapter("x", str(root / "sql.gguf"), config, 64)
    write_gguf_adapter(root / "sql", tmp_path / "copy.gguf", base.config)
    same = load_gguf_adapter("x", str(tmp_path / "copy.gguf"), config, 64)
    write_gguf_adapter(root / "sql", tmp_path / "other.gguf", base.config, alpha=3.0)
    other = load_gguf_adapter("x", str(tmp_path / "other.gguf"), config, 64)
    assert one.content_hash == same.content_hash != other.content_hash


def _drop(target: str):
    return lambda name, array: None if name == target else array


MALFORMED = {
    "model_file": (dict(general_type="model"), "general.type is 'model', not 'adapter'"),
    "not_lora": (dict(adapter_type="control_vector"), "adapter.type is 'control_vector', not 'lora'"),
    "no_alpha": (dict(edit=lambda name, array: array), "adapter.lora.alpha must be a number, got None"),
    "wrong_arch": (dict(arch="qwen2"), "for GGUF architecture 'qwen2'; the model is LlamaForCausalLM"),
    "shape": (dict(edit=lambda name, array: array[:, :-1] if name.endswith("attn_v.weight.lora_a") else array),
              r"layer 0 v_proj has A \(4, 63\).*needs A \(4, 64\)"),
    "half_pair": (dict(edit=_drop("blk.1.ffn_down.weight.lora_b")), "down_proj has lora_A without its pair"),
    "rank_over": (dict(), "rank 4 is above --max-lora-rank 2"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_gguf_adapters_are_refused_naming_the_fault(models, config, tmp_path, case):
    root, base, _, _ = models
    kwargs, match = MALFORMED[case]
    path = tmp_path / f"{case}.gguf"
    write_gguf_adapter(root / "sql", path, base.config, alpha=kwargs.pop("alpha", 8.0)
                       if case not in ("no_alpha",) else None, **kwargs)
    with pytest.raises(LoraLoadError, match=match):
        load_gguf_adapter("bad", str(path), config, 2 if case == "rank_over" else 64)


def test_odd_tensors_and_files_are_refused(models, config, tmp_path):
    import gguf

    path = tmp_path / "embd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 8.0)
    writer.add_tensor("token_embd.weight.lora_a", np.ones((4, 256), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(LoraLoadError, match="'token_embd.weight.lora_a' is not a LoRA lora_a/lora_b tensor"):
        load_gguf_adapter("bad", str(path), config, 64)
    with pytest.raises(LoraLoadError, match="missing.gguf': no such file"):
        load_gguf_adapter("bad", str(tmp_path / "missing.gguf"), config, 64)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(LoraLoadError, match="is not a GGUF file"):
        load_gguf_adapter("bad", str(tmp_path / "junk.gguf"), config, 64)


@pytest.fixture(scope="module")
def engine(models):
    root, _, _, gguf_base = models
    made = Engine(str(gguf_base), dtype="float32", device="cpu", max_total_tokens=1024, log_level="warning",
                  lora_paths=[f"sql_peft={root / 'sql'}", str(root / "sql.gguf")], max_loras_per_batch=4,
                  disable_overlap_schedule=True)
    yield made
    made.shutdown()


@pytest.fixture
def _engine_conserved(engine):
    yield
    state = engine.get_internal_state()
    assert state["kv_conservation"] is not None and "error" not in state["kv_conservation"], state
    assert state["protected_tokens"] == 0 and state["num_running_reqs"] == 0


@pytest.mark.usefixtures("_engine_conserved")
def test_engine_greedy_tokens_equal_the_peft_folders(engine, models):
    """`--lora-paths` with a bare GGUF path (named `sql` after its file) beside a PEFT folder, then run-time
    loads of a GGUF file and a PEFT folder: the tokens equal PEFT's merged models'."""
    root, base, merged, _ = models
    assert {a["name"] for a in engine.list_lora_adapters()} == {"sql", "sql_peft"}
    prompt = _prompts([10], seed=23)[0]
    params = {"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True}
    outs = engine.generate(input_ids=[prompt, prompt], sampling_params=params, lora_path=["sql", "sql_peft"])
    assert outs[0]["output_ids"] == outs[1]["output_ids"] == hf_greedy(merged["sql"], prompt, STEPS)
    engine.load_lora_adapter("chat_gguf", str(root / "chat.gguf"))
    engine.load_lora_adapter("chat", str(root / "chat"))
    try:
        names = ["chat_gguf", "chat", None, "chat_gguf"]
        prompts = _prompts([9, 9, 6, 13], seed=22)
        prompts[1] = prompts[0]
        outs = engine.generate(input_ids=prompts, sampling_params=params, lora_path=names)
        for name, ids, out in zip(names, prompts, outs, strict=True):
            ref = base if name is None else merged["chat"]
            assert out["output_ids"] == hf_greedy(ref, ids, STEPS), name
        assert outs[0]["output_ids"] == outs[1]["output_ids"]
    finally:
        engine.unload_lora_adapter("chat_gguf")
        engine.unload_lora_adapter("chat")


@pytest.mark.usefixtures("_engine_conserved")
def test_engine_refuses_a_bad_gguf_and_changes_nothing(engine, models, tmp_path):
    root, base, _, _ = models
    before = engine.list_lora_adapters()
    write_gguf_adapter(root / "sql", tmp_path / "model.gguf", base.config, general_type="model")
    with pytest.raises(ValueError, match="not 'adapter'.*status 400"):
        engine.load_lora_adapter("bad", str(tmp_path / "model.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"junk")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        engine.load_lora_adapter("bad", str(tmp_path / "junk.gguf"))
    assert engine.list_lora_adapters() == before


@pytest.mark.long
def test_embedded_smollm2_gguf_adapter_equals_the_peft_folder(loaded, tmp_path):
    """The real GGUF base (9 query heads, 3 KV heads): a GGUF adapter converted from a PEFT one gives the PEFT
    folder's logits, prefill and 8 greedy decode steps."""
    from test_model_smollm2 import hf_model_from_gguf

    hf_base = hf_model_from_gguf(torch.float32)
    spec = SPECS[1]  # NOTE: all seven modules, q and k among them
    merged = make_peft_adapter(hf_base, tmp_path / "chat", spec, b_scale=0.25)
    write_gguf_adapter(tmp_path / "chat", tmp_path / "chat.gguf", hf_base.config)
    runner = ModelRunner(ServerArgs(dtype="float32", device="cpu", max_total_tokens=512, max_loras_per_batch=2,
                                    lora_paths=(f"peft={tmp_path / 'chat'}", f"gguf={tmp_path / 'chat.gguf'}")),
                         loaded)
    adapters = [runner.lora.get("peft"), runner.lora.get("gguf")]
    prompt = runner.tokenizer.encode("The capital of France is", add_special_tokens=False)
    driver = DirectDriver(runner)
    try:
        reqs = [driver.new_request() for _ in adapters]
        logits = driver.extend(reqs, [prompt, prompt], adapters)
        seq = list(prompt)
        for step in range(8):
            assert rel_err(logits[1], logits[0]) < TOL, step
            assert rel_err(logits[0], hf_last_logits(merged, seq)) < TOL, step
            assert int(logits[1].argmax()) == int(logits[0].argmax()), step
            token = int(logits[0].argmax())
            seq.append(token)
            logits = driver.decode(reqs, [token, token], adapters)
    finally:
        driver.release_all()
    _conserved(runner)
