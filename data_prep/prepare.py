"""From a data source to tokenized, masked, split samples, counting every row left out."""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data_prep.chat import tokenize_conversation
from data_prep.conversations import BadRow, normalise, unique_key
from data_prep.readers import read_rows
from mtptrain.config import DataConfig

log = logging.getLogger(__name__)
EXAMPLES_PER_REASON = 3


class NoUsableData(RuntimeError):
    pass


@dataclass
class Sample:
    key: str  # unique within the store: the conversation id
    split: str  # "train" or "validation"
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class RowStats:
    rows: int = 0
    kept: int = 0
    truncated: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def skip(self, ref: str, reason: str, detail: str) -> None:
        self.skipped[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < EXAMPLES_PER_REASON:
            shown.append(f"{ref}: {detail}" if detail else ref)

    def report(self) -> str:
        lines = [f"{self.rows} rows read, {self.kept} kept ({self.truncated} truncated to max_length), "
                 f"{sum(self.skipped.values())} skipped"]
        for reason, count in self.skipped.most_common():
            lines.append(f"  skipped {count} x {reason}, e.g. " + "; ".join(self.examples[reason]))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"rows": self.rows, "kept": self.kept, "truncated": self.truncated,
                "skipped": dict(self.skipped.most_common()), "skipped_examples": self.examples}


def unfinished_answers(row) -> frozenset[int]:
    """Answers `mtptrain regenerate` stopped at a length limit (meta.finished false): the target never ended
    them, so their end-of-turn marker is not a training target."""
    finished = (row.get("meta") or {}).get("finished") if isinstance(row, dict) else None
    return frozenset(i for i, done in enumerate(finished) if done is False) if isinstance(finished, list) else frozenset()


def split_of(key: str, seed: int, validation_fraction: float) -> str:
    """Deterministic split from a hash of the id: stable under reordering and subsetting."""
    bucket = int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big") / 2**64
    return "validation" if bucket < validation_fraction else "train"


def prepare_samples(cfg: DataConfig, tokenizer, show_progress: bool = True) -> tuple[list[Sample], RowStats]:
    stats = RowStats()
    samples: list[Sample] = []
    seen: Counter = Counter()  # keys in use -> repeats of that id so far
    source, fmt, column = cfg.source, cfg.format, cfg.messages_column
    if cfg.regenerated:  # the same conversations with the target's own answers (`mtptrain regenerate`)
        from data_prep.regenerate import check_complete

        check_complete(Path(cfg.regenerated), cfg, tokenizer)
        source, fmt, column = cfg.regenerated, "messages", None
    rows = read_rows(source, split=cfg.dataset_split, config=cfg.dataset_config, limit=cfg.max_conversations)
    for row in tqdm(rows, desc="tokenizing", unit=" rows", disable=not show_progress, total=cfg.max_conversations):
        stats.rows += 1
        if row.problem is not None:
            stats.skip(row.ref, *row.problem)
            continue
        try:
            conversation = normalise(row.value, row.ref, fmt, column)
            key = unique_key(conversation.id, seen)
            tokenized = tokenize_conversation(tokenizer, conversation.messages, cfg.max_length, cfg.overlong,
                                              unfinished_answers(row.value) if cfg.regenerated else frozenset())
        except BadRow as bad:
            stats.skip(row.ref, bad.reason, bad.detail)
            continue
        stats.kept += 1
        stats.truncated += tokenized.truncated
        samples.append(Sample(key, split_of(key, cfg.seed, cfg.validation_fraction),
                              tokenized.input_ids, tokenized.loss_mask))
    log.info("data: %s", stats.report())
    if not samples:
        raise NoUsableData(f"no usable conversation in {source}:\n{stats.report()}\n"
                           "Check data.source and data.format (and data.max_length if rows are over-long).")
    return samples, stats
