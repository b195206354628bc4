"""The speculation cache: which continuations are pre-drafted for the guessed outcomes of a verification, and
what is answered when the real outcome arrives (a hit, or a fresh draft)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mtptrain.engine.ngram import NgramProposer
from mtptrain.engine.ssd.drafters import Continuation, DraftLM, HeadDraft
from mtptrain.engine.ssd.policy import fan_out, guesses, outcome_probabilities
from mtptrain.engine.verify import Sampling


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

    def since(self, earlier: "SSDStats") -> "SSDStats":
        """What was counted after `earlier` (a snapshot of the same worker's stats)."""
        def minus(now: list[int], then: list[int]) -> list[int]:
            return [n - (then[j] if j < len(then) else 0) for j, n in enumerate(now)]
        return SSDStats(minus(self.hits, earlier.hits), minus(self.misses, earlier.misses),
                        self.guesses - earlier.guesses, self.rounds_cut - earlier.rounds_cut,
                        self.backup_drafts - earlier.backup_drafts)

    def summary(self) -> dict:
        return {"hit_rate": round(self.hit_rate, 4), "hits_by_accepted": self.hits, "misses_by_accepted": self.misses,
                "guesses": self.guesses, "rounds_cut": self.rounds_cut, "backup_drafts": self.backup_drafts}


class Speculator:
    """The worker's state: the last draft, the continuations pre-drafted for its outcomes, acceptance counts."""

    def __init__(self, drafter: DraftLM | HeadDraft, settings: SSDSettings):
        self.drafter, self.settings, self.vocab_size = drafter, settings, drafter.vocab_size
        self.backup = NgramProposer(1, 3)
        self.accepted = [1] * settings.k  # a uniform prior on each position's acceptance rate
        self.proposed = [2] * settings.k
        self.stats = SSDStats()
        self.previous: tuple[list[int], Continuation] | None = None
        self.cache: dict[tuple[int, int], Continuation] = {}

    def reset(self, prompt: list[int] | None = None) -> None:
        self.drafter.reset(prompt)
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
            # a cached or prompt-lookup draft: the drafter runs it from the committed text (a head from the
            # target's true states, where its cached draft had read its own predictions)
            cont.scores = self.drafter.sync(tokens + cont.tokens, k + 1)
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
