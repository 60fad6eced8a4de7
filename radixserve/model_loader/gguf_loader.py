"""GGUF -> a cached Hugging Face-style folder (config.json, *.safetensors, tokenizer files).

The conversion reads the file with the `gguf` package, dequantises every tensor, undoes the Q/K
row permutation that llama.cpp's converter applies to Llama models (and Gemma's 1 + w in its norm
weights, `gguf_tensor`), and builds the tokenizer and
chat template from the GGUF metadata. The folder lands in the cache (RADIXSERVE_CACHE_DIR, default
~/.cache/radixserve), keyed by the file's path, size, mtime and the compute dtype, so later starts
load safetensors directly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from radixserve import envs
from radixserve.configs.model_config import ModelLoadError
from radixserve.model_loader.gguf_dequant import dequantize

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 2
SHARD_BYTES = 2 << 30
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "gemma3": "Gemma3ForCausalLM"}
# NOTE: llama.cpp permutes Q/K rows only for architectures it runs with "normal" (interleaved) rope.
_PERMUTED_ARCHITECTURES = ("llama",)
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma 3 normalises both sublayers' inputs and outputs: llama.cpp's ffn_norm is its pre-feedforward norm.
_GEMMA3_LAYER_TENSORS = {**_LAYER_TENSORS, "ffn_norm": "pre_feedforward_layernorm",
                         "post_attention_norm": "post_attention_layernorm",
                         "post_ffw_norm": "post_feedforward_layernorm"}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def cache_root() -> Path:
    return envs.CACHE_DIR.get()


def gguf_to_hf_folder(path: Path, dtype: torch.dtype | None) -> Path:
    """The cached folder for this GGUF file and dtype, converting it first if needed.

    dtype None: config and tokenizer only (the packed loader reads the weights from the file itself)."""
    kind = "meta" if dtype is None else str(dtype).removeprefix("torch.")
    folder = cache_root() / f"{path.stem}-{_file_key(path)}-{kind}"
    if (folder / "config.json").exists():
        return folder
    reader = open_gguf(path)
    config = hf_config_from_gguf(reader, path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=folder.parent))
    try:
        logger.info("converting %s to %s (first start only)", path, folder)
        if dtype is not None:
            _write_weights(reader, config, tmp, dtype)
        _write_tokenizer(path, tmp, gguf_architecture_of(config))
        # NOTE: config.json is written last and the folder renamed into place whole, so a folder
        # with a config.json is always complete, even when two processes convert at once.
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        _publish(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def open_gguf(path: Path):
    """A GGUFReader, after checking the magic and that every tensor's bytes lie inside the file."""
    from gguf import GGUFReader

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic at its start)")
    try:
        reader = GGUFReader(path)
    except ValueError as e:
        if "GGMLQuantizationType" in str(e):
            raise ModelLoadError(f"{path} holds a tensor of unknown GGUF type ({e})") from e
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}; is it truncated?") from e
    except Exception as e:  # the reader raises assorted errors on damaged headers
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}; is it truncated?") from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(f"{path} is truncated: tensor {t.name!r} ends at byte {t.data_offset + t.n_bytes}, "
                                 f"the file has {size}")
    return reader


def gguf_field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_config_from_gguf(reader, path: Path) -> dict[str, Any]:
    arch = _gguf_architecture(reader, path)
    get = lambda key, default=None: gguf_field(reader, f"{arch}.{key}", default)  # noqa: E731
    heads = int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise ModelLoadError(f"{path}: per-layer KV head counts are not supported")
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(f"{path}: partial rotary embeddings are not supported")
    names = {t.name for t in reader.tensors}
    config = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(get("vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens", []))),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(get("rope.scaling.type"), get("rope.scaling.factor"), path),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "eos_token_id": [i for i in (gguf_field(reader, "tokenizer.ggml.eos_token_id"),
                                     gguf_field(reader, "tokenizer.ggml.eot_token_id")) if i is not None],
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "radixserve_source": str(path),
    }
    if arch == "gemma3":
        config.update(_gemma3_config(reader, get, head_dim))
    if "rope_freqs.weight" in names:
        tensor = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        factors = dequantize(tensor.data, tensor.tensor_type, (int(tensor.n_elements),), tensor.name)
        config["rope_freq_factors"] = factors.tolist()
    return config


