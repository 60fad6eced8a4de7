"""The real server (scheduler process + embedded SmolLM2) through the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI
from server_harness import ServerHandle, check_idle_conservation

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def model_name(api_client: OpenAI) -> str:
    return api_client.models.list().data[0].id


def _unique_text(words: int = 40) -> str:
    """A prompt no other test sent (so its first run cannot hit the cache)."""
    return f"Note {uuid.uuid4().hex}: " + " ".join(["the river flows past the old mill"] * (words // 7 + 1))


def test_models_lists_the_served_model_with_its_effective_context(api_server: ServerHandle, api_client: OpenAI) -> None:
    models = api_client.models.list().data
    assert len(models) == 1 and models[0].id == "SmolLM2-135M-Instruct"
    raw = api_server.get("/v1/models").json()["data"][0]
    assert raw["max_model_len"] == 1024  # min(context 2048, pool 1024)


def test_chat_sync_stream_and_non_stream_agree_and_report_usage(api_client: OpenAI, model_name: str) -> None:
    full = api_client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=16, temperature=0)
    choice = full.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = full.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0
    stream = api_client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None
    assert final.usage.completion_tokens == usage.completion_tokens
    # NOTE: the same prompt again: all but the last prompt token come from the radix cache.
    assert final.usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_streaming_without_include_usage_has_no_usage_chunk(api_client: OpenAI, model_name: str) -> None:
    chunks = list(api_client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=4,
                                                 temperature=0, stream=True))
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_completions_async_batch_of_prompts_with_n_and_seed(api_client: OpenAI, api_server: ServerHandle,
                                                            model_name: str) -> None:
    async def run() -> tuple:
        aclient = AsyncOpenAI(base_url=api_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        prompts = ["The sky is", "My favourite fruit is"]
        full = await aclient.completions.create(model=model_name, prompt=prompts, n=2, max_tokens=6,
                                                temperature=0.8, seed=7)
        again = await aclient.completions.create(model=model_name, prompt=prompts, n=2, max_tokens=6,
                                                 temperature=0.8, seed=7, stream=True,
                                                 stream_options={"include_usage": True})
        texts = ["", "", "", ""]
        usage = None
        async for chunk in again:
            for c in chunk.choices:
                texts[c.index] += c.text
            usage = chunk.usage or usage
        await aclient.close()
        return full, texts, usage

    full, streamed, usage = asyncio.run(run())
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    assert [c.text for c in full.choices] == streamed  # a seed makes sampling reproducible
    assert all(c.finish_reason == "length" for c in full.choices)
    assert full.usage.completion_tokens == 4 * 6 == usage.completion_tokens
    lengths = [len(api_server.post("/tokenize", json={"prompt": p}).json()["tokens"])
               for p in ["The sky is", "My favourite fruit is"]]
    assert full.usage.prompt_tokens == usage.prompt_tokens == sum(lengths)
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_completions_accept_token_ids_and_match_text_prompt(api_client: OpenAI, api_server: ServerHandle,
                                                            model_name: str) -> None:
    native = api_server.post("/generate", json={"text": "The capital of Italy is",
                                            "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    text = api_client.completions.create(model=model_name, prompt="The capital of Italy is", max_tokens=8,
                                     temperature=0).choices[0].text
    assert text == native["text"]
    prompt_ids = _tokenize(api_server, "The capital of Italy is")
    by_ids = api_client.completions.create(model=model_name, prompt=prompt_ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == text
    assert by_ids.usage.prompt_tokens == len(prompt_ids) == native["meta_info"]["prompt_tokens"]


def _tokenize(api_server: ServerHandle, text: str) -> list[int]:
    r = api_server.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    assert api_server.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"] == text
    return body["tokens"]


def test_cached_tokens_on_repeated_prefix_and_zero_under_another_salt(api_client: OpenAI, model_name: str) -> None:
    prompt = _unique_text()
    salt_a, salt_b = uuid.uuid4().hex, uuid.uuid4().hex

    def cached(**extra: str) -> int:
        r = api_client.completions.create(model=model_name, prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body=extra or None)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt=salt_a) == 0
    assert cached(cache_salt=salt_a) > 0  # positive control: same salt, same prompt
    assert cached(cache_salt=salt_b) == 0  # another salt never shares KV
    assert cached() == 0  # nor does the unsalted namespace
    assert cached(extra_key=salt_a) == 0  # ("key", s) is not ("salt", s)
    assert cached(cache_salt=salt_a, extra_key="x") == 0  # a salt plus a key is a narrower namespace
    assert cached() > 0


def test_native_generate_text_ids_stream_and_meta_info(api_server: ServerHandle) -> None:
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    first = api_server.post("/generate", json=body).json()
    assert len(first["output_ids"]) == 6 and first["meta_info"]["completion_tokens"] == 6
    assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 6}  # SGLang's shape, whole
    meta = api_server.post("/generate", json=body).json()["meta_info"]
    assert meta["cached_tokens"] == meta["prompt_tokens"] - 1
    with api_server.client() as c, c.stream("POST", "/generate", json=body | {"stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["text"] == first["text"] and last["output_ids"] == first["output_ids"]
    batch = api_server.post("/generate", json={"input_ids": [first["output_ids"], [1, 2, 3]],
                                           "sampling_params": {"max_new_tokens": 2}}).json()
    assert isinstance(batch, list) and len(batch) == 2


def test_max_tokens_unset_means_the_rest_of_the_context(api_server: ServerHandle) -> None:
    limit = api_server.info()["model"]["effective_max_context"]
    ids = [28120 + i % 50 for i in range(limit - 5)]
    r = api_server.post("/v1/completions", json={"prompt": ids, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["finish_reason"] == "length"


def test_stop_string_cuts_the_text_and_finishes_with_stop(api_client: OpenAI, model_name: str) -> None:
    base = api_client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=16, temperature=0)
    text = base.choices[0].message.content
    word = "Paris"
    assert word in text
    cut = api_client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=16, temperature=0,
                                         stop=[word])
    assert cut.choices[0].message.content == text[:text.index(word)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = api_client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=16, temperature=0,
                                              stop=[word], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text[:text.index(word)]


def test_health_health_generate_and_server_info(api_server: ServerHandle) -> None:
    assert api_server.get("/health").json() == {"status": "ok"}
    r = api_server.get("/health_generate")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    info = api_server.info()
    assert info["scheduler_alive"] is True
    model = info["model"]
    assert model["max_total_num_tokens"] == 1024 and model["context_len"] == 2048
    assert model["page_size"] == 1 and model["dtype"] == "float32" and model["vocab_size"] > 0
    assert info["server_args"]["api_key"] is None
    state = info["scheduler_state"]
    for key in ("num_retractions", "evicted_tokens", "cached_tokens", "prompt_tokens", "kv_accounting"):
        assert key in state
    # the execution plan: every choice with its reason, the same one the scheduler logged at start-up
    plan = info["platform"]["execution_plan"]
    assert plan["dtype"] == {"choice": "float32", "reason": "explicit --dtype"}
    # float32 weights (explicit --dtype float32): the float32 C decoder runs where timing gave every decoder layer
    # our float32 GEMV, and otherwise the plan names the method that stopped it
    decoder_layers = {e["choice"].rsplit(" x", 1)[0] for part, e in plan.items()
                      if part.startswith("linear ") and not part.startswith(f"linear {model['vocab_size']}x")}
    if decoder_layers == {"f32_gemv"}:
        # where timing alone chose another method for a shape, the plan gives it f32_gemv and says so after this
        assert plan["decoder"]["choice"] == "C decoder"
        assert plan["decoder"]["reason"].startswith("float32 on the float32 GEMV: every decoder layer in one C call")
    else:
        assert (plan["decoder"]["choice"] == "python layers"
                and "not bf16_weights or f32_gemv or packed" in plan["decoder"]["reason"])
    assert sum(int(e["choice"].rsplit(" x", 1)[1]) for part, e in plan.items() if part.startswith("linear ")) == 30 * 4 + 1
    assert all(e["reason"] for e in plan.values())
    assert "execution plan:" in api_server.log_tail(200_000) and "attention decode" in api_server.log_tail(200_000)


def test_flush_cache_409_while_running_then_200_with_tokens_freed(api_server: ServerHandle, api_client: OpenAI,
                                                                  model_name: str) -> None:
    prompt = _unique_text()
    api_client.completions.create(model=model_name, prompt=prompt, max_tokens=2, temperature=0)
    body = {"prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with api_server.client() as c, c.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()  # NOTE: keep it; a dropped iterator closes the connection (an abort)
        next(lines)  # the request is running now
        busy = api_server.post("/flush_cache")
        assert busy.status_code == 409
        err = busy.json()
        assert err["error"]["code"] == "requests_running" and err["in_flight_requests"] >= 1
    check_idle_conservation(api_server)
    epoch = api_server.info()["scheduler_state"]["cache_epoch"]
    done = api_server.post("/flush_cache")
    assert done.status_code == 200, done.text
    assert done.json()["success"] is True and done.json()["tokens_freed"] > 0
    assert done.json()["cache_epoch"] == epoch + 1 == api_server.info()["scheduler_state"]["cache_epoch"]
    cold = api_client.completions.create(model=model_name, prompt=prompt, max_tokens=2, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0  # the flush really emptied the tree


def test_skip_special_tokens_passes_through_the_openai_api(api_client: OpenAI, model_name: str) -> None:
    for skip, text in ((True, ""), (False, "<|im_start|><|im_start|>")):
        r = api_client.completions.create(model=model_name, prompt="Hi", max_tokens=2, temperature=0,
                                          logit_bias={"1": 100}, extra_body={"skip_special_tokens": skip})
        assert r.choices[0].text == text


def test_metrics_names_and_counts_add_up(api_server: ServerHandle, api_client: OpenAI, model_name: str) -> None:
    before = api_server.metrics()
    r = api_client.completions.create(model=model_name, prompt=_unique_text(), max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    again = api_client.completions.create(model=model_name, prompt=_unique_text(), max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    check_idle_conservation(api_server)
    after = api_server.metrics()

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("radixserve:prompt_tokens_total") == r.usage.prompt_tokens + again.usage.prompt_tokens
    assert delta("radixserve:generation_tokens_total") == 5 + 3
    assert delta("radixserve:cached_tokens_total") == (r.usage.prompt_tokens_details.cached_tokens
                                                       + again.usage.prompt_tokens_details.cached_tokens)
    assert delta("radixserve:num_requests_total") == 2
    assert delta("radixserve:num_aborted_requests_total") == 0
    assert delta("radixserve:time_to_first_token_seconds_count") == 2
    assert delta("radixserve:e2e_request_latency_seconds_count") == 2
    assert delta("radixserve:inter_token_latency_seconds_count") == 4 + 2
    for name in ("radixserve:evicted_tokens_total", "radixserve:num_retractions_total",
                 "radixserve:num_running_reqs", "radixserve:num_queue_reqs", "radixserve:token_usage"):
        assert name in after
    assert after["radixserve:scheduler_up"] == 1.0


def test_raw_httpx_chat_has_the_openai_shape(api_server: ServerHandle) -> None:
    r = httpx.post(api_server.base_url + "/v1/chat/completions",
                   json={"messages": QUESTION, "max_tokens": 3, "temperature": 0}, timeout=60)
    body = r.json()
    assert r.status_code == 200
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
    assert isinstance(body["usage"]["prompt_tokens_details"]["cached_tokens"], int)


def test_bench_http_backend_replays_the_workloads_through_the_openai_api(api_server: ServerHandle) -> None:
    from radixserve.bench.http_backend import HttpBackend
    from radixserve.bench.runner import run_workload
    from radixserve.bench.workloads import build_workloads

    backend = HttpBackend(api_server.base_url, "on")
    w1, w3 = build_workloads(backend.tokenizer, ["w1", "w3"], scale=0.1)
    try:
        backend.flush_cache()
        res = run_workload(backend, w1)
        assert len(res.records) == 3 and res.completion_tokens == 3 * w1.max_new_tokens
        assert all(0 < r.ttft <= r.e2e for r in res.records)
        assert res.cached_tokens > 0  # the shared prefix is reused
        # NOTE: the server's own counter of computed prefill tokens matches what usage reported.
        assert res.prefill_computed == res.prompt_tokens - res.cached_tokens
        conv = run_workload(backend, w3)
        assert len(conv.records) == 8
        later_turns = [r for i, r in enumerate(conv.records) if i % 4 > 0]
        assert all(r.cached_tokens > 0 for r in later_turns)  # each turn reuses the previous ones
    finally:
        backend.close()


def test_penalties_min_tokens_and_logit_bias_reach_the_sampler(api_client: OpenAI, api_server: ServerHandle,
                                                               model_name: str) -> None:
    prompt = "one two three one two three one two three one two three"
    plain = api_client.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0)
    penalized = api_client.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0)
    assert plain.choices[0].text != penalized.choices[0].text
    pushed = api_client.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0,
                                       logit_bias={"1234": 100})
    tokens = api_server.post("/tokenize", json={"prompt": pushed.choices[0].text, "add_special_tokens": False}).json()
    assert tokens["tokens"] == [1234]
    ask = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    short = api_client.chat.completions.create(model=model_name, messages=ask, max_tokens=30, temperature=0)
    longer = api_client.chat.completions.create(model=model_name, messages=ask, max_tokens=30, temperature=0,
                                            extra_body={"min_tokens": 10})
    assert short.usage.completion_tokens < 10 <= longer.usage.completion_tokens
    native = api_server.post("/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "frequency_penalty": 2.0, "presence_penalty": 2.0}}).json()
    assert native["text"] == penalized.choices[0].text


def test_native_max_new_tokens_zero_prewarms_the_cache(api_server: ServerHandle) -> None:
    text = _unique_text() + " A system prompt that many later requests will share."
    warm = api_server.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 0}})
    assert warm.status_code == 200, warm.text
    assert warm.json()["output_ids"] == [] and warm.json()["meta_info"]["finish_reason"]["type"] == "length"
    hit = api_server.post("/generate", json={"text": text + " Question?", "sampling_params": {"max_new_tokens": 1}})
    assert hit.json()["meta_info"]["cached_tokens"] >= warm.json()["meta_info"]["prompt_tokens"] - 1
