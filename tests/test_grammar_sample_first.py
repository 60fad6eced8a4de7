"""Grammar rows sampled first and masked only when refused (constrained/batch_mask.py): the same tokens for
greedy rows and the same distribution for temperature rows as masking every row first."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_model_support import one_torch_thread

from radixserve.constrained.batch_mask import BatchMask, checked_after_sampling
from radixserve.layers.sampler import Sampler, SamplingBatchInfo, compute_logprobs
from radixserve.sampling_params import SamplingParams

_single_thread = pytest.fixture(scope="module", autouse=True)(one_torch_thread)

VOCAB = 40  # two bitmask words


class SetGrammar:
    """A grammar that allows a fixed set of tokens next (counts what sampling asked of it)."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed
        self.checks = self.fills = 0

    def allows(self, token: int) -> bool:
        self.checks += 1
        return token in self.allowed

    def fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        self.fills += 1
        words = [0] * bitmask.shape[1]
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        bitmask[row] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def _fill(bitmask, rows):
    for row, grammar in rows:
        grammar.fill_row(bitmask, row)


def _info(params: list[SamplingParams], grammars: list[SetGrammar], mask_all: bool, **kw) -> SamplingBatchInfo:
    info = SamplingBatchInfo.from_params(params, [0] * len(params), "cpu", **kw)
    mask = BatchMask(torch.full((len(params), math.ceil(VOCAB / 32)), -1, dtype=torch.int32), [])
    rows = list(enumerate(grammars))
    checked = [] if mask_all else [(r, g) for r, g in rows if checked_after_sampling(params[r], False)]
    masked = [(r, g) for r, g in rows if (r, g) not in checked]
    mask.set_rows(masked, checked, _fill)
    info.grammar_mask = mask
    return info


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), allowed=st.sets(st.integers(0, VOCAB - 1), min_size=1, max_size=VOCAB))
def test_greedy_rows_get_the_masked_argmax(seed: int, allowed: set[int]) -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(seed))
    logits[0, sorted(allowed)[0]] = 100.0  # one row whose unmasked argmax is allowed
    expected = logits.masked_fill(~torch.isin(torch.arange(VOCAB), torch.tensor(sorted(allowed))), -math.inf)
    grammars = [SetGrammar(allowed) for _ in range(6)]
    params = [SamplingParams(temperature=0)] * 6
    tokens = Sampler(seed=0)(logits.clone(), _info(params, grammars, mask_all=False))
    assert tokens.tolist() == expected.argmax(-1).tolist()
    assert grammars[0].fills == 0 and grammars[0].checks == 1  # allowed at once: never masked


def test_temperature_rows_follow_the_masked_distribution() -> None:
    """Chi-square against the masked softmax: sample-first (unseeded and seeded rows) and mask-all, 20,000 rows
    each (fixed seeds)."""
    n, probs = 20_000, torch.tensor([0.30, 0.25, 0.15, 0.10, 0.08, 0.05, 0.04, 0.03] + [0.0] * (VOCAB - 8))
    allowed = {1, 3, 4, 6, 20}  # the most likely token is refused: ~70% of first draws are
    logits = torch.log(probs.clamp_min(1e-30)).expand(n, VOCAB).clone()
    target = torch.zeros(VOCAB)
    target[sorted(allowed)] = probs[sorted(allowed)]
    target /= target.sum()
    seeded = [SamplingParams(temperature=1.0, seed=i) for i in range(n)]  # a seeded row's second draw is its own
    for mask_all, params in ((False, [SamplingParams(temperature=1.0)] * n), (False, seeded), (True, seeded)):
        grammars = [SetGrammar(allowed) for _ in range(n)]
        tokens = Sampler(seed=1)(logits.clone(), _info(params, grammars, mask_all))
        counts = torch.bincount(tokens, minlength=VOCAB).double()
        assert set(tokens.tolist()) <= allowed
        support = target > 0
        expected = target[support].double() * n
        chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
        assert chi2 < 18.5, (mask_all, chi2)  # 4 degrees of freedom: p = 0.001
        refills = sum(g.fills for g in grammars)
        assert (refills == n) if mask_all else (0.5 * n < refills < 0.8 * n)


def test_a_seeded_row_draws_the_same_token_in_any_batch_and_position() -> None:
    allowed = {2, 5, 7}
    probs = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)), -1)
    row = torch.log(probs)
    seeded = SamplingParams(temperature=0.9, seed=1234)
    alone = Sampler(seed=0)(row.unsqueeze(0).clone(), _info([seeded], [SetGrammar(allowed)], False))
    others = [SamplingParams(temperature=0.7)] * 5
    batch = torch.stack([row] * 6)
    for position in (0, 3, 5):
        params = others[:position] + [seeded] + others[position:]
        tokens = Sampler(seed=position)(batch.clone(), _info(params, [SetGrammar(allowed) for _ in params], False))
        assert tokens[position].item() == alone.item()


def test_rows_with_filters_or_logprobs_are_masked_before_sampling() -> None:
    assert checked_after_sampling(SamplingParams(temperature=0), False)
    assert checked_after_sampling(SamplingParams(temperature=0.8), False)
    assert not checked_after_sampling(SamplingParams(temperature=0.8, top_p=0.9), False)
    assert not checked_after_sampling(SamplingParams(temperature=0.8, top_k=5), False)
    assert not checked_after_sampling(SamplingParams(temperature=0.8, min_p=0.1), False)
    assert not checked_after_sampling(SamplingParams(temperature=0), True)


def test_mask_all_switch_masks_every_row(monkeypatch) -> None:
    monkeypatch.setenv("RADIXSERVE_GRAMMAR_MASK_ALL", "1")
    assert not checked_after_sampling(SamplingParams(temperature=0), False)


def test_a_refused_row_s_logits_are_masked_for_its_logprobs() -> None:
    """A refused row is masked in place, so logprobs computed afterwards are the constrained ones."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 0] = 5.0  # token 0: the unmasked argmax, refused
    grammars = [SetGrammar({1, 2}), SetGrammar({0, 1})]
    info = _info([SamplingParams(temperature=0)] * 2, grammars, mask_all=False)
    work = logits.clone()
    tokens = Sampler(seed=0)(work, info)
    assert tokens.tolist() == [1, 0]
    lp = compute_logprobs(work, tokens, info, top_k=2)
    assert lp.top_logprobs[0].tolist() == pytest.approx([math.log(0.5)] * 2)
    assert lp.top_ids[0].tolist() in ([1, 2], [2, 1])
    assert info.grammar_mask.num_refused == 1 and grammars[1].fills == 0


def test_a_refused_greedy_row_takes_the_best_allowed_token() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4], logits[0, 5] = 1.0, 0.5, 0.9
    grammar = SetGrammar({4, 5})
    info = _info([SamplingParams(temperature=0)], [grammar], mask_all=False)
    assert Sampler(seed=0)(logits.clone(), info).tolist() == [5]
    assert grammar.checks == 1 and grammar.fills == 1
