"""Exactness of the engine on tiny random targets: greedy output equals the target's own greedy decoding,
sampled output follows the target's distribution, and rollback leaves the cache as a fresh prefill."""

import pytest
import torch
from conftest import make_tiny_llama
from law import engine_two_token_law, exact_two_token_law

from mtptrain.engine.proposer import ProposerBase
from mtptrain.engine.generate import generate
from mtptrain.engine.ngram import NgramProposer
from mtptrain.runtime.runner import open_runner
from mtptrain.engine.verify import Sampling, distribution


@pytest.fixture(scope="module")
def model64():
    return make_tiny_llama(400, seed=3).double()


def _prompts():
    g = torch.Generator().manual_seed(0)
    phrase = torch.randint(0, 400, (5,), generator=g).tolist()
    return [phrase * 3 + torch.randint(0, 400, (4,), generator=g).tolist(),  # repetition: n-gram drafts hit
            torch.randint(0, 400, (12,), generator=g).tolist()]


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_output_equals_the_targets_own_greedy_decoding(model64, k):
    runner = open_runner(model64)
    for prompt in _prompts():
        reference = model64.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, min_new_tokens=40,
                                     pad_token_id=0)[0, len(prompt):].tolist()
        plain = generate(runner, prompt, 40)
        assert plain.tokens == reference
        assert plain.stats.tau == 1.0
        spec = generate(runner, prompt, 40, NgramProposer(1, 3), k=k)
        assert spec.tokens == reference  # float64: identical, no exceptions
        assert spec.stats.steps <= plain.stats.steps


def test_ngram_drafts_are_accepted_on_repetitive_text(model64):
    # A target that repeats: its greedy output loops, so prompt lookup must pay off.
    runner = open_runner(model64)
    prompt = _prompts()[0]
    result = generate(runner, prompt, 64, NgramProposer(1, 3), k=4)
    assert result.stats.tau > 1.5, result.stats
    assert result.stats.acceptance()[0] > 0.5
    assert result.stats.emitted == len(result.tokens) - 1  # every step's tokens, the prefill's excluded
    # each step emits its accepted drafts plus one token; only a bonus past max_new_tokens is dropped
    assert 0 <= sum(result.stats.accepted) + result.stats.steps - result.stats.emitted <= 1


def test_ngram_matches_at_least_min_n_tokens():
    tokens = [5, 7, 9, 4, 5]  # only the last token recurs
    assert NgramProposer(1, 3).propose(tokens, 2) == ([7, 9], None)
    assert NgramProposer().propose(tokens, 2) == ([], None)  # the default matches 2 tokens or more
    assert NgramProposer().propose(tokens + [7], 3) == ([9, 4, 5], None)
    assert NgramProposer(2, 3).propose([1, 2, 3, 1, 2, 8, 1, 2], 2) == ([8, 1], None)  # the latest match wins


def test_end_of_sequence_stops_generation(model64):
    runner = open_runner(model64)
    prompt = _prompts()[1]
    free = generate(runner, prompt, 30).tokens
    eos = free[10]
    stopped = generate(runner, prompt, 30, NgramProposer(), k=4, eos={eos})
    assert stopped.tokens == free[: free.index(eos) + 1]


@pytest.mark.parametrize("runtime", ["native", "transformers"])
@torch.no_grad()
def test_rollback_leaves_the_cache_of_a_fresh_prefill(model64, runtime):
    runner = open_runner(model64, runtime=runtime)
    tokens = _prompts()[0] + _prompts()[1]
    runner.forward(tokens[:10])
    runner.forward(tokens[10:25])  # as if 15 drafts were verified
    runner.rollback(17)
    fresh = open_runner(model64, runtime=runtime)
    fresh.forward(tokens[:17])
    assert runner.length == fresh.length == 17
    for (k, v), (fresh_k, fresh_v) in zip(runner.kv(), fresh.kv(), strict=True):
        assert torch.allclose(k, fresh_k, atol=1e-12) and torch.allclose(v, fresh_v, atol=1e-12)
    assert torch.allclose(runner.forward(tokens[17:20]), fresh.forward(tokens[17:20]), atol=1e-10)


