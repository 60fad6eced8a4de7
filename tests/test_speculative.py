"""Speculative decoding (n-gram drafts, greedy verification): the drafter, the acceptance rule, and the
scheduler on a fake model that quotes its context, so drafts are often right and sometimes wrong.

The fake reads every token back from its "KV" (test_scheduler_fake.py): a verify row that attended over a
wrong slot, or a rejected draft's slot left in a row, changes the outputs, which must equal a plain greedy
loop token for token; the conservation identity is checked after every step.
"""

from __future__ import annotations

import random

import pytest

from radixserve.configs.speculative import SpecConfig
from radixserve.protocol.io_struct import AbortReq
from radixserve.server_args import ServerArgs
from radixserve.speculative.ngram import DraftBudget, NgramIndex
from radixserve.speculative.verify import VerifyInput, accept_greedy
from tests.test_scheduler_fake import VOCAB, conserve, drain, make_scheduler, next_token, reference, submit


def quoting(seq: list[int]) -> int:
    """The token after the latest earlier occurrence of the last 3 tokens, else a hash of the sequence; every
    seventh position a hash too, so some drafts fail."""
    if len(seq) >= 4 and len(seq) % 7:
        tail = seq[-3:]
        for start in range(len(seq) - 4, -1, -1):
            if seq[start: start + 3] == tail:
                return seq[start + 3]
    return next_token(seq)


# ---- the drafter --------------------------------------------------------------------------------
def test_ngram_index_takes_the_longest_suffix_and_its_latest_occurrence():
    index = NgramIndex(min_match=1, max_match=3)
    index.extend([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    # [6, 7] occurred twice before the end; the latest (followed by 9) wins, as far as the tokens go
    assert index.propose(4) == [9, 2, 6, 7]
    index.extend([9])
    # now the 3-gram [6, 7, 9] matches at 5..8: its continuation, not that of the shorter [7, 9]
    assert index.propose(2) == [2, 6]
    index.extend([3])
    assert index.propose(3) == []  # 3 never occurred before the end: no draft
    index.extend([3, 3])
    assert index.propose(5) == [3]  # the suffix never matches itself: only the one token after [3, 3] earlier


def test_ngram_index_ignores_matches_shorter_than_min_match():
    index = NgramIndex(min_match=2, max_match=4)
    index.extend([1, 2, 3, 9, 4, 3])
    assert index.propose(3) == []  # [3] matches but is shorter than 2; [4, 3] never occurred
    index.extend([9])
    assert index.propose(3) == [4, 3, 9]


def test_draft_budget_adapts_and_pauses_on_failure():
    budget = DraftBudget(max_tokens=6)
    assert budget.next_length() == 6
    budget.record(6, 6)
    assert budget.next_length() == 6
    budget.record(6, 1)
    assert 1 < budget.next_length() < 6  # shrinks toward what is accepted, plus one
    for _ in range(3):
        budget.record(budget.next_length() or 1, 0)
    paused = [budget.next_length() for _ in range(4)]
    assert paused == [0, 0, 0, 0]  # three verifies that accepted nothing: drafting pauses
    pause = budget.paused_steps
    assert pause > 0 and budget.paused_steps == pause  # asking for a length does not count the pause down
    for _ in range(pause):
        assert budget.next_length() == 0
        budget.tick()  # a decode step of the batch does
    assert budget.next_length() == 1
    budget.record(1, 1)
    assert budget.zero_streak == 0 and budget.next_length() == 2


def test_accept_greedy_keeps_the_matching_prefix_and_the_models_token():
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert accept_greedy([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accept_greedy([4, 5, 6], [8, 5, 6, 7]) == [8]
    assert accept_greedy([], [3]) == [3]


def test_verify_input_rows():
    verify = VerifyInput([[1, 2], [], [3]], [10, 20, 30])
    assert verify.row_counts == [3, 1, 2]
    assert verify.row_offsets() == [0, 3, 4]
    assert verify.last_rows("cpu").tolist() == [2, 3, 5]


def test_bad_speculative_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="speculative_algorithm"):
        ServerArgs(speculative_algorithm="eagle9")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        ServerArgs(speculative_algorithm="ngram", speculative_num_draft_tokens=0)
    with pytest.raises(ValueError, match="match lengths"):
        ServerArgs(speculative_algorithm="ngram", speculative_ngram_min_match=5, speculative_ngram_max_match=3)
    assert SpecConfig.of(ServerArgs()) is None
    assert SpecConfig.of(ServerArgs(speculative_algorithm="ngram")).num_draft_tokens == 6


# ---- the scheduler --------------------------------------------------------------------------------
def _spec_scheduler(**kw):
    return make_scheduler(rule=quoting, speculative_algorithm="ngram", **kw)


def _quoting_prompt(rng: random.Random) -> list[int]:
    """A prompt that repeats a random phrase, so the quoting model continues it."""
    phrase = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 12))]
    noise = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 6))]
    return noise + phrase * rng.randrange(1, 4) + phrase[: rng.randrange(3, len(phrase))]


