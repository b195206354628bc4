"""The head chain: exact output whatever the head, and a head cache rebuilt from the target's true states."""

import pytest
import torch
from conftest import make_tiny_llama
from law import engine_two_token_law, exact_law_after_the_first
from test_tree import _path

from mtptrain.engine.generate import generate
from mtptrain.engine.head_chain import HeadChainProposer
from mtptrain.runtime.runner import open_runner
from mtptrain.engine.verify import Sampling, distribution
from mtptrain.heads import FrozenTarget
from mtptrain.heads.spec import HeadSpec

SPECS = {"eagle": HeadSpec("eagle", last_layer=3),
         "eagle3": HeadSpec("eagle3", last_layer=3, feature_layers=[0, 1, 2], ttt_steps=2, draft_vocab_size=400)}


def with_oracle(proposer, committed: list[int]):
    """Make a drafter propose the target's own continuation (`committed`), with every fourth draft wrong:
    long accepted runs and partial acceptances, so multi-token commits reach its caches."""
    choose, propose, count = proposer._choose, proposer.propose, [0]

    def oracle_propose(tokens, k):
        proposer._upcoming = iter(committed[len(tokens):])
        return propose(tokens, k)

    def oracle_choose(logits):
        choice = next(proposer._upcoming, 0)
        count[0] += 1
        _, *rest = choose(logits)  # greedy: the rest (a column, no distribution) does not depend on the token
        return ((choice if count[0] % 4 else (choice + 1) % logits.shape[-1]), *rest)

    proposer.propose, proposer._choose = oracle_propose, oracle_choose
    return proposer


