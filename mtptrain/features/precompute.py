"""`mtptrain precompute`: run the target over prepared conversations, store its hidden states.

The work is planned before anything runs (`plan.py`): samples are sorted by
length within each split and cut into shards of about `shard_mb`; rank r of W
computes the shards r, r+W, r+2W, ... (`compute.py`). A rerun skips every
shard whose record is on disk. Whichever rank sees the last record appear
writes the manifest (under torchrun, rank 0 after a barrier).
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from pathlib import Path

from mtptrain.data.prepare import prepare_samples
from mtptrain.data.resumable import state_path
from mtptrain.data.samples import RowStats
from mtptrain.config import Recipe, dump_recipe
from mtptrain.dist import DistInfo, all_reduce_sum, barrier, destroy_process_group, init_process_group
from mtptrain.features.compute import RankResult, compute_shards, store_writes
from mtptrain.features.plan import ShardPlan, make_plan_id, plan_shards
from mtptrain.target.layers import resolve_layers
from mtptrain.data.kept_states import KeptStates
from mtptrain.features.store import (
    MANIFEST, SCHEMA_VERSION, SPLITS, FeatureStoreError, load_manifest, read_complete_record, record_path,
    stored_bits, write_manifest,
)
from mtptrain.io import atomic_write_json, create_json_once, load_json, sha256_file
from mtptrain.runtime.dtype import agree_on_dtype, ranks_must_agree
from mtptrain.runtime.runner import runtime_record
from mtptrain.target import Target, load_config, load_target, rank_devices
from mtptrain.tracking import init_run

log = logging.getLogger(__name__)

RUNTIME_FILE = "runtime.json"  # the target's compute dtype and kernels that computed the store's shards


def build_manifest(out_dir: Path, plan: list[ShardPlan], plan_id: str, target: Target, layers: list[int],
                   recipe: Recipe, stats: RowStats, runtime: dict) -> dict | None:
    """The manifest, if every planned shard is complete; None while some are missing."""
    records = [read_complete_record(out_dir / shard.name, plan_id) for shard in plan]
    if any(r is None for r in records):
        return None
    totals = {split: {"samples": sum(r.samples for r in records if r.split == split),
                      "tokens": sum(r.tokens for r in records if r.split == split)} for split in SPLITS}
    return {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "target": target.identity(),
        "layers": layers,
        "last_layer": target.num_layers - 1,
        "layer_convention": "output of decoder layer i, 0-based; the last layer is stored before the final norm",
        "dtype": recipe.precompute.dtype,
        "runtime": runtime,  # what computed the features: the target's compute dtype and kernels
        "max_length": recipe.data.max_length,
        "data": {**recipe.data.model_dump(mode="json"), "rows": stats.to_dict()},
        "plan_id": plan_id,
        "totals": totals,
        "shards": [{k: v for k, v in r.__dict__.items() if k != "plan_id"} for r in records],
    }


def run_precompute(recipe: Recipe, show_progress: bool = True, wandb: str | None = None) -> dict:
    dist = DistInfo.from_env()
    grouped = init_process_group(dist)
    try:
        summary = _precompute(recipe, dist, grouped, show_progress and dist.is_main)
    finally:
        if grouped:
            destroy_process_group()
    if dist.is_main:
        _log_wandb(recipe, summary, wandb or recipe.tracking.wandb)
    return summary


def _log_wandb(recipe: Recipe, summary: dict, mode: str) -> None:
    """Rank 0's numbers (and the store's, once complete) as the precompute job of the run's W&B group."""
    run = init_run(recipe, "precompute", mode, Path(recipe.precompute.output_dir))
    if run is None:
        return
    flat = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    flat.update({f"samples/{split}": n for split, n in summary.get("samples", {}).items()})
    run.summary.update({f"precompute/{k}": v for k, v in flat.items()})
    run.finish()


