"""A new architecture is its layers and nothing else (models/causal_lm.py): a toy parallel-block model, registered
with `register_model`, runs through the Engine from a Hugging Face folder and decodes what a plain-torch reference
of the same block decodes. And the built-in models keep the contract the runner relies on."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_model_support import assert_engine_conserved, make_tiny_model, one_torch_thread
from torch import nn

from radixserve.configs.model_config import ModelConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.layers.layernorm import RMSNorm
from radixserve.models.causal_lm import CausalLM
from radixserve.models.llama import LlamaDecoderLayer

pytestmark = pytest.mark.slow
_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)
TOY = "ToyParallelForCausalLM"


class ToyModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # NOTE: Llama's layer modules (attention, MLP, two norms) under Llama's names; the toy runs them its own way
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class ToyParallelForCausalLM(CausalLM):
    """GPT-J's parallel block on Llama's parts: x + attention(norm1(x)) + MLP(norm2(x)). Its layers and final norm are
    all it defines; the forward, the logits and checkpoint loading are the base's."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, ToyModel(config))

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor,
                   fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        for layer in self.model.layers:
            hidden = (hidden + layer.self_attn(layer.input_layernorm(hidden), cos, sin, fb)
                      + layer.mlp(layer.post_attention_layernorm(hidden)))
        return hidden, None

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.model.norm(hidden)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


@torch.inference_mode()
def _reference_logits(state: dict[str, torch.Tensor], hf: dict, ids: list[int]) -> torch.Tensor:
    """The toy block in plain torch over the checkpoint's tensors, the whole sequence at once: last logits."""
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    dim, eps, n = hf["hidden_size"] // heads, hf["rms_norm_eps"], len(ids)
    theta = hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"]
    pos = torch.arange(n)
    x = state["model.embed_tokens.weight"][ids]
    mask = torch.full((n, n), float("-inf")).triu(1)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, state[p + "input_layernorm.weight"], eps)
        q = _rotate((h @ state[p + "self_attn.q_proj.weight"].T).view(n, heads, dim), pos, theta)
        k = _rotate((h @ state[p + "self_attn.k_proj.weight"].T).view(n, kv_heads, dim), pos, theta)
        v = (h @ state[p + "self_attn.v_proj.weight"].T).view(n, kv_heads, dim)
        k, v = (t.repeat_interleave(heads // kv_heads, 1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim) + mask
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * dim)
        m = _rms(x, state[p + "post_attention_layernorm.weight"], eps)
        mlp = (torch.nn.functional.silu(m @ state[p + "mlp.gate_proj.weight"].T) * (m @ state[p + "mlp.up_proj.weight"].T))
        x = x + attn @ state[p + "self_attn.o_proj.weight"].T + mlp @ state[p + "mlp.down_proj.weight"].T
    head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    return _rms(x[-1], state["model.norm.weight"], eps) @ head.T


def test_a_registered_toy_architecture_runs_through_the_engine(tmp_path):
    from safetensors.torch import load_file

    from radixserve import Engine
    from radixserve.models.registry import _REGISTERED, register_model

    make_tiny_model(tmp_path, "llama", seed=3)  # NOTE: Llama's tensor names: the toy's parameters have the same
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = [TOY]
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = {k: v.float() for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    with pytest.raises(Exception, match="unsupported model architecture"):
        Engine(model_path=str(tmp_path), dtype="float32", log_level="error")
    with pytest.raises(TypeError, match="not a CausalLM"):
        register_model("NotAModel", nn.Linear)
    register_model(TOY, ToyParallelForCausalLM)
    try:
        engine = Engine(model_path=str(tmp_path), dtype="float32", log_level="error")
        try:
            assert type(engine.model_runner.model) is ToyParallelForCausalLM
            # NOTE: no weight view: the plan runs its layers in Python and says why
            assert not engine.model_runner.device_setup.c_decoder
            prompts = [[5, 17, 33, 9, 120, 64], [200, 3, 3, 41]]
            outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                        "ignore_eos": True})
            for prompt, out in zip(prompts, outs, strict=True):
                ids = list(prompt)
                for token in out["output_ids"]:
                    logits = _reference_logits(state, config, ids)
                    top2 = logits.topk(2).values
                    # NOTE: the engine's token is the reference's argmax, unless the two best are a float32 tie
                    assert token == int(logits.argmax()) or float(top2[0] - top2[1]) < 1e-4, (prompt, ids, token)
                    ids.append(token)
            assert_engine_conserved(engine)
        finally:
            engine.shutdown()
    finally:
        _REGISTERED.pop(TOY, None)


def test_the_built_in_models_are_causal_lms_with_their_own_parts_only():
    """Each definition is a CausalLM and overrides only the parts an architecture supplies: the forward, the
    logits and checkpoint loading are written once."""
    from radixserve.models.gemma2 import Gemma2ForCausalLM
    from radixserve.models.gemma3 import Gemma3ForCausalLM
    from radixserve.models.llama import LlamaForCausalLM

    shared = {"forward", "logits", "load_weights", "_target_of", "_shard_range", "_check_complete", "tie_weights",
              "set_decoder"}
    for cls in (LlamaForCausalLM, Gemma3ForCausalLM, Gemma2ForCausalLM):
        assert issubclass(cls, CausalLM)
        own = {name for klass in cls.__mro__[: cls.__mro__.index(CausalLM)] for name in vars(klass)}
        assert not own & shared, (cls.__name__, own & shared)
        assert {"run_layers", "final_norm"} <= {n for k in cls.__mro__[: cls.__mro__.index(CausalLM)] for n in vars(k)}
