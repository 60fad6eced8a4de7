"""SGLang's /abort_request: a request named by its `rid` (or all of the caller's) ends with finish reason
abort and its partial output, at any API; its KV is released; nothing else is touched."""

from __future__ import annotations

import json
import threading
import time

import pytest
from server_harness import ServerHandle

pytestmark = pytest.mark.slow

LONG = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}


def abort_when_running(api_server: ServerHandle, body: dict, expected: int = 1, timeout_s: float = 30.0) -> int:
    """POST /abort_request once `expected` requests are in flight; returns how many it reached."""
    deadline = time.monotonic() + timeout_s
    while api_server.info()["in_flight_requests"] < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    r = api_server.post("/abort_request", json=body)
    assert r.status_code == 200, r.text
    return r.json()["aborted"]


def in_thread(fn) -> tuple[threading.Thread, list]:
    box: list = []
    thread = threading.Thread(target=lambda: box.append(fn()))
    thread.start()
    return thread, box


def test_native_stream_aborted_by_rid_ends_with_abort_and_partial_output(api_server: ServerHandle) -> None:
    body = {"text": "Count from one to one thousand:", "sampling_params": LONG, "stream": True, "rid": "job-1"}
    with api_server.client() as c, c.stream("POST", "/generate", json=body) as stream:
        events = (json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {"))
        first = next(events)
        assert first["meta_info"]["finish_reason"] is None
        assert abort_when_running(api_server, {"rid": "job-1"}) == 1
        *_, last = first, *events
    meta = last["meta_info"]
    assert stream.status_code == 200
    assert meta["finish_reason"]["type"] == "abort" and "client" in meta["finish_reason"]["message"]
    assert 1 <= meta["completion_tokens"] < 400 and len(last["output_ids"]) == meta["completion_tokens"]


def test_openai_completion_with_rid_returns_200_and_finish_reason_abort(api_server: ServerHandle) -> None:
    body = {"prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "rid": "job-2"}
    thread, box = in_thread(lambda: api_server.post("/v1/completions", json=body))
    assert abort_when_running(api_server, {"rid": "job-2"}) == 1
    thread.join(60)
    r = box[0]
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert r.json()["usage"]["completion_tokens"] < 400


def test_abort_all_leaves_other_work_alone_once_done_and_bad_bodies_get_400(api_server: ServerHandle) -> None:
    jobs = [in_thread(lambda i=i: api_server.post("/generate", json={"text": f"Story {i}:", "sampling_params": LONG,
                                                                 "rid": f"batch-{i}"})) for i in range(2)]
    assert abort_when_running(api_server, {"abort_all": True}, expected=2) == 2
    for thread, box in jobs:
        thread.join(60)
        assert box[0].status_code == 200 and box[0].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert api_server.post("/abort_request", json={"rid": "nobody"}).json() == {"success": True, "aborted": 0}
    missing = api_server.post("/abort_request", json={})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "rid"
    mismatch = api_server.post("/generate", json={"text": ["a", "b"], "rid": ["only-one"]})
    assert mismatch.status_code == 400 and mismatch.json()["error"]["param"] == "rid"
    after = api_server.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 3}, "rid": "batch-0"})
    assert after.status_code == 200 and after.json()["meta_info"]["finish_reason"]["type"] == "length"
