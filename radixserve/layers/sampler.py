"""Token sampling: greedy, temperature, top-k, top-p, min-p, and per-request seeds.

Sampling inverts each row's cumulative distribution at one uniform number per row: the sampled token is
the first whose cumulative probability exceeds u * total (a float64 cumsum and a searchsorted, no host
sync). A request with a `seed` takes u from a hash of (seed, output index), so its token depends only on its
own logits and that pair, whatever batch it runs in. NOTE: one number per row, not one per vocabulary entry
(the exponential race, argmax(probs / E)): at batch 32 over a 49k vocabulary the race drew 1.5M exponentials
per step, 27 ms on 2 cores (48 ms with per-row seeded generators), the inversion takes ~1.3 ms.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch

from radixserve.layers.penalties import PenaltyBatchInfo, PenaltyState
from radixserve.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
FORBIDDEN_LOGPROB = -9999.0


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # float32 [bs, 1]; 1.0 for greedy rows (unused there)
    top_ps: torch.Tensor  # float32 [bs]
    top_ks: torch.Tensor  # int64 [bs]; 0 means no top-k
    min_ps: torch.Tensor  # float32 [bs]
    greedy: torch.Tensor  # bool [bs]
    seeds: list[int | None]
    output_lens: list[int]  # how many tokens each request has already produced
    is_all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    generator_seed: int | None = None  # seeds the Sampler's stream for rows without a seed
    penalties: PenaltyBatchInfo | None = None  # penalties, min_new_tokens, logit_bias (set by the scheduler)
    # Constrained decoding (managers/grammar_manager.py): int32 [bs, ceil(vocab / 32)] allowed tokens, filled by
    # the scheduler once the rows' earlier tokens are accepted; sampling waits for `mask_ready`.
    vocab_mask: torch.Tensor | None = None
    mask_ready: threading.Event | None = None
    grammar_reqs: list | None = None

    @classmethod
    def from_params(cls, params: list[SamplingParams], output_lens: list[int], device: torch.device | str,
                    default_generator_seed: int | None = None) -> SamplingBatchInfo:
        """`default_generator_seed` (e.g. the server's random_seed) picks the Sampler's random stream for
        rows without a seed: one generator per seed, created on first use and advancing from batch to
        batch, so a run is reproducible without repeating the same noise every step."""
        greedy = [p.is_greedy for p in params]
        return cls(
            temperatures=torch.tensor([[1.0 if g else p.temperature] for p, g in zip(params, greedy, strict=True)],
                                      dtype=torch.float32, device=device),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_ks=torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int64, device=device),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            seeds=[p.seed for p in params],
            output_lens=list(output_lens),
            is_all_greedy=all(greedy),
            need_top_p=any(p.top_p < 1.0 for p in params),
            need_top_k=any(p.top_k > 0 for p in params),
            need_min_p=any(p.min_p > 0 for p in params),
            generator_seed=default_generator_seed,
        )


class TokenLogprobs(NamedTuple):
    """Log-probabilities of one step, per batch row (device tensors until copied to the host)."""

    token_logprobs: torch.Tensor  # float32 [bs]: of the sampled token
    top_logprobs: torch.Tensor  # float32 [bs, k]: the k most likely tokens, descending (k may be 0)
    top_ids: torch.Tensor  # int64 [bs, k]


def compute_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, info: SamplingBatchInfo,
                     top_k: int) -> TokenLogprobs:
    """Log-probabilities under the temperature-scaled distribution, before top-k/top-p/min-p (as
    SGLang); greedy rows use temperature 1, i.e. the model's own distribution. A token a grammar forbids
    (logit -inf) gets -9999.0, OpenAI's stand-in, so that every logprob is a JSON number."""
    out = compute_input_logprobs(logits.float() / info.temperatures, next_ids, top_k)
    if info.vocab_mask is None:
        return out
    return TokenLogprobs(*(torch.nan_to_num(t, neginf=FORBIDDEN_LOGPROB) if t.is_floating_point() else t for t in out))


def compute_input_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, top_k: int) -> TokenLogprobs:
    """Row i scores `target_ids[i]` under softmax(logits): prompt tokens under the model's own distribution."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, target_ids.view(-1, 1).to(torch.int64)).squeeze(1)
    top = torch.topk(logprobs, min(top_k, logprobs.shape[-1]), dim=-1)
    return TokenLogprobs(chosen, top.values, top.indices)


class Sampler:
    """`seed` seeds the stream of unseeded rows when a batch names no `generator_seed`."""

    def __init__(self, seed: int | None = None, num_rows: int = 1) -> None:
        self.seed = seed
        self._generators: dict[tuple[torch.device, int | None], torch.Generator] = {}
        self.penalties = PenaltyState(num_rows)  # one history row per ReqToTokenPool row

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """logits: float [bs, vocab] -> int64 [bs]. Penalties apply to greedy rows too.

        A grammar's bitmask is applied to `logits` in place first, so the logprobs computed from them afterwards
        are those of the constrained distribution (as SGLang's)."""
        if info.vocab_mask is not None:
            from radixserve.constrained.grammar_backend import apply_token_bitmask

            if info.mask_ready is not None:
                info.mask_ready.wait()
            apply_token_bitmask(logits, info.vocab_mask)
        if info.penalties is not None:
            logits = self.penalties.process(logits, info.penalties)
        next_ids = self._sample(logits, info)
        if info.penalties is not None:
            self.penalties.record(next_ids, info.penalties)
        return next_ids

    def _sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        greedy_ids = torch.argmax(logits, dim=-1)
        if info.is_all_greedy:
            return greedy_ids
        probs = torch.softmax(logits.float() / info.temperatures, dim=-1)
        if info.need_top_k or info.need_top_p or info.need_min_p:
            probs = _filter_probs(probs, info)
        cdf = probs.double().cumsum(dim=-1)
        target = self._uniforms(probs, info).unsqueeze(1) * cdf[:, -1:]
        # NOTE: right=True: the first token whose cumulative mass exceeds the target, so a token of zero
        # probability (its cumulative mass equal to its predecessor's) is never chosen
        sampled = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
        return torch.where(info.greedy, greedy_ids, sampled)

    def _uniforms(self, probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """float64 [bs] in [0, 1): seeded rows from (seed, output index), the others from the stream."""
        seed = self.seed if info.generator_seed is None else info.generator_seed
        u = torch.rand(probs.shape[0], dtype=torch.float64, device=probs.device,
                       generator=self._generator(probs.device, seed))
        seeded = [(row, s) for row, s in enumerate(info.seeds) if s is not None]
        if seeded:
            rows = torch.tensor([row for row, _ in seeded], device=probs.device)
            values = [(_mix_seed(s, info.output_lens[row]) >> 10) * 2.0 ** -53 for row, s in seeded]
            u[rows] = torch.tensor(values, dtype=torch.float64, device=probs.device)
        return u

    def _generator(self, device: torch.device, seed: int | None) -> torch.Generator:
        key = (device, seed)
        if key not in self._generators:
            g = torch.Generator(device=device)
            if seed is None:
                g.seed()
            else:
                g.manual_seed(seed)
            self._generators[key] = g
        return self._generators[key]


def _filter_probs(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Zeroes tokens outside top-k, outside the top-p nucleus, or below min_p * max prob."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
    if info.need_top_k:
        rank = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
        drop |= (rank >= info.top_ks.unsqueeze(1)) & (info.top_ks.unsqueeze(1) > 0)
    if info.need_top_p:
        # NOTE: a token is kept while the mass *before* it is below top_p, so the top token always stays.
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) > info.top_ps.unsqueeze(1)
    if info.need_min_p:
        drop |= sorted_probs < sorted_probs[:, :1] * info.min_ps.unsqueeze(1)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _mix_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): nearby seeds and indices give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)
