"""Forward-pass throughput: radixserve's model runner before/after the CPU fast path, and transformers.

Paths (--paths): `before` is the old code path, through its switches (`--linear-method dense
--disable-fused-ops`: F.linear and eager elementwise torch); `after` is the default (linear methods
chosen per shape, fused compiled ops); `onednn` is `after` with oneDNN for every linear layer (no
GEMV kernel for decode's few rows); `python-layers` is `after` with decode's decoder layers called one
op at a time from Python (RADIXSERVE_DECODE_STEP=0) instead of in one C call (models/c_decoder.py).
The runners and transformers load the same weights.
Prefill: one prompt of --prefill-len tokens (logits of the last token only, as generate does).
Decode: batches of --batches requests, each with --context tokens of context, --steps steps per
round. The decode context is filled with random K/V (decode cost does not depend on the values),
written through our allocator into each runner's pool and into a transformers DynamicCache of the
same shape. Rounds alternate between the engines, so load from other processes hits all alike; the
table shows the median round. --profile adds where each path's time goes (forward_profile.py).

    python benchmarks/bench_forward.py                   # prints the table, updates docs/benchmarks.md
    python benchmarks/bench_forward.py --profile         # also the profile tables, against GEMM peak and bandwidth
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from direct import DirectDriver, DirectRequest
from forward_profile import (
    StepProfile,
    instrument,
    linear_flops,
    machine_limits,
    profile_step,
    render_profiles,
)

from radixserve.bench.docs import cpu_header, write_doc_section
from radixserve.bench.timing import median_times
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "bench_forward.png"
BEGIN, END = "<!-- bench_forward:begin -->", "<!-- bench_forward:end -->"
PATHS = {"before": {"linear_method": "dense", "disable_fused_ops": True}, "after": {},
         "onednn": {"linear_method": "onednn"},  # `after` without our decode kernels (layers/gemv.py)
         "python-layers": {"env": {"RADIXSERVE_DECODE_STEP": "0"}}}  # `after` without the C decoder
HF = "transformers"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto: what --dtype auto picks on this CPU (radixserve.platform.choose_dtype)")
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--steps", type=int, default=8, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--paths", default="before,after",
                   help="our code paths to measure: before, onednn, python-layers, after")
    p.add_argument("--backend", default="cpu", help="our attention backend (cpu: C kernels; torch)")
    p.add_argument("--only-ours", action="store_true", help="skip transformers (no comparison columns)")
    p.add_argument("--threads", default="", help="torch thread counts to run, e.g. 1,2 (default: torch's)")
    p.add_argument("--profile", action="store_true", help="profile tables of each path (1 thread)")
    p.add_argument("--no-docs", action="store_true", help="do not touch docs/")
    return p.parse_args()


def build_engines(args: argparse.Namespace) -> tuple[dict[str, ModelRunner], object | None, list[int]]:
    from radixserve.model_loader.gguf_loader import gguf_to_hf_folder

    batches = [int(b) for b in args.batches.split(",")]
    pool = max(batches) * (args.context + args.steps + 2) + args.prefill_len + 64
    runners = {}
    for path in args.paths.split(","):
        options = dict(PATHS[path])
        env = options.pop("env", {})
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)  # NOTE: read while the runner sets the model up, restored after
        try:
            server_args = ServerArgs(model_path=args.model_path, dtype=args.dtype, max_total_tokens=pool,
                                     attention_backend=args.backend, **options)
            runners[path] = ModelRunner(server_args)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    hf = None
    if not args.only_ours:
        from transformers import AutoModelForCausalLM

        first = next(iter(runners.values()))
        source = Path(first.loaded.source)
        folder = gguf_to_hf_folder(source, first.dtype) if source.is_file() else source
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=first.dtype).eval()
    return runners, hf, batches


def time_rounds(fns: dict[str, callable], rounds: int) -> dict[str, float]:
    """Median seconds per call of each fn, calls interleaved round by round."""
    return median_times(fns, rounds)


def prefill_prompt(runner: ModelRunner, length: int) -> list[int]:
    return torch.randint(10, runner.model_config.vocab_size, (length,),
                         generator=torch.Generator().manual_seed(0)).tolist()


def bench_prefill(runners: dict[str, ModelRunner], hf, args: argparse.Namespace) -> dict[str, float]:
    prompt = prefill_prompt(next(iter(runners.values())), args.prefill_len)
    fns = {}
    for path, runner in runners.items():
        driver = DirectDriver(runner)

        def ours(driver: DirectDriver = driver) -> None:
            req = driver.new_request()
            driver.extend([req], [prompt])
            driver.release([req])

        fns[path] = ours
    if hf is not None:
        def theirs() -> None:
            with torch.inference_mode():
                hf(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)

        fns[HF] = theirs
    seconds = time_rounds(fns, max(3, args.rounds // 2))
    return {name: args.prefill_len / s for name, s in seconds.items()}


def fill_context(runners: dict[str, ModelRunner], hf, batch: int, context: int):
    """`batch` requests with `context` random K/V tokens each, in every runner's pool (and a transformers
    DynamicCache). Returns {path: (driver, requests)} and the cache (None without transformers)."""
    first = next(iter(runners.values()))
    cfg = first.model_config
    cache = None
    if hf is not None:
        from transformers import DynamicCache

        cache = DynamicCache(config=hf.config)
    filled = {path: _requests_with_context(runner, batch, context) for path, runner in runners.items()}
    g = torch.Generator().manual_seed(batch)
    shape = (batch, cfg.num_kv_heads, context, cfg.head_dim)
    for layer in range(cfg.num_layers):
        k = torch.randn(shape, generator=g).to(first.dtype)
        v = torch.randn(shape, generator=g).to(first.dtype)
        if cache is not None:
            cache.update(k, v, layer)
        for path, (_, reqs) in filled.items():
            runner = runners[path]
            for i, req in enumerate(reqs):
                slots = runner.req_to_token_pool.req_to_token[req.row, :context].long()
                runner.token_to_kv_pool.set_kv_buffer(layer, slots, k[i].transpose(0, 1), v[i].transpose(0, 1))
    return filled, cache


def _requests_with_context(runner: ModelRunner, batch: int, context: int) -> tuple[DirectDriver, list[DirectRequest]]:
    driver = DirectDriver(runner)
    reqs = [driver.new_request() for _ in range(batch)]
    for req in reqs:
        slots = runner.token_to_kv_pool_allocator.alloc_extend([0], [context], [-1], context)
        driver._assign(req, 0, [11] * context, slots)
    return driver, reqs


def truncate(driver: DirectDriver, reqs: list[DirectRequest], context: int) -> None:
    """Drops the decode steps of a round: frees their slots, keeps the first `context` tokens."""
    for req in reqs:
        kept, dropped = req.owned[:1], req.owned[1:]
        if dropped:
            driver.runner.token_to_kv_pool_allocator.free(torch.cat(dropped))
        req.owned, req.token_ids = kept, req.token_ids[:context]


def bench_decode(runners: dict[str, ModelRunner], hf, batch: int, args: argparse.Namespace) -> dict[str, float]:
    filled, cache = fill_context(runners, hf, batch, args.context)
    tokens = [17] * batch
    fns = {}
    for path, (driver, reqs) in filled.items():
        def ours(driver: DirectDriver = driver, reqs: list[DirectRequest] = reqs) -> None:
            for _ in range(args.steps):
                driver.decode(reqs, tokens)
            truncate(driver, reqs, args.context)

        fns[path] = ours
    if hf is not None:
        def theirs() -> None:
            with torch.inference_mode():
                for _ in range(args.steps):
                    hf(input_ids=torch.tensor([[17]] * batch), past_key_values=cache, use_cache=True)
            cache.crop(-args.steps)

        fns[HF] = theirs
    seconds = time_rounds(fns, args.rounds)
    for driver, reqs in filled.values():
        driver.release(reqs)
    return {name: batch * args.steps / s for name, s in seconds.items()}


def profile_paths(runners: dict[str, ModelRunner], args: argparse.Namespace) -> list[StepProfile]:
    """Prefill of --prefill-len tokens and one decode step at each batch size, per path, 1 thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    profiles = []
    try:
        profiles += [profile_prefill(path, runner, args.prefill_len) for path, runner in runners.items()]
        for batch in sorted({int(b) for b in args.batches.split(",")}):
            filled, _ = fill_context(runners, None, batch, args.context)
            for path, (driver, reqs) in filled.items():
                def step(driver: DirectDriver = driver, reqs: list[DirectRequest] = reqs) -> None:
                    driver.decode(reqs, [17] * len(reqs))

                def reset(driver: DirectDriver = driver, reqs: list[DirectRequest] = reqs) -> None:
                    truncate(driver, reqs, args.context)

                flops = linear_flops(runners[path].model, batch, batch)
                with instrument(runners[path]):
                    profiles.append(profile_step(f"decode bs={batch} ctx={args.context}", path, step, flops,
                                                 repeats=5, reset=reset))
                driver.release(reqs)
    finally:
        torch.set_num_threads(threads)
    return profiles


