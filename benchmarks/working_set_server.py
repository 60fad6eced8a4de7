"""The servers of benchmarks/bench_hicache_working_set.py: their commands, start and stop, /metrics, the per-tier
split of the prompt tokens, agent sessions and the KV conservation check at the end."""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_peers_http import wait_ready  # noqa: E402
from peer_config import VLLM_BLOCK_SIZE, vllm_cpu_env  # noqa: E402

SERVED_NAME = "smollm2"
WARMUP_IDS = [100 + i for i in range(16)]  # NOTE: shorter than a storage page: the warm-up stores nothing
SESSION_TTL_S = 24 * 3600  # NOTE: a round of a full-size cold side takes longer than the default idle timeout


def kv_bytes_per_token(folder: Path, dtype: str) -> int:
    """K and V of every layer for one token in `dtype`, from the folder's config.json."""
    import json

    cfg = json.loads((folder / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * (4 if dtype == "float32" else 2)


def server_command(side: str, args: argparse.Namespace, shape, folder: Path, dtype: str,
                   storage: str | None) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment of one side's server."""
    pool = round(args.pool_fraction * shape.sessions * shape.session_tokens)
    context = shape.session_tokens + 256
    if side == "vLLM":
        # NOTE: its CPU KV space is whole GiB; the block count override cuts it to the same pool as radixserve's
        space = math.ceil(pool * kv_bytes_per_token(folder, dtype) / 2**30)
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--port",
               str(args.port), "--dtype", dtype, "--served-model-name", SERVED_NAME, "--enable-prefix-caching",
               "--max-model-len", str(context), "--max-num-seqs", "64", "--block-size", str(VLLM_BLOCK_SIZE),
               "--num-gpu-blocks-override", str(pool // VLLM_BLOCK_SIZE), "--enable-prompt-tokens-details"]
        env = {**vllm_cpu_env(), "VLLM_CPU_KVCACHE_SPACE": str(space), "VLLM_SERVER_DEV_MODE": "1"}
        return cmd, env
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(args.port),
           "--served-model-name", SERVED_NAME, "--max-total-tokens", str(pool), "--context-length", str(context),
           "--log-level", "warning", *shlex.split(args.radixserve_args)]
    if side == "tiers on":
        size = 2 * shape.sessions * shape.session_tokens * kv_bytes_per_token(folder, dtype) + 2**30
        cmd += ["--enable-hierarchical-cache", "--hicache-storage-dir", str(storage), "--hicache-storage-size",
                str(size), "--hicache-ratio", str(args.hicache_ratio), "--hicache-write-policy", args.write_policy]
    root = str(HERE.parent)
    return cmd, {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}


@contextmanager
def served(cmd: list[str], env: dict[str, str], port: int, log: Path) -> Iterator[str]:
    """A fresh server (output in `log`), warmed up by one short request and with an empty prefix cache; yields
    its URL and stops it after."""
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        wait_ready(url, proc)
        body = {"model": SERVED_NAME, "prompt": WARMUP_IDS, "max_tokens": 4, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=600)
        assert r.status_code == 200, f"warm-up: HTTP {r.status_code} {r.text[:300]}"
        reset = "/reset_prefix_cache" if "vllm" in " ".join(cmd) else "/flush_cache"
        r = httpx.post(url + reset, timeout=600)
        assert r.status_code == 200, f"{reset}: HTTP {r.status_code} {r.text[:300]}"  # NOTE: vLLM: dev mode on
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def metrics(url: str) -> dict[str, float]:
    """/metrics as {name: value}, the samples of one name summed over their labels."""
    out: dict[str, float] = {}
    for ln in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        m = _SAMPLE.match(ln)
        if m and not ln.startswith("#"):
            try:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
            except ValueError:
                continue
    return out


def tier_split(side: str, before: dict, after: dict, results: list, source: str = "usage") -> dict[str, float]:
    """The prompt tokens of one round by where their KV came from. radixserve: from each response's
    `usage.prompt_tokens_details.cached_tokens_details` (`source` "usage", where every response has it) or from
    the /metrics counters (device = cached tokens not loaded from a tier); vLLM (one tier): its usage's cached
    tokens, or its prefix-cache hits in /metrics."""
    d = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
    prompt = sum(r.prompt_tokens for r in results)
    if side == "vLLM":
        hits = sum(r.cached_tokens for r in results) or d("vllm:prefix_cache_hits_total")
        return {"device": hits, "computed": prompt - hits}
    if d("radixserve:prompt_tokens_total") != prompt:
        raise RuntimeError(f"/metrics counted {d('radixserve:prompt_tokens_total')} prompt tokens for {prompt} sent")
    details = [r.details.get("cached_tokens_details") for r in results]
    if source == "usage" and all(details):
        split = {k: float(sum(x[k] for x in details)) for k in ("device", "host", "storage")}
        return {**split, "computed": prompt - sum(r.cached_tokens for r in results)}
    cached = d("radixserve:cached_tokens_total")
    host, storage = d("radixserve:hicache_host_loaded_tokens_total"), d("radixserve:hicache_storage_loaded_tokens_total")
    return {"device": cached - host - storage, "host": host, "storage": storage, "computed": prompt - cached}


def open_sessions(client: httpx.Client, sessions: list) -> None:
    for s in sessions:
        r = client.post("/open_session", json={"session_id": f"ws-{s.index}", "ttl_s": SESSION_TTL_S})
        assert r.status_code == 200, f"open_session: HTTP {r.status_code} {r.text[:300]}"
        s.session_id = r.json()


def check_conservation(client: httpx.Client, sessions: list, timeout_s: float = 120.0) -> str:
    """Closes the sessions, waits until the server is idle, and checks the KV conservation identity in
    /get_server_info's `kv_accounting`: free + evictable + protected + request-private == pool, nothing protected
    (no session pins left), no request row in use. Raises if it does not hold; returns it as a line."""
    for s in sessions:
        if s.session_id is not None:
            r = client.post("/close_session", json={"session_id": s.session_id})
            assert r.status_code == 200, f"close_session: HTTP {r.status_code} {r.text[:300]}"
    deadline = time.monotonic() + timeout_s
    while True:
        info = client.get("/get_server_info").json()
        state = info["scheduler_state"]
        acc = state["kv_accounting"]
        if info["in_flight_requests"] == 0 and state["num_running_reqs"] == 0 and acc["idle"]:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not idle after {timeout_s} s: {acc}")
        time.sleep(0.2)
    terms = acc["available"] + acc["pending_free"] + acc["evictable"] + acc["protected"] + acc["request_private"]
    ok = (acc["holds"] and terms == acc["size"] == state["max_total_num_tokens"] and acc["protected"] == 0
          and acc["req_rows_in_use"] == 0 and state.get("open_sessions", 0) == 0)
    line = (f"{'holds' if ok else 'FAILS'}: free {acc['available'] + acc['pending_free']} + evictable "
            f"{acc['evictable']} + protected {acc['protected']} + request-private {acc['request_private']} = "
            f"{terms} of {acc['size']} slots")
    if not ok:
        raise RuntimeError(f"KV conservation {line}: {acc}")
    return line
