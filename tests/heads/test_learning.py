"""Heads and losses together learn: accuracy far above chance after a short plain-PyTorch fit.

The trainer has its own, end-to-end version of this test; this one isolates the modelling path.
"""


import pytest
import torch
from conftest import make_tiny_llama

from mtptrain.heads import EagleHead, FrozenTarget, MTPHead
from mtptrain.heads.eagle3 import Eagle3Head
from mtptrain.heads.losses import distill_loss
from mtptrain.heads.vocab import DraftVocab


def _data(model, n=24, length=24, seed=0):
    """Sequences with a learnable pattern (a repeating random phrase) and the target's states on them."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(0, 400, (6,), generator=g)
    ids = torch.stack([phrase.roll(int(torch.randint(0, 6, (1,), generator=g))).repeat(length // 6)
                       for _ in range(n)])
    caught = {}
    hook = model.model.norm.register_forward_pre_hook(lambda _m, a: caught.setdefault("h", a[0]))
    with torch.no_grad():
        model(ids)
    hook.remove()
    return ids, caught["h"]


def _fit(head, loss_fn, steps=60):
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    first = last = None
    for _ in range(steps):
        stats = loss_fn()
        opt.zero_grad()
        stats.loss.backward()
        opt.step()
        first = first if first is not None else stats
        last = stats
    return first, last


@pytest.mark.parametrize("kind", ["eagle", "eagle-stripped", "mtp", "eagle3"])
def test_loss_falls_and_accuracy_rises_well_above_chance(kind):
    torch.manual_seed(0)
    model = make_tiny_llama(400).eval()
    frozen = FrozenTarget.of(model)
    ids, h = _data(model)
    mask = torch.ones(ids.shape[0], ids.shape[1] - 1)
    if kind.startswith("eagle") and kind != "eagle3":
        head = EagleHead(frozen, norms="stripped" if kind.endswith("stripped") else "restored")
        def loss_fn():
            out = head(head.features(h[:, :-1]), ids[:, 1:])
            return distill_loss(head.logits, frozen.target_logits, out, h[:, 1:], mask, chunk=128)
    elif kind == "mtp":
        head = MTPHead(frozen, depths=1)
        def loss_fn():
            out = head(h, ids)[0]
            return distill_loss(lambda x: head.logits(x, 1), frozen.target_logits, out, h[:, 1:], mask, chunk=128)
    else:
        head = Eagle3Head(frozen, DraftVocab.from_token_streams(ids, 64, 400), num_features=1)
        def loss_fn():
            out = head.unroll(head.fuse([h]), ids, steps=1)[0]
            return distill_loss(head.logits, head.target_logits, out, h[:, 1:], mask, chunk=128)
    first, last = _fit(head, loss_fn)
    # The cross-entropy is floored by the target's own entropy (near ln 400 for a random tiny target),
    # so the distance that must fall is the KL: loss minus that constant.
    assert last.loss.item() < first.loss.item()
    assert last.kl < 0.1 * first.kl, (first.kl, last.kl)
    accuracy = last.correct / last.count
    assert accuracy > 0.8, accuracy  # chance is 1/400 (1/64 for the reduced vocabulary)
