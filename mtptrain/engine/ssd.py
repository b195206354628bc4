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
from typing import TYPE_CHECKING, Literal

import torch
from transformers import DynamicCache

from mtptrain.engine.head_chain import head_features
from mtptrain.engine.ngram import NgramProposer
from mtptrain.engine.runner import cut_cache
from mtptrain.engine.verify import Sampling, distribution

if TYPE_CHECKING:
    from mtptrain.config import TargetConfig


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


class _Drafter:
    """What both drafters share: Saguaro's choice of a token, and continuations drafted row by row in a batch.

    A drafter has `cached`, the text its state covers; `draft(tokens, k, fans)`, one draft from that text;
    `continue_batch(prefix_len, firsts, k, fans, stop)`, a continuation after each of `firsts` appended to its
    text cut to prefix_len; `sync(tokens, rows)`, its scores for the last `rows` positions of `tokens`."""

    def __init__(self, sampling: Sampling, factor: float, seed: int):
        self.sampling, self.factor = sampling, factor
        self.generator = torch.Generator().manual_seed(seed)

    def _choose(self, logits: torch.Tensor, fan: int) -> tuple[int, torch.Tensor | None]:
        if self.sampling.greedy:
            return int(logits.argmax()), None
        q = saguaro_distribution(distribution(logits, self.sampling), fan, self.factor)
        return int(torch.multinomial(q, 1, generator=self.generator)), q

    def _rows(self, step, first_logits: torch.Tensor, k: int, fans: list[int], stop) -> list[Continuation] | None:
        """k tokens for each row of a batch: `step(tokens)` runs one token per row and returns the scores
        [B, V] for the next ones. None when `stop()` turns true between steps."""
        batch = first_logits.shape[0]
        rows, qs = [[] for _ in range(batch)], [[] for _ in range(batch)]
        scores = [[first_logits[b]] for b in range(batch)]
        logits = first_logits
        for index in range(k):
            if stop():
                return None
            picked = [self._choose(logits[b], fans[index] if index < len(fans) else 0) for b in range(batch)]
            for b, (token, q) in enumerate(picked):
                rows[b].append(token)
                qs[b].append(q)
            logits = step([token for token, _ in picked])
            for b in range(batch):
                scores[b].append(logits[b])
        return [Continuation(rows[b], None if self.sampling.greedy else torch.stack(qs[b]), torch.stack(scores[b]))
                for b in range(batch)]


class DraftLM(_Drafter):
    """A small causal LM drafting in the SSD worker: one draft at a time from its KV cache, and continuations
    for many guesses at once, batched per outcome j over a copy of the cache cut after d_1 .. d_j."""

    def __init__(self, model, sampling: Sampling, factor: float, seed: int):
        super().__init__(sampling, factor, seed)
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.vocab_size = model.config.vocab_size
        self.cache, self.cached = DynamicCache(), []  # the cache holds the keys and values of `cached`

    def reset(self, prompt: list[int] | None = None) -> None:
        self.cache, self.cached = DynamicCache(), []

    @torch.inference_mode()
    def draft(self, tokens: list[int], k: int, fans: list[int]) -> Continuation:
        common = self._keep_shared_prefix(tokens, 1)  # the newest token is always run, for its logits
        first = self._forward(self.cache, [tokens[common:]])
        [cont] = self._rows(lambda picked: self._forward(self.cache, [picked]), first, k, fans, lambda: False)
        self.cached = tokens + cont.tokens
        return cont

    @torch.inference_mode()
    def continue_batch(self, prefix_len: int, firsts: list[int], k: int, fans: list[int],
                       stop=lambda: False) -> list[Continuation] | None:
        """Continuations of k tokens after each of `firsts`, all appended to the cached text cut to prefix_len.

        Returns None when `stop()` turns true between forwards (the real outcome has arrived)."""
        cache = copy.deepcopy(self.cache)
        cut_cache(cache, prefix_len)
        if len(firsts) > 1:
            cache.batch_repeat_interleave(len(firsts))
        first = self._forward(cache, [[t] for t in firsts])
        return self._rows(lambda picked: self._forward(cache, [[t] for t in picked]), first, k, fans, stop)

    @torch.inference_mode()
    def sync(self, tokens: list[int], rows: int) -> torch.Tensor:
        """Bring the cache up to `tokens` (after a cached or a backup draft); the scores [rows, V] for the token
        after each of the last `rows` tokens. At least `rows` tokens are run."""
        common = self._keep_shared_prefix(tokens, rows)
        ids = torch.tensor([tokens[common:]], device=self.device)
        logits = self.model(ids, past_key_values=self.cache, use_cache=True).logits[0]
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
        ids = torch.tensor(ids, device=self.device)
        return self.model(ids, past_key_values=cache, use_cache=True).logits[:, -1].float()


