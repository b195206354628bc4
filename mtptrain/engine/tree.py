"""Draft trees and their exact verification in one target forward.

A tree hangs off the pending token (the root, row 0 of the verification
forward). Node i carries a draft token and the index of its parent (-1: the
root). Nodes are listed parents first, and the children of a node in the
order the drafter prefers them (best first). The target runs over
[pending, node_0 .. node_{N-1}] with an attention mask that lets each row see
the cached prefix, its ancestors and itself, and with position ids
prefix + depth, so row 1+i scores exactly what a sequential forward over the
path to node i would score.

Verification walks down from the root. Greedy: take the child whose token is
the target's argmax; when none matches, the argmax is the correction. With
sampling, the children are deterministic proposals, tried in order against
the target's distribution p: child c is accepted with probability
p(c) / sum(p); on rejection c's mass is removed and p renormalised. When no
child is accepted a sample of what is left of p is emitted. Each emitted token
is therefore distributed exactly as p (the multi-candidate rule of SpecInfer,
Miao et al., arXiv:2305.09781, with one-hot draft distributions), whatever
the drafter's scores were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtptrain.engine.verify import draw, greedy_choice, uniform


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]  # parent node index, -1 for the root (the pending token)

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError("a draft tree needs one parent per token")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i}: parent {parent} must be listed before it (or be -1, the root)")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int]) -> "DraftTree":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def depths(self) -> list[int]:
        """Depth of every node (1 for the root's children)."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent < 0 else out[parent] + 1)
        return out

    def children(self) -> dict[int, list[int]]:
        """Node -> its children in preference order; key -1 is the root."""
        out: dict[int, list[int]] = {-1: []}
        for i, parent in enumerate(self.parents):
            out.setdefault(parent, []).append(i)
            out.setdefault(i, [])
        return out

    def visibility(self) -> torch.Tensor:
        """Bool [N+1, N+1] over [root, nodes]: row r may attend to column c (c is r, or an ancestor of r)."""
        n = len(self) + 1
        seen = torch.zeros(n, n, dtype=torch.bool)
        seen[:, 0] = True
        for i, parent in enumerate(self.parents):
            seen[i + 1] = seen[parent + 1]
            seen[i + 1, i + 1] = True
        seen[0, 1:] = False
        return seen

    def attention(self, past: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Additive mask [1, 1, N+1, past+N+1] and position ids [1, N+1] for the verification forward."""
        seen = self.visibility().to(device)
        full = torch.cat([torch.ones(len(seen), past, dtype=torch.bool, device=device), seen], dim=1)
        mask = torch.zeros(full.shape, dtype=dtype, device=device).masked_fill_(~full, torch.finfo(dtype).min)
        positions = torch.tensor([[past] + [past + d for d in self.depths()]], device=device)
        return mask[None, None], positions


@dataclass
class TreeVerdict:
    path: list[int]  # accepted node indices, root's child first
    emitted: list[int]  # their tokens, then the correction or bonus token

    @property
    def accepted(self) -> int:
        return len(self.path)


def verify_tree_greedy(tree: DraftTree, target_logits: torch.Tensor) -> TreeVerdict:
    """target_logits [N+1, V]: row 0 scores the root's children, row 1+i those of node i."""
    choice = greedy_choice(target_logits)
    children = tree.children()
    path, node = [], -1
    while True:
        want = choice[node + 1]
        match = next((c for c in children[node] if tree.tokens[c] == want), None)
        if match is None:
            return TreeVerdict(path, [tree.tokens[i] for i in path] + [want])
        path.append(match)
        node = match


def verify_tree_sampling(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator) -> TreeVerdict:
    """target_probs [N+1, V], the target's distributions after the sampling transform, in float64."""
    children = tree.children()
    path, node = [], -1
    while True:
        p = target_probs[node + 1].clone()
        accepted = None
        for child in children[node]:
            token = tree.tokens[child]
            total = float(p.sum())
            if total <= 0:
                break
            if uniform(generator) * total < float(p[token]):
                accepted = child
                break
            p[token] = 0.0
        if accepted is None:
            # every child was refused: emit a sample of the remaining mass (p itself if none is left,
            # which only happens when the children covered p's whole support and each was refused,
            # an event of probability zero)
            residual = p if float(p.sum()) > 0 else target_probs[node + 1]
            token = draw(residual, generator)
            return TreeVerdict(path, [tree.tokens[i] for i in path] + [token])
        path.append(accepted)
        node = accepted
