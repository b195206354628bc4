"""Turning logits into distributions, and exact verification of a draft against the target.

Greedy (temperature 0): draft token i is accepted while it equals the
target's argmax at that position; the first mismatch is replaced by the
target's argmax, and a fully accepted draft earns one bonus token. The output
is token for token the target's own greedy decoding.

Sampling (temperature > 0), the speculative sampling of Leviathan et al.
(arXiv:2211.17192) and Chen et al. (arXiv:2302.01318): with p the target's and
q the drafter's distribution at a position, after the same temperature /
top-k / top-p transform,

    accept d_i with probability min(1, p_i(d_i) / q_i(d_i))
    on rejection emit a sample of normalise(max(0, p_i - q_i)) and stop
    after K accepted drafts emit a bonus sample of p_{K+1}

so every emitted token is distributed exactly as the target would sample it.
A deterministic drafter (n-gram lookup) has a one-hot q: acceptance is p(d)
and the residual is p without d, renormalised.

Every random choice reads one uniform u from a seeded CPU generator as a
Python float (`uniform`), and a token is drawn from u by inverse CDF on the
probabilities' own device (`draw`). The generator never meets a tensor on
another device (on a CUDA target, torch.multinomial(cuda_probs,
generator=cpu_generator) raises), and a seed gives the same stream, so the
same tokens from the same probabilities, on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtptrain.runtime.native_kernels import argmax_kernel


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def distribution(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Probabilities [..., V] after temperature, top-k and top-p, in float64 (sums that must be exact)."""
    logits = logits.double() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing the line stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> tuple[int, torch.Tensor | None]:
    """A drafter's token and its distribution q: the argmax and None when greedy, else a sample of q."""
    if sampling.greedy:
        return greedy_choice(logits), None
    q = distribution(logits, sampling)
    return draw(q, generator), q


def chosen_probability(logits: torch.Tensor, choice: int, q: torch.Tensor | None) -> float:
    """The drafter's probability of the token it chose: q's where it sampled from q, the softmax's at the
    argmax where it chose greedily (q None). A chain that stops early multiplies these along its drafts."""
    if q is not None:
        return float(q[choice])
    return float(1.0 / torch.exp(logits.float() - logits[choice].float()).sum())


def uniform(generator: torch.Generator) -> float:
    """u ~ U[0, 1) from the seeded CPU generator, read back as a Python float (53 random bits)."""
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """A token drawn from probs [V] (non-negative, any total, any device) by inverse CDF:

        token = min{i : cdf_i > u * cdf_V},  u ~ U[0, 1),  so P(token = i) = p_i / total

    right=True makes the comparison strict: across a zero-probability token the cdf is flat, so that token is
    never the first to exceed u * total, u = 0 included. If float rounding leaves u * total at or above the last
    cdf value, searchsorted answers V: the last token with positive probability takes it. One host sync (the
    int), and on CPU far cheaper than torch.multinomial (float64 on a 2-core AMD EPYC: 1.03 ms against 0.055 ms
    for 49152 tokens, 0.18 ms against 0.017 ms for 8192)."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    index = int(torch.searchsorted(cdf, cdf[-1:] * uniform(generator), right=True))
    if index == cdf.shape[-1]:
        index = int(probs.nonzero()[-1])
    return index


def draw_distinct(probs: torch.Tensor, count: int, generator: torch.Generator) -> list[int]:
    """`count` distinct tokens drawn from probs [V] without replacement, in the order drawn: each by `draw` from
    what the ones before it left (the first from probs, the second from probs without the first, ...). Three
    draws over 8,192 float64 probabilities take 62 us against 176 us for a Gumbel top-3 (exponential noise over
    every token), on a 2-core AMD EPYC Zen 4. `count` must not exceed the tokens of positive probability."""
    left, out = probs.clone(), []
    for _ in range(count):
        out.append(draw(left, generator))
        left[out[-1]] = 0.0
    return out


class TargetRows:
    """The target's distributions at the K+1 verified positions, each computed when verification first reads it:
    a chain rejected at position i never needs rows i+1.. (at temperature 1 most steps stop at the first or
    second), and a row is a float64 softmax over the whole vocabulary."""

    def __init__(self, logits: torch.Tensor, sampling: Sampling):
        self.logits, self.sampling, self.rows = logits, sampling, {}

    def __getitem__(self, i: int) -> torch.Tensor:
        if i not in self.rows:
            self.rows[i] = distribution(self.logits[i], self.sampling)
        return self.rows[i]


@dataclass
class DraftProbs:
    """A drafter's distributions q, one row per drafted token: over the whole vocabulary (`support` None), or
    over a draft vocabulary whose target ids are `support` [N] (q is 0 elsewhere, so no row of the target's
    size is built); `columns` are the drafted tokens' columns in the rows."""

    rows: torch.Tensor  # [K, V] or [K, N]
    columns: list[int]
    support: torch.Tensor | None = None

    def prob(self, i: int) -> float:
        """q_i of the token drafted at position i."""
        return float(self.rows[i, self.columns[i]])

    def residual(self, i: int, p: torch.Tensor) -> torch.Tensor:
        """max(0, p - q_i) over the whole vocabulary."""
        q = self.rows[i].to(p.device)  # a split target's logits come from its last GPU, the head's from its first
        if self.support is None:
            return (p - q).clamp_min(0.0)
        support = self.support.to(p.device)
        residual = p.clone()
        residual[support] = (p[support] - q).clamp_min(0.0)
        return residual


