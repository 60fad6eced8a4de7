"""A quick probe of one dtype choice: start-up, then prefill and decode speed at the given batch sizes.

    python benchmarks/bench_dtype_probe.py embedded float32 64 1,32     # model, --dtype, new tokens, batch sizes
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 RADIXSERVE_CPU_ISA=avx2 \\
        python benchmarks/bench_dtype_probe.py embedded auto           # the AVX2 class, what auto picks there

Prompts of 100 tokens; decode speed = (batch x (new tokens - 1)) / (the wall with new tokens - the wall with one).
"""

from __future__ import annotations

import sys
import time

from radixserve import Engine


def main() -> None:
    model, dtype = sys.argv[1], sys.argv[2]
    new = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    batches = [int(b) for b in (sys.argv[4] if len(sys.argv) > 4 else "1,32").split(",")]
    start = time.time()
    engine = Engine(dtype=dtype, **({} if model == "embedded" else {"model_path": model}))
    startup = time.time() - start
    params = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
    engine.generate(input_ids=[list(range(1000, 1040))], sampling_params={**params, "max_new_tokens": 4})
    results = []
    for bs in batches:
        start = time.time()
        engine.generate(input_ids=[[i * 7 + 1000 + j for j in range(100)] for i in range(bs)],
                        sampling_params={**params, "max_new_tokens": 1})
        prefill = time.time() - start
        start = time.time()
        engine.generate(input_ids=[[i * 7 + 3000 + j for j in range(100)] for i in range(bs)], sampling_params=params)
        full = time.time() - start
        results.append(f"bs{bs}: prefill {bs * 100 / prefill:.0f} tok/s, decode {bs * (new - 1) / (full - prefill):.1f} tok/s")
    print(f"{model.rstrip('/').split('/')[-1]} --dtype {dtype} [{engine.model_runner.device_setup.describe()}] "
          f"start {startup:.1f}s |", " | ".join(results), flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
