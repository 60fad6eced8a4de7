"""Benchmark of RadixCache match/insert on a realistic synthetic trace, and of eviction at two tree sizes.

    python benchmarks/bench_radix.py [--requests 10000] [--page-sizes 1,16] [--no-docs]
        [--sglang /tmp/sglang_py]   # optional: also time SGLang's pure-Python RadixCache

The trace mixes a few shared system prompts, few-shot blocks and multi-turn chats that grow turn
by turn. Each request is served as the scheduler does it: `match_prefix(prompt[:-1])` at
admission, then `insert(prompt + output)` when it finishes. Keys are built outside the timed
region for both caches (the scheduler keeps token ids ready), so the timings are the tree's.
Prints tables, replaces its section of docs/benchmarks.md and writes docs/bench_radix.png.

`--sglang DIR`: DIR holds an unpacked SGLang wheel (`pip download sglang==0.5.17 --no-deps`,
then unzip). Nothing of it is copied here; the third-party packages it imports but the radix
tree never uses are replaced by inert stand-ins at import time.
"""

from __future__ import annotations

import argparse
import gc
import importlib.abc
import importlib.machinery
import platform
import random
import statistics
import sys
import time
import types
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from radixserve.bench.docs import cpu_header, write_doc_section  # noqa: E402
from radixserve.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402

VOCAB = 32000
DOC_START, DOC_END = "<!-- bench_radix:start -->", "<!-- bench_radix:end -->"


# ---------------------------------------------------------------------- trace
@dataclass(frozen=True)
class TraceRequest:
    prompt: tuple[int, ...]
    output: tuple[int, ...]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def build_trace(num_requests: int, seed: int = 0) -> list[TraceRequest]:
    """Chats (55%) whose next turn extends prompt + reply; few-shot (30%); one-off questions (15%)."""
    rng = random.Random(seed)
    systems = [_tokens(rng, n) for n in (256, 512, 1024, 1536)]
    shots = [_tokens(rng, rng.randint(80, 200)) for _ in range(8)]
    chats: list[list[int]] = []
    trace: list[TraceRequest] = []
    while len(trace) < num_requests:
        kind = rng.random()
        if kind < 0.55:
            if len(chats) < 20 or rng.random() < 0.3:
                chats.append(list(rng.choice(systems)))
            history = rng.choice(chats)
            history.extend(_tokens(rng, rng.randint(20, 120)))  # the user's message
            prompt, output = tuple(history), tuple(_tokens(rng, rng.randint(30, 250)))
            history.extend(output)  # the reply is part of the next turn's prompt
            if len(history) > 4000:
                chats.remove(history)
        elif kind < 0.85:
            few_shot = [t for shot in shots[: rng.randint(1, 8)] for t in shot]
            prompt = tuple(rng.choice(systems[:2]) + few_shot + _tokens(rng, rng.randint(20, 150)))
            output = tuple(_tokens(rng, rng.randint(5, 60)))
        else:
            prompt = tuple(rng.choice(systems) + _tokens(rng, rng.randint(50, 400)))
            output = tuple(_tokens(rng, rng.randint(20, 200)))
        trace.append(TraceRequest(prompt, output))
    return trace


# ---------------------------------------------------------------------- adapters
class OursAdapter:
    name = "radixserve"

    def __init__(self, page_size: int) -> None:
        self.cache = RadixCache(page_size=page_size)

    @staticmethod
    def tokens(token_ids: tuple[int, ...]) -> list[int]:
        return array("q", token_ids).tolist()  # fresh int objects, as a tokenizer returns them

    def key(self, tokens: list[int], limit: int | None = None) -> RadixKey:
        return RadixKey(tokens if limit is None else tokens[:limit])

    def match(self, key: RadixKey) -> int:
        return len(self.cache.match_prefix(key).device_indices)

    def insert(self, key: RadixKey, value: torch.Tensor) -> int:
        return self.cache.insert(key, value)

    def evict(self, num_tokens: int) -> int:
        return self.cache.evict(num_tokens)

    def size(self) -> tuple[int, int]:
        return self.cache.node_count(), self.cache.total_size()


class OursArrayAdapter(OursAdapter):
    """Our cache fed array('q') token ids (SGLang's container): keys are packed by a memcpy."""

    name = "radixserve[array]"

    @staticmethod
    def tokens(token_ids: tuple[int, ...]) -> array:
        return array("q", token_ids)


class _NullAllocator:
    device = torch.device("cpu")

    def free(self, *_args, **_kwargs) -> None:
        pass

    free_segment = free


class _Inert:
    """Stands in for any attribute of a third-party module SGLang imports but the tree never calls."""

    def __init__(self, *_a, **_k) -> None:
        pass

    def __call__(self, *a, **k):
        return a[0] if len(a) == 1 and callable(a[0]) and not k else _Inert()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()

    def __getitem__(self, _k):
        return _Inert()

    def __iter__(self):
        return iter(())

    def __bool__(self) -> bool:
        return False

    def __mro_entries__(self, _bases):
        return (object,)

    def __or__(self, _other):
        return _Inert()

    __ror__ = __or__


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    ROOTS = ("psutil", "pybase64", "triton", "torchvision", "aiohttp", "msgspec", "transformers",
             "partial_json_parser", "xgrammar", "sglang.kernels", "sglang.srt.configs", "sglang.srt.layers",
             "sglang.srt.observability", "sglang.srt.entrypoints", "sglang.srt.function_call",
             "sglang.srt.disaggregation")

    def find_spec(self, fullname, path, target=None):
        if any(fullname == r or fullname.startswith(r + ".") for r in self.ROOTS):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda name: _Inert()  # type: ignore[method-assign]
        return module

    def exec_module(self, module) -> None:
        pass


class SGLangAdapter:
    name = "sglang"

    def __init__(self, page_size: int) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixCache as SGLangCache
        from sglang.srt.mem_cache.radix_cache import RadixKey as SGLangKey

        self._key, self._match, self._insert, self._evict = SGLangKey, MatchPrefixParams, InsertParams, EvictParams
        self.cache = SGLangCache.create_simulated(mock_allocator=_NullAllocator(), page_size=page_size)

    @staticmethod
    def load(path: str) -> str:
        sys.path.insert(0, path)
        sys.meta_path.insert(0, _InertFinder())
        import sglang

        return getattr(sglang, "__version__", "unknown")

    @staticmethod
    def tokens(token_ids: tuple[int, ...]) -> array:
        return array("q", token_ids)  # SGLang's scheduler keeps token ids as array('q')

    def key(self, tokens: array, limit: int | None = None):
        return self._key(tokens, limit=limit)

    def match(self, key) -> int:
        return len(self.cache.match_prefix(self._match(key=key)).device_indices)

    def insert(self, key, value: torch.Tensor) -> int:
        return self.cache.insert(self._insert(key=key, value=value)).prefix_len

    def evict(self, num_tokens: int) -> int:
        return self.cache.evict(self._evict(num_tokens=num_tokens)).num_tokens_evicted

    def size(self) -> tuple[int, int]:
        nodes, stack = 0, list(self.cache.root_node.children.values())
        while stack:
            node = stack.pop()
            nodes += 1
            stack.extend(node.children.values())
        return nodes, self.cache.total_size()


# ---------------------------------------------------------------------- measurements
@dataclass
class TraceResult:
    cache: str
    page_size: int
    match_us: list[float] = field(default_factory=list)
    matched: list[int] = field(default_factory=list)
    insert_us: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    scaling: list[tuple[int, float, float]] = field(default_factory=list)  # (nodes, us/match, ns/token)
    nodes: int = 0
    tokens: int = 0


def run_traces(adapter_classes, page_size: int, trace: list[TraceRequest], probes: list[TraceRequest],
               checkpoints: set[int]) -> list[TraceResult]:
    """Serve the trace with every cache in lockstep (so machine noise hits them alike).

    Each cache gets the token container its scheduler holds (ours: a fresh list per request, as a
    tokenizer returns it; SGLang: array('q')) and builds its key inside the timed region.
    """
    adapters = [cls(page_size) for cls in adapter_classes]
    results = [TraceResult(a.name, page_size) for a in adapters]
    values = torch.arange(max(len(r.prompt) + len(r.output) for r in trace), dtype=torch.int64)
    probe_tokens = [[a.tokens(p.prompt) for p in probes] for a in adapters]
    clock = time.perf_counter_ns
    gc.collect()
    for i, req in enumerate(trace, 1):
        full_len = len(req.prompt) + len(req.output)
        value = values[:full_len]
        for adapter, result in zip(adapters, results, strict=True):
            prompt, full = adapter.tokens(req.prompt), adapter.tokens(req.prompt + req.output)
            t0 = clock()
            matched = adapter.match(adapter.key(prompt, len(prompt) - 1))
            t1 = clock()
            adapter.insert(adapter.key(full), value)
            t2 = clock()
            result.match_us.append((t1 - t0) / 1e3)
            result.insert_us.append((t2 - t1) / 1e3)
            result.matched.append(matched)
            result.prompt_tokens += len(req.prompt) - 1
        if i in checkpoints:
            for adapter, result, tokens in zip(adapters, results, probe_tokens, strict=True):
                result.scaling.append(_probe(adapter, tokens))
    for adapter, result in zip(adapters, results, strict=True):
        result.nodes, result.tokens = adapter.size()
    return results


def _probe(adapter, probe_tokens) -> tuple[int, float, float]:
    for tokens in probe_tokens:  # warm: the first pass may split edges
        adapter.match(adapter.key(tokens, len(tokens) - 1))
    t0 = time.perf_counter_ns()
    matched = sum(adapter.match(adapter.key(tokens, len(tokens) - 1)) for tokens in probe_tokens)
    elapsed = time.perf_counter_ns() - t0
    return adapter.size()[0], elapsed / 1e3 / len(probe_tokens), elapsed / max(matched, 1)


def run_eviction(adapter_cls, num_leaves: int, rounds: int = 9, per_round: int = 1000,
                 seed: int = 1) -> tuple[int, float, float]:
    """Tree of ~num_leaves leaves under 256 shared trunks; evict per_round leaves, `rounds` times."""
    rng = random.Random(seed)
    adapter = adapter_cls(1)
    leaf_len = 8
    trunks = [tuple(_tokens(rng, 32)) for _ in range(256)]
    leaves = [trunks[i % 256] + tuple(_tokens(rng, leaf_len)) for i in range(num_leaves)]
    value = torch.arange(32 + leaf_len, dtype=torch.int64)
    for leaf in leaves:
        adapter.insert(adapter.key(adapter.tokens(leaf)), value)
    for leaf in rng.sample(leaves, num_leaves // 10):  # touch 10%: refreshes access times
        adapter.match(adapter.key(adapter.tokens(leaf)))
    nodes = adapter.size()[0]
    gc.collect()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        evicted = adapter.evict(per_round * leaf_len)
        times.append((time.perf_counter_ns() - t0) / 1e3)
        assert evicted >= per_round * leaf_len, evicted
    per_call = min(times)  # NOTE: best of `rounds`: the machine is shared, noise only adds time
    return nodes, per_call / 1e3, per_call / per_round


# ---------------------------------------------------------------------- reporting
def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def trace_table(results: list[TraceResult]) -> str:
    rows = ["| cache | page | match µs mean / p50 / p99 | insert µs mean / p50 | ns per matched token "
            "| hit rate | nodes | tokens |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        matched = sum(r.matched)
        rows.append(
            f"| {r.cache} | {r.page_size} | {statistics.mean(r.match_us):.1f} / {_pct(r.match_us, .5):.1f} / "
            f"{_pct(r.match_us, .99):.1f} | {statistics.mean(r.insert_us):.1f} / {_pct(r.insert_us, .5):.1f} "
            f"| {sum(r.match_us) * 1e3 / max(matched, 1):.2f} | {matched / r.prompt_tokens:.1%} "
            f"| {r.nodes:,} | {r.tokens:,} |")
    return "\n".join(rows)


def scaling_table(results: list[TraceResult], checkpoints: list[int]) -> str:
    rows = ["| cache | page | after requests | tree nodes | µs per probe match | ns per matched token |",
            "|---|---|---|---|---|---|"]
    for r in results:
        for n, (nodes, us, ns) in zip(checkpoints, r.scaling, strict=True):
            rows.append(f"| {r.cache} | {r.page_size} | {n:,} | {nodes:,} | {us:.1f} | {ns:.2f} |")
    return "\n".join(rows)


def eviction_table(evictions: dict[str, list[tuple[int, float, float]]]) -> str:
    rows = ["| cache | tree nodes | ms per evict(1,000 leaves) | µs per evicted node |", "|---|---|---|---|"]
    for name, points in evictions.items():
        for nodes, ms, us in points:
            rows.append(f"| {name} | {nodes:,} | {ms:.2f} | {us:.2f} |")
    return "\n".join(rows)


def plot(results: list[TraceResult], evictions: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        centers, medians = _binned_medians(r.matched, r.match_us, width=250)
        left.plot(centers, medians, marker=".", linestyle="-" if r.page_size == 1 else "--",
                  label=f"{r.cache}, page {r.page_size}")
    left.set(xlabel="matched tokens (bins of 250)", ylabel="median match_prefix µs",
             title="Match cost grows with the matched length")
    left.legend(fontsize=8)
    for name, points in evictions.items():
        right.plot([p[0] for p in points], [p[2] for p in points], marker="o", label=name)
    right.set(xscale="log", yscale="log", xlabel="tree nodes", ylabel="µs per evicted node",
              title="Eviction of 1,000 leaves")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _binned_medians(xs: list[int], ys: list[float], width: int) -> tuple[list[float], list[float]]:
    bins: dict[int, list[float]] = {}
    for x, y in zip(xs, ys, strict=True):
        bins.setdefault(x // width, []).append(y)
    keys = sorted(k for k, v in bins.items() if len(v) >= 20)
    return [(k + 0.5) * width for k in keys], [statistics.median(bins[k]) for k in keys]


def write_docs(section: str, doc: Path) -> None:
    write_doc_section(doc, DOC_START, DOC_END, section)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--page-sizes", default="1,16")
    parser.add_argument("--evict-sizes", default="10000,100000")
    parser.add_argument("--sglang", default=None, help="directory holding an unpacked SGLang wheel")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()

    adapters = [OursAdapter, OursArrayAdapter]
    sglang_version = None
    if args.sglang:
        sglang_version = SGLangAdapter.load(args.sglang)
        adapters.append(SGLangAdapter)
    trace = build_trace(args.requests)
    probes = random.Random(2).sample(trace, 300)
    checkpoints = sorted({max(1, args.requests // 10), max(1, args.requests * 3 // 10), args.requests})
    results = [r for ps in args.page_sizes.split(",")
               for r in run_traces(adapters, int(ps), trace, probes, set(checkpoints))]
    evictions = {a.name: [run_eviction(a, int(n)) for n in args.evict_sizes.split(",")]
                 for a in adapters if a is not OursArrayAdapter}

    versions = (f"Python {platform.python_version()}, torch {torch.__version__}"
                + (f", SGLang {sglang_version} (pure-Python RadixCache)" if sglang_version else ""))
    machine = cpu_header()
    command = "python benchmarks/bench_radix.py " + " ".join(sys.argv[1:])
    prompt_tokens = sum(len(r.prompt) for r in trace)
    section = "\n\n".join([
        "## Radix cache: match / insert / evict (`benchmarks/bench_radix.py`)",
        f"Machine: {machine}. Versions: {versions}.\nCommand: `{command.strip()}`",
        f"Trace: {len(trace):,} requests ({prompt_tokens:,} prompt tokens): 4 system prompts (256-1536 tokens), "
        "8 few-shot blocks, multi-turn chats growing turn by turn, one-off questions. Per request: "
        "`match_prefix(prompt[:-1])`, then `insert(prompt + output)`; no eviction during the trace. Keys are "
        "built inside the timed region: `radixserve` from a fresh `list[int]` per request (what a tokenizer "
        "returns and our scheduler passes; packing it costs ~10-20 ns a token), `radixserve[array]` is the same "
        "cache fed `array('q')`, SGLang's container (packing is a memcpy)"
        + (", `sglang` is SGLang's own `RadixCache` fed `array('q')`, run in lockstep with ours from an unpacked "
           "wheel outside this repo (`pip download sglang==0.5.17 --no-deps`, unzip to the `--sglang` folder)"
           if sglang_version else "") + ". The machine is shared (2 cores, other jobs running): expect noise.",
        trace_table(results),
        "Match cost against tree size (300 fixed probe prompts, re-matched as the tree grows):",
        scaling_table(results, checkpoints),
        "Eviction (LRU; leaves of 8 tokens under 256 shared trunks, 10% of them touched since insertion; "
        "best of 9 calls, each evicting 1,000 leaves):",
        eviction_table(evictions),
        "![radix benchmark](bench_radix.png)",
    ])
    print(section)
    if not args.no_docs:
        plot(results, evictions, ROOT / "docs" / "bench_radix.png")
        write_docs(section, ROOT / "docs" / "benchmarks.md")



if __name__ == "__main__":
    main()
