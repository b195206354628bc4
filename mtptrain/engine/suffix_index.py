"""Drafting from a suffix index over past outputs, the scheme of TitanML's Takeoff server.

Every finished request's tokens go into a bounded circular buffer (oldest
tokens drop out). A suffix array over the buffer is rebuilt in the background
every `rebuild_every` finished requests, and queries use the latest complete
one. A query takes the last `max_context` tokens of the text and, while
nothing matches, shorter contexts down to `min_context`. Among the matching
positions (at most `max_matches`, evenly spread over the match range, so a
very common context costs bounded work) the draft is grown token by token,
each time taking the most frequent next token among the positions that still
agree.

Suffixes are ordered by their first `window` tokens (window = max_context),
which is all a query of at most max_context tokens compares. Requests are
separated by -1 so no match runs across two of them.
"""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import torch

from mtptrain.engine.proposer import ProposerBase

SEPARATOR = -1


def build_suffix_array(buffer: np.ndarray, window: int) -> np.ndarray:
    """Start positions sorted by the `window` tokens that follow them (padded past the end)."""
    n = len(buffer)
    padded = np.concatenate([buffer, np.full(window, np.iinfo(np.int64).min, dtype=np.int64)])
    # lexsort sorts by its last key first: give it the window's columns from last to first.
    return np.lexsort([padded[j : j + n] for j in range(window - 1, -1, -1)]).astype(np.int64)


def match_range(buffer: np.ndarray, suffixes: np.ndarray, query: list[int]) -> tuple[int, int]:
    """[lo, hi) of the suffixes starting with `query` (binary search, comparing len(query) tokens)."""
    q = tuple(query)

    def prefix(i: int) -> tuple:
        return tuple(buffer[suffixes[i] : suffixes[i] + len(q)].tolist())

    lo, hi = 0, len(suffixes)
    while lo < hi:  # first suffix >= query
        mid = (lo + hi) // 2
        if prefix(mid) < q:
            lo = mid + 1
        else:
            hi = mid
    start, hi = lo, len(suffixes)
    while lo < hi:  # first suffix whose prefix > query
        mid = (lo + hi) // 2
        if prefix(mid) <= q:
            lo = mid + 1
        else:
            hi = mid
    return start, lo


class SuffixIndexProposer(ProposerBase):
    name = "suffix-index"

    def __init__(self, capacity: int = 1 << 20, min_context: int = 2, max_context: int = 8,
                 max_matches: int = 64, rebuild_every: int = 1, background: bool = True):
        if not 1 <= min_context <= max_context:
            raise ValueError("need 1 <= min_context <= max_context")
        self.capacity, self.min_context, self.max_context = capacity, min_context, max_context
        self.max_matches, self.rebuild_every, self.background = max_matches, rebuild_every, background
        self._pending: list[int] = []
        self._buffer = np.zeros(0, dtype=np.int64)
        self._index = (self._buffer, np.zeros(0, dtype=np.int64))  # swapped whole: readers never see halves
        self._finished = 0
        self._lock = threading.Lock()
        self._builder: threading.Thread | None = None

    def finish(self, tokens: list[int]) -> None:
        """Add a finished request's tokens; rebuild the index every `rebuild_every` requests."""
        with self._lock:
            self._pending.extend(tokens + [SEPARATOR])
            self._finished += 1
            due = self._finished % self.rebuild_every == 0
        if due:
            self.rebuild(wait=not self.background)

    def rebuild(self, wait: bool = True) -> None:
        if self._builder is not None and self._builder.is_alive():
            if not wait:
                return  # one build at a time; the next finished request triggers another
            self._builder.join()
        self._builder = threading.Thread(target=self._build, daemon=True)
        self._builder.start()
        if wait:
            self._builder.join()

    def _build(self) -> None:
        with self._lock:
            added, self._pending = self._pending, []
        buffer = np.concatenate([self._buffer, np.asarray(added, dtype=np.int64)])[-self.capacity :]
        self._buffer = buffer
        self._index = (buffer, build_suffix_array(buffer, self.max_context))

    def matches(self, context: list[int]) -> np.ndarray:
        buffer, suffixes = self._index
        lo, hi = match_range(buffer, suffixes, context)
        if hi - lo > self.max_matches:  # bounded work for very common contexts
            return suffixes[np.linspace(lo, hi - 1, self.max_matches).astype(np.int64)]
        return suffixes[lo:hi]

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        buffer, _ = self._index
        for n in range(min(self.max_context, len(tokens)), self.min_context - 1, -1):
            positions = self.matches(tokens[-n:]) + n
            draft: list[int] = []
            while positions.size and len(draft) < k:
                positions = positions[positions < len(buffer)]
                following = buffer[positions]
                following = following[following != SEPARATOR]
                if not following.size:
                    break
                token = Counter(following.tolist()).most_common(1)[0][0]
                draft.append(int(token))
                positions = positions[buffer[positions] == token] + 1
            if draft:
                return draft, None
        return [], None
