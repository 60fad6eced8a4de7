"""POST /v1/embeddings on the real server: the OpenAI SDK, pooling against transformers, cache reuse, concurrency.

The shared API server (float32, --embedding-pooling last) serves most tests; a second server with
--embedding-pooling mean and 32-token prefill chunks checks mean pooling over chunks and that it never reuses a
cached prefix. Every vector is checked against transformers reading the same GGUF (the final norm's output).
After each test the KV conservation identity holds (conftest's `_api_server_conserved`; explicitly for the mean
server).
"""

from __future__ import annotations

import base64
import json
import math
import struct
import threading
import uuid

import pytest
import torch
from server_harness import API_SERVER_ARGS, ServerHandle, check_idle_conservation, shared_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
EMBEDDINGS = "/v1/embeddings"
TEXTS = ["The cat sat on the mat.", "Quantum chromodynamics describes the strong interaction.",
         "A radix tree shares the prefixes of its keys."]
LOADED_S = 600.0  # NOTE: a shared 2-core machine decoded at 0.5 token/s while this was written
LONG = "A radix tree stores token sequences so that requests sharing a prefix reuse their KV cache. " * 5


def _embed(server: ServerHandle, inputs, **extra) -> dict:
    r = server.post(EMBEDDINGS, json={"model": MODEL, "input": inputs} | extra)
    assert r.status_code == 200, r.text
    return r.json()


def _vectors(body: dict) -> list[list[float]]:
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return [d["embedding"] for d in body["data"]]


def _cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))  # NOTE: both are L2-normalised


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _ids(server: ServerHandle, text: str) -> list[int]:
    return server.post("/tokenize", json={"prompt": text}).json()["tokens"]


def _cached_tokens(server: ServerHandle) -> float:
    return server.metrics()["radixserve:cached_tokens_total"]


@pytest.fixture(scope="module")
def reference():
    """(ids -> transformers' final-norm output [tokens, hidden]) on the same GGUF in float32."""
    from test_model_smollm2 import hf_model_from_gguf

    hf = hf_model_from_gguf(torch.float32)

    def hidden(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf.model(torch.tensor([ids])).last_hidden_state[0].float()

    return hidden


@pytest.fixture(scope="module")
def mean_server():
    server = shared_server(*API_SERVER_ARGS, "--embedding-pooling", "mean", "--chunked-prefill-size", "32")
    yield server
    check_idle_conservation(server)


def test_sdk_float_and_base64_match_transformers_last_token(api_server: ServerHandle, api_client, reference) -> None:
    floats = api_client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    default = api_client.embeddings.create(model=MODEL, input=TEXTS)  # NOTE: this SDK asks for base64 by default
    assert floats.object == "list" and floats.model == MODEL and len(floats.data) == 3
    ids = [_ids(api_server, t) for t in TEXTS]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    for item, other, prompt in zip(floats.data, default.data, ids, strict=True):
        assert item.object == "embedding" and len(item.embedding) == 576
        # NOTE: the second call is a radix cache hit (only the last row computed): equal to float32 rounding
        assert list(other.embedding) == pytest.approx(item.embedding, abs=1e-5)
        expected = torch.nn.functional.normalize(reference(prompt)[-1], dim=0)
        assert torch.allclose(torch.tensor(item.embedding), expected, atol=1e-4), \
            (torch.tensor(item.embedding) - expected).abs().max()
    raw = _embed(api_server, TEXTS[0], encoding_format="base64")["data"][0]["embedding"]
    packed = base64.b64decode(raw)
    decoded = list(struct.unpack(f"<{len(packed) // 4}f", packed))  # little-endian float32, as the SDK decodes
    assert decoded == pytest.approx(floats.data[0].embedding, abs=1e-5)


def test_base64_is_little_endian_float32_of_the_floats() -> None:
    from radixserve.entrypoints.serving_embeddings import _encode

    values = [0.1, -0.5, 1 / 3, 0.0]
    packed = base64.b64decode(_encode(values, None, "base64"))
    assert packed == struct.pack("<4f", *values)
    assert _encode(values, None, "float") == values
    assert _encode([3.0, 4.0, 12.0], 2, "float") == pytest.approx([0.6, 0.8])


def test_cosine_alone_and_in_a_batch_and_token_ids(api_server: ServerHandle) -> None:
    salt = uuid.uuid4().hex
    batch = _vectors(_embed(api_server, [*TEXTS, TEXTS[0]], cache_salt=salt))
    alone = _vectors(_embed(api_server, TEXTS[1], cache_salt=uuid.uuid4().hex))[0]
    for v in batch:
        assert math.sqrt(_cos(v, v)) == pytest.approx(1.0, abs=1e-5)
    assert _cos(batch[0], batch[3]) == pytest.approx(1.0, abs=1e-5)
    assert _cos(batch[0], batch[1]) < 0.99 and _cos(batch[0], batch[2]) < 0.99
    # NOTE: float32; one request alone and the same text in a batch of four run different row counts
    assert _max_diff(alone, batch[1]) < 1e-5
    ids = [_ids(api_server, t) for t in TEXTS]
    by_ids = _vectors(_embed(api_server, ids, cache_salt=uuid.uuid4().hex))
    one = _vectors(_embed(api_server, ids[2], cache_salt=uuid.uuid4().hex))[0]
    for a, b in zip(by_ids, batch, strict=False):
        assert _max_diff(a, b) < 1e-5
    assert _max_diff(one, batch[2]) < 1e-5


def test_dimensions_truncate_then_renormalise(api_server: ServerHandle) -> None:
    full = _vectors(_embed(api_server, TEXTS[0]))[0]
    short = _vectors(_embed(api_server, TEXTS[0], dimensions=64))[0]
    assert len(short) == 64
    norm = math.sqrt(sum(v * v for v in full[:64]))
    assert short == pytest.approx([v / norm for v in full[:64]], abs=1e-5)
    assert _vectors(_embed(api_server, TEXTS[0], dimensions=576))[0] == pytest.approx(full, abs=1e-7)
    b64 = _embed(api_server, TEXTS[0], dimensions=8, encoding_format="base64")["data"][0]["embedding"]
    assert len(base64.b64decode(b64)) == 8 * 4


def test_shared_prefix_is_a_radix_cache_hit(api_server: ServerHandle, reference) -> None:
    salt = uuid.uuid4().hex
    head = _ids(api_server, LONG)
    longer = head + _ids(api_server, " And then it goes on.")
    _embed(api_server, head, cache_salt=salt)
    before = _cached_tokens(api_server)
    hit = _vectors(_embed(api_server, longer, cache_salt=salt))[0]
    # NOTE: the first request's whole prompt went into the tree when it finished; the second reuses all of it
    assert _cached_tokens(api_server) - before == len(head)
    cold = _vectors(_embed(api_server, longer, cache_salt=uuid.uuid4().hex))[0]
    assert _max_diff(hit, cold) < 1e-5
    expected = torch.nn.functional.normalize(reference(longer)[-1], dim=0)
    assert torch.allclose(torch.tensor(hit), expected, atol=1e-4)


@pytest.mark.long  # NOTE: minutes on 2 loaded cores; the long run (CI) keeps it
def test_embeddings_beside_streaming_generation_leave_its_tokens_alone(api_server: ServerHandle) -> None:
    body = {"model": MODEL, "prompt": "Write a short story about a lighthouse keeper:", "max_tokens": 24,
            "temperature": 0, "ignore_eos": True, "cache_salt": uuid.uuid4().hex}
    r = api_server.post("/v1/completions", json=body, timeout=LOADED_S)
    assert r.status_code == 200, r.text
    alone = r.json()["choices"][0]["text"]
    errors: list[str] = []
    pieces: list[str] = []
    seen: list[int] = []  # the streamed pieces when each embedding answer came

    def embed_many() -> None:
        for i in range(3):
            r = api_server.post(EMBEDDINGS, json={"input": [LONG, *TEXTS, f"{i} {LONG}"],
                                                  "cache_salt": uuid.uuid4().hex}, timeout=LOADED_S)
            if r.status_code != 200:
                errors.append(r.text)
            seen.append(len(pieces))

    threads = [threading.Thread(target=embed_many) for _ in range(2)]
    with api_server.client(timeout=LOADED_S) as c, c.stream("POST", "/v1/completions", json=body | {"stream": True}) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            pieces.append(json.loads(line[6:])["choices"][0]["text"])
            if len(pieces) == 1:
                for t in threads:
                    t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:1]
    assert min(seen) < len(pieces)  # NOTE: some embeddings ran while the generation was still decoding
    assert "".join(pieces) == alone


