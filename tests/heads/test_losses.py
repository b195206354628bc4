import pytest
import torch
import torch.nn.functional as F

from mtptrain.heads.losses import Loss, distill_loss, feature_loss


def _setup(seed=0, vocab=50, hidden=8, n=37):
    g = torch.Generator().manual_seed(seed)
    head_w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    target_w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    predicted = torch.randn(2, n, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    target_hidden = torch.randn(2, n, hidden, generator=g, dtype=torch.float64)
    mask = (torch.rand(2, n, generator=g) > 0.3).long()
    return (lambda x: x @ head_w.T), (lambda x: x @ target_w.T), predicted, target_hidden, mask, head_w


def _loss_and_grads(setup, loss: Loss):
    """distill_loss over `setup` (chunks of 5) with its gradients in (predicted, head weights), cleared after."""
    head_logits, target_logits, predicted, target_hidden, mask, head_w = setup
    stats = distill_loss(head_logits, target_logits, predicted, target_hidden, mask, chunk=5, loss=loss)
    stats.loss.backward()
    grads = predicted.grad.clone(), head_w.grad.clone()
    predicted.grad, head_w.grad = None, None
    return stats, grads


def _direct(setup):
    """The target's p and the head's log q at the masked positions, computed whole."""
    head_logits, target_logits, predicted, target_hidden, mask, _ = setup
    keep = mask.bool()
    return F.softmax(target_logits(target_hidden[keep]), -1), F.log_softmax(head_logits(predicted[keep]), -1)


def test_chunked_loss_and_gradient_equal_the_direct_computation():
    head_logits, target_logits, predicted, target_hidden, mask, head_w = _setup()
    stats = distill_loss(head_logits, target_logits, predicted, target_hidden, mask, chunk=5)
    stats.loss.backward()
    grad_chunked = predicted.grad.clone(), head_w.grad.clone()
    predicted.grad, head_w.grad = None, None

    keep = mask.bool()
    p = F.softmax(target_logits(target_hidden[keep]), -1)
    logq = F.log_softmax(head_logits(predicted[keep]), -1)
    direct = -(p * logq).sum(-1).mean()
    direct.backward()
    assert torch.allclose(stats.loss, direct)
    assert torch.allclose(grad_chunked[0], predicted.grad) and torch.allclose(grad_chunked[1], head_w.grad)
    kl = (p * (p.log() - logq)).sum(-1).mean()
    assert abs(stats.kl - kl.item()) < 1e-9
    assert stats.count == int(keep.sum())
    assert stats.correct == int((logq.argmax(-1) == p.argmax(-1)).sum())


def test_identical_distributions_have_zero_kl_and_full_accuracy():
    _, target_logits, _, target_hidden, mask, _ = _setup()
    stats = distill_loss(target_logits, target_logits, target_hidden, target_hidden, mask, chunk=8)
    assert abs(stats.kl) < 1e-9 and stats.correct == stats.count


def test_empty_mask_gives_zero_loss_with_a_graph():
    head_logits, target_logits, predicted, target_hidden, mask, _ = _setup()
    stats = distill_loss(head_logits, target_logits, predicted, target_hidden, torch.zeros_like(mask))
    assert stats.count == 0 and stats.loss.item() == 0.0
    stats.loss.backward()  # a step on an all-prompt batch must not crash


def test_feature_loss_counts_only_masked_positions():
    a, b = torch.zeros(1, 4, 3), torch.ones(1, 4, 3)
    mask = torch.tensor([[1, 0, 0, 1]])
    b[0, 1] = 100.0  # unmasked: ignored
    assert torch.isclose(feature_loss(a, b, mask), torch.tensor(0.5))


def test_keeping_the_logits_for_backward_gives_the_recomputed_loss_and_gradients():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40)
    predicted = torch.randn(3, 7, 16)
    table = torch.randn(3, 7, 40)
    mask = (torch.rand(3, 7) > 0.3).long()
    results = []
    for recompute in (True, False):
        head.zero_grad()
        x = predicted.clone().requires_grad_(True)
        stats = distill_loss(head, lambda t: t, x, table, mask, chunk=5, recompute=recompute)
        stats.loss.backward()
        results.append((stats, x.grad.clone(), head.weight.grad.clone()))
    (a, ax, aw), (b, bx, bw) = results
    assert torch.allclose(a.loss, b.loss) and a.correct == b.correct and a.count == b.count > 0
    assert torch.allclose(ax, bx, atol=1e-7) and torch.allclose(aw, bw, atol=1e-7)


