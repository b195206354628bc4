"""From a data source to tokenized, masked, split samples, counting every row left out."""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from mtptrain.data.chat import tokenize_conversation
from mtptrain.data.conversations import BadRow, normalise, unique_key
from mtptrain.data.readers import read_rows
from mtptrain.data.regenerate import check_complete
from mtptrain.data.samples import NoUsableData, RowStats, Sample
from mtptrain.config import DataConfig

log = logging.getLogger(__name__)


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
    short = None if cfg.regenerated else stats.ran_out(cfg.max_conversations, source)
    if short:  # a regenerated file holds the conversations its run kept: fewer than asked is no news there
        log.warning("data: %s", short)
    if not samples:
        raise NoUsableData(f"no usable conversation in {source}:\n{stats.report()}\n"
                           "Check data.source and data.format (and data.max_length if rows are over-long).")
    return samples, stats
