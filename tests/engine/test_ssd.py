"""What speculative speculative decoding pre-drafts: outcome probabilities, fan-out, guesses, Saguaro sampling."""

import pytest
import torch
from conftest import make_tiny_llama

from mtptrain.engine.ssd import fan_out, guesses, outcome_probabilities, saguaro_distribution
from mtptrain.engine.verify import Sampling, distribution


def test_outcome_probabilities_sum_to_one_and_follow_the_rates():
    probs = outcome_probabilities([0.8, 0.5, 0.25])
    assert probs == pytest.approx([0.2, 0.4, 0.3, 0.1])
    assert sum(outcome_probabilities([0.6] * 5)) == pytest.approx(1.0)


def test_fan_out_is_the_capped_geometric_allocation():
    # A constant acceptance rate a gives P(j) ∝ a^j for j < K, so F_j ∝ a^(j / (1 + r)): ratio 0.5 at a = 0.25, r = 1.
    probs = outcome_probabilities([0.25] * 4)
    fans = fan_out(31, probs, power=1.0)
    assert sum(fans) == 31
    assert fans[:4] == [16, 8, 4, 2] and fans[4] == 1  # the last outcome (all accepted) has P = a^K
    # A larger r spreads the budget more evenly (the tail of the miss curve falls faster).
    assert fan_out(31, probs, power=4.0)[0] < 16
    # Caps: a position with few candidates keeps its cap, the rest goes to the others.
    capped = fan_out(31, probs, power=1.0, caps=[3, 100, 100, 100, 100])
    assert capped[0] == 3 and sum(capped) == 31 and capped[1] > capped[2] > capped[3]
    assert fan_out(10, probs, caps=[1, 1, 1, 1, 1]) == [1, 1, 1, 1, 1]
    assert fan_out(0, probs) == [0] * 5
    with pytest.raises(ValueError):
        fan_out(4, probs, power=0.0)


def test_guesses_skip_the_rejected_draft_token_and_come_best_first():
    scores = torch.tensor([[0.15, 0.5, 0.3, 0.05],   # after 0 drafts: the draft's own token 1 is skipped
                           [0.4, 0.1, 0.2, 0.3],   # after 1 draft: draft token 0 is skipped
                           [0.25, 0.15, 0.5, 0.1]])  # after the whole draft: the bonus, nothing skipped
    assert guesses([1, 0], scores, [2, 1, 1]) == [(0, 2), (1, 3), (2, 2), (0, 0)]
    assert guesses([1, 0], scores, [0, 0, 2]) == [(2, 2), (2, 0)]


def test_saguaro_scales_the_top_tokens_and_renormalises():
    q = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    scaled = saguaro_distribution(q, 2, 0.5)
    assert scaled.sum() == pytest.approx(1.0)
    assert scaled.tolist() == pytest.approx([0.25 / 0.6, 0.15 / 0.6, 0.15 / 0.6, 0.05 / 0.6])
    assert torch.equal(saguaro_distribution(q, 2, 1.0), q)
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        saguaro_distribution(q, 2, 0.0)


def test_saguaro_moves_the_residual_onto_the_cached_tokens():
    """With q close to p, a rejection's token is drawn from max(0, p - q'): scaling q's top tokens down makes
    them the residual's likely tokens, which are the ones a speculation cache holds."""
    p = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.45, 0.35, 0.1, 0.1], dtype=torch.float64)

    def residual_mass_on_top_2(q_used):
        residual = (p - q_used).clamp_min(0)
        return float(residual[:2].sum() / residual.sum())

    assert residual_mass_on_top_2(q) == 0.0  # plain q: a rejection always emits token 2, never cached
    assert residual_mass_on_top_2(saguaro_distribution(q, 2, 0.5)) == pytest.approx(0.5)
    assert residual_mass_on_top_2(saguaro_distribution(q, 2, 0.2)) > 0.8


# --------------------------------------------------------------------------- the speculation cache and the worker


def varied_model(layers: int = 4, vocab: int = 64):
    """A tiny target whose greedy text varies (float64, so batched and single forwards agree exactly)."""
    return make_tiny_llama(vocab, seed=3, layers=layers, initializer_range=0.3).double()


def varied_draft(layers: int = 2):
    """The worker's draft model: the varied target cut to its first layers (importable by the spawned worker)."""
    from mtptrain.engine.draft_model import truncated_target

    return truncated_target(varied_model(), layers)