BAD = [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["ok", ""]}, "input"), ({"input": [[1, 2], []]}, "input"),
    ({"input": [10**9]}, "input"), ({"input": 5}, "input"), ({"input": [1, "a"]}, "input"), ({}, "input"),
    ({"input": "x", "dimensions": 0}, "dimensions"), ({"input": "x", "dimensions": 577}, "dimensions"),
    ({"input": "x", "dimensions": "8"}, "dimensions"), ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "user": 3}, "user"), ({"input": [1] * 2048}, "input"), ({"input": ["x"] * 300}, "input"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_inputs_are_400s_naming_the_field(api_server: ServerHandle, body: dict, param: str) -> None:
    r = api_server.post(EMBEDDINGS, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_unknown_model_is_404_and_models_and_schema_state_the_route(api_server: ServerHandle) -> None:
    r = api_server.post(EMBEDDINGS, json={"input": "x", "model": "no-such-model"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    cards = api_server.get("/v1/models").json()["data"]
    assert cards[0]["id"] == MODEL and cards[0]["embedding_pooling"] == "last"
    schema = api_server.get("/openapi.json").json()
    operation = schema["paths"][EMBEDDINGS]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    assert {"input", "model", "encoding_format", "dimensions", "user"} <= set(
        schema["components"]["schemas"][body]["properties"])
    assert {"400", "401", "404", "413", "503"} <= set(operation["responses"])


def test_mean_pooling_over_chunks_matches_transformers_and_computes_whole(mean_server: ServerHandle,
                                                                          reference) -> None:
    assert mean_server.get("/v1/models").json()["data"][0]["embedding_pooling"] == "mean"
    ids = _ids(mean_server, LONG)
    assert len(ids) > 2 * 32  # NOTE: prefilled in three 32-token chunks, their sums added up
    salt = uuid.uuid4().hex
    first = _vectors(_embed(mean_server, ids, cache_salt=salt))[0]
    expected = torch.nn.functional.normalize(reference(ids).mean(0), dim=0)
    assert torch.allclose(torch.tensor(first), expected, atol=1e-4), (torch.tensor(first) - expected).abs().max()
    before = _cached_tokens(mean_server)
    again = _vectors(_embed(mean_server, [ids, ids[:40]], cache_salt=salt))
    assert _cached_tokens(mean_server) == before  # NOTE: mean pooling matches no prefix: computed whole
    assert _max_diff(again[0], first) < 1e-5
    short = torch.nn.functional.normalize(reference(ids[:40]).mean(0), dim=0)
    assert torch.allclose(torch.tensor(again[1]), short, atol=1e-4)
    # a generation after it still reuses the prompt the embedding cached
    r = mean_server.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "cache_salt": salt})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1
    check_idle_conservation(mean_server)
