"""`LoraManager`: the adapters of one model runner: which are registered, which are packed, and the rows of
the current forward.

- registry: name -> `LoraAdapter` (host float32 weights and identity), from `--lora-paths` or
  `/load_lora_adapter`; requests name an adapter and the scheduler resolves it here on arrival;
- slots: at most `--max-loaded-loras` adapters packed in the model's dtype on its device, least recently
  used first out; a forward packs what it needs and never evicts one of its own adapters;
- segments: the forward's rows grouped by adapter (lora/layers.py), set by `prepare` just before the model
  runs and cleared after it.

NOTE: the scheduler may register or unregister between steps while the overlap loop's forward runs on its
own stream; the slots are guarded by one lock, and a forward holds its packed adapters by reference.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from radixserve.configs.model_config import ModelConfig
from radixserve.configs.row_table import DEFAULT_ROWS, RowTable
from radixserve.forward_batch import ForwardBatch
from radixserve.lora.adapter import LoraAdapter, LoraLoadError, load_peft_adapter
from radixserve.lora.gguf_adapter import is_gguf_file, load_gguf_adapter
from radixserve.lora.layers import LoraSegments, PackedLora, attach_lora, group_rows, pack_adapter

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


@dataclass(frozen=True)
class LoraLimits:
    max_rank: int
    max_loaded: int  # adapters packed at once (slots)
    max_per_batch: int  # distinct adapters in one running batch (the scheduler keeps it)


def parse_lora_paths(entries: tuple[str, ...]) -> list[tuple[str, str]]:
    """`--lora-paths name=path ...` (a bare path is named after its folder, or its file less `.gguf`)
    -> [(name, path)]."""
    pairs = []
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep:
            path = entry
            name = path.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")
        pairs.append((name, path))
    return pairs


class LoraManager:
    """Registered adapters, their packed slots (LRU) and the current forward's segments."""

    def __init__(self, model: nn.Module, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 limits: LoraLimits, rows: RowTable = DEFAULT_ROWS) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.limits = limits
        self.batch = LoraSegments(kernel=_cpu_kernel(device), rows=rows)  # NOTE: rows: the execution plan's table
        attach_lora(model, self.batch)
        self.registry: dict[str, LoraAdapter] = {}
        self._slots: OrderedDict[str, PackedLora] = OrderedDict()  # by namespace value; oldest use first
        self._lock = threading.Lock()
        self.packs = 0  # adapters packed into a slot so far (a hit reuses one)
        self._out_sizes = {"qkv_proj": (config.q_size, config.kv_size, config.kv_size),
                           "o_proj": (config.hidden_size,),
                           "gate_up_proj": (config.intermediate_size, config.intermediate_size),
                           "down_proj": (config.hidden_size,)}

    # ---- registry -------------------------------------------------------------------------------
    def register(self, name: str, path: str) -> LoraAdapter:
        """Reads, checks and registers an adapter; raises LoraLoadError (nothing changes) when it cannot."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise LoraLoadError(f"LoRA adapter name {name!r} must be 1-128 letters, digits, '_', '.' or '-', "
                                "starting with a letter or digit")
        if name in self.registry:
            raise LoraLoadError(f"LoRA adapter {name!r} is already loaded; unload it first")
        adapter = load_adapter(name, path, self.config, self.limits.max_rank)
        self.registry[name] = adapter
        return adapter

    def unregister(self, name: str) -> LoraAdapter:
        """Forgets an adapter and its slot (the caller checked that no request uses it)."""
        adapter = self.registry.pop(name)
        with self._lock:
            self._slots.pop(adapter.namespace_part[1], None)
        return adapter

    def get(self, name: str) -> LoraAdapter | None:
        return self.registry.get(name)

    def loaded_slots(self) -> list[str]:
        with self._lock:
            return list(self._slots)

    def describe(self) -> list[dict[str, Any]]:
        slots = set(self.loaded_slots())
        return [{**a.describe(), "packed": a.namespace_part[1] in slots} for a in self.registry.values()]

    # ---- a forward ------------------------------------------------------------------------------
    def prepare(self, fb: ForwardBatch) -> None:
        """Sets the forward's segments from its requests' adapters (`fb.lora_adapters`), packing what it needs."""
        adapters = fb.lora_adapters
        if adapters is None:
            self.batch.segments = []
            return
        packed = self._acquire({a.namespace_part[1]: a for a in adapters if a is not None})
        names = [None if a is None else a.namespace_part[1] for a in adapters]
        self.batch.segments = group_rows(names, _row_counts(fb), packed, self.device)

    def finish(self) -> None:
        self.batch.segments = []

    def _acquire(self, wanted: dict[str, LoraAdapter]) -> dict[str, PackedLora]:
        if len(wanted) > self.limits.max_loaded:
            raise RuntimeError(f"a forward needs {len(wanted)} adapters; only {self.limits.max_loaded} fit")
        with self._lock:
            for key in wanted:
                if key in self._slots:
                    self._slots.move_to_end(key)
            for key, adapter in wanted.items():
                if key in self._slots:
                    continue
                # NOTE: evict the least recently used slot that this forward does not need
                while len(self._slots) >= self.limits.max_loaded:
                    victim = next(k for k in self._slots if k not in wanted)
                    del self._slots[victim]
                self._slots[key] = pack_adapter(adapter, self._out_sizes, self.dtype, self.device)
                self.packs += 1
            return {key: self._slots[key] for key in wanted}


def _cpu_kernel(device: torch.device) -> Any:
    """The C LoRA kernel on the CPU (None elsewhere, or where it does not build: torch matmuls then)."""
    if device.type != "cpu":
        return None
    from radixserve.kernels.lora import load_lora_kernel

    return load_lora_kernel()


def load_adapter(name: str, path: str, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """A PEFT folder, or a llama.cpp GGUF adapter file (GGUF magic, or a `.gguf` name, so that a damaged one
    is refused as GGUF)."""
    if is_gguf_file(path) or (str(path).endswith(".gguf") and not Path(path).is_dir()):
        return load_gguf_adapter(name, path, config, max_rank)
    return load_peft_adapter(name, path, config, max_rank)


def _row_counts(fb: ForwardBatch) -> list[int]:
    """Rows of each request in the forward: its new tokens (extend), one (decode), or its verify rows."""
    if fb.forward_mode.is_extend():
        return list(fb.extend_seq_lens_cpu)
    if fb.verify is not None:
        return list(fb.verify.row_counts)
    return [1] * fb.batch_size


__all__ = ["LoraLimits", "LoraLoadError", "LoraManager", "parse_lora_paths"]
