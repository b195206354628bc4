"""The index shift of every head family, on a right-padded batch: which target state and which mask
each draft position is scored against."""

import pytest
import torch
from conftest import make_tiny_llama

import mtptrain.heads.objective as objective
from mtptrain.heads import FrozenTarget
from mtptrain.heads.losses import DistillStats, Loss, distill_loss
from mtptrain.heads.spec import HeadSpec

LENGTHS = [7, 4]  # the second sample is right-padded to 7


def _batch():
    batch_size, length, hidden = len(LENGTHS), max(LENGTHS), 64
    # Every state carries its own coordinates: value t + 100 * b.
    coords = torch.arange(length)[None, :, None] + 100 * torch.arange(batch_size)[:, None, None]
    states = coords.expand(batch_size, length, hidden).float().clone()
    ids = torch.randint(1, 400, (batch_size, length))
    mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1], [0, 1, 1, 1, 0, 0, 0]])
    for b, n in enumerate(LENGTHS):
        states[b, n:], ids[b, n:], mask[b, n:] = 0, 0, 0
    return {"input_ids": ids, "loss_mask": mask, "hidden": {0: states.clone(), 1: states.clone(), 2: states.clone(),
                                                               3: states}}


@pytest.mark.parametrize("spec", [HeadSpec("eagle", last_layer=3), HeadSpec("mtp", last_layer=3, mtp_depths=3),
                                  HeadSpec("eagle3", last_layer=3, feature_layers=[0, 1, 2], ttt_steps=3,
                                           draft_vocab_size=50)], ids=["eagle", "mtp", "eagle3"])
def test_position_p_at_t_is_matched_to_state_t_plus_p_and_mask_of_token_t_plus_1_plus_p(spec, monkeypatch):
    calls = []

    def record(head_logits, target_logits, predicted, target_hidden, mask, chunk, to_target=None, target_top=None,
               recompute=True, loss=None, weight=None):
        calls.append((target_hidden[..., 0].clone(), mask.clone(), predicted.shape[1]))
        return DistillStats(predicted.sum() * 0.0, 0.0, 0, 0)

    monkeypatch.setattr(objective, "distill_loss", record)
    head = spec.family.build(spec, FrozenTarget.of(make_tiny_llama(400)))
    if spec.kind == "eagle3":  # its target logits are tabled once per batch: let the table carry the coordinates
        head.target_tables = lambda hidden, chunk: (hidden[..., 0].long(), hidden)
    batch = _batch()
    spec.family.objective(head, batch, spec, [1.0] * spec.draft_positions, 0.1, 64)
    assert len(calls) == spec.draft_positions
    for p, (target, mask, width) in enumerate(calls, start=1):
        for b, n in enumerate(LENGTHS):
            for t in range(width):
                if t + p < n:  # the matched state exists in this sample
                    assert target[b, t] == t + p + 100 * b, (p, b, t)
                expected = int(batch["loss_mask"][b, t + 1 + p]) if t + 1 + p < max(LENGTHS) else 0
                assert mask[b, t] == expected, (p, b, t)
                if t + 1 + p >= n:
                    assert mask[b, t] == 0  # nothing past the sample's end (or in its padding) counts


def _eagle3(draft_vocab_size: int):
    """A tiny target, an EAGLE-3 head of 3 TTT steps on it, and a batch of random states whose every token
    counts."""
    torch.manual_seed(0)
    target = make_tiny_llama(400)
    spec = HeadSpec("eagle3", last_layer=3, feature_layers=[0, 1, 2], ttt_steps=3, draft_vocab_size=draft_vocab_size)
    head = spec.family.build(spec, FrozenTarget.of(target))
    batch = _batch()
    batch["hidden"] = {k: torch.randn_like(v) for k, v in batch["hidden"].items()}
    batch["loss_mask"] = (torch.arange(7)[None] < torch.tensor(LENGTHS)[:, None]).long()
    return target, spec, head, batch


