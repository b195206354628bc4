"""Draft model and suffix index: exact engine output, shared weights, and suffix-array answers equal to
brute force."""

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from law import engine_two_token_law, exact_two_token_law

from mtptrain.engine.draft_model import DraftModelProposer, truncated_target
from mtptrain.engine.generate import generate
from mtptrain.runtime.runner import open_runner
from mtptrain.engine.suffix_index import SEPARATOR, SuffixIndexProposer, build_suffix_array, match_range
from mtptrain.engine.verify import Sampling


@pytest.fixture(scope="module")
def model64():
    return make_tiny_llama(400, seed=3).double()


def _prompt(seed, n=10):
    return torch.randint(0, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_truncated_target_shares_every_weight_and_computes_its_first_layers(model64):
    draft = truncated_target(model64, 2)
    target_ptrs = {p.data_ptr() for p in model64.parameters()}
    assert all(p.data_ptr() in target_ptrs for p in draft.parameters())
    assert len(draft.get_decoder().layers) == 2 and len(model64.get_decoder().layers) == 4
    reference = make_tiny_llama(400, seed=3, layers=2).double()
    state = {k: v for k, v in model64.state_dict().items() if not k.startswith(("model.layers.2", "model.layers.3"))}
    reference.load_state_dict(state)
    ids = torch.tensor([_prompt(1)])
    with torch.no_grad():
        assert torch.allclose(draft(ids).logits, reference(ids).logits, atol=1e-12)
        assert not torch.allclose(draft(ids).logits, model64(ids).logits)
    with pytest.raises(ValueError, match="keeps 1..3"):
        truncated_target(model64, 4)


@pytest.mark.parametrize("draft", ["other model", "truncated target"])
def test_draft_model_output_is_the_targets_greedy_output(model64, draft):
    drafter = make_tiny_llama(400, seed=7).double() if draft == "other model" else truncated_target(model64, 2)
    runner = open_runner(model64)
    for seed in (1, 2):
        prompt = _prompt(seed)
        reference = generate(runner, prompt, 32).tokens
        result = generate(runner, prompt, 32, DraftModelProposer(drafter), k=3)
        assert result.tokens == reference
        assert sum(result.stats.proposed) > 0


def test_draft_model_sampling_is_exact_in_law():
    vocab = 12
    model = make_tiny_llama(vocab, seed=4).double()
    drafter = make_tiny_llama(vocab, seed=8).double()
    prompt, sampling = [1, 5, 7, 2], Sampling(temperature=1.0)
    exact = exact_two_token_law(model, prompt, sampling)
    make = lambda seed: DraftModelProposer(drafter, sampling, seed=seed)  # noqa: E731
    empirical, drafted, rejected = engine_two_token_law(model, prompt, sampling, make, 2500)
    assert drafted == 2500 and 0 < rejected < drafted
    assert 0.5 * (empirical - exact).abs().sum() < 0.15


@pytest.mark.parametrize("seed", range(5))
def test_suffix_array_answers_equal_brute_force_on_random_streams(seed):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 6))  # small vocabularies: many repeats, long shared prefixes
    buffer = rng.integers(0, vocab, 400)
    buffer[rng.choice(400, 8, replace=False)] = SEPARATOR
    suffixes = build_suffix_array(buffer, window=6)
    assert sorted(suffixes.tolist()) == list(range(400))
    for _ in range(60):
        n = int(rng.integers(1, 7))
        query = rng.integers(0, vocab, n).tolist()
        lo, hi = match_range(buffer, suffixes, query)
        found = sorted(suffixes[lo:hi].tolist())
        brute = [p for p in range(len(buffer) - n + 1) if buffer[p : p + n].tolist() == query]
        assert found == brute, (query, found, brute)


def test_suffix_index_takes_the_most_frequent_continuation_and_stays_bounded():
    index = SuffixIndexProposer(capacity=60, min_context=1, max_context=3, background=False)
    for tail in ([7, 8, 9], [7, 8, 9], [7, 8, 9], [7, 5, 6]):
        index.finish([1, 2, 3] + tail)
    assert index.propose([0, 2, 3, 7], 3)[0] == [8, 9]  # [3, 7] followed by 8 three times, 5 once; ends at a separator
    assert index.propose([4, 4, 4], 3)[0] == []
    for _ in range(50):
        index.finish([11, 12, 13, 14])
    assert len(index._buffer) <= 60  # the circular buffer drops the oldest tokens
    assert index.propose([3, 7], 2)[0] == []  # they are gone from the index too


def test_suffix_index_rebuilds_in_the_background_and_pays_off_on_repeated_requests(model64):
    index = SuffixIndexProposer(min_context=2, max_context=6, background=True)
    runner = open_runner(model64)
    prompt = _prompt(3)
    reference = generate(runner, prompt, 40).tokens
    first = generate(runner, prompt, 40, index, k=4)  # nothing indexed yet
    index._builder.join()  # the rebuild that request started
    second = generate(runner, prompt, 40, index, k=4)
    assert first.tokens == second.tokens == reference
    assert first.stats.tau < 1.1 < 3.0 < second.stats.tau  # the second request is drafted from the first
