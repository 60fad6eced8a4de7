"""Multi-LoRA through the Engine on a tiny random Llama with PEFT-made adapters: greedy tokens equal PEFT's merged
models for a batch mixing four adapters and the base model (both loops, chunked prefill); cache namespaces per
adapter (reuse within one, none across; a reloaded adapter with new weights misses the old KV); run-time load
and unload (refused while in use, frees the adapter's KV); unknown adapters; --max-loras-per-batch; the LRU
slots. The conservation identity is checked after every test."""

from __future__ import annotations

import threading

import pytest
import torch
from lora_support import SPECS, AdapterSpec, hf_greedy, make_peft_adapter, tiny_peft_models
from test_model_support import assert_engine_conserved, one_torch_thread

from radixserve import Engine
from radixserve.client.scheduler_client import InProcessTransport

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

STEPS = 6


models = pytest.fixture(scope="module", name="models")(tiny_peft_models)


def _engine(root, **kwargs) -> Engine:
    paths = [f"{spec.name}={root / spec.name}" for spec in SPECS]
    args = dict(dtype="float32", device="cpu", max_total_tokens=1024, lora_paths=paths, max_loras_per_batch=4,
                log_level="warning")
    return Engine(str(root / "base"), **{**args, **kwargs})


@pytest.fixture(scope="module")
def engines(models):
    """(overlap loop with 8-token prefill chunks, normal loop)."""
    root, _, _ = models
    made = [_engine(root, chunked_prefill_size=8), _engine(root, disable_overlap_schedule=True)]
    yield made
    for engine in made:
        engine.shutdown()


@pytest.fixture(autouse=True)
def _conserved(request):
    yield
    for name in ("engines", "engine"):
        if name in request.fixturenames:
            value = request.getfixturevalue(name)
            for engine in value if isinstance(value, list) else [value]:
                assert_engine_conserved(engine)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


GREEDY = {"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True}


def test_mixed_batch_greedy_tokens_equal_peft(engines, models):
    _, base, merged = models
    names = ["sql", None, "chat", "code", "math", "sql", None, "chat"]
    prompts = _prompts([13, 5, 21, 9, 17, 4, 11, 8], seed=5)
    for engine in engines:
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)
        for name, ids, out in zip(names, prompts, outs, strict=True):
            assert out["output_ids"] == hf_greedy(base if name is None else merged[name], ids, STEPS), name


def test_same_prompt_reuses_within_an_adapter_and_never_across(engines):
    prompt = _prompts([24], seed=6)[0]
    for engine in engines:
        engine.flush_cache()
        first = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="sql")
        again = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="sql")
        other = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="chat")
        plain = engine.generate(input_ids=prompt, sampling_params=GREEDY)
        assert first["meta_info"]["cached_tokens"] == 0
        assert again["meta_info"]["cached_tokens"] == len(prompt) - 1  # NOTE: the last token is recomputed
        assert other["meta_info"]["cached_tokens"] == 0
        assert plain["meta_info"]["cached_tokens"] == 0
        assert again["output_ids"] == first["output_ids"]
        assert other["output_ids"] != first["output_ids"]


def test_tenant_namespace_and_adapter_compose(engines):
    prompt = _prompts([16], seed=7)[0]
    engine = engines[1]
    engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="code", extra_key="tenant-a")
    same = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="code", extra_key="tenant-a")
    other_tenant = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="code", extra_key="tenant-b")
    no_tenant = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="code")
    assert same["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert other_tenant["meta_info"]["cached_tokens"] == 0
    assert no_tenant["meta_info"]["cached_tokens"] == 0


def test_unknown_adapter_is_refused_naming_it(engines):
    engine = engines[0]
    with pytest.raises(ValueError, match="'nope' is not loaded"):
        engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, lora_path="nope")


def test_the_scheduler_refuses_an_unknown_adapter_with_404(engines, monkeypatch):
    """Past the Engine's own check (as a request racing an unload would be): the scheduler ends it, 404."""
    engine = engines[1]
    monkeypatch.setattr(engine, "_check_adapter", lambda name: None)
    out = engine.submit([5, 6, 7], GREEDY, lora_path="gone").result()
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 404 and "'gone'" in reason["message"]