def _run(sched, overlap: bool, steps_between: int = 0):
    if overlap:
        sched.init_overlap()
        sched.run_until_idle_overlap(20_000, on_step=lambda: conserve(sched))
        sched.close_overlap()
        conserve(sched)
    else:
        drain(sched)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_outputs_equal_plain_greedy_under_pressure(page_size, overlap):
    rng = random.Random(7 + page_size + 10 * overlap)
    # NOTE: a small pool and a tiny decode reserve over-admit, so decode retracts; chunks of 16 tokens
    sched, outputs = _spec_scheduler(pool_tokens=192, page_size=page_size, max_running=6, chunk=16,
                                     conservativeness=0.05)
    expected = {}
    for i in range(40):
        prompt = _quoting_prompt(rng) if i % 4 else [rng.randrange(1, VOCAB) for _ in range(rng.randrange(2, 30))]
        sp = submit(sched, f"r{i}", prompt, max_new_tokens=rng.randrange(1, 60), temperature=0.0,
                    ignore_eos=rng.random() < 0.7, stop_token_ids=[rng.randrange(1, VOCAB)] if i % 5 == 0 else [])
        expected[f"r{i}"] = reference(prompt, sp, quoting)
    _run(sched, overlap)
    for rid, want in expected.items():
        assert outputs[rid]["ids"] == want, rid
        assert outputs[rid]["finish"]["type"] in ("stop", "length")
    stats = sched.stats
    assert stats.spec_accepted_tokens > 0, "no draft was ever accepted: the test exercises nothing"
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens, "no draft was ever rejected"
    assert stats.num_retractions > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_aborts_mid_verify_leak_nothing(overlap):
    rng = random.Random(3)
    sched, outputs = _spec_scheduler(pool_tokens=512, max_running=8)
    expected = {}
    for i in range(16):
        prompt = _quoting_prompt(rng)
        expected[f"r{i}"] = reference(prompt, submit(sched, f"r{i}", prompt, max_new_tokens=60, temperature=0.0,
                                                     ignore_eos=True), quoting)
    if overlap:
        sched.init_overlap()
    step = sched.run_step_overlap if overlap else sched.run_step
    for n in range(12):
        step(block_when_idle=False)
        conserve(sched)
        if n % 3 == 2:
            sched.input_queue.put(AbortReq(f"r{n}"))
    _run(sched, overlap)
    aborted = [rid for rid, rec in outputs.items() if rec["finish"]["type"] == "abort"]
    assert aborted
    for rid, want in expected.items():
        got = outputs[rid]["ids"]
        assert got == want[: len(got)] if rid in aborted else got == want, rid
    assert sched.stats.spec_accepted_tokens > 0


def test_mixed_batch_greedy_and_sampled_requests():
    """A sampled request takes no draft: it runs its single row in the verify forward beside drafting ones."""
    rng = random.Random(11)
    sched, outputs = _spec_scheduler(pool_tokens=1024, max_running=8)
    expected = {}
    for i in range(6):
        prompt = _quoting_prompt(rng)
        sp = submit(sched, f"r{i}", prompt, max_new_tokens=30, temperature=0.0 if i % 2 else 0.8, ignore_eos=True)
        expected[f"r{i}"] = reference(prompt, sp, quoting)  # NOTE: the fake's sampler is an argmax for every row
    drain(sched)
    for rid, want in expected.items():
        assert outputs[rid]["ids"] == want, rid
    reqs_drafted = sched.stats.spec_verify_steps
    assert reqs_drafted > 0