def profile_prefill(path: str, runner: ModelRunner, length: int) -> StepProfile:
    driver = DirectDriver(runner)
    prompt = prefill_prompt(runner, length)
    held: list[DirectRequest] = []

    def prefill() -> None:
        held.append(driver.new_request())
        driver.extend(held[-1:], [prompt])

    def release() -> None:
        driver.release([held.pop()])

    with instrument(runner):
        return profile_step(f"prefill {length}", path, prefill, linear_flops(runner.model, length, 1), reset=release)


Row = tuple[str, int, dict[str, float]]  # workload, threads, tokens/s per engine
NOTES = """`before` is the code path before the CPU fast path, through its switches: every linear layer
in `F.linear` (in bf16 on the CPU it reorders the weight on every call) and the passes between the
matrix products as separate eager torch ops. `after` is the default: each weight shape runs the
linear method that measured fastest here (in bf16 on this CPU `onednn_gemv`: our AMX kernel up to 32
rows, oneDNN's prepacked layout above; layers/linear_tuning.py, layers/gemv.py), and residual add +
RMSNorm, rotary + KV write and SiLU-and-mul run as compiled ops (AOTInductor; layers/fused_ops.py),
and a decode batch of up to 32 rows runs all decoder layers in one C call (models/c_decoder.py).
`onednn` is `after` with oneDNN for every linear layer; `python-layers` is `after` with a decode
batch's layers run op by op from Python instead of in one C call (models/c_decoder.py). Attention is the same in every path (the CPU
backend's kernels: on this CPU AMX tiles for bf16 prefill, the C decode kernel), so this table does not
show it; benchmarks/bench_prefill_attention.py does. Decode contexts hold random K/V; prefill computes
the last token's logits only, as generate does. In the profile, `after`'s decode steps are one call
(column `C decoder`: its linear products, attention and passes together); the LM head has its own column
(and so does sampling, not run here), so their GEMM column is empty."""


