"""The CUDA path end to end: Engines on a GPU against transformers on the same GPU.

Skipped without a CUDA device (CI has none); `scripts/cuda_check.sh` runs this file, the other `-m cuda` tests
and a short timing on a GPU machine. Models are random: tiny Llamas of two head shapes (`test_head_shapes`),
tiny Gemma 3 (window layers, the hybrid pool), PEFT adapters, and, for structured outputs, a small random
model behind SmolLM2's real tokenizer (RADIXSERVE_TEST_TOKENIZER, a folder with its tokenizer files; the
embedded model's folder when unset)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from lora_support import hf_greedy
from test_model_gemma3 import _prompts
from test_model_support import assert_engine_conserved

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LOOPS = [pytest.param(False, id="overlap"), pytest.param(True, id="normal")]


def _shared_prefix_prompts() -> list[list[int]]:
    system = _prompts([40], seed=1)[0]
    return [system + tail for tail in _prompts([3, 17, 29, 8], seed=2)] + _prompts([33, 5], seed=3)


SHAPES = [pytest.param(64, 4, 1, id="d64-gqa4"), pytest.param(128, 4, 2, id="d128-gqa4")]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("normal_loop", LOOPS)
@pytest.mark.parametrize("dim, group, kv_heads", SHAPES)
def test_engine_greedy_equals_transformers(tmp_path, dim, group, kv_heads, normal_loop, page_size):
    """float32 on the GPU: greedy tokens equal transformers' on the same GPU; shared prefixes are reused."""
    from test_head_shapes import _tiny_llama
    from transformers import AutoModelForCausalLM

    from radixserve import Engine

    folder = _tiny_llama(tmp_path, dim, group, kv_heads)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to("cuda").eval()
    prompts = _shared_prefix_prompts()
    expected = [hf_greedy(hf, p, 10) for p in prompts]
    params = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
    with Engine(model_path=str(folder), dtype="float32", device="cuda", max_total_tokens=2048, page_size=page_size,
                chunked_prefill_size=32, disable_overlap_schedule=normal_loop, log_level="warning") as engine:
        first = engine.generate(input_ids=prompts[0], sampling_params=params)
        rest = engine.generate(input_ids=prompts[1:], sampling_params=params)
        assert_engine_conserved(engine)
    assert [r["output_ids"] for r in [first, *rest]] == expected
    assert max(r["meta_info"]["cached_tokens"] for r in rest[:3]) >= 32  # the shared 40 tokens, page-aligned


def test_bf16_loops_agree_and_follow_transformers(tmp_path):
    """bfloat16 on the GPU: both loops give the same tokens, and each request's first token is transformers'."""
    from test_head_shapes import _tiny_llama
    from transformers import AutoModelForCausalLM

    from radixserve import Engine

    folder = _tiny_llama(tmp_path, 128, 4, 2)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).to("cuda").eval()
    prompts = _shared_prefix_prompts()
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    outs = {}
    for normal in (False, True):
        with Engine(model_path=str(folder), dtype="bfloat16", device="cuda", max_total_tokens=2048,
                    disable_overlap_schedule=normal, log_level="warning") as engine:
            outs[normal] = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]
            assert_engine_conserved(engine)
    assert outs[False] == outs[True]
    assert [o[0] for o in outs[False]] == [hf_greedy(hf, p, 1)[0] for p in prompts]


@pytest.mark.parametrize("normal_loop", LOOPS)
def test_ngram_speculation_is_exact(tmp_path, normal_loop):
    """n-gram drafts verified on the GPU: the same tokens as plain decoding; a prompt asked again is drafted
    from the radix tree (the first answer is there) and its drafts are accepted."""
    from test_head_shapes import _tiny_llama

    from radixserve import Engine

    folder = _tiny_llama(tmp_path, 64, 4, 1)
    loop = _prompts([12], seed=5)[0]
    prompts = [loop * 4, _prompts([20], seed=6)[0] + loop * 3, _prompts([30], seed=7)[0]]
    params = {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True}
    outs, again = {}, {}
    for spec in ("none", "ngram"):
        with Engine(model_path=str(folder), dtype="float32", device="cuda", max_total_tokens=2048,
                    speculative_algorithm=spec, disable_overlap_schedule=normal_loop,
                    log_level="warning") as engine:
            outs[spec] = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]
            again[spec] = engine.generate(input_ids=prompts[2], sampling_params=params)
            assert_engine_conserved(engine)
    assert outs["ngram"] == outs["none"]
    assert again["ngram"]["output_ids"] == again["none"]["output_ids"] == outs["none"][2]
    assert again["ngram"]["meta_info"]["spec_accepted_tokens"] >= 16, again["ngram"]["meta_info"]


