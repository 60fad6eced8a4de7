"""The roofline of bench_peers.py's prefill and decode figures (radixserve/bench/roofline.py), per engine.

Each figure's work comes from the spec's own prompts (token ids) and the model config: a cold prefill is one prefill
of its prompt; a decode figure (peer_replay.run_decode: the wall of n new tokens less the wall of one) is the n - 1
decode steps of its batch, step k attending to prompt + k tokens per row. Each engine's formats (compute dtype,
stored weight and KV dtypes) are its own, the machine's rates are measured once at the start.
"""

from __future__ import annotations

from radixserve.bench import roofline

FIGURES = {"cold": "prefill_tok_s", "decode": "decode_tok_s"}


def workload_cost(cfg, workload: dict, fmt: roofline.Formats) -> tuple[roofline.StepCost, int] | None:
    """(the work behind a spec workload's prefill or decode figure, the tokens it counts); None for other kinds."""
    lens = [len(p) for p in workload["prompts"]] if "prompts" in workload else []
    if workload["kind"] == "cold":
        return roofline.prefill(cfg, lens, fmt.bytes_per_weight, fmt.kv_bytes), sum(lens)
    if workload["kind"] == "decode":
        steps = workload["new_tokens"] - 1
        return roofline.decode_run(cfg, lens, steps, fmt.bytes_per_weight, fmt.kv_bytes), steps * len(lens)
    return None


def bounds(cfg, spec: dict, fmt: roofline.Formats, rates: roofline.MachineRates) -> dict[str, tuple[float, str]]:
    """workload name -> (its figure's roofline in tokens/s, the binding roof)."""
    out = {}
    for workload in spec["workloads"]:
        work = workload_cost(cfg, workload, fmt)
        if work is not None:
            cost, tokens = work
            out[workload["name"]] = (tokens / rates.seconds(cost, fmt.compute), rates.limit(cost, fmt.compute))
    return out


def table(cfg, spec: dict, rates: roofline.MachineRates, formats: dict[str, roofline.Formats],
          measured: dict[str, dict[str, float]]) -> str:
    """One row per (prefill or decode figure, engine): measured tokens/s, its bound and the achieved fraction.
    `measured`: workload -> engine -> the figure (bench_peers.summarize)."""
    lines = ["| workload | engine | formats | measured tok/s | bound tok/s (limit) | of bound |",
             "|---|---|---|---:|---:|---:|"]
    for engine, fmt in formats.items():
        for name, (bound, limit) in bounds(cfg, spec, fmt, rates).items():
            value = measured.get(name, {}).get(engine)
            if value is not None:
                lines.append(f"| {name} | {engine} | {fmt.describe()} | {value:.0f} | {bound:.0f} ({limit}) | "
                             f"{value / bound:.0%} |")
    return "\n".join(lines)