def render(rows: list[Row], args: argparse.Namespace, load: tuple[float, float], profile_md: str) -> str:
    names = list(rows[0][2])
    ratio_cols = []
    if "before" in names and "after" in names:
        ratio_cols.append(("after / before", "after", "before"))
    if "python-layers" in names and "after" in names:
        ratio_cols.append(("after / python-layers", "after", "python-layers"))
    if HF in names:
        ratio_cols += [(f"{n} / transformers", n, HF) for n in names if n != HF]
    model = ("embedded SmolLM2-135M-Instruct (GGUF Q4_1, dequantised)" if args.model_path is None
             else args.model_path)
    command = (f"python benchmarks/bench_forward.py --dtype {args.dtype} --prefill-len {args.prefill_len} "
               f"--context {args.context} --batches {args.batches} --steps {args.steps} --rounds {args.rounds} "
               f"--paths {args.paths} --backend {args.backend}" + (" --only-ours" if args.only_ours else "")
               + (f" --threads {args.threads}" if args.threads else "") + (" --profile" if args.profile else ""))
    lines = [
        "## Forward pass: before/after the CPU fast path, and transformers (`benchmarks/bench_forward.py`)",
        "",
        f"Model: {model}; every engine runs the same weights; attention backend `{args.backend}`. "
        f"{cpu_header(args.dtype)}. torch {torch.__version__}, transformers {_transformers_version()}. "
        f"Load average {load[0]:.1f} at start, {load[1]:.1f} at end: the machine is shared, so rounds alternate "
        "between the engines and the table shows the median round.",
        "",
        f"Command: `{command}`",
        "",
        "| workload | threads | " + " | ".join(f"{n} tok/s" for n in names) + " | "
        + " | ".join(c[0] for c in ratio_cols) + " |",
        "|---|---:|" + "---:|" * (len(names) + len(ratio_cols)),
    ]
    for workload, threads, tps in rows:
        cells = [f"{tps[n]:.1f}" for n in names] + [f"{tps[a] / tps[b]:.2f}x" for _, a, b in ratio_cols]
        lines.append(f"| {workload} | {threads} | " + " | ".join(cells) + " |")
    lines += ["", f"![forward throughput]({PLOT.name})", "", NOTES]
    if profile_md:
        lines += ["", "Where the time goes (torch.profiler, 1 thread; ms per step and share of the step's wall "
                  "time; `Python & dispatch` is the wall time no op accounts for):", "", profile_md]
    return "\n".join(lines)


