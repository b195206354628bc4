"""What `generate` asks of a drafter: the Proposer protocol, and a base with the optional steps as no-ops.

    reset(prompt)        a new request begins (drafters with per-request state: their own caches)
    propose(tokens, k)   a chain (draft, its distributions or None) of at most k tokens, or a DraftTree
    observe(start, hidden, tokens)
                         the target's captured states for newly committed positions (start, start + 1, ...),
                         with the tokens that follow them; called only when `reads_states` is true, since
                         slicing the states costs a copy per step
    finish(tokens)       the request's whole text, once it is done (drafters that learn from past outputs)
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
