"""The decode graph runner's buckets, padding, buffer refill and refusals, on the CPU: its graph object is a
stand-in that reruns the captured function at replay (what a CUDA graph does, minus the launch savings), over the
same static buffers. The attention backends' capture / replay hooks run for real (torch; triton in its interpreter)
under a one-layer model, against the eager path."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # NOTE: before any triton kernel module is imported

from radixserve.forward_batch import ForwardBatch  # noqa: E402
from radixserve.layers.attention.registry import create_attention_backend  # noqa: E402
from radixserve.layers.attention.torch_backend import TorchAttnBackend  # noqa: E402
from radixserve.layers.radix_attention import RadixAttention  # noqa: E402
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from radixserve.model_executor.cuda_graph_runner import (  # noqa: E402
    PAD_ROW,
    PAD_SLOT,
    GraphDecodeRunner,
    GraphPlan,
    capture_bs_list,
    plan_cuda_graphs,
)
from radixserve.server_args import ServerArgs  # noqa: E402

CPU = torch.device("cpu")
VOCAB, DIM, HEADS, KV_HEADS = 11, 16, 2, 1


class EagerGraph:
    """The CPU stand-in for a CUDA graph: capture runs the function once and keeps its output as the static one;
    replay runs it again over the same buffers and writes the result into that output."""

    def __init__(self) -> None:
        self.fn, self.out, self.replays = None, None, 0

    def capture(self, fn):
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())
        self.replays += 1


def test_bucket_sizes():
    assert capture_bs_list(160)[:6] == (1, 2, 4, 8, 16, 24) and capture_bs_list(160)[-1] == 160
    assert capture_bs_list(20) == (1, 2, 4, 8, 16, 20)
    assert capture_bs_list(3) == (1, 2, 3)


def test_plan_says_why_graphs_are_off():
    cuda = torch.device("cuda")  # NOTE: only its type is read: no CUDA needed
    args = ServerArgs()
    assert plan_cuda_graphs(args, CPU, None).bs_list == () and "not a CUDA device" in plan_cuda_graphs(args, CPU, None).reason
    assert plan_cuda_graphs(args.replace(disable_cuda_graph=True), cuda, None).reason == "--disable-cuda-graph"
    assert plan_cuda_graphs(args, cuda, "no hooks").reason == "no hooks"
    assert plan_cuda_graphs(args.replace(enable_lora=True), cuda, None).bs_list == ()
    assert plan_cuda_graphs(args, cuda, None, max_running_requests=40).max_bs == 40
    assert plan_cuda_graphs(args, cuda, None).max_bs == 160
    spec = plan_cuda_graphs(args.replace(cuda_graph_max_bs=12, speculative_algorithm="ngram"), cuda, None)
    assert spec.bs_list == (1, 2, 4, 8, 12) and "verify steps run eagerly" in spec.reason
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        ServerArgs(cuda_graph_max_bs=0)


class TinyModel:
    """One attention layer between embeddings and a vocabulary projection: logits of each decode row."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(3)
        self.q, self.k, self.v = (torch.randn(VOCAB, n * DIM, generator=gen) for n in (HEADS, KV_HEADS, KV_HEADS))
        self.out = torch.randn(HEADS * DIM, VOCAB, generator=gen)
        self.layer = RadixAttention(0, HEADS, KV_HEADS, DIM, DIM**-0.5)
        self.calls = 0

    def __call__(self, fb: ForwardBatch) -> torch.Tensor:
        self.calls += 1
        ids = fb.input_ids
        q = (self.q[ids] * (1 + fb.positions.unsqueeze(1))).view(-1, HEADS, DIM)
        k, v = self.k[ids].view(-1, KV_HEADS, DIM), self.v[ids].view(-1, KV_HEADS, DIM)
        return fb.attn_backend.forward(q, k, v, self.layer, fb) @ self.out


