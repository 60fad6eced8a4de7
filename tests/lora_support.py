"""Helpers for the LoRA tests (no tests here): PEFT adapters with seeded random A and B on a Hugging Face
model, saved as PEFT folders, and the merged model each stands for (PEFT's `merge_and_unload`); a PEFT folder
rewritten as a llama.cpp-style GGUF LoRA adapter file."""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from test_model_support import make_tiny_model


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    targets: tuple[str, ...]
    seed: int
    alpha: float = 16.0
    rslora: bool = False


# Several ranks and target sets; together they cover all seven target modules and rslora.
SPECS = (
    AdapterSpec("sql", 4, ("q_proj", "v_proj", "down_proj"), seed=11),
    AdapterSpec("chat", 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), seed=12),
    AdapterSpec("code", 2, ("o_proj", "gate_proj", "up_proj"), seed=13, alpha=4.0),
    AdapterSpec("math", 16, ("k_proj", "up_proj"), seed=14, alpha=8.0, rslora=True),
)


def make_peft_adapter(base, folder: Path, spec: AdapterSpec, b_scale: float = 1.0) -> torch.nn.Module:
    """Saves a LoRA adapter of `spec` for HF model `base` (left unchanged) to `folder`; returns the merged
    float32 model it stands for. B is random too (PEFT's default init leaves B zero: no effect to test);
    `b_scale` shrinks it (a real model's adapter moves its logits, it does not drown them)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(spec.seed)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                        use_rslora=spec.rslora, init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(copy.deepcopy(base), config)
    if b_scale != 1.0:
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.mul_(b_scale)
    peft_model.save_pretrained(str(folder))
    return peft_model.merge_and_unload().eval()


def tiny_peft_models(tmp_path_factory) -> tuple[Path, torch.nn.Module, dict[str, torch.nn.Module]]:
    """The tests' shared fixture (module scope, `models` in the test files): a tiny random Llama saved under
    `<root>/base` and one PEFT folder per spec of SPECS under `<root>/<name>`; returns (root, the base HF model,
    name -> the merged float32 model each adapter stands for)."""
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model(root / "base", "llama")
    merged = {spec.name: make_peft_adapter(base, root / spec.name, spec) for spec in SPECS}
    return root, base, merged


@torch.inference_mode()
def hf_greedy(model, token_ids: list[int], steps: int) -> list[int]:
    """Greedy continuation by plain forwards on the model's device (no EOS stop, no cache): the reference tokens."""
    ids = list(token_ids)
    device = next(model.parameters()).device
    for _ in range(steps):
        ids.append(int(model(input_ids=torch.tensor([ids], device=device)).logits[0, -1].argmax()))
    return ids[len(token_ids):]


_GGUF_MODULES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                 "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def write_gguf_adapter(folder: Path, path: Path, hf_config, arch: str = "llama", alpha: float | None = None,
                       general_type: str = "adapter", adapter_type: str = "lora",
                       edit=None) -> None:
    """The PEFT folder's adapter as llama.cpp's converter writes it, from the format's conventions: tensors
    `blk.<i>.<base tensor>.weight.lora_a` (A [rank, in]) and `.lora_b` (B [out, rank]), B of q/k permuted per
    head for the llama architecture, `adapter.lora.alpha` such that alpha / rank is PEFT's scaling (an rsLoRA
    adapter's alpha is converted). `alpha` overrides it (None: write none when `edit` says so); `edit(name,
    array) -> array | None` changes or drops a tensor, for malformed files."""
    import gguf
    from safetensors.torch import load_file
    from test_gguf_support import llama_cpp_permute

    peft = json.loads((folder / "adapter_config.json").read_text())
    rank = peft["r"]
    scaling = peft["lora_alpha"] / (math.sqrt(rank) if peft.get("use_rslora") else rank)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(general_type)
    writer.add_string("adapter.type", adapter_type)
    if alpha is None and edit is None:
        alpha = scaling * rank
    if alpha is not None:
        writer.add_float32("adapter.lora.alpha", float(alpha))
    for key, tensor in sorted(load_file(str(folder / "adapter_model.safetensors")).items()):
        match = re.search(r"layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight$", key)
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        array = tensor.float().numpy()
        if half == "B" and arch == "llama" and module in ("q_proj", "k_proj"):
            heads = hf_config.num_attention_heads if module == "q_proj" else hf_config.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        name = f"blk.{layer}.{_GGUF_MODULES[module]}.weight.lora_{half.lower()}"
        if edit is not None:
            array = edit(name, array)
        if array is not None:
            writer.add_tensor(name, array.copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
