"""`radixserve serve --dp N` without starting anything: CPU shares, a worker's flags, the install hint, and
the /get_load entry. The cluster itself is tested in test_scale_out.py."""

from __future__ import annotations

import argparse

import pytest

from radixserve.entrypoints import dp_launcher
from radixserve.entrypoints.dp_processes import core_shares, free_port, worker_flags
from radixserve.entrypoints.gateway_api import load_entry
from radixserve.launch_server import add_serve_args
from radixserve.server_args import ServerArgs


def test_core_shares_are_contiguous_and_refuse_more_workers_than_cpus() -> None:
    assert core_shares([0, 1], 2) == [[0], [1]]
    assert core_shares([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert core_shares([4, 5, 6, 7], 1) == [[4, 5, 6, 7]]
    with pytest.raises(ValueError, match="--dp 3 needs at least 3 CPUs"):
        core_shares([0, 1], 3)


def test_worker_flags_round_trip_through_the_serve_parser() -> None:
    args = ServerArgs(dtype="float32", max_total_tokens=4096, disable_radix_cache=True, api_key="a,b", port=9)
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    parsed = ServerArgs.from_cli_args(parser.parse_args(worker_flags(args, 41000, 3)))
    assert parsed == args.replace(host="127.0.0.1", port=41000, torch_threads=3)


def test_dp_without_sglang_router_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.cli import main

    monkeypatch.setattr(dp_launcher, "router_installed", lambda: False)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--dp", "2"])
    assert "pip install 'radixserve[router]'" in str(e.value.code)


def test_load_entry_counts_kv_held_by_requests() -> None:
    state = {"max_total_num_tokens": 1000, "token_usage": 0.25, "num_waiting_reqs": 3}
    assert load_entry(5, state) == {"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 3, "num_tokens": 250}
    assert load_entry(0, {})["num_tokens"] == 0


def test_free_port_never_hands_out_a_port_twice_or_an_avoided_one() -> None:
    # CI once started both workers of `serve --dp 2` on one port: the kernel gave the same ephemeral port to
    # two binds in a row, and the second worker failed to bind.
    first = free_port()
    ports = [free_port(avoid=(first,)) for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert first not in ports
