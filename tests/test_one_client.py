"""One request script through both front ends, the offline Engine and the HTTP server's /generate, which share
the scheduler's client (radixserve/client/): identical token ids, logprobs, finish reasons and cache hits."""

from __future__ import annotations

from typing import Any

import pytest
from server_harness import ServerHandle, assert_conservation, start_server, wait_idle

from radixserve import Engine

ARGS = {"dtype": "float32", "max_total_tokens": 2048, "context_length": 2048, "disable_overlap_schedule": True}
THREADS = 2  # NOTE: the server's scheduler runs with OMP_NUM_THREADS=2; the Engine's forward must too


def _cli(args: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


def _script(tokenizer: Any) -> list[dict[str, Any]]:
    """Requests as /generate bodies; the Engine gets the same fields as keyword arguments."""
    system = tokenizer.encode("You are a helpful assistant. Answer in one short sentence.")
    ask = system + tokenizer.encode(" What is the capital of France?")
    other = system + tokenizer.encode(" Name three colours of the rainbow.")
    greedy = {"temperature": 0.0}
    return [
        {"input_ids": ask, "sampling_params": {**greedy, "max_new_tokens": 12}, "return_logprob": True,
         "top_logprobs_num": 3},
        {"input_ids": ask, "sampling_params": {**greedy, "max_new_tokens": 12}},  # the prefix is cached now
        {"input_ids": ask, "sampling_params": {**greedy, "max_new_tokens": 20, "stop": [":"]}},  # a stop string
        {"input_ids": other, "sampling_params": {**greedy, "max_new_tokens": 5}, "return_logprob": True,
         "logprob_start_len": 0, "top_logprobs_num": 2},
        {"input_ids": ask, "sampling_params": {"temperature": 0.9, "seed": 11, "max_new_tokens": 8, "n": 2},
         "return_logprob": True},
        {"text": "The capital of France is", "sampling_params": {**greedy, "max_new_tokens": 8}},
    ]


def _via_engine(engine: Engine, body: dict[str, Any]) -> Any:
    kwargs = {k: v for k, v in body.items() if k not in ("text", "input_ids")}
    return engine.generate(prompt=body.get("text"), input_ids=body.get("input_ids"), **kwargs)


def _comparable(result: Any) -> Any:
    if isinstance(result, list):
        return [_comparable(r) for r in result]
    meta = result["meta_info"]
    keep = ("finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "output_token_logprobs",
            "output_top_logprobs", "input_token_logprobs", "input_top_logprobs")
    return {"text": result["text"], "output_ids": result["output_ids"],
            **{k: _lists(meta[k]) for k in keep if k in meta}}


def _lists(value: Any) -> Any:
    """JSON's shape: tuples become lists."""
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    return value


def _assert_close(a: Any, b: Any, where: str) -> None:
    if isinstance(a, float) and isinstance(b, float):
        assert abs(a - b) <= 1e-4, (where, a, b)
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), where
        for x, y in zip(a, b, strict=True):
            _assert_close(x, y, where)
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_close(a[k], b[k], where)
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module")
def server() -> ServerHandle:
    handle = start_server(*_cli(ARGS))
    yield handle
    handle.stop()


@pytest.mark.long  # NOTE: ~90 s; the Engine and the server are each tested in the default run
def test_one_script_through_the_engine_and_the_server_gives_identical_results(server: ServerHandle) -> None:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    engine = Engine(log_level="warning", **ARGS)
    try:
        script = _script(engine.tokenizer)
        for i, body in enumerate(script):
            over_http = server.post("/generate", json=body)
            assert over_http.status_code == 200, over_http.text
            in_process = _via_engine(engine, body)
            if body["sampling_params"].get("n", 1) == 1:
                assert _comparable(in_process) == _comparable(over_http.json()), f"request {i}: {body}"
            else:
                # NOTE: whether the n choices share their forwards depends on arrival timing, and a different batch
                # shape rounds differently: the same tokens, logprobs within 1e-4.
                _assert_close(_comparable(in_process), _comparable(over_http.json()), f"request {i}: {body}")
        # the same rule refuses the same request, with the same words
        bad = {"input_ids": [1, 2, 10**7], "sampling_params": {"max_new_tokens": 2}}
        refused = server.post("/generate", json=bad)
        with pytest.raises(ValueError) as engine_error:
            _via_engine(engine, bad)
        assert refused.status_code == 400 and "outside the vocabulary" in str(engine_error.value)
        assert "outside the vocabulary" in refused.json()["error"]["message"]
        engine_state = engine.get_internal_state()
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)
    assert_conservation(wait_idle(server))
    assert engine_state["kv_conservation"] is not None and "error" not in engine_state["kv_conservation"]
