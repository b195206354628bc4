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


@torch.no_grad()
def exact_law_after_the_first(model, prompt: list[int], sampling) -> torch.Tensor:
    """P(x2, x3) flattened to [V * V], x1 summed out: the law of the two tokens a chain of two drafts decides in
    the first verification (the prompt's forward samples x1)."""
    vocab = model.config.vocab_size
    first = distribution(model(torch.tensor([prompt])).logits[0, -1], sampling)
    return sum(first[t] * exact_two_token_law(model, prompt + [t], sampling) for t in range(vocab))


def engine_two_token_law(model, prompt: list[int], sampling, make_proposer, trials: int, k: int = 2,
                         capture: list[int] = (), after: int = 0, longest: list | None = None):
    """Empirical law of (x_{after+1}, x_{after+2}) over `trials` seeds, and how many drafts were proposed and
    rejected; `longest` gets each trial's longest draft (with after=1 the first verification's: the budget of
    any later one is a single token)."""
    vocab = model.config.vocab_size
    runner = open_runner(model, capture=capture)  # the layers a head-chain drafter reads
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    drafted = rejected = 0
    for seed in range(trials):
        # the drafter draws from its own stream: sharing the engine's seed would correlate draft and choice
        result = generate(runner, prompt, after + 2, make_proposer(10**6 + seed), k=k, sampling=sampling, seed=seed)
        counts[result.tokens[after] * vocab + result.tokens[after + 1]] += 1
        if longest is not None:
            longest.append(len(result.stats.proposed))
        drafted += sum(result.stats.proposed)
        rejected += sum(result.stats.proposed) - sum(result.stats.accepted)
    return counts / trials, drafted, rejected
