"""Decode and prefill on a CUDA GPU: radixserve's Engine against transformers' `generate` on the same card, in
one run, on random-weight folders of the shape ladder (radixserve/bench/shapes.py) or any model folder.

Decode tokens/s is taken by difference: the same prompts run with `--short` and `--long` new tokens, so prompt
processing and start-up cancel out. transformers runs with its static cache compiled off (its default generate),
greedy, the same prompts and token counts; it is the reference the CUDA path should not fall far behind.

    python benchmarks/bench_gpu.py --shape qwen2.5-0.5b --tokenizer <folder with SmolLM2's tokenizer>
    python benchmarks/bench_gpu.py --model <hf folder> --batches 1,32
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face folder (else --shape is written under --work)")
    p.add_argument("--shape", default="qwen2.5-0.5b", help="a shape of radixserve/bench/shapes.py")
    p.add_argument("--tokenizer", help="a folder with the tokenizer files (default: the embedded SmolLM2's)")
    p.add_argument("--work", default="/tmp/radixserve_gpu_bench")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--short", type=int, default=16)
    p.add_argument("--long", type=int, default=144)
    p.add_argument("--engines", default="radixserve,transformers")
    p.add_argument("--max-total-tokens", type=int, default=200_000, help="radixserve's KV pool (tokens)")
    return p.parse_args()


def model_folder(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from radixserve.bench.shapes import SHAPES, write_folder

    tokenizer = Path(args.tokenizer) if args.tokenizer else None
    return write_folder(SHAPES[args.shape], Path(args.work) / args.shape, tokenizer_folder=tokenizer)


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def radixserve_runs(folder: Path, args, batches: list[int], vocab: int) -> dict[int, tuple[float, float]]:
    from radixserve import Engine

    out = {}
    with Engine(model_path=str(folder), dtype=args.dtype, device="cuda", max_total_tokens=args.max_total_tokens,
                log_level="warning") as engine:
        def run(batch: int, new: int, salt: int) -> None:
            # NOTE: a salt per run (extra_key) so that no run reads another's prompt from the radix cache
            engine.generate(input_ids=prompts(batch, args.prompt_tokens, vocab), extra_key=f"run{salt}",
                            sampling_params={"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True})
        run(2, 8, -1)  # warm-up
        for batch in batches:
            short = timed(lambda b=batch: run(b, args.short, 2 * b))
            long = timed(lambda b=batch: run(b, args.long, 2 * b + 1))
            out[batch] = (short, long)
    return out


def transformers_runs(folder: Path, args, batches: list[int], vocab: int) -> dict[int, tuple[float, float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, args.dtype)).to("cuda").eval()

    @torch.inference_mode()
    def run(batch: int, new: int) -> None:
        ids = torch.tensor(prompts(batch, args.prompt_tokens, vocab), device="cuda")
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)
    run(2, 8)
    return {b: (timed(lambda b=b: run(b, args.short)), timed(lambda b=b: run(b, args.long))) for b in batches}


def main() -> None:
    import json

    args = parse_args()
    folder = model_folder(args)
    vocab = min(json.loads((folder / "config.json").read_text())["vocab_size"], 49152)
    batches = [int(b) for b in args.batches.split(",")]
    runners = {"radixserve": radixserve_runs, "transformers": transformers_runs}
    results = {name: runners[name](folder, args, batches, vocab) for name in args.engines.split(",")}
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · {folder.name} · {args.dtype} · "
          f"{args.prompt_tokens}-token prompts")
    print(f"| engine | batch | prefill+{args.short} tok (s) | decode tok/s |")
    print("|---|---:|---:|---:|")
    for name, runs in results.items():
        for batch, (short, long) in runs.items():
            rate = batch * (args.long - args.short) / (long - short)
            print(f"| {name} | {batch} | {short:.3f} | {rate:.0f} |")


if __name__ == "__main__":
    main()
