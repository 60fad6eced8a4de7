"""A LoRA adapter read from a llama.cpp GGUF adapter file (what llama.cpp's `--lora` takes), checked against
the base model like a PEFT folder (lora/adapter.py) and kept in the same form.

The format, as llama.cpp's converter writes it from a PEFT folder and its loader reads it:

- metadata `general.type = "adapter"`, `adapter.type = "lora"`, `adapter.lora.alpha` (float32) and
  `general.architecture` (the base model's GGUF architecture);
- per targeted weight two tensors named after the base GGUF's tensor plus a suffix:
  `blk.<i>.attn_q.weight.lora_a` and `.lora_b`; in row-major (numpy/torch) terms lora_a is A [rank, in]
  and lora_b is B [out, rank], PEFT's own layout (GGUF lists dims fastest-first: ne = [in, rank] and
  [rank, out]);
- the scale is `alpha / rank`, or 1 where alpha is 0 (llama.cpp's rule); rank is the tensors'. rsLoRA is
  not a field: a converted rsLoRA adapter carries an alpha that gives its scale;
- for the `llama` architecture llama.cpp's converter permutes the rows of Q and K per head (its rope
  layout), and for an adapter it permutes B of q/k the same way (the output side; A is the input side).
  The base GGUF loader undoes that for the base weights (model_loader/gguf_loader.py, `unpermute_rows`); here it
  is undone for B, so A and B end up in the Hugging Face layout the model runs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from radixserve.configs.model_config import ModelConfig, ModelLoadError
from radixserve.lora.adapter import TARGET_MODULES, LoraAdapter, LoraLoadError, check_pair

GGUF_MAGIC = b"GGUF"
# llama.cpp's per-layer tensor name -> the target module it is
_GGUF_MODULES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
                 "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_HALVES = {"lora_a": "A", "lora_b": "B"}


def is_gguf_file(path: str) -> bool:
    """A file that starts with the GGUF magic (what `--lora-paths`, the Engine and the API take as a GGUF
    adapter; a folder is a PEFT adapter)."""
    file = Path(path)
    if not file.is_file():
        return False
    with open(file, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def load_gguf_adapter(name: str, path: str, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Reads and checks a llama.cpp GGUF LoRA adapter for `config`'s model; raises LoraLoadError naming what is
    wrong. The content hash is over the file's bytes."""
    from radixserve.model_loader.gguf_loader import GGUF_ARCHITECTURES, gguf_field, open_gguf

    def refuse(why: str) -> LoraLoadError:
        return LoraLoadError(f"LoRA adapter {name!r}: {path!r}: {why}")

    file = Path(path)
    if not file.is_file():
        raise refuse("no such file")
    try:
        reader = open_gguf(file)
    except ModelLoadError as e:
        raise LoraLoadError(f"LoRA adapter {name!r}: {e}") from None
    kind, adapter_type = gguf_field(reader, "general.type"), gguf_field(reader, "adapter.type")
    if kind != "adapter":
        raise refuse(f"general.type is {kind!r}, not 'adapter' (a model file, not a LoRA adapter?)")
    if adapter_type != "lora":
        raise refuse(f"adapter.type is {adapter_type!r}, not 'lora'")
    alpha = gguf_field(reader, "adapter.lora.alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not torch.isfinite(torch.tensor(alpha)):
        raise refuse(f"adapter.lora.alpha must be a number, got {alpha!r}")
    arch = gguf_field(reader, "general.architecture")
    if GGUF_ARCHITECTURES.get(arch) != config.architecture:
        raise refuse(f"the adapter is for GGUF architecture {arch!r}; the model is {config.architecture}")
    halves = _read_tensors(refuse, reader, config)
    ranks = {pair["A"].shape[0] for pair in halves.values() if "A" in pair}
    if len(ranks) != 1:
        raise refuse(f"lora_a tensors of several ranks {sorted(ranks)}; one rank per adapter is served")
    rank = ranks.pop()
    if rank > max_rank:
        raise refuse(f"rank {rank} is above --max-lora-rank {max_rank}")
    if arch == "llama":  # NOTE: the permuted architectures of gguf_loader: undo the converter's q/k row order
        _unpermute_b(halves, config)
    weights = {where: check_pair(name, config, rank, where, pair) for where, pair in sorted(halves.items())}
    digest = hashlib.sha256(file.read_bytes()).hexdigest()[:16]
    scale_alpha = float(alpha) if alpha else float(rank)  # NOTE: llama.cpp: alpha 0 means a scale of 1
    return LoraAdapter(name, str(file), rank, scale_alpha, False, digest, weights)


def _read_tensors(refuse, reader, config: ModelConfig) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    from radixserve.model_loader.gguf_dequant import dequantize

    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        base, _, suffix = t.name.rpartition(".")
        parts = base.split(".")
        if suffix not in _HALVES or len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight" \
                or not parts[1].isdigit():
            raise refuse(f"tensor {t.name!r} is not a LoRA lora_a/lora_b tensor of a decoder layer's weight")
        layer, module = int(parts[1]), _GGUF_MODULES.get(parts[2])
        if module is None:
            raise refuse(f"tensor {t.name!r} targets {parts[2]!r}, which the model lacks (LoRA-capable: "
                         f"{', '.join(TARGET_MODULES)})")
        if layer >= config.num_layers:
            raise refuse(f"tensor {t.name!r} is for layer {layer}; the model has {config.num_layers}")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # NOTE: GGUF lists dims fastest-first
        if len(shape) != 2:
            raise refuse(f"tensor {t.name!r} has {len(shape)} dimensions; LoRA A and B have 2")
        try:
            tensor = dequantize(t.data, t.tensor_type, shape, t.name).float()
        except ModelLoadError as e:
            raise refuse(str(e)) from None
        halves.setdefault((layer, module), {})[_HALVES[suffix]] = tensor
    if not halves:
        raise refuse("the file holds no LoRA tensors")
    return halves


def _unpermute_b(halves: dict[tuple[int, str], dict[str, torch.Tensor]], config: ModelConfig) -> None:
    """B of q_proj/k_proj back to the Hugging Face row order (where its shape is right; check_pair refuses
    the rest)."""
    from radixserve.model_loader.gguf_loader import unpermute_rows

    for (_, module), pair in halves.items():
        if module not in ("q_proj", "k_proj") or "B" not in pair:
            continue
        heads, rows = (config.num_heads, config.q_size) if module == "q_proj" else (config.num_kv_heads,
                                                                                   config.kv_size)
        if pair["B"].shape[0] == rows and rows % (2 * heads) == 0:
            pair["B"] = unpermute_rows(pair["B"], heads).contiguous()