def test_eagle3_agreement_is_the_targets_full_vocabulary_choice_at_each_position():
    target, spec, head, batch = _eagle3(50)
    with torch.no_grad():
        # The head always drafts draft id 0 (its final norm is zero, so all its logits tie); the target's
        # choice cycles through that token (a hit), another draft-vocabulary token and one outside it.
        head.norm.weight.zero_()
        tokens = [int(head.draft_to_target[0]), int(head.draft_to_target[5]), 300]
        assert 300 not in head.draft_to_target.tolist()
        for t in range(7):
            batch["hidden"][3][:, t] = 10 * target.model.embed_tokens.weight[tokens[t % 3]]
        result = spec.family.objective(head, batch, spec, [1.0] * 3, 0.1, chunk=3)
        fused = head.fuse([batch["hidden"][layer] for layer in (0, 1, 2)])
        outputs = head.unroll(fused, batch["input_ids"], 3)
        last = batch["hidden"][3]
        for p, (out, stats) in enumerate(zip(outputs, result.positions), start=1):
            correct = count = 0
            for b, n in enumerate(LENGTHS):
                for t in range(out.shape[1]):
                    if t + 1 + p < n:
                        draft = int(head.draft_to_target[head.logits(out[b, t]).argmax()])
                        correct += draft == int(target.lm_head(target.model.norm(last[b, t + p])).argmax())
                        count += 1
            assert (stats.correct, stats.count) == (correct, count)
            # the loss from the batch's one LM-head pass equals the loss from the head's own draft-vocab rows
            m = objective.target_mask(batch["loss_mask"], p, out.shape[1])
            direct = distill_loss(head.logits, head.target_logits, out, last[:, p:p + out.shape[1]], m, 3)
            assert torch.allclose(stats.loss, direct.loss, atol=1e-5) and abs(stats.kl - direct.kl) < 1e-5
    assert 0 < sum(s.correct for s in result.positions) < sum(s.count for s in result.positions)



def test_reachable_scores_position_p_only_where_positions_before_it_drafted_the_targets_choices():
    """Loss.reachable: position p's loss is the loss of a mask of the places where positions 1..p-1 hit (a
    greedy chain drafts position p nowhere else), and so is its gradient; the metrics stay over every place."""
    target, spec, head, batch = _eagle3(400)
    with torch.no_grad():  # the head's logits near the target's, so that it hits often but not always
        head.lm_head.weight.copy_(target.lm_head.weight[head.draft_to_target])
        batch["hidden"][3] = head.unroll(head.fuse([batch["hidden"][k] for k in (0, 1, 2)]), batch["input_ids"], 1)[0]
        batch["hidden"][3] = torch.cat([batch["hidden"][3][:, :1], batch["hidden"][3]], 1)
        batch["hidden"][3] += 0.5 * torch.randn_like(batch["hidden"][3])
    plain = spec.family.objective(head, batch, spec, [1.0] * 3, 0.1, chunk=3)
    kept = spec.family.objective(head, batch, spec, [1.0] * 3, 0.1, chunk=3, loss=Loss(reachable=True))
    outputs = head.unroll(head.fuse([batch["hidden"][k] for k in (0, 1, 2)]), batch["input_ids"], 3)
    last, reached, dropped, later = batch["hidden"][3], None, 0, 0
    for p, (a, b, out) in enumerate(zip(plain.positions, kept.positions, outputs), start=1):
        assert (a.correct, a.count) == (b.correct, b.count) and torch.allclose(a.kl, b.kl)  # metrics: every place
        assert a.hits is None and int(b.hits.sum()) == int(b.correct)  # kept only where the next weight needs it
        m = objective.target_mask(batch["loss_mask"], p, out.shape[1])
        mask = m if reached is None else m * reached[:, : out.shape[1]]
        dropped += int(m.sum() - mask.sum())
        later += int(mask.sum()) if p > 1 else 0
        direct = distill_loss(head.logits, head.target_logits, out, last[:, p:p + out.shape[1]], mask, 3)
        assert torch.allclose(b.loss, direct.loss, atol=1e-5), p
        reached = b.hits.long() if reached is None else reached[:, : b.hits.shape[1]] * b.hits
    assert dropped > 0 and later > 0  # the case is not trivial: later places dropped and kept
    # the gradient: position 2 alone, against its mask of reachable places
    head.zero_grad()
    spec.family.objective(head, batch, spec, [0.0, 1.0, 0.0], 0.1, chunk=3, loss=Loss(reachable=True)).loss.backward()
    ours = [p.grad.clone() for p in head.parameters() if p.requires_grad]
    head.zero_grad()
    outputs = head.unroll(head.fuse([batch["hidden"][k] for k in (0, 1, 2)]), batch["input_ids"], 2)
    m = objective.target_mask(batch["loss_mask"], 2, outputs[1].shape[1]) * kept.positions[0].hits[:, : outputs[1].shape[1]]
    distill_loss(head.logits, head.target_logits, outputs[1], last[:, 2:2 + outputs[1].shape[1]], m, 3).loss.backward()
    for g, h in zip(ours, [p.grad for p in head.parameters() if p.requires_grad]):
        assert (g is None and h is None) or torch.allclose(g, h, atol=1e-6)
