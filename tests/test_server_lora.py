"""LoRA over HTTP on a tiny random Llama with PEFT-made adapters: choosing an adapter (OpenAI `model` as
"<base>:<adapter>" or "<adapter>", native `lora_path`), `/v1/models`, unknown adapters (404 naming them), and
the admin's `/load_lora_adapter` / `/unload_lora_adapter` (403 for a tenant, 400 for a bad folder, 404 for an
unknown name). The conservation identity is checked after every test."""

from __future__ import annotations

import pytest
from lora_support import SPECS, AdapterSpec, hf_greedy, make_peft_adapter
from server_harness import check_idle_conservation, start_server
from test_model_support import make_tiny_model

ADMIN, TENANT = "admin-key", "tenant-key"
STEPS = 5
PROMPT = [5, 17, 33, 9, 100, 42, 7, 19]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_http")
    base = make_tiny_model(root / "base", "llama")
    merged = {spec.name: make_peft_adapter(base, root / spec.name, spec) for spec in SPECS[:2]}
    paths = [f"{spec.name}={root / spec.name}" for spec in SPECS[:2]]
    server = start_server("--model-path", str(root / "base"), "--dtype", "float32", "--max-total-tokens", "1024",
                          "--api-key", TENANT, "--admin-api-key", ADMIN, "--lora-paths", *paths,
                          api_key=TENANT, admin_key=ADMIN)
    yield server, root, base, merged
    server.stop()


@pytest.fixture(autouse=True)
def _conserved(request):
    yield
    if "setup" in request.fixturenames:
        check_idle_conservation(request.getfixturevalue("setup")[0])


def _generate(server, **body):
    return server.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": STEPS, "temperature": 0, "ignore_eos": True}, **body})


def test_models_lists_the_base_and_its_adapters(setup):
    server, root, _, _ = setup
    cards = server.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["base", "sql", "chat"]
    assert cards[1]["parent"] == "base" and cards[1]["root"] == str(root / "sql")


def test_native_lora_path_gives_peft_tokens_and_namespaces(setup):
    server, _, base, merged = setup
    for name in ("sql", "chat"):
        r = _generate(server, lora_path=name)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == hf_greedy(merged[name], PROMPT, STEPS)
    plain = _generate(server).json()
    assert plain["output_ids"] == hf_greedy(base, PROMPT, STEPS)
    again = _generate(server, lora_path="sql").json()
    assert again["meta_info"]["cached_tokens"] == len(PROMPT) - 1


def test_openai_model_names_an_adapter_both_ways(setup):
    server, _, _, _ = setup
    native = _generate(server, lora_path="chat").json()["text"]
    for model in ("base:chat", "chat"):
        r = server.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": STEPS,
                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == native


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"model": "nope", "prompt": "t5 t6", "max_tokens": 2}),
    ("/v1/completions", {"model": "base:nope", "prompt": "t5 t6", "max_tokens": 2}),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "t5"}], "max_tokens": 2}),
    ("/generate", {"text": "t5 t6", "lora_path": "nope"}),
])
def test_an_unknown_adapter_is_a_404_naming_it(setup, route, body):
    server, _, _, _ = setup
    r = server.post(route, json=body)
    assert r.status_code == 404, r.text
    assert "'nope'" in r.json()["error"]["message"]


def test_admin_loads_and_unloads_at_run_time(setup, tmp_path):
    server, _, base, _ = setup
    merged = make_peft_adapter(base, tmp_path / "new", AdapterSpec("new", 4, ("gate_proj", "o_proj"), seed=31))
    body = {"lora_name": "new", "lora_path": str(tmp_path / "new")}
    assert server.post("/load_lora_adapter", json=body).status_code == 403  # a tenant key
    admin = {"headers": server.admin_headers}
    bad = server.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)}, **admin)
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    r = server.post("/load_lora_adapter", json=body, **admin)
    assert r.status_code == 200, r.text
    assert "new" in [a["name"] for a in r.json()["adapters"]]
    assert _generate(server, lora_path="new").json()["output_ids"] == hf_greedy(merged, PROMPT, STEPS)
    assert server.post("/unload_lora_adapter", json={"lora_name": "new"}).status_code == 403
    r = server.post("/unload_lora_adapter", json={"lora_name": "new"}, **admin)
    assert r.status_code == 200 and r.json()["freed_tokens"] >= len(PROMPT), r.text
    assert _generate(server, lora_path="new").status_code == 404
    assert server.post("/unload_lora_adapter", json={"lora_name": "new"}, **admin).status_code == 404


def test_admin_loads_a_gguf_lora_file(setup, tmp_path):
    """`/load_lora_adapter` with a llama.cpp GGUF adapter file: the PEFT adapter's tokens; a model file is a 400."""
    from lora_support import write_gguf_adapter

    server, root, base, merged = setup
    write_gguf_adapter(root / "chat", tmp_path / "chat.gguf", base.config)
    write_gguf_adapter(root / "chat", tmp_path / "model.gguf", base.config, general_type="model")
    admin = {"headers": server.admin_headers}
    bad = server.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path / "model.gguf")},
                      **admin)
    assert bad.status_code == 400 and "not 'adapter'" in bad.json()["error"]["message"], bad.text
    r = server.post("/load_lora_adapter", json={"lora_name": "chat_gguf", "lora_path": str(tmp_path / "chat.gguf")},
                    **admin)
    assert r.status_code == 200, r.text
    try:
        out = _generate(server, lora_path="chat_gguf").json()
        assert out["output_ids"] == hf_greedy(merged["chat"], PROMPT, STEPS)
    finally:
        assert server.post("/unload_lora_adapter", json={"lora_name": "chat_gguf"}, **admin).status_code == 200
