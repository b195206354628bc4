from collections import Counter

import pytest
import torch
from conftest import make_tiny_llama
from transformers import DynamicCache

from mtptrain.heads import FrozenTarget
from mtptrain.heads.eagle3 import Eagle3Head, ttt_mask
from mtptrain.heads.vocab import DraftVocab


@pytest.fixture(scope="module")
def frozen():
    return FrozenTarget.of(make_tiny_llama(400).double())


def test_draft_vocab_takes_the_most_frequent_tokens_and_maps_both_ways():
    counts = Counter({7: 50, 3: 40, 9: 40, 1: 5, 399: 1})
    vocab = DraftVocab.from_counts(counts, 3, 400)
    assert vocab.draft_to_target.tolist() == [3, 7, 9]  # 7, then the tie 3/9; stored ascending
    for draft_id, target_id in enumerate(vocab.draft_to_target.tolist()):
        assert vocab.target_to_draft[target_id] == draft_id
    assert int((vocab.target_to_draft >= 0).sum()) == 3
    topped_up = DraftVocab.from_counts(Counter({5: 2}), 4, 400)
    assert topped_up.draft_to_target.tolist() == [0, 1, 2, 5]
    streams = DraftVocab.from_token_streams([[1, 1, 2], torch.tensor([2, 2, 3])], 2, 10)
    assert streams.draft_to_target.tolist() == [1, 2]
    with pytest.raises(ValueError, match="must be in 1..400"):
        DraftVocab.from_counts(counts, 0, 400)


def test_head_shapes_and_frozen_parts(frozen):
    vocab = DraftVocab.from_counts(Counter(range(100)), 64, 400)
    head = Eagle3Head(frozen, vocab).double()
    assert head.layer.self_attn.q_proj.in_features == 128 and head.fc.in_features == 192
    assert torch.equal(head.lm_head.weight, frozen.lm_head.weight[vocab.draft_to_target])  # initialised from the target
    assert head.lm_head.weight.data_ptr() != frozen.lm_head.weight.data_ptr()  # but its own, trained
    state = head.state_dict()
    assert "draft_to_target" in state and "target_to_draft" in state
    assert not any(t.shape[0] == 400 and t.dim() == 2 for t in state.values())  # no target-vocab matrix
    h = torch.randn(2, 5, 64, dtype=torch.float64)
    assert torch.allclose(head.target_logits(h), frozen.target_logits(h)[..., vocab.draft_to_target])


def test_ttt_mask_pattern():
    mask = ttt_mask(3, 2, torch.float32, torch.device("cpu"))[0, 0] == 0
    expected = torch.tensor([[1, 0, 0, 1, 0, 0, 1, 0, 0],
                             [1, 1, 0, 0, 1, 0, 0, 1, 0],
                             [1, 1, 1, 0, 0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)


def _head31(head: Eagle3Head) -> Eagle3Head:
    """Norms away from ones, so that a norm applied in the wrong place shows."""
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return head


NORMS = pytest.mark.parametrize("norms", [{}, {"fc_norm": True, "norm_output": True}], ids=["eagle3", "eagle3.1"])


@NORMS
@torch.no_grad()
def test_training_time_test_equals_drafting_with_a_cache(frozen, norms):
    torch.manual_seed(0)
    head = _head31(Eagle3Head(frozen, DraftVocab.from_counts(Counter(), 50, 400), **norms).double())
    layer_states = [torch.randn(1, 10, 64, dtype=torch.float64) for _ in range(3)]
    ids = torch.randint(0, 400, (1, 10))
    fused = head.fuse(layer_states)
    steps = 4
    unrolled = head.unroll(fused, ids, steps)
    assert [u.shape[1] for u in unrolled] == [9, 8, 7, 6]
    for t0 in range(0, 6):
        # Drafting after a verified prefix ending at t0: prefill with the target's states, then chain.
        cache = DynamicCache()
        out = head(fused[:, : t0 + 1], ids[:, 1 : t0 + 2], cache=cache)[:, -1:]
        assert torch.allclose(out, unrolled[0][:, t0 : t0 + 1], atol=1e-10)
        for step in range(1, steps):
            if t0 + 1 + step >= ids.shape[1]:
                break
            out = head(out, ids[:, t0 + 1 + step : t0 + 2 + step], cache=cache)
            assert torch.allclose(out, unrolled[step][:, t0 : t0 + 1], atol=1e-10), (t0, step)


@NORMS
def test_ttt_attention_over_the_attended_entries_equals_the_masked_attention_with_gradients(frozen, norms):
    """A batch of two, GQA (4 query heads on 2 key heads), 4 steps: outputs and gradients of `unroll` equal
    those of one masked forward per step over the cache of the earlier steps."""
    torch.manual_seed(0)
    head = _head31(Eagle3Head(frozen, DraftVocab.from_counts(Counter(), 50, 400), **norms).double())
    layer_states = [torch.randn(2, 12, 64, dtype=torch.float64) for _ in range(3)]
    ids = torch.randint(0, 400, (2, 12))
    runs = {}
    for name in ("unroll", "unroll_masked"):
        head.zero_grad()
        outputs = getattr(head, name)(head.fuse(layer_states), ids, 4)
        sum((o * torch.linspace(-1, 1, o.shape[-1], dtype=o.dtype)).sum() * (i + 1)
            for i, o in enumerate(outputs)).backward()
        runs[name] = ([o.detach() for o in outputs], {n: p.grad.clone() for n, p in head.named_parameters()
                                                     if p.grad is not None})
    (fast, fast_grads), (masked, masked_grads) = runs["unroll"], runs["unroll_masked"]
    assert [o.shape for o in fast] == [o.shape for o in masked] == [(2, 11 - j, 64) for j in range(4)]
    for a, b in zip(fast, masked):
        assert torch.allclose(a, b, atol=1e-10)
    assert fast_grads.keys() == masked_grads.keys() and len(fast_grads) > 5
    for name in fast_grads:
        assert torch.allclose(fast_grads[name], masked_grads[name], atol=1e-9), name


def test_eagle31_norms_normalise_each_fused_layer_and_carry_the_normed_output(frozen):
    """fc_norm: each layer is normed alone before fc, so scaling one layer's states changes nothing;
    norm_output: a step's carried state is the final norm of its layer output, and the LM head reads it as is."""
    torch.manual_seed(0)
    plain = Eagle3Head(frozen, DraftVocab.from_counts(Counter(), 50, 400)).double()
    head = _head31(Eagle3Head(frozen, DraftVocab.from_counts(Counter(), 50, 400), fc_norm=True,
                              norm_output=True).double())
    assert sorted(n for n in head.state_dict() if n.startswith("fc_norm")) == [f"fc_norm.{i}.weight" for i in range(3)]
    assert not any(n.startswith("fc_norm") for n in plain.state_dict())
    layers = [torch.randn(1, 6, 64, dtype=torch.float64) for _ in range(3)]
    scaled = [layers[0] * 7.0, *layers[1:]]
    assert torch.allclose(head.fuse(layers), head.fuse(scaled), atol=1e-5)  # up to the norm's epsilon
    assert not torch.allclose(plain.fuse(layers), plain.fuse(scaled))
    ids = torch.randint(0, 400, (1, 6))
    out = head(head.fuse(layers), ids)
    head.norm_output = False
    raw = head(head.fuse(layers), ids)
    assert torch.allclose(out, head.norm(raw), atol=1e-10)
    head.norm_output = True
    assert torch.allclose(head.logits(out), head.lm_head(out), atol=1e-10)


def test_eagle31_settings_belong_to_eagle3_heads():
    from mtptrain.config import Eagle3HeadConfig, RecipeError, load_recipe
    from mtptrain.heads.spec import HeadSpec

    manifest = {"layers": [1, 2, 3], "last_layer": 3, "target": {"vocab_size": 400}}
    spec = HeadSpec.of(Eagle3HeadConfig(fc_norm=True, norm_output=True), manifest)
    assert spec.fc_norm and spec.norm_output and spec.feature_layers == (1, 2)
    with pytest.raises(RecipeError, match="eagle3 heads"):
        load_recipe(None, ["head.kind=eagle", "head.fc_norm=true"])
