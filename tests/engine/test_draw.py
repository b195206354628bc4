"""The one sampling primitive: `draw` follows its probabilities and never picks a zero, and every sampled path of
the engine draws through it without handing its CPU generator a tensor (on a CUDA target, a tensor on the GPU)."""

import math
import weakref

import pytest
import torch
from conftest import make_tiny_llama
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

import mtptrain.engine.verify as verify
from mtptrain.engine.generate import generate
from mtptrain.engine.proposer import ProposerBase
from mtptrain.engine.tree import DraftTree
from mtptrain.engine.verify import Sampling, draw
from mtptrain.heads import FrozenTarget
from mtptrain.heads.spec import HeadSpec
from mtptrain.runtime.runner import open_runner

SAMPLING = Sampling(temperature=1.0, top_k=8)
PROBS = torch.tensor([0, 2, 0, 4, 1, 5, 0, 2, 2, 0], dtype=torch.float64) / 16  # dyadic: every cdf value exact


def test_draws_follow_the_probabilities_and_never_pick_a_zero():
    generator = torch.Generator().manual_seed(0)
    n = 20000
    tokens = [draw(PROBS * 3.0, generator) for _ in range(n)]  # draw normalises: any total will do
    assert all(type(t) is int for t in tokens)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(PROBS)).double()
    assert counts[PROBS == 0].sum() == 0
    expected = n * PROBS[PROBS > 0]
    chi_square = float(((counts[PROBS > 0] - expected) ** 2 / expected).sum())
    assert chi_square < 25.8  # 6 cells, 5 degrees of freedom: an exact sampler exceeds it with probability 1e-4


def test_the_ends_of_the_unit_interval_land_on_tokens_with_mass(monkeypatch):
    """u = 0 takes the first token with mass, not the zero before it. u * total at the top (rounding; simulated
    with u = 1) would run past the end: it takes the last token with mass, not the zero after it."""
    generator = torch.Generator()
    monkeypatch.setattr(verify, "uniform", lambda g: 0.0)
    assert draw(PROBS, generator) == 1
    monkeypatch.setattr(verify, "uniform", lambda g: math.nextafter(1.0, 0.0))
    assert draw(PROBS, generator) == 8
    monkeypatch.setattr(verify, "uniform", lambda g: 1.0)
    assert draw(PROBS, generator) == 8
    monkeypatch.setattr(verify, "uniform", lambda g: 2 / 16)  # exactly the cdf after token 1: the next with mass
    assert draw(PROBS, generator) == 3


def test_a_seed_gives_the_same_tokens():
    def tokens(seed):
        generator = torch.Generator().manual_seed(seed)
        return [draw(PROBS, generator) for _ in range(50)]

    assert tokens(7) == tokens(7) != tokens(8)


