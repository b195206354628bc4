"""Exactness: outputs compared with their reference, a divergence judged by the baseline's top-2 logit gap at
its first differing token (a near-tie tolerated, anything else a failure), and the failures a command reports."""

import torch

from mtptrain.config import EvalConfig
from mtptrain.eval.exactness import Exactness, NearTie, exactness_failures, near_tie_bound


class FixedLogits:
    """A runner whose next-token logits are the same after every context, in float32."""

    dtype = torch.float32

    def __init__(self, logits: list[float]):
        self.logits, self.contexts = torch.tensor([logits]), []

    def reset(self):
        pass

    def forward(self, context, last_only=False):
        self.contexts.append(list(context))
        return self.logits


def test_the_half_precision_near_tie_bound_follows_the_largest_logit():
    """In bfloat16 the bound is eval.near_tie_ulps rounding steps of the largest logit in magnitude (the scale of
    the logits' errors), whatever the size of the two logits compared; in float32 it is eval.near_tie."""
    ev = EvalConfig()
    assert near_tie_bound(ev, torch.float32, 36.25) == ev.near_tie
    assert near_tie_bound(ev, torch.bfloat16, 36.25) == 4 * 0.25  # one step of a logit in [32, 64) is 2**-2
    assert near_tie_bound(ev, torch.bfloat16, -36.25) == 1.0
    assert near_tie_bound(ev, torch.bfloat16, 3.75) == 4 * 2.0 ** -6
    assert near_tie_bound(ev, torch.bfloat16, 0.0) == ev.near_tie


def test_a_divergence_is_a_near_tie_only_below_the_bound_and_is_judged_where_it_starts():
    exactness, tie = Exactness("chain K=2"), FixedLogits([1.0, 1.0 - 1e-4, -2.0])
    exactness.against_baseline(NearTie(tie, EvalConfig()), [7, 8], [1, 2, 3], [1, 2, 3], "q0/1")
    exactness.against_baseline(NearTie(tie, EvalConfig()), [7, 8], [1, 2, 3], [1, 5, 3], "q1/1")
    assert tie.contexts == [[7, 8, 1]]  # the prompt and the tokens before the first difference
    clear = FixedLogits([3.0, 1.0, 0.0])
    exactness.against_baseline(NearTie(clear, EvalConfig()), [7], [1, 2], [1], "q2/1")  # a shorter output
    exactness.against_first_repeat(NearTie(clear, EvalConfig()), [7], [4, 4], [4, 4], "q0/1", 2)
    exactness.against_first_repeat(NearTie(clear, EvalConfig()), [7], [4, 4], [4, 6], "q0/1", 2)
    record = exactness.record()
    assert (record["checked"], record["identical"]) == (3, 1)  # the repeats are not counted as checks
    assert record["near_ties"] == [{"request": "q1/1", "position": 1, "top2_gap": 0.0001, "bound": 0.001}]
    assert record["failures"] == [{"request": "q2/1", "position": 1, "top2_gap": 2.0, "bound": 0.001},
                                  {"request": "q0/1", "repeat": 2, "position": 1, "top2_gap": 2.0, "bound": 0.001}]
    results = {"methods": [{"label": "chain K=2", "exactness": record}]}
    assert exactness_failures(results) == ["chain K=2 q2/1 token 1", "chain K=2 q0/1 token 1 (repeat 2)"]
