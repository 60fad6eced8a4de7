"""A bigger model that computes what a small one computes: a target for measuring a draft model.

A draft model pays off when it is much cheaper than the served model and agrees with it often. On this machine
there is one real model (the embedded SmolLM2-135M); the random-weight shapes of `shapes.py` share its tokenizer
but not its predictions, so a draft would never be accepted. `inflate` writes a Llama folder of a bigger shape
(wider, more heads, more MLP channels, more layers) whose function is the small model's:

- the residual stream is the small one's in its first `hidden` coordinates and zero in the rest: the embedding is
  padded with zero columns, and the rows of every `o_proj` / `down_proj` past the small width are zero;
- each RMSNorm weight is scaled by sqrt(small / big) and its eps by small / big, so the norm over the padded
  vector equals the small model's norm over the original one (the padded coordinates are zero);
- the small model's query heads sit at target heads whose KV head holds a copy of their small KV head, and the
  columns of `o_proj` (resp. `down_proj`) that read the extra heads (resp. MLP channels) are zero;
- layers past the small model's depth are identities (their `o_proj` and `down_proj` are zero).

Everything else (extra heads, channels, the columns that read the zero coordinates) is seeded random, and a step
reads all of it: the target costs what a model of its shape costs and answers what SmolLM2 answers, up to the
rounding of its dtype. `noise` > 0 writes random values of that relative scale where the extra heads and channels
would otherwise be cut off, so the target drifts away from the draft and acceptance falls: a knob for how well a
draft model agrees with its target.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from radixserve.bench.shapes import copy_tokenizer, publish_folder, read_stamp


@dataclass(frozen=True)
class InflatedShape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int

    def params(self, vocab: int, head_dim: int) -> int:
        """Parameters with tied embeddings."""
        attention = self.hidden * (self.heads + 2 * self.kv_heads) * head_dim + self.heads * head_dim * self.hidden
        return self.layers * (attention + 3 * self.hidden * self.intermediate + 2 * self.hidden) + \
            vocab * self.hidden + self.hidden


# NOTE: about 8x the embedded model's weight bytes, in the ratio of a real draft pair (0.5B for 3-7B, 1B for 8B);
# a bigger shape decodes too slowly on 2 cores to benchmark three workloads in reasonable time.
INFLATED: dict[str, InflatedShape] = {s.name: s for s in (
    InflatedShape("smollm2-1.1b-inflated", hidden=1536, intermediate=6144, layers=30, heads=24, kv_heads=8),
)}


def head_placement(heads: int, kv_heads: int, big_heads: int, big_kv_heads: int) -> tuple[list[int], dict[int, int]]:
    """Where the small model's query heads go in the big one, and which small KV head each used big KV head copies.

    Returns (target head of each small head, {big kv head: small kv head}). Raises ValueError when the big shape
    cannot hold the small one's heads with their KV sharing intact."""
    group, big_group = heads // kv_heads, big_heads // big_kv_heads
    if big_heads < heads or heads % kv_heads or big_heads % big_kv_heads:
        raise ValueError(f"{big_heads}/{big_kv_heads} heads cannot hold {heads}/{kv_heads}")
    if big_group >= group:  # each small KV group fits inside one big group
        place = [(h // group) * big_group + h % group for h in range(heads)]
    else:  # one small group spans several big ones: copy its KV head into each
        place = list(range(heads))
    kv: dict[int, int] = {}
    for h, t in enumerate(place):
        if kv.setdefault(t // big_group, h // group) != h // group or t >= big_heads:
            raise ValueError(f"{big_heads}/{big_kv_heads} heads cannot hold {heads}/{kv_heads}")
    return place, kv


def inflate(source: Path, out: Path, shape: InflatedShape, noise: float = 0.0, seed: int = 0,
            dtype: torch.dtype = torch.bfloat16) -> Path:
    """Writes `shape` computing the function of the Llama folder `source` (float weights, tied embeddings) to `out`;
    a folder already written from the same source, shape, noise, seed and dtype is kept."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((source / "config.json").read_text())
    stamp = {"source": str(source), "shape": asdict(shape), "noise": noise, "seed": seed, "dtype": str(dtype)}
    if (out / "config.json").exists() and read_stamp(out, "inflated.json") == stamp:
        return out
    if config.get("model_type") != "llama" or not config.get("tie_word_embeddings"):
        raise ValueError("inflate reads a Llama model with tied embeddings")
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        small = {k: f.get_tensor(k).float() for k in f.keys()}
    gen = torch.Generator().manual_seed(seed)
    weights = _inflate_weights(small, config, shape, noise, gen)
    big = {**{k: v for k, v in config.items() if k != "radixserve_source"},
           "hidden_size": shape.hidden, "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
           "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
           "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
           "rms_norm_eps": config["rms_norm_eps"] * config["hidden_size"] / shape.hidden,
           "torch_dtype": str(dtype).removeprefix("torch.")}

    def fill(tmp: Path) -> None:
        save_file({k: v.to(dtype).contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        copy_tokenizer(source, tmp)
        (tmp / "inflated.json").write_text(json.dumps(stamp))
        (tmp / "config.json").write_text(json.dumps(big, indent=1))

    return publish_folder(out, fill)


def _inflate_weights(small: dict[str, torch.Tensor], config: dict, shape: InflatedShape, noise: float,
                     gen: torch.Generator) -> dict[str, torch.Tensor]:
    d, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or d // heads
    if shape.hidden < d or shape.intermediate < inter or shape.layers < layers:
        raise ValueError(f"{shape.name} is smaller than the source in some dimension")
    place, kv_of = head_placement(heads, kv_heads, shape.heads, shape.kv_heads)
    norm_scale = math.sqrt(d / shape.hidden)

    def rand(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * std

    def padded_norm(w: torch.Tensor) -> torch.Tensor:
        return torch.cat([w * norm_scale, torch.ones(shape.hidden - d)])

    def heads_view(w: torch.Tensor) -> torch.Tensor:
        return w.view(-1, hd, w.shape[-1])

    out = {"model.embed_tokens.weight": torch.cat(
        [small["model.embed_tokens.weight"], torch.zeros(config["vocab_size"], shape.hidden - d)], dim=1),
        "model.norm.weight": padded_norm(small["model.norm.weight"])}
    std = small["model.layers.0.self_attn.q_proj.weight"].std().item()
    for i in range(shape.layers):
        p, src = f"model.layers.{i}.", (lambda n, i=i: small[f"model.layers.{i}.{n}"]) if i < layers else None
        q = rand(shape.heads * hd, shape.hidden, std)
        k, v = (rand(shape.kv_heads * hd, shape.hidden, std) for _ in range(2))
        o = torch.zeros(shape.hidden, shape.heads * hd)
        gate, up = (rand(shape.intermediate, shape.hidden, std) for _ in range(2))
        down = torch.zeros(shape.hidden, shape.intermediate)
        if noise:  # the extra heads and channels leak into the small model's coordinates
            o[:d] = rand(d, shape.heads * hd, std * noise)
            down[:d] = rand(d, shape.intermediate, std * noise)
        if src is not None:
            for h, t in enumerate(place):
                heads_view(q)[t, :, :d] = heads_view(src("self_attn.q_proj.weight"))[h]
                heads_view(o.T)[t, :, :d] = heads_view(src("self_attn.o_proj.weight").T)[h]
            for t, s in kv_of.items():
                heads_view(k)[t, :, :d] = heads_view(src("self_attn.k_proj.weight"))[s]
                heads_view(v)[t, :, :d] = heads_view(src("self_attn.v_proj.weight"))[s]
            gate[:inter, :d], up[:inter, :d] = src("mlp.gate_proj.weight"), src("mlp.up_proj.weight")
            down[:d, :inter] = src("mlp.down_proj.weight")
            norms = {n: padded_norm(src(n)) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
        else:
            norms = {n: torch.ones(shape.hidden) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
        out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                    p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": o,
                    p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": down,
                    **{p + n: w for n, w in norms.items()}})
    return out
