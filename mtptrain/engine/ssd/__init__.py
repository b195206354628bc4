"""Speculative speculative decoding (Saguaro; Kumar, Dao and May, arXiv:2603.03251): while the target verifies
a draft, the drafter, in its own process, pre-drafts continuations for the likely outcomes.

    policy.py       what to guess: outcome probabilities, the fan-out per outcome, Saguaro sampling
    drafters.py     the drafter's side: a draft model or a trained head, with its own KV cache
    speculator.py   the speculation cache: settings, statistics, hits and misses
    worker.py       the drafter's process and SSDProposer, the proposer `generate` talks to
"""

from mtptrain.engine.ssd.drafters import Continuation, DraftLM, HeadDraft
from mtptrain.engine.ssd.policy import fan_out, guesses, outcome_probabilities, saguaro_distribution
from mtptrain.engine.ssd.speculator import SSDSettings, SSDStats, Speculator
from mtptrain.engine.ssd.worker import HeadParts, SSDProposer

__all__ = ["Continuation", "DraftLM", "HeadDraft", "HeadParts", "SSDProposer", "SSDSettings", "SSDStats",
           "Speculator", "fan_out", "guesses", "outcome_probabilities", "saguaro_distribution"]