class HeadDraft(_Drafter):
    """An EAGLE or EAGLE-3 head drafting in the SSD worker (engine/head_chain.py for its index shift).

    The head reads the target's states, which exist only for verified text: after each verification the
    worker receives them (`observe`), and the head's cache is rebuilt from them up to the committed text, its
    `base`. A draft and its guesses start from there. A guessed outcome (j, t*) continues from the head's own
    predicted features for d_1 .. d_j, since the target's states for them are still being computed; when
    that guess is hit, its draft is the one used, and the next round's guesses are made again from the true
    states (`sync`). Scores are over the target's vocabulary (a reduced draft vocabulary maps into it).
    """

    def __init__(self, head, spec, sampling: Sampling, factor: float, seed: int, vocab_size: int):
        if spec.kind not in ("eagle", "eagle3"):
            raise ValueError(f"SSD drafts with an eagle or eagle3 head, not {spec.kind!r}")
        super().__init__(sampling, factor, seed)
        self.head, self.spec, self.vocab_size = head.eval(), spec, vocab_size
        self.to_target = getattr(head, "draft_to_target", None)
        self.device = next(head.parameters()).device
        self.reset()

    def reset(self, prompt: list[int] | None = None) -> None:
        self.cache = DynamicCache()  # len(base) - 1 positions from the target's states, then the head's own
        self.base: list[int] = list(prompt or [])  # the committed text observed (the pending token last)
        self.outs: list[torch.Tensor] = []  # head outputs [1, 1, H]: outs[i] at position len(base) - 2 + i
        self.cached: list[int] = []  # base and the tokens run after it

    @torch.inference_mode()
    def observe(self, true_length: int, hidden: dict[int, torch.Tensor], next_tokens: list[int]) -> None:
        """The target's states [n, H] at positions true_length .. +n-1, and the n tokens that follow them."""
        cut_cache(self.cache, true_length)
        self.base = self.base[: true_length + 1] + list(next_tokens)
        features = head_features(self.head, self.spec, hidden)
        ids = torch.tensor([next_tokens], device=self.device)
        self.outs = [self.head(features, ids, cache=self.cache)[:, -1:]]
        self.cached = list(self.base)

    @torch.inference_mode()
    def draft(self, tokens: list[int], k: int, fans: list[int]) -> Continuation:
        self._from_base(tokens)
        [cont] = self._rows(self._step(self.cache, self.outs), self._scores(self.outs[0]), k, fans, lambda: False)
        self.cached = tokens + cont.tokens
        return cont

    @torch.inference_mode()
    def continue_batch(self, prefix_len: int, firsts: list[int], k: int, fans: list[int],
                       stop=lambda: False) -> list[Continuation] | None:
        j = prefix_len - len(self.base)  # drafts accepted by the guessed outcome
        if not 0 <= j < len(self.outs):
            raise ValueError(f"a continuation after {j} drafts needs the head to have run them ({len(self.outs) - 1})")
        cache = copy.deepcopy(self.cache)
        cut_cache(cache, len(self.base) - 1 + j)
        if len(firsts) > 1:
            cache.batch_repeat_interleave(len(firsts))
        outs = [self.outs[j].expand(len(firsts), -1, -1)]
        step = self._step(cache, outs)
        return self._rows(step, step(firsts), k, fans, stop)

    @torch.inference_mode()
    def sync(self, tokens: list[int], rows: int) -> torch.Tensor:
        """Run the head from the true states over the tokens after `base`; scores [rows, V] for the token after
        each of the last `rows` tokens."""
        self._from_base(tokens[: len(self.base)])
        step = self._step(self.cache, self.outs)
        scores = [self._scores(self.outs[0])[0]] + [step([token])[0] for token in tokens[len(self.base):]]
        if rows > len(scores):
            raise ValueError(f"the head has scores for {len(scores)} positions after its base, not {rows}")
        self.cached = list(tokens)
        return torch.stack(scores[-rows:])

    def _from_base(self, tokens: list[int]) -> None:
        if tokens != self.base or not self.outs:
            raise RuntimeError("the SSD head drafts only from text whose target states it has observed "
                               f"({len(self.base)} tokens observed, asked for {len(tokens)})")
        cut_cache(self.cache, len(self.base) - 1)
        del self.outs[1:]

    def _step(self, cache: DynamicCache, outs: list[torch.Tensor]):
        """One head step per row, reading its last output and the chosen tokens; appends to `outs`."""
        def step(tokens: list[int]) -> torch.Tensor:
            ids = torch.tensor(tokens, device=self.device)[:, None]
            outs.append(self.head(outs[-1], ids, cache=cache))
            return self._scores(outs[-1])
        return step

    def _scores(self, feature: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] over the target's vocabulary (-inf outside a reduced draft vocabulary)."""
        logits = self.head.logits(feature)[:, -1].float()
        if self.to_target is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.to_target] = logits
        return full


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