def test_every_cached_continuation_is_the_draft_the_drafter_would_make_from_scratch():
    from mtptrain.engine.ssd import DraftLM, Speculator, SSDSettings

    settings = SSDSettings(k=3, budget=6)
    speculator = Speculator(DraftLM(varied_draft(), settings.sampling, 1.0, 0), settings)
    context = [5, 9, 13, 2, 40, 7]
    first = speculator.next_draft(context, 3)
    speculator.speculate(lambda: False)
    # Before any outcome, each position's acceptance rate is 1/2: P(j) = 1/2, 1/4, 1/8, 1/8, fans ∝ sqrt(P(j)).
    assert speculator.fans(3) == [2, 2, 1, 1]
    assert len(speculator.cache) == 6 and speculator.stats.guesses == 6
    assert sorted(j for j, _ in speculator.cache) == [0, 0, 1, 1, 2, 3]
    for (j, token), cont in speculator.cache.items():
        fresh = DraftLM(varied_draft(), settings.sampling, 1.0, 0).draft(context + first.tokens[:j] + [token], 3, [])
        assert cont.tokens == fresh.tokens, (j, token)
        assert torch.allclose(cont.scores, fresh.scores, atol=1e-9)
    # The outcome is read from the text: j drafts accepted, then the guessed token. A hit returns the cached draft.
    (j, token), cached = next(iter(speculator.cache.items()))
    assert speculator.next_draft(context + first.tokens[:j] + [token], 3).tokens == cached.tokens
    assert sum(speculator.stats.hits) == 1 and sum(speculator.stats.misses) == 0


def test_cached_sampled_drafts_report_the_saguaro_distribution_they_were_drawn_from():
    """Verification is exact only if each drafted token comes with the q' it was sampled from."""
    from mtptrain.engine.ssd import DraftLM, Speculator, SSDSettings

    settings = SSDSettings(k=3, budget=6, factor=0.3, sampling=Sampling(temperature=1.0))
    speculator = Speculator(DraftLM(varied_draft(), settings.sampling, settings.factor, 0), settings)
    context = [5, 9, 13, 2, 40, 7]
    first = speculator.next_draft(context, 3)
    fans = speculator.fans(3)
    speculator.speculate(lambda: False)
    reference = DraftLM(varied_draft(), settings.sampling, settings.factor, 0)
    for (j, token), cont in speculator.cache.items():
        text = context + first.tokens[:j] + [token]
        logits = reference.sync(text + cont.tokens, len(cont.tokens) + 1)
        for i in range(len(cont.tokens)):
            expected = saguaro_distribution(distribution(logits[i], settings.sampling), fans[i], 0.3)
            assert torch.allclose(cont.probs[i], expected, atol=1e-9), (j, token, i)
            assert cont.probs[i, cont.tokens[i]] > 0


def test_ssd_decoding_is_the_targets_greedy_decoding_and_hits_its_cache():
    from mtptrain.engine.generate import generate
    from mtptrain.runtime.runner import open_runner
    from mtptrain.engine.ssd import SSDProposer, SSDSettings

    target = varied_model()
    # complete: every round's budget is spent before the next draft is handed out, so hits do not depend on
    # how fast this machine verifies (a tiny target verifies before the drafter has guessed anything).
    proposer = SSDProposer(varied_draft, SSDSettings(k=3, budget=8, complete=True))
    try:
        runner = open_runner(target)
        for prompt in ([5, 9, 13, 2, 40, 7], [1, 2, 3, 4, 5, 6, 7, 8]):
            plain = generate(runner, prompt, 40)
            ssd = generate(runner, prompt, 40, proposer, k=3)
            assert ssd.tokens == plain.tokens
            assert ssd.stats.steps < plain.stats.steps
        stats = proposer.stats()
        assert sum(stats.hits) > 0 and stats.guesses > 0, stats
    finally:
        proposer.close()


def law_draft():
    """The law test's drafter: its 12-token target cut to one layer."""
    from mtptrain.engine.draft_model import truncated_target

    return truncated_target(make_tiny_llama(12, seed=4).double(), 1)