@dataclass
class Verdict:
    accepted: int  # leading draft tokens accepted
    emitted: list[int]  # accepted drafts, then the correction or bonus token


_ARGMAX_DTYPES = (torch.float32, torch.bfloat16)  # the argmax kernel's


def greedy_choice(logits: torch.Tensor) -> list[int] | int:
    """argmax over the last dimension (the first maximum): an int for logits [V], a list for [R, V].

    On the CPU, for float32 and bfloat16, the runtime's kernel (csrc/layer_ops.cpp, argmax_rows) reads the
    logits as they lie: a verification's 4 rows of SmolLM2's 49,152 logits in bfloat16 take 28 us warm and
    69 us right after the forward against 119 and 143 us through torch (a float32 copy first, then its argmax)
    on a 2-core AMD EPYC Zen 5 (benchmarks/argmax.py). Elsewhere, and for a row holding a NaN (which torch's
    argmax takes as the maximum), torch's argmax in float32: the same choice as over the logits' own dtype (the
    upcast is exact and the first maximum wins either way), and several times faster than a bfloat16 argmax on
    a CPU."""
    kernel = argmax_kernel() if logits.device.type == "cpu" and logits.dtype in _ARGMAX_DTYPES else None
    if kernel is not None and logits.dim() in (1, 2) and logits.shape[-1] > 0:
        rows = kernel(logits)
        if -1 not in rows:
            return rows if logits.dim() == 2 else rows[0]
    return logits.float().argmax(-1).tolist()


def verify_greedy(draft: list[int], target_logits: torch.Tensor) -> Verdict:
    """target_logits [K+1, V]: row i scores the token after the first i drafts."""
    choice = greedy_choice(target_logits)
    accepted = 0
    while accepted < len(draft) and draft[accepted] == choice[accepted]:
        accepted += 1
    return Verdict(accepted, draft[:accepted] + [choice[accepted]])


def verify_sampling(draft: list[int], draft_probs: torch.Tensor | DraftProbs | None,
                    target_probs: torch.Tensor | TargetRows, generator: torch.Generator) -> Verdict:
    """draft_probs [K, V] or DraftProbs (None: a deterministic drafter, one-hot q); target_probs [K+1, V] or the
    rows computed as they are read (TargetRows)."""
    if isinstance(draft_probs, torch.Tensor):
        draft_probs = DraftProbs(draft_probs, list(draft))
    for i, token in enumerate(draft):
        p = target_probs[i]
        q_token = 1.0 if draft_probs is None else draft_probs.prob(i)
        if uniform(generator) * q_token < float(p[token]):  # u < p/q
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = draft_probs.residual(i, p)
        # p == q exactly leaves no residual mass; then any sample of p is exact. (draw normalises.)
        residual = residual if float(residual.sum()) > 0 else p
        return Verdict(i, draft[:i] + [draw(residual, generator)])
    return Verdict(len(draft), draft + [draw(target_probs[len(draft)], generator)])
