"""Sampler: greedy, temperature, top-k, top-p, min-p, and per-request seeds."""

from __future__ import annotations

import math

import pytest
import torch
from test_model_support import one_torch_thread

from radixserve.layers.sampler import Sampler, SamplingBatchInfo
from radixserve.sampling_params import SamplingParams

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

VOCAB = 16


def _logits_from_probs(probs: list[float], rows: int) -> torch.Tensor:
    padded = probs + [0.0] * (VOCAB - len(probs))
    logits = torch.log(torch.tensor(padded, dtype=torch.float32).clamp_min(1e-30))
    return logits.expand(rows, VOCAB).clone()


def _sample(logits: torch.Tensor, params: list[SamplingParams], output_lens=None, sampler=None, **kw) -> list[int]:
    info = SamplingBatchInfo.from_params(params, output_lens or [0] * len(params), "cpu", **kw)
    return (sampler or Sampler(seed=0))(logits, info).tolist()


def _many(params: SamplingParams, probs: list[float], n: int = 4000) -> torch.Tensor:
    """n draws, one per row, each row with its own seed: a histogram over the vocabulary."""
    rows = [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(n)]
    tokens = _sample(_logits_from_probs(probs, n), rows)
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB).float() / n


def test_greedy_is_argmax():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1))
    assert _sample(logits, [SamplingParams(temperature=0)] * 5) == logits.argmax(-1).tolist()
    assert _sample(logits, [SamplingParams(temperature=0.8, top_k=1)] * 5) == logits.argmax(-1).tolist()


def test_mixed_greedy_and_sampled_rows():
    logits = _logits_from_probs([0.4, 0.35, 0.25], 64)
    params = [SamplingParams(temperature=0) if i % 2 else SamplingParams(seed=i) for i in range(64)]
    tokens = _sample(logits, params)
    assert all(t == 0 for t in tokens[1::2])
    assert len(set(tokens[0::2])) == 3


def test_temperature_one_follows_the_distribution():
    probs = [0.5, 0.3, 0.15, 0.05]
    freq = _many(SamplingParams(temperature=1.0), probs)
    for p, f in zip(probs, freq[:4].tolist(), strict=True):
        assert abs(f - p) < 4 * math.sqrt(p * (1 - p) / 4000) + 1e-3
    assert freq[4:].sum() == 0


def test_low_temperature_sharpens():
    freq = _many(SamplingParams(temperature=0.25), [0.5, 0.3, 0.15, 0.05])
    expected = torch.tensor([0.5, 0.3, 0.15, 0.05]) ** 4
    expected /= expected.sum()
    assert abs(freq[0].item() - expected[0].item()) < 0.03


def test_top_k():
    freq = _many(SamplingParams(top_k=2), [0.4, 0.3, 0.2, 0.1])
    assert freq[2:].sum() == 0 and freq[0] > 0.5 and freq[1] > 0.35


def test_top_p_keeps_the_smallest_nucleus():
    freq = _many(SamplingParams(top_p=0.7), [0.5, 0.3, 0.15, 0.05])
    assert freq[2:].sum() == 0 and abs(freq[0].item() - 0.5 / 0.8) < 0.04


def test_top_p_always_keeps_the_top_token():
    freq = _many(SamplingParams(top_p=0.01), [0.5, 0.3, 0.2], n=200)
    assert freq[0] == 1.0


def test_min_p():
    freq = _many(SamplingParams(min_p=0.5), [0.5, 0.3, 0.15, 0.05])
    assert freq[2:].sum() == 0 and freq[1] > 0.3


def test_seed_gives_the_same_token_in_any_batch():
    g = torch.Generator().manual_seed(3)
    target = torch.randn(1, VOCAB, generator=g)
    others = torch.randn(6, VOCAB, generator=g)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    plain = SamplingParams(temperature=1.0)
    alone = _sample(target, [seeded], output_lens=[5])
    for position in range(4):
        rows = torch.cat([others[:position], target, others[position:]])
        params = [plain] * position + [seeded] + [plain] * (6 - position)
        lens = [0] * position + [5] + [9] * (6 - position)
        got = _sample(rows, params, output_lens=lens, sampler=Sampler(seed=position))
        assert got[position] == alone[0]


def test_seeded_stream_advances_with_the_output_index():
    logits = torch.zeros(1, VOCAB)  # uniform
    tokens = [_sample(logits, [SamplingParams(seed=7)], output_lens=[i])[0] for i in range(40)]
    assert len(set(tokens)) > 8
    assert tokens == [_sample(logits, [SamplingParams(seed=7)], output_lens=[i])[0] for i in range(40)]


def test_unseeded_rows_reproducible_from_generator_seeds():
    logits = torch.zeros(32, VOCAB)
    params = [SamplingParams()] * 32
    a = _sample(logits, params, default_generator_seed=11)
    b = _sample(logits, params, default_generator_seed=11, sampler=Sampler(seed=99))
    assert a == b
    assert _sample(logits, params, sampler=Sampler(seed=5)) == _sample(logits, params, sampler=Sampler(seed=5))


def test_unseeded_stream_advances_between_batches():
    """The same default seed every step must not replay the same noise (tokens would repeat)."""
    logits = torch.zeros(32, VOCAB)
    params = [SamplingParams()] * 32
    sampler = Sampler(seed=5)
    steps = [_sample(logits, params, sampler=sampler, default_generator_seed=3) for _ in range(3)]
    assert steps[0] != steps[1] != steps[2]
    fresh = Sampler()
    assert steps == [_sample(logits, params, sampler=fresh, default_generator_seed=3) for _ in range(3)]