@torch.no_grad()
def exact_law_of_tokens_2_and_3(model, prompt: list[int], sampling) -> torch.Tensor:
    """P(x2, x3) flattened to [V * V], x1 summed out: the target's own sampling law."""
    vocab = model.config.vocab_size
    p1 = distribution(model(torch.tensor([prompt])).logits[0, -1], sampling)
    ones = torch.tensor([prompt + [a] for a in range(vocab)])
    p2 = distribution(model(ones).logits[:, -1], sampling)  # [x1, x2]
    twos = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
    p3 = distribution(model(twos).logits[:, -1], sampling).reshape(vocab, vocab, vocab)  # [x1, x2, x3]
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0).flatten()


def test_ssd_sampling_stays_exact_in_law():
    """Temperature 1, three tokens, drafts of 2: when the first round accepts nothing, the third token is
    verified against a draft pre-drafted before that outcome was known (a cache hit), sampled from Saguaro's
    q'. The law of tokens 2 and 3 is still the target's own."""
    from mtptrain.engine.generate import generate
    from mtptrain.runtime.runner import open_runner
    from mtptrain.engine.ssd import SSDProposer, SSDSettings

    vocab = 12
    model = make_tiny_llama(vocab, seed=4).double()
    prompt = list(range(vocab)) * 2
    sampling = Sampling(temperature=1.0)
    exact = exact_law_of_tokens_2_and_3(model, prompt, sampling)
    proposer = SSDProposer(law_draft, SSDSettings(k=2, budget=6, factor=0.3, sampling=sampling, complete=True))
    runner = open_runner(model)
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    trials = 2000
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the drafter's process has the other core
    try:
        for seed in range(trials):
            tokens = generate(runner, prompt, 3, proposer, k=2, sampling=sampling, seed=seed).tokens
            counts[tokens[1] * vocab + tokens[2]] += 1
        stats = proposer.stats()
    finally:
        proposer.close()
        torch.set_num_threads(threads)
    assert sum(stats.hits) > 200, stats  # cached drafts were verified many times (first rounds draft afresh)
    # An exact sampler's TV over 144 cells at 2000 samples is about 0.1.
    assert 0.5 * (counts / trials - exact).abs().sum() < 0.15


def test_ssd_settings_refuse_an_unknown_fallback_and_bad_numbers():
    from mtptrain.engine.ssd import SSDSettings

    with pytest.raises(ValueError, match="'draft' or 'ngram'"):
        SSDSettings(fallback="lookup")
    with pytest.raises(ValueError, match="0 < factor <= 1"):
        SSDSettings(factor=0.0)


# --------------------------------------------------------------------------- a head as the SSD drafter


def head_parts():
    """The worker's head: a tiny EAGLE-3 head over the varied target, with a 40-token draft vocabulary (the
    mapping into the target's 64 tokens is exercised). Importable by the spawned worker; deterministic."""
    from collections import Counter

    from mtptrain.engine.ssd import HeadParts
    from mtptrain.heads import FrozenTarget
    from mtptrain.heads.spec import HeadSpec
    from mtptrain.heads.vocab import DraftVocab

    spec = HeadSpec("eagle3", last_layer=3, feature_layers=[0, 1, 2], ttt_steps=2, draft_vocab_size=40)
    model = varied_model()
    torch.manual_seed(5)
    vocab = DraftVocab.from_counts(Counter({t: 64 - t for t in range(64)}), 40, 64)
    head = spec.family.build(spec, FrozenTarget.of(model), vocab).double()
    for param in head.parameters():  # random weights large enough that the head's choices vary
        param.data.normal_(0, 0.3) if param.dim() > 1 else None
    return HeadParts(head, spec, 64)


@torch.no_grad()
def head_scores_along(parts, base: list[int], path: list[int]) -> torch.Tensor:
    """Reference: the head's scores over the target vocabulary for the token after base + path[:i], i = 0..len,
    built step by step from the target's states for `base` and the head's own features after it."""
    from transformers import DynamicCache

    from mtptrain.runtime.runner import open_runner

    head, spec = parts.head, parts.spec
    runner = open_runner(varied_model(), capture=spec.feature_layers)
    runner.forward(base[:-1])
    cache = DynamicCache()
    feature = head.fuse([runner.hidden[layer][None] for layer in spec.feature_layers])
    out = head(feature, torch.tensor([base[1:]]), cache=cache)[:, -1:]
    rows = [head.logits(out)[0, -1]]
    for token in path:
        out = head(out, torch.tensor([[token]]), cache=cache)
        rows.append(head.logits(out)[0, -1])
    full = torch.full((len(rows), 64), float("-inf"))
    full[:, head.draft_to_target] = torch.stack(rows).float()  # drafters score in float32
    return full


