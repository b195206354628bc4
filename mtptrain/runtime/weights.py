"""A decoder layer's weights as the native runtime multiplies them: fused, and on CPUs where it pays, laid out
for the product once.

Fusing: the q, k and v projections become one [q + 2 kv, H] tensor and the gate and up projections one
[2 I, H] tensor; the transformers modules' own weights become views into them, so nothing is held twice.

Layouts (the product's, chosen by measurement, runtime/choice.py):
- "plain": the modules' own [out, in] tensors;
- "packed": oneDNN's blocked layout, which spares the re-layout torch's `F.linear` does on every call on CPU
  (measured on an AMD EPYC with avx512_bf16: a [3072, 576] bf16 product of one row in 60 us instead of
  171 us);
- "native": the runtime's own blocks of 32 output features (`blocked`), which csrc/blocked_linear.cpp reads
  front to back.
A laid-out tensor replaces the plain one: the transformers modules' weights are released (left on the meta
device, same shapes), so the memory is still held once. If transformers' own forward runs such a layer later
(a reference comparison, a fallback path), a hook on the layer restores its plain weights first, exactly (a
product with the identity matrix, or the blocks put back in place), and the runtime lays them out again the
next time it runs. The LM head is laid out as a copy, because the embedding (tied heads) and drafting heads
read its plain form.

The state lives on the transformers modules themselves, so two models that share layers (a truncated draft
model) share it too.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from mtptrain.runtime.native_kernels import BLOCK, blocked_linear_kernel

STATE = "_mtptrain_runtime"


@dataclass
class Layer:
    norm_in: torch.Tensor
    qkv: torch.Tensor  # [q + 2 kv, H], or its laid-out form
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # Qwen3: [H + Hkv, D], the q-norm weight per query head, then the k-norm per key head
    out: torch.Tensor
    norm_post: torch.Tensor
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor
    layout: str  # "plain", "packed" or "native"
    dtype: torch.dtype


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) with W in oneDNN's packed layout."""
    shape = x.shape
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), weight, bias, "none", [], "")
    return out.reshape(*shape[:-1], out.shape[-1])