def test_max_new_tokens_and_stop_tokens_end_a_draft():
    sched, outputs = _spec_scheduler(pool_tokens=1024, max_running=8)
    phrase = list(range(10, 22))
    prompt = phrase * 3
    # the quoting model continues the phrase, drafts run through whole phrases and must stop exactly
    want = reference(prompt, submit(sched, "len", prompt, max_new_tokens=17, temperature=0.0, ignore_eos=True),
                     quoting)
    submit(sched, "stop", prompt, max_new_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[15])
    drain(sched)
    assert outputs["len"]["ids"] == want and len(want) == 17 and outputs["len"]["finish"]["type"] == "length"
    assert outputs["stop"]["ids"] == [10, 11, 12, 13, 14, 15] and outputs["stop"]["finish"]["matched"] == 15
    assert sched.stats.spec_accepted_tokens >= 10


def test_spec_off_never_drafts():
    sched, outputs = make_scheduler(rule=quoting)
    prompt = list(range(10, 22)) * 3
    want = reference(prompt, submit(sched, "a", prompt, max_new_tokens=20, temperature=0.0, ignore_eos=True), quoting)
    drain(sched)
    assert sched.stats.spec_verify_steps == 0
    assert outputs["a"]["ids"] == want


# ---- speculative sampling -------------------------------------------------------------------------
def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.001 (z of the normal), Wilson-Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def chi_square(counts: dict, probs: dict, n: int) -> float:
    return sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in probs.items())


@pytest.mark.parametrize("draft", [0, 3, -1])
def test_sampler_keeps_the_target_distribution_against_a_draft(draft):
    """One row, many times: with a draft token d the row's token is still distributed as p (top-k applied)."""
    import torch

    from radixserve.layers.sampler import Sampler, SamplingBatchInfo
    from radixserve.sampling_params import SamplingParams

    n, logits = 40_000, torch.tensor([2.0, 0.5, 1.0, 1.5, -1.0, 0.0])
    params = SamplingParams(temperature=0.7, top_k=5)
    info = SamplingBatchInfo.from_params([params] * n, [0] * n, "cpu", default_generator_seed=1)
    info.draft_ids = torch.full((n,), draft, dtype=torch.int64)
    ids = Sampler()(logits.repeat(n, 1), info)
    p = torch.softmax(logits / 0.7, dim=-1)
    p[p.argmin()] = 0  # top-k 5 of 6
    p = p / p.sum()
    counts = {int(t): int(c) for t, c in zip(*torch.unique(ids, return_counts=True), strict=True)}
    assert counts.get(int(logits.argmin()), 0) == 0
    probs = {t: float(p[t]) for t in range(6) if p[t] > 0}
    assert chi_square(counts, probs, n) < chi_square_critical(len(probs) - 1), counts


class _ConditionalRunner:
    """A 3-token model: the next token's distribution depends on the last token, read back from KV; sampling is
    radixserve's Sampler, so the scheduler's verify steps run speculative sampling for real."""

    TABLE = [[1.2, 0.2, -0.5], [-0.3, 0.9, 0.4], [0.5, -0.4, 0.8]]

    def __new__(cls, pool_tokens: int, max_running: int):
        import torch

        from radixserve.layers.sampler import Sampler
        from tests.test_scheduler_fake import FakeRunner

        runner = FakeRunner(pool_tokens, 1, max_running)
        runner.model_config.vocab_size = 3
        runner.model_config.eos_token_ids = ()
        sampler, table = Sampler(num_rows=runner.req_to_token_pool.size + 1), torch.tensor(cls.TABLE)

        def forward(fb, read_done=None):
            rows = runner.req_to_token_pool.req_to_token
            last = [int(rows[r, n - 1]) for r, n in zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu, strict=True)]
            if read_done is not None:
                read_done.record()
            runner.kv[fb.out_cache_loc] = fb.input_ids
            return table[runner.kv[torch.tensor(last)]]

        runner.forward = forward
        runner.sample = lambda logits, info: sampler(logits, info)
        return runner


