"""Grammar memory and compile bounds (docs/structured_outputs.md, "Limits and errors").

    python benchmarks/bench_grammar_cache.py --schemas 250 --budget-mib 32     # RSS over distinct schemas
    python benchmarks/bench_grammar_cache.py --engine --schemas 300            # the same through an Engine
    python benchmarks/bench_grammar_cache.py --sizes                           # checks, compile time, size

Default: one GrammarBackend on the embedded model's tokenizer compiles `--schemas` distinct small schemas (a
string with maxLength 8 and an integer range each, ~1 MiB compiled) under `--grammar-cache-bytes`; the process's
RSS, the compile time per schema and the caches' bytes are printed four times on the way. `--engine`: each schema
through `Engine.generate` (4 tokens). `--sizes`: for a few grammars, the checks before compiling (xgrammar's
Grammar + grammar_checks.shape), then the compile from a fresh compiler and the compiled size.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

MIB = 1 << 20


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def schema(i: int) -> str:
    return json.dumps({"type": "object", "properties": {f"key_{i}": {"type": "string", "maxLength": 8},
                                                        "n": {"type": "integer", "minimum": 0, "maximum": i + 1}},
                       "required": [f"key_{i}", "n"]})


def tokenizer():
    import torch

    from radixserve.model_loader.gguf_loader import gguf_to_hf_folder
    from radixserve.model_loader.model_folder import load_tokenizer
    from radixserve.models.loader import embedded_model_path

    return load_tokenizer(gguf_to_hf_folder(embedded_model_path(), torch.float32))


def run_backend(n: int, budget: int) -> None:
    from radixserve.constrained.grammar_backend import GrammarBackend, GrammarSpec

    tok = tokenizer()
    backend = GrammarBackend(tok, len(tok), [tok.eos_token_id], cache_bytes=budget)
    backend.submit(GrammarSpec("json_schema", schema(-1))).result()
    gc.collect()
    start, rss0 = time.perf_counter(), rss_mib()
    for i in range(n):
        backend.submit(GrammarSpec("json_schema", schema(i))).result()
        if (i + 1) % max(n // 4, 1) == 0:
            gc.collect()
            info = backend.cache_info()
            print(f"{i + 1:5d} schemas: RSS +{rss_mib() - rss0:6.1f} MiB, {(time.perf_counter() - start) / (i + 1) * 1e3:5.1f}"
                  f" ms/schema, ours {info['grammar_cache_bytes'] / MIB:5.1f} MiB in {info['grammar_cache_entries']}"
                  f" entries, xgrammar's {info['xgrammar_cache_bytes'] / MIB:5.1f} MiB", flush=True)


def run_engine(n: int, budget: int) -> None:
    import torch

    from radixserve import Engine

    torch.set_num_threads(1)  # NOTE: small forwards on a shared 2-core machine: one thread is fastest
    engine = Engine(dtype="float32", device="cpu", log_level="warning", max_total_tokens=4096,
                    grammar_cache_bytes=budget)
    try:
        engine.generate("JSON:", sampling_params={"json_schema": schema(-1), "max_new_tokens": 4})
        gc.collect()
        start, rss0 = time.perf_counter(), rss_mib()
        for i in range(n):
            engine.generate("JSON:", sampling_params={"json_schema": schema(i), "max_new_tokens": 4})
            if (i + 1) % max(n // 4, 1) == 0:
                gc.collect()
                state = engine.get_internal_state()
                print(f"{i + 1:5d} requests: RSS +{rss_mib() - rss0:6.1f} MiB, "
                      f"{(time.perf_counter() - start) / (i + 1) * 1e3:5.1f} ms/request, grammar cache "
                      f"{state['grammar_cache_bytes'] / MIB:5.1f} MiB, xgrammar's "
                      f"{state['xgrammar_cache_bytes'] / MIB:5.1f} MiB", flush=True)
    finally:
        engine.shutdown()


def run_sizes() -> None:
    import xgrammar as xgr

    from radixserve.constrained.grammar_checks import shape

    tok = tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])

    def obj(props: dict) -> str:
        return json.dumps({"type": "object", "properties": props, "required": list(props)})

    def regex_shape(p: str):
        return shape(str(xgr.Grammar.from_regex(p)))

    cases = [("json_schema", "name (maxLength 20) + age", obj({"name": {"type": "string", "maxLength": 20},
                                                               "age": {"type": "integer", "maximum": 120}})),
             ("json_schema", "100 strings, maxLength 20..119", obj({f"field_{i}": {"type": "string",
                                                                                  "maxLength": 20 + i}
                                                                    for i in range(100)})),
             ("regex", "[^a]{0,100}[^b]{0,100}", "[^a]{0,100}[^b]{0,100}"),
             ("regex", "[a-z]{0,200}", "[a-z]{0,200}")]
    for kind, name, source in cases:
        start = time.perf_counter()
        grammar = xgr.Grammar.from_json_schema(source, any_whitespace=False) if kind == "json_schema" else \
            xgr.Grammar.from_regex(source)
        found = shape(str(grammar), regex_shape)
        checked = time.perf_counter() - start
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=64 * MIB)
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(source, any_whitespace=False) if kind == "json_schema" else \
            compiler.compile_regex(source)
        print(f"{name:32s} checks {checked * 1e3:5.1f} ms: {found.states:5d} states, {found.work:4d} distinct | "
              f"compile {time.perf_counter() - start:6.2f} s, {compiled.memory_size_bytes / MIB:7.2f} MiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemas", type=int, default=250, help="distinct schemas (default 250)")
    parser.add_argument("--budget-mib", type=int, default=32, help="--grammar-cache-bytes in MiB (default 32)")
    parser.add_argument("--engine", action="store_true", help="through an Engine (default: the backend alone)")
    parser.add_argument("--sizes", action="store_true", help="checks, compile time and size of a few grammars")
    args = parser.parse_args()
    if args.sizes:
        run_sizes()
    elif args.engine:
        run_engine(args.schemas, args.budget_mib * MIB)
    else:
        run_backend(args.schemas, args.budget_mib * MIB)


if __name__ == "__main__":
    main()
