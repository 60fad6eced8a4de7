"""The speculative-decoding settings, read once from ServerArgs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ALGORITHMS = ("none", "ngram", "standalone")


@dataclass(frozen=True)
class SpecConfig:
    """`num_draft_tokens`: the most draft tokens a request proposes per step (K). A draft comes from the
    longest match of the request's last n tokens, n from `max_match` down to `min_match` (ngram), or from
    `draft_model_path`'s greedy decoding (standalone; None: the embedded SmolLM2). `max_verify_rows`:
    the most rows a verify step runs (requests plus draft tokens): past a few dozen rows a CPU step is no
    longer bound by reading the weights, and a rejected draft token costs real time."""

    algorithm: str = "ngram"
    num_draft_tokens: int = 6
    min_match: int = 2
    max_match: int = 8
    max_verify_rows: int = 32
    draft_model_path: str | None = None
    draft_quantization: str = "none"

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm={self.algorithm!r} is not one of {', '.join(ALGORITHMS)}")
        if not 1 <= self.num_draft_tokens <= 64:
            raise ValueError(f"speculative_num_draft_tokens must be in [1, 64], got {self.num_draft_tokens}")
        if self.max_verify_rows < 2:
            raise ValueError(f"speculative_max_verify_rows must be >= 2, got {self.max_verify_rows}")
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(f"speculative n-gram match lengths must satisfy 1 <= min ({self.min_match}) "
                             f"<= max ({self.max_match})")

    @classmethod
    def of(cls, args: Any) -> SpecConfig | None:
        """The configuration the server arguments ask for; None when speculation is off."""
        if args.speculative_algorithm == "none":
            return None
        return cls(args.speculative_algorithm, args.speculative_num_draft_tokens,
                   args.speculative_ngram_min_match, args.speculative_ngram_max_match,
                   args.speculative_max_verify_rows, args.speculative_draft_model_path,
                   args.speculative_draft_model_quantization)
