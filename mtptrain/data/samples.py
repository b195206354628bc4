"""What data preparation hands on: tokenized samples, and the count of every row left out."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from mtptrain.errors import MtptrainError

EXAMPLES_PER_REASON = 3


class NoUsableData(MtptrainError, RuntimeError):
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

    def ran_out(self, limit: int | None, source: str) -> str | None:
        """What to say when the source held fewer rows than `limit` (data.max_conversations) asked for."""
        if limit is None or self.rows >= limit:
            return None
        return (f"{source} holds {self.rows:,} rows, fewer than data.max_conversations ({limit:,}): every row was "
                "read")

    def report(self) -> str:
        lines = [f"{self.rows} rows read, {self.kept} kept ({self.truncated} truncated to max_length), "
                 f"{sum(self.skipped.values())} skipped"]
        for reason, count in self.skipped.most_common():
            lines.append(f"  skipped {count} x {reason}, e.g. " + "; ".join(self.examples[reason]))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"rows": self.rows, "kept": self.kept, "truncated": self.truncated,
                "skipped": dict(self.skipped.most_common()), "skipped_examples": self.examples}
