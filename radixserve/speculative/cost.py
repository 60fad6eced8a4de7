"""What a verify row costs on this machine, learned from the decode steps themselves.

A decode step of R rows takes about a + b * R seconds: `a` is what every step pays (reading the weights, the
step's fixed overhead), `b` what one more row adds (its arithmetic, its attention). On a CPU that multiplies in
bf16 on AMX tiles, b is small next to a and a draft token is nearly free; in float32 on AVX2 a 135M model is
already bound by arithmetic at 8 rows, and a draft token that is rejected costs as much as it would have
yielded. `StepCost` fits a and b by least squares over the recent steps (older ones weigh less), from the time
each forward took on its stream.

`row_value_threshold(batch)`: the acceptance probability a draft token needs to pay for its row. A plain step
of B requests yields B tokens in a + b * B seconds; a draft token accepted with probability q yields q tokens
for b more seconds; it pays when q / b > B / (a + b * B), that is q > b * B / (a + b * B).
"""

from __future__ import annotations

DECAY = 0.98  # weight of a step per later step: about the last fifty steps count
MIN_STEPS = 8  # before this many, or without two row counts to compare, rows count as free


class StepCost:
    def __init__(self) -> None:
        self.n = self.sx = self.sxx = self.sy = self.sxy = 0.0
        self.steps = 0

    def observe(self, rows: int, seconds: float) -> None:
        for name in ("n", "sx", "sxx", "sy", "sxy"):
            setattr(self, name, getattr(self, name) * DECAY)
        self.n += 1
        self.sx += rows
        self.sxx += rows * rows
        self.sy += seconds
        self.sxy += rows * seconds
        self.steps += 1

    def fit(self) -> tuple[float, float] | None:
        """(a, b) in seconds, or None while the steps seen cannot tell them apart."""
        det = self.n * self.sxx - self.sx * self.sx
        if self.steps < MIN_STEPS or det <= 1e-9 * self.n * self.sxx:
            return None
        b = max((self.n * self.sxy - self.sx * self.sy) / det, 0.0)
        a = max((self.sy - b * self.sx) / self.n, 1e-9)
        return a, b

    def row_value_threshold(self, batch: int) -> float:
        """The acceptance probability a draft token needs in a batch of `batch` requests (0 while unknown)."""
        fitted = self.fit()
        if fitted is None:
            return 0.0
        a, b = fitted
        return b * batch / (a + b * batch)