def test_speculative_sampling_output_distribution_end_to_end():
    """Thousands of seeded requests through the scheduler with n-gram drafts: the joint distribution of their
    first three tokens matches the model's (chi-square), and drafts were both kept and refused."""
    import itertools

    import torch

    from radixserve.managers.scheduler import Scheduler
    from radixserve.protocol.io_struct import TokenizedGenerateReqInput
    from radixserve.sampling_params import SamplingParams

    outputs: dict[str, list[int]] = {}

    def sink(out):
        for o in out.outputs:
            outputs.setdefault(o.rid, []).extend(o.new_token_ids)

    args = ServerArgs(max_total_tokens=8192, chunked_prefill_size=-1, speculative_algorithm="ngram",
                      speculative_ngram_min_match=1, speculative_max_verify_rows=1024, random_seed=5)
    sched = Scheduler(args, _ConditionalRunner(8192, 128), output_sink=sink)
    n, prompt = 3000, [0, 1, 2, 0, 1, 2, 0, 1]  # NOTE: drafts 2, 0, 1 ...: the n-gram continuation
    for i in range(n):
        params = SamplingParams(temperature=1.0, max_new_tokens=3, ignore_eos=True, seed=i)
        sched.input_queue.put(TokenizedGenerateReqInput(f"r{i}", prompt, params))
    sched.run_until_idle(100_000, on_step=lambda: conserve(sched))
    conserve(sched)
    p = torch.softmax(torch.tensor(_ConditionalRunner.TABLE), dim=-1)
    probs = {}
    for a, b, c in itertools.product(range(3), repeat=3):
        probs[(a, b, c)] = float(p[1, a] * p[a, b] * p[b, c])
    counts: dict = {}
    for ids in outputs.values():
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
    assert sum(counts.values()) == n
    assert chi_square(counts, probs, n) < chi_square_critical(26), counts
    stats = sched.stats
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens


# ---- drafts from the radix tree -------------------------------------------------------------------
def _tree(page_size: int = 1):
    import torch

    from radixserve.mem_cache.radix_cache import RadixCache
    from radixserve.mem_cache.radix_key import RadixKey

    tree = RadixCache(page_size=page_size)

    def insert(tokens, ns=None):
        tree.insert(RadixKey(tokens, ns), torch.arange(len(tokens), dtype=torch.int32))

    return tree, insert


@pytest.mark.parametrize("page_size", [1, 4])
def test_tree_continuation_reads_another_answer_in_the_same_namespace_only(page_size):
    from radixserve.speculative.tree_draft import tree_continuation

    tree, insert = _tree(page_size)
    insert(list(range(1, 25)))  # a prompt and its answer
    insert(list(range(1, 9)) + [70, 71, 72, 73, 74, 75, 76, 77])  # another answer
    insert(list(range(1, 25)), ns="tenant-b")
    from radixserve.mem_cache.radix_key import RadixKey

    tree.match_prefix(RadixKey(list(range(1, 9)) + [70, 71, 72, 73, 74, 75, 76, 77]))  # the most recently used path
    nodes, stamps = tree.node_count(), {n.id: n.last_access_time for n in tree._iter_nodes()}
    assert tree_continuation(tree, list(range(1, 14)), None, 5) == [14, 15, 16, 17, 18]
    assert tree_continuation(tree, list(range(1, 9)), None, 3) == [70, 71, 72]  # the most recently used child
    assert tree_continuation(tree, list(range(1, 11)), None, 30) == list(range(11, 25))  # as far as it goes
    assert tree_continuation(tree, [1, 2, 3, 99], None, 4) == []  # diverged
    assert tree_continuation(tree, list(range(1, 14)), "tenant-c", 5) == []  # another namespace sees nothing
    assert tree_continuation(tree, list(range(1, 14)), "tenant-b", 2) == [14, 15]
    # NOTE: read only: no edge split, no access time touched
    assert tree.node_count() == nodes and {n.id: n.last_access_time for n in tree._iter_nodes()} == stamps