class GeneratorsStayOnTheHost(TorchFunctionMode):
    """A CUDA target on a CPU-only machine: every tensor counts as on the target's device except those a generator
    makes and copies made by `.cpu()` (host tensors). Raises where CUDA would: a generator handed to an op on a device
    tensor (torch.multinomial(cuda_probs, generator=cpu_generator): "Expected a 'cuda' device type for
    generator"); and where the engine would move a value between devices unasked: a host tensor in the same op as a
    device tensor (a float read of a host draw is fine)."""

    def __init__(self):
        super().__init__()
        self.host: dict[int, weakref.ref] = {}  # id -> the tensor (a WeakSet compares tensors with ==)
        self.draws = 0

    def on_host(self, tensor: torch.Tensor) -> bool:
        known = self.host.get(id(tensor))
        return known is not None and known() is tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_host = [self.on_host(t) for t in tensors]
        generator = kwargs.get("generator")
        name = getattr(func, "__name__", str(func))
        if generator is not None and not all(on_host):
            raise RuntimeError(f"Expected a 'cuda' device type for generator but found '{generator.device.type}' "
                               f"(in {name})")
        if any(on_host) and not all(on_host):
            raise RuntimeError(f"a host tensor meets a device tensor in {name}")
        # .cpu() copies a CUDA tensor (on the CPU it would hand back the tensor itself)
        out = args[0].clone() if func is torch.Tensor.cpu else func(*args, **kwargs)
        if generator is not None or (tensors and all(on_host)) or func is torch.Tensor.cpu:
            self.draws += generator is not None
            self.host.update((id(t), weakref.ref(t)) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


class SmallTree(ProposerBase):
    """Two children at the root, one grandchild: the tree path of sampled verification."""

    def propose(self, tokens, k):
        return DraftTree([1, 5, 7], [-1, -1, 0])


def _drafters(model) -> dict:
    """name -> (the target layers it reads, a fresh drafter): one of each path that samples, each drafter made
    outside the mode (as the runtime's kernel choice is)."""
    from mtptrain.engine.draft_model import DraftModelProposer, truncated_target
    from mtptrain.engine.head_chain import HeadChainProposer
    from mtptrain.engine.head_tree import HeadTreeProposer
    from mtptrain.engine.mtp_chain import MTPChainProposer
    from mtptrain.engine.ngram import NgramProposer

    eagle, mtp = HeadSpec("eagle", last_layer=3), HeadSpec("mtp", last_layer=3, mtp_depths=2)
    torch.manual_seed(0)
    eagle_head = eagle.family.build(eagle, FrozenTarget.of(model)).double()
    mtp_head = mtp.family.build(mtp, FrozenTarget.of(model)).double()
    draft_model = truncated_target(model, 1)
    return {"plain": ((), lambda: None),
            "ngram": ((), lambda: NgramProposer(1, 1)),
            "tree": ((), SmallTree),
            "draft-model": ((), lambda: DraftModelProposer(draft_model, SAMPLING, seed=1)),
            "head-chain": (eagle.layers, lambda: HeadChainProposer(eagle_head, eagle, SAMPLING, seed=1)),
            "head-tree": (eagle.layers, lambda: HeadTreeProposer(eagle_head, eagle, 2, 2, 4, SAMPLING, seed=1)),
            "mtp-chain": ([3], lambda: MTPChainProposer(mtp_head, mtp, SAMPLING, seed=1))}


@pytest.mark.parametrize("name", ["plain", "ngram", "tree", "draft-model", "head-chain", "head-tree", "mtp-chain"])
def test_sampled_generation_never_hands_its_generator_a_device_tensor(name):
    model = make_tiny_llama(12, seed=4).double()
    capture, drafter = _drafters(model)[name]
    runner = open_runner(model, capture=capture)
    prompt = list(range(12)) * 2
    expected = generate(runner, prompt, 8, drafter(), k=2, sampling=SAMPLING, seed=3).tokens
    with GeneratorsStayOnTheHost() as mode:
        tokens = generate(runner, prompt, 8, drafter(), k=2, sampling=SAMPLING, seed=3).tokens
    assert tokens == expected  # the mode watches and changes nothing
    assert mode.draws >= len(tokens)


def test_the_ssd_drafter_draws_on_the_host():
    from mtptrain.engine.draft_model import truncated_target
    from mtptrain.engine.ssd import DraftLM

    drafter = DraftLM(truncated_target(make_tiny_llama(12, seed=4).double(), 1), SAMPLING, 0.3, 0)
    with GeneratorsStayOnTheHost() as mode:
        continuation = drafter.draft([1, 5, 7, 2], 3, [2, 1, 1])
    assert len(continuation.tokens) == 3 and mode.draws == 3


def test_the_regenerate_sampler_draws_on_the_host():
    from mtptrain.data.engines import sampler

    pick = sampler(SAMPLING, 0)
    logits = torch.randn(12, generator=torch.Generator().manual_seed(0))
    with GeneratorsStayOnTheHost() as mode:
        token = pick(logits)
    assert type(token) is int and mode.draws == 1


def test_a_draft_vocabulary_row_verifies_as_its_row_over_the_whole_vocabulary_does():
    """DraftProbs over a draft vocabulary (q zero outside its support) gives, seed for seed, the verdicts of the
    same q spread over the whole vocabulary; TargetRows gives those of the full [K+1, V] distribution."""
    vocab, size, k = 300, 40, 3
    sampling = Sampling(temperature=1.0)
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        support = torch.randperm(vocab, generator=g)[:size].sort().values
        q = torch.softmax(torch.randn(k, size, generator=g, dtype=torch.float64) * 2, -1)
        logits = torch.randn(k + 1, vocab, generator=g) * 2
        logits[:, support] += 2.0  # the target likes the draft vocabulary, so that drafts are often accepted
        columns = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
        draft = [int(support[c]) for c in columns]
        full = torch.zeros(k, vocab, dtype=torch.float64)
        full[:, support] = q
        p = verify.distribution(logits, sampling)
        expected = verify.verify_sampling(draft, full, p, torch.Generator().manual_seed(seed))
        rows = verify.TargetRows(logits, sampling)
        got = verify.verify_sampling(draft, verify.DraftProbs(q, columns, support), rows,
                                     torch.Generator().manual_seed(seed))
        assert (got.accepted, got.emitted) == (expected.accepted, expected.emitted), seed
        assert sorted(rows.rows) == list(range(got.accepted + 1))  # rows past the verdict were never computed
