"""Pooled hidden states of embedding requests: what a model's extend forward hands back besides its logits.

An embedding request (`Req.embed`) runs as a prefill that generates nothing; the model's forward calls
`pool_hidden` with the final norm's output of each request's last row (the rows the LM head reads) and a way to
normalise any other range of the batch's rows. The result, `ForwardBatch.pooled_hidden`, is float32
[bs, hidden]: the last row's vector ("last"), or the sum over the rows this forward computed ("mean"; the request
adds up its chunks and divides by its prompt length, managers/req.py). Rows of generating requests carry their
last row too and are ignored.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.forward_batch import ForwardBatch

POOLING_MODES = ("last", "mean")


def pool_hidden(fb: ForwardBatch, normed_last: torch.Tensor, norm_rows: Callable[[int, int], torch.Tensor]) -> None:
    """Sets `fb.pooled_hidden` when some request of the extend batch `fb` embeds (`fb.pooling`).

    `normed_last`: the final norm's output at the batch's sampling rows (its first bs rows are each request's last
    row); `norm_rows(start, end)`: the final norm's output of the flat token rows [start, end)."""
    if fb.pooling is None or not fb.forward_mode.is_extend():
        return
    # NOTE: a copy in float32: the LM head still reads normed_last after this
    pooled = normed_last[: fb.batch_size].float().clone()
    start = 0
    for i, (mode, n) in enumerate(zip(fb.pooling, fb.extend_seq_lens_cpu, strict=True)):
        if mode == "mean" and n > 0:
            pooled[i] = norm_rows(start, start + n).float().sum(0)
        start += n
    fb.pooled_hidden = pooled


def normalize(vector: torch.Tensor, dimensions: int | None = None) -> list[float]:
    """The L2-normalised vector (first truncated to `dimensions`), as a list of floats."""
    v = vector.float()
    if dimensions is not None:
        v = v[:dimensions]
    return torch.nn.functional.normalize(v, dim=0).tolist()
