"""Embedding requests in the scheduler on the fake model of test_scheduler_fake.py (fast, no weights).

The fake's "hidden state" of a row is computed from the token ids it reads back from KV, so a pooled vector equals
the reference only when every row the request pools was computed over the right slots: the last row over the whole
prompt (a cached prefix included), every row of every chunk exactly once for mean pooling. Runs beside generation,
and the KV conservation identity is checked after every step (`drain`).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_scheduler_fake import FakeRunner, FakeScheduler, conserve, drain, next_token, reference, submit

from radixserve.protocol.io_struct import TokenizedGenerateReqInput
from radixserve.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs


def row_vector(token: int) -> list[float]:
    return [1.0, float(token), float(token * token % 97)]


def normalized(v: list[float]) -> list[float]:
    n = math.sqrt(sum(x * x for x in v))
    return [x / n for x in v]


def expected_last(prompt: list[int]) -> list[float]:
    return normalized([1.0, float(next_token(prompt) + 1), float(len(prompt))])


def expected_mean(prompt: list[int]) -> list[float]:
    return normalized([sum(col) for col in zip(*(row_vector(t) for t in prompt), strict=True)])


class PoolingRunner(FakeRunner):
    """FakeRunner that also pools as the model does (layers/pooler.py): the last row's vector, a function of
    the whole sequence read back from KV; or the sum over this forward's rows of a function of each row's token."""

    def forward(self, fb, read_done=None) -> torch.Tensor:
        logits = super().forward(fb, read_done)
        if fb.pooling is None:
            return logits
        table = self.req_to_token_pool.req_to_token
        pooled = torch.zeros(fb.batch_size, 3)
        for i, (mode, row, pre, ext) in enumerate(zip(fb.pooling, fb.req_pool_indices.tolist(),
                                                      fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, strict=True)):
            seq = self.kv[table[row, : pre + ext].long()].tolist()
            if mode == "mean":
                pooled[i] = torch.tensor([row_vector(t) for t in seq[pre:]]).sum(0)
            else:
                pooled[i] = torch.tensor([1.0, float(next_token(seq) + 1), float(len(seq))])
        fb.pooled_hidden = pooled
        return logits


def make(chunk: int = -1):
    args = ServerArgs(max_total_tokens=512, chunked_prefill_size=chunk)
    outputs: dict[str, dict] = {}

    def sink(out) -> None:
        for o in out.outputs:
            rec = outputs.setdefault(o.rid, {"ids": [], "finish": None, "embedding": None})
            rec["ids"].extend(o.new_token_ids)
            rec["finish"], rec["cached"] = o.finished_reason, o.cached_tokens
            rec["embedding"] = o.embedding if o.embedding is not None else rec["embedding"]

    return FakeScheduler(args, PoolingRunner(512, max_running=8), output_sink=sink), outputs


def run(sched, overlap: bool) -> None:
    """Until idle in the normal or the overlap loop, checking the KV conservation identity after every step."""
    if not overlap:
        drain(sched)
        return
    sched.run_until_idle_overlap(on_step=lambda: conserve(sched))
    conserve(sched)
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size


def embed(sched, rid: str, prompt: list[int], pooling: str) -> None:
    sched.input_queue.put(TokenizedGenerateReqInput(rid, prompt, SamplingParams(max_new_tokens=0), embed=pooling))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("chunk", [-1, 16])
def test_last_pooling_beside_generation_and_from_the_cache(chunk: int, overlap: bool) -> None:
    sched, outputs = make(chunk)
    prompt = [(7 * i) % 100 + 1 for i in range(40)]
    sp = submit(sched, "gen", prompt[:30] + [5, 6], max_new_tokens=6, ignore_eos=True)
    embed(sched, "e1", prompt, "last")
    run(sched, overlap)
    assert outputs["gen"]["ids"] == reference(prompt[:30] + [5, 6], sp)
    e1 = outputs["e1"]
    assert e1["ids"] == [] and e1["finish"] == {"type": "length", "length": 0}
    assert e1["embedding"] == pytest.approx(expected_last(prompt), abs=1e-6)
    embed(sched, "e2", prompt + [9], "last")  # its prompt's head is in the tree: only the new token is computed
    run(sched, overlap)
    assert outputs["e2"]["cached"] == len(prompt)
    assert outputs["e2"]["embedding"] == pytest.approx(expected_last(prompt + [9]), abs=1e-6)


@pytest.mark.parametrize("overlap", [False, True])
def test_mean_pooling_adds_chunks_and_never_reuses_a_prefix(overlap: bool) -> None:
    sched, outputs = make(chunk=16)
    prompt = [(11 * i) % 90 + 3 for i in range(50)]  # NOTE: four 16-token chunks
    embed(sched, "m1", prompt, "mean")
    run(sched, overlap)
    assert outputs["m1"]["embedding"] == pytest.approx(expected_mean(prompt), abs=1e-6)
    embed(sched, "m2", prompt, "mean")
    submit(sched, "gen", prompt, max_new_tokens=2, ignore_eos=True)
    run(sched, overlap)
    assert outputs["m2"]["cached"] == 0 and outputs["m2"]["embedding"] == pytest.approx(outputs["m1"]["embedding"])
    assert outputs["gen"]["cached"] == len(prompt) - 1  # NOTE: the embedding's prompt went into the tree
