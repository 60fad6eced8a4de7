import argparse

import pytest

from radixserve.sampling_params import SamplingParams, SamplingParamsError
from radixserve.server_args import ServerArgs


def test_server_args_defaults_follow_sglang_names():
    args = ServerArgs()
    assert args.schedule_policy == "lpm"
    assert args.radix_eviction_policy == "lru"
    assert args.page_size == 1 and not args.disable_radix_cache and not args.disable_overlap_schedule


@pytest.mark.parametrize("field, value", [("dtype", "int8"), ("schedule_policy", "random"),
                                          ("radix_eviction_policy", "mru")])
def test_server_args_reject_unknown_choice_and_list_valid_ones(field, value):
    with pytest.raises(ValueError, match="is not one of"):
        ServerArgs(**{field: value})


def test_server_args_reject_bad_sizes_and_unknown_keywords():
    with pytest.raises(ValueError):
        ServerArgs(page_size=0)
    with pytest.raises(ValueError):
        ServerArgs(chunked_prefill_size=0)
    with pytest.raises(ValueError, match="torch_threads"):
        ServerArgs(torch_threads=0)
    with pytest.raises(TypeError, match="unknown server argument"):
        ServerArgs.from_kwargs(max_total_token=10)


def test_cli_flags_round_trip_and_document_defaults():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--page-size", "4", "--disable-radix-cache", "--max-total-tokens", "512",
                            "--torch-threads", "1"])
    args = ServerArgs.from_cli_args(ns)
    assert (args.page_size, args.disable_radix_cache, args.max_total_tokens) == (4, True, 512)
    assert args.torch_threads == 1
    assert "(default: lpm)" in parser.format_help()


def test_api_keys_split():
    assert ServerArgs(api_key="a,b").api_keys == ["a", "b"]
    assert ServerArgs().api_keys == []


@pytest.mark.parametrize("kwargs, param", [
    ({"max_new_tokens": -1}, "max_new_tokens"), ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k"),
    ({"min_p": 2.0}, "min_p"), ({"n": 0}, "n"), ({"n": 17}, "n"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"), ({"seed": "x"}, "seed"), ({"temperature": True}, "temperature"),
])
def test_invalid_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_sampling_params_from_dict():
    p = SamplingParams.from_any({"max_new_tokens": 5, "stop": "\n", "temperature": 0})
    assert p.stop == ["\n"] and p.is_greedy
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_any({"max_tokens": 5})
    with pytest.raises(TypeError):
        SamplingParams.from_any([1, 2])