def test_a_repeated_prompt_drafts_the_earlier_answer_from_the_tree():
    """The hash model never repeats itself, so own-sequence drafts are rare; the second run of a prompt takes the
    first run's answer from the tree (nearly all accepted), and a request in another namespace does not."""
    from radixserve.protocol.io_struct import TokenizedGenerateReqInput
    from radixserve.sampling_params import SamplingParams

    sched, outputs = make_scheduler(pool_tokens=1024, speculative_algorithm="ngram")
    prompt = list(range(30, 60))
    submit(sched, "first", prompt, max_new_tokens=40, temperature=0.0, ignore_eos=True)
    drain(sched)
    alone = sched.stats.spec_accepted_tokens
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    sched.input_queue.put(TokenizedGenerateReqInput("other-ns", prompt, params, extra_key="tenant-b"))
    drain(sched)
    other_ns = sched.stats.spec_accepted_tokens - alone
    submit(sched, "again", prompt, max_new_tokens=40, temperature=0.0, ignore_eos=True)
    drain(sched)
    again = sched.stats.spec_accepted_tokens - alone - other_ns
    want = reference(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert outputs["first"]["ids"] == outputs["again"]["ids"] == outputs["other-ns"]["ids"] == want
    assert again >= 30 and other_ns <= alone + 3, (alone, other_ns, again)


# ---- figures: /metrics and the native meta_info ---------------------------------------------------
def test_spec_figures_reach_metrics_and_native_meta_info():
    import time

    from radixserve.entrypoints.serving_common import ChoiceResult
    from radixserve.entrypoints.serving_native import _meta
    from radixserve.frontend.tokenizer_metrics import ServerMetrics
    from radixserve.managers.scheduler_metrics import SchedulerStats

    stats = SchedulerStats(spec_verify_steps=10, spec_draft_tokens=40, spec_accepted_tokens=30)
    text = ServerMetrics(lambda: stats.as_dict(), lambda: True).expose().decode()
    assert "radixserve:spec_accepted_tokens_total 30.0" in text
    assert "radixserve:spec_accept_rate 0.75" in text and "radixserve:spec_accept_length 4.0" in text
    result = ChoiceResult(rid="a", figures={"spec_verify_ct": 3, "spec_accept_length": 2.5})
    meta = _meta("a", result, time.monotonic())
    assert meta["spec_verify_ct"] == 3 and meta["spec_accept_length"] == 2.5
    assert "spec_verify_ct" not in _meta("b", ChoiceResult(rid="b"), time.monotonic())


def test_fit_rows_gives_the_row_budget_to_the_best_accepted_requests():
    from types import SimpleNamespace

    from radixserve.speculative.drafter import fit_rows

    def req(mean):
        return SimpleNamespace(spec=SimpleNamespace(budget=DraftBudget(max_tokens=6, mean_accepted=mean)))

    reqs = [req(0.5), req(4.0), req(-1.0), req(2.0)]
    drafts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], []]
    assert fit_rows(drafts, reqs, 32) == drafts  # fits: unchanged
    # 4 requests + 6 draft tokens: the unverified one (counts as 6) and the 4.0 one first, the 0.5 one last
    assert fit_rows(drafts, reqs, 10) == [[], [4, 5, 6, 7], [8, 9], []]
    assert fit_rows(drafts, reqs, 5) == [[], [], [8], []]
    assert fit_rows(drafts, reqs, 4) == [[], [], [], []]


def test_step_cost_fits_rows_and_prices_draft_tokens():
    from types import SimpleNamespace

    from radixserve.speculative.cost import StepCost
    from radixserve.speculative.drafter import worth_rows

    cost = StepCost()
    assert cost.row_value_threshold(8) == 0.0  # nothing seen: rows count as free
    for rows in (8, 12, 16, 9, 20, 8, 14, 10, 8, 18):
        cost.observe(rows, 0.008 + 0.002 * rows)  # a + b * R: 8 ms + 2 ms per row
    a, b = cost.fit()
    assert abs(a - 0.008) < 1e-6 and abs(b - 0.002) < 1e-6
    assert abs(cost.row_value_threshold(8) - 0.016 / 0.024) < 1e-6  # b*B / (a + b*B)
    assert abs(cost.row_value_threshold(1) - 0.002 / 0.010) < 1e-6
    req = SimpleNamespace(spec=SimpleNamespace(budget=DraftBudget(max_tokens=6, rate=0.6)))
    draft = [1, 2, 3, 4, 5, 6]
    assert worth_rows(draft, req, 0.2) == draft and worth_rows(draft, req, 0.55) == draft
    assert worth_rows(draft, req, 0.7) == []  # 60% of its draft tokens accepted: a row here needs 70%
    flat = StepCost()
    for _ in range(20):
        flat.observe(8, 0.02)
    assert flat.fit() is None and flat.row_value_threshold(8) == 0.0  # one row count: no slope to see