def _setup(backend_name: str, max_bs: int = 4, buckets: tuple[int, ...] | None = None):
    pool = MHATokenToKVPool(64, 1, torch.float32, KV_HEADS, DIM, 1, CPU)
    req_to_token = ReqToTokenPool(6, 24, CPU)
    gen = torch.Generator().manual_seed(5)
    pool.k_buffer[0][1:] = torch.randn(64, KV_HEADS, DIM, generator=gen)
    pool.v_buffer[0][1:] = torch.randn(64, KV_HEADS, DIM, generator=gen)
    backend = create_attention_backend(backend_name, CPU, cascade=False)
    if backend_name == "triton":
        backend.num_kv_splits = 2  # NOTE: fewer interpreted programs; the split count is a launch constant
    template = ForwardBatch.for_decode([0], [0], [1], torch.zeros(1, dtype=torch.int32), CPU)
    template.req_to_token_pool, template.token_to_kv_pool, template.attn_backend = req_to_token, pool, backend
    model = TinyModel()
    runner = GraphDecodeRunner(GraphPlan(buckets or capture_bs_list(max_bs), "test"), backend, model, template,
                               req_to_token.req_to_token.shape[1], CPU, graph_factory=EagerGraph)
    return runner, model, template


def _decode(template: ForwardBatch, rows: list[int], seq_lens: list[int], ids: list[int]) -> ForwardBatch:
    """Request `rows` at `seq_lens` (their req_to_token rows filled: row r's position i is slot 8 * r + i + 1)."""
    table = template.req_to_token_pool.req_to_token
    for row, n in zip(rows, seq_lens, strict=True):
        table[row, :n] = torch.arange(n, dtype=torch.int32) + 8 * row + 1
    loc = torch.tensor([8 * r + n for r, n in zip(rows, seq_lens, strict=True)], dtype=torch.int32)
    fb = ForwardBatch.for_decode(ids, rows, seq_lens, loc, CPU)
    fb.req_to_token_pool, fb.token_to_kv_pool = template.req_to_token_pool, template.token_to_kv_pool
    fb.attn_backend = template.attn_backend
    return fb


def _eager(runner: GraphDecodeRunner, model: TinyModel, fb: ForwardBatch) -> torch.Tensor:
    runner.backend.init_forward_metadata(fb)
    return model(fb)


# NOTE: these batches live on the CPU, which compiled Triton kernels cannot read: on a GPU machine (no interpreter)
# the Triton backend's graphs run for real in tests/test_cuda_graphs.py instead
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None or not INTERPRETED,
    reason="triton is not installed, or runs compiled (GPU): tests/test_cuda_graphs.py"))]


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_replay_matches_eager_and_padding_touches_no_real_slot(backend_name):
    runner, model, template = _setup(backend_name, buckets=(2, 4))
    runner.capture()
    assert sorted(runner.captured) == [2, 4] and model.calls == 2 * 3  # two warm-ups and the capture each
    assert all(c.meta.graph for c in runner.captured.values())
    pool = template.token_to_kv_pool
    read = []
    for rows, lens, ids in [([1, 2, 3], [5, 2, 7], [3, 4, 5]), ([4, 1, 2, 3], [6, 5, 2, 7], [1, 3, 4, 5]),
                            ([5], [8], [2])]:
        fb = _decode(template, rows, lens, ids)
        want = _eager(runner, model, fb)  # NOTE: writes the same K/V at the same slots as the replay will
        before = [b.clone() for b in (pool.k_buffer[0], pool.v_buffer[0])]
        got = runner.replay(fb, read_done=SimpleNamespace(record=lambda: read.append(1)))
        assert got.shape == (len(rows), VOCAB)
        assert torch.allclose(got, want, atol=1e-5), backend_name
        for buffer, old in zip((pool.k_buffer[0], pool.v_buffer[0]), before, strict=True):
            changed = (buffer != old).any(-1).any(-1).nonzero().flatten().tolist()
            assert set(changed) <= {PAD_SLOT}, changed  # padded rows write slot 0 only
        bucket = runner.bucket(len(rows))
        buffers = runner.buffers
        assert buffers.req_pool_indices[len(rows) : bucket].eq(PAD_ROW).all()
        assert buffers.seq_lens[len(rows) : bucket].eq(1).all()
        assert buffers.out_cache_loc[len(rows) : bucket].eq(PAD_SLOT).all()
        assert fb.attn_metadata is runner.captured[bucket].meta
    assert len(read) == 3 and runner.replays == 3
    assert runner.captured[4].graph.replays == 2 and runner.captured[2].graph.replays == 1


