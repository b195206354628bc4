"""Speculative speculative decoding (SSD): the parts that decide what to pre-draft.

Kumar, Dao and May, "Speculative Speculative Decoding" (arXiv:2603.03251),
whose algorithm is called Saguaro: while the target verifies a draft
d_1 .. d_K, the drafter guesses the verification's outcome, (j, t*) with j
drafts accepted and t* the target's next token (the correction, or the bonus
after j = K), and drafts a continuation for each guess. When the real outcome
is among the guesses, the next draft is ready the moment verification ends.

This module holds what decides those guesses, with no process or timing in
it:

* `outcome_probabilities`: P(j accepted) from the drafter's acceptance rates;
* `fan_out`: how many bonus tokens to guess for each j within a budget.
  The paper observes that the probability that t* is not among the drafter's
  top F tokens falls as a power of F, miss(F) ∝ F^-r. Minimising
  sum_j P(j) miss(F_j) subject to sum_j F_j = B gives F_j ∝ P(j)^(1/(1+r)):
  a geometric series in j when the acceptance rate is constant, capped where
  a position has fewer candidates;
* `saguaro_distribution`: Saguaro sampling. The drafter samples from q with
  its top-F tokens scaled down by C (0 < C <= 1), renormalised. Verification
  against that same distribution is still exact; the residual
  max(0, p - q'), from which a rejected position's token is drawn, then puts
  more of its mass on those top-F tokens, which are the cached guesses;
* `guesses`: the (j, t*) pairs to pre-draft, most likely first.
"""

from __future__ import annotations

import math

import torch


def outcome_probabilities(acceptance: list[float]) -> list[float]:
    """P(exactly j drafts accepted), j = 0..K, from per-position conditional acceptance rates a_1..a_K:
    P(j) = a_1 ... a_j (1 - a_{j+1}) for j < K, and a_1 ... a_K for j = K."""
    out, reach = [], 1.0
    for rate in acceptance:
        out.append(reach * (1.0 - rate))
        reach *= rate
    out.append(reach)
    return out


def fan_out(budget: int, probabilities: list[float], power: float = 1.0, caps: list[int] | None = None) -> list[int]:
    """Integer fan-outs F_j (sum = budget unless every cap is reached), F_j ∝ P(j)^(1/(1+power)), F_j <= caps[j].

    Shares above a cap are clipped and the rest of the budget is spread again over the other outcomes in the
    same proportion; rounding gives the leftover units to the largest remainders.
    """
    if budget < 0 or power <= 0:
        raise ValueError(f"need budget >= 0 and power > 0, got {budget}, {power}")
    caps = caps if caps is not None else [budget] * len(probabilities)
    weights = [max(p, 0.0) ** (1.0 / (1.0 + power)) for p in probabilities]
    fixed: dict[int, int] = {}
    while True:  # water-filling: clip whatever exceeds its cap, spread the rest again
        free = [j for j in range(len(weights)) if j not in fixed and weights[j] > 0]
        left = budget - sum(fixed.values())
        total = sum(weights[j] for j in free)
        shares = {j: left * weights[j] / total for j in free} if total > 0 else {}
        over = [j for j, s in shares.items() if s > caps[j]]
        if not over:
            break
        fixed.update({j: caps[j] for j in over})
    counts = [fixed.get(j, 0) for j in range(len(weights))]
    floors = {j: min(caps[j], math.floor(s)) for j, s in shares.items()}
    for j, f in floors.items():
        counts[j] = f
    leftover = min(budget, sum(caps)) - sum(counts)
    for j in sorted(shares, key=lambda j: shares[j] - floors[j], reverse=True):
        if leftover <= 0:
            break
        if counts[j] < caps[j]:
            counts[j] += 1
            leftover -= 1
    return counts


def saguaro_distribution(q: torch.Tensor, fan: int, factor: float) -> torch.Tensor:
    """q with its `fan` most likely tokens scaled by `factor` (0 < factor <= 1), renormalised (last dim)."""
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"the Saguaro factor C must be in (0, 1], got {factor}")
    if fan <= 0 or factor == 1.0:
        return q
    top = q.topk(min(fan, q.shape[-1]), dim=-1).indices
    scaled = q.clone()
    scaled.scatter_(-1, top, q.gather(-1, top) * factor)
    return scaled / scaled.sum(-1, keepdim=True)


def guesses(draft: list[int], scores: torch.Tensor, fans: list[int]) -> list[tuple[int, int]]:
    """The outcomes (j, t*) to pre-draft: for each j, the drafter's `fans[j]` best tokens at position j + 1.

    scores [K+1, V]: the drafter's logits or probabilities for the token after the first j drafts (row K:
    after the whole draft). A rejection at j never emits d_{j+1} (greedy: the target's argmax differs;
    sampling: the residual is 0 where p >= q), so d_{j+1} is skipped for j < K. Ordered by fan-out
    rank, then by j: every outcome's best guess before any outcome's second.
    """
    per_outcome = []
    for j, fan in enumerate(fans):
        if fan <= 0:
            per_outcome.append([])
            continue
        order = scores[j].topk(min(fan + 1, scores.shape[-1])).indices.tolist()
        skip = draft[j] if j < len(draft) else None
        per_outcome.append([t for t in order if t != skip][:fan])
    out = []
    for rank in range(max((len(g) for g in per_outcome), default=0)):
        out.extend((j, g[rank]) for j, g in enumerate(per_outcome) if rank < len(g))
    return out