def plot(rows: list[Row], dtype: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows[0][2])
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [x + (i - (len(names) - 1) / 2) * width for x in range(len(rows))]
        ax.bar(xs, [r[2][name] for r in rows], width=width, label=name)
    ax.set_xticks(range(len(rows)), [_short_label(r) for r in rows], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("tokens / s (log)")
    ax.set_title(f"SmolLM2-135M forward throughput ({dtype}): before/after the CPU fast path", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)


def _short_label(row: Row) -> str:
    workload = row[0].split(" ctx=")[0].replace("decode ", "decode\n")
    return f"{workload}\n{row[1]} thread(s)"


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def main() -> None:
    args = parse_args()
    print(cpu_header(args.dtype), flush=True)
    load_start = os.getloadavg()[0]
    runners, hf, batches = build_engines(args)
    dtype = str(next(iter(runners.values())).dtype).removeprefix("torch.")
    rows: list[Row] = []
    for threads in [int(t) for t in args.threads.split(",") if t] or [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        rows.append((f"prefill {args.prefill_len}", threads, bench_prefill(runners, hf, args)))
        print(_line(rows[-1]), flush=True)
        for batch in batches:
            rows.append((f"decode bs={batch} ctx={args.context}", threads, bench_decode(runners, hf, batch, args)))
            print(_line(rows[-1]), flush=True)
    profile_md = ""
    if args.profile:
        profiles = profile_paths(runners, args)
        for p in profiles:
            print(f"\n{p.title} ({p.path})\n{p.table}")
        profile_md = render_profiles(profiles, machine_limits(), dtype)
    section = render(rows, args, (load_start, os.getloadavg()[0]), profile_md)
    print("\n" + section)
    if not args.no_docs:
        write_doc_section(DOCS, BEGIN, END, section)
        plot(rows, dtype)
        print(f"wrote {DOCS} and {PLOT}", file=sys.stderr)


def _line(row: Row) -> str:
    return f"{row[0]} ({row[1]} threads): " + ", ".join(f"{n} {v:.1f} tok/s" for n, v in row[2].items())


if __name__ == "__main__":
    main()
