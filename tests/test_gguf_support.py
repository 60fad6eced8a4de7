"""Helpers for the GGUF tests (no tests here): write a tiny HF model as a llama.cpp-style GGUF file.

Written from the GGUF conventions, independently of radixserve's loader: llama.cpp tensor names,
dims listed fastest-first, and for the llama architecture Q/K rows permuted per head the way
llama.cpp's converter does it.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType
HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{suffix}"


def byte_level_tokens(n: int) -> list[str]:
    """The first n symbols of GPT-2's byte-to-unicode alphabet: a valid byte-level BPE vocabulary."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars[:n]


def write_gguf(path: Path, hf_model, arch: str, quantize: dict[str, Q] | None = None,
               override_arch: str | None = None) -> dict[str, torch.Tensor]:
    """Writes `hf_model` (vocab 256) to `path`. `quantize` maps a substring of HF names to a GGUF type.

    Returns the HF state dict as the file holds it after quantisation round trips, for references.
    """
    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), override_arch or arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(byte_level_tokens(cfg.vocab_size))
    writer.add_token_types([1] * cfg.vocab_size)
    writer.add_token_merges([])
    writer.add_token_scores([0.0] * cfg.vocab_size)  # with no merges, transformers derives them from scores
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    stored = {}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.float().numpy()
        qtype = next((t for key, t in (quantize or {}).items() if key in name), Q.F32)
        if qtype != Q.F32:
            raw = gguf.quants.quantize(w, qtype)
            w = gguf.quants.dequantize(raw, qtype)
        stored[name] = torch.from_numpy(w.copy())
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            w_file = llama_cpp_permute(w, heads)
            raw = gguf.quants.quantize(w_file, qtype) if qtype != Q.F32 else w_file
        elif qtype == Q.F32:
            raw = w
        writer.add_tensor(gguf_name(name), raw, raw_dtype=qtype if qtype != Q.F32 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored
