"""The feature-combination soak: a concurrent mixed load through the Engine, in configurations that combine the
features which change the scheduler's step, each run checked for what a user of both features expects.

A configuration (`Combo`) sets each step-changing feature: speculation (none, n-gram, a draft model), LoRA (two
adapters and the base model in one batch), the model (the embedded SmolLM2, or Gemma 3 270M: sliding-window
layers over the hybrid radix cache), int4 weights, the page size, the loop (overlap or normal) and chunked
prefill. `pairwise_combos` picks configurations so that every pair of levels of two features runs together at
least once (a covering array, built greedily and deterministically), minus the pairs the engine refuses
(`refused`, with the reason).

One run (`soak`) sends `mixed_work` from threads at once into a small KV pool (decode retracts): plain, greedy and
sampled, `json_schema`, `regex`, n > 1, logprobs, penalties, stop strings, a long prompt that is chunked, and
streams the client drops. It checks: no scheduler step failed; no request ended in an abort the client did not
ask for; every grammar answer that finished matches its grammar; every greedy answer equals the same request run
alone afterwards (on a flushed cache), but where the solo run's top two tokens tie within `TIE` (near ties under
int4 rounding are not the subject here); the conservation identity; and the process's RSS growth under a bound.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import resource
import threading
from dataclasses import dataclass, field, fields, replace
from typing import Any

import jsonschema

# NOTE: bounded strings and enums: a small model given an unbounded string may write it until max_new_tokens
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "color"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]}}}
ANSWER = r"(yes|no), because [a-z ]{1,24}\."
TIE = 0.05  # nats between the solo run's top two tokens under which a different greedy choice is a tie
# NOTE: int4 prefills round activations to int8 on one path and not on the other, chosen by the batch's row count: a
# request's logits move by up to ~0.45 nats with what it was prefilled beside (docs/quantization.md, "Batch
# invariance"), so two tokens' gap by up to twice that (each moving its own way; a 0.5 bound failed once in the long
# run of 2026-12-07: standalone drafts + LoRA + int4 + overlap + chunked). --enable-deterministic-inference removes
# the switch but not for LoRA prompt rows (docs/deterministic.md), so the soak keeps this bound
TIE_INT4 = 1.0
POOL_TOKENS = 768  # small enough that the load below retracts, large enough for its longest request
# NOTE: the process keeps freed heap (glibc with M_MMAP_MAX 0, set once the model is loaded), so RSS is the high-water
# mark of the load's working set (Gemma 3's 262k-token logits, masks and penalty rows: ~770 MiB measured), not a
# leak; the bound catches growth that scales with requests (a grammar cache without a byte budget adds ~9 MiB a
# schema), and `repeat_growth_mb` (a second identical round) shows the high-water mark is reached. Rows per step
# depend on timing, so a second round can set a new mark once: Gemma 3 + n-gram + overlap + chunked grew past 96 MiB
# in two of three runs (126 MiB in the one printed; 2026-12-07, a loaded 2-core Zen 3); one float32 logits row
# of Gemma 3 is 1 MiB, so the bound is ~190 rows, far below what a grammar cache without a budget adds in a round
RSS_GROWTH_MB = 1024
REPEAT_GROWTH_MB = 192


@dataclass(frozen=True)
class Combo:
    """One configuration of the step-changing features."""

    spec: str = "none"  # none | ngram | standalone (the embedded SmolLM2 drafting)
    lora: bool = False  # two adapters and the base model mixed in the batch
    model: str = "smollm2"  # smollm2 | gemma3 (hybrid sliding-window cache)
    quant: str = "none"  # none | int4
    page_size: int = 1
    overlap: bool = True
    chunked: bool = False  # chunked prefill of 64 tokens (else one prefill per request)

    def label(self) -> str:
        return "-".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


LEVELS: dict[str, tuple[Any, ...]] = {
    "spec": ("none", "ngram", "standalone"), "lora": (False, True), "model": ("smollm2", "gemma3"),
    "quant": ("none", "int4"), "page_size": (1, 4), "overlap": (True, False), "chunked": (False, True)}


def refused(combo: Combo) -> str | None:
    """Why the engine does not run this configuration (a clear error at start), or None."""
    if combo.model == "gemma3" and combo.spec == "standalone":
        return "a draft model must share the served model's vocabulary (Gemma 3's is not SmolLM2's)"
    if combo.model == "gemma3" and combo.lora:
        return "the test's LoRA adapters are made for SmolLM2's shapes"
    return None


def pairwise_combos(levels: dict[str, tuple[Any, ...]] = LEVELS, seed: int = 0, tries: int = 64) -> list[Combo]:
    """Configurations covering every allowed pair of levels of two features (greedy covering array: each round
    keeps, of `tries` random valid configurations, the one covering most pairs not yet covered)."""
    names = list(levels)
    rng = random.Random(seed)

    def pairs(combo: Combo) -> set[tuple]:
        return {((a, getattr(combo, a)), (b, getattr(combo, b))) for a, b in itertools.combinations(names, 2)}

    every = [Combo(**dict(zip(names, values, strict=True))) for values in itertools.product(*levels.values())]
    allowed = [c for c in every if refused(c) is None]
    todo = set().union(*(pairs(c) for c in allowed))
    chosen: list[Combo] = []
    while todo:
        candidates = [rng.choice(allowed) for _ in range(tries)]
        # NOTE: a configuration holding the first uncovered pair guarantees progress every round
        first = sorted(todo, key=repr)[0]
        candidates.append(next(c for c in allowed if first in pairs(c)))
        best = max(candidates, key=lambda c: len(pairs(c) & todo))
        chosen.append(best)
        todo -= pairs(best)
    return chosen


# ---- the load ---------------------------------------------------------------------------------------
@dataclass
class Work:
    """One request of the load: its prompt, its sampling parameters and what the client does with it."""

    rid: str
    kind: str  # plain | json | regex | n2 | logprobs | penalties | stop | long | dropped
    prompt: list[int]
    params: dict[str, Any]
    lora: str | None = None
    logprobs: bool = False
    drop_after: int = 0  # > 0: a stream the client drops after this many increments

    @property
    def greedy(self) -> bool:
        return self.params.get("temperature", 1.0) == 0.0 and self.params.get("n", 1) == 1 and not self.drop_after


def mixed_work(engine: Any, adapters: tuple[str | None, ...], seed: int = 0, count: int = 24) -> list[Work]:
    """`count` requests over every request-level feature, prompts from a few shared system prompts (so the radix
    cache and n-gram drafts have something to find), LoRA adapters round-robin."""
    rng = random.Random(seed)
    systems = ["You are a terse assistant. Answer in one sentence.",
               "You describe people as JSON objects with a name, an age and a favourite colour."]
    topics = ["a pirate", "a baker", "a pilot", "the moon", "a cat", "a violin", "the sea", "a robot"]
    kinds = ["plain", "json", "regex", "n2", "logprobs", "penalties", "stop", "long", "dropped"]
    work = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        topic = rng.choice(topics)
        text = f"Tell me about {topic}. Repeat its name three times: {topic}, {topic}, {topic}."
        if kind == "long":
            text = " ".join([f"Line {j}: {topic} walks to the {rng.choice(topics)}." for j in range(24)]) + " Summarise."
        prompt = engine.apply_chat_template([{"role": "system", "content": systems[i % 2]},
                                             {"role": "user", "content": text}])
        params: dict[str, Any] = {"max_new_tokens": rng.choice([24, 40]), "temperature": 0.0}
        item = Work(f"w{i}-{kind}", kind, prompt, params, lora=adapters[i % len(adapters)])
        if kind == "json":
            params.update(json_schema=json.dumps(PERSON), temperature=rng.choice([0.0, 0.7]), max_new_tokens=64)
        elif kind == "regex":
            params.update(regex=ANSWER, temperature=rng.choice([0.0, 0.7]), max_new_tokens=48)
        elif kind == "n2":
            params.update(n=2, temperature=0.8, seed=i)
        elif kind == "logprobs":
            item.logprobs = True
        elif kind == "penalties":
            params.update(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1)
        elif kind == "stop":
            params.update(stop=[".", "\n"], ignore_eos=False)
        elif kind == "dropped":
            params.update(temperature=0.7, max_new_tokens=64)
            item.drop_after = rng.randint(1, 6)
        work.append(item)
    return work


@dataclass
class SoakReport:
    results: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # rid -> one result per choice
    errors: list[str] = field(default_factory=list)  # exceptions the client saw
    dropped: int = 0


def _run_one(engine: Any, item: Work, report: SoakReport, lock: threading.Lock) -> None:
    try:
        if item.drop_after:
            handle = engine.submit(item.prompt, item.params, stream=True, lora_path=item.lora)
            for n, _ in enumerate(handle.stream(), start=1):
                if n >= item.drop_after:
                    break  # NOTE: closing the stream early aborts the request
            with lock:
                report.dropped += 1
            return
        out = engine.generate(input_ids=item.prompt, sampling_params=item.params, lora_path=item.lora,
                              return_logprob=item.logprobs, top_logprobs_num=2 if item.logprobs else 0)
        with lock:
            report.results[item.rid] = out if isinstance(out, list) else [out]
    except Exception as e:  # noqa: BLE001 - every failure is reported, none is allowed
        with lock:
            report.errors.append(f"{item.rid}: {type(e).__name__}: {e}"[:300])


def run_load(engine: Any, work: list[Work]) -> SoakReport:
    """Every request of `work` from its own thread, all at once; waits for all."""
    report, lock = SoakReport(), threading.Lock()
    threads = [threading.Thread(target=_run_one, args=(engine, item, report, lock)) for item in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return report


# ---- the checks -------------------------------------------------------------------------------------
def grammar_problem(item: Work, result: dict[str, Any]) -> str | None:
    """Why a finished grammar answer does not match its grammar, or None (a `length` finish is cut short)."""
    finish = result["meta_info"]["finish_reason"]
    if finish["type"] != "stop" or item.kind not in ("json", "regex"):
        return None
    text = result["text"]
    if item.kind == "json":
        try:
            jsonschema.validate(json.loads(text), PERSON)
        except (ValueError, jsonschema.ValidationError) as e:
            return f"{item.rid}: {text!r} does not match the schema: {str(e)[:120]}"
    elif not re.fullmatch(ANSWER, text):
        return f"{item.rid}: {text!r} does not match {ANSWER}"
    return None


def solo_problem(engine: Any, item: Work, loaded: dict[str, Any], tie: float = TIE) -> str | None:
    """Run `item` alone on a flushed cache; why its greedy answer differs from the one under load, or None.
    A difference is allowed only at a position where the solo run's two best tokens tie within `tie`."""
    assert engine.flush_cache()["success"]
    solo = engine.generate(input_ids=item.prompt, sampling_params=item.params, lora_path=item.lora,
                           return_logprob=True, top_logprobs_num=2)
    a, b = loaded["output_ids"], solo["output_ids"]
    if a == b:
        return None
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    tops = solo["meta_info"]["output_top_logprobs"]
    if at < len(tops) and len(tops[at]) >= 2 and tops[at][0][0] - tops[at][1][0] < tie:
        return None
    return f"{item.rid}: under load {a[:at + 3]}... alone {b[:at + 3]}... (first difference at {at})"


def rss_mb() -> float:
    """The process's resident memory now (VmRSS), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def check_soak(engine: Any, work: list[Work], report: SoakReport, rss_before: float, solo_limit: int = 100) -> list[str]:
    """Every problem of one run, as text (empty: the run is clean); at most `solo_limit` greedy requests run alone."""
    problems = list(report.errors)
    failed = engine.scheduler.failed_steps
    if failed:
        problems.append(f"{failed} scheduler step(s) failed")
    for item in work:
        if item.drop_after:
            continue
        for result in report.results.get(item.rid, []):
            finish = result["meta_info"]["finish_reason"]
            if finish is None or finish["type"] == "abort":
                problems.append(f"{item.rid}: ended {finish}")
            elif (problem := grammar_problem(item, result)) is not None:
                problems.append(problem)
    state = engine.get_internal_state()
    conservation = state["kv_conservation"]
    if conservation is None or "error" in conservation or state["protected_tokens"] or state["num_running_reqs"]:
        problems.append(f"KV not conserved at idle: {conservation}, protected {state['protected_tokens']}")
    int4 = engine.server_args.quantization == "int4"
    # NOTE: under int4 a tie is judged on the reported logprobs, which are before penalties: penalized rows are left out
    compared = [w for w in work if w.greedy and not (int4 and w.kind == "penalties")]
    for item in compared[:solo_limit]:
        if item.rid in report.results:
            result = report.results[item.rid][0]
            if result["meta_info"]["finish_reason"]["type"] != "abort":
                problem = solo_problem(engine, item, result, TIE_INT4 if int4 else TIE)
                if problem is not None:
                    problems.append(problem)
    growth = rss_mb() - rss_before
    if growth > RSS_GROWTH_MB:
        problems.append(f"RSS grew {growth:.0f} MiB in one run (bound {RSS_GROWTH_MB})")
    return problems


def engine_args(combo: Combo, models: dict[str, Any]) -> dict[str, Any]:
    """The Engine's arguments for `combo`; `models` has the paths the fixtures made (gemma3, lora adapters)."""
    from radixserve.server_args import ServerArgs

    args: dict[str, Any] = dict(dtype="float32", device="cpu", max_total_tokens=POOL_TOKENS, log_level="error",
                                page_size=combo.page_size, disable_overlap_schedule=not combo.overlap,
                                chunked_prefill_size=64 if combo.chunked else -1, max_running_requests=16,
                                schedule_conservativeness=0.05)
    if "grammar_cache_bytes" in {f.name for f in fields(ServerArgs)}:
        args["grammar_cache_bytes"] = 32 << 20
    if combo.model == "gemma3":
        args["model_path"] = str(models["gemma3"])
    if combo.quant != "none":
        args["quantization"] = combo.quant
    if combo.spec != "none":
        args["speculative_algorithm"] = combo.spec
    if combo.lora:
        args["lora_paths"] = tuple(f"{name}={path}" for name, path in models["adapters"].items())
    return args


def warm_up(engine: Any, work: list[Work]) -> None:
    """One short request of each grammar kind first: the grammar engine's tables for this vocabulary and the compiled
    grammars are made once per process (hundreds of MiB for Gemma 3's 262k tokens), not per request, so the RSS
    bound measures what the load itself adds."""
    for kind in ("json", "regex"):
        item = next(w for w in work if w.kind == kind)
        engine.generate(input_ids=item.prompt, sampling_params={**item.params, "max_new_tokens": 2})
    assert engine.flush_cache()["success"]


def soak(combo: Combo, models: dict[str, Any], seed: int = 0, count: int = 24, solo_limit: int = 100,
         repeat: bool = False) -> tuple[list[str], dict[str, Any]]:
    """One run of the mixed load in `combo` (`count` requests; at most `solo_limit` greedy ones rerun alone; with
    `repeat`, a second identical round must not grow RSS): (its problems, its figures)."""
    from radixserve import Engine

    adapters = (None, *models["adapters"]) if combo.lora else (None,)
    engine = Engine(**engine_args(combo, models))
    try:
        work = mixed_work(engine, adapters, seed, count)
        warm_up(engine, work)
        rss_before = rss_mb()
        report = run_load(engine, work)
        if repeat:
            after = rss_mb()
            again = run_load(engine, [replace(w, rid=w.rid + "-again") for w in work])
            report.errors.extend(again.errors)
            if (growth := rss_mb() - after) > REPEAT_GROWTH_MB:
                report.errors.append(f"RSS grew {growth:.0f} MiB more in a second identical round")
        stats = engine.scheduler.stats
        figures = {"retractions": stats.num_retractions, "verify_steps": stats.spec_verify_steps,
                   "jump_forwards": stats.num_jump_forwards, "dropped": report.dropped,
                   "answered": sum(len(r) for r in report.results.values())}
        return check_soak(engine, work, report, rss_before, solo_limit), figures
    finally:
        engine.shutdown()


def default_slice() -> list[Combo]:
    """The default run's configurations: every feature on at least once, the riskiest pairs together."""
    return [Combo(spec="ngram", page_size=4, overlap=True, chunked=True),
            Combo(spec="standalone", lora=True, quant="int4", overlap=False),
            replace(Combo(), model="gemma3", spec="ngram", page_size=4)]