# --------------------------------------------------------------------------- the worker process


@dataclass
class HeadParts:
    """What a worker's `make` returns to draft with a head: the head on its device, its spec, the target's
    vocabulary size."""

    head: torch.nn.Module
    spec: object
    vocab_size: int


def _serve(conn, make, settings: SSDSettings) -> None:
    """The drafter's process: answer each request for a draft at once, then pre-draft until the next arrives."""
    torch.set_num_threads(settings.threads)
    try:
        made = make()
        if isinstance(made, HeadParts):
            drafter = HeadDraft(made.head, made.spec, settings.sampling, settings.factor, settings.seed,
                                made.vocab_size)
        else:
            drafter = DraftLM(made, settings.sampling, settings.factor, settings.seed)
    except Exception as exc:  # the main process raises it, with what the worker found
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    speculator = Speculator(drafter, settings)
    conn.send(("ready",))
    while True:
        message = conn.recv()
        kind = message[0]
        if kind == "propose":
            cont = speculator.next_draft(message[1], message[2])
            conn.send((cont.tokens, None if cont.probs is None else cont.probs.cpu()))
            # stops as soon as the next message is waiting, unless every round spends its budget
            speculator.speculate((lambda: False) if settings.complete else conn.poll)
        elif kind == "observe":  # no answer: the target's loop goes on at once
            drafter.observe(*message[1:])
        elif kind == "idle":  # the request is over: stop speculating, so no CPU is spent past it
            conn.send(("ok",))
        elif kind == "reset":
            speculator.reset(message[1])
            conn.send(("ok",))
        elif kind == "stats":
            conn.send(speculator.stats)
        elif kind == "close":
            conn.close()
            return


