"""llama.cpp's side of the quantization benchmarks, run by a python that has llama-cpp-python (numpy only here).

    python llama_cpp_helper.py quality REQUEST.json OUT_DIR   # logits.npy, text_logprobs.npy
    python llama_cpp_helper.py speed MODEL.gguf THREADS CONTEXT STEPS PREFILL   # prints one JSON line
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
from llama_cpp import Llama


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def quality(request_path: str, out_dir: str) -> None:
    request = json.loads(Path(request_path).read_text())
    text = request["text"]
    llm = Llama(request["model"], n_ctx=max(2048, len(text) + 8), n_batch=1024, n_threads=1, logits_all=True,
                verbose=False)
    rows = []
    for ids in request["prompts"]:
        llm.reset()
        llm.eval(ids)
        rows.append(np.array(llm.scores[len(ids) - 1], dtype=np.float32))
    llm.reset()
    llm.eval(text)
    scores = log_softmax(np.array(llm.scores[: len(text) - 1], dtype=np.float64))
    np.save(Path(out_dir) / "logits.npy", np.stack(rows))
    np.save(Path(out_dir) / "text_logprobs.npy", scores[np.arange(len(text) - 1), text[1:]])


def speed(model: str, threads: int, context: int, steps: int, prefill: int) -> None:
    llm = Llama(model, n_ctx=max(context + steps + 8, prefill + 8), n_batch=prefill, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    prompt = [(i * 7919) % 40000 + 100 for i in range(max(context, prefill))]
    llm.eval(prompt[-64:])  # NOTE: a warm-up, so the timed prefill is not the first call (as ours is not)
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt[:prefill])
    prefill_s = time.perf_counter() - start
    llm.reset()
    llm.eval(prompt[:context])
    token = int(np.argmax(llm.scores[context - 1]))
    start = time.perf_counter()
    for _ in range(steps):
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    decode_s = time.perf_counter() - start
    print(json.dumps({"decode1": steps / decode_s, "prefill": prefill / prefill_s, "rss_mib": rss_mib()}))


if __name__ == "__main__":
    if sys.argv[1] == "quality":
        quality(sys.argv[2], sys.argv[3])
    else:
        speed(sys.argv[2], *(int(a) for a in sys.argv[3:7]))
