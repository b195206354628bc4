"""The one loop: prefill, then propose, verify, accept, advance, until max_new_tokens or end of sequence.

The target's cache always holds the committed tokens except the newest one
("pending"), whose logits are not known yet. A step runs the target on
[pending, d_1 .. d_K]: row i scores the token after pending and the first i
drafts, which verifies d_{i+1} and supplies the bonus after d_K. After n
drafts are accepted, the cache is rolled back to the committed prefix plus
pending plus those n, and the correction (or bonus) token becomes pending.
A drafter may also propose a tree (engine/tree.py): the target then scores
every node in one forward under a tree mask, and the cache keeps the pending
token plus the accepted path. With no proposer the same loop is plain
autoregressive decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from mtptrain.engine.proposer import Proposer, common_prefix
from mtptrain.engine.tree import DraftTree, verify_tree_greedy, verify_tree_sampling
from mtptrain.engine.verify import (Sampling, TargetRows, distribution, draw, greedy_choice, verify_greedy,
                                    verify_sampling)
from mtptrain.runtime.attention import decoding_kernels
from mtptrain.runtime.runner import Runner


@dataclass
class GenerationStats:
    steps: int = 0  # verification forwards (the prefill not included)
    emitted: int = 0  # tokens emitted by those steps, bonus included
    proposed: list[int] = field(default_factory=list)  # per draft position
    accepted: list[int] = field(default_factory=list)
    verified: int = 0  # draft tokens scored by the target (a tree's nodes, a chain's length)
    draft_seconds: float = 0.0  # proposing, and a drafter catching up on the target's states
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0  # up to the first token: the prompt's forward, and a drafter reading its states
    prefilled: int = 0  # prompt tokens the target ran before the first token (fewer where a prefix was reused)

    @property
    def tau(self) -> float:
        """Mean accepted length: tokens emitted per target forward, bonus included (1.0 without drafting)."""
        return self.emitted / self.steps if self.steps else 0.0

    def acceptance(self) -> list[float]:
        """At position i, the share of all verification steps whose drafts 1..i were all accepted (a step that
        drafted fewer than i tokens counts as not reaching i). Out of all steps, not out of those that drafted
        i: a tree's depth and an n-gram's match vary from step to step, and over all steps every method's
        numbers compare, fall with i, and sum to tau - 1 (each step emits its accepted drafts plus one), less
        the tokens cut where an answer ends (its token budget or an end of sequence) inside a step."""
        return [a / self.steps for a in self.accepted] if self.steps else []

    def record(self, drafted: int, accepted: int, emitted: int, verified: int | None = None) -> None:
        """drafted: the draft's depth (a chain's length); verified: the draft tokens the target scored."""
        self.steps += 1
        self.verified += drafted if verified is None else verified
        self.emitted += emitted
        while len(self.proposed) < drafted:
            self.proposed.append(0)
            self.accepted.append(0)
        for i in range(drafted):
            self.proposed[i] += 1
            self.accepted[i] += i < accepted

    def merge(self, other: GenerationStats) -> None:
        """Add another generation's counts and times to these (per draft position too)."""
        self.steps += other.steps
        self.emitted += other.emitted
        self.verified += other.verified
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds
        self.prefill_seconds += other.prefill_seconds
        self.prefilled += other.prefilled
        for i, (proposed, accepted) in enumerate(zip(other.proposed, other.accepted)):
            if i == len(self.proposed):
                self.proposed.append(0)
                self.accepted.append(0)
            self.proposed[i] += proposed
            self.accepted[i] += accepted


@dataclass
class Generation:
    tokens: list[int]
    stats: GenerationStats


def generate(runner: Runner, prompt: list[int], max_new_tokens: int, proposer: Proposer | None = None, k: int = 4,
             sampling: Sampling = Sampling(), eos: set[int] = frozenset(), seed: int = 0,
             reuse_prefix: bool = False) -> Generation:
    """Up to `max_new_tokens` after `prompt`: the proposer's drafts (k at most) verified by the target, exactly
    (its greedy decoding at temperature 0, its own distribution otherwise). On CUDA the target's and the drafter's
    attention run without cuDNN's kernel, which plans anew for every length (runtime/attention.py).

    reuse_prefix: the prompt's longest prefix that the runner's cache already holds (what its last generation
    left: a conversation's earlier turns, a shared system prompt) is not run again, as a serving engine's prefix
    cache does; a drafter that reads the target's states bounds it by what it keeps of its own
    (`Proposer.reusable`). Off, the whole prompt is run. The tokens are the same either way up to float
    rounding: the reused keys and values were computed in forwards of other lengths."""
    with decoding_kernels(runner.device):
        return _generate(runner, prompt, max_new_tokens, proposer, k, sampling, eos, seed, reuse_prefix)


