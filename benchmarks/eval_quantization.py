"""Quality of packed weights on the embedded SmolLM2-135M: next-token agreement and mean KL against float32
on 200 fixed prompts (tests/data/quantization_prompts.txt), and perplexity on a fixed text
(tests/data/perplexity_text.txt); llama.cpp on the same GGUF file when llama-cpp-python is importable
by --llama-python. Writes its section of docs/quantization.md.

    python benchmarks/eval_quantization.py [--llama-python /root/peers/llamacpp/bin/python]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from direct import DirectDriver

from radixserve.bench.docs import write_doc_section
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.model_loader.gguf_loader import gguf_to_hf_folder
from radixserve.models.loader import embedded_model_path
from radixserve.server_args import ServerArgs

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "tests" / "data" / "quantization_prompts.txt"
TEXT = ROOT / "tests" / "data" / "perplexity_text.txt"
DOCS = ROOT / "docs" / "quantization.md"
BEGIN, END = "<!-- eval_quantization:begin -->", "<!-- eval_quantization:end -->"
LLAMA_HELPER = Path(__file__).resolve().parent / "llama_cpp_helper.py"


def variants() -> list[tuple[str, dict]]:
    f32_folder = str(gguf_to_hf_folder(embedded_model_path(), torch.float32))
    return [
        ("float32 (reference)", dict(dtype="float32")),
        ("bfloat16", dict(dtype="bfloat16")),
        ("int8 per-channel, quantized at load", dict(model_path=f32_folder, dtype="float32", quantization="int8")),
        ("int4 g32, quantized at load", dict(model_path=f32_folder, dtype="float32", quantization="int4")),
        ("int4 g32, the Q4_1 blocks as they are", dict(dtype="float32", quantization="int4")),
    ]


def token_lists(tokenizer) -> tuple[list[list[int]], list[int]]:
    prompts = [line.replace("\\n", "\n") for line in PROMPTS.read_text().splitlines() if line]
    ids = [tokenizer.encode(p) for p in prompts]
    return ids, tokenizer.encode(TEXT.read_text())


def next_token_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    driver, rows = DirectDriver(runner), []
    for start in range(0, len(prompts), 20):
        batch = prompts[start:start + 20]
        rows.append(driver.extend([driver.new_request() for _ in batch], batch).float())
        driver.release_all()
    return torch.cat(rows)


def text_logprobs(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """log p(token i | tokens < i) for i >= 1, by one decode step per token (all positions' logits)."""
    driver = DirectDriver(runner)
    req = driver.new_request()
    out = [torch.log_softmax(driver.extend([req], [ids[:1]])[0].float(), -1)[ids[1]]]
    for i in range(1, len(ids) - 1):
        out.append(torch.log_softmax(driver.decode([req], [ids[i]])[0].float(), -1)[ids[i + 1]])
    driver.release_all()
    return torch.stack(out)


def compare(ref_logits: torch.Tensor, logits: torch.Tensor, logprobs: torch.Tensor) -> dict:
    ref_lp, lp = torch.log_softmax(ref_logits, -1), torch.log_softmax(logits, -1)
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1)
    return {"agree": float((ref_logits.argmax(-1) == logits.argmax(-1)).float().mean()),
            "kl": max(float(kl.mean()), 0.0), "ppl": float(torch.exp(-logprobs.mean()))}


def llama_cpp_figures(python: str, prompts: list[list[int]], text: list[int]) -> tuple[np.ndarray, np.ndarray]:
    with tempfile.TemporaryDirectory() as tmp:
        request = Path(tmp) / "request.json"
        request.write_text(json.dumps({"model": str(embedded_model_path()), "prompts": prompts, "text": text}))
        subprocess.run([python, str(LLAMA_HELPER), "quality", str(request), tmp], check=True)
        return np.load(Path(tmp) / "logits.npy"), np.load(Path(tmp) / "text_logprobs.npy")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-python", default="", help="a python with llama-cpp-python, for llama.cpp's figures")
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows, reference, tokens = [], None, None
    for name, kwargs in variants():
        runner = ModelRunner(ServerArgs(max_total_tokens=8192, log_level="warning", **kwargs))
        if tokens is None:
            tokens = token_lists(runner.tokenizer)
        logits = next_token_logits(runner, tokens[0])
        logprobs = text_logprobs(runner, tokens[1])
        if reference is None:
            reference = logits
        rows.append((name, compare(reference, logits, logprobs)))
        print(name, rows[-1][1], flush=True)
        del runner
    if args.llama_python:
        logits, logprobs = llama_cpp_figures(args.llama_python, *tokens)
        rows.append(("llama.cpp, the same Q4_1 file", compare(reference, torch.from_numpy(logits).float(),
                                                              torch.from_numpy(logprobs).float())))
        print(rows[-1], flush=True)
    table = ["| weights | next-token agreement with float32 | mean KL (nats) | perplexity |", "|---|---:|---:|---:|"]
    table += [f"| {n} | {r['agree'] * 100:.1f}% | {r['kl']:.5f} | {r['ppl']:.3f} |" for n, r in rows]
    body = "\n".join([
        "## Quality (`benchmarks/eval_quantization.py`)",
        "",
        f"200 prompts ([tests/data/quantization_prompts.txt](../tests/data/quantization_prompts.txt)), the "
        f"next-token distribution after each; perplexity over the {len(tokens[1])} tokens of "
        "[tests/data/perplexity_text.txt](../tests/data/perplexity_text.txt). Float32, int8 and int4 rows compute "
        "in float32 activations (the packed kernels round them to int8 per block of 32 for up to 4 rows, or up to 32 rows in the tiled layout of AVX-512 VNNI CPUs).",
        "",
        f"Command: `python benchmarks/eval_quantization.py{' --llama-python ' + args.llama_python if args.llama_python else ''}`",
        "",
        *table,
        "",
    ])
    print(body)
    if not args.no_docs:
        write_doc_section(DOCS, BEGIN, END, body)


if __name__ == "__main__":
    sys.exit(main())
