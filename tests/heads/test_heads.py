"""Head modules: frozen shared parts, the norm switch, incremental = full forward, index shift."""

import pytest
import torch
from conftest import make_tiny_llama
from transformers import DynamicCache

from mtptrain.heads import EagleHead, FrozenTarget, MTPHead


@pytest.fixture(scope="module")
def target():
    model = make_tiny_llama(400).double()
    return model, FrozenTarget.of(model)


def heads(frozen):
    torch.manual_seed(0)
    return [EagleHead(frozen).double(), EagleHead(frozen, norms="stripped").double(),
            MTPHead(frozen, depths=3).double(), MTPHead(frozen, depths=3, share=True).double()]


def test_frozen_parts_are_shared_by_reference_and_never_saved(target):
    model, frozen = target
    for head in heads(frozen):
        assert head.frozen.embed is model.get_input_embeddings()
        assert head.frozen.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
        state = head.state_dict()
        assert not any("embed_tokens" in k or "lm_head" in k for k in state), list(state)
        assert not any(400 in t.shape for t in state.values())  # nothing vocabulary-sized
        embed_ptr = model.get_input_embeddings().weight.data_ptr()
        assert all(t.data_ptr() != embed_ptr for t in state.values())
        assert all(p.requires_grad for p in head.parameters())
        own = {id(p) for p in head.parameters()}
        assert id(model.get_input_embeddings().weight) not in own
        assert not model.get_input_embeddings().weight.requires_grad


def _rms_norms(module):
    return [m for m in module.modules() if type(m).__name__.endswith("RMSNorm")]


def test_the_stripped_switch_really_removes_the_norms(target):
    _, frozen = target
    restored, stripped = EagleHead(frozen), EagleHead(frozen, norms="stripped")
    # restored: embedding norm, feature norm, the layer's input and post-attention norms, final norm
    assert len(_rms_norms(restored)) == 5
    # stripped keeps only the post-attention norm inside the decoder layer, as the original EAGLE head did
    assert len(_rms_norms(stripped)) == 1
    assert isinstance(stripped.block.layer.input_layernorm, torch.nn.Identity)
    h = torch.randn(2, 5, 64, dtype=torch.float64)
    assert torch.equal(restored.features(h), h)
    assert torch.allclose(stripped.features(h), frozen.final_norm(h))
    with pytest.raises(ValueError, match="restored"):
        EagleHead(frozen, norms="none")


def test_layer_is_built_like_the_targets_own(target):
    """The head's decoder layer is the target's layer class with the target's shapes, so it computes what a
    layer of the target computes: given the same weights, the same output."""
    model, frozen = target
    layer, own = EagleHead(frozen).double().block.layer, model.model.layers[0]
    assert type(layer) is type(own)
    assert {n: p.shape for n, p in layer.named_parameters()} == {n: p.shape for n, p in own.named_parameters()}
    layer.load_state_dict(own.state_dict())
    h = torch.randn(1, 5, model.config.hidden_size, dtype=torch.float64)
    position_ids = torch.arange(5)[None]
    rope = model.model.rotary_emb(h, position_ids)
    assert torch.allclose(layer(h, position_embeddings=rope, position_ids=position_ids)[0],
                          own(h, position_embeddings=rope, position_ids=position_ids)[0])


@torch.no_grad()
def test_incremental_steps_with_a_cache_equal_the_full_sequence(target):
    _, frozen = target
    torch.manual_seed(1)
    features, ids = torch.randn(2, 12, 64, dtype=torch.float64), torch.randint(0, 400, (2, 12))
    for head in heads(frozen)[:2]:
        full = head(features, ids)
        cache = DynamicCache()
        pieces = [head(features[:, a:b], ids[:, a:b], cache=cache) for a, b in [(0, 5), (5, 6), (6, 9), (9, 12)]]
        assert torch.allclose(torch.cat(pieces, 1), full, atol=1e-12)
        # Rolling the cache back and recomputing gives the same states again.
        cache.crop(6 - cache.get_seq_length())  # this transformers crops by a negative count
        again = head(features[:, 6:12], ids[:, 6:12], cache=cache)
        assert torch.allclose(again, full[:, 6:], atol=1e-12)
    mtp = heads(frozen)[2]
    cache = DynamicCache()
    first = mtp.step(1, features[:, :11], ids[:, 1:])
    stepped = torch.cat([mtp.step(1, features[:, a:b], ids[:, a + 1:b + 1], cache=cache) for a, b in [(0, 4), (4, 11)]], 1)
    assert torch.allclose(stepped, first, atol=1e-12)


@torch.no_grad()
def test_mtp_depth_k_sees_no_token_after_t_plus_k(target):
    _, frozen = target
    mtp = heads(frozen)[2]
    torch.manual_seed(2)
    features, ids = torch.randn(1, 10, 64, dtype=torch.float64), torch.randint(0, 400, (1, 10))
    outputs = mtp(features, ids)
    assert [o.shape[1] for o in outputs] == [9, 8, 7]
    t = 3
    for depth, out in enumerate(outputs, start=1):
        changed_ids = ids.clone()
        changed_ids[0, t + depth + 1:] = (changed_ids[0, t + depth + 1:] + 1) % 400  # tokens after x_{t+k}
        changed_features = features.clone()
        changed_features[0, t + 1:] += 1.0  # target states after h_t
        again = mtp(changed_features, changed_ids)[depth - 1]
        assert torch.allclose(again[0, : t + 1], out[0, : t + 1]), depth
        # ... while x_{t+k} itself matters
        moved = ids.clone()
        moved[0, t + depth] = (moved[0, t + depth] + 1) % 400
        assert not torch.allclose(mtp(features, moved)[depth - 1][0, t], out[0, t])


def test_shared_mtp_reuses_one_module(target):
    _, frozen = target
    shared, separate = MTPHead(frozen, depths=3, share=True), MTPHead(frozen, depths=3)
    assert len(shared.blocks) == 1 and len(separate.blocks) == 3
    assert sum(p.numel() for p in separate.parameters()) == 3 * sum(p.numel() for p in shared.parameters())
    with pytest.raises(ValueError, match="depth 4"):
        shared.step(4, torch.zeros(1, 1, 64), torch.zeros(1, 1, dtype=torch.long))
