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

import copy
import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import DynamicCache

from mtptrain.engine.ngram import NgramProposer
from mtptrain.engine.runner import cut_cache
from mtptrain.engine.verify import Sampling, distribution


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


# --------------------------------------------------------------------------- the drafter's side


@dataclass
class Continuation:
    """A draft and what verification needs of it: tokens, their distributions q' (None when greedy), and the
    drafter's scores for the token after each prefix of it (rows 0..K), from which the next guesses come."""

    tokens: list[int]
    probs: torch.Tensor | None  # [K, V]
    scores: torch.Tensor | None  # [K + 1, V]; None for a prompt-lookup draft until the drafter has read it


class DraftLM:
    """A small causal LM drafting in the SSD worker: one draft at a time from its KV cache, and continuations
    for many guesses at once, batched per outcome j over a copy of the cache cut after d_1 .. d_j."""

    def __init__(self, model, sampling: Sampling, factor: float, seed: int):
        self.model, self.sampling, self.factor = model, sampling, factor
        self.generator = torch.Generator().manual_seed(seed)
        self.cache, self.cached = DynamicCache(), []  # the cache holds the keys and values of `cached`

    def reset(self) -> None:
        self.cache, self.cached = DynamicCache(), []

    @torch.inference_mode()
    def draft(self, tokens: list[int], k: int, fans: list[int]) -> Continuation:
        common = self._keep_shared_prefix(tokens, 1)  # the newest token is always run, for its logits
        logits = self._forward(self.cache, [tokens[common:]])[0]
        out, probs, scores = [], [], [logits]
        for step in range(k):
            token, q = self._choose(logits, fans[step] if step < len(fans) else 0)
            out.append(token)
            probs.append(q)
            logits = self._forward(self.cache, [[token]])[0]
            scores.append(logits)
        self.cached = tokens + out
        return Continuation(out, None if self.sampling.greedy else torch.stack(probs), torch.stack(scores))

    @torch.inference_mode()
    def continue_batch(self, prefix_len: int, firsts: list[int], k: int, fans: list[int],
                       stop=lambda: False) -> list[Continuation] | None:
        """Continuations of k tokens after each of `firsts`, all appended to the cached text cut to prefix_len.

        Returns None when `stop()` turns true between forwards (the real outcome has arrived)."""
        cache = copy.deepcopy(self.cache)
        cut_cache(cache, prefix_len)
        if len(firsts) > 1:
            cache.batch_repeat_interleave(len(firsts))
        logits = self._forward(cache, [[t] for t in firsts])
        rows = [[] for _ in firsts]
        qs = [[] for _ in firsts]
        scores = [[logits[b]] for b in range(len(firsts))]
        for step in range(k):
            if stop():
                return None
            picked = [self._choose(logits[b], fans[step] if step < len(fans) else 0) for b in range(len(firsts))]
            for b, (token, q) in enumerate(picked):
                rows[b].append(token)
                qs[b].append(q)
            logits = self._forward(cache, [[token] for token, _ in picked])
            for b in range(len(firsts)):
                scores[b].append(logits[b])
        return [Continuation(rows[b], None if self.sampling.greedy else torch.stack(qs[b]), torch.stack(scores[b]))
                for b in range(len(firsts))]

    @torch.inference_mode()
    def sync(self, tokens: list[int], rows: int) -> torch.Tensor:
        """Bring the cache up to `tokens` (after a cached or a backup draft); the scores [rows, V] for the token
        after each of the last `rows` tokens. At least `rows` tokens are run."""
        common = self._keep_shared_prefix(tokens, rows)
        logits = self.model(torch.tensor([tokens[common:]]), past_key_values=self.cache, use_cache=True).logits[0]
        self.cached = list(tokens)
        return logits[-rows:].float()

    def _keep_shared_prefix(self, tokens: list[int], rerun: int) -> int:
        """Cut the cache to the longest prefix it shares with `tokens`, leaving at least the last `rerun` tokens
        to run; returns that prefix's length."""
        common, limit = 0, min(len(self.cached), len(tokens) - rerun)
        while common < limit and self.cached[common] == tokens[common]:
            common += 1
        cut_cache(self.cache, common)
        return common

    def _forward(self, cache: DynamicCache, ids: list[list[int]]) -> torch.Tensor:
        """Logits [B, V] for the token after each row (rows of equal length), appended to `cache`."""
        return self.model(torch.tensor(ids), past_key_values=cache, use_cache=True).logits[:, -1].float()

    def _choose(self, logits: torch.Tensor, fan: int) -> tuple[int, torch.Tensor | None]:
        if self.sampling.greedy:
            return int(logits.argmax()), None
        q = saguaro_distribution(distribution(logits, self.sampling), fan, self.factor)
        return int(torch.multinomial(q, 1, generator=self.generator)), q


