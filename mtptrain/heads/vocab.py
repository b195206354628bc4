"""A draft vocabulary: the target tokens an EAGLE-3 head drafts over, the most frequent of its training data, with
the maps between draft and target ids."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass
class DraftVocab:
    draft_to_target: torch.Tensor  # long [N]: target id of draft id i, ascending
    target_to_draft: torch.Tensor  # long [V]: draft id of a target id, -1 where absent

    @classmethod
    def from_counts(cls, counts: Counter, size: int, target_vocab: int) -> "DraftVocab":
        """The `size` most frequent tokens (ties broken by lower id); too few seen tokens are topped up by id."""
        if not 0 < size <= target_vocab:
            raise ValueError(f"draft vocabulary size {size} must be in 1..{target_vocab}")
        ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
        chosen = set(ranked)
        ranked += [t for t in range(target_vocab) if t not in chosen][: size - len(ranked)]
        draft_to_target = torch.tensor(sorted(ranked), dtype=torch.long)
        target_to_draft = torch.full((target_vocab,), -1, dtype=torch.long)
        target_to_draft[draft_to_target] = torch.arange(size)
        return cls(draft_to_target, target_to_draft)

    @classmethod
    def from_token_streams(cls, streams: Iterable, size: int, target_vocab: int) -> "DraftVocab":
        counts: Counter = Counter()
        for ids in streams:
            counts.update(int(t) for t in ids)
        return cls.from_counts(counts, size, target_vocab)

    def __len__(self) -> int:
        return len(self.draft_to_target)
