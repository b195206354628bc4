"""Draft trees: one masked forward scores every node like a sequential forward over its path, tree
verification keeps what sequential verification would, and tree drafting leaves the output exact."""

import random

import pytest
import torch
from conftest import make_tiny_llama
from law import engine_two_token_law, exact_two_token_law

from mtptrain.engine.proposer import ProposerBase
from mtptrain.engine.generate import generate
from mtptrain.runtime.runner import open_runner
from mtptrain.engine.tree import DraftTree, TreeDraws, verify_tree_greedy, verify_tree_sampling
from mtptrain.engine.verify import Sampling, draw_distinct, verify_greedy

VOCAB = 400


@pytest.fixture(scope="module")
def model64():
    return make_tiny_llama(VOCAB, seed=3).double()


def _random_tree(rng: random.Random, size: int, vocab: int, favoured: list[int] = ()) -> DraftTree:
    """A random tree; with `favoured`, the chain of those tokens is hidden among the root's descendants."""
    tokens, parents = [], []
    parent = -1
    for token in favoured:
        tokens.append(token), parents.append(parent)
        parent = len(tokens) - 1
    while len(tokens) < size:
        tokens.append(rng.randrange(vocab)), parents.append(rng.randrange(-1, len(tokens) - 1))
    # shuffle the listing while keeping parents before children
    order = sorted(range(size), key=lambda i: (_depth(parents, i), rng.random()))
    index = {n: i for i, n in enumerate(order)}
    return DraftTree([tokens[n] for n in order], [index[parents[n]] if parents[n] >= 0 else -1 for n in order])


def _depth(parents, i):
    return 1 if parents[i] < 0 else 1 + _depth(parents, parents[i])


