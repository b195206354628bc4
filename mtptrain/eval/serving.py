"""eval.engines: vllm: the same requests, in the same interleaved repeats, through vLLM (the serving engine).

vLLM runs in its own environment (mtptrain/serving/), one worker process per configuration: its baseline (no
drafts) and the head's chain at each K of eval.k, loaded from an export of the head (vllm.format). Each request
is generated alone (batch 1), timed inside the worker, and read back with vLLM's own spec-decode counters
(vllm:spec_decode_num_drafts, ..._num_accepted_tokens_per_pos), which become the row's GenerationStats:

  steps     target forwards after the prefill: the tokens after the prefill's first, less the drafts accepted
            (each step emits its accepted drafts and one token of the target's); equal to vLLM's num_drafts
            whenever every step drafts, as a head's chain does
  emitted   the tokens after the prefill's first
  accepted  per position, vLLM's num_accepted_tokens_per_pos (position i counts only after 1..i-1: cumulative)

so tau = emitted / steps is vLLM's "acceptance length" (1 + accepted / drafts), pooled over all steps as vLLM
and SGLang report it, but for the tokens a last step drafted past the answer's end, which neither engine emits.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from mtptrain.config import ExportConfig, Recipe
from mtptrain.engine.generate import Generation, GenerationStats
from mtptrain.engine.verify import Sampling
from mtptrain.eval.methods import Config, EvalError, HeadInfo
from mtptrain.export.run import export_head
from mtptrain.export.sidecar import read_sidecar
from mtptrain.serving.vllm_engine import (Served, VllmWorker, batch1_cache_gib, close_all, eagle3_speculation,
                                          engine_args, on_gpu)
from mtptrain.target.source import resolve_local_dir

PREFIX = "vllm "  # the labels of vLLM's rows
# The serving check (docs/export.md): with both engines in float32, where they write the same answers, the head
# drafts from the same contexts in both, so vLLM's acceptance per position matches the embedded engine's within
# AGREEMENT_BOUND and most requests' counts match exactly. Measured on a conforming export (the shipped head, all
# 160 MT-bench requests, benchmarks/vllm_side_by_side.py): gaps 0.000 / 0.006 / 0.007, identical counts in 118
# of 160 requests (0.74). The deliberately broken exports of tests/serving/test_vllm.py each break one or both.
AGREEMENT_BOUND = 0.02
AGREEMENT_SHARE = 0.5
# At temperature > 0 the engines draw their own samples, so their answers differ and only the law can agree: each
# position's pooled acceptance within AGREEMENT_Z standard errors of the embedded engine's (a binomial share of
# each side's steps). Measured with vLLM's drafts sampled (vllm.draft_sample_method: probabilistic), the shipped
# head, 40 MT-bench first turns at temperature 1 (docs/export.md): gaps of 0.4 / 0.6 / 1.5 standard errors, against
# 24 at the first position before vLLM's CPU temperatures were repaired (its issue 55005).
AGREEMENT_Z = 4.0
SETTLE_SECONDS = 0.25  # after a vLLM request, its OpenMP threads spin ~200 ms (KMP_BLOCKTIME): not on the next one


def agreement(tallies, sampled: bool = False) -> list[dict]:
    """Per vLLM chain row, against the embedded row of the same K (the one without an early stop and without a
    draft temperature of its own: vLLM drafts all K, at the eval's temperature): the largest difference of pooled
    acceptance at any position, and of the requests both engines answered with the same tokens, the share whose
    steps and accepted counts per position are identical. `sampled` (the eval's temperature above 0): each
    position's difference in standard errors as well, "z" and "max_z", which is what `conforms` then judges."""
    embedded = {(t.config.method, t.config.k): t for t in tallies if _partner(t.config)}
    found = []
    for t in tallies:
        ours = embedded.get((t.config.method, t.config.k))
        if t.config.engine != "vllm" or t.config.method == "baseline" or ours is None:
            continue
        mine, theirs = ours.stats.acceptance(), t.stats.acceptance()
        width = max(len(mine), len(theirs))  # a position one engine never reached counts as 0 there
        mine, theirs = mine + [0.0] * (width - len(mine)), theirs + [0.0] * (width - len(theirs))
        gaps = [abs(a - b) for a, b in zip(mine, theirs)]
        same = [i for i, (a, b) in enumerate(zip(ours.outputs, t.outputs)) if a == b]
        identical = sum(ours.requests[i].steps == t.requests[i].steps
                        and ours.requests[i].accepted == t.requests[i].accepted for i in same)
        entry = {"label": t.config.label, "against": ours.config.label,
                 "acceptance_gap": [round(g, 4) for g in gaps], "max_gap": round(max(gaps, default=0.0), 4),
                 "same_answers": len(same), "identical_counts": identical,
                 "identical_share": round(identical / len(same), 4) if same else None}
        if sampled:
            z = [_standard_errors(a, b, ours.stats.steps, t.stats.steps) for a, b in zip(mine, theirs)]
            entry.update(sampled=True, z=[round(v, 2) for v in z], max_z=round(max(z, default=0.0), 2),
                         steps=[ours.stats.steps, t.stats.steps])
        found.append(entry)
    return found


def _standard_errors(mine: float, theirs: float, n_mine: int, n_theirs: int) -> float:
    """The difference of two shares of steps in standard errors of the difference (pooled share; binomial)."""
    gap = abs(mine - theirs)
    if not n_mine or not n_theirs:
        return math.inf if gap else 0.0
    pooled = (mine * n_mine + theirs * n_theirs) / (n_mine + n_theirs)
    error = math.sqrt(pooled * (1 - pooled) * (1 / n_mine + 1 / n_theirs))
    return gap / error if error else (math.inf if gap else 0.0)


def _partner(config: Config) -> bool:
    """An embedded row vLLM's chain of the same K is compared with: it drafts all K, at the eval's temperature."""
    return config.engine == "embedded" and not config.stop and config.draft_temperature is None and not config.int8


def unchecked(configs: list[Config]) -> list[str]:
    """A note naming the vLLM chain rows that `agreement` has no embedded row to compare with (empty if none)."""
    partners = {(c.method, c.k) for c in configs if _partner(c)}
    missing = [c.label for c in configs if c.engine == "vllm" and c.method != "baseline"
               and (c.method, c.k) not in partners]
    if not missing:
        return []
    why = ("the embedded engine is not in eval.engines" if not any(c.engine == "embedded" for c in configs) else
           "no embedded chain row of the same K drafts all K at the eval's temperature: add 0 to eval.chain.stops "
           "and, at temperature > 0, leave eval.chain.draft_temperatures empty")
    return [f"vllm: {', '.join(missing)} not checked against the embedded engine's acceptance ({why})"]


def conforms(entry: dict, bound: float = AGREEMENT_BOUND, share: float = AGREEMENT_SHARE,
             z_bound: float = AGREEMENT_Z) -> list[str]:
    """Why an agreement entry fails the serving check (empty when it passes). At temperature > 0 (an entry of
    `agreement(..., sampled=True)`) the engines' answers differ, and each position's acceptance is judged in
    standard errors instead."""
    if entry.get("sampled"):
        if entry["max_z"] > z_bound:
            return [f"{entry['label']}: acceptance per position differs from {entry['against']}'s by up to "
                    f"{entry['max_z']:.1f} standard errors (bound {z_bound:g}; gaps "
                    f"{' '.join(f'{g:.3f}' for g in entry['acceptance_gap'])})"]
        return []
    failures = []
    if entry["max_gap"] > bound:
        failures.append(f"{entry['label']}: acceptance per position differs from {entry['against']}'s by up to "
                        f"{entry['max_gap']:.3f} (bound {bound})")
    if entry["identical_share"] is None:
        failures.append(f"{entry['label']}: no request answered with the same tokens by both engines")
    elif entry["identical_share"] < share:
        failures.append(f"{entry['label']}: of {entry['same_answers']} requests answered alike, "
                        f"{entry['identical_counts']} drafted with identical acceptance (share "
                        f"{entry['identical_share']:.2f} < {share})")
    return failures


def served_stats(served: Served, k: int) -> GenerationStats:
    """A vLLM generation's counters as the engine's GenerationStats (see the module's docstring)."""
    stats = GenerationStats()
    after_first = max(0, len(served.tokens) - 1)
    stats.steps = max(served.drafts, after_first - served.accepted)
    stats.emitted = after_first  # as the embedded engine counts: what was emitted, cut where the answer ended
    stats.verified = served.draft_tokens
    stats.proposed = [served.drafts] * k if served.drafts else []
    stats.accepted = list(served.accepted_per_pos[:k]) if served.drafts else []
    return stats


@dataclass
class ServingRun:
    """The vLLM side of one eval run: its workers, what they said about themselves, and their configurations."""

    workers: list[VllmWorker] = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    configs: list[Config] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # whether vLLM's chain draws its drafts as the embedded engine's does (at temperature > 0 only when vLLM samples
    # them: vllm.draft_sample_method: probabilistic), so that the serving check can compare their acceptance
    comparable: bool = True

    def close(self) -> None:
        close_all(self.workers)

    def record(self) -> dict:
        """results.json's "serving"."""
        return {"engine": "vllm", **self.facts}


def vllm_configs(recipe: Recipe, target, head_info: HeadInfo | None, sampling: Sampling, limit: int,
                 stops: set[int], out_dir: Path) -> ServingRun:
    """Starts one vLLM worker per configuration (baseline, then chain K=k for each K of eval.k when eval.methods
    has chain) and returns them as eval configurations whose `serve` runs one request."""
    ev, run = recipe.eval, ServingRun()
    model = resolve_local_dir(recipe.target)[0]
    wanted: list[tuple[str, int, dict | None, str]] = [("baseline", 0, None, "")]
    if "chain" in ev.methods:
        exports = _exports(recipe, target, head_info, out_dir / "vllm")
        for export in exports:
            name = f" [{export.name}]" if len(exports) > 1 else ""
            drawn = "greedy" if sampling.greedy else recipe.vllm.draft_sample_method  # at T=0 drafts are argmaxes
            wanted += [("chain", k, eagle3_speculation(export, k, drawn), name) for k in ev.k]
    skipped = sorted(set(ev.methods) - {"chain"})
    if skipped:
        run.notes.append(f"vllm: measured without drafts and with the head's chain; {', '.join(skipped)} run in "
                         "the embedded engine only")
    max_model_len = limit + ev.max_new_tokens  # the target's context (eval/prompts.py's token_limit)
    cache = batch1_cache_gib(target.model.config, max_model_len, recipe.vllm.dtype)
    cfg = recipe.vllm
    if cfg.kv_cache_gib is None and cfg.memory_utilization is None and on_gpu():
        # engines side by side on one GPU: each its share (vLLM's default takes 90% of the device for one)
        cfg = cfg.model_copy(update={"memory_utilization": 0.9 / len(wanted)})
    try:
        labels = [PREFIX + ("baseline" if method == "baseline" else f"{method} K={k}{name}")
                  for method, k, _, name in wanted]
        for label, (method, k, speculative, _) in zip(labels, wanted):  # the workers start and build at once
            worker = VllmWorker(cfg, out_dir / "vllm" / f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', label).strip('-')}.log")
            run.workers.append(worker)
            worker.open_begin(engine_args(cfg, model, max_model_len, speculative,
                                          kv_cache_gib=None if on_gpu() else cache))
        for label, worker, (method, k, speculative, _) in zip(labels, run.workers, wanted):
            facts = worker.open_end()
            run.facts = {**{key: facts[key] for key in ("vllm", "torch", "dtype", "device", "threads")},
                         "in_process": cfg.in_process, "format": run.facts.get("format"),
                         "fixed": facts.get("fixed", []), "unprobed": facts.get("unprobed", False)}
            if speculative:
                run.facts["format"] = f"the export {', '.join(cfg.export)}" if cfg.export else cfg.format
            run.configs.append(Config(label, method, k, engine="vllm",
                                      serve=_server(worker, k, sampling, stops, len(wanted) > 1)))
    except BaseException:
        run.close()
        raise
    if not sampling.greedy and recipe.vllm.draft_sample_method == "greedy" and len(wanted) > 1:
        run.comparable = False
        run.notes.append("vllm: its chain drafts the head's argmax at temperature > 0 (vllm.draft_sample_method: "
                         "greedy), the embedded engine samples its drafts, so their acceptance is not compared; "
                         "set vllm.draft_sample_method: probabilistic for the serving check")
    if run.facts.get("unprobed") and not sampling.greedy:
        run.notes.append("vllm: its engine core runs in its own process (vllm.in_process: false), where this eval "
                         "can neither probe nor repair vLLM's CPU expand_batch_to_tokens (vLLM issue 55005: in vLLM "
                         "0.32 it verifies sampled requests against uninitialised temperatures); set "
                         "vllm.in_process: true")
    return run


def _server(worker: VllmWorker, k: int, sampling: Sampling, stops: set[int], settle: bool):
    def serve(ids: list[int], max_new_tokens: int, seed: int) -> tuple[Generation, float]:
        request = {"id": 0, "prompt": list(ids), "max_tokens": max_new_tokens, "temperature": sampling.temperature,
                   "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": seed, "stop": sorted(stops)}
        served = worker.each([request])[0]
        if settle:
            time.sleep(SETTLE_SECONDS)
        return Generation(list(served.tokens), served_stats(served, k)), served.seconds
    return serve


def _exports(recipe: Recipe, target, head_info: HeadInfo | None, out_dir: Path) -> list[Path]:
    """The head in vllm.format, for vLLM to load (the speculators format names the local target as verifier);
    or vllm.export, exports made elsewhere, each after checking it was made for this target."""
    if recipe.vllm.export:
        exports = [_given_export(Path(path), target) for path in recipe.vllm.export]
        names = [export.name for export in exports]
        if len(set(names)) < len(names):
            raise EvalError(f"vllm.export names two exports by one directory name ({', '.join(names)}): their "
                            "rows would share a label; give each its own directory name")
        return exports
    if head_info is None:
        raise EvalError("eval.engines has vllm and eval.methods has chain, but no head was loaded")
    fmt = recipe.vllm.format
    if fmt not in head_info.spec.family.export_formats:
        raise EvalError(f"eval.engines: vllm serves the head from a {fmt} export (vllm.format), which cannot hold a "
                        f"{head_info.spec.kind} head: drop chain from eval.methods for vLLM, or drop vllm from "
                        "eval.engines")
    out = out_dir / f"export-{fmt}"
    export_head(head_info.path, out, ExportConfig(format=fmt, target=recipe.target.model if Path(
        recipe.target.model).expanduser().is_dir() else None, verifier=resolve_local_dir(recipe.target)[0]))
    return [out]


def _given_export(export: Path, target) -> Path:
    sidecar = read_sidecar(export)
    if sidecar.get("export_format") not in ("eagle3", "speculators"):
        raise EvalError(f"vllm.export {export} is a {sidecar.get('export_format')} export: vLLM's EAGLE-3 drafter "
                        "reads eagle3 and speculators exports")
    made_for = sidecar.get("head_config", {}).get("target", {})
    if made_for.get("fingerprint") != target.fingerprint:
        raise EvalError(f"vllm.export {export} was exported for another target ({made_for.get('name')}, "
                        f"fingerprint {made_for.get('fingerprint')}; this one is {target.name}, "
                        f"{target.fingerprint}): export the head for this target")
    return export