class RandomDrafter(ProposerBase):
    """Drafts tokens sampled from a fixed distribution q, and says so: the general (non one-hot) path."""

    name = "random"

    def __init__(self, q: torch.Tensor, seed: int):
        self.q, self.generator = q, torch.Generator().manual_seed(seed)

    def propose(self, tokens, k):
        draft = torch.multinomial(self.q, k, replacement=True, generator=self.generator).tolist()
        return draft, self.q.expand(k, -1)


@pytest.mark.parametrize("drafter", ["ngram", "random"])
def test_sampled_tokens_follow_the_targets_distribution(drafter):
    """Temperature 1 on a 12-token vocabulary: the empirical law of the first two tokens, the second one
    always drafted and verified by rejection sampling, matches the target's exact law."""
    vocab = 12
    model = make_tiny_llama(vocab, seed=4).double()
    prompt = list(range(vocab)) * 2  # every token occurs: prompt lookup always finds a draft
    sampling = Sampling(temperature=1.0)
    exact = exact_two_token_law(model, prompt, sampling)
    q = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * 2, -1)
    make = (lambda seed: NgramProposer(1, 1)) if drafter == "ngram" else (lambda seed: RandomDrafter(q, seed))
    trials = 3000
    empirical, drafted, rejected = engine_two_token_law(model, prompt, sampling, make, trials, k=3)
    assert drafted == trials and 0 < rejected < trials  # both the accept and the resample branch ran
    # An exact sampler's TV over 144 cells at 3000 samples is about 0.1. A sampler that kept every draft
    # would emit x2 from the drafter's law instead: its TV against the exact law is far above the bound.
    first = exact.reshape(vocab, vocab).sum(1)
    kept_draft = first[:, None] * (q[None, :] if drafter == "random" else
                                   torch.nn.functional.one_hot((torch.arange(vocab) + 1) % vocab, vocab).double())
    assert 0.5 * (kept_draft.flatten() - exact).abs().sum() > 0.3
    assert 0.5 * (empirical - exact).abs().sum() < 0.15


def test_top_k_and_top_p_transforms():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    assert torch.count_nonzero(distribution(logits, Sampling(1.0, top_k=2))) == 2
    probs = torch.softmax(logits.double(), -1)[0]
    # top_p = 0.8 keeps the smallest prefix whose mass reaches 0.8: here the two most likely tokens.
    kept = distribution(logits, Sampling(1.0, top_p=0.8))[0]
    assert probs[0] < 0.8 <= probs[0] + probs[1]
    assert torch.allclose(kept, torch.tensor([probs[0], probs[1], 0, 0]) / (probs[0] + probs[1]))


def test_every_proposer_of_the_engine_follows_the_protocol():
    """generate calls reset, observe (when reads_states) and finish on any proposer: none is probed with hasattr."""
    from mtptrain.engine.draft_model import DraftModelProposer
    from mtptrain.engine.head_chain import HeadChainProposer
    from mtptrain.engine.head_tree import HeadTreeProposer
    from mtptrain.engine.mtp_chain import MTPChainProposer
    from mtptrain.engine.ngram import NgramProposer
    from mtptrain.engine.proposer import Proposer
    from mtptrain.engine.ssd import SSDProposer
    from mtptrain.engine.suffix_index import SuffixIndexProposer

    classes = [DraftModelProposer, HeadChainProposer, HeadTreeProposer, MTPChainProposer, NgramProposer, SSDProposer,
               SuffixIndexProposer]
    for cls in classes:
        assert all(callable(getattr(cls, step, None)) for step in ("reset", "propose", "observe", "finish")), cls
    assert [c.reads_states for c in classes] == [False, True, True, True, False, False, False]
    assert isinstance(NgramProposer(), Proposer)