def test_stale_rows_are_refilled_as_padding():
    """A 3-row batch after a 4-row one in the same bucket: row 3 is padding again, not the old request."""
    runner, model, template = _setup("torch")
    runner.capture()
    runner.replay(_decode(template, [4, 1, 2, 3], [6, 5, 2, 7], [1, 3, 4, 5]))
    assert runner.buffers.req_pool_indices[3] == 3
    fb = _decode(template, [1, 2, 3], [6, 3, 8], [2, 2, 2])
    want = _eager(runner, model, fb)
    got = runner.replay(fb)
    assert torch.allclose(got, want, atol=1e-5)
    assert runner.buffers.req_pool_indices[3] == PAD_ROW and runner.buffers.seq_lens[3] == 1
    table = runner.backend.graph_tables
    assert table.mask[3, 0] == 0 and torch.isinf(table.mask[3, 1:]).all()  # the padded row sees slot 0 alone


def test_refusals_and_eager_verify_count():
    runner, _, template = _setup("torch", max_bs=2)
    fb = _decode(template, [1, 2], [3, 4], [1, 1])
    assert runner.refusal(fb) is None
    assert "over --cuda-graph-max-bs 2" in runner.refusal(_decode(template, [1, 2, 3], [3, 4, 5], [1, 1, 1]))
    extend = ForwardBatch.for_extend([1, 2], [1], [0], [2], torch.tensor([1, 2], dtype=torch.int32), CPU)
    assert runner.refusal(extend) == "not a decode batch"
    fb.verify = object()
    assert "verify" in runner.refusal(fb)
    runner.note_eager(fb)
    runner.note_eager(fb)
    assert runner.eager_verify_steps == 2
    fb.verify, fb.lora_adapters = None, [None, None]
    assert runner.refusal(fb) == "a LoRA batch"


def test_backends_declare_their_graph_support():
    assert TorchAttnBackend.graph_refusal() is None
    assert "sliding-window" in TorchAttnBackend.graph_refusal(windows=(8,))
    assert TorchAttnBackend.graph_refusal(context_len=4096) is None
    assert "as wide as the context" in TorchAttnBackend.graph_refusal(context_len=32768)
    with pytest.raises(ValueError, match="no batch sizes"):
        GraphDecodeRunner(GraphPlan((), "off"), TorchAttnBackend(), lambda fb: None, None, 8, CPU)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from test_head_shapes import _tiny_llama

    return _tiny_llama(tmp_path_factory.mktemp("graphs"), 64, 4, 1)


@pytest.mark.parametrize("normal_loop", [False, pytest.param(True, marks=pytest.mark.long)], ids=["overlap", "normal"])
def test_engine_decode_replays_through_the_model_runner(tiny_llama, normal_loop):
    """ModelRunner's graph path under the scheduler on the CPU (the stand-in graph): decode steps of either loop
    replay buckets (ragged batches: padded rows), greedy ids equal an eager engine's, the KV identity holds."""
    from test_model_gemma3 import _prompts
    from test_model_support import assert_engine_conserved

    from radixserve import Engine

    prompts = _prompts([5, 17, 9, 30, 2], seed=11)
    params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    outs = {}
    for graphs in (True, False):
        with Engine(model_path=str(tiny_llama), dtype="float32", device="cpu", max_total_tokens=1024,
                    disable_overlap_schedule=normal_loop, log_level="warning") as engine:
            runner = engine.model_runner
            assert runner.cuda_graphs is None and runner.execution_plan.choice("cuda graphs") == "off"
            if graphs:
                runner.init_cuda_graphs(GraphPlan((2, 4, 8), "test"), EagerGraph)
            first = engine.generate(input_ids=prompts[0], sampling_params=params)  # one row: bucket 2, padded
            rest = engine.generate(input_ids=prompts[1:], sampling_params=params)
            outs[graphs] = [r["output_ids"] for r in [first, *rest]]
            assert_engine_conserved(engine)
            if graphs:
                assert runner.cuda_graphs.replays >= 2 * (params["max_new_tokens"] - 1)
    assert outs[True] == outs[False]