class SSDProposer:
    """A proposer for `generate` whose drafter runs in its own process, on its own CPU threads (or device), and
    pre-drafts for the likely outcomes while the target verifies. `generate` is unchanged: it asks for a draft,
    and the answer is immediate when the outcome was guessed (draft_seconds then measures the exposed drafting).

    `make` (picklable: a module-level function or a partial of one) builds the drafter in the worker: a causal
    LM, or `HeadParts` for a head. A head reads the target's states, so give `layers` (the target layers it
    reads; the runner must capture them): the proposer then forwards each verification's states to the worker.
    """

    name = "ssd"

    def __init__(self, make, settings: SSDSettings = SSDSettings(), layers: list[int] | None = None,
                 device: str | torch.device = "cpu"):
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # a fresh interpreter: its own torch threads
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, make, settings), daemon=True)
        self._process.start()
        child.close()
        try:
            answer = self._conn.recv()
        except EOFError:
            self._process.join(timeout=5)
            answer = ("error", f"the process exited with code {self._process.exitcode}")
        if answer != ("ready",):
            self._process.join(timeout=5)
            raise RuntimeError(f"the SSD drafter process could not start its drafter: {answer[1]}")
        self._device = torch.device(device)  # the target's: the draft distributions go there
        if layers is not None:
            self.layers = list(layers)
            self.observe = self._observe  # `generate` hands states only to proposers that have `observe`

    def reset(self, prompt: list[int]) -> None:
        self._conn.send(("reset", list(prompt)))
        self._conn.recv()

    def _observe(self, true_length: int, hidden: dict[int, torch.Tensor], next_tokens: list[int]) -> None:
        states = {layer: hidden[layer].detach().to("cpu", copy=True) for layer in self.layers}
        self._conn.send(("observe", true_length, states, list(next_tokens)))

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        self._conn.send(("propose", list(tokens), k))
        draft, probs = self._conn.recv()
        return draft, None if probs is None else probs.to(self._device)

    def finish(self, tokens: list[int]) -> None:
        """The request is over (`generate` calls this): returns once the worker has stopped pre-drafting."""
        self._conn.send(("idle",))
        self._conn.recv()

    def stats(self) -> SSDStats:
        self._conn.send(("stats",))
        return self._conn.recv()

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(("close",))
            self._process.join(timeout=30)
        self._conn.close()


def draft_lm(target: TargetConfig, draft_model: str | None = None, layers: int | None = None,
             device: str = "cpu"):
    """`make` for a draft model in the worker: `draft_model` (a causal LM with the target's tokenizer), or the
    target cut to its first `layers` decoder layers, on `device` (CPU linear layers as eval runs them)."""
    from mtptrain.engine.draft_model import truncated_target
    from mtptrain.target import load_target

    cfg = target.model_copy(update={"device": device, "gpus_per_rank": 1})
    if draft_model is not None:
        cfg = cfg.model_copy(update={"model": draft_model, "gguf_file": None, "revision": None})
    model = load_target(cfg).model
    if layers is not None:
        model = truncated_target(model, layers)
    return _cpu_linears(model)


def head_parts(directory: str, target: TargetConfig, identity: dict, device: str = "cpu") -> HeadParts:
    """`make` for a head in the worker: the target's embedding, final norm and LM head (its decoder layers
    are not loaded when the checkpoint is in safetensors), and the head, checked against `identity` (the
    target the main process loaded)."""
    from pathlib import Path

    from mtptrain.heads import FrozenTarget
    from mtptrain.heads.checkpoint import load_head
    from mtptrain.target import load_frozen_target, load_target

    cfg = target.model_copy(update={"device": device, "gpus_per_rank": 1})
    loaded = load_frozen_target(cfg) or load_target(cfg)
    head, spec = load_head(Path(directory), FrozenTarget.of(loaded.model), identity)
    head.to(dtype=loaded.model.get_input_embeddings().weight.dtype)
    return HeadParts(_cpu_linears(head), spec, loaded.model.config.vocab_size)


def _cpu_linears(model):
    """On CPU, the short-input linear layers eval uses (engine/cpu_matmul.py), for the life of the worker."""
    from mtptrain.engine.cpu_matmul import skinny_linears

    skinny_linears(model).__enter__()  # never exited: the process exists only to draft
    return model