def test_verify_rows_stop_at_the_fast_path_when_a_step_past_it_yields_less():
    """Past the model's fast rows (the C decoder's limit) a step runs another path: one fit on each side,
    and the drafts are cut to the fast rows when that step yields more tokens a second, by the measured times."""
    from types import SimpleNamespace

    from radixserve.speculative.cost import StepCost
    from radixserve.speculative.drafter import row_limit

    def req(rate):
        return SimpleNamespace(spec=SimpleNamespace(budget=DraftBudget(max_tokens=6, mean_accepted=4.0, rate=rate)))

    def cost(near, far, fast_rows=8):
        c = StepCost(fast_rows)
        for rows in (2, 3, 5, 8, 4, 6, 7, 2, 8, 5):
            c.observe(rows, near[0] + near[1] * rows)
        for rows in (9, 12, 14, 10, 16, 11, 13, 9, 15, 12):
            c.observe(rows, far[0] + far[1] * rows)
        return c

    reqs, drafts = [req(0.8), req(0.8)], [[1] * 6, [2] * 6]  # 2 requests + 12 draft tokens: 14 rows
    slow_far = cost((0.010, 0.0005), (0.025, 0.001))
    assert slow_far.fit(4) == pytest.approx((0.010, 0.0005)) and slow_far.fit(12) == pytest.approx((0.025, 0.001))
    # near: 8 rows, 2 + 0.8 * 6 tokens in 14 ms (486/s); far: 14 rows, 2 + 0.8 * 12 tokens in 39 ms (297/s)
    assert row_limit(slow_far, drafts, reqs, 32) == 8
    assert row_limit(cost((0.010, 0.0005), (0.008, 0.0005)), drafts, reqs, 32) == 32  # past it is no slower
    assert row_limit(slow_far, [[1] * 3, [2] * 3], reqs, 32) == 32  # 8 rows: within the fast path anyway
    assert row_limit(slow_far, drafts, [req(0.8)] * 9, 32) == 32  # the plain step is already past it
    assert row_limit(StepCost(None), drafts, reqs, 32) == 32  # no fast path
    unmeasured = StepCost(8)
    assert row_limit(unmeasured, drafts, reqs, 32) == 32  # the far side is tried first
    for _ in range(3):
        unmeasured.observe(14, 0.039)
    assert row_limit(unmeasured, drafts, reqs, 32) == 8  # then the near side
    assert unmeasured.step_seconds(14) == pytest.approx(0.039) and unmeasured.step_seconds(8) is None
    # a step past the fast rows is bought with the acceptance verify steps measured, not with a rate that drifted
    # back up while the request's drafts were dropped (worth_rows' probing): far 19 ms, near 14 ms
    modest_far = cost((0.010, 0.0005), (0.012, 0.0005))
    assert row_limit(modest_far, drafts, reqs, 32) == 32  # 0.8 measured: 11.6 tokens in 19 ms beat 6.8 in 14
    probed = [SimpleNamespace(spec=SimpleNamespace(budget=DraftBudget(6, mean_accepted=1.0, rate=0.8, measured=0.1)))
              for _ in range(2)]
    assert row_limit(modest_far, drafts, probed, 32) == 8  # 0.1 measured: 3.2 tokens in 19 ms lose to 2.6 in 14


