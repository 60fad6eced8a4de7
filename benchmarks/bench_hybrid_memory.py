"""What the hybrid KV pool saves on a sliding-window model, worked out for Gemma 3 270M and measured end to end.

Part 1 (arithmetic, from the config): KV bytes per token with every layer's KV for every token (one pool) and with
the hybrid pool (full layers for every token, window layers for a window pool that is a fraction of it), and how
many 4,000-token requests fit in 1 GiB of KV either way.

Part 2 (measured): the same layer pattern (5 window layers of W = 512, then a full one) on a small random Gemma 3,
through the Engine: `--requests` prompts of `--prompt-len` random tokens and `--new-tokens` greedy tokens each, in
one fixed KV byte budget (`--budget-tokens` tokens of every layer), run with one pool and with the hybrid pool at
each `--ratios` (--swa-full-tokens-ratio), in the normal loop (so the schedule depends on the pools alone). Reported: the pools' tokens, the most requests decoding at once
(`peak_running_reqs`), the wall time, and whether every run produced the same tokens.

    python benchmarks/bench_hybrid_memory.py            # writes the section of docs/benchmarks.md and a plot
"""

from __future__ import annotations

import argparse
import platform as host
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "images" / "hybrid_kv_memory.png"
START, END = "<!-- bench_hybrid_memory:start -->", "<!-- bench_hybrid_memory:end -->"

# Gemma 3 270M, as its GGUF reads (tests/test_gemma3_gguf.py checks these): 18 layers, every 6th full,
# window 512, 1 KV head of dim 256.
GEMMA3_270M = {"layers": 18, "full_every": 6, "window": 512, "kv_heads": 1, "head_dim": 256}


def arithmetic(ratios: list[float], request_len: int, budget_bytes: int, bytes_per_value: int = 2) -> list[str]:
    g = GEMMA3_270M
    per_layer = 2 * g["kv_heads"] * g["head_dim"] * bytes_per_value
    full_layers = g["layers"] // g["full_every"]
    window_layers = g["layers"] - full_layers
    one_pool = per_layer * g["layers"]
    lines = ["| layout | KV bytes per token | full-layer tokens in 1 GiB | window-pool tokens | 4,000-token "
             "requests that fit |", "|---|---:|---:|---:|---:|"]
    tokens = budget_bytes // one_pool
    lines.append(f"| one pool (every layer, every token) | {one_pool:,} | {tokens:,} | (same) | "
                 f"{tokens // request_len} |")
    for ratio in ratios:
        per_token = per_layer * (full_layers + ratio * window_layers)
        full = int(budget_bytes // per_token)
        window = int(full * ratio)
        # NOTE: a decoding request holds its window lock (W - 1) and up to W + 16 of its own window KV
        per_request_window = 2 * g["window"] + 16
        fit = min(full // request_len, window // per_request_window)
        lines.append(f"| hybrid, window pool {ratio:g} of full | {per_token:,.0f} | {full:,} | {window:,} | {fit} |")
    return lines


def write_model(folder: Path, window: int, context: int) -> None:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from radixserve.bench.shapes import _embedded_tokenizer_folder

    tok = _embedded_tokenizer_folder()
    config = Gemma3TextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=context, sliding_window=window,
        layer_types=["sliding_attention"] * 5 + ["full_attention"], eos_token_id=0, bos_token_id=1, pad_token_id=2,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).to(torch.float32).save_pretrained(str(folder))
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok / name).exists():
            shutil.copy(tok / name, folder / name)


def run(folder: Path, options: dict, prompts: list[list[int]], new_tokens: int) -> dict:
    from radixserve import Engine

    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    # NOTE: the normal loop, so that the schedule (and the peak) depends on the pools alone, not on timing
    with Engine(model_path=str(folder), dtype="float32", device="cpu", log_level="warning",
                disable_overlap_schedule=True, **options) as engine:
        started = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - started
        state = engine.get_internal_state()
    assert state["kv_conservation"] is not None and "error" not in state["kv_conservation"], state
    return {"outputs": [o["output_ids"] for o in outs], "wall": wall, "peak": state["peak_running_reqs"],
            "full": state["max_total_num_tokens"], "window": state.get("window_pool_tokens"),
            "retractions": state["num_retractions"]}


def plot(rows: list[tuple[str, dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    names = [name for name, _ in rows]
    ax.barh(names, [r["peak"] for _, r in rows], color=["#999999"] + ["#2a7ab0"] * (len(rows) - 1))
    ax.set_xlabel("requests decoding at once (same KV bytes)")
    ax.invert_yaxis()
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=4000)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--budget-tokens", type=int, default=16_384, help="KV budget, in tokens of every layer")
    parser.add_argument("--ratios", default="0.5,0.15")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    from radixserve.bench.docs import cpu_header, write_doc_section

    ratios = [float(r) for r in args.ratios.split(",")]
    table1 = arithmetic(ratios, 4000 + args.new_tokens, 2**30)
    print("\n".join(table1))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_model(folder, 512, args.prompt_len + args.new_tokens + 64)
        budget_bytes_per_layer_token = args.budget_tokens * 6  # in units of one layer's K+V of one token
        modes = [("one pool", {"max_total_tokens": args.budget_tokens, "disable_hybrid_swa_memory": True})]
        for ratio in ratios:
            modes.append((f"hybrid, ratio {ratio:g}", {"max_total_tokens": int(budget_bytes_per_layer_token
                                                                                // (1 + 5 * ratio)),
                                                        "swa_full_tokens_ratio": ratio}))
        for name, options in modes:
            result = run(folder, options, prompts, args.new_tokens)
            rows.append((name, result))
            print(f"{name}: full {result['full']} window {result['window']} peak {result['peak']} "
                  f"wall {result['wall']:.1f} s retractions {result['retractions']}", file=sys.stderr)
    same = all(r["outputs"] == rows[0][1]["outputs"] for _, r in rows)
    table2 = ["| pool | full-layer tokens | window-pool tokens | most requests decoding at once | wall (s) | "
              "retractions |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in rows:
        table2.append(f"| {name} | {r['full']:,} | {r['window'] or '(same)'} | {r['peak']} | {r['wall']:.1f} | "
                      f"{r['retractions']} |")
    print("\n".join(table2))
    print("same tokens in every run:", same)
    if args.no_docs:
        return
    plot(rows)
    body = "\n".join([
        "## Hybrid KV pool for sliding-window models (`benchmarks/bench_hybrid_memory.py`)", "",
        f"{cpu_header('float32')}; Python {host.python_version()}, torch {torch.__version__}. Command: "
        f"`python benchmarks/bench_hybrid_memory.py --requests {args.requests} --prompt-len {args.prompt_len} "
        f"--new-tokens {args.new_tokens} --budget-tokens {args.budget_tokens} --ratios {args.ratios}`.", "",
        "Gemma 3 270M, worked out from its config (bf16 KV, 1 GiB of KV, requests of 4,000 + "
        f"{args.new_tokens} tokens; a decoding request keeps about 2W + 16 window slots):", "", *table1, "",
        f"Measured through the Engine on a small random Gemma 3 with the same layer pattern (5 window layers of "
        f"W = 512, then a full one): {args.requests} prompts of {args.prompt_len} random tokens, {args.new_tokens} "
        f"greedy tokens each, all in one KV budget of {args.budget_tokens:,} tokens of every layer:", "", *table2, "",
        f"Every run produced the same tokens: {'yes' if same else 'NO'}.", "",
        "![requests decoding at once, one pool vs hybrid](images/hybrid_kv_memory.png)"])
    write_doc_section(DOC, START, END, body)


if __name__ == "__main__":
    main()
