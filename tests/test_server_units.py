"""Server pieces that need no model: namespaces, body parsing, usage aggregation, max_tokens resolution."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from radixserve.entrypoints.http_errors import ApiError, parse_json
from radixserve.entrypoints.serving_common import per_choice_params, resolve_max_tokens
from radixserve.entrypoints.serving_openai import _Usage
from radixserve.managers.scheduler_process import SchedulerInfo
from radixserve.managers.tokenizer_manager import GenerateOutput, api_key_id, cache_namespace
from radixserve.mem_cache.radix_key import check_namespace
from radixserve.sampling_params import SamplingParams


def test_namespaces_are_structured_and_never_alias() -> None:
    keys = [
        cache_namespace(None, None, None),
        cache_namespace(None, "a", None),
        cache_namespace(None, None, "a"),
        cache_namespace(None, "a", "b"),
        cache_namespace(None, "a|b", None),
        cache_namespace(None, "ab", None),
        cache_namespace(api_key_id("k1"), None, None),
        cache_namespace(api_key_id("k1"), "a", None),
        cache_namespace(api_key_id("k2"), "a", None),
    ]
    assert keys[0] is None
    assert len(set(keys)) == len(keys)
    for key in keys:
        check_namespace(key)  # the radix tree accepts every one of them
    # The key-derived part always comes first, so a client salt can only add to it.
    assert keys[7][0] == ("api", api_key_id("k1")) and keys[7][1] == ("salt", "a")
    assert api_key_id("k1") != api_key_id("k2") and "k1" not in api_key_id("k1")


@pytest.mark.parametrize("raw, code", [(b"{", "invalid_json"), (b"\xff{}", "invalid_utf8"), (b"", "invalid_json"),
                                       (b'{"t": NaN}', "invalid_json")])
def test_parse_json_rejects_bad_bodies(raw: bytes, code: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_json(raw)
    assert e.value.status == 400 and e.value.code == code


def _tm(context: int, pool: int, page: int = 1) -> SimpleNamespace:
    info = SchedulerInfo("m", None, context, 100, (0,), pool, page, 8, "float32", "cpu", 1)
    return SimpleNamespace(info=info)


def test_max_tokens_unset_is_the_rest_of_the_effective_context() -> None:
    assert resolve_max_tokens(_tm(2048, 1024), 24, None, "prompt") == 1000  # bounded by the pool
    assert resolve_max_tokens(_tm(512, 4096), 12, None, "prompt") == 500  # bounded by the context
    assert resolve_max_tokens(_tm(512, 4096), 12, 7, "prompt") == 7
    with pytest.raises(ApiError) as e:
        resolve_max_tokens(_tm(512, 4096), 12, 501, "prompt")
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    assert "513 tokens (12 in the prompt, 501 in the completion)" in e.value.message
    with pytest.raises(ApiError) as e:
        resolve_max_tokens(_tm(2048, 1000, page=16), 992, None, "messages")  # pool rounds down to 992
    assert e.value.code == "kv_pool_exceeded" and e.value.param == "messages"


def _out(completion: int, cached: int) -> GenerateOutput:
    return GenerateOutput("r", "", [], "length", None, None, 10, completion, cached)


def test_usage_counts_each_prompt_once_and_the_smallest_hit_among_its_choices() -> None:
    usage = _Usage([10, 20], n=2)
    for index, (completion, cached) in enumerate([(3, 0), (3, 9), (4, 19), (4, 19)]):
        usage.add(index, _out(completion, cached))
    info = usage.info()
    assert (info.prompt_tokens, info.completion_tokens, info.total_tokens) == (30, 14, 44)
    assert info.prompt_tokens_details.cached_tokens == 0 + 19


def test_n_choices_get_distinct_seeds_only_when_seeded() -> None:
    seeded = per_choice_params(SamplingParams(seed=5, n=3), 3)
    assert [p.seed for p in seeded] == [5, 6, 7] and all(p.n == 1 for p in seeded)
    assert [p.seed for p in per_choice_params(SamplingParams(n=2), 2)] == [None, None]
