"""The byte budget of compiled grammars (--grammar-cache-bytes) and the bounds on a grammar's compile.

Hundreds of distinct schemas through one GrammarBackend: the process's RSS stays near the budget (before the
budget, xgrammar's unbounded cache grew ~1 MiB a schema: 261 MiB after 248 of these); a repeated schema
compiles once; a grammar larger than the budget is a 400 naming the field, through the Engine, and is not
cached; one too large to compile, or one past the compile timeout, holds up no grammar behind it; /flush_cache
drops the cache.
"""

from __future__ import annotations

import gc
import json
import threading
import time

import pytest
from feature_soak import rss_mb

from radixserve.constrained.grammar_backend import GrammarBackend, GrammarError, GrammarSpec

MIB = 1 << 20
PROMPT = "Answer in JSON."


def _schema(i: int) -> str:
    """A distinct small schema (~1 MiB compiled with the default model's 49k vocabulary: the string's masks)."""
    return json.dumps({"type": "object", "properties": {f"key_{i}": {"type": "string", "maxLength": 8},
                                                        "n": {"type": "integer", "minimum": 0, "maximum": i + 1}},
                       "required": [f"key_{i}", "n"]})


@pytest.fixture(scope="module")
def tokenizer():
    import torch

    from radixserve.model_loader.gguf_loader import gguf_to_hf_folder
    from radixserve.model_loader.model_folder import load_tokenizer
    from radixserve.models.loader import embedded_model_path

    return load_tokenizer(gguf_to_hf_folder(embedded_model_path(), torch.float32))


def _backend(tokenizer, cache_bytes: int) -> GrammarBackend:
    return GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_bytes=cache_bytes)


def test_distinct_schemas_stay_within_the_byte_budget_and_a_repeated_one_compiles_once(tokenizer, monkeypatch):
    """NOTE: 32 MiB, not less: below ~3 MiB for xgrammar's rule-level cache (a quarter's third) these schemas
    compile ~3x slower (their string masks no longer stay cached), and the test would take ~25 s."""
    budget = 32 * MIB
    backend = _backend(tokenizer, budget)
    compiles = []
    real = backend._compile
    monkeypatch.setattr(backend, "_compile", lambda spec: compiles.append(spec) or real(spec))
    backend.submit(GrammarSpec("json_schema", _schema(-1))).result(60)  # NOTE: xgrammar's first-use tables
    gc.collect()
    before = rss_mb()
    for i in range(250):
        backend.submit(GrammarSpec("json_schema", _schema(i))).result(60)
    gc.collect()
    grown = rss_mb() - before
    assert grown < budget / MIB + 32, f"RSS grew {grown:.0f} MiB over 250 schemas under a {budget // MIB} MiB budget"
    info = backend.cache_info()
    assert info["grammar_cache_bytes"] <= budget - budget // 4 and info["xgrammar_cache_bytes"] <= budget // 4
    assert info["grammar_cache_evictions"] >= 200
    # the most recent schema is cached: submitting it again compiles nothing
    last = GrammarSpec("json_schema", _schema(249))
    assert backend.submit(last).done()
    n = len(compiles)
    for _ in range(3):
        backend.submit(last).result(60)
    assert len(compiles) == n
    # flushing drops ours and xgrammar's
    entries, freed = backend.flush()
    assert entries > 10 and freed > budget // 2 and backend.cache_info()["grammar_cache_bytes"] == 0
    assert backend.cache_info()["xgrammar_cache_bytes"] == 0


def test_a_grammar_too_large_to_compile_is_refused_before_compiling(tokenizer, monkeypatch):
    """Too many repetition states (grammar_checks.MAX_GRAMMAR_WORK): a 400 at once, nothing compiled."""
    backend = _backend(tokenizer, 64 * MIB)
    monkeypatch.setattr(backend._compiler, "compile_regex", lambda *a: pytest.fail("compiled"))
    pattern = "".join(f"[^{c}]{{0,120}}" for c in "abcdefghij")  # 1,200 distinct states: ~40 s to compile at ~35 ms each
    start = time.monotonic()
    with pytest.raises(GrammarError, match="regex: the grammar is too large to compile") as e:
        backend.submit(GrammarSpec("regex", pattern)).result(10)
    assert e.value.reason == "grammar too large" and time.monotonic() - start < 2


def test_a_compile_past_the_timeout_holds_up_no_grammar_behind_it(tokenizer, monkeypatch):
    backend = _backend(tokenizer, 64 * MIB)
    release = threading.Event()
    real = backend._compile

    def slow(spec):
        if spec.source == "slow+":
            release.wait(30)
        return real(spec)

    monkeypatch.setattr(backend, "_compile", slow)
    stuck = backend.submit(GrammarSpec("regex", "slow+"))
    behind = backend.submit(GrammarSpec("regex", "fast+"))
    time.sleep(0.3)
    assert not behind.done()  # one worker: queued behind the slow compile
    backend.check_overdue(0.2)
    assert behind.result(10) is not None and not stuck.done()
    release.set()
    assert stuck.result(10) is not None and backend.cache_info()["grammar_compiles_overdue"] == 1


def test_a_grammar_over_the_budget_is_a_400_naming_the_field_and_is_not_cached():
    import torch
    from test_model_support import assert_engine_conserved

    from radixserve import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(dtype="float32", device="cpu", max_total_tokens=2048, log_level="warning",
                    grammar_cache_bytes=4 * MIB)
    try:
        big = {"type": "object", "properties": {f"s{i}": {"type": "string", "maxLength": 8 + i} for i in range(10)},
               "required": [f"s{i}" for i in range(10)]}  # ~11 MiB compiled
        for _ in range(2):
            out = engine.generate(PROMPT, sampling_params={"json_schema": big, "max_new_tokens": 8})
            reason = out["meta_info"]["finish_reason"]
            assert reason["type"] == "abort" and reason["status_code"] == 400 and out["output_ids"] == []
            assert reason["message"].startswith("grammar too large: json_schema: the compiled grammar takes ")
            assert "--grammar-cache-bytes" in reason["message"]
        state = engine.get_internal_state()
        assert state["grammar_cache_bytes"] < 4 * MIB
        small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        out = engine.generate(PROMPT, sampling_params={"json_schema": small, "max_new_tokens": 20})
        assert json.loads(out["text"]) in ({"ok": True}, {"ok": False})
        flushed = engine.flush_cache()
        assert flushed["success"] and "compiled grammar(s)" in flushed["message"], flushed
        assert engine.get_internal_state()["grammar_cache_bytes"] == 0
        assert_engine_conserved(engine)
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)
