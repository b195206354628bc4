"""Validation through the inference implementation: the head drafts for real while it trains.

Teacher-forced agreement (`val/acc_*`) scores each draft position against the target's own states. What a
user gets is acceptance in the engine, where the head reads its own predicted features after the first
position and the target verifies. At every `train.eval_every`, `drafting_metrics` runs the engine on
held-out prompts (the validation split's, before their first answer token) with the target on its runtime
(`mtptrain/runtime/`) and the head's KV-cache steps (`mtptrain/heads/fast.py`), greedy, and reports:

    val/tau_chain, val/accept_chain_<i>   a chain of train.engine_eval.k drafts: tau and per-position acceptance
    val/tau_tree,  val/accept_tree_<i>    a small EAGLE-2 tree (branch 2, depth k), where the family has trees

The trainer keeps the head with the best chain tau (`BestHead`) and, with `select_best`, exports that one.
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

import torch

from mtptrain.config import EngineEvalConfig
from mtptrain.engine.generate import GenerationStats, generate
from mtptrain.io import read_json_object
from mtptrain.runtime.runner import open_runner

log = logging.getLogger(__name__)

TREE_BRANCH = 2


@torch.no_grad()
def drafting_metrics(source, head, spec, prompts: list[list[int]], cfg: EngineEvalConfig, stops: set[int]) -> dict:
    """tau and per-position acceptance of the head's chain (and small tree) over `prompts`, greedy, with the
    target on `source` (its runtime decoder, kept between validations, or its model: `open_runner`)."""
    was_training = head.training
    runner = open_runner(source, capture=spec.layers)
    drafters = {"chain": lambda: spec.family.chain(head, spec)}
    if cfg.tree_budget and spec.family.no_tree is None:
        drafters["tree"] = lambda: spec.family.tree(head, spec, TREE_BRANCH, cfg.k, cfg.tree_budget)
    metrics = {}
    try:
        for name, make in drafters.items():
            stats = GenerationStats()
            for prompt in prompts:
                stats.merge(generate(runner, prompt, cfg.max_new_tokens, make(), k=cfg.k, eos=stops).stats)
            metrics[f"val/tau_{name}"] = stats.tau
            metrics.update({f"val/accept_{name}_{i + 1}": a for i, a in enumerate(stats.acceptance())})
    finally:
        runner.close()
        head.train(was_training)  # the drafters put the head in eval mode
    return metrics


class BestHead:
    """The head with the best validated chain tau so far, kept in `<run>/best-head` (a head directory, with
    the validation that chose it in its config) so that a resumed run still knows it."""

    def __init__(self, run_dir: Path):
        self.directory = Path(run_dir) / "best-head"
        self.tau, self.step = -1.0, None
        config = self.directory / "config.json"
        if config.is_file():
            try:
                chosen = read_json_object(config, ValueError, "").get("validation")
                tau, step = float(chosen["tau_chain"]), chosen["step"]
                if not math.isfinite(tau):
                    raise ValueError(tau)
            except (ValueError, TypeError, KeyError, AttributeError):  # damaged: the next validation replaces it
                log.warning("%s does not record the validation that chose its head: the next validation's head "
                            "takes its place", config)
            else:
                self.tau, self.step = tau, step

    def offer(self, step: int, metrics: dict, save) -> bool:
        """Keep this step's head (`save(directory, extra)` writes it) if its chain tau beats the best so far."""
        tau = metrics.get("val/tau_chain")
        if tau is None or tau <= self.tau:
            return False
        scratch = self.directory.with_name(self.directory.name + ".tmp")
        shutil.rmtree(scratch, ignore_errors=True)
        save(scratch, {"validation": {"step": step, "tau_chain": tau,
                                      **{k.removeprefix("val/"): v for k, v in metrics.items()}}})
        shutil.rmtree(self.directory, ignore_errors=True)
        scratch.rename(self.directory)
        self.tau, self.step = tau, step
        log.info("step %d: best validated chain tau so far, %.3f (kept in %s)", step, tau, self.directory)
        return True
