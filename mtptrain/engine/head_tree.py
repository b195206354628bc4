"""EAGLE-2 dynamic draft trees from an EAGLE / EAGLE-3 head (Li et al., arXiv:2406.16858).

The head expands the tree level by level. Every node is scored by its
cumulative draft log-probability (the sum over its path), which EAGLE-2 shows
tracks the chance that the target accepts it. At each level only the
`branch` best-scoring nodes are expanded, in one head forward with a tree
mask; each expanded node proposes its `branch` most likely next tokens. After
`depth` levels, the `budget` best-scoring nodes of everything proposed become
the tree the target verifies. A child never scores higher than its parent,
so the kept nodes always include their ancestors, and a node already
behind the `budget` best so far is not expanded (`_keepable`): none of its
descendants could be kept.

At temperature > 0 a node's children are by default drawn at random
(`children="sampled"`): without replacement from the head's distribution q
at that node, after the sampling transform, and verified by recursive rejection
(engine/tree.py), which accepts a drawn child far more often than a
deterministic one: the head's argmax is accepted with probability p(argmax),
a drawn token with sum(min(p, q)) (on MT-bench at T=1, 0.30 against 0.44 for
the shipped head, docs/reference-run.md). How many children a node
gets is decided before they are drawn, from the q rows alone: a node scores
the sum over its path of log q_(r), q's r-th largest probability for the
child drawn r-th (EAGLE-2's score where the draws are the best tokens), and
each level gives its `branch` children to the best of these scores.
`children="top"` keeps EAGLE-2's deterministic children at any temperature.

The head's cache gains the expanded nodes while drafting; the next observe
cuts it back to the true prefix, as for chains.
"""

from __future__ import annotations

import torch

from mtptrain.engine.head_chain import HeadChainProposer
from mtptrain.engine.tree import DraftTree, TreeDraws
from mtptrain.engine.verify import Sampling, distribution, draw_distinct