def _precompute(recipe: Recipe, dist: DistInfo, grouped: bool, show_progress: bool) -> dict:
    out_dir = Path(recipe.precompute.output_dir)
    with store_writes(out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
    device = rank_devices(recipe.target, dist)[0]
    if ranks_must_agree(device, dist):  # every rank computes its shards with rank 0's dtype and kernels
        agree_on_dtype(load_config(recipe.target), device)
    target = load_target(recipe.target, dist)
    layers = resolve_layers(recipe.precompute.layers, target.num_layers)
    samples, stats = prepare_samples(recipe.data, target.tokenizer, show_progress=show_progress)
    for split in SPLITS:
        if not any(s.split == split for s in samples):
            log.warning("the %s split is empty (data.validation_fraction=%s)", split, recipe.data.validation_fraction)
    bytes_per_token = len(layers) * target.hidden_size * stored_bits(recipe.precompute.dtype) // 8
    plan = plan_shards(samples, max(1, int(recipe.precompute.shard_mb * 2**20 / bytes_per_token)))
    plan_id = make_plan_id(target, recipe, layers, plan)
    # Refuse another recipe's directory before writing anything into it.
    complete = [read_complete_record(out_dir / shard.name, plan_id) is not None for shard in plan]
    existing = _existing_manifest(out_dir)
    if existing is not None and existing["plan_id"] != plan_id:
        raise FeatureStoreError(f"{out_dir / MANIFEST} belongs to a store made by another recipe (other data, "
                                "target, layers or dtype); nothing in it was changed. Use a new precompute.output_dir.")
    mine = plan[dist.rank :: dist.world_size]
    damaged = _drop_damaged(out_dir, mine, plan_id)
    if grouped:  # every rank takes the same branch below, or the others would wait at a barrier forever
        damaged = int(all_reduce_sum(damaged))
    if existing is not None and all(complete) and not damaged:
        log.info("%s is already complete (shards verified); nothing to compute", out_dir)
        return _finish(out_dir, existing, RankResult(shards_skipped=len(plan)), dist, bytes_per_token, False)
    if existing is not None and (dist.is_main or damaged):
        log.warning("%s lists shards that are missing or damaged: recomputing them", out_dir / MANIFEST)
        (out_dir / MANIFEST).unlink(missing_ok=True)  # rewritten once every shard is back
    if dist.is_main:
        with store_writes(out_dir):
            dump_recipe(recipe, out_dir / "recipe.yaml")
    log.info("plan: %d samples, %d tokens, layers %s, %d shards over %d rank(s)", len(samples),
             sum(len(s) for s in samples), layers, len(plan), dist.world_size)
    runtime = _claim_runtime(out_dir, runtime_record(target.model, recipe.target.runtime))
    _remove_stale_temporaries(out_dir, mine)
    regenerated = Path(recipe.data.regenerated) if recipe.data.regenerated else None
    kept = None if regenerated is None else KeptStates.open(
        regenerated, state_path(regenerated), layers, recipe.precompute.dtype, runtime, target.hidden_size,
        target.vocab_size)
    result = compute_shards(target, mine, layers, recipe, out_dir, plan_id, dist.rank, show_progress, kept)
    if kept is not None:
        log.info("precompute: %d samples copied from the states %s kept, %d computed", kept.copied,
                 Path(recipe.data.regenerated).name, kept.computed)
    if grouped:
        barrier()
    manifest, wrote = None, False
    if dist.is_main or not grouped:
        manifest = build_manifest(out_dir, plan, plan_id, target, layers, recipe, stats, runtime)
        if manifest is not None and not grouped and dist.world_size > 1:
            wrote = _first_to_write(out_dir, manifest)
            manifest = manifest if wrote else None  # the rank that wrote it reports the store
        elif manifest is not None:
            with store_writes(out_dir):
                write_manifest(out_dir, manifest)
            wrote = True
    if grouped:
        barrier()
    return _finish(out_dir, manifest, result, dist, bytes_per_token, wrote)


def _claim_runtime(out_dir: Path, record: dict) -> dict:
    """The runtime every shard of the store is computed with: the first run (or rank) to get here records its own
    in RUNTIME_FILE; a later one whose target would compute in another dtype refuses, since a store whose shards
    differ in precision by which run or rank wrote them trains a head on a mix. Other kernels in the same dtype
    differ in float32 rounding only: a warning."""
    path = out_dir / RUNTIME_FILE
    if not path.exists():
        with store_writes(out_dir):
            create_json_once(path, record)  # never over a record another rank made first
    try:
        stored = load_json(path.read_text())
    except (OSError, ValueError) as exc:
        raise FeatureStoreError(f"{path} cannot be read ({exc}): it records how this store's shards were computed. "
                                "Compute the store into a new precompute.output_dir.") from None
    if not isinstance(stored, dict) or (stored.get("runtime"), stored.get("dtype")) != \
            (record["runtime"], record["dtype"]):
        mine = f"{record['runtime']} runtime in {record['dtype']}"
        theirs = (f"{stored.get('runtime')} runtime in {stored.get('dtype')}" if isinstance(stored, dict)
                  else repr(stored))
        raise FeatureStoreError(
            f"{path}: this store's shards were computed on the {theirs}, and this run would compute on the {mine}. "
            f"One store holds one precision: set target.dtype={stored.get('dtype') if isinstance(stored, dict) else '...'}"
            " (and target.runtime to match) to finish it, or compute into a new precompute.output_dir.")
    if stored != record:
        log.warning("%s: the shards so far were computed with other kernels (%s) than this run's (%s); same dtype, "
                    "so they differ in rounding only", path, stored, record)
    return stored


def _first_to_write(out_dir: Path, manifest: dict) -> bool:
    """Write the manifest unless another rank has just written this store's: ranks without a process group
    that finish together both see every record, and exactly one of them writes and reports the store."""
    with store_writes(out_dir):
        if create_json_once(out_dir / MANIFEST, manifest):
            return True
        existing = _existing_manifest(out_dir)
        if existing is not None and existing.get("plan_id") == manifest["plan_id"]:
            return False
        write_manifest(out_dir, manifest)  # a stale or unreadable manifest: rewritten, as a single rank would
    return True


def _existing_manifest(out_dir: Path) -> dict | None:
    """The manifest already in out_dir, or None; an unreadable one is set aside, as if absent."""
    if not (out_dir / MANIFEST).is_file():
        return None
    try:
        return load_manifest(out_dir)
    except FeatureStoreError as exc:
        log.warning("ignoring the manifest in %s (%s); it will be rewritten", out_dir, exc)
        return None


def _drop_damaged(out_dir: Path, mine: list[ShardPlan], plan_id: str) -> int:
    """Check this rank's complete shards against their records (sha256) and drop the record of each one that does
    not match, so that it is computed again; returns how many. A rerun skips only what it has verified."""
    damaged = 0
    for shard in mine:
        record = read_complete_record(out_dir / shard.name, plan_id)
        if record is not None and sha256_file(out_dir / shard.name) != record.sha256:
            log.warning("%s does not match its record (sha256): the shard is damaged; computing it again",
                        out_dir / shard.name)
            record_path(out_dir / shard.name).unlink()
            damaged += 1
    return damaged


def _remove_stale_temporaries(out_dir: Path, mine: list[ShardPlan]) -> None:
    """Temporary files of this rank's shards and their records left by a killed run (no other rank writes
    these shards)."""
    for shard in mine:
        for name in (shard.name, record_path(out_dir / shard.name).name):
            for stale in out_dir.glob(f".{name}.tmp-*"):
                stale.unlink(missing_ok=True)


def _finish(out_dir: Path, manifest: dict | None, result: RankResult, dist: DistInfo, min_bytes_per_token: int,
            wrote_manifest: bool) -> dict:
    summary = {
        "rank": dist.rank, "world_size": dist.world_size, "wrote_manifest": wrote_manifest,
        "shards_written": result.shards_written, "shards_skipped": result.shards_skipped,
        "tokens_computed": result.tokens, "tokens_copied": result.copied_tokens, "seconds": round(result.seconds, 2),
        "tokens_per_second": round(result.tokens / result.seconds, 1) if result.seconds else None,
        "padding_fraction": (round(1 - (result.tokens - result.copied_tokens) / result.padded_tokens, 4)
                             if result.padded_tokens else 0.0),
    }
    if manifest is None:
        summary["complete"] = False
        return summary
    stored_bytes = sum(s["bytes"] for s in manifest["shards"])
    tokens = sum(t["tokens"] for t in manifest["totals"].values())
    summary.update({
        "complete": True,
        "samples": {split: t["samples"] for split, t in manifest["totals"].items()},
        "tokens": tokens, "rows": manifest["data"]["rows"], "bytes_on_disk": stored_bytes,
        "bytes_per_token": round(stored_bytes / max(tokens, 1), 1),
        "min_bytes_per_token": min_bytes_per_token,
    })
    if wrote_manifest:
        with store_writes(out_dir):
            atomic_write_json(out_dir / "summary.json", summary)
    return summary


def format_summary(summary: dict) -> str:
    lines = [f"shards written {summary['shards_written']}, skipped (already complete) {summary['shards_skipped']}"]
    if summary["tokens_per_second"]:
        lines.append(f"computed {summary['tokens_computed']:,} tokens in {summary['seconds']:.1f} s: "
                     f"{summary['tokens_per_second']:,.0f} tokens/s (rank {summary['rank']} of "
                     f"{summary['world_size']}), padding {summary['padding_fraction']:.1%}")
        if summary.get("tokens_copied"):
            lines.append(f"of which {summary['tokens_copied']:,} copied from the states `mtptrain regenerate` kept")
    if not summary.get("complete"):
        lines.append("this rank is done; the store is complete once every rank has finished (the last one "
                     "writes manifest.json). If none is running any more, rerun the same command.")
        return "\n".join(lines)
    rows = summary["rows"]
    lines.append(f"samples: {summary['samples']['train']:,} train, {summary['samples']['validation']:,} validation; "
                 f"tokens {summary['tokens']:,}")
    skipped = ", ".join(f"{n} {reason}" for reason, n in rows["skipped"].items()) or "none"
    lines.append(f"rows: {rows['rows']:,} read, {rows['kept']:,} kept, skipped: {skipped}")
    lines.append(f"on disk: {summary['bytes_on_disk'] / 2**20:,.1f} MiB, {summary['bytes_per_token']:,.1f} bytes/token "
                 f"(minimum {summary['min_bytes_per_token']:,}: "
                 f"x{summary['bytes_per_token'] / summary['min_bytes_per_token']:.3f})")
    return "\n".join(lines)