@pytest.mark.parametrize("kind", ["tv", "lk", "lk-hybrid"])
def test_acceptance_losses_and_their_gradients_equal_their_formulas(kind):
    """alpha = sum_v min(p_v, q_v), the acceptance probability of speculative sampling; each loss from it."""
    setup = _setup(seed=2)
    _, _, predicted, _, _, head_w = setup
    stats, grads = _loss_and_grads(setup, Loss(kind, 2.0))
    p, logq = _direct(setup)
    alpha = torch.minimum(p, logq.exp()).sum(-1)
    kl = (p * (p.log() - logq)).sum(-1)
    blend = torch.exp(-2.0 * alpha.detach())
    direct = {"tv": 1 - alpha, "lk": -alpha.log(), "lk-hybrid": blend * kl + (1 - blend) * (1 - alpha)}[kind].mean()
    direct.backward()
    assert torch.allclose(stats.loss, direct)
    assert torch.allclose(grads[0], predicted.grad) and torch.allclose(grads[1], head_w.grad)
    assert abs(stats.alpha - alpha.mean().item()) < 1e-9 and abs(stats.kl - kl.mean().item()) < 1e-9


@pytest.mark.parametrize("kind", ["kl", "lk-hybrid"])
def test_the_top_k_term_and_its_gradient_equal_their_formula(kind):
    """topk adds w x (-sum over the target's K most likely tokens of p log q) to the loss of any kind."""
    setup = _setup(seed=5)
    _, _, predicted, _, _, head_w = setup
    stats, grads = _loss_and_grads(setup, Loss(kind, 2.0, topk=4, topk_weight=0.5))
    p, logq = _direct(setup)
    order = p.argsort(-1, descending=True)[:, :4]
    top = -(p.gather(-1, order) * logq.gather(-1, order)).sum(-1)
    alpha = torch.minimum(p, logq.exp()).sum(-1)
    blend = torch.exp(-2.0 * alpha.detach())
    base = {"kl": -(p * logq).sum(-1),
            "lk-hybrid": blend * (p * (p.log() - logq)).sum(-1) + (1 - blend) * (1 - alpha)}[kind]
    direct = (base + 0.5 * top).mean()
    direct.backward()
    assert torch.allclose(stats.loss, direct)
    assert torch.allclose(grads[0], predicted.grad) and torch.allclose(grads[1], head_w.grad)
    plain, _ = _loss_and_grads(setup, Loss(kind, 2.0))
    assert torch.allclose(plain.loss, base.mean()) and not torch.allclose(plain.loss, stats.loss)
    assert abs(stats.kl - plain.kl) < 1e-12  # the metrics stay the distribution's


def test_alpha_is_reported_under_kl_without_entering_its_gradient():
    head_logits, target_logits, predicted, target_hidden, mask, _ = _setup(seed=3)
    stats = distill_loss(head_logits, target_logits, predicted, target_hidden, mask, chunk=7)
    keep = mask.bool()
    p = F.softmax(target_logits(target_hidden[keep]), -1)
    q = F.softmax(head_logits(predicted[keep]), -1)
    assert abs(stats.alpha - torch.minimum(p, q).sum(-1).mean().item()) < 1e-9
    assert 0.0 < stats.alpha < 1.0
    same = distill_loss(target_logits, target_logits, target_hidden, target_hidden, mask)
    assert abs(same.alpha - 1.0) < 1e-9  # a head equal to the target is always accepted


@pytest.mark.parametrize("kind", ["kl", "tv", "lk", "lk-hybrid"])
def test_every_loss_raises_the_acceptance_it_is_trained_for(kind):
    """Free logits fitted to a peaked target: alpha climbs far from its start under every loss."""
    g = torch.Generator().manual_seed(4)
    target = torch.randn(64, 30, generator=g, dtype=torch.float64) * 3
    logits = torch.zeros(64, 30, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=0.1)
    mask = torch.ones(64, dtype=torch.long)
    start = distill_loss(lambda x: x, lambda t: t, logits, target, mask, loss=Loss(kind)).alpha
    for _ in range(150):
        optimizer.zero_grad()
        distill_loss(lambda x: x, lambda t: t, logits, target, mask, loss=Loss(kind)).loss.backward()
        optimizer.step()
    end = distill_loss(lambda x: x, lambda t: t, logits, target, mask, loss=Loss(kind)).alpha
    assert start < 0.3 and end > 0.9, (start, end)


def test_an_unknown_loss_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="kl, tv, lk, lk-hybrid"):
        Loss("reverse-kl")
