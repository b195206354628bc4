"""Computing shards: forward passes with layer hooks, and a writer thread that overlaps I/O.

The main thread runs forward passes while the writer thread copies finished
batches into shard buffers, serialises, hashes and writes them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from mtptrain.data.samples import Sample
from mtptrain.config import Recipe
from mtptrain.errors import MtptrainError
from mtptrain.features.plan import ShardPlan, make_batches
from mtptrain.data.kept_states import KeptStates
from mtptrain.features.store import FP8, READ_DTYPE, ShardRecord, quantize_rows, read_complete_record, write_shard
from mtptrain.heads.common import FrozenTarget
from mtptrain.io import writing_to
from mtptrain.runtime.batch import capture_states
from mtptrain.runtime.runner import runtime_for
from mtptrain.target import Target

log = logging.getLogger(__name__)


TOP_CHUNK = 2048  # positions per LM-head product when taking the target's choices


def forward_batch(target: Target, source, layers: list[int],
                  batch: list[Sample]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Captured hidden states [B, T, H] of a right-padded batch, from `source` (the target's batched decoder, or
    its model under transformers' forward: `runtime_for(target.model, runtime, batched=True)`, made once per
    stage), and the target's greedy next token [B, T] at every position, from the last layer's states (always
    captured)."""
    longest = max(len(s) for s in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, sample in enumerate(batch):
        ids[row, : len(sample)] = torch.from_numpy(sample.input_ids)
    states = capture_states(source, ids, layers)
    return states, target_choices(FrozenTarget.of(target.model), states[target.num_layers - 1])


@torch.inference_mode()
def target_choices(frozen: FrozenTarget, states: torch.Tensor) -> torch.Tensor:
    """The target's greedy next token (int32) after each of `states` [..., H] (pre-norm, last layer): stored so
    that training never multiplies by the full LM head just to score its agreement (heads/eagle3.py), in
    chunks of TOP_CHUNK positions (a [chunk, vocab] product at a time)."""
    flat = states.reshape(-1, states.shape[-1])
    tops = [frozen.target_logits(flat[i:i + TOP_CHUNK]).max(-1).indices.to(torch.int32)
            for i in range(0, flat.shape[0], TOP_CHUNK)]
    return torch.cat(tops).reshape(states.shape[:-1])


@dataclass
class _ShardBuffer:
    plan: ShardPlan
    hidden: dict[int, torch.Tensor]
    top: torch.Tensor  # the target's greedy next token per row
    pending: int  # batches still to arrive

    @classmethod
    def allocate(cls, plan: ShardPlan, layers: list[int], hidden_size: int, dtype: torch.dtype, n_batches: int):
        return cls(plan, {layer: torch.empty(plan.tokens, hidden_size, dtype=dtype) for layer in layers},
                   torch.empty(plan.tokens, dtype=torch.int32), n_batches)

    def add(self, first_row: int, batch: list[Sample], outputs: dict[int, torch.Tensor], top: torch.Tensor) -> None:
        """Copy a batch's rows into place; batches cover the shard's samples in order, so rows are contiguous."""
        for target, source in [*((self.hidden[layer], states) for layer, states in outputs.items()), (self.top, top)]:
            row = first_row
            for b, sample in enumerate(batch):  # source: [B, T, ...] padded, or one tensor per sample
                target[row : row + len(sample)].copy_(source[b][: len(sample)])
                row += len(sample)
        self.pending -= 1


def store_writes(out_dir: Path):
    """A write into the store that the disk refuses, said as such: shards and records are written atomically,
    so the complete ones stay and a rerun resumes after them."""
    return writing_to(out_dir, "the feature store",
                      "set precompute.output_dir to a directory on another disk (a new directory starts afresh)",
                      "Every complete shard is kept (nothing half-written is left), and rerunning the same command "
                      "resumes after them.")


class ShardWriter:
    """A background thread that assembles shards from finished batches and writes them."""

    def __init__(self, out_dir: Path, plan_id: str, rank: int, depth: int, dtype: str):
        self.out_dir, self.plan_id, self.rank, self.dtype = out_dir, plan_id, rank, dtype
        self.records: list[ShardRecord] = []
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
        self._thread.start()

    def put(self, item) -> None:
        self._raise_failure()
        self._queue.put(item)

    def close(self) -> list[ShardRecord]:
        """Wait for every queued batch to be written; safe to call more than once."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise_failure()
        return self.records

    def _raise_failure(self) -> None:
        """The writer thread's error in the main thread: a project error (a full disk) as it is, any other as
        the bug it is."""
        if isinstance(self.error, MtptrainError):
            raise self.error
        if self.error is not None:
            raise RuntimeError("the shard writer failed") from self.error

    def _run(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                buffer, first_row, batch, outputs, top = item
                buffer.add(first_row, batch, outputs, top)
                if buffer.pending == 0:
                    self.records.append(self._write(buffer))
        except BaseException as exc:  # reported to the main thread on its next put / close
            self.error = exc
            while self._queue.get() is not None:  # drain so the producer never blocks
                pass

    def _write(self, buffer: _ShardBuffer) -> ShardRecord:
        samples = buffer.plan.samples
        offsets = np.cumsum([0] + [len(s) for s in samples]).astype(np.int64)
        hidden, scales = buffer.hidden, None
        if self.dtype == FP8:  # the buffer holds bfloat16 rows: each becomes float8 and its scale
            quantized = {layer: quantize_rows(states) for layer, states in hidden.items()}
            hidden = {layer: q for layer, (q, _) in quantized.items()}
            scales = {layer: scale for layer, (_, scale) in quantized.items()}
        with store_writes(self.out_dir):
            return write_shard(self.out_dir / buffer.plan.name, buffer.plan.split, [s.key for s in samples],
                               np.concatenate([s.input_ids for s in samples]),
                               np.concatenate([s.loss_mask for s in samples]), offsets, hidden,
                               self.plan_id, self.rank, target_top=buffer.top, scales=scales)


def _to_host(states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """On an accelerator, narrow before the copy (half the bytes over the bus). On the CPU the
    writer thread's copy into the shard buffer converts, off the compute thread."""
    return states.to(dtype).cpu() if states.device.type != "cpu" else states


def kept_batch(target: Target, kept: KeptStates | None, layers: list[int],
               batch: list[Sample]) -> tuple[dict[int, list[torch.Tensor]], list[torch.Tensor]] | None:
    """A batch's states copied from what regenerate kept (data/kept_states.py), one tensor per sample,
    and the target's choices after them: kept where decoding computed them (after each generated token), computed
    from the kept last layer elsewhere (a prompt's positions). None unless every sample of the batch was kept (then
    the target runs)."""
    if kept is None:
        return None
    found = []
    for sample in batch:
        states = kept.states_for(sample)
        if states is None:
            return None
        found.append(states)
    top = torch.cat([tops for _, tops in found])
    missing = (top < 0).nonzero().squeeze(-1)
    if len(missing):
        last = torch.cat([states[target.num_layers - 1] for states, _ in found])[missing]
        top[missing] = target_choices(FrozenTarget.of(target.model), last.to(target.model.dtype))
    return {layer: [states[layer] for states, _ in found] for layer in layers}, list(top.split([len(s) for s in batch]))


@dataclass
class RankResult:
    shards_written: int = 0
    shards_skipped: int = 0
    tokens: int = 0
    copied_tokens: int = 0  # of `tokens`, those whose states regenerate kept
    padded_tokens: int = 0
    seconds: float = 0.0
    records: list[ShardRecord] = field(default_factory=list)


def compute_shards(target: Target, shards: list[ShardPlan], layers: list[int], recipe: Recipe, out_dir: Path,
                   plan_id: str, rank: int, show_progress: bool, kept: KeptStates | None = None) -> RankResult:
    cfg = recipe.precompute
    dtype = READ_DTYPE if cfg.dtype == FP8 else getattr(torch, cfg.dtype)  # the shard buffers' dtype
    todo = [s for s in shards if read_complete_record(out_dir / s.name, plan_id) is None]
    result = RankResult(shards_skipped=len(shards) - len(todo))
    if result.shards_skipped:
        log.info("resuming: %d of %d shards of this rank are already complete", result.shards_skipped, len(shards))
    if not todo:
        return result
    writer = ShardWriter(out_dir, plan_id, rank, cfg.write_queue, cfg.dtype)
    progress = tqdm(total=sum(s.tokens for s in todo), unit="tok", unit_scale=True, desc="precompute",
                    disable=not show_progress)
    start = time.perf_counter()
    source = runtime_for(target.model, recipe.target.runtime, batched=True)
    try:
        for shard in todo:
            batches = make_batches(shard.samples, cfg.batch_tokens, cfg.max_batch_size)
            buffer = _ShardBuffer.allocate(shard, layers, target.hidden_size, dtype, len(batches))
            first_row = 0
            for batch in batches:
                tokens = sum(len(s) for s in batch)
                copied = kept_batch(target, kept, layers, batch)
                if copied is not None:
                    writer.put((buffer, first_row, batch, *copied))
                    result.copied_tokens += tokens
                else:
                    outputs, top = forward_batch(target, source, layers, batch)
                    writer.put((buffer, first_row, batch, {k: _to_host(v, dtype) for k, v in outputs.items()},
                                top.cpu()))
                    result.padded_tokens += len(batch) * max(len(s) for s in batch)
                first_row += tokens
                result.tokens += tokens
                progress.update(tokens)
    finally:
        # Always stop the writer thread: on success it flushes the last shard, on error it
        # finishes what was queued (each shard is atomic) and exits.
        result.records = writer.close()
        progress.close()
    result.seconds = time.perf_counter() - start
    result.shards_written = len(result.records)
    return result


