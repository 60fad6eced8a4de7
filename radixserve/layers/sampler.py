"""Token sampling: greedy, temperature, top-k, top-p, min-p, and per-request seeds.

Sampling inverts each row's cumulative distribution at one uniform number per row: the sampled token is
the first whose cumulative probability exceeds u * total (a float64 cumsum and a searchsorted, no host
sync). A request with a `seed` takes u from a hash of (seed, output index), so its token depends only on its
own logits and that pair, whatever batch it runs in. NOTE: one number per row, not one per vocabulary entry
(the exponential race, argmax(probs / E)): at batch 32 over a 49k vocabulary the race drew 1.5M exponentials
per step, 27 ms on 2 cores (48 ms with per-row seeded generators), the inversion takes ~1.3 ms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from radixserve.layers.penalties import PenaltyBatchInfo, PenaltyState
from radixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.constrained.batch_mask import BatchMask

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
    # Constrained decoding (constrained/batch_mask.py): the rows' grammars, set by the scheduler once the rows'
    # earlier tokens are accepted; sampling waits for them.
    grammar_mask: BatchMask | None = None
    # Speculative decoding (speculative/verify.py): per row, the draft token the row's sample decides on (the
    # next row's input), -1 where none. A sampled row keeps it with its probability, else samples the rest.
    draft_ids: torch.Tensor | None = None
    verify: Any = None  # the VerifyInput these rows come from (the grammar rows and penalties read it)

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
    if info.grammar_mask is None:
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

    def __init__(self, seed: int | None = None, num_rows: int = 1, exact_match_verify: bool = False) -> None:
        self.seed = seed
        # NOTE: deterministic inference: a verify row samples as a decode row would (the same uniform, the same
        # inversion) and keeps its draft only when that sample is the draft, so speculation changes no token
        self.exact_match_verify = exact_match_verify
        self._generators: dict[tuple[torch.device, int | None], torch.Generator] = {}
        self.penalties = PenaltyState(num_rows)  # one history row per ReqToTokenPool row

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """logits: float [bs, vocab] -> int64 [bs]. Penalties apply to greedy rows too.

        A grammar row is masked in place before sampling, or sampled first and masked and sampled again only if
        its grammar refuses the token (constrained/batch_mask.py: the same distribution); either way the
        logprobs computed from `logits` afterwards are those of the constrained distribution (as SGLang's)."""
        mask = info.grammar_mask
        if mask is not None:
            mask.apply(logits)
        processed = logits
        if info.penalties is not None:
            processed = self.penalties.process(logits, info.penalties)
        next_ids = self._sample(processed, info)
        if mask is not None:
            refused = mask.refused(next_ids)
            if refused:
                next_ids = self._sample_refused(logits, processed, next_ids, info, refused)
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
        u = self._uniforms(probs.shape[0], info)
        plain = info.draft_ids is None or self.exact_match_verify
        sampled = _invert_cdf(probs, u) if plain else self._verify_drafts(probs, u, info)
        return torch.where(info.greedy, greedy_ids, sampled)

    def _verify_drafts(self, probs: torch.Tensor, u: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Speculative sampling against a draft that proposed one token d with certainty: keep d with probability
        p(d), else sample from p without d. Each row's token is then distributed exactly as p, and a row keeps
        the draft exactly when the greedy rule (speculative/verify.accept_greedy) accepts it. Rows without a
        draft sample as usual."""
        drafts = info.draft_ids
        has = drafts >= 0
        d = drafts.clamp(min=0).unsqueeze(1)
        p_draft = probs.gather(1, d).squeeze(1).double() / probs.double().sum(dim=-1)
        keep = has & (u < p_draft)
        residual = probs.scatter(1, d, torch.zeros_like(d, dtype=probs.dtype)) if bool(has.any()) else probs
        # NOTE: the row's second uniform (draw 1) for the residual, so that acceptance and choice are independent
        rows = has.nonzero().flatten().tolist()
        u_rest = u.clone()
        if rows:
            u_rest[torch.tensor(rows, device=u.device)] = self._uniforms(len(rows), info, rows, draw=1)
        rest = _invert_cdf(torch.where(has.unsqueeze(1), residual, probs), torch.where(has, u_rest, u))
        return torch.where(keep, drafts, rest)

    def _sample_refused(self, logits: torch.Tensor, processed: torch.Tensor, next_ids: torch.Tensor,
                        info: SamplingBatchInfo, rows: list[int]) -> torch.Tensor:
        """Samples `rows` again from their masked distribution (their bitmask rows are filled now): greedy rows
        by argmax, the others (plain temperature: nothing else is checked after sampling) with a second
        uniform."""
        from radixserve.constrained.batch_mask import apply_rows

        bitmask = info.grammar_mask.bitmask
        apply_rows(logits, bitmask, rows)  # NOTE: logprobs are computed from `logits` afterwards
        if processed is not logits:
            apply_rows(processed, bitmask, rows)
        index = torch.tensor(rows, device=logits.device)
        part = processed.index_select(0, index)
        greedy_ids = torch.argmax(part, dim=-1)
        probs = torch.softmax(part.float() / info.temperatures.index_select(0, index), dim=-1)
        sampled = _invert_cdf(probs, self._uniforms(len(rows), info, rows, draw=1))
        next_ids = next_ids.clone()
        next_ids[index] = torch.where(info.greedy.index_select(0, index), greedy_ids, sampled)
        return next_ids

    def _uniforms(self, n: int, info: SamplingBatchInfo, rows: list[int] | None = None, draw: int = 0) -> torch.Tensor:
        """float64 [n] in [0, 1) for the batch's rows (or `rows` of it): seeded rows from (seed, output index,
        draw), the others from the stream. `draw` 1 is a row's second uniform of a step (a refused token)."""
        device = info.temperatures.device
        seed = self.seed if info.generator_seed is None else info.generator_seed
        u = torch.rand(n, dtype=torch.float64, device=device, generator=self._generator(device, seed))
        rows = range(n) if rows is None else rows
        seeded = [(i, info.seeds[row], info.output_lens[row]) for i, row in enumerate(rows)
                  if info.seeds[row] is not None]
        if seeded:
            at = torch.tensor([i for i, _, _ in seeded], device=device)
            values = [(_mix_seed(_mix_seed(s, index), draw - 1) if draw else _mix_seed(s, index)) >> 10
                      for _, s, index in seeded]
            u[at] = torch.tensor([v * 2.0 ** -53 for v in values], dtype=torch.float64, device=device)
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


def _invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds u * the row's total (int64 [bs])."""
    cdf = probs.double().cumsum(dim=-1)
    target = u.unsqueeze(1) * cdf[:, -1:]
    # NOTE: right=True: the first token whose cumulative mass exceeds the target, so a token of zero
    # probability (its cumulative mass equal to its predecessor's) is never chosen
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


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