def _path(tree: DraftTree, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


def _logits(model, ids: list[int], runtime: str) -> torch.Tensor:
    """[len(ids), V]: a fresh forward over `ids` alone, on the given runtime."""
    runner = open_runner(model, runtime=runtime)
    runner.reset()
    return runner.forward(ids)


@pytest.mark.parametrize("runtime", ["native", "transformers"])
@torch.no_grad()
def test_the_tree_forward_scores_every_node_like_a_sequential_forward_over_its_path(model64, runtime):
    rng = random.Random(0)
    prefix = [rng.randrange(VOCAB) for _ in range(11)]
    for size in (1, 5, 17):
        tree = _random_tree(rng, size, VOCAB)
        runner = open_runner(model64, runtime=runtime)
        runner.forward(prefix[:-1])
        logits = runner.forward_tree(prefix[-1], tree)
        assert runner.length == len(prefix) + size
        assert torch.allclose(logits[0], _logits(model64, prefix, runtime)[-1], atol=1e-10)
        for node in range(size):
            ids = prefix + [tree.tokens[n] for n in _path(tree, node)]
            assert torch.allclose(logits[node + 1], _logits(model64, ids, runtime)[-1], atol=1e-10)


@pytest.mark.parametrize("runtime", ["native", "transformers"])
@torch.no_grad()
def test_tree_verification_equals_sequential_verification_of_its_best_path(model64, runtime):
    """Greedy: the tree keeps the longest root path that chain verification accepts, with the same
    correction token; the cache then equals a fresh prefill of the committed text."""
    rng = random.Random(1)
    prefix = [rng.randrange(VOCAB) for _ in range(9)]
    greedy = model64.generate(torch.tensor([prefix]), max_new_tokens=6, do_sample=False, min_new_tokens=6,
                              pad_token_id=0)[0, len(prefix):].tolist()
    for trial in range(12):
        favoured = greedy[: rng.randrange(0, 6)]
        if favoured and trial % 3 == 0:
            favoured = favoured[:-1] + [(favoured[-1] + 1) % VOCAB]  # a near miss at the end
        tree = _random_tree(rng, 12, VOCAB, favoured)
        runner = open_runner(model64, runtime=runtime)
        runner.forward(prefix[:-1])
        verdict = verify_tree_greedy(tree, runner.forward_tree(prefix[-1], tree))
        best = None
        for leaf in range(len(tree)):
            chain = [tree.tokens[n] for n in _path(tree, leaf)]
            sequential = verify_greedy(chain, _logits(model64, prefix + chain, runtime)[len(prefix) - 1:])
            if best is None or sequential.accepted > best.accepted:
                best = sequential
        assert verdict.emitted == best.emitted
        assert verdict.emitted == greedy[: len(verdict.emitted)]
        runner.keep(len(prefix), verdict.path)
        committed = prefix + verdict.emitted[:-1]
        reference = open_runner(model64, runtime=runtime)
        reference.forward(committed)
        for (keys, values), (their_keys, their_values) in zip(runner.kv(), reference.kv(), strict=True):
            assert torch.allclose(keys, their_keys, atol=1e-10)
            assert torch.allclose(values, their_values, atol=1e-10)


_TOP: dict = {}  # (model, branch, context) -> top tokens: the law tests draft from the same contexts thousands of times


class TargetTreeDrafter(ProposerBase):
    """Test drafter: a tree of the target's own top-`branch` tokens (every path likely, deep acceptance),
    or, with `noise`, random tokens mixed in."""

    def __init__(self, model, branch=2, depth=3, noise=0.0, seed=0):
        self.model, self.branch, self.depth, self.noise = model, branch, depth, noise
        self.rng = random.Random(seed)

    @torch.no_grad()
    def _top(self, context):
        key = (id(self.model), self.branch, tuple(context))
        if key not in _TOP:
            _TOP[key] = self.model(torch.tensor([context])).logits[0, -1].topk(self.branch).indices.tolist()
        return _TOP[key]

    def propose(self, tokens, k):
        vocab = self.model.config.vocab_size
        nodes, parents, frontier = [], [], [(-1, [])]
        for _ in range(min(k, self.depth)):
            grown = []
            for parent, path in frontier:
                for token in self._top(tokens + path):
                    if self.rng.random() < self.noise:
                        token = self.rng.randrange(vocab)
                    if token in [nodes[i] for i, p in enumerate(parents) if p == parent]:
                        continue
                    nodes.append(token), parents.append(parent)
                    grown.append((len(nodes) - 1, path + [token]))
            frontier = grown[: self.branch]
        return DraftTree(nodes, parents)


def test_generation_with_draft_trees_is_the_targets_greedy_output(model64):
    prompt = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(4)).tolist()
    reference = generate(open_runner(model64), prompt, 40).tokens
    deep = generate(open_runner(model64), prompt, 40, TargetTreeDrafter(model64), k=3)
    noisy = generate(open_runner(model64), prompt, 40, TargetTreeDrafter(model64, noise=0.5, seed=1), k=3)
    assert deep.tokens == noisy.tokens == reference
    assert deep.stats.tau == pytest.approx(4.0, abs=0.2)  # three accepted drafts and a bonus per step
    assert 1.0 < noisy.stats.tau < deep.stats.tau


def test_sampling_with_draft_trees_stays_exact_in_law():
    """Temperature 1, 12-token vocabulary: the law of (x1, x2) with tree drafts is the target's."""
    vocab = 12
    model = make_tiny_llama(vocab, seed=4).double()
    prompt, sampling = [1, 5, 7, 2], Sampling(temperature=1.0)
    exact = exact_two_token_law(model, prompt, sampling)
    make = lambda seed: TargetTreeDrafter(model, branch=3, depth=2, noise=0.5, seed=seed)  # noqa: E731
    empirical, drafted, rejected = engine_two_token_law(model, prompt, sampling, make, 3000)
    assert drafted > 0 and rejected > 0
    assert 0.5 * (empirical - exact).abs().sum() < 0.12