def test_reloaded_adapter_with_new_weights_misses_the_old_kv(engines, models, tmp_path):
    _, base, _ = models
    engine = engines[0]
    prompt = _prompts([20], seed=8)[0]
    old = make_peft_adapter(base, tmp_path / "v1", AdapterSpec("swap", 4, ("q_proj", "up_proj"), seed=21))
    new = make_peft_adapter(base, tmp_path / "v2", AdapterSpec("swap", 4, ("q_proj", "up_proj"), seed=22))
    engine.load_lora_adapter("swap", str(tmp_path / "v1"))
    try:
        first = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="swap")
        assert first["output_ids"] == hf_greedy(old, prompt, STEPS)
        assert engine.unload_lora_adapter("swap")["freed_tokens"] >= len(prompt)
        engine.load_lora_adapter("swap", str(tmp_path / "v2"))
        second = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="swap")
        assert second["meta_info"]["cached_tokens"] == 0
        assert second["output_ids"] == hf_greedy(new, prompt, STEPS)
    finally:
        engine.unload_lora_adapter("swap")


def test_unload_is_refused_while_a_request_runs_and_never_breaks_it(engines, models, tmp_path):
    _, base, _ = models
    engine = engines[0]
    merged = make_peft_adapter(base, tmp_path / "busy", AdapterSpec("busy", 8, ("v_proj", "down_proj"), seed=23))
    engine.load_lora_adapter("busy", str(tmp_path / "busy"))
    prompt = _prompts([10], seed=9)[0]
    stream = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 200}, lora_path="busy",
                             stream=True)
    first = next(stream)  # NOTE: the request is running now
    with pytest.raises(ValueError, match="in flight.*status 409"):
        engine.unload_lora_adapter("busy")
    chunks = [first, *stream]
    assert chunks[-1]["finished"] and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert [t for c in chunks for t in c["output_ids"]] == hf_greedy(merged, prompt, 200)
    names = [a["name"] for a in engine.list_lora_adapters()]
    assert "busy" in names
    out = engine.unload_lora_adapter("busy")
    assert out["freed_tokens"] > 0
    assert "busy" not in [a["name"] for a in out["adapters"]]


