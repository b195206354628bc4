"""The load step: a decoder's weights as the runtime holds them, fused once and laid out for its product.

The q, k and v projections become one [q + 2 kv, H] tensor and the gate and up projections one [2 I, H]
tensor, read from the state of a transformers decoder (its modules' tensors, nothing else of them), then laid
out once for the product the machine measured fastest (runtime/products.py). The runtime's tensors are its
own: nothing is kept on, hooked into or released from the transformers modules.

Memory: under a product that reads the plain layout ("linear", "skinny": every GPU, and CPUs where those win)
the fused tensors are the model's memory itself, because `share_fused` points the modules' own weights at
their rows of them (the same values; transformers' forward runs on them unchanged), so a model and its
decoders hold each weight once. Under a laid-out product ("packed", "native") the decoder holds the laid-out
copy beside the model's plain weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mtptrain.runtime.products import PRODUCTS, Product


@dataclass
class Layer:
    norm_in: torch.Tensor | None  # None: a draft head's layer without an input norm (EAGLE's original placement)
    qkv: torch.Tensor  # [q + 2 kv, H], or its laid-out form
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # Qwen3: [H + Hkv, D], the q-norm weight per query head, then the k-norm per key head
    out: torch.Tensor
    norm_post: torch.Tensor
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor


def layer_weights(layer: nn.Module, product: str | Product, share: bool = False) -> Layer:
    """A decoder layer's weights for `product` (a key of PRODUCTS, or a Product: a draft head's INT8), read from
    its modules. With `share`, the fused plain tensors become the modules' own memory (`share_fused`: a target's
    layers); without, the modules are left exactly as they are (a draft head being trained, whose modules keep
    their own tensors)."""
    attn, mlp = layer.self_attn, layer.mlp
    projections = [attn.q_proj, attn.k_proj, attn.v_proj]
    with torch.inference_mode(False), torch.no_grad():
        qkv, gate_up = _fused(projections), _fused([mlp.gate_proj, mlp.up_proj])
        bias = _fused(projections, "bias")
        if share:
            share_fused(qkv, projections)
            share_fused(gate_up, [mlp.gate_proj, mlp.up_proj])
            if bias is not None:
                share_fused(bias, projections, "bias")
        lay_out = (PRODUCTS[product] if isinstance(product, str) else product).lay_out
        return Layer(norm_in=getattr(layer.input_layernorm, "weight", None), qkv=lay_out(qkv), qkv_bias=bias,
                     qk_norm=_qk_norm(attn), out=lay_out(attn.o_proj.weight.detach()),
                     norm_post=layer.post_attention_layernorm.weight.detach(), gate_up=lay_out(gate_up),
                     down=lay_out(mlp.down_proj.weight.detach()))


def _qk_norm(attn: nn.Module) -> torch.Tensor | None:
    """Qwen3's per-head q and k norm weights stacked for q and k rotated as one tensor (None without norms)."""
    if not hasattr(attn, "q_norm"):
        return None
    heads, kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
    return torch.cat([attn.q_norm.weight.detach().expand(heads, -1), attn.k_norm.weight.detach().expand(kv_heads, -1)])


def _fused(modules: list[nn.Linear], attribute: str = "weight") -> torch.Tensor | None:
    """One tensor holding the modules' weights (or biases) one after another: the memory they already share
    when they follow one another in one storage (fused before), else a new tensor."""
    parts = [getattr(m, attribute) for m in modules]
    if any(p is None for p in parts):
        return None
    rows = sum(p.shape[0] for p in parts)
    if _adjacent(parts):
        return parts[0].detach().as_strided((rows, *parts[0].shape[1:]), parts[0].stride())
    return torch.cat([p.detach() for p in parts])


def share_fused(fused: torch.Tensor, modules: list[nn.Linear], attribute: str = "weight") -> None:
    """Point each module's tensor at its rows of `fused` (the same values), so the two hold one memory."""
    start = 0
    for module in modules:
        part = getattr(module, attribute)
        end = start + part.shape[0]
        if part.data_ptr() != fused[start:end].data_ptr():
            part.data = fused[start:end]
        start = end


def _adjacent(parts: list[torch.Tensor]) -> bool:
    """The tensors are contiguous and follow one another in one storage."""
    if not all(p.is_contiguous() and p.device.type != "meta" for p in parts):
        return False
    storage = parts[0].untyped_storage().data_ptr()
    for a, b in zip(parts, parts[1:]):
        if b.untyped_storage().data_ptr() != storage or b.data_ptr() != a.data_ptr() + a.numel() * a.element_size():
            return False
    return True