# --------------------------------------------------------------------------- the speculation cache


@dataclass(frozen=True)
class SSDSettings:
    k: int = 4  # draft length
    budget: int = 8  # guesses pre-drafted per round, spread over the outcomes by `fan_out`
    power: float = 1.0  # r of the miss curve miss(F) ∝ F^-r
    factor: float = 1.0  # Saguaro's C: the drafter's top-F tokens are scaled by it when sampling (1 = off)
    fallback: Literal["draft", "ngram"] = "draft"  # on a miss: the drafter afresh, or prompt lookup first
    threads: int = 1  # the drafter's CPU threads, apart from the target's
    # Spend the whole budget every round even when the outcome arrives first: the cache's quality measured
    # apart from timing (tests, hit rate against budget). Off, a round's speculation stops at the outcome.
    complete: bool = False
    sampling: Sampling = Sampling()
    seed: int = 0

    def __post_init__(self):
        if self.fallback not in ("draft", "ngram"):
            raise ValueError(f"SSD fallback must be 'draft' or 'ngram', not {self.fallback!r}")
        if self.k < 1 or self.budget < 0 or not 0.0 < self.factor <= 1.0:
            raise ValueError(f"SSD needs k >= 1, budget >= 0 and 0 < factor <= 1; got {self.k}, {self.budget}, "
                             f"{self.factor}")


@dataclass
class SSDStats:
    hits: list[int] = field(default_factory=list)  # by outcome j (drafts accepted), bonus included
    misses: list[int] = field(default_factory=list)
    guesses: int = 0  # continuations pre-drafted
    rounds_cut: int = 0  # speculations stopped by the outcome before the budget was spent
    backup_drafts: int = 0  # misses answered by prompt lookup

    def add(self, j: int, hit: bool) -> None:
        for row in (self.hits, self.misses):
            while len(row) <= j:
                row.append(0)
        (self.hits if hit else self.misses)[j] += 1

    @property
    def hit_rate(self) -> float:
        total = sum(self.hits) + sum(self.misses)
        return sum(self.hits) / total if total else 0.0


