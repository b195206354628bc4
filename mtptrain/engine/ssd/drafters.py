"""The drafter's side of SSD: a draft model or a trained head, drafting a continuation for each guessed outcome
from a shared prefix, with its own KV cache."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from mtptrain.runtime.transformers_runner import cut_cache
from mtptrain.engine.proposer import common_prefix
from mtptrain.engine.ssd.policy import saguaro_distribution
from mtptrain.engine.verify import Sampling, distribution, draw


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
        return draw(q, self.generator), q

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
        common = common_prefix(self.cached, tokens, max(len(tokens) - rerun, 0))
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
        features = self.head.draft_input(hidden, self.spec)
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
