"""A decoder layer's weights as the native runtime multiplies them: fused, and on CPUs where it pays, packed.

Fusing: the q, k and v projections become one [q + 2 kv, H] tensor and the gate and up projections one
[2 I, H] tensor; the transformers modules' own weights become views into them, so nothing is held twice.

Packing (product "packed", chosen by measurement, runtime/choice.py): oneDNN's blocked layout for each
product's weight, which spares the re-layout torch's `F.linear` does on every call on CPU (measured on an
AMD EPYC with avx512_bf16: a [3072, 576] bf16 product of one row in 60 us instead of 171 us). The packed
tensor replaces the plain one: the transformers modules' weights are released (left on the meta device,
same shapes), so the memory is still held once. If transformers' own forward runs a packed layer later (a
reference comparison, a fallback path), a hook on the layer restores its plain weights first, exactly (a
product with the identity matrix), and the runtime packs them again the next time it runs. The LM head is
packed as a copy, because the embedding (tied heads) and drafting heads read its plain form.

The state lives on the transformers modules themselves, so two models that share layers (a truncated draft
model) share it too.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

STATE = "_mtptrain_runtime"


@dataclass
class Layer:
    norm_in: torch.Tensor
    qkv: torch.Tensor  # [q + 2 kv, H], or its packed form
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # Qwen3: [H + Hkv, D], the q-norm weight per query head, then the k-norm per key head
    out: torch.Tensor
    norm_post: torch.Tensor
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor
    packed: bool
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


def layer_weights(layer: nn.Module, packed: bool) -> Layer:
    """The layer's fused (and, with `packed`, packed) weights, built once and kept on the layer."""
    dtype = layer.post_attention_layernorm.weight.dtype
    state = layer.__dict__.get(STATE)
    if state is not None and (state.packed != packed or state.dtype != dtype or not _plain_current(layer, state)):
        restore(layer)
        state = None
        for module in _projections(layer):  # the model was cast since: plain weights restored in the old dtype
            if module.weight.dtype != dtype:
                module.weight.data = module.weight.data.to(dtype)
    if state is None:
        state = _build(layer, packed)
        layer.__dict__[STATE] = state
    return state


def _build(layer: nn.Module, packed: bool) -> Layer:
    attn, mlp = layer.self_attn, layer.mlp
    projections = [attn.q_proj, attn.k_proj, attn.v_proj]
    qkv, gate_up, out, down = _fuse(projections), _fuse([mlp.gate_proj, mlp.up_proj]), attn.o_proj.weight, \
        mlp.down_proj.weight
    if packed:
        qkv, gate_up, out, down = (pack(w) for w in (qkv, gate_up, out, down))
        for module in (*projections, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            module.weight = nn.Parameter(torch.empty(module.weight.shape, dtype=module.weight.dtype, device="meta"),
                                         requires_grad=module.weight.requires_grad)
        layer.__dict__[STATE + "_hook"] = layer.register_forward_pre_hook(lambda module, _args: restore(module))
    # A draft head's layer may have no input norm (EAGLE's original placement): norm_in is then None.
    return Layer(norm_in=getattr(layer.input_layernorm, "weight", None), qkv=qkv,
                 qkv_bias=_fuse(projections, "bias"), qk_norm=_qk_norm(attn),
                 out=out, norm_post=layer.post_attention_layernorm.weight, gate_up=gate_up, down=down,
                 packed=packed, dtype=layer.post_attention_layernorm.weight.dtype)


def layer_copy(layer: nn.Module, packed: bool) -> Layer:
    """The layer's runtime weights built from a copy of it, leaving its own modules untouched (trainable,
    callable): for a draft head's single layer, small enough that holding it twice costs nothing that matters."""
    with torch.inference_mode(False), torch.no_grad():
        return _build(copy.deepcopy(layer), packed)


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
    """An unpacked state still runs the module's weights (they were not replaced or moved since)."""
    if state.packed:
        return layer.self_attn.q_proj.weight.device.type == "meta"
    return layer.self_attn.q_proj.weight.data_ptr() == state.qkv.data_ptr() and \
        layer.mlp.gate_proj.weight.data_ptr() == state.gate_up.data_ptr() and \
        layer.self_attn.o_proj.weight.data_ptr() == state.out.data_ptr()


def restore(layer: nn.Module) -> None:
    """Give a layer back its plain weights (from the packed ones when they were released) and forget its
    runtime state; a runtime built on it packs again when it next runs."""
    state = layer.__dict__.pop(STATE, None)
    hook = layer.__dict__.pop(STATE + "_hook", None)
    if hook is not None:
        hook.remove()
    if state is None or not state.packed:
        return
    attn, mlp = layer.self_attn, layer.mlp
    inputs = lambda module: module.weight.shape[1]  # noqa: E731 (a released weight keeps its shape)
    with torch.inference_mode(False), torch.no_grad():
        plain = {attn.o_proj: unpack(state.out, inputs(attn.o_proj), state.dtype),
                 mlp.down_proj: unpack(state.down, inputs(mlp.down_proj), state.dtype)}
        for fused, modules in ((unpack(state.qkv, inputs(attn.q_proj), state.dtype), [attn.q_proj, attn.k_proj,
                                                                                       attn.v_proj]),
                               (unpack(state.gate_up, inputs(mlp.gate_proj), state.dtype), [mlp.gate_proj,
                                                                                             mlp.up_proj])):
            start = 0
            for module in modules:
                end = start + module.weight.shape[0]
                plain[module] = fused[start:end]
                start = end
        for module, weight in plain.items():
            module.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)


def lm_head_weights(model: nn.Module, packed: bool) -> torch.Tensor:
    """The LM head's weight, or its packed copy."""
    module = model.get_output_embeddings()
    return packed_copy(module) if packed else module.weight


def packed_copy(module: nn.Linear) -> torch.Tensor:
    """A packed copy of a linear module's weight, kept on the module beside the plain one and made again if the
    weight changed (the LM head's, shared by the runtime and the draft heads that call the module)."""
    key = (module.weight.data_ptr(), module.weight.dtype)
    kept = module.__dict__.get(STATE)
    if kept is None or kept[0] != key:
        kept = (key, pack(module.weight))
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
