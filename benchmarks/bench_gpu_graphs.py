"""Decode on a CUDA GPU with CUDA graphs on and off (the Triton backend), beside the memory-bandwidth bound; and
greedy identity of graphs on vs off. Run by scripts/gpu_check.sh; needs no network and no tokenizer files.

Model: seeded random weights in a shape of radixserve/bench/shapes.py (default qwen2.5-0.5b), with a small
word-level tokenizer (prompts are token ids). Decode tokens/s is taken by difference, as benchmarks/bench_gpu.py
does: the same prompts run with --short and --long new tokens, so prefill and start-up cancel out.

Bound: a decode step reads every weight once and each row's KV once, so at HBM bandwidth B a step takes at least
(weight bytes + bs x context x KV bytes per token) / B, and tokens/s <= bs / that. B is the card's datasheet figure
(H100 SXM 3.35 TB/s, H100 PCIe 2.0, H200 4.8; --bandwidth-gbs for others).

    python benchmarks/bench_gpu_graphs.py --batches 1,8,32,128
    python benchmarks/bench_gpu_graphs.py --identity-only
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

DEVICE = "cuda"  # --device cpu: a smoke run of the script itself (graphs are CUDA only: "on" runs eagerly there)
DATASHEET_GBS = (("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("A100-SXM4-80GB", 2039.0),
                 ("A100", 1555.0), ("L40S", 864.0))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-0.5b", help="a shape of radixserve/bench/shapes.py")
    p.add_argument("--work", default="/tmp/radixserve_gpu_graphs")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--short", type=int, default=8)
    p.add_argument("--long", type=int, default=72)
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="default: the card's datasheet figure")
    p.add_argument("--identity-only", action="store_true")
    p.add_argument("--device", default="cuda")
    return p.parse_args()


def write_tokenizer(folder: Path, vocab: int = 256) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1").save_pretrained(str(folder))


def model_folder(name: str, work: Path, dtype: torch.dtype, init_range: float | None = None) -> Path:
    """A random model folder (kept between runs): a ladder shape, or "tiny" (4 layers, float32, wide weights so
    that greedy argmaxes are clear: near-ties could flip between two batch shapes' GEMM algorithms)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from radixserve.bench.shapes import SHAPES, hf_config

    out = work / f"{name}-{str(dtype).removeprefix('torch.')}"
    if (out / "config.json").exists():
        return out
    if name == "tiny":
        config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                             initializer_range=init_range or 0.2, eos_token_id=1, bos_token_id=None)
    else:
        config = hf_config(SHAPES[name], 1, None)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out)
    model.save_pretrained(str(out))
    return out


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def engine(folder: Path, dtype: str, graphs: bool, max_bs: int, **kwargs):
    from radixserve import Engine

    return Engine(model_path=str(folder), dtype=dtype, device=DEVICE, log_level="warning",
                  disable_cuda_graph=not graphs, cuda_graph_max_bs=max_bs, max_running_requests=max_bs, **kwargs)


def timed(fn) -> float:
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def decode_rates(folder: Path, args, batches: list[int], vocab: int, graphs: bool) -> tuple[dict, dict]:
    """Decode tokens/s per batch size, and what the bound needs (weight bytes, KV bytes per token, capture s)."""
    with engine(folder, args.dtype, graphs, max(batches), max_total_tokens=max(batches) * 300) as eng:
        runner = eng.model_runner
        sizes = {"weights": sum(p.numel() * p.element_size() for p in runner.model.parameters()),
                 "kv_per_token": runner._bytes_per_token(),
                 "capture_s": 0.0 if runner.cuda_graphs is None else runner.cuda_graphs.capture_s,
                 "backend": runner.execution_plan.choice("attention backend")}

        def run(batch: int, new: int, salt: int) -> None:
            # NOTE: a salt per run (extra_key) so that no run reads another's prompt from the radix cache
            eng.generate(input_ids=prompts(batch, args.prompt_tokens, vocab, salt), extra_key=f"run{salt}",
                         sampling_params={"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True})
        run(2, 4, -1)  # warm-up
        rates = {}
        for batch in batches:
            short = timed(lambda b=batch: run(b, args.short, 2 * b))
            long = timed(lambda b=batch: run(b, args.long, 2 * b + 1))
            rates[batch] = batch * (args.long - args.short) / (long - short)
    return rates, sizes


def bound(batch: int, context: int, sizes: dict, gbs: float) -> float:
    step_bytes = sizes["weights"] + batch * context * sizes["kv_per_token"]
    return batch * gbs * 1e9 / step_bytes


def identity(work: Path) -> bool:
    """Greedy ids of 24 mixed requests (shared prefixes, lengths 5..300), graphs on vs off, both loops."""
    folder = model_folder("tiny", work, torch.float32)
    g = torch.Generator().manual_seed(1)
    system = torch.randint(2, 4096, (64,), generator=g).tolist()
    reqs = [system[: 8 + 2 * i] + torch.randint(2, 4096, (5 + 12 * i,), generator=g).tolist() for i in range(24)]
    params = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    outs = {}
    for graphs in (True, False):
        for normal in (False, True):
            with engine(folder, "float32", graphs, 16, max_total_tokens=16384, page_size=16,
                        disable_overlap_schedule=normal) as eng:
                outs[graphs, normal] = [r["output_ids"] for r in eng.generate(input_ids=reqs, sampling_params=params)]
                graph_runner = eng.model_runner.cuda_graphs
                replays = graph_runner.replays if graph_runner is not None else 0
            print(f"identity: graphs {'on' if graphs else 'off'}, {'normal' if normal else 'overlap'} loop: "
                  f"{len(reqs)} requests, {replays} graph replays")
    same = all(o == outs[True, False] for o in outs.values())
    print(f"identity: greedy ids {'IDENTICAL' if same else 'DIFFER'} across graphs on/off and both loops")
    return same


def main() -> None:
    global DEVICE
    args = parse_args()
    DEVICE = args.device
    work = Path(args.work)
    same = identity(work)
    if args.identity_only:
        raise SystemExit(0 if same else 1)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    gbs = args.bandwidth_gbs or next((v for key, v in DATASHEET_GBS if key in name), None)
    folder = model_folder(args.shape, work, getattr(torch, args.dtype))
    vocab = min(json.loads((folder / "config.json").read_text())["vocab_size"], 32000)
    batches = [int(b) for b in args.batches.split(",")]
    on, sizes = decode_rates(folder, args, batches, vocab, graphs=True)
    off, _ = decode_rates(folder, args, batches, vocab, graphs=False)
    context = args.prompt_tokens + (args.short + args.long) // 2
    print(f"{name} · torch {torch.__version__} · {args.shape} random weights · {args.dtype} · {sizes['backend']} backend · "
          f"{args.prompt_tokens}-token prompts · graphs captured in {sizes['capture_s']:.1f} s · "
          f"bound at {gbs or '?'} GB/s, {sizes['weights'] / 1e9:.2f} GB of weights, context ~{context}")
    print("| batch | graphs on tok/s | graphs off tok/s | on/off | bandwidth bound tok/s | on / bound |")
    print("|---:|---:|---:|---:|---:|---:|")
    for b in batches:
        cap = bound(b, context, sizes, gbs) if gbs else float("nan")
        print(f"| {b} | {on[b]:.0f} | {off[b]:.0f} | {on[b] / off[b]:.2f}x | {cap:.0f} | {on[b] / cap:.0%} |")
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