class HeadTreeProposer(HeadChainProposer):
    name = "head-tree"

    def __init__(self, head, spec, branch: int = 4, depth: int = 5, budget: int = 16,
                 sampling: Sampling = Sampling(), seed: int = 0, children: str = "sampled", int8: bool = False):
        super().__init__(head, spec, sampling, seed, int8=int8)
        if branch < 1 or depth < 1 or budget < 1:
            raise ValueError(f"a draft tree needs branch, depth and budget >= 1 (got {branch}, {depth}, {budget})")
        if children not in ("sampled", "top"):
            raise ValueError(f"a tree's children are 'sampled' or 'top' (got {children!r})")
        self.branch, self.depth, self.budget = branch, depth, budget
        self.sampled = children == "sampled" and not sampling.greedy

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [..., Vd] the nodes are ranked by (after the sampling transform at T > 0). Greedy, in
        float32: a ranking, summed over a few levels, needs no more, and over three rows of 8,192 it takes 11 us
        against 39 in float64 (a 2-core AMD EPYC Zen 4)."""
        if self.sampling.greedy:
            return torch.log_softmax(logits.float(), dim=-1)
        return distribution(logits, self.sampling).log()

    def _top(self, logits: torch.Tensor) -> tuple[list, list]:
        """The `branch` best tokens (target ids) and their log-probabilities, for logits [Vd] or for each row of
        logits [F, Vd] (lists of lists): a level's rows in one pass (a call per row cost 38 us, 12.6 calls a
        step of a 5-level tree on a 2-core AMD EPYC Zen 5)."""
        logp = self._scores(logits)
        values, index = logp.topk(min(self.branch, logp.shape[-1]))
        to_target = getattr(self.head, "draft_to_target", None)
        tokens = to_target[index] if to_target is not None else index
        return tokens.tolist(), values.tolist()

    @torch.inference_mode()
    def propose(self, tokens: list[int], k: int) -> DraftTree:
        if self.sampled:
            return self._propose_sampled(min(self.depth, k))
        depth = min(self.depth, k)
        past = self.stepper.length  # head positions 0 .. past-1 hold true states
        node_tokens, parents, scores, node_depth = [], [], [], []
        inputs: dict[int, torch.Tensor] = {}  # node -> the feature it is run with (its parent's output)
        for token, score in zip(*self._top(self.last_logits)):
            inputs[len(node_tokens)] = self.last_feature[0, -1]
            node_tokens.append(token), parents.append(-1), scores.append(score), node_depth.append(1)
        frontier = list(range(len(node_tokens)))
        slot: dict[int, int] = {}  # expanded node -> its entry in the head cache, after the true prefix
        for level in range(1, depth):
            frontier = self._keepable(frontier, scores)
            if not frontier:
                break
            out, logits = self._expand(frontier, node_tokens, parents, [inputs[n] for n in frontier], slot, past,
                                       past - 1 + level)
            children = []
            for row, (n, tops) in enumerate(zip(frontier, zip(*self._top(logits)))):
                for token, logp in zip(*tops):
                    child = len(node_tokens)
                    inputs[child] = out[0, row]
                    node_tokens.append(token), parents.append(n), scores.append(scores[n] + logp)
                    node_depth.append(level + 1)
                    children.append(child)
            frontier = sorted(children, key=lambda c: -scores[c])[: self.branch]
        # the budget best nodes; ties keep creation order, so a parent (created first, never lower) leads
        keep = sorted(range(len(node_tokens)), key=lambda n: (-scores[n], n))[: self.budget]
        order = sorted(keep, key=lambda n: (node_depth[n], -scores[n], n))  # parents first, best child first
        index = {n: i for i, n in enumerate(order)}
        return DraftTree([node_tokens[n] for n in order], [index[parents[n]] if parents[n] >= 0 else -1 for n in order])

    def _keepable(self, frontier: list[int], scores: list[float]) -> list[int]:
        """The frontier's nodes whose children could be among the `budget` kept: a child scores at most its
        parent and comes after every node made so far, so a node scoring no more than the budget-th best score
        so far can have no kept child, nor can its descendants. Expanding only the others (none: the head step
        is not run) leaves the tree the same, for fewer rows or head steps."""
        if len(scores) < self.budget:
            return frontier
        bar = sorted(scores, reverse=True)[self.budget - 1]
        return [n for n in frontier if scores[n] > bar]

    def _propose_sampled(self, depth: int) -> DraftTree:
        """A tree whose children are drawn without replacement from the head's distribution at their parent
        (module docstring), listed level by level, siblings in the order drawn."""
        past = self.stepper.length
        to_target = getattr(self.head, "draft_to_target", None)
        tokens, parents, scores, columns, level_of = [], [], [], [], []
        rows: dict[int, torch.Tensor] = {}  # node (-1: the root) -> the q its children were drawn from
        inputs = {-1: self.last_feature[0, -1]}  # node -> its head output, which its children are run with
        slot: dict[int, int] = {}
        q = distribution(self.last_logits, self.sampling)[None]
        for level in range(1, depth + 1):
            if level > 1:
                room = self.budget - len(tokens)
                last = [n for n in range(len(tokens)) if level_of[n] == level - 1]
                frontier = sorted(last, key=lambda n: (-scores[n], n))[: min(self.branch, room)]
                if not frontier:
                    break
                out, logits = self._expand(frontier, tokens, parents, [inputs[parents[n]] for n in frontier], slot,
                                           past, past - 2 + level)
                for row, n in enumerate(frontier):
                    inputs[n] = out[0, row]
                q = distribution(logits, self.sampling)
            else:
                frontier = [-1]
            counts, ranked = self._counts(q, [scores[n] if n >= 0 else 0.0 for n in frontier],
                                          min(self.branch, self.budget - len(tokens)))
            for row, n in enumerate(frontier):
                if not counts[row]:
                    continue
                rows[n] = q[row]
                for rank, column in enumerate(draw_distinct(q[row], counts[row], self.generator)):
                    tokens.append(int(to_target[column]) if to_target is not None else column)
                    parents.append(n), columns.append(column), level_of.append(level)
                    scores.append((scores[n] if n >= 0 else 0.0) + ranked[row][rank])
        return DraftTree(tokens, parents, TreeDraws(rows, columns, to_target))

    def _counts(self, q: torch.Tensor, scores: list[float], room: int) -> tuple[list[int], list[list[float]]]:
        """How many children each row of q [F, Vd] gets out of `room`, and the log of q's largest probabilities
        per row: the r-th child of row f scores scores[f] + log q_f's r-th largest, and the `room` best scores
        win (a row's scores fall with r, so each row's winners are its first). Zero-probability tokens are
        never counted (a top-k or top-p cut leaves fewer than `branch` to draw)."""
        top = q.topk(min(self.branch, q.shape[-1]), dim=-1).values.log().tolist()
        candidates = sorted(((-(scores[f] + logq), f, r) for f, row in enumerate(top)
                             for r, logq in enumerate(row) if logq > float("-inf")))[:room]
        counts = [0] * len(top)
        for _, f, _ in candidates:
            counts[f] += 1
        return counts, top

    def _expand(self, frontier: list[int], tokens: list[int], parents: list[int], features: list[torch.Tensor],
                slot: dict[int, int], past: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One head step over the frontier's nodes (each run with its entry of `features`, its parent's output) at
        `position`, each seeing the true prefix, its expanded ancestors and itself; each node takes the next
        slot of the head cache. The step's outputs [1, F, H] and the logits [F, Vd] of its rows."""
        device = self.last_feature.device
        ids = torch.tensor([[tokens[n] for n in frontier]], device=device)
        seen = self._seen(frontier, parents, slot, past, device)
        positions = torch.full((1, len(frontier)), position, device=device)
        for n in frontier:
            slot[n] = len(slot)
        out = self.stepper.step(torch.stack(features)[None], ids, positions, seen)
        return out, self.stepper.logits(out)[0, : len(frontier)]

    @staticmethod
    def _seen(frontier, parents, slot, past, device) -> torch.Tensor:
        """[1, 1, F, past + len(slot) + F], True where a node looks: the true prefix, its expanded ancestors,
        itself."""
        width = past + len(slot) + len(frontier)
        allowed = torch.zeros(len(frontier), width, dtype=torch.bool)
        allowed[:, :past] = True
        for row, n in enumerate(frontier):
            allowed[row, past + len(slot) + row] = True
            ancestor = parents[n]
            while ancestor >= 0:
                allowed[row, past + slot[ancestor]] = True
                ancestor = parents[ancestor]
        return allowed.to(device)[None, None]
