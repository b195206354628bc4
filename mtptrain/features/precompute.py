"""`mtptrain precompute`: run the target over prepared conversations, store its hidden states.

The work is planned before anything runs: samples are sorted by length within
each split and cut into shards of about `shard_mb`; rank r of W computes the
shards r, r+W, r+2W, ... So the plan, the shard names and their contents do
not depend on how many ranks run, and a rerun skips every shard whose record
is on disk. Whichever rank sees the last record appear writes the manifest
(under torchrun, rank 0 after a barrier).

Compute and I/O overlap: the main thread runs forward passes while a writer
thread copies finished batches into shard buffers, serialises, hashes and
writes them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from data_prep.prepare import RowStats, Sample, prepare_samples
from mtptrain.config import Recipe, dump_recipe
from mtptrain.dist import DistInfo, barrier, destroy_process_group, init_process_group, setup_logging
from mtptrain.features.store import (
    MANIFEST, SCHEMA_VERSION, SPLITS, FeatureStoreError, ShardRecord, load_manifest, read_complete_record,
    write_manifest, write_shard,
)
from mtptrain.io import atomic_write_json
from mtptrain.target import Target, load_target

log = logging.getLogger(__name__)


def resolve_layers(spec: list[int] | str, num_layers: int) -> list[int]:
    """Captured layers, 0-based "output of decoder layer i"; the last layer is always among them.

    The "eagle3" default takes low / middle / high features at outputs of layers
    1, L/2 - 1 and L - 4, i.e. the inputs of layers 2, L/2 and L - 3 that the
    EAGLE-3 reference implementation and SGLang capture (arXiv:2503.01840).
    """
    if spec == "eagle3":
        inner = [1, num_layers // 2 - 1, num_layers - 4]
    elif spec == "last":
        inner = []
    else:
        inner = list(spec)
        too_deep = [i for i in inner if i >= num_layers]
        if too_deep:
            raise ValueError(f"precompute.layers {too_deep} do not exist: the target has {num_layers} decoder "
                             f"layers, numbered 0..{num_layers - 1}")
    return sorted(set(i for i in inner if i >= 0) | {num_layers - 1})


# --------------------------------------------------------------------------- planning


@dataclass
class ShardPlan:
    name: str
    split: str
    samples: list[Sample]

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.samples)


def plan_shards(samples: list[Sample], tokens_per_shard: int) -> list[ShardPlan]:
    shards: list[ShardPlan] = []
    for split in SPLITS:
        ordered = sorted((s for s in samples if s.split == split), key=lambda s: (len(s), s.key))
        current: list[Sample] = []
        tokens = index = 0
        for sample in ordered + [None]:  # None flushes the last, partial shard
            if sample is not None:
                current.append(sample)
                tokens += len(sample)
            if current and (sample is None or tokens >= tokens_per_shard):
                shards.append(ShardPlan(f"{split}-{index:05d}.safetensors", split, current))
                current, tokens, index = [], 0, index + 1
    return shards


def make_plan_id(target: Target, recipe: Recipe, layers: list[int], shards: list[ShardPlan]) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps({"target": target.fingerprint, "tokenizer": target.tokenizer_fingerprint,
                              "layers": layers, "dtype": recipe.precompute.dtype,
                              "data": recipe.data.model_dump(mode="json")}, sort_keys=True).encode())
    for shard in shards:
        digest.update(shard.name.encode())
        for sample in shard.samples:
            digest.update(sample.key.encode())
            digest.update(sample.input_ids.tobytes())
            digest.update(sample.loss_mask.tobytes())
    return digest.hexdigest()[:32]


def make_batches(samples: list[Sample], batch_tokens: int, max_batch_size: int) -> list[list[Sample]]:
    """Consecutive groups of length-sorted samples whose padded size stays within the token budget."""
    batches: list[list[Sample]] = []
    current: list[Sample] = []
    longest = 0
    for sample in samples:
        new_longest = max(longest, len(sample))
        if current and ((len(current) + 1) * new_longest > batch_tokens or len(current) >= max_batch_size):
            batches.append(current)
            current, new_longest = [], len(sample)
        current.append(sample)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


# --------------------------------------------------------------------------- compute


class LayerCapture:
    """Forward hooks that keep the outputs of chosen decoder layers during one forward pass."""

    def __init__(self, target: Target, layers: list[int]):
        self.outputs: dict[int, torch.Tensor] = {}
        self._hooks = [target.decoder_layers()[i].register_forward_hook(self._keeper(i)) for i in layers]

    def _keeper(self, layer: int):
        def keep(_module, _inputs, output):
            self.outputs[layer] = output[0] if isinstance(output, tuple) else output
        return keep

    def take(self) -> dict[int, torch.Tensor]:
        outputs, self.outputs = self.outputs, {}
        return outputs

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


@torch.inference_mode()
def forward_batch(target: Target, capture: LayerCapture, batch: list[Sample]) -> dict[int, torch.Tensor]:
    """Captured hidden states [B, T, H] of a right-padded batch.

    Right padding needs no attention mask: under the causal mask a real token
    never attends to the padding after it, so every real row is computed
    exactly as it would be alone.
    """
    longest = max(len(s) for s in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, sample in enumerate(batch):
        ids[row, : len(sample)] = torch.from_numpy(sample.input_ids)
    # The decoder stack alone: the LM head's vocab-sized logits are not needed.
    target.decoder()(input_ids=ids.to(target.device), use_cache=False)
    return capture.take()


@dataclass
class _ShardBuffer:
    plan: ShardPlan
    hidden: dict[int, torch.Tensor]
    pending: int  # batches still to arrive

    @classmethod
    def allocate(cls, plan: ShardPlan, layers: list[int], hidden_size: int, dtype: torch.dtype, n_batches: int):
        return cls(plan, {layer: torch.empty(plan.tokens, hidden_size, dtype=dtype) for layer in layers}, n_batches)

    def add(self, first_row: int, batch: list[Sample], outputs: dict[int, torch.Tensor]) -> None:
        """Copy a batch's rows into place; batches cover the shard's samples in order, so rows are contiguous."""
        for layer, states in outputs.items():
            row = first_row
            for b, sample in enumerate(batch):
                self.hidden[layer][row : row + len(sample)].copy_(states[b, : len(sample)])
                row += len(sample)
        self.pending -= 1


class ShardWriter:
    """A background thread that assembles shards from finished batches and writes them."""

    def __init__(self, out_dir: Path, plan_id: str, rank: int, depth: int):
        self.out_dir, self.plan_id, self.rank = out_dir, plan_id, rank
        self.records: list[ShardRecord] = []
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
        self._thread.start()

    def put(self, item) -> None:
        if self.error is not None:
            raise RuntimeError("the shard writer failed") from self.error
        self._queue.put(item)

    def close(self) -> list[ShardRecord]:
        """Wait for every queued batch to be written; safe to call more than once."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self.error is not None:
            raise RuntimeError("the shard writer failed") from self.error
        return self.records

    def _run(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                buffer, first_row, batch, outputs = item
                buffer.add(first_row, batch, outputs)
                if buffer.pending == 0:
                    self.records.append(self._write(buffer))
        except BaseException as exc:  # reported to the main thread on its next put / close
            self.error = exc
            while self._queue.get() is not None:  # drain so the producer never blocks
                pass

    def _write(self, buffer: _ShardBuffer) -> ShardRecord:
        samples = buffer.plan.samples
        offsets = np.cumsum([0] + [len(s) for s in samples]).astype(np.int64)
        return write_shard(self.out_dir / buffer.plan.name, buffer.plan.split, [s.key for s in samples],
                           np.concatenate([s.input_ids for s in samples]),
                           np.concatenate([s.loss_mask for s in samples]), offsets, buffer.hidden,
                           self.plan_id, self.rank)


def _to_host(states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """On an accelerator, narrow before the copy (half the bytes over the bus). On the CPU the
    writer thread's copy into the shard buffer converts, off the compute thread."""
    return states.to(dtype).cpu() if states.device.type != "cpu" else states


@dataclass
class RankResult:
    shards_written: int = 0
    shards_skipped: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    seconds: float = 0.0
    records: list[ShardRecord] = field(default_factory=list)


def compute_shards(target: Target, shards: list[ShardPlan], layers: list[int], recipe: Recipe, out_dir: Path,
                   plan_id: str, rank: int, show_progress: bool) -> RankResult:
    cfg = recipe.precompute
    dtype = getattr(torch, cfg.dtype)
    todo = [s for s in shards if read_complete_record(out_dir / s.name, plan_id) is None]
    result = RankResult(shards_skipped=len(shards) - len(todo))
    if result.shards_skipped:
        log.info("resuming: %d of %d shards of this rank are already complete", result.shards_skipped, len(shards))
    if not todo:
        return result
    capture = LayerCapture(target, layers)
    writer = ShardWriter(out_dir, plan_id, rank, cfg.write_queue)
    progress = tqdm(total=sum(s.tokens for s in todo), unit="tok", unit_scale=True, desc="precompute",
                    disable=not show_progress)
    start = time.perf_counter()
    try:
        for shard in todo:
            batches = make_batches(shard.samples, cfg.batch_tokens, cfg.max_batch_size)
            buffer = _ShardBuffer.allocate(shard, layers, target.hidden_size, dtype, len(batches))
            first_row = 0
            for batch in batches:
                outputs = forward_batch(target, capture, batch)
                writer.put((buffer, first_row, batch, {k: _to_host(v, dtype) for k, v in outputs.items()}))
                tokens = sum(len(s) for s in batch)
                first_row += tokens
                result.tokens += tokens
                result.padded_tokens += len(batch) * max(len(s) for s in batch)
                progress.update(tokens)
    finally:
        # Always stop the writer thread: on success it flushes the last shard, on error it
        # finishes what was queued (each shard is atomic) and exits.
        result.records = writer.close()
        capture.close()
        progress.close()
    result.seconds = time.perf_counter() - start
    result.shards_written = len(result.records)
    return result


# --------------------------------------------------------------------------- the stage


def build_manifest(out_dir: Path, plan: list[ShardPlan], plan_id: str, target: Target, layers: list[int],
                   recipe: Recipe, stats: RowStats) -> dict | None:
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
        "max_length": recipe.data.max_length,
        "data": {**recipe.data.model_dump(mode="json"), "rows": stats.to_dict()},
        "plan_id": plan_id,
        "totals": totals,
        "shards": [{k: v for k, v in r.__dict__.items() if k != "plan_id"} for r in records],
    }


def run_precompute(recipe: Recipe, show_progress: bool = True) -> dict:
    dist = DistInfo.from_env()
    setup_logging(dist)
    grouped = init_process_group(dist)
    try:
        return _precompute(recipe, dist, grouped, show_progress and dist.is_main)
    finally:
        destroy_process_group()


def _precompute(recipe: Recipe, dist: DistInfo, grouped: bool, show_progress: bool) -> dict:
    out_dir = Path(recipe.precompute.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = load_target(recipe.target, dist)
    layers = resolve_layers(recipe.precompute.layers, target.num_layers)
    samples, stats = prepare_samples(recipe.data, target.tokenizer, show_progress=show_progress)
    for split in SPLITS:
        if not any(s.split == split for s in samples):
            log.warning("the %s split is empty (data.validation_fraction=%s)", split, recipe.data.validation_fraction)
    bytes_per_token = len(layers) * target.hidden_size * torch.finfo(getattr(torch, recipe.precompute.dtype)).bits // 8
    plan = plan_shards(samples, max(1, int(recipe.precompute.shard_mb * 2**20 / bytes_per_token)))
    plan_id = make_plan_id(target, recipe, layers, plan)
    # Refuse another recipe's directory before writing anything into it.
    complete = [read_complete_record(out_dir / shard.name, plan_id) is not None for shard in plan]
    existing = _existing_manifest(out_dir)
    if existing is not None and existing["plan_id"] != plan_id:
        raise FeatureStoreError(f"{out_dir / MANIFEST} belongs to a store made by another recipe (other data, "
                                "target, layers or dtype). Use a new precompute.output_dir, or delete this one.")
    if existing is not None and all(complete):
        log.info("%s is already complete; nothing to compute", out_dir)
        return _finish(out_dir, existing, RankResult(shards_skipped=len(plan)), dist, bytes_per_token, False)
    if existing is not None and dist.is_main:
        log.warning("%s lists shards that are missing or damaged: recomputing them", out_dir / MANIFEST)
        (out_dir / MANIFEST).unlink(missing_ok=True)  # rewritten once every shard is back
    if dist.is_main:
        dump_recipe(recipe, out_dir / "recipe.yaml")
    log.info("plan: %d samples, %d tokens, layers %s, %d shards over %d rank(s)", len(samples),
             sum(len(s) for s in samples), layers, len(plan), dist.world_size)
    mine = plan[dist.rank :: dist.world_size]
    _remove_stale_temporaries(out_dir, mine)
    result = compute_shards(target, mine, layers, recipe, out_dir, plan_id, dist.rank, show_progress)
    if grouped:
        barrier()
    manifest, wrote = None, False
    if dist.is_main or not grouped:
        manifest = build_manifest(out_dir, plan, plan_id, target, layers, recipe, stats)
        if manifest is not None:
            write_manifest(out_dir, manifest)
            wrote = True
    if grouped:
        barrier()
    return _finish(out_dir, manifest, result, dist, bytes_per_token, wrote)


def _existing_manifest(out_dir: Path) -> dict | None:
    """The manifest already in out_dir, or None; an unreadable one is set aside, as if absent."""
    if not (out_dir / MANIFEST).is_file():
        return None
    try:
        return load_manifest(out_dir)
    except FeatureStoreError as exc:
        log.warning("ignoring the manifest in %s (%s); it will be rewritten", out_dir, exc)
        return None


def _remove_stale_temporaries(out_dir: Path, mine: list[ShardPlan]) -> None:
    """Temporary files of this rank's shards left by a killed run (no other rank writes these shards)."""
    for shard in mine:
        for stale in out_dir.glob(f".{shard.name}.tmp-*"):
            stale.unlink(missing_ok=True)


def _finish(out_dir: Path, manifest: dict | None, result: RankResult, dist: DistInfo, min_bytes_per_token: int,
            wrote_manifest: bool) -> dict:
    summary = {
        "rank": dist.rank, "world_size": dist.world_size, "wrote_manifest": wrote_manifest,
        "shards_written": result.shards_written, "shards_skipped": result.shards_skipped,
        "tokens_computed": result.tokens, "seconds": round(result.seconds, 2),
        "tokens_per_second": round(result.tokens / result.seconds, 1) if result.seconds else None,
        "padding_fraction": round(1 - result.tokens / result.padded_tokens, 4) if result.padded_tokens else 0.0,
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
        atomic_write_json(out_dir / "summary.json", summary)
    return summary


def format_summary(summary: dict) -> str:
    lines = [f"shards written {summary['shards_written']}, skipped (already complete) {summary['shards_skipped']}"]
    if summary["tokens_per_second"]:
        lines.append(f"computed {summary['tokens_computed']:,} tokens in {summary['seconds']:.1f} s: "
                     f"{summary['tokens_per_second']:,.0f} tokens/s (rank {summary['rank']} of "
                     f"{summary['world_size']}), padding {summary['padding_fraction']:.1%}")
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