def test_a_tree_sampler_that_skips_the_residual_is_caught():
    """The bound above is tight enough to fail a sampler that, after refusing every child, samples
    from p itself instead of the residual (it then over-weights the drafted tokens)."""
    import mtptrain.engine.tree as tree_module

    vocab = 12
    model = make_tiny_llama(vocab, seed=4).double()
    prompt, sampling = [1, 5, 7, 2], Sampling(temperature=1.0)
    exact = exact_two_token_law(model, prompt, sampling)
    original = tree_module.verify_tree_sampling

    def broken(tree, probs, generator):
        verdict = original(tree, probs, generator)
        if verdict.accepted == 0:  # resample the correction from p, ignoring the refusals
            token = int(torch.multinomial(probs[0], 1, generator=generator))
            return tree_module.TreeVerdict([], [token])
        return verdict

    make = lambda seed: TargetTreeDrafter(model, branch=3, depth=2, noise=0.0, seed=seed)  # noqa: E731
    import mtptrain.engine.generate as generate_module

    generate_module.verify_tree_sampling = broken
    try:
        empirical, _, _ = engine_two_token_law(model, prompt, sampling, make, 3000)
    finally:
        generate_module.verify_tree_sampling = original
    assert 0.5 * (empirical - exact).abs().sum() > 0.12


def _first_token_law(p: torch.Tensor, q: torch.Tensor, support, children: int, trials: int,
                     drawn: bool = True) -> torch.Tensor:
    """The law of the token a root with `children` children drawn from q emits, by `trials` verifications."""
    generator, draws = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    counts = torch.zeros(len(p), dtype=torch.float64)
    rows = torch.stack([p] * (children + 1))  # the children's own rows only give bonus tokens, not counted
    for _ in range(trials):
        if drawn:  # without replacement, as the head tree draws
            columns = draw_distinct(q, children, draws)
        else:  # q's best tokens, passed off as drawn from q
            columns = q.topk(children).indices.tolist()
        tokens = [int(support[c]) if support is not None else c for c in columns]
        tree = DraftTree(tokens, [-1] * children, TreeDraws({-1: q}, columns, support))
        counts[verify_tree_sampling(tree, rows, generator).emitted[0]] += 1
    return counts / trials


@pytest.mark.parametrize(("support", "q"), [
    (None, [0.30, 0.02, 0.25, 0.30, 0.03, 0.10]),
    (torch.tensor([0, 2, 3, 5]), [0.40, 0.05, 0.25, 0.30]),
    (torch.tensor([0, 2, 3]), [0.50, 0.30, 0.20]),
], ids=["whole-vocabulary", "draft-vocabulary", "children-cover-q"])
def test_children_drawn_without_replacement_and_verified_recursively_emit_the_targets_law(support, q):
    """Recursive rejection over three children drawn without replacement (q far from p, so most are refused
    and the residual carries the law; in the last case the three are all of q's tokens, the third drawn with
    certainty): the emitted token follows p within sampling noise, and a root whose children are q's best
    tokens, verified as if drawn from q, is caught by the same bound."""
    p = torch.tensor([0.05, 0.30, 0.10, 0.05, 0.40, 0.10], dtype=torch.float64)
    q = torch.tensor(q, dtype=torch.float64)
    law = _first_token_law(p, q, support, 3, 20000)
    assert 0.5 * (law - p).abs().sum() < 0.02  # sampling noise: about 0.005 at 20,000 trials
    wrong = _first_token_law(p, q, support, 3, 5000, drawn=False)
    assert 0.5 * (wrong - p).abs().sum() > 0.1


def test_trees_are_refused_when_a_child_precedes_its_parent():
    with pytest.raises(ValueError, match="listed before"):
        DraftTree([1, 2], [1, -1])
    assert DraftTree.chain([4, 5, 6]).depths() == [1, 2, 3]


def test_a_tree_is_verified_with_sdpa_when_the_target_runs_flash_attention(model64):
    """transformers' forward under flash attention drops an arbitrary mask: the tree's forward runs SDPA over the
    same cache (and the model keeps flash for chains), giving the logits an SDPA target gives."""
    reference = open_runner(model64, runtime="transformers")
    reference.forward([1, 2, 3])
    tree = DraftTree([5, 6, 7], [-1, 0, -1])
    expected = reference.forward_tree(4, tree)
    runner = open_runner(model64, runtime="transformers")
    runner.forward([1, 2, 3])
    model64.config._attn_implementation = "flash_attention_2"  # as target.attn_implementation auto picks on CUDA
    try:
        logits = runner.forward_tree(4, tree)
        assert model64.config._attn_implementation == "flash_attention_2"
    finally:
        model64.config._attn_implementation = "sdpa"
    torch.testing.assert_close(logits, expected)