def test_bad_adapters_are_refused_and_change_nothing(engines, tmp_path):
    engine = engines[1]
    before = engine.list_lora_adapters()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no adapter_config.json.*status 400"):
        engine.load_lora_adapter("bad", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora_adapter("sql", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="status 404"):
        engine.unload_lora_adapter("never-loaded")
    assert engine.list_lora_adapters() == before


def test_max_loras_per_batch_is_kept_and_every_request_is_right(models):
    """Three adapters, at most two per batch: every forward holds at most two, all requests finish correctly."""
    root, base, merged = models
    engine = _engine(root, max_loras_per_batch=2, max_loaded_loras=2, disable_overlap_schedule=True)
    seen: list[int] = []
    manager = engine.model_runner.lora
    prepare = manager.prepare
    lock = threading.Lock()

    def recording_prepare(fb):
        with lock:
            seen.append(len({a.name for a in fb.lora_adapters or [] if a is not None}))
        prepare(fb)

    manager.prepare = recording_prepare
    try:
        names = ["sql", "chat", "code", "sql", "code", "chat", None]
        prompts = _prompts([6, 7, 8, 9, 10, 11, 12], seed=10)
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)
        for name, ids, out in zip(names, prompts, outs, strict=True):
            assert out["output_ids"] == hf_greedy(base if name is None else merged[name], ids, STEPS), name
        assert max(seen) == 2
        assert len(manager.loaded_slots()) <= 2
        assert manager.packs >= 3  # NOTE: three adapters through two slots: at least one was packed again
        assert_engine_conserved(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("overlap", [False, True])
def test_speculative_verify_rows_and_retraction_keep_each_adapter(models, overlap):
    """n-gram drafts verified under each row's adapter, on a pool small enough to retract: greedy tokens still
    equal PEFT's, and both mechanisms ran."""
    root, base, merged = models
    engine = _engine(root, disable_overlap_schedule=not overlap, speculative_algorithm="ngram",
                     max_total_tokens=160, chunked_prefill_size=16, schedule_conservativeness=0.05)
    try:
        names = ["sql", "chat", None, "code", "math", "sql", "chat", None]
        loop = [7, 8, 9, 10, 11, 12]
        prompts = [loop * 3 + p for p in _prompts([3] * len(names), seed=11)]  # NOTE: repeats: drafts to verify
        params = {**GREEDY, "max_new_tokens": 12}
        outs = engine.generate(input_ids=prompts, sampling_params=params, lora_path=names)
        for name, ids, out in zip(names, prompts, outs, strict=True):
            assert out["output_ids"] == hf_greedy(base if name is None else merged[name], ids, 12), name
        state = engine.get_internal_state()
        assert state["spec_draft_tokens"] > 0 and state["num_retractions"] > 0, state
        assert_engine_conserved(engine)
    finally:
        engine.shutdown()


def test_logprobs_are_the_adapters_own(engines, models):
    _, _, merged = models
    prompt = _prompts([12], seed=12)[0]
    out = engines[1].generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 1}, lora_path="math",
                              return_logprob=True, logprob_start_len=0)
    with torch.inference_mode():
        logits = merged["math"](input_ids=torch.tensor([prompt])).logits[0].float()
    want = torch.log_softmax(logits, -1)
    got_out = out["meta_info"]["output_token_logprobs"][0][0]
    assert abs(got_out - float(want[-1].max())) < 1e-4
    got_in = [entry[0] for entry in out["meta_info"]["input_token_logprobs"][1:]]
    ref_in = [float(want[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    assert max(abs(a - b) for a, b in zip(got_in, ref_in, strict=True)) < 1e-4


def _generate_together(engine, prompts, params, names, monkeypatch) -> list[dict]:
    """The requests enter the scheduler's queue in one step. NOTE: `generate` queues them one by one, and the
    scheduler may start on the first before the last is in: then no decode batch holds them all (it flaked so)."""
    sent: list = []
    with monkeypatch.context() as patch:
        patch.setattr(engine.client, "transport", InProcessTransport(sent.append))
        handles = [engine.submit(ids, params, lora_path=name) for ids, name in zip(prompts, names, strict=True)]
    queue = engine.scheduler.input_queue
    with queue.mutex:
        queue.queue.extend(sent)
        queue.unfinished_tasks += len(sent)
        queue.not_empty.notify()
    return [handle.result() for handle in handles]


def test_cascade_shares_a_prefix_only_within_one_adapter(engines, models, monkeypatch):
    """16 requests over one long prefix: under one adapter the decode attends the shared prefix once (cascade);
    split over two adapters nothing is shared across them, so no cascade; the tokens equal PEFT's either way."""
    from radixserve.layers.attention import cascade

    _, _, merged = models
    engine = engines[1]
    plans: list[int] = []
    plan_decode = cascade.plan_decode

    def recording(fb, policy, *args):
        plan = plan_decode(fb, policy, *args)
        plans.append(0 if plan is None else int(plan.prefix_slots.numel()))
        return plan

    monkeypatch.setattr(cascade, "plan_decode", recording)
    prefix = _prompts([280], seed=13)[0]
    tails = _prompts([3] * 16, seed=14)
    for names in (["sql"] * 16, ["sql", "chat"] * 8):
        for name in set(names):  # NOTE: the prefix cached first under each adapter, so all 16 start together
            engine.generate(input_ids=prefix, sampling_params={**GREEDY, "max_new_tokens": 1}, lora_path=name)
        plans.clear()
        prompts = [prefix + t for t in tails]
        outs = _generate_together(engine, prompts, {**GREEDY, "max_new_tokens": 4}, names, monkeypatch)
        for name, ids, out in zip(names, prompts, outs, strict=True):
            assert out["output_ids"] == hf_greedy(merged[name], ids, 4), name
        if len(set(names)) == 1:
            assert max(plans) >= 256, plans
        else:
            assert plans and max(plans) == 0, plans


def test_an_adapter_blocked_by_the_limit_is_not_starved(models):
    """--max-loras-per-batch 1: a request for adapter B that arrives while A's requests run is admitted before
    A's requests that arrived after it (they would otherwise keep A's batch busy and B waiting)."""
    root, _, merged = models
    engine = _engine(root, max_loras_per_batch=1, disable_overlap_schedule=True)
    extends: list[tuple[str, ...]] = []
    manager = engine.model_runner.lora
    prepare = manager.prepare

    def recording_prepare(fb):
        if fb.forward_mode.is_extend():
            extends.append(tuple(a.name for a in fb.lora_adapters))
        prepare(fb)

    manager.prepare = recording_prepare
    try:
        early, late = _prompts([5] * 4, seed=15), _prompts([5] * 4, seed=16)
        params = {**GREEDY, "max_new_tokens": 8}
        handles = [engine.submit(p, params, lora_path="sql") for p in early]
        handles.append(engine.submit(_prompts([6], seed=17)[0], params, lora_path="chat"))
        handles += [engine.submit(p, params, lora_path="sql") for p in late]
        outs = [h.result() for h in handles]
        assert outs[4]["output_ids"] == hf_greedy(merged["chat"], _prompts([6], seed=17)[0], 8)
        assert all(len(set(names)) == 1 for names in extends), extends  # NOTE: one adapter per batch
        chat_at = next(i for i, names in enumerate(extends) if names[0] == "chat")
        sql_total = sum(len(names) for names in extends[:chat_at] if names[0] == "sql")
        assert sql_total <= len(early), extends  # NOTE: no late request ran before the blocked adapter
        assert_engine_conserved(engine)
    finally:
        engine.shutdown()