@pytest.mark.parametrize("page_size", [1, 4])
def test_gemma3_hybrid_pool_equals_transformers(tmp_path, page_size):
    """Tiny Gemma 3 (window 8) on the GPU with the window pool squeezed: transformers' greedy tokens."""
    from test_model_gemma3 import make_tiny_gemma3

    from radixserve import Engine

    hf = make_tiny_gemma3(tmp_path).to("cuda")
    prompts = _shared_prefix_prompts()
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    with Engine(model_path=str(tmp_path), dtype="float32", device="cuda", max_total_tokens=1024, page_size=page_size,
                chunked_prefill_size=8, swa_full_tokens_ratio=0.01, log_level="warning") as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        assert_engine_conserved(engine)
    assert [r["output_ids"] for r in outs] == expected


def test_multi_lora_batch_equals_merged_models(tmp_path_factory):
    """Four PEFT adapters (and the base) in one batch on the GPU: each row is its merged model's greedy."""
    from lora_support import SPECS, tiny_peft_models

    from radixserve import Engine

    root, base, merged = tiny_peft_models(tmp_path_factory)
    prompt = _prompts([14], seed=9)[0]
    names = [None] + [spec.name for spec in SPECS]
    expected = [hf_greedy((base if n is None else merged[n]).to("cuda"), prompt, 6) for n in names]
    paths = [f"{spec.name}={root / spec.name}" for spec in SPECS]
    with Engine(str(root / "base"), dtype="float32", device="cuda", max_total_tokens=1024, lora_paths=paths,
                max_loras_per_batch=4, log_level="warning") as engine:
        outs = engine.generate(input_ids=[prompt] * len(names), lora_path=names,
                               sampling_params={"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True})
        assert_engine_conserved(engine)
    assert [r["output_ids"] for r in outs] == expected


def _tokenizer_folder() -> Path:
    given = os.environ.get("RADIXSERVE_TEST_TOKENIZER")
    if given:
        return Path(given)
    from radixserve.model_loader.gguf_loader import gguf_to_hf_folder
    from radixserve.models.loader import embedded_model_path

    return gguf_to_hf_folder(embedded_model_path(), torch.float32)


@pytest.fixture(scope="module")
def real_tokenizer_model(tmp_path_factory) -> Path:
    """A random 2-layer model with SmolLM2's vocabulary, tokenizer and chat template."""
    import shutil

    from transformers import AutoModelForCausalLM, LlamaConfig

    source = _tokenizer_folder()
    folder = tmp_path_factory.mktemp("smol_tok")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(folder))
    return folder


def test_structured_outputs_on_the_gpu(real_tokenizer_model):
    """xgrammar's masks applied to GPU logits: a random model still answers inside the grammar."""
    import jsonschema

    from radixserve import Engine

    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer"}},
              "required": ["answer", "n"], "additionalProperties": False}
    with Engine(str(real_tokenizer_model), dtype="float32", device="cuda", max_total_tokens=4096,
                log_level="warning") as engine:
        picked = engine.generate("Is it?", sampling_params={"regex": "(yes|no)", "max_new_tokens": 8,
                                                           "temperature": 0.0})
        shaped = engine.generate(["Reply in JSON.", "Another."],
                                 sampling_params={"json_schema": json.dumps(schema), "max_new_tokens": 64,
                                                  "temperature": 0.8, "seed": 3})
        assert_engine_conserved(engine)
    assert picked["text"] in ("yes", "no")
    for out in shaped:
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            jsonschema.validate(json.loads(out["text"]), schema)
        else:  # cut at max_new_tokens: still a prefix of some valid answer
            assert out["text"].startswith("{")
