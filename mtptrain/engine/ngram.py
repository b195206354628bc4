"""N-gram prompt lookup (Saxena, "Prompt Lookup Decoding", 2023): drafts copied from earlier text.

The last n tokens (n from max_n down to min_n) are searched for in the prompt
and the text generated so far; the tokens that followed their latest earlier
occurrence are the draft. Deterministic, so its q is one-hot.
"""

from __future__ import annotations

import torch

from mtptrain.engine.proposer import ProposerBase


class NgramProposer(ProposerBase):
    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
                if tokens[start : start + n] == suffix:
                    draft = tokens[start + n : start + n + k]
                    if draft:
                        return draft, None
        return [], None
