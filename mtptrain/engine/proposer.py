"""What `generate` asks of a drafter: the Proposer protocol, and a base with the optional steps as no-ops.

    reset(prompt)        a new request begins (drafters with per-request state: their own caches)
    propose(tokens, k)   a chain (draft, its distributions or None) of at most k tokens, or a DraftTree
    observe(start, hidden, tokens)
                         the target's captured states for newly committed positions (start, start + 1, ...),
                         with the tokens that follow them; called only when `reads_states` is true, since
                         slicing the states costs a copy per step
    finish(tokens)       the request's whole text, once it is done (drafters that learn from past outputs)
    reusable(prompt)     how many leading positions of the target's states, from the drafter's last request, it
                         still holds for `prompt` (asked before reset, only of drafters that read states, when the
                         engine reuses a cached prefix: the first observe then starts there); 0 by default
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from mtptrain.engine.tree import DraftTree


@runtime_checkable
class Proposer(Protocol):
    name: str
    reads_states: bool

    def reset(self, prompt: list[int]) -> None: ...

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None] | DraftTree: ...

    def observe(self, start: int, hidden: dict[int, torch.Tensor], tokens: list[int]) -> None: ...

    def finish(self, tokens: list[int]) -> None: ...

    def reusable(self, prompt: list[int]) -> int: ...


def common_prefix(a: list[int], b: list[int], limit: int | None = None) -> int:
    """The length of the longest prefix `a` and `b` share (at most `limit`)."""
    n, end = 0, min(len(a), len(b), len(a) if limit is None else limit)
    while n < end and a[n] == b[n]:
        n += 1
    return n


class ProposerBase:
    """The optional steps of a Proposer, doing nothing: a drafter overrides those it needs."""

    name = "proposer"
    reads_states = False

    def reset(self, prompt: list[int]) -> None:
        pass

    def observe(self, start: int, hidden: dict[int, torch.Tensor], tokens: list[int]) -> None:
        pass

    def finish(self, tokens: list[int]) -> None:
        pass

    def reusable(self, prompt: list[int]) -> int:
        return 0