class Speculator:
    """The worker's state: the last draft, the continuations pre-drafted for its outcomes, acceptance counts."""

    def __init__(self, drafter: DraftLM, settings: SSDSettings, vocab_size: int):
        self.drafter, self.settings, self.vocab_size = drafter, settings, vocab_size
        self.backup = NgramProposer(1, 3)
        self.accepted = [1] * settings.k  # a uniform prior on each position's acceptance rate
        self.proposed = [2] * settings.k
        self.stats = SSDStats()
        self.previous: tuple[list[int], Continuation] | None = None
        self.cache: dict[tuple[int, int], Continuation] = {}

    def reset(self) -> None:
        self.drafter.reset()
        self.previous, self.cache = None, {}

    def fans(self, k: int) -> list[int]:
        rates = [a / n for a, n in zip(self.accepted, self.proposed)][:k]
        return fan_out(self.settings.budget, outcome_probabilities(rates), self.settings.power,
                       caps=[self.vocab_size - 1] * (k + 1))

    def next_draft(self, tokens: list[int], k: int) -> Continuation:
        outcome = self._outcome(tokens)
        cont = None
        if outcome is not None:
            j, token = outcome
            drafted = len(self.previous[1].tokens)
            for i in range(drafted):  # the previous draft's positions: accepted up to j, then rejected
                self.proposed[i] += i <= j
                self.accepted[i] += i < j
            cont = self.cache.get(outcome)
            self.stats.add(j, cont is not None)
        self.cache = {}
        if cont is None:
            cont = self._fallback(tokens, k)
        cont = Continuation(cont.tokens[:k], None if cont.probs is None else cont.probs[:k],
                            None if cont.scores is None else cont.scores[: k + 1])
        self.previous = (list(tokens), cont)
        return cont

    def _outcome(self, tokens: list[int]) -> tuple[int, int] | None:
        """(j, t*) when `tokens` extend the previous round's text by j of its drafts and one token."""
        if self.previous is None:
            return None
        before, cont = self.previous
        j = len(tokens) - len(before) - 1
        if not 0 <= j <= len(cont.tokens) or tokens[: len(before)] != before or \
                tokens[len(before) : len(before) + j] != cont.tokens[:j]:
            return None
        return j, tokens[-1]

    def _fallback(self, tokens: list[int], k: int) -> Continuation:
        if self.settings.fallback == "ngram":
            draft, _ = self.backup.propose(tokens, k)
            if draft:
                self.stats.backup_drafts += 1
                return Continuation(draft, None, None)  # scores come when the drafter catches up
        return self.drafter.draft(tokens, k, self.fans(k))

    def speculate(self, stop) -> None:
        """Pre-draft continuations for the likely outcomes of the last draft, most likely first, until the
        budget is spent or `stop()` says the outcome is known."""
        tokens, cont = self.previous
        k = len(cont.tokens)
        if cont.scores is None or self.drafter.cached != tokens + cont.tokens:
            scores = self.drafter.sync(tokens + cont.tokens, k + 1)
            cont.scores = cont.scores if cont.scores is not None else scores
        if k == 0:
            return
        fans = self.fans(k)
        order: dict[int, list[int]] = {}
        for j, token in guesses(cont.tokens, cont.scores, fans):
            order.setdefault(j, []).append(token)
        for j, firsts in order.items():
            made = self.drafter.continue_batch(len(tokens) + j, firsts, self.settings.k, self.fans(self.settings.k),
                                               stop)
            if made is None:
                self.stats.rounds_cut += 1
                return
            self.cache.update({(j, t): c for t, c in zip(firsts, made)})
            self.stats.guesses += len(firsts)
            if stop():
                self.stats.rounds_cut += 1
                return


# --------------------------------------------------------------------------- the worker process


def _serve(conn, make_model, settings: SSDSettings) -> None:
    """The drafter's process: answer each request for a draft at once, then pre-draft until the next arrives."""
    torch.set_num_threads(settings.threads)
    model = make_model()
    speculator = Speculator(DraftLM(model, settings.sampling, settings.factor, settings.seed), settings,
                            model.config.vocab_size)
    conn.send(("ready",))
    while True:
        message = conn.recv()
        kind = message[0]
        if kind == "propose":
            cont = speculator.next_draft(message[1], message[2])
            conn.send((cont.tokens, cont.probs))
            # stops as soon as the next request is waiting, unless every round spends its budget
            speculator.speculate((lambda: False) if settings.complete else conn.poll)
        elif kind == "reset":
            speculator.reset()
            conn.send(("ok",))
        elif kind == "stats":
            conn.send(speculator.stats)
        elif kind == "close":
            conn.close()
            return


class SSDProposer:
    """A proposer for `generate` whose drafter runs in its own process, on its own CPU threads, and pre-drafts
    for the likely outcomes while the target verifies. `generate` is unchanged: it asks for a draft, and the
    answer is immediate when the outcome was guessed (draft_seconds then measures the exposed drafting)."""

    name = "ssd"

    def __init__(self, make_model, settings: SSDSettings = SSDSettings()):
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # a fresh interpreter: its own torch threads
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, make_model, settings), daemon=True)
        self._process.start()
        child.close()
        if self._conn.recv() != ("ready",):
            raise RuntimeError("the SSD drafter process did not start")

    def reset(self, prompt: list[int]) -> None:
        self._conn.send(("reset",))
        self._conn.recv()

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        self._conn.send(("propose", list(tokens), k))
        return self._conn.recv()

    def stats(self) -> SSDStats:
        self._conn.send(("stats",))
        return self._conn.recv()

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(("close",))
            self._process.join(timeout=30)
        self._conn.close()


def truncated_draft(target_model: str, layers: int, dtype: str = "float32"):
    """A draft model for the worker: the target cut to its first `layers` decoder layers (picklable by name)."""
    from mtptrain.config import TargetConfig
    from mtptrain.engine.draft_model import truncated_target
    from mtptrain.target import load_target

    target = load_target(TargetConfig(model=target_model, dtype=dtype, device="cpu"))
    return truncated_target(target.model, layers)