def observed_head_speculator(settings, base):
    from mtptrain.runtime.runner import open_runner
    from mtptrain.engine.ssd import HeadDraft, Speculator

    parts = head_parts()
    drafter = HeadDraft(parts.head, parts.spec, settings.sampling, settings.factor, 0, parts.vocab_size)
    speculator = Speculator(drafter, settings)
    speculator.reset(base)
    runner = open_runner(varied_model(), capture=parts.spec.feature_layers)
    runner.forward(base[:-1])
    drafter.observe(0, runner.hidden, base[1:])
    return parts, speculator


def test_a_heads_cached_continuations_read_its_own_features_for_the_guessed_drafts():
    """Outcome (j, t*) is pre-drafted before the target's states for d_1 .. d_j exist: the head continues from
    its own predicted features for them. Each cached draft equals that, built step by step without a batch,
    a copied cache or a cut; the first draft equals the head chain's."""
    from mtptrain.engine.head_chain import HeadChainProposer
    from mtptrain.runtime.runner import open_runner
    from mtptrain.engine.ssd import SSDSettings

    settings = SSDSettings(k=3, budget=8)
    base = [5, 9, 13, 2, 30, 7, 11]
    parts, speculator = observed_head_speculator(settings, base)
    first = speculator.next_draft(base, 3)
    chain = HeadChainProposer(parts.head, parts.spec)
    chain.reset(base)
    runner = open_runner(varied_model(), capture=parts.spec.feature_layers)
    runner.forward(base[:-1])
    chain.observe(0, runner.hidden, base[1:])
    assert first.tokens == chain.propose(base, 3)[0]
    assert all(t in parts.head.draft_to_target.tolist() for t in first.tokens)
    speculator.speculate(lambda: False)
    assert len(speculator.cache) == 8
    for (j, token), cont in speculator.cache.items():
        reference = head_scores_along(parts, base, first.tokens[:j] + [token] + cont.tokens)
        assert torch.allclose(cont.scores, reference[j + 1:], atol=1e-6), (j, token)
        assert cont.tokens == [int(row.argmax()) for row in reference[j + 1: -1]]


def test_a_heads_cached_sampled_drafts_carry_their_saguaro_distributions():
    from mtptrain.engine.ssd import SSDSettings

    settings = SSDSettings(k=3, budget=8, factor=0.3, sampling=Sampling(temperature=1.0))
    base = [5, 9, 13, 2, 30, 7, 11]
    parts, speculator = observed_head_speculator(settings, base)
    first = speculator.next_draft(base, 3)
    fans = speculator.fans(3)
    speculator.speculate(lambda: False)
    for (j, token), cont in speculator.cache.items():
        reference = head_scores_along(parts, base, first.tokens[:j] + [token] + cont.tokens)[j + 1:]
        for i, drawn in enumerate(cont.tokens):
            expected = saguaro_distribution(distribution(reference[i], settings.sampling), fans[i], 0.3)
            assert torch.allclose(cont.probs[i], expected, atol=1e-9), (j, token, i)
            assert cont.probs[i, drawn] > 0 and drawn in parts.head.draft_to_target.tolist()


def test_ssd_with_a_head_is_the_targets_greedy_decoding_and_hits_its_cache():
    """The head reads each verification's states in the worker; every output equals the target's own."""
    from mtptrain.engine.generate import generate
    from mtptrain.runtime.runner import open_runner
    from mtptrain.engine.ssd import SSDProposer, SSDSettings

    target = varied_model()
    proposer = SSDProposer(head_parts, SSDSettings(k=3, budget=16, complete=True), layers=[0, 1, 2])
    try:
        runner = open_runner(target, capture=[0, 1, 2])
        for prompt in ([5, 9, 13, 2, 40, 7], [1, 2, 3, 4, 5, 6, 7, 8]):
            plain = generate(open_runner(target), prompt, 40)
            ssd = generate(runner, prompt, 40, proposer, k=3)
            assert ssd.tokens == plain.tokens
        stats = proposer.stats()
        assert sum(stats.hits) > 0 and stats.guesses > 0, stats
    finally:
        proposer.close()
