"""The disk tier end to end on the embedded SmolLM2 (float32, small pool): a restart over the same directory
reuses the stored prefix, greedy tokens unchanged; a changed setting or namespace reuses nothing."""

from __future__ import annotations

import pytest
from test_model_support import assert_engine_conserved

from radixserve import Engine

GREEDY = {"max_new_tokens": 12, "temperature": 0.0}
PROMPT_IDS = [(i * 7919) % 40000 + 100 for i in range(600)]  # ~600 tokens, no repeats within a page


def run(loaded, folder, prompt=PROMPT_IDS, extra_key=None, **args):
    """One Engine 'process' over `folder`: generate once, check conservation, return (output, tier stats)."""
    with Engine(loaded_model=loaded, dtype="float32", device="cpu", max_total_tokens=1024, log_level="warning",
                enable_hierarchical_cache=True, hicache_storage_dir=str(folder), **args) as engine:
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY, extra_key=extra_key)
        assert_engine_conserved(engine)
        stats = engine.scheduler.kv_manager.hicache.stats
        state = engine.get_internal_state()  # NOTE: what /metrics exports (radixserve:hicache_* counters)
        assert state["hicache_loaded_tokens"] == stats["loaded_tokens"]
        assert state["hicache_bytes_written"] == stats["bytes_written"]
        assert state["hicache_storage_hits"] == stats["hits"]
    return out, stats


@pytest.mark.parametrize("chunk", [2048, 200])
def test_a_restart_reuses_the_stored_prefix_with_identical_tokens(loaded, tmp_path, chunk):
    """Also with the prompt prefilled in chunks under the overlap loop: a continuing chunk is published while its
    forward may still run, so its pages are stored only once the request's last chunk was processed."""
    cold, cold_stats = run(loaded, tmp_path, chunked_prefill_size=chunk)
    assert cold["meta_info"]["cached_tokens"] == 0 and cold_stats["pages_written"] >= 600 // 32
    warm, warm_stats = run(loaded, tmp_path, chunked_prefill_size=chunk)
    assert warm["output_ids"] == cold["output_ids"]
    prompt = warm["meta_info"]["prompt_tokens"]
    assert prompt == len(PROMPT_IDS)
    # NOTE: every whole 32-token page of the prompt but the last token's: 576 of 600
    assert warm["meta_info"]["cached_tokens"] == warm_stats["loaded_tokens"] == (prompt - 1) // 32 * 32
    # NOTE: the Engine's meta_info splits them by tier too (a fresh process: all from storage)
    assert warm["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": (prompt - 1) // 32 * 32}
    assert warm_stats["corrupt"] == 0 and warm_stats["hits"] == (prompt - 1) // 32


def test_a_changed_setting_or_namespace_reuses_nothing(loaded, tmp_path):
    run(loaded, tmp_path)
    for args in ({"page_size": 4}, {"kv_cache_dtype": "bfloat16"}):
        out, stats = run(loaded, tmp_path, **args)
        assert out["meta_info"]["cached_tokens"] == 0 and stats["loaded_tokens"] == 0, args
    out, stats = run(loaded, tmp_path, extra_key="another-tenant")
    assert out["meta_info"]["cached_tokens"] == 0 and stats["loaded_tokens"] == 0


def test_write_back_stores_what_the_small_pool_evicts(loaded, tmp_path):
    """write_back: a second long prompt evicts the first from the 1024-token pool, which stores it; a restart
    then loads the first prompt from disk."""
    other = [(i * 104729) % 40000 + 100 for i in range(600)]
    with Engine(loaded_model=loaded, dtype="float32", device="cpu", max_total_tokens=1024, log_level="warning",
                enable_hierarchical_cache=True, hicache_storage_dir=str(tmp_path),
                hicache_write_policy="write_back") as engine:
        first = engine.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY)
        assert engine.scheduler.kv_manager.hicache.stats["pages_written"] == 0
        engine.generate(input_ids=other, sampling_params=GREEDY)
        assert engine.scheduler.kv_manager.hicache.stats["pages_written"] > 0
        assert_engine_conserved(engine)
    again, stats = run(loaded, tmp_path)
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] >= 500 and stats["loaded_tokens"] >= 500
