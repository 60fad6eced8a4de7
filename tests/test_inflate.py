"""The inflated target of the draft-model benchmark computes its source's function (transformers as the judge)."""

from __future__ import annotations

import json

import pytest
import torch

from radixserve.bench.inflate import InflatedShape, head_placement, inflate

VOCAB = 96


def _source(tmp_path, heads: int = 6, kv_heads: int = 2):
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a wrong scale shows
        for name, w in model.named_parameters():
            if "norm" in name:
                w.uniform_(0.5, 1.5)
    folder = tmp_path / "source"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**config.to_dict(), "radixserve_source": "x"}))
    return model, folder


def _logits(folder, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("heads, kv_heads", [(16, 4), (8, 8), (12, 2)], ids=["wider-groups", "mha", "fewer-kv"])
def test_inflated_model_computes_the_source_function(tmp_path, heads, kv_heads):
    small, folder = _source(tmp_path)
    shape = InflatedShape("t", hidden=96, intermediate=144, layers=3, heads=heads, kv_heads=kv_heads)
    big = inflate(folder, tmp_path / "big", shape, dtype=torch.float32)
    ids = list(range(3, 40, 3))
    with torch.no_grad():
        want = small(torch.tensor([ids])).logits[0]
    got = _logits(big, ids)
    cfg = json.loads((big / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (96, heads, kv_heads)
    assert "radixserve_source" not in cfg
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # the extra weights are really there (a step reads them): random, not zero
    from safetensors import safe_open

    with safe_open(str(big / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.2.mlp.gate_proj.weight").abs().mean() > 1e-3
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight")[-8:].abs().mean() > 1e-3


def test_noise_moves_the_target_away_from_its_source(tmp_path):
    small, folder = _source(tmp_path)
    shape = InflatedShape("t", hidden=96, intermediate=96, layers=2, heads=12, kv_heads=4)
    ids = list(range(5, 30, 2))
    with torch.no_grad():
        want = small(torch.tensor([ids])).logits[0]
    diffs = [(_logits(inflate(folder, tmp_path / f"n{n}", shape, noise=n, dtype=torch.float32), ids) - want)
             .abs().max().item() for n in (0.0, 0.3, 1.0)]
    assert diffs[0] < 1e-4 < diffs[1] < diffs[2]


def test_head_placement_keeps_kv_sharing_or_refuses():
    place, kv = head_placement(9, 3, 24, 8)  # SmolLM2-135M into the benchmark's shape: groups of 3 stay whole
    assert place == list(range(9)) and kv == {0: 0, 1: 1, 2: 2}
    place, kv = head_placement(6, 2, 6, 6)  # MHA: each head gets its own copy of its group's KV head
    assert kv == {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1}
    with pytest.raises(ValueError, match="cannot hold"):
        head_placement(6, 2, 8, 4)  # groups of 2 cannot hold groups of 3 without splitting one across KV heads
    with pytest.raises(ValueError, match="cannot hold"):
        head_placement(6, 2, 4, 2)


def test_inflate_refuses_a_smaller_shape(tmp_path):
    _, folder = _source(tmp_path)
    with pytest.raises(ValueError, match="smaller"):
        inflate(folder, tmp_path / "big", InflatedShape("t", hidden=32, intermediate=144, layers=3, heads=6,
                                                          kv_heads=2), dtype=torch.float32)
