"""What a verify row costs on this machine, learned from the decode steps themselves.

A decode step of R rows takes about a + b * R seconds: `a` is what every step pays (reading the weights, the
step's fixed overhead), `b` what one more row adds (its arithmetic, its attention). On a CPU that multiplies in
bf16 on AMX tiles, b is small next to a and a draft token is nearly free; in float32 on AVX2 a 135M model is
already bound by arithmetic at 8 rows, and a draft token that is rejected costs as much as it would have
yielded. `RowFit` fits a and b by least squares over the recent steps (older ones weigh less), from the time
each forward took on its stream.

`row_value_threshold(batch)`: the acceptance probability a draft token needs to pay for its row. A plain step
of B requests yields B tokens in a + b * B seconds; a draft token accepted with probability q yields q tokens
for b more seconds; it pays when q / b > B / (a + b * B), that is q > b * B / (a + b * B).

The line breaks where the model has a faster path for small batches (the C decoder, up to `fast_rows`
rows): a step of one more row than that runs another path, at another a and b. `StepCost` then keeps one fit
on each side, and `step_seconds(rows)` answers from the side that `rows` falls on (drafter.py compares a verify
step cut to the fast rows with one that goes past them).
"""

from __future__ import annotations

DECAY = 0.98  # weight of a step per later step: about the last fifty steps count
MIN_STEPS = 8  # before this many, or without two row counts to compare, rows count as free
MIN_MEAN = 3  # steps on a side before their mean time stands for a step there (while no line is fitted)


class RowFit:
    """seconds = a + b * rows, by least squares over the steps observed (older ones weigh less)."""

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

    def predict(self, rows: int) -> float | None:
        """The seconds of a step of `rows` rows: the line where it is fitted, else the mean step; None before
        MIN_MEAN steps."""
        fitted = self.fit()
        if fitted is not None:
            return fitted[0] + fitted[1] * rows
        return self.sy / self.n if self.steps >= MIN_MEAN else None


class StepCost:
    """The decode steps' cost, one `RowFit` per side of `fast_rows` (one fit when the model has no fast path)."""

    def __init__(self, fast_rows: int | None = None) -> None:
        self.fast_rows = fast_rows
        self.sides = (RowFit(), RowFit())  # steps of at most fast_rows rows (all of them without); those above

    def side(self, rows: int) -> RowFit:
        return self.sides[self.fast_rows is not None and rows > self.fast_rows]

    def observe(self, rows: int, seconds: float) -> None:
        self.side(rows).observe(rows, seconds)

    def fit(self, rows: int = 1) -> tuple[float, float] | None:
        """(a, b) of the side that a step of `rows` rows falls on, or None while unknown."""
        return self.side(rows).fit()

    def step_seconds(self, rows: int) -> float | None:
        return self.side(rows).predict(rows)

    def row_value_threshold(self, batch: int) -> float:
        """The acceptance probability a draft token needs in a batch of `batch` requests (0 while unknown), by
        the fit of the side the batch's plain step falls on."""
        fitted = self.fit(batch)
        if fitted is None:
            return 0.0
        a, b = fitted
        return b * batch / (a + b * batch)


def beats_plain(batch: int, expected: float, plain_s: float, step_s: float) -> bool:
    """Whether a step of `batch` requests with drafts (`expected` accepted draft tokens), taking `step_s` seconds in
    all, yields more tokens a second than a plain step of the batch taking `plain_s`."""
    return (batch + expected) * plain_s > batch * step_s


def accept_rate(accepted: int, drafted: int) -> float:
    """Speculative decoding: the share of draft tokens accepted."""
    return accepted / drafted if drafted else 0.0


def accept_length(accepted: int, verify_steps: int) -> float:
    """Speculative decoding: tokens a verify step yielded on average (its accepted drafts and the model's own)."""
    return (accepted + verify_steps) / verify_steps if verify_steps else 0.0
