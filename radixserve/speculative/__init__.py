"""Speculative decoding: drafts proposed without the target model, verified by it in one forward.

`ngram.py` proposes drafts by matching a request's last tokens against text the engine has already
seen; `verify.py` holds what a verify forward carries and the greedy acceptance rule; the decode
planner asks for drafts, the output processor accepts them (docs/speculative.md).
"""
