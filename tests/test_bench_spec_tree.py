"""The token-tree study's replay (benchmarks/bench_spec_tree.py): its chain is the shipped drafter's, its trees
add branches from other occurrences, and every replayed step yields exactly the answer's tokens."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_spec_tree import TREES, continuations, replay, tree_rows  # noqa: E402


def test_continuations_put_the_latest_longest_match_first_and_branch_on_distinct_tokens():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2]
    found = continuations(tokens, k=3, branches=3)
    assert found[0] == [3, 9, 1]  # the latest occurrence of (1, 2): the chain's draft
    assert found[1] == [4, 1, 2]  # another occurrence, another first token
    assert len(found) == 2  # the third occurrence of (1, 2) starts with 3 again: no new branch
    assert tree_rows([[3, 9, 1], [4]]) == 5  # the last token, three chain nodes, one branch node
    assert tree_rows([[3, 9], [3, 8]]) == 4  # a shared first node counts once


def test_replay_yields_the_answer_and_here_trees_take_no_more_steps_than_the_chain():
    prompt = [5, 6, 7, 8, 5, 6, 9, 8, 5, 6, 7, 8, 1]
    answer = [5, 6, 9, 8, 5, 6, 7, 8, 5, 6, 9, 8, 2, 3]
    per_shape = {shape: replay(prompt, answer, 4, shape) for shape in TREES}
    for shape, steps in per_shape.items():
        assert sum(t for _, t in steps) == len(answer), shape
        assert all(1 <= t <= r for r, t in steps), shape  # a step yields at most its rows' tokens
    chain = per_shape[TREES[0]]
    assert len(chain) < len(answer)  # drafts were accepted: fewer steps than tokens
    assert all(len(per_shape[s]) <= len(chain) for s in TREES[1:])