def reusable_prefix(runner: Runner, prompt: list[int], proposer: Proposer | None = None) -> int:
    """How many leading tokens of `prompt` need not run through the target: those its cache holds but the last
    of them, and no more than a drafter reading the target's states keeps of its own. The last shared token runs
    again (never the prompt's last either, whose logits give the first token): a head's position there reads
    the token after it, so a head could not keep it, and with every configuration starting at the same place
    their reused keys stay alike (a position computed again in a forward of another length rounds otherwise in
    bfloat16, and flips near-ties)."""
    n = min(common_prefix(runner.tokens, prompt) - 1, len(prompt) - 1)
    if proposer is not None and proposer.reads_states:
        n = min(n, proposer.reusable(prompt))
    return max(n, 0)


def _generate(runner: Runner, prompt: list[int], max_new_tokens: int, proposer: Proposer | None, k: int,
              sampling: Sampling, eos: set[int], seed: int, reuse_prefix: bool) -> Generation:
    opened = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)  # on the CPU whatever the target's device: see verify.draw
    stats = GenerationStats()
    start = reusable_prefix(runner, prompt, proposer) if reuse_prefix else 0
    if start:
        runner.rollback(start)
    else:
        runner.reset()
    observes = proposer is not None and proposer.reads_states
    if proposer is not None:
        proposer.reset(prompt)
    first = _pick(runner.forward(prompt[start:], last_only=True), sampling, generator)
    out = [first]
    stats.prefilled = len(prompt) - start
    if observes:  # drafters that read the target's states see them for every committed position
        proposer.observe(start, runner.hidden, prompt[start + 1:] + [first])
    sync = _synchronizer(runner)  # honest step timings
    sync()
    stats.prefill_seconds = time.perf_counter() - opened
    while len(out) < max_new_tokens and out[-1] not in eos:
        started = time.perf_counter()
        budget = min(k, max_new_tokens - len(out))
        proposal = proposer.propose(prompt + out, budget) if proposer is not None and budget else ([], None)
        sync()
        verifying = time.perf_counter()
        committed = len(prompt) + len(out)  # the cache holds committed - 1 tokens; pending goes next
        if isinstance(proposal, DraftTree):
            logits = runner.forward_tree(out[-1], proposal)
            if sampling.greedy:
                verdict = verify_tree_greedy(proposal, logits)
            else:
                verdict = verify_tree_sampling(proposal, TargetRows(logits, sampling), generator)
            runner.keep(committed, verdict.path)
            rows = [0] + [1 + i for i in verdict.path]
            drafted, size = max(proposal.depths(), default=0), len(proposal)
        else:
            draft, draft_probs = proposal
            logits = runner.forward([out[-1]] + draft)
            if sampling.greedy:
                verdict = verify_greedy(draft, logits)
            else:
                verdict = verify_sampling(draft, draft_probs, TargetRows(logits, sampling), generator)
            runner.rollback(committed + verdict.accepted)
            rows = slice(0, verdict.accepted + 1)  # a view of each layer's states, not a copy
            drafted = size = len(draft)
        sync()
        verified = time.perf_counter()
        if observes:  # the drafter catches up on the target's states: drafting work, timed as such
            kept = {layer: states[rows] for layer, states in runner.hidden.items()}
            proposer.observe(committed - 1, kept, verdict.emitted)
        sync()
        stats.draft_seconds += (verifying - started) + (time.perf_counter() - verified)
        stats.verify_seconds += verified - verifying
        emitted = _until_eos(verdict.emitted, eos)[: max_new_tokens - len(out)]  # a bonus past the end is dropped
        stats.record(drafted, verdict.accepted, len(emitted), size)
        out.extend(emitted)
    tokens = _until_eos(out, eos)
    if proposer is not None:
        proposer.finish(prompt + tokens)
    return Generation(tokens, stats)


def _synchronizer(runner: Runner):
    """Waits for every GPU the target runs on (a split target spans several; synchronize() waits for one)."""
    devices = [d for d in getattr(runner, "devices", [runner.device]) if d.type == "cuda"]
    return (lambda: [torch.cuda.synchronize(d) for d in devices]) if devices else (lambda: None)


def _pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    if sampling.greedy:
        return greedy_choice(logits[-1])
    return draw(distribution(logits[-1], sampling), generator)


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens
