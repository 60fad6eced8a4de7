"""A LoRA adapter read from a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`), checked
against the base model it is meant for.

What PEFT's LoRA means, and what is kept: each targeted linear layer W gains `scaling * B @ A`, with A
[rank, in] and B [out, rank]; `scaling` is `lora_alpha / r` (or `lora_alpha / sqrt(r)` with rslora). The
adapter keeps A and B per (layer, module) in float32 on the host; the packed forms a forward multiplies
with are made from them (lora/layers.py). A llama.cpp GGUF adapter file is read into the same form
(lora/gguf_adapter.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixserve.configs.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The linear layers an adapter may target, as Hugging Face names them.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoraLoadError(ValueError):
    """An adapter that cannot be served (HTTP 400): the message says which file, key or value and why."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter as registered: its name, where it came from, its identity and its A/B weights.

    `content_hash` is over the config and weights files, so a reloaded adapter with other weights gets another
    identity (and so another cache namespace: `namespace_part`)."""

    name: str
    path: str
    rank: int
    alpha: float
    use_rslora: bool
    content_hash: str
    # (layer index, module name) -> (A [rank, in], B [out, rank]), float32 on the host
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def target_modules(self) -> tuple[str, ...]:
        present = {module for _, module in self.weights}
        return tuple(m for m in TARGET_MODULES if m in present)

    @property
    def namespace_part(self) -> tuple[str, str]:
        """The (kind, value) part this adapter adds to a request's cache namespace (radix key `extra_key`)."""
        return ("lora", f"{self.name}@{self.content_hash}")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "rank": self.rank, "alpha": self.alpha,
                "use_rslora": self.use_rslora, "scaling": self.scaling, "target_modules": list(self.target_modules),
                "content_hash": self.content_hash}


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(out_features, in_features) of a target module in `config`'s model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (config.q_size, hidden), "k_proj": (config.kv_size, hidden), "v_proj": (config.kv_size, hidden),
            "o_proj": (hidden, config.q_size), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}[module]


def load_peft_adapter(name: str, path: str, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Reads and checks a PEFT LoRA folder for `config`'s model; raises LoraLoadError naming what is wrong."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoraLoadError(f"LoRA adapter {name!r}: {path!r} is neither a PEFT LoRA folder nor a GGUF LoRA adapter "
                            "file")
    for needed in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / needed).is_file():
            raise LoraLoadError(f"LoRA adapter {name!r}: {path!r} has no {needed} (a PEFT LoRA folder has "
                                f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    config_bytes = (folder / CONFIG_FILE).read_bytes()
    weight_bytes = (folder / WEIGHTS_FILE).read_bytes()
    peft = _read_config(name, config_bytes)
    rank, alpha, rslora = _check_config(name, peft, max_rank)
    weights = _read_weights(name, weight_bytes, config, rank)
    digest = hashlib.sha256(config_bytes + b"\0" + weight_bytes).hexdigest()[:16]
    return LoraAdapter(name, str(folder), rank, alpha, rslora, digest, weights)


def _read_config(name: str, raw: bytes) -> dict[str, Any]:
    try:
        peft = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraLoadError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(peft, dict):
        raise LoraLoadError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    return peft


def _check_config(name: str, peft: dict[str, Any], max_rank: int) -> tuple[int, float, bool]:
    def refuse(why: str) -> LoraLoadError:
        return LoraLoadError(f"LoRA adapter {name!r}: {why}")

    if str(peft.get("peft_type", "LORA")).upper() != "LORA":
        raise refuse(f"peft_type {peft.get('peft_type')!r} is not LORA")
    rank, alpha = peft.get("r"), peft.get("lora_alpha", peft.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise refuse(f"'r' must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise refuse(f"rank {rank} is above --max-lora-rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise refuse(f"'lora_alpha' must be a number, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if peft.get(key):
            raise refuse(f"{key} (per-module ranks or alphas) is not supported")
    for key in ("use_dora", "fan_in_fan_out"):
        if peft.get(key):
            raise refuse(f"{key}=true is not supported")
    if peft.get("bias", "none") != "none":
        raise refuse(f"bias={peft.get('bias')!r} is not supported (only 'none')")
    if peft.get("modules_to_save"):
        raise refuse("modules_to_save (fully trained extra modules) is not supported")
    targets = peft.get("target_modules")
    if isinstance(targets, list):
        lacking = sorted({str(t).rsplit(".", 1)[-1] for t in targets} - set(TARGET_MODULES))
        if lacking:
            raise refuse(f"target module(s) {', '.join(lacking)} are not in the model's LoRA-capable layers "
                         f"({', '.join(TARGET_MODULES)})")
    return rank, float(alpha), bool(peft.get("use_rslora", False))


def _read_weights(name: str, raw: bytes, config: ModelConfig,
                  rank: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    try:
        tensors = load_safetensors(raw)
    except (SafetensorError, ValueError, OSError) as e:
        raise LoraLoadError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is not a safetensors file ({e})") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise LoraLoadError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a decoder layer")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if module not in TARGET_MODULES:
            raise LoraLoadError(f"LoRA adapter {name!r}: tensor {key!r} targets {module!r}, which the model lacks "
                                f"(LoRA-capable: {', '.join(TARGET_MODULES)})")
        if layer >= config.num_layers:
            raise LoraLoadError(f"LoRA adapter {name!r}: tensor {key!r} is for layer {layer}; the model has "
                                f"{config.num_layers}")
        halves.setdefault((layer, module), {})[half] = tensor.float()
    if not halves:
        raise LoraLoadError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return {where: check_pair(name, config, rank, where, pair) for where, pair in sorted(halves.items())}


def check_pair(name: str, config: ModelConfig, rank: int, where: tuple[int, str],
                pair: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    layer, module = where
    if set(pair) != {"A", "B"}:
        raise LoraLoadError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_{''.join(pair)} without its pair")
    out_features, in_features = module_shape(config, module)
    a, b = pair["A"], pair["B"]
    if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
        raise LoraLoadError(f"LoRA adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B "
                            f"{tuple(b.shape)}; the model needs A ({rank}, {in_features}) and B ({out_features}, "
                            f"{rank})")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise LoraLoadError(f"LoRA adapter {name!r}: layer {layer} {module} has non-finite weights")
    return a.contiguous(), b.contiguous()