def _setup(kind):
    model = make_tiny_llama(400, seed=3).double()
    spec = SPECS[kind]
    torch.manual_seed(0)
    head = spec.family.build(spec, FrozenTarget.of(model)).double()
    runner = open_runner(model, capture=spec.layers)
    return model, spec, head, runner


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_head_chain_output_is_the_targets_greedy_output(kind):
    model, spec, head, runner = _setup(kind)
    prompt = torch.randint(0, 400, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = generate(open_runner(model), prompt, 30).tokens
    result = generate(runner, prompt, 30, HeadChainProposer(head, spec), k=3)
    assert result.tokens == reference
    assert sum(result.stats.proposed) > 0


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("drafting", ["chain", "oracle-chain", "tree"])
@torch.no_grad()
def test_the_head_cache_after_verification_holds_the_true_prefix(kind, drafting):
    """After rounds of drafting and verification, the head's cache equals one built in a single pass
    over the committed text with the target's own states."""
    from mtptrain.engine.head_tree import HeadTreeProposer

    model, spec, head, runner = _setup(kind)
    proposer = HeadChainProposer(head, spec) if "chain" in drafting else HeadTreeProposer(head, spec, 3, 3, 8)
    prompt = torch.randint(0, 400, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    if drafting == "oracle-chain":
        with_oracle(proposer, prompt + generate(open_runner(model), prompt, 20).tokens)
    result = generate(runner, prompt, 20, proposer, k=3)
    if drafting == "oracle-chain":
        assert result.stats.tau > 2.0
    committed = prompt + result.tokens
    # The head has seen pairs (h_t, x_{t+1}) for t up to the position before the last pending token
    # (plus the draft entries of the round in flight, cut back at the next observe).
    true_length = len(committed) - 1
    one_pass = open_runner(model, capture=list(runner.hidden))  # the target over the committed text at once
    one_pass.reset()
    one_pass.forward(committed[:-1])
    fresh = HeadChainProposer(head, spec)
    fresh.reset(prompt)
    fresh.observe(0, one_pass.hidden, committed[1:])
    # A wrong or misplaced entry is off by O(1); float rounding of one pass against many short ones, by ~1e-7.
    for ours, theirs in zip(_head_kv(proposer, true_length), _head_kv(fresh, true_length), strict=True):
        assert ours[0].shape == theirs[0].shape
        assert torch.allclose(ours[0], theirs[0], atol=1e-5)
        assert torch.allclose(ours[1], theirs[1], atol=1e-5)


def _head_kv(proposer, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The keys and values of the first `length` positions in a head proposer's cache, per layer."""
    cache = proposer.stepper.cache
    return [(k[:, :, :length], v[:, :, :length]) for k, v in zip(cache.keys, cache.values)]


@pytest.mark.parametrize(("kind", "stop", "draft_temperature"), [("eagle", 0.085, 1.0), ("mtp", 0.0, 0.4)])
def test_sampling_with_head_drafts_stays_exact_in_law(kind, stop, draft_temperature):
    """Temperature 1, 12-token vocabulary: the law of the two tokens a chain of two drafts decides in its first
    verification equals the target's exact law. The eagle head's chain has a stop near the median probability of
    its first draft, so about half its chains end after one draft: a length that depends on its own draws. The mtp
    head drafts at a temperature of its own (eval.chain.draft_temperatures), which leaves the law the target's."""
    from mtptrain.engine.mtp_chain import MTPChainProposer

    vocab = 12
    model = make_tiny_llama(vocab, seed=4).double()
    spec = HeadSpec(kind, last_layer=3, mtp_depths=2)
    drafter = HeadChainProposer if kind == "eagle" else MTPChainProposer
    torch.manual_seed(0)
    head = spec.family.build(spec, FrozenTarget.of(model)).double()
    prompt, sampling = [1, 5, 7, 2], Sampling(temperature=1.0)
    exact = exact_law_after_the_first(model, prompt, sampling)
    drafting = Sampling(temperature=draft_temperature)
    make = lambda seed: drafter(head, spec, drafting, seed=seed, stop=stop)  # noqa: E731
    first: list[int] = []
    empirical, drafted, rejected = engine_two_token_law(model, prompt, sampling, make, 2500, capture=[3], after=1,
                                                        longest=first)
    assert rejected > 0 and set(first) == ({1, 2} if stop else {2})
    if stop:
        assert 0.1 < first.count(1) / len(first) < 0.9
    assert 0.5 * (empirical - exact).abs().sum() < 0.15


def test_a_trained_and_exported_head_is_accepted_by_the_engine(tiny_target_dir, tmp_path):
    """precompute -> train -> export -> load_head -> engine: the drafts of a trained head get accepted."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
    from conftest import tiny_recipe, write_sharegpt
    from train_helpers import train_recipe

    from mtptrain.config import TargetConfig
    from mtptrain.features.precompute import run_precompute
    from mtptrain.heads.checkpoint import load_head
    from mtptrain.target import load_target
    from mtptrain.train.trainer import run_train

    run_precompute(tiny_recipe(tiny_target_dir, write_sharegpt(tmp_path / "c.json", 160, seed=5),
                               tmp_path / "features", layers="[0, 1, 2]", dtype="float32"), show_progress=False)
    run_train(train_recipe(tiny_target_dir, tmp_path / "features", tmp_path / "run", "head.kind=eagle",
                           "train.epochs=3"), show_progress=False)
    target = load_target(TargetConfig(model=str(tiny_target_dir)))
    head, spec = load_head(tmp_path / "run" / "head", FrozenTarget.of(target.model), target.identity())
    runner = open_runner(target.model, capture=[spec.last_layer])
    untrained = spec.family.build(spec, FrozenTarget.of(target.model))
    prompt = target.tokenizer.apply_chat_template([{"role": "user", "content": "the word is hot and you see"}],
                                                  add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    plain = generate(open_runner(target.model), prompt, 48).tokens
    trained_run = generate(runner, prompt, 48, HeadChainProposer(head, spec), k=4)
    untrained_run = generate(runner, prompt, 48, HeadChainProposer(untrained, spec), k=4)
    assert trained_run.tokens == untrained_run.tokens == plain
    assert trained_run.stats.tau > 2.0, trained_run.stats.acceptance()
    assert untrained_run.stats.tau < 1.3


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_head_tree_output_is_the_targets_greedy_output(kind):
    from mtptrain.engine.head_tree import HeadTreeProposer

    model, spec, head, runner = _setup(kind)
    prompt = torch.randint(0, 400, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = generate(open_runner(model), prompt, 30).tokens
    proposer = HeadTreeProposer(head, spec, branch=3, depth=4, budget=10)
    result = generate(runner, prompt, 30, proposer, k=4)
    assert result.tokens == reference
    # full trees of 10 nodes, but in the last step, with one token left to emit: its 3 depth-1 nodes
    assert result.stats.verified == 10 * (result.stats.steps - 1) + 3


def test_head_tree_keeps_the_best_scored_nodes_with_their_ancestors():
    from mtptrain.engine.head_tree import HeadTreeProposer

    model, spec, head, runner = _setup("eagle")
    proposer = HeadTreeProposer(head, spec, branch=3, depth=3, budget=7)
    prompt = torch.randint(0, 400, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    _read_prompt(proposer, runner, prompt)
    tree = proposer.propose(prompt + [7], 3)
    assert len(tree) == 7
    assert all(p < i for i, p in enumerate(tree.parents))
    assert max(tree.depths()) <= 3
    first = proposer.last_logits.topk(3).indices.tolist()
    assert [t for t, p in zip(tree.tokens, tree.parents) if p < 0] == first  # best first
    assert proposer.stepper.length == len(prompt) + 2 * 3  # true prefix, then two expanded levels


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@torch.no_grad()
def test_a_tree_expands_only_nodes_that_can_have_a_kept_child_and_stays_the_same_tree(kind):
    """A node scoring no more than the budget-th best node so far can have no kept descendant: leaving it
    unexpanded (and a level with none left, its head step) gives the tree of expanding every frontier node."""
    from mtptrain.engine.head_tree import HeadTreeProposer

    model, spec, head, runner = _setup(kind)
    saved = 0
    for seed in range(8):
        prompt = torch.randint(0, 400, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
        made = []
        for every in (False, True):
            proposer = HeadTreeProposer(head, spec, branch=3, depth=4, budget=6)
            sharp = proposer.stepper.logits  # a sure head (a random one is flat): nodes fall behind the budget
            proposer.stepper.logits = lambda out, sharp=sharp: sharp(out) * 40
            if every:
                proposer._keepable = lambda frontier, scores: frontier
            _read_prompt(proposer, runner, prompt)
            tree = proposer.propose(prompt + [7], 4)
            made.append((tree.tokens, tree.parents, proposer.stepper.length))
        (tokens, parents, pruned), (all_tokens, all_parents, expanded) = made
        assert (tokens, parents) == (all_tokens, all_parents) and len(tokens) == 6
        assert pruned <= expanded
        saved += pruned < expanded
    assert saved >= 2, saved


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@torch.no_grad()
def test_a_sampled_trees_children_are_drawn_from_the_heads_distribution_after_their_path(kind):
    """At temperature > 0 every node's children were drawn from q, the head's distribution after the node's
    path, as a chain drafting that path computes it: the tree's head steps read the right features, positions
    and ancestors. Each level's children go to the best-scored nodes, siblings listed in the order drawn."""
    from mtptrain.engine.head_tree import HeadTreeProposer

    model, spec, head, runner = _setup(kind)
    sampling = Sampling(temperature=0.7)
    proposer = HeadTreeProposer(head, spec, branch=3, depth=4, budget=10, sampling=sampling, seed=3)
    prompt = torch.randint(0, 400, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    _read_prompt(proposer, runner, prompt)
    tree = proposer.propose(prompt + [7], 4)
    assert len(tree) == 10 and max(tree.depths()) == 4
    assert [tree.depths().count(d) for d in (1, 2, 3, 4)] == [3, 3, 3, 1]
    to_target = getattr(head, "draft_to_target", None)
    chain = HeadChainProposer(head, spec, sampling)
    for node, q in tree.draws.rows.items():
        path = _path(tree, node)
        _read_prompt(chain, runner, prompt)
        feature, logits = chain.last_feature, chain.last_logits
        for n in path:
            feature = chain.stepper.step(feature, torch.tensor([[tree.tokens[n]]]))
            logits = chain.stepper.logits(feature)[0, -1]
        assert torch.allclose(q, distribution(logits, sampling), atol=1e-9), (node, path)
        kids = [c for c, parent in enumerate(tree.parents) if parent == node]
        assert [tree.draws.columns[c] for c in kids] == list(dict.fromkeys(tree.draws.columns[c] for c in kids))
        for c in kids:
            column = tree.draws.columns[c]
            assert tree.tokens[c] == (int(to_target[column]) if to_target is not None else column)


def _read_prompt(proposer, runner, prompt: list[int]) -> None:
    """The target reads `prompt` and the proposer its states, token 7 pending: ready to draft."""
    proposer.reset(prompt)
    runner.reset()
    runner.forward(prompt)
    proposer.observe(0, runner.hidden, prompt[1:] + [7])


def test_sampling_with_sampled_head_trees_stays_exact_in_law():
    """Temperature 1, 12-token vocabulary: with trees whose children are drawn from the head (three at the root,
    then two levels), the law of the two tokens the first verification decides is the target's. The eagle3 head
    drafts from an 8-token draft vocabulary at a temperature of its own (a whole vocabulary at the target's
    temperature: the per-node test in tests/engine/test_tree.py)."""
    from mtptrain.engine.head_tree import HeadTreeProposer

    vocab = 12
    model = make_tiny_llama(vocab, seed=4).double()
    spec = HeadSpec("eagle3", last_layer=3, feature_layers=[0, 1, 2], ttt_steps=2, draft_vocab_size=8)
    torch.manual_seed(0)
    head = spec.family.build(spec, FrozenTarget.of(model)).double()
    prompt, sampling = [1, 5, 7, 2], Sampling(temperature=1.0)
    exact = exact_law_after_the_first(model, prompt, sampling)
    drafting = Sampling(temperature=0.6)
    make = lambda seed: HeadTreeProposer(head, spec, 3, 2, 6, drafting, seed=seed)  # noqa: E731
    empirical, drafted, rejected = engine_two_token_law(model, prompt, sampling, make, 2500, capture=spec.layers,
                                                        after=1)
    assert drafted > 0 and rejected > 0
    assert 0.5 * (empirical - exact).abs().sum() < 0.15


MTP_SPECS = [HeadSpec("mtp", last_layer=3, mtp_depths=3), HeadSpec("mtp", last_layer=3, mtp_depths=2, mtp_share=True),
             HeadSpec("mtp", last_layer=3, mtp_depths=1)]


@pytest.mark.parametrize("spec", MTP_SPECS, ids=["3-depths", "2-shared", "1-depth"])
@pytest.mark.parametrize("oracle", [False, True], ids=["head", "oracle"])
def test_mtp_chain_output_is_the_targets_greedy_output_and_its_caches_hold_the_truth(spec, oracle):
    from mtptrain.engine.mtp_chain import MTPChainProposer

    model = make_tiny_llama(400, seed=3).double()
    torch.manual_seed(0)
    head = spec.family.build(spec, FrozenTarget.of(model)).double()
    runner = open_runner(model, capture=[spec.last_layer])
    prompt = torch.randint(0, 400, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = generate(open_runner(model), prompt, 30).tokens
    proposer = MTPChainProposer(head, spec)
    if oracle:
        with_oracle(proposer, prompt + reference)
    result = generate(runner, prompt, 30, proposer, k=5)
    assert result.tokens == reference
    if oracle and spec.mtp_depths > 1:
        assert result.stats.tau > 2.0
    assert len(result.stats.proposed) == spec.mtp_depths  # k is capped at the head's depths
    committed = prompt + result.tokens
    one_pass = open_runner(model, capture=[3])  # the target over the committed text at once
    one_pass.reset()
    one_pass.forward(committed[:-1])
    fresh = MTPChainProposer(head, spec)
    fresh.reset(committed)
    fresh.observe(0, one_pass.hidden, committed[1:])
    # (the engine may have committed one bonus token past max_new_tokens: compare the common prefix)
    for depth in range(spec.mtp_depths + 1):
        n = fresh.states[depth].shape[0]
        assert proposer.states[depth].shape[0] >= n
        assert torch.allclose(proposer.states[depth][:n], fresh.states[depth], atol=1e-9), depth
    for ours, theirs in zip(proposer.caches, fresh.caches):
        for a, b in zip(ours.layers, theirs.layers):
            n = b.keys.shape[-2]
            assert torch.allclose(a.keys[..., :n, :], b.keys, atol=1e-9)
            assert torch.allclose(a.values[..., :n, :], b.values, atol=1e-9)


def test_mtp_chain_drafts_from_a_one_token_prompt():
    from mtptrain.engine.mtp_chain import MTPChainProposer

    model = make_tiny_llama(400, seed=3).double()
    spec = HeadSpec("mtp", last_layer=3, mtp_depths=3)
    torch.manual_seed(0)
    head = spec.family.build(spec, FrozenTarget.of(model)).double()
    reference = generate(open_runner(model), [7], 12).tokens
    result = generate(open_runner(model, capture=[3]), [7], 12, MTPChainProposer(head, spec), k=3)
    assert result.tokens == reference and result.stats.proposed[0] > 0


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
@torch.no_grad()
def test_a_chain_with_a_stop_ends_where_its_drafts_probability_falls_below_it_and_stays_exact(kind):
    """The stop ends a chain after the draft whose running product of the head's probabilities falls below
    it; the output is still the target's greedy output, from fewer verified tokens."""
    from mtptrain.engine.mtp_chain import MTPChainProposer
    from mtptrain.engine.verify import chosen_probability

    model = make_tiny_llama(400, seed=3, initializer_range=0.2).double()
    spec = SPECS["eagle3"] if kind == "eagle3" else HeadSpec("mtp", last_layer=3, mtp_depths=4)
    drafter = HeadChainProposer if kind == "eagle3" else MTPChainProposer
    torch.manual_seed(0)
    head = spec.family.build(spec, FrozenTarget.of(model)).double()
    prompt = torch.randint(0, 400, (9,), generator=torch.Generator().manual_seed(1)).tolist()

    def opened(stop):  # a drafter that has read the prompt, and the probabilities of what it drafts
        runner = open_runner(model, capture=spec.layers)
        runner.reset()
        first = int(runner.forward(prompt, last_only=True)[-1].argmax())
        proposer, seen = drafter(head, spec, stop=stop), []
        proposer.reset(prompt)
        proposer.observe(0, runner.hidden, prompt[1:] + [first])
        choose = proposer._choose

        def recording(logits):
            chosen = choose(logits)
            column = chosen[1] if kind == "eagle3" else chosen[0]
            seen.append(chosen_probability(logits, column, None))
            return chosen
        proposer._choose = recording
        return proposer, prompt + [first], seen

    proposer, tokens, probabilities = opened(0.0)
    full, _ = proposer.propose(tokens, 4)
    running = torch.tensor(probabilities).cumprod(0)
    assert len(full) == 4 and (running[1:] < running[:-1]).all()
    for i in (1, 2):  # a stop between running products i-1 and i: the draft that brings it below is the last
        stop = float((running[i - 1] * running[i]).sqrt())
        short, _ = opened(stop)[0].propose(tokens, 4)
        assert short == full[: i + 1]
    # one token is always drafted, and the greedy output does not depend on the stop
    assert opened(0.999)[0].propose(tokens, 4)[0] == full[:1]
    reference = generate(open_runner(model), prompt, 30).tokens
    stop = float(running[1])  # where the first step's chain ends after its third draft
    result = generate(open_runner(model, capture=spec.layers), prompt, 30, drafter(head, spec, stop=stop), k=4)
    assert result.tokens == reference
    assert result.stats.verified < 4 * result.stats.steps
