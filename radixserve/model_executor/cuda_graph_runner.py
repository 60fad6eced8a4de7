"""CUDA graphs for decode: each bucket's step captured once at start-up, then replayed (SGLang's CudaGraphRunner).

A decode step launches hundreds of small kernels whose launch cost, at small batches, is most of the step. Each
bucket batch size (`capture_bs_list`: 1, 2, 4, 8, then every 8 up to `--cuda-graph-max-bs`) is captured once, over
static input buffers; a decode batch of bs rows replays the smallest bucket >= bs:

1. its inputs are copied into the first bs rows of the static buffers, and the rows bs .. bucket are padding that
   touches no real slot: request row 0 (never handed out, all slot 0), length 1, position 0, written to slot 0
   (reserved by every allocator: "padded tokens write their K/V there", memory_pool.py);
2. the backend refills its captured metadata in place (`init_forward_metadata_replay`: the slot table copied from
   the rows just written), after which the forward has read `req_to_token` (`read_done` is recorded);
3. the graph replays, and the first bs rows of its static logits are the step's.

What runs eagerly instead, and why, is one decision (`GraphDecodeRunner.refusal`): extend batches, batches larger
than the largest bucket, speculative verify steps (k + 1 rows per request: counted and said once in the log), LoRA
batches, input-logprob batches. Which backend and model can be captured at all is `plan_cuda_graphs`'s (in the
execution plan with its reason). The graph object is a parameter (`graph_factory`): `TorchCudaGraph` on CUDA; the
tests run the same padding and refill logic with a stand-in that reruns the captured function.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from radixserve.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from radixserve.layers.attention.base import AttentionBackend, AttentionMetadata
    from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

DEFAULT_MAX_BS = 160  # SGLang's default on an 80 GB card for small models
PAD_ROW = 0  # NOTE: ReqToTokenPool row 0 is never handed out and stays all slot 0
PAD_SLOT = 0  # NOTE: slot 0 is never handed out by an allocator: padded rows write their K/V there


def capture_bs_list(max_bs: int) -> tuple[int, ...]:
    """The bucket sizes: 1, 2, 4, 8, then every 8 up to max_bs (which is always a bucket)."""
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_bs] + list(range(16, max_bs + 1, 8))
    return tuple(sorted(set(sizes) | {max_bs}))


@dataclass(frozen=True)
class GraphPlan:
    """Which decode batch sizes are captured (empty: none) and why (the execution plan's "cuda graphs" entry)."""

    bs_list: tuple[int, ...]
    reason: str

    @property
    def max_bs(self) -> int:
        return self.bs_list[-1] if self.bs_list else 0


def plan_cuda_graphs(args: ServerArgs, device: torch.device, backend_refusal: str | None,
                     max_running_requests: int | None = None) -> GraphPlan:
    """Graphs on CUDA unless switched off, the backend cannot (its `graph_refusal`), or LoRA is on (its segments are
    sized per batch); buckets up to --cuda-graph-max-bs (default: min(160, the running-request limit))."""
    if device.type != "cuda":
        return GraphPlan((), f"not a CUDA device ({device.type}): every step eager")
    if args.disable_cuda_graph:
        return GraphPlan((), "--disable-cuda-graph")
    if backend_refusal is not None:
        return GraphPlan((), backend_refusal)
    if args.lora_enabled:
        return GraphPlan((), "LoRA: the adapters' row segments are built per batch")
    cap = max_running_requests or args.max_running_requests or DEFAULT_MAX_BS
    max_bs = args.cuda_graph_max_bs or min(DEFAULT_MAX_BS, cap)
    sizes = capture_bs_list(max_bs)
    verify = "; speculative verify steps run eagerly" if args.speculative_algorithm != "none" else ""
    return GraphPlan(sizes, f"decode captured at {len(sizes)} batch sizes up to {max_bs}{verify}")


class Graph(Protocol):
    """What the runner needs of a graph: capture a function once (its outputs become static), replay it."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class TorchCudaGraph:
    """A torch.cuda.CUDAGraph sharing one memory pool with the other buckets (captured largest first)."""

    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


def cuda_graph_factory() -> Callable[[], Graph]:
    pool = torch.cuda.graph_pool_handle()
    return lambda: TorchCudaGraph(pool)


class DecodeBuffers:
    """The static inputs every bucket's graph reads: rows 0 .. max_bs - 1 of ids, positions, request rows, lengths
    and write slots."""

    def __init__(self, max_bs: int, device: torch.device) -> None:
        long = {"dtype": torch.int64, "device": device}
        self.input_ids = torch.zeros(max_bs, **long)
        self.positions = torch.zeros(max_bs, **long)
        self.req_pool_indices = torch.full((max_bs,), PAD_ROW, **long)
        self.seq_lens = torch.ones(max_bs, **long)
        self.out_cache_loc = torch.full((max_bs,), PAD_SLOT, dtype=torch.int32, device=device)

    def batch(self, bs: int, template: ForwardBatch | None = None) -> ForwardBatch:
        """A decode ForwardBatch over the first bs rows (the pools and backend copied from `template`)."""
        fb = ForwardBatch(ForwardMode.DECODE, bs, self.input_ids[:bs], self.positions[:bs],
                          self.req_pool_indices[:bs], self.seq_lens[:bs], self.out_cache_loc[:bs], [1] * bs)
        if template is not None:
            fb.req_to_token_pool, fb.token_to_kv_pool = template.req_to_token_pool, template.token_to_kv_pool
            fb.attn_backend = template.attn_backend
        return fb

    def fill(self, fb: ForwardBatch, bucket: int) -> None:
        """Rows 0 .. bs - 1 from `fb`; rows bs .. bucket - 1 padding that touches no real slot."""
        bs = fb.batch_size
        self.input_ids[:bs].copy_(fb.input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices)
        self.seq_lens[:bs].copy_(fb.seq_lens)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc)
        if bucket > bs:
            # NOTE: refilled every replay: a smaller batch after a larger one must not attend over stale real rows
            self.input_ids[bs:bucket].zero_()
            self.positions[bs:bucket].zero_()
            self.req_pool_indices[bs:bucket].fill_(PAD_ROW)
            self.seq_lens[bs:bucket].fill_(1)
            self.out_cache_loc[bs:bucket].fill_(PAD_SLOT)


@dataclass
class _Captured:
    graph: Graph
    batch: ForwardBatch  # over the static buffers
    meta: AttentionMetadata


class GraphDecodeRunner:
    """Captures `run_model` (a ForwardBatch -> float32 logits) for every bucket of `plan`, and replays it for decode
    batches it takes. `template` supplies the pools and backend (a ForwardBatch with them set)."""

    def __init__(self, plan: GraphPlan, backend: AttentionBackend, run_model: Callable[[ForwardBatch], torch.Tensor],
                 template: ForwardBatch, max_context_len: int, device: torch.device,
                 graph_factory: Callable[[], Graph] | None = None) -> None:
        if not plan.bs_list:
            raise ValueError(f"no batch sizes to capture ({plan.reason})")
        self.plan = plan
        self.backend = backend
        self.run_model = run_model
        self.buffers = DecodeBuffers(plan.max_bs, device)
        self.template = template
        self.graph_factory = graph_factory or cuda_graph_factory()
        backend.init_graph_state(plan.max_bs, max_context_len, device)
        self.captured: dict[int, _Captured] = {}
        # NOTE: one static output for every bucket (rows 0 .. bucket - 1), so the buckets' logits are not all held at
        # once (the sum over buckets of bucket x vocab floats: over 1 GB at a 150k vocabulary); set at capture
        self.logits: torch.Tensor | None = None
        self.capture_s = 0.0
        self.replays = 0
        self.eager_verify_steps = 0  # speculative verify steps that ran eagerly (logged once)

    def capture(self) -> float:
        """Captures every bucket once, largest first (the smaller ones reuse its memory); returns the seconds."""
        start = time.perf_counter()
        for bs in reversed(self.plan.bs_list):
            fb = self.buffers.batch(bs, self.template)
            meta = self.backend.init_forward_metadata_capture(fb)
            for _ in range(2):  # NOTE: warm-up outside the graph: autotuning, lazy allocations, kernel compiles
                warm = self.run_model(fb)
            if self.logits is None:
                self.logits = torch.empty(self.plan.max_bs, warm.shape[1], dtype=warm.dtype, device=warm.device)
            graph = self.graph_factory()
            graph.capture(lambda fb=fb: self._into_static(fb))
            self.captured[bs] = _Captured(graph, fb, meta)
        self.capture_s = time.perf_counter() - start
        logger.info("CUDA graphs: decode captured at %d batch sizes (%s) in %.2f s", len(self.captured),
                    ", ".join(map(str, self.plan.bs_list)), self.capture_s)
        return self.capture_s

    def _into_static(self, fb: ForwardBatch) -> torch.Tensor:
        out = self.logits[: fb.batch_size]
        out.copy_(self.run_model(fb))
        return out

    def refusal(self, fb: ForwardBatch) -> str | None:
        """None: `fb` replays a graph; else why it runs eagerly."""
        if not fb.forward_mode.is_decode():
            return "not a decode batch"
        if fb.verify is not None:
            return "a speculative verify step (k + 1 rows per request)"
        if fb.lora_adapters is not None:
            return "a LoRA batch"
        if fb.extra_logits_indices is not None:
            return "input logprobs"
        if fb.batch_size > self.plan.max_bs:
            return f"{fb.batch_size} rows, over --cuda-graph-max-bs {self.plan.max_bs}"
        return None

    def bucket(self, bs: int) -> int:
        return next(size for size in self.plan.bs_list if size >= bs)

    def note_eager(self, fb: ForwardBatch) -> None:
        """Counts a verify step that ran eagerly, and says so the first time."""
        if fb.verify is not None:
            self.eager_verify_steps += 1
            if self.eager_verify_steps == 1:
                logger.info("CUDA graphs: speculative verify steps run eagerly (only plain decode is captured)")

    def replay(self, fb: ForwardBatch, read_done: Any = None) -> torch.Tensor:
        """The logits of `fb` ([bs, vocab], a view of the static output: read it before the next replay, as the
        pipeline does, sampling on the same stream)."""
        bs = fb.batch_size
        bucket = self.bucket(bs)
        captured = self.captured[bucket]
        self.buffers.fill(fb, bucket)
        self.backend.init_forward_metadata_replay(captured.batch, captured.meta)
        if read_done is not None:
            read_done.record()  # NOTE: req_to_token rows are read: the scheduler may write them again
        captured.graph.replay()
        self.replays += 1
        fb.attn_metadata = captured.meta
        return self.logits[:bs]
