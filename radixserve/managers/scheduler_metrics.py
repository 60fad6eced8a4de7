"""Scheduler counters and the per-batch log lines (SGLang's "Prefill batch." / "Decode batch.")."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from radixserve.speculative.cost import accept_length, accept_rate


@dataclass
class SchedulerStats:
    """Monotonic counters since start (never reset by flush_cache); exported by get_internal_state."""

    num_requests: int = 0  # accepted into the waiting queue
    num_finished: int = 0  # ended with stop or length
    num_aborts: int = 0  # ended with abort (client abort, rejection, out of memory)
    num_rejected: int = 0  # of the aborts: refused at admission
    num_queue_timeouts: int = 0  # of the aborts: waited longer than --queue-timeout
    num_retractions: int = 0
    peak_running_reqs: int = 0  # the largest decode batch so far
    jump_forward_tokens: int = 0  # output tokens a grammar forced, appended without a decode step
    num_jump_forwards: int = 0
    grammar_rows_masked: int = 0  # grammar rows whose token mask was filled before sampling
    grammar_rows_checked: int = 0  # grammar rows sampled first, their token checked (constrained/batch_mask.py)
    grammar_rows_refused: int = 0  # of those, rows whose token the grammar refused: masked and sampled again
    spec_verify_steps: int = 0  # speculative decoding: decode steps that verified at least one draft
    spec_draft_tokens: int = 0  # draft tokens proposed and verified
    spec_accepted_tokens: int = 0  # of those, accepted (each verify also yields one token of the model's own)
    prompt_tokens: int = 0  # Σ prompt lengths of admitted requests (first prefill only)
    cached_tokens: int = 0  # Σ of their cache hits (first prefill only)
    generated_tokens: int = 0
    evicted_tokens: int = 0
    prefill_tokens_computed: int = 0  # every extend token run, re-prefills after retraction included
    num_prefill_batches: int = 0
    num_decode_batches: int = 0
    prefill_forward_s: float = 0.0  # wall time in run_batch (forward + sampling), by batch kind
    decode_forward_s: float = 0.0
    cache_ops_s: float = 0.0  # wall time in radix-cache work: matching, locking, inserting, releasing, evicting
    # the disk tier (mem_cache/hicache.py, --enable-hierarchical-cache): its store's counters, copied after each use
    hicache_loaded_tokens: int = 0  # tokens loaded from storage into the tree (they count as cached_tokens)
    hicache_storage_hits: int = 0  # pages read and verified
    hicache_storage_misses: int = 0
    hicache_bytes_written: int = 0
    hicache_bytes_read: int = 0
    hicache_corrupt_pages: int = 0
    hicache_host_loaded_tokens: int = 0  # of hicache_loaded_tokens, those from the host-memory tier (host_tier.py)
    hicache_storage_loaded_tokens: int = 0  # ... and those from the storage backend
    hicache_host_hits: int = 0  # host tier: pages found / looked for and absent
    hicache_host_misses: int = 0
    hicache_host_usage_bytes: int = 0  # host tier: bytes held now (a gauge)
    hicache_load_seconds: float = 0.0  # wall time loading pages into the pool (reads + pool writes)
    hicache_store_seconds: float = 0.0  # wall time storing pages (host copies + backend writes)
    started_at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "forward_time_s": self.prefill_forward_s + self.decode_forward_s,
                "spec_accept_rate": self.spec_accept_rate, "spec_accept_length": self.spec_accept_length}

    @contextmanager
    def timing(self, counter: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, counter, getattr(self, counter) + time.perf_counter() - start)

    @property
    def spec_accept_rate(self) -> float:
        return accept_rate(self.spec_accepted_tokens, self.spec_draft_tokens)

    @property
    def spec_accept_length(self) -> float:
        return accept_length(self.spec_accepted_tokens, self.spec_verify_steps)

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class DecodeThroughput:
    """Generated tokens per second over the decode steps since the last decode log line."""

    def __init__(self) -> None:
        self.tokens = 0
        self.since = time.perf_counter()

    def add(self, n: int) -> None:
        self.tokens += n

    def take(self) -> float:
        now = time.perf_counter()
        rate = self.tokens / max(now - self.since, 1e-9)
        self.tokens, self.since = 0, now
        return rate


def prefill_log_line(new_seq: int, new_token: int, cached_token: int, token_usage: float,
                     running_req: int, queue_req: int) -> str:
    return (f"Prefill batch. #new-seq: {new_seq}, #new-token: {new_token}, #cached-token: {cached_token}, "
            f"token usage: {token_usage:.2f}, #running-req: {running_req}, #queue-req: {queue_req}")


def decode_log_line(running_req: int, num_tokens: int, token_usage: float, gen_throughput: float,
                    queue_req: int) -> str:
    return (f"Decode batch. #running-req: {running_req}, #token: {num_tokens}, token usage: {token_usage:.2f}, "
            f"gen throughput (token/s): {gen_throughput:.2f}, #queue-req: {queue_req}")