def unpack(weight: torch.Tensor, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The plain [out, in] weight back from its packed form: I @ W.T is W.T exactly (one nonzero per sum)."""
    eye = torch.eye(in_features, dtype=dtype)
    return packed_product(eye, weight, None).T.contiguous()


@dataclass(frozen=True)
class Blocked:
    """A weight [out_features, in_features] in the runtime's blocked layout: blocks [G, KP, 32, P] with
    blocks[g, p, i, e] = W[32 g + i, P p + e] (zero past the weight), P = 2 inputs per step in bfloat16 and 1 in
    float32 (csrc/blocked_linear.cpp says why)."""
    blocks: torch.Tensor
    out_features: int
    in_features: int

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks.dtype


def _pairs(dtype: torch.dtype) -> int:
    return 2 if dtype == torch.bfloat16 else 1


def blocked(weight: torch.Tensor) -> Blocked:
    """`weight` [out, in] laid out in blocks of BLOCK output features (a new tensor; the weight is not kept)."""
    out_features, in_features = weight.shape
    step = _pairs(weight.dtype)
    groups, steps = -(-out_features // BLOCK), -(-in_features // step)
    padded = weight.detach().new_zeros(groups * BLOCK, steps * step)
    padded[:out_features, :in_features] = weight.detach()
    blocks = padded.view(groups, BLOCK, steps, step).permute(0, 2, 1, 3).contiguous()
    return Blocked(blocks, out_features, in_features)


def unblocked(weight: Blocked) -> torch.Tensor:
    """The plain [out, in] weight back from its blocks, exactly (the same values, put back in place)."""
    groups, steps, block, step = weight.blocks.shape
    plain = weight.blocks.permute(0, 2, 1, 3).reshape(groups * block, steps * step)
    return plain[: weight.out_features, : weight.in_features].contiguous()


def blocked_product(x: torch.Tensor, weight: Blocked, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) with W in the blocked layout, by csrc/blocked_linear.cpp; where that kernel has no
    product for x (another dtype than the blocks', a GPU, a CPU without the instructions), by `F.linear` on the
    weight put back (slow: the runtime lays weights out this way only where the kernel runs)."""
    kernel = blocked_linear_kernel(x.dtype) if x.device.type == "cpu" and x.dtype == weight.dtype else None
    if kernel is None:
        return nn.functional.linear(x, unblocked(weight).to(x.dtype), bias)
    return kernel(x, weight.blocks, bias, weight.out_features)


LAYOUT = {"packed": pack, "native": blocked}  # plain [out, in] -> the layout


def _plain(weight, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """A laid-out weight's plain form, exactly."""
    return unblocked(weight) if isinstance(weight, Blocked) else unpack(weight, in_features, dtype)


def layout_of(product: str) -> str:
    """The weights' layout a product reads: packed for oneDNN's, native for the runtime's, else plain."""
    return product if product in LAYOUT else "plain"


def layer_weights(layer: nn.Module, layout: str) -> Layer:
    """The layer's fused weights in `layout` ("plain", "packed" or "native"), built once and kept on the layer."""
    dtype = layer.post_attention_layernorm.weight.dtype
    state = layer.__dict__.get(STATE)
    if state is not None and (state.layout != layout or state.dtype != dtype or not _plain_current(layer, state)):
        restore(layer)
        state = None
        for module in _projections(layer):  # the model was cast since: plain weights restored in the old dtype
            if module.weight.dtype != dtype:
                module.weight.data = module.weight.data.to(dtype)
    if state is None:
        state = _build(layer, layout)
        layer.__dict__[STATE] = state
    return state


def _build(layer: nn.Module, layout: str) -> Layer:
    attn, mlp = layer.self_attn, layer.mlp
    projections = [attn.q_proj, attn.k_proj, attn.v_proj]
    qkv, gate_up, out, down = _fuse(projections), _fuse([mlp.gate_proj, mlp.up_proj]), attn.o_proj.weight, \
        mlp.down_proj.weight
    if layout != "plain":
        qkv, gate_up, out, down = (LAYOUT[layout](w) for w in (qkv, gate_up, out, down))
        for module in (*projections, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            module.weight = nn.Parameter(torch.empty(module.weight.shape, dtype=module.weight.dtype, device="meta"),
                                         requires_grad=module.weight.requires_grad)
        layer.__dict__[STATE + "_hook"] = layer.register_forward_pre_hook(lambda module, _args: restore(module))
    # A draft head's layer may have no input norm (EAGLE's original placement): norm_in is then None.
    return Layer(norm_in=getattr(layer.input_layernorm, "weight", None), qkv=qkv,
                 qkv_bias=_fuse(projections, "bias"), qk_norm=_qk_norm(attn),
                 out=out, norm_post=layer.post_attention_layernorm.weight, gate_up=gate_up, down=down,
                 layout=layout, dtype=layer.post_attention_layernorm.weight.dtype)


def layer_copy(layer: nn.Module, layout: str) -> Layer:
    """The layer's runtime weights built from a copy of it, leaving its own modules untouched (trainable,
    callable): for a draft head's single layer, small enough that holding it twice costs nothing that matters."""
    with torch.inference_mode(False), torch.no_grad():
        return _build(copy.deepcopy(layer), layout)


def _qk_norm(attn: nn.Module) -> torch.Tensor | None:
    """Qwen3's per-head q and k norm weights stacked for q and k rotated as one tensor (None without norms)."""
    if not hasattr(attn, "q_norm"):
        return None
    heads, kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
    return torch.cat([attn.q_norm.weight.detach().expand(heads, -1), attn.k_norm.weight.detach().expand(kv_heads, -1)])


def _projections(layer: nn.Module) -> list[nn.Linear]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]


def _plain_current(layer: nn.Module, state: Layer) -> bool:
    """A plain state still runs the module's weights (they were not replaced or moved since)."""
    if state.layout != "plain":
        return layer.self_attn.q_proj.weight.device.type == "meta"
    return layer.self_attn.q_proj.weight.data_ptr() == state.qkv.data_ptr() and \
        layer.mlp.gate_proj.weight.data_ptr() == state.gate_up.data_ptr() and \
        layer.self_attn.o_proj.weight.data_ptr() == state.out.data_ptr()


def restore(layer: nn.Module) -> None:
    """Give a layer back its plain weights (from the laid-out ones when they were released) and forget its
    runtime state; a runtime built on it lays them out again when it next runs."""
    state = layer.__dict__.pop(STATE, None)
    hook = layer.__dict__.pop(STATE + "_hook", None)
    if hook is not None:
        hook.remove()
    if state is None or state.layout == "plain":
        return
    attn, mlp = layer.self_attn, layer.mlp
    inputs = lambda module: module.weight.shape[1]  # noqa: E731 (a released weight keeps its shape)
    with torch.inference_mode(False), torch.no_grad():
        plain = {attn.o_proj: _plain(state.out, inputs(attn.o_proj), state.dtype),
                 mlp.down_proj: _plain(state.down, inputs(mlp.down_proj), state.dtype)}
        for fused, modules in ((_plain(state.qkv, inputs(attn.q_proj), state.dtype), [attn.q_proj, attn.k_proj,
                                                                                       attn.v_proj]),
                               (_plain(state.gate_up, inputs(mlp.gate_proj), state.dtype), [mlp.gate_proj,
                                                                                             mlp.up_proj])):
            start = 0
            for module in modules:
                end = start + module.weight.shape[0]
                plain[module] = fused[start:end]
                start = end
        for module, weight in plain.items():
            module.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)


def lm_head_weights(model: nn.Module, layout: str):
    """The LM head's weight, or its laid-out copy."""
    module = model.get_output_embeddings()
    return module.weight if layout == "plain" else laid_out_copy(module, layout)


def laid_out_copy(module: nn.Linear, layout: str = "packed"):
    """A copy of a linear module's weight in `layout` ("packed" or "native"), kept on the module beside the plain
    one and made again if the weight changed (the LM head's, shared by the runtime and the draft heads that call
    the module)."""
    key = (module.weight.data_ptr(), module.weight.dtype, layout)
    kept = module.__dict__.get(STATE)
    if kept is None or kept[0] != key:
        kept = (key, LAYOUT[layout](module.weight))
        module.__dict__[STATE] = kept
    return kept[1]


def _fuse(modules: list[nn.Linear], attribute: str = "weight") -> torch.Tensor | None:
    """One tensor holding the modules' weights (or biases) one after another; each module's own tensor becomes
    a view into it. Weights fused before are used where they are."""
    parts = [getattr(m, attribute) for m in modules]
    if any(p is None for p in parts):
        return None
    rows = sum(p.shape[0] for p in parts)
    if _adjacent(parts):
        return parts[0].detach().as_strided((rows, *parts[0].shape[1:]), parts[0].stride())
    fused = torch.cat([p.detach() for p in parts])
    _split(fused, modules, attribute)
    return fused


def _split(fused: torch.Tensor, modules: list[nn.Linear], attribute: str = "weight") -> None:
    """Point each module's tensor at its rows of `fused`."""
    start = 0
    for module in modules:
        part = getattr(module, attribute)
        end = start + part.shape[0]
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
