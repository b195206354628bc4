"""A request that shares a prefix with the runner's last one runs only the rest (generate(reuse_prefix=True)):
the same tokens and the same drafts as a request run whole, for every kind of drafter and both runners."""

import pytest
import torch
from conftest import make_tiny_llama

from mtptrain.engine.draft_model import DraftModelProposer
from mtptrain.engine.generate import generate, reusable_prefix
from mtptrain.engine.head_chain import HeadChainProposer
from mtptrain.engine.head_tree import HeadTreeProposer
from mtptrain.engine.ngram import NgramProposer
from mtptrain.heads import FrozenTarget
from mtptrain.heads.spec import HeadSpec
from mtptrain.runtime.runner import open_runner

VOCAB = 400
EAGLE3 = HeadSpec("eagle3", last_layer=3, feature_layers=[0, 1, 2], ttt_steps=2, draft_vocab_size=VOCAB)
MTP = HeadSpec("mtp", last_layer=3, mtp_depths=2)


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(VOCAB, seed=3).double()


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _drafter(kind: str, model):
    """(a fresh drafter of `kind`, the target layers its runner captures)"""
    if kind == "none":
        return None, ()
    if kind == "ngram":
        return NgramProposer(1, 3), ()
    if kind == "draft-model":
        return DraftModelProposer(make_tiny_llama(VOCAB, seed=5, layers=1).double()), ()
    spec = MTP if kind == "mtp" else EAGLE3
    torch.manual_seed(0)
    head = spec.family.build(spec, FrozenTarget.of(model)).double()
    if kind == "head-tree":
        return HeadTreeProposer(head, spec, 3, 3, 8), spec.layers
    return spec.family.chain(head, spec), spec.layers


@pytest.mark.parametrize("runtime", ["native", "transformers"])
@pytest.mark.parametrize("kind", ["none", "head-chain", "head-tree", "mtp", "draft-model", "ngram"])
def test_a_second_turn_runs_only_what_it_adds_and_decodes_as_if_run_whole(model, kind, runtime):
    first = _ids(12, 1)
    proposer, capture = _drafter(kind, model)
    runner = open_runner(model, capture, runtime)
    turn1 = generate(runner, first, 16, proposer, k=3, reuse_prefix=True)
    assert turn1.stats.prefilled == len(first)  # nothing cached yet
    second = first + turn1.tokens + _ids(7, 2)  # the answer, then the next question
    turn2 = generate(runner, second, 16, proposer, k=3, reuse_prefix=True)

    fresh, _ = _drafter(kind, model)
    whole = generate(open_runner(model, capture, runtime), second, 16, fresh, k=3)
    assert whole.stats.prefilled == len(second)
    assert turn2.tokens == whole.tokens
    assert (turn2.stats.steps, turn2.stats.accepted) == (whole.stats.steps, whole.stats.accepted)
    shared = len(first) + len(turn1.tokens) - 2  # the answer but its last token, less the last shared one
    if kind == "mtp":  # it reads the target's states and keeps none of its own: the prompt runs whole
        assert turn2.stats.prefilled == len(second)
    else:
        assert turn2.stats.prefilled <= len(second) - shared


def test_the_reused_prefix_ends_where_the_prompt_leaves_the_cached_tokens(model):
    runner = open_runner(model, (), "native")
    prompt = _ids(20, 3)
    generate(runner, prompt, 6, reuse_prefix=True)
    held = list(runner.tokens)
    assert held[:20] == prompt and len(held) >= 25
    assert reusable_prefix(runner, held[:10] + [(held[10] + 1) % VOCAB] + held[11:]) == 9  # the last shared reruns
    assert reusable_prefix(runner, held) == len(held) - 1  # the last token runs, for its logits
    assert reusable_prefix(runner, held + [5, 6]) == len(held) - 1
    assert reusable_prefix(runner, [(held[0] + 1) % VOCAB] + held[1:]) == 0
    again = generate(runner, held[:10] + [7, 8, 9], 6, reuse_prefix=True)
    assert again.stats.prefilled == 4
    assert runner.tokens[:13] == held[:10] + [7, 8, 9]
    runner.reset()
    assert runner.tokens == [] and reusable_prefix(runner, held) == 0


def test_without_reuse_every_request_runs_whole(model):
    runner = open_runner(model, (), "native")
    prompt = _ids(10, 4)
    out = generate(runner, prompt, 5)
    assert generate(runner, prompt + out.tokens, 5).stats.prefilled == len(prompt) + len(out.tokens)


@pytest.mark.parametrize("runtime", ["native", "transformers"])
def test_a_runner_knows_the_tokens_its_cache_holds_after_a_tree_keeps_its_path(model, runtime):
    spec = EAGLE3
    torch.manual_seed(0)
    head = spec.family.build(spec, FrozenTarget.of(model)).double()
    runner = open_runner(model, spec.layers, runtime)
    prompt = _ids(9, 6)
    result = generate(runner, prompt, 20, HeadTreeProposer(head, spec, 3, 3, 8), k=3)
    committed = prompt + result.tokens
    assert runner.tokens == committed[: len(runner.tokens)] and len(runner.tokens) >= len(committed) - 1
    one_pass = open_runner(model, (), runtime)
    one_pass.forward(runner.tokens)
    for (k1, v1), (k2, v2) in zip(runner.kv(), one_pass.kv()):
        torch.testing.assert_close(k1[:, :, : len(runner.tokens)], k2[:, :, : len(runner.tokens)])
        torch.testing.assert_close(v1[:, :, : len(runner.tokens)], v2[:, :, : len(runner.tokens)])


def _head_kv(proposer, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache = proposer.stepper.cache
    return [(k[:, :, :length], v[:, :, :length]) for k, v in zip(cache.keys, cache.values)]


@pytest.mark.parametrize("case", ["fresh drafter", "runner used in between"])
def test_the_target_reuses_no_more_than_the_head_still_holds(model, case):
    """The runner may hold a longer prefix than the head (a fresh head on a used runner; a request run without the
    head in between): the reused prefix is the head's, and the head's cache ends up as if the prompt ran whole."""
    spec = EAGLE3
    torch.manual_seed(0)
    head = spec.family.build(spec, FrozenTarget.of(model)).double()
    runner = open_runner(model, spec.layers, "native")
    prompt = _ids(30, 7)
    proposer = HeadChainProposer(head, spec)
    if case == "fresh drafter":
        generate(runner, prompt[:-4], 8, HeadChainProposer(head, spec), k=3, reuse_prefix=True)
        expected = 0
    else:
        generate(runner, prompt[:12] + _ids(10, 8), 8, proposer, k=3, reuse_prefix=True)  # the head sees 12 shared
        generate(runner, prompt[:-2], 8, None, reuse_prefix=True)  # the runner alone holds 28
        expected = 11  # the head's position 11 reads x_12, which differs
    assert reusable_prefix(runner, prompt) >= 25  # the runner alone would reuse more
    assert reusable_prefix(runner, prompt, proposer) == expected
    result = generate(runner, prompt, 12, proposer, k=3, reuse_prefix=True)
    assert result.stats.prefilled == len(prompt) - expected

    whole = HeadChainProposer(head, spec)
    reference = generate(open_runner(model, spec.layers, "native"), prompt, 12, whole, k=3)
    assert result.tokens == reference.tokens
    true_length = len(prompt) + len(result.tokens) - 1
    for ours, theirs in zip(_head_kv(proposer, true_length), _head_kv(whole, true_length), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-9, rtol=1e-9)
