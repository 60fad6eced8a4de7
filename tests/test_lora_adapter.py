"""LoRA units: reading and checking PEFT folders (each malformed case refused with a message naming it), the
identity hash, flags, namespaces, row segments, and dropping an adapter's namespace from the radix tree."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from radixserve.configs.model_config import ModelConfig
from radixserve.lora.adapter import LoraLoadError, load_peft_adapter
from radixserve.lora.layers import group_rows
from radixserve.lora.manager import parse_lora_paths
from radixserve.managers.scheduler_lora import adapter_namespace
from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.radix_cache import RadixCache
from radixserve.mem_cache.radix_key import RadixKey
from radixserve.server_args import ServerArgs

HF = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=48,
          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
          rms_norm_eps=1e-6, rope_theta=10000.0)


@pytest.fixture
def config() -> ModelConfig:
    return ModelConfig.from_hf_dict(HF)


def write_adapter(folder: Path, config: dict | None = None, tensors: dict | None = None, rank: int = 4) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = config if config is not None else {"peft_type": "LORA", "r": rank, "lora_alpha": 8,
                                                "target_modules": ["q_proj", "down_proj"]}
    if tensors is None:
        g = torch.Generator().manual_seed(0)
        prefix = "base_model.model.model.layers"
        tensors = {}
        for layer in range(2):
            tensors[f"{prefix}.{layer}.self_attn.q_proj.lora_A.weight"] = torch.randn(rank, 32, generator=g)
            tensors[f"{prefix}.{layer}.self_attn.q_proj.lora_B.weight"] = torch.randn(32, rank, generator=g)
            tensors[f"{prefix}.{layer}.mlp.down_proj.lora_A.weight"] = torch.randn(rank, 48, generator=g)
            tensors[f"{prefix}.{layer}.mlp.down_proj.lora_B.weight"] = torch.randn(32, rank, generator=g)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_a_good_adapter_reads_with_its_scaling_and_targets(tmp_path, config):
    adapter = load_peft_adapter("a", str(write_adapter(tmp_path / "a")), config, max_rank=8)
    assert adapter.rank == 4 and adapter.scaling == 2.0
    assert adapter.target_modules == ("q_proj", "down_proj")
    assert len(adapter.weights) == 4 and adapter.weights[(1, "down_proj")][0].shape == (4, 48)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": ["q_proj"]}
    rs = load_peft_adapter("b", str(write_adapter(tmp_path / "b", cfg)), config, max_rank=8)
    assert rs.scaling == pytest.approx(4.0)  # NOTE: alpha / sqrt(r)


def test_the_identity_follows_the_content(tmp_path, config):
    one = load_peft_adapter("x", str(write_adapter(tmp_path / "one")), config, 8)
    same = load_peft_adapter("x", str(write_adapter(tmp_path / "same")), config, 8)
    folder = write_adapter(tmp_path / "other")
    tensors = {k: v + 1 for k, v in __import__("safetensors.torch").torch.load_file(
        str(folder / "adapter_model.safetensors")).items()}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    other = load_peft_adapter("x", str(folder), config, 8)
    assert one.content_hash == same.content_hash != other.content_hash
    assert one.namespace_part != other.namespace_part


def _key(layer: int, module: str, half: str) -> str:
    block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{module}.lora_{half}.weight"


@pytest.mark.parametrize("case, match", [
    ("missing_folder", "is neither a PEFT LoRA folder nor a GGUF LoRA adapter file"),
    ("no_weights", "has no adapter_model.safetensors"),
    ("bad_json", "not valid JSON"),
    ("rank_over", "rank 16 is above --max-lora-rank 8"),
    ("target_lacking", r"target module\(s\) embed_tokens"),
    ("lm_head_tensor", "is not a LoRA A/B weight of a decoder layer"),
    ("wrong_shape", r"the model needs A \(4, 32\)"),
    ("half_pair", "without its pair"),
    ("layer_over", "is for layer 5; the model has 2"),
    ("rank_pattern", "rank_pattern"),
    ("dora", "use_dora=true is not supported"),
    ("not_safetensors", "is not a safetensors file"),
    ("bad_rank", "'r' must be a positive integer"),
])
def test_malformed_adapters_are_refused_naming_the_fault(tmp_path, config, case, match):
    folder = tmp_path / case
    base = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    pair = {_key(0, "q_proj", "A"): torch.ones(4, 32), _key(0, "q_proj", "B"): torch.ones(32, 4)}
    if case == "missing_folder":
        pass
    elif case == "no_weights":
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps(base))
    elif case == "bad_json":
        write_adapter(folder)
        (folder / "adapter_config.json").write_text("{not json")
    elif case == "rank_over":
        write_adapter(folder, rank=16)
    elif case == "target_lacking":
        write_adapter(folder, {**base, "target_modules": ["q_proj", "embed_tokens"]})
    elif case == "lm_head_tensor":
        write_adapter(folder, base, {**pair, "base_model.model.lm_head.lora_A.weight": torch.ones(4, 32)})
    elif case == "wrong_shape":
        write_adapter(folder, base, {_key(0, "q_proj", "A"): torch.ones(4, 16), _key(0, "q_proj", "B"): torch.ones(32, 4)})
    elif case == "half_pair":
        write_adapter(folder, base, {_key(0, "q_proj", "A"): torch.ones(4, 32)})
    elif case == "layer_over":
        write_adapter(folder, base, {_key(5, "q_proj", "A"): torch.ones(4, 32), _key(5, "q_proj", "B"): torch.ones(32, 4)})
    elif case == "rank_pattern":
        write_adapter(folder, {**base, "rank_pattern": {"q_proj": 2}}, pair)
    elif case == "dora":
        write_adapter(folder, {**base, "use_dora": True}, pair)
    elif case == "not_safetensors":
        write_adapter(folder, base, pair)
        (folder / "adapter_model.safetensors").write_bytes(b"\x00" * 20)
    elif case == "bad_rank":
        write_adapter(folder, {**base, "r": "eight"}, pair)
    with pytest.raises(LoraLoadError, match=match):
        load_peft_adapter("bad", str(folder), config, max_rank=8)


def test_flags_parse_and_check():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--lora-paths", "a=/x/a", "/y/b", "--max-loras-per-batch", "2"]))
    assert args.lora_paths == ("a=/x/a", "/y/b") and args.lora_enabled and args.max_loras_per_batch == 2
    assert parse_lora_paths(args.lora_paths) == [("a", "/x/a"), ("b", "/y/b")]
    assert not ServerArgs().lora_enabled and ServerArgs(enable_lora=True).lora_enabled
    assert ServerArgs(lora_paths=["a=/x"]).lora_paths == ("a=/x",)
    with pytest.raises(ValueError, match="max_loaded_loras=1 is below max_loras_per_batch=2"):
        ServerArgs(max_loras_per_batch=2, max_loaded_loras=1)
    with pytest.raises(ValueError, match="max_lora_rank must be >= 1"):
        ServerArgs(max_lora_rank=0)


class _Adapter:
    def __init__(self, name: str) -> None:
        self.namespace_part = ("lora", f"{name}@0123")


def test_namespaces_compose_with_the_tenant_first():
    a = _Adapter("a")
    assert adapter_namespace(None, a) == (("lora", "a@0123"),)
    assert adapter_namespace((("api", "k1"), ("salt", "s")), a) == (("api", "k1"), ("salt", "s"), ("lora", "a@0123"))
    assert adapter_namespace("t", a) == (("key", "t"), ("lora", "a@0123"))
    assert adapter_namespace("t", a) != adapter_namespace("t", _Adapter("b")) != adapter_namespace(None, a)


def test_rows_are_grouped_into_segments_per_adapter():
    packed = {"a": "A", "b": "B"}
    segments = group_rows(["a", "a", None, "b", "a"], [3, 2, 4, 1, 2], packed, torch.device("cpu"))
    assert segments[0][1] == "A" and segments[0][0].tolist() == [0, 1, 2, 3, 4, 10, 11]
    assert segments[1] == (slice(9, 10), "B")
    assert group_rows([None, None], [1, 1], packed, torch.device("cpu")) == []


def test_dropping_a_namespace_frees_its_kv_and_keeps_the_others():
    allocator = TokenToKVPoolAllocator(64, "cpu")
    tree = RadixCache(None, allocator)
    free_at_start = allocator.available_size()
    lora = ("lora", "a@0123")
    keys = [((lora,), [1, 2, 3, 4]), ((lora,), [1, 2, 9]), ((("api", "k"), lora), [1, 2]), (None, [1, 2, 3])]
    for ns, tokens in keys:
        slots = allocator.alloc(len(tokens))
        already = tree.insert(RadixKey(tokens, ns), slots)
        allocator.free(slots[:already])  # NOTE: the tree kept its own slots for the part it held
    held = tree.total_size()
    freed = tree.drop_namespaces(lambda key: isinstance(key, tuple) and lora in key)
    assert freed == 4 + 1 + 2 and tree.total_size() == held - freed == 3
    assert tree.evictable_size() == 3 and allocator.available_size() == free_at_start - 3
    assert len(tree.match_prefix(RadixKey([1, 2, 3], None)).device_indices) == 3
    assert len(tree.match_prefix(RadixKey([1, 2, 3], (lora,))).device_indices) == 0
    node = tree.match_prefix(RadixKey([1, 2, 3], None)).last_node
    tree.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="locked"):
        tree.drop_namespaces(lambda key: key is None)
    assert tree.total_size() == 3  # NOTE: refused before anything changed
    tree.dec_lock_ref(node)
