"""The exact law of the first two sampled tokens after a prompt, and an empirical one from the engine."""

import torch

from mtptrain.engine.generate import generate
from mtptrain.runtime.runner import open_runner
from mtptrain.engine.verify import distribution


@torch.no_grad()
def exact_two_token_law(model, prompt: list[int], sampling) -> torch.Tensor:
    """P(x1, x2) flattened to [V * V]: the target's own sampling law."""
    vocab = model.config.vocab_size
    first = distribution(model(torch.tensor([prompt])).logits[0, -1], sampling)
    second = torch.stack([distribution(model(torch.tensor([prompt + [t]])).logits[0, -1], sampling)
                          for t in range(vocab)])
    return (first[:, None] * second).flatten()


def engine_two_token_law(model, prompt: list[int], sampling, make_proposer, trials: int, k: int = 2,
                         capture: list[int] = ()):
    """Empirical law of (x1, x2) over `trials` seeds, and how many drafts were proposed and rejected."""
    vocab = model.config.vocab_size
    runner = open_runner(model, capture=capture)  # the layers a head-chain drafter reads
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    drafted = rejected = 0
    for seed in range(trials):
        # the drafter draws from its own stream: sharing the engine's seed would correlate draft and choice
        result = generate(runner, prompt, 2, make_proposer(10**6 + seed), k=k, sampling=sampling, seed=seed)
        counts[result.tokens[0] * vocab + result.tokens[1]] += 1
        drafted += sum(result.stats.proposed)
        rejected += sum(result.stats.proposed) - sum(result.stats.accepted)
    return counts / trials, drafted, rejected
