"""A head's drafting steps on the runtime's kernels equal its own forward over a transformers cache."""

import pytest
import torch
from conftest import make_tiny_llama
from transformers import DynamicCache

from mtptrain.heads import FrozenTarget
from mtptrain.heads.spec import HeadSpec

SPECS = {"eagle": HeadSpec("eagle", last_layer=3),
         "eagle-stripped": HeadSpec("eagle", last_layer=3, norms="stripped"),
         "eagle3": HeadSpec("eagle3", last_layer=3, feature_layers=[0, 1, 2], ttt_steps=2, draft_vocab_size=300),
         "eagle3.1-norms": HeadSpec("eagle3", last_layer=3, feature_layers=[0, 1, 2], ttt_steps=2,
                                    draft_vocab_size=300, fc_norm=True, norm_output=True)}


def _head(kind: str, dtype: torch.dtype):
    model = make_tiny_llama(400, seed=3).to(dtype)
    spec = SPECS[kind]
    torch.manual_seed(0)
    head = spec.family.build(spec, FrozenTarget.of(model)).to(dtype).eval()
    with torch.no_grad():  # fresh norms are ones: make them matter
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return head


def head_lm_head(head):
    return head.lm_head if hasattr(head, "lm_head") else head.frozen.lm_head


def _laid_out(monkeypatch, product):
    from mtptrain.heads import fast
    from mtptrain.runtime.choice import Choice

    one, many = ("fused", "fused") if product == "native" else ("plain", "sdpa")  # the runtime's own together
    monkeypatch.setattr(fast, "choose", lambda config, device, requested: Choice(
        getattr(torch, requested), product, one, many, "set"))


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("product", ["linear", "native", pytest.param("packed", marks=pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"))])
@torch.no_grad()
def test_steps_equal_the_heads_forward_through_prefill_steps_rollback_and_a_tree(kind, product, monkeypatch):
    laid_out = product != "linear"
    if laid_out:
        _laid_out(monkeypatch, product)
    dtype = torch.float32 if laid_out else torch.float64
    head = _head(kind, dtype)
    stepper = head.stepper(SPECS[kind])
    assert stepper.choice.product == product
    assert (stepper.lm_head is not head_lm_head(head).weight) == laid_out  # laid out: its own copy
    generator = torch.Generator().manual_seed(1)
    hidden = head.frozen.config.hidden_size
    features = torch.randn(1, 12, hidden, generator=generator, dtype=dtype)
    ids = torch.randint(0, 400, (1, 12), generator=generator)
    cache = DynamicCache()
    # transformers computes norms and rotary tables in float32 even for a float64 model
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-6, atol=1e-6)

    def both(f, i, positions=None, seen=None):
        mask = None
        if seen is not None:
            mask = torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, torch.finfo(dtype).min)
        theirs = head(f, i, position_ids=positions, cache=cache, mask=mask)
        ours = stepper.step(f, i, positions, seen)
        assert torch.allclose(ours, theirs, **tolerance), (ours - theirs).abs().max()
        # the LM head on the stepper's product (packed with the layer) gives the head's own logits
        assert torch.allclose(stepper.logits(ours), head.logits(theirs), **tolerance)
        return ours

    both(features[:, :7], ids[:, :7])  # a prefill
    for t in range(7, 10):  # single steps
        both(features[:, t:t + 1], ids[:, t:t + 1])
    stepper.rollback(8)  # verification kept 8 positions
    cache.crop(8 - cache.get_seq_length())
    both(features[:, 8:12], ids[:, 8:12])  # several positions after a cached prefix
    # three tree nodes at one depth: each sees the prefix and itself only
    seen = torch.zeros(1, 1, 3, 15, dtype=torch.bool)
    seen[..., :12] = True
    for row in range(3):
        seen[0, 0, row, 12 + row] = True
    both(features[:, :3], ids[:, :3], torch.full((1, 3), 12), seen)
    assert stepper.length == cache.get_seq_length() == 15
    # the feature drafted from: the target's captured states, as the head's own draft_input reads them
    captured = {layer: torch.randn(5, hidden, generator=generator, dtype=dtype) for layer in range(4)}
    ours, theirs = stepper.draft_input(captured), head.draft_input(captured, SPECS[kind])
    assert ours.shape == theirs.shape == (1, 5, hidden)
    assert torch.allclose(ours, theirs, **tolerance), (ours - theirs).abs().max()


def _as_int8_leaves_them(head, kind: str) -> None:
    """The head's weights that an int8 stepper multiplies by (its layer's products, eagle3's fc, the LM head it
    drafts through), replaced by what int8 quantization leaves of them."""
    from mtptrain.runtime.products import int8_blocked, int8_dequantized

    layer = head.layer if kind == "eagle3" else head.block.layer
    linears = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
               layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj, head_lm_head(head)]
    if kind == "eagle3":
        linears.append(head.fc)
    for module in linears:
        module.weight.copy_(int8_dequantized(int8_blocked(module.weight)).to(module.weight.dtype))


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@torch.no_grad()
def test_an_int8_stepper_equals_the_head_with_its_weights_as_int8_leaves_them(kind, monkeypatch):
    """eval.draft_weights int8: the stepper lays the head's weights out in int8 (runtime/products.py, INT8)
    whatever product the machine chose, and steps as the head would with the dequantized weights."""
    from mtptrain.runtime.products import INT8, Int8Blocked

    _laid_out(monkeypatch, "native")
    head = _head(kind, torch.float32)
    stepper = head.stepper(SPECS[kind], int8=True)
    assert stepper.kernels.product is INT8
    assert isinstance(stepper.lm_head, Int8Blocked) and isinstance(stepper.layer.qkv, Int8Blocked)
    plain = head.stepper(SPECS[kind])
    _as_int8_leaves_them(head, kind)
    generator = torch.Generator().manual_seed(2)
    hidden = head.frozen.config.hidden_size
    captured = {layer: torch.randn(6, hidden, generator=generator) for layer in range(4)}
    ids = torch.randint(0, 400, (1, 6), generator=generator)
    feature = stepper.draft_input(captured)
    assert torch.allclose(feature, head.draft_input(captured, SPECS[kind]), rtol=1e-4, atol=1e-4)
    cache = DynamicCache()
    ours, theirs = stepper.step(feature, ids), head(feature, ids, cache=cache)
    for _ in range(3):  # then steps on its own outputs, as a chain drafts
        assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4), (ours - theirs).abs().max()
        assert torch.allclose(stepper.logits(ours), head.logits(theirs), rtol=1e-4, atol=1e-4)
        ids = stepper.logits(ours)[:, -1:].argmax(-1)
        ours, theirs = stepper.step(ours[:, -1:], ids), head(theirs[:, -1:], ids, cache=cache)
    # the plain stepper, laid out before the quantization, still multiplies by the head's own weights
    assert not torch.allclose(plain.logits(ours), stepper.logits(ours), rtol=1e-4, atol=1e-4)
