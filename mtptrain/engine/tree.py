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
sampling, the children of a node are tried in their listed order against the
target's distribution p there, by recursive rejection sampling:

    child x_j, drawn from q_j, is accepted with probability min(1, p_j(x_j) / q_j(x_j))
    on rejection p_{j+1} = normalise(max(0, p_j - q_j)) and q_{j+1} = q_j without x_j, renormalised
    when no child is accepted, a sample of the last p_j is emitted

Where the drafter drew a node's children without replacement from a
distribution q (`TreeDraws`: x_1 ~ q, x_2 ~ q without x_1, ...), q_j is the
law x_j was drawn from given the children before it, so each step is
Leviathan et al.'s speculative sampling against what is left of p, and the
emitted token follows p exactly (recursive speculative decoding, Jeon et
al., arXiv:2402.14160). Children the drafter chose deterministically (its
best tokens) have a one-hot q: child c is accepted with probability p_j(c),
and on rejection c's mass leaves p (SpecInfer's multi-candidate rule, Miao et
al., arXiv:2305.09781). How many children a node has may depend on anything
drawn before them, never on their own draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtptrain.engine.verify import draw, greedy_choice, uniform


@dataclass
class TreeDraws:
    """Where a tree's children were drawn at random: for each node that has children (-1: the root), the
    distribution q [Vd] they were drawn from without replacement, in their listed order; `columns[i]`, node i's
    column in its parent's q; `support`, the target ids of q's columns (None: q spans the target's vocabulary)."""

    rows: dict[int, torch.Tensor]
    columns: list[int]
    support: torch.Tensor | None = None


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]  # parent node index, -1 for the root (the pending token)
    draws: TreeDraws | None = None  # None: every child a deterministic proposal (one-hot q)

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


def verify_tree_sampling(tree: DraftTree, target_probs, generator: torch.Generator) -> TreeVerdict:
    """target_probs [N+1, V] (or verify.TargetRows, computing a row when it is first read): the target's
    distributions after the sampling transform, in float64."""
    children = tree.children()
    path, node = [], -1
    while True:
        accepted, residual = _try_children(tree, node, children[node], target_probs[node + 1], generator)
        if accepted is None:
            return TreeVerdict(path, [tree.tokens[i] for i in path] + [draw(residual, generator)])
        path.append(accepted)
        node = accepted


def _try_children(tree: DraftTree, node: int, kids: list[int], p: torch.Tensor, generator: torch.Generator):
    """Recursive rejection over `kids` against p: (the accepted child, None), or (None, what is left of p, any
    total)."""
    if not kids:  # a leaf: its bonus token is a sample of p
        return None, p
    draws = tree.draws
    if draws is None:  # deterministic proposals: q one-hot, so a refusal takes its token's mass out of p
        total, refused = float(p.sum()), []
        for child in kids:
            token = tree.tokens[child]
            mass = float(p[token])
            if uniform(generator) * total < mass:
                return child, None
            total -= mass
            refused.append(token)
            if total <= 0:
                # the children held all of p and each was refused, an event of probability zero (float
                # rounding aside): any sample of p is then exact
                return None, p
        left = p.clone()
        left[refused] = 0.0
        return None, left
    # q lives on the draft vocabulary's columns (`support`): only they change, so the work is on them. Both
    # distributions stay unnormalised: `inside` is p on the columns and `off` p's mass elsewhere, which no
    # refusal changes (a refusal at normalised p_j = [inside, off] / T, q_j = q / Q leaves T times
    # [max(0, inside / T - q / Q), off / T] = [max(0, inside - q T / Q), off]).
    # on p's device: a split target's logits come from its last GPU, the head's rows from its first
    q = draws.rows[node].to(p.device, copy=True)
    support = None if draws.support is None else draws.support.to(p.device)
    inside = p if support is None else p[support]
    off = 0.0 if support is None else max(0.0, float(p.sum()) - float(inside.sum()))
    q_total = float(q.sum())
    for child in kids:
        if q_total <= 0:  # more children than q's support: none can have been drawn from what is left
            break
        column = draws.columns[child]
        total = float(inside.sum()) + off
        q_column = float(q[column])
        if uniform(generator) * q_column * total < float(inside[column]) * q_total:  # u < (inside / T) / (q / Q)
            return child, None
        inside = torch.sub(inside, q, alpha=total / q_total).clamp_min_(0.0)
        q[column] = 0.0
        q_total -= q_column
        if float(inside.sum()) + off <= 0:
            return None, p  # p_j was q_j exactly: the refusal had probability zero
    if support is None:
        return None, inside
    left = p.clone()
    left[support] = inside
    return None, left