def test_a_full_fast_path_with_nothing_that_could_pay_proposes_nothing():
    """`could_pay`: a batch of 8 at 8 fast rows (plain 14 ms; past them 12 ms + 0.5 ms a row, so 19 ms for one more
    request's 6 drafts) whose requests' verify steps measured 0.1 of their drafts accepted proposes nothing (8.6
    tokens in 19 ms lose to 8 in 14 ms, and more such requests only add rows); one request measured at 0.95 is worth
    a step (13.7 tokens in 19 ms); a batch of 4 keeps room in the fast rows and always proposes."""
    from types import SimpleNamespace

    from radixserve.speculative.cost import StepCost
    from radixserve.speculative.drafter import batch_drafts, could_pay

    cost = StepCost(8)
    for rows in (2, 3, 5, 8, 4, 6, 7, 2, 8, 5):
        cost.observe(rows, 0.010 + 0.0005 * rows)
    for rows in (9, 12, 14, 10, 16, 11, 13, 9, 15, 12):
        cost.observe(rows, 0.012 + 0.0005 * rows)

    class Drafter:
        config = SimpleNamespace(max_verify_rows=32)

        def __init__(self):
            self.cost, self.proposed = cost, 0

        def draft_length(self, req):
            return 6

        def prepare(self, reqs):
            pass

        def propose(self, req):
            self.proposed += 1
            return [1] * 6

    def req(measured):
        budget = DraftBudget(max_tokens=6, mean_accepted=1.0, rate=0.9, measured=measured)
        return SimpleNamespace(spec=SimpleNamespace(budget=budget), grammar=None)

    drafter = Drafter()
    poor = [req(0.1) for _ in range(8)]
    assert not could_pay(drafter, poor)
    assert batch_drafts(drafter, poor) == [[]] * 8 and drafter.proposed == 0
    assert could_pay(drafter, [req(0.95)] + poor[1:])
    assert could_pay(drafter, poor[:4])


def test_a_request_whose_drafts_do_not_pay_is_probed_again():
    from types import SimpleNamespace

    from radixserve.speculative.drafter import worth_rows

    req = SimpleNamespace(spec=SimpleNamespace(budget=DraftBudget(max_tokens=6, rate=0.1)))
    cut = 0
    while not worth_rows([1, 2, 3], req, 0.5):
        cut += 1
        assert cut < 50
    assert 5 <= cut <= 20 and req.spec.budget.rate > 0.5


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 0.7}, {"presence_penalty": 0.9},
                                     {"repetition_penalty": 1.8}, {"min_new_tokens": 6}])
def test_penalized_requests_draft_with_their_history_exact(penalty):
    """On a 3-token model where penalties decide most argmaxes, penalized greedy requests with drafts give the
    tokens of the run without speculation: each verify row counts the draft tokens before it, and the history
    keeps only the accepted ones."""
    from radixserve.managers.scheduler import Scheduler
    from radixserve.protocol.io_struct import TokenizedGenerateReqInput
    from radixserve.sampling_params import SamplingParams

    def run(algorithm: str) -> tuple[dict[str, list[int]], Scheduler]:
        outputs: dict[str, list[int]] = {}

        def sink(out):
            for o in out.outputs:
                outputs.setdefault(o.rid, []).extend(o.new_token_ids)

        args = ServerArgs(max_total_tokens=4096, chunked_prefill_size=-1, speculative_algorithm=algorithm,
                          speculative_ngram_min_match=1)
        runner = _ConditionalRunner(4096, 16)
        runner.model_config.eos_token_ids = (2,)
        sched = Scheduler(args, runner, output_sink=sink)
        for i in range(12):
            prompt = [0, 1, 2, 0, 1, 2, 0, 1][: 4 + i % 5] + [i % 3]
            params = SamplingParams(temperature=0.0, max_new_tokens=20, **penalty)
            sched.input_queue.put(TokenizedGenerateReqInput(f"r{i}", prompt, params))
        sched.run_until_idle(10_000, on_step=lambda: conserve(sched))
        conserve(sched)
        return outputs, sched

    plain, _ = run("none")
    spec, sched = run("ngram")
    assert spec == plain
    assert sched.stats.spec_accepted_tokens > 0
    if "repetition_penalty" not in penalty:  # NOTE: that one makes the model cycle 0, 1, 2: every draft is right
        assert sched.stats.spec_draft_tokens > sched.stats.spec_accepted_tokens
