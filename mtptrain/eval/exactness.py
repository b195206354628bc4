"""Exactness at temperature 0: every output of a method must equal the baseline's, token for token, and every
later repeat its own first one. A divergence is tolerated only where the baseline's two best logits at the first
differing token are a float near-tie (near_tie_bound); anything else is an EXACTNESS FAILURE, a bug in the
engine or the proposer, which fails the command."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from mtptrain.config import EvalConfig
from mtptrain.runtime.runner import Runner

log = logging.getLogger(__name__)

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


def logit_scale_and_gap(runner: Runner, context: list[int]) -> tuple[float, float]:
    """The largest logit in magnitude of the baseline's next-token logits after `context` (the scale their
    rounding errors follow), and the margin of the best over the second best, by the forward the baseline
    decodes with."""
    runner.reset()
    logits = runner.forward(context, last_only=True)[-1].float()
    top = logits.topk(2).values
    return float(logits.abs().max()), float(top[0] - top[1])


def near_tie_bound(ev, dtype: torch.dtype, scale: float) -> float:
    """eval.near_tie, or in a half-precision dtype eval.near_tie_ulps rounding steps of the largest logit in
    magnitude (`scale`) if more.

    Two forwards of one context differ in their logits by errors carried from every layer's rounded states,
    whose size follows the logits' overall scale, not the size of the two logits compared: measured on
    SmolLM2-135M in bfloat16, a chain's verification and a one-token step ordered two logits of 3.75 either
    way at a gap of 0.22 (15 steps of 3.75), where the largest logit was -36.25 (1 step of it is 0.25)."""
    bits = MANTISSA_BITS.get(dtype)
    if bits is None or scale == 0:
        return ev.near_tie
    return max(ev.near_tie, ev.near_tie_ulps * 2.0 ** (math.floor(math.log2(abs(scale))) - bits))


@dataclass(frozen=True)
class NearTie:
    """What judges a divergence: the forward the baseline decodes with, and eval's near-tie settings."""

    runner: Runner
    ev: EvalConfig

    def gap_and_bound(self, context: list[int]) -> tuple[float, float]:
        """The baseline's top-2 logit gap after `context`, and the bound below which it is a near-tie."""
        scale, gap = logit_scale_and_gap(self.runner, context)
        return gap, near_tie_bound(self.ev, self.runner.dtype, scale)


@dataclass
class Exactness:
    """One configuration's outputs against the baseline's (its first repeat) and against its own first repeat
    (the later ones): how many were checked and identical, and where the others diverged."""

    label: str
    checked: int = 0
    identical: int = 0
    near_ties: list = field(default_factory=list)
    failures: list = field(default_factory=list)

    def record(self) -> dict:
        """results.json's "exactness" of the configuration."""
        return {"checked": self.checked, "identical": self.identical, "near_ties": self.near_ties,
                "failures": self.failures}

    def against_baseline(self, judge: NearTie, prompt: list[int], reference: list[int], tokens: list[int],
                         where: str) -> None:
        self.checked += 1
        if tokens == reference:
            self.identical += 1
            return
        self._diverged(judge, prompt, reference, tokens, {"request": where}, "the baseline")

    def against_first_repeat(self, judge: NearTie, prompt: list[int], first: list[int], tokens: list[int],
                             where: str, repeat: int) -> None:
        if tokens != first:
            self._diverged(judge, prompt, first, tokens, {"request": where, "repeat": repeat}, "its first repeat")

    def _diverged(self, judge: NearTie, prompt: list[int], expected: list[int], tokens: list[int], entry: dict,
                  against: str) -> None:
        """Records where `tokens` leave `expected`: a near-tie when the baseline's top-2 gap there is below the
        near-tie bound (near_tie_bound), a failure otherwise."""
        first = next((i for i, (a, b) in enumerate(zip(expected, tokens)) if a != b), min(len(expected), len(tokens)))
        gap, bound = judge.gap_and_bound(prompt + expected[:first])
        entry = {**entry, "position": first, "top2_gap": round(gap, 6), "bound": round(bound, 6)}
        where = entry["request"] + (f" (repeat {entry['repeat']})" if "repeat" in entry else "")
        if gap < bound:
            self.near_ties.append(entry)
            log.warning("%s: %s differs from %s at token %d, a near-tie (top-2 gap %.2e < %.0e)",
                        self.label, where, against, first, gap, bound)
        else:
            self.failures.append(entry)
            log.error("EXACTNESS FAILURE: %s: %s differs from %s at token %d where the baseline's top-2 gap is "
                      "%.3g (not a near-tie): this is a bug in the engine or the proposer", self.label, where,
                      against, first, gap)


def exactness_failures(results: dict) -> list[str]:
    return [f"{m['label']} {f['request']} token {f['position']}"
            + (f" (repeat {f['repeat']})" if "repeat" in f else "")
            for m in results["methods"] for f in m["exactness"]["failures"]]
