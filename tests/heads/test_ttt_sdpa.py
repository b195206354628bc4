"""The training-time test's attention as one SDPA call (`ttt_sdpa`, what it runs on CUDA: no scores of the batch
and heads kept for backward) gives the outputs and gradients of the products over the attended entries only (what
it runs on the CPU), and hands SDPA a call its mem-efficient CUDA kernel takes: as many key-value heads as query
heads, a mask in the queries' dtype with 8-aligned rows."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_llama

import mtptrain.heads.eagle3 as eagle3
from mtptrain.heads import FrozenTarget
from mtptrain.heads.eagle3 import Eagle3Head
from mtptrain.heads.vocab import DraftVocab


def _unrolled(head, layer_states, ids, steps):
    head.zero_grad()
    outputs = head.unroll(head.fuse(layer_states), ids, steps)
    weights = [torch.linspace(-1, 1, o.shape[-1], dtype=o.dtype) * (i + 1) for i, o in enumerate(outputs)]
    sum((o * w).sum() for o, w in zip(outputs, weights)).backward()
    return [o.detach() for o in outputs], {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_one_sdpa_call_per_step_gives_the_products_outputs_and_gradients(dtype, tol, monkeypatch):
    torch.manual_seed(0)
    frozen = FrozenTarget.of(make_tiny_llama(400).to(dtype))  # 4 query heads on 2 key-value heads
    head = Eagle3Head(frozen, DraftVocab.from_counts(Counter(), 50, 400)).to(dtype)
    layer_states = [torch.randn(2, 13, 64, dtype=dtype) for _ in range(3)]
    ids = torch.randint(0, 400, (2, 13))
    products, product_grads = _unrolled(head, layer_states, ids, 4)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, **kwargs):
        calls.append((q.shape[1] == k.shape[1], attn_mask.dtype == q.dtype, attn_mask.stride(-2) % 8 == 0))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    monkeypatch.setattr(eagle3, "ttt_attention", eagle3.ttt_sdpa)
    fused, fused_grads = _unrolled(head, layer_states, ids, 4)
    assert calls == [(True, True, True)] * 4
    for a, b in zip(fused, products, strict=True):
        assert torch.allclose(a, b, atol=tol, rtol=tol)
    assert fused_grads.keys() == product_grads.keys() and len(fused_grads) > 5
    for name in fused_grads:
        assert torch.allclose(fused_grads[name], product_grads[name], atol=tol, rtol=tol), name