def _gemma3_config(reader, get, head_dim: int) -> dict[str, Any]:
    """What a Gemma 3 config says beyond the Llama keys. llama.cpp's file omits the layer pattern (one full layer
    in six), the window layers' rotary base (10,000) and the query scale (head_dim ** -0.5 for every size but
    27B, whose query_pre_attn_scalar is hidden / heads): it fixes them in code, and so do we."""
    tokens = gguf_field(reader, "tokenizer.ggml.tokens", [])
    eos = [i for i in (gguf_field(reader, "tokenizer.ggml.eos_token_id"),) if i is not None]
    if GEMMA3_END_OF_TURN in tokens:  # NOTE: a chat turn ends with it; transformers' generation config lists it
        eos.append(tokens.index(GEMMA3_END_OF_TURN))
    return {"model_type": "gemma3_text", "sliding_window": int(get("attention.sliding_window", 4096)),
            "sliding_window_pattern": int(get("attention.sliding_window_pattern", 6)),
            "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": head_dim,
            "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": get("final_logit_softcapping"),
            "attn_logit_softcapping": get("attn_logit_softcapping"), "eos_token_id": eos,
            "tie_word_embeddings": True}


GEMMA3_END_OF_TURN = "<end_of_turn>"


def gguf_tensor(arch: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A dequantized GGUF tensor as the Hugging Face checkpoint holds it, under its HF `name`.

    NOTE: llama.cpp stores Gemma's RMSNorm weights as 1 + w; Hugging Face checkpoints (and our GemmaRMSNorm)
    hold w."""
    if arch == "gemma3" and name.endswith("norm.weight"):
        return tensor - 1.0
    return tensor


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """llama.cpp tensor name -> Hugging Face name; None for tensors that are not weights (rope_freqs)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base == "rope_freqs":
        return None
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    parts = base.split(".")
    layer_tensors = _GEMMA3_LAYER_TENSORS if arch == "gemma3" else _LAYER_TENSORS
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{suffix}"
    raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}; radixserve knows Llama/Qwen2/Qwen3/Gemma 3 "
                         "tensor names")


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave of rotary halves (its `permute`), for Q or K weights/biases."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_architecture_of(config: dict[str, Any]) -> str:
    """The GGUF architecture name of a config this module wrote."""
    return next(k for k, v in GGUF_ARCHITECTURES.items() if v == config["architectures"][0])


def _gguf_architecture(reader, path: Path) -> str:
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r}; supported: "
                             f"{', '.join(GGUF_ARCHITECTURES)}")
    return arch


def _rope_scaling(kind: str | None, factor: float | None, path: Path) -> dict[str, Any] | None:
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise ModelLoadError(f"{path}: rope scaling {kind!r} is not supported (only linear)")


def _write_weights(reader, config: dict[str, Any], folder: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    permuted = config["model_type"] in _PERMUTED_ARCHITECTURES
    arch = gguf_architecture_of(config)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    shards: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    for t in reader.tensors:
        name = hf_tensor_name(t.name, arch)
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
        tensor = gguf_tensor(arch, name, dequantize(t.data, t.tensor_type, shape, t.name))
        if permuted and (".q_proj." in name or ".k_proj." in name):
            tensor = unpermute_rows(tensor, heads if ".q_proj." in name else kv_heads)
        shard[name] = tensor.to(dtype).contiguous()
        shard_bytes += shard[name].numel() * shard[name].element_size()
        if shard_bytes >= SHARD_BYTES:
            save_file(shard, folder / f"shard-{len(shards)}.safetensors")
            shards.append(list(shard))
            shard, shard_bytes = {}, 0
    if shard:
        save_file(shard, folder / f"shard-{len(shards)}.safetensors")
        shards.append(list(shard))
    _name_shards_like_transformers(folder, shards)


def _name_shards_like_transformers(folder: Path, shards: list[list[str]]) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors plus an index, so transformers can read it too."""
    if len(shards) == 1:
        os.rename(folder / "shard-0.safetensors", folder / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.rename(folder / f"shard-{i}.safetensors", folder / file)
        weight_map.update(dict.fromkeys(names, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _write_tokenizer(path: Path, folder: Path, arch: str = "llama") -> None:
    from transformers import AutoTokenizer

    # NOTE: read through a link in an empty folder: transformers would otherwise merge in any
    # tokenizer files lying beside the GGUF file.
    source = folder / "gguf-source"
    source.mkdir()
    (source / path.name).symlink_to(path.resolve())
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source), gguf_file=path.name)
    except Exception as e:  # transformers raises many kinds for tokenizers it cannot rebuild
        raise ModelLoadError(f"{path}: cannot build a tokenizer from the GGUF metadata: {e}") from e
    finally:
        shutil.rmtree(source)
    if arch == "gemma3" and not tokenizer.chat_template:
        from radixserve.model_loader.model_folder import GEMMA_CHAT_TEMPLATE

        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE  # NOTE: llama.cpp's Gemma 3 files may carry none
    tokenizer.save_pretrained(str(folder))


def _publish(tmp: Path, folder: Path) -> None:
    try:
        os.rename(tmp, folder)
    except OSError:
        if not (folder / "config.json").exists():
            raise
        # another process finished the same conversion first; its folder is equally good


def _file_key(path: Path) -> str:
    stat = path.stat()
    text = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|v{CONVERTER_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]
