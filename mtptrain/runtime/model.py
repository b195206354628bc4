"""The target's decoder as one plain forward: fused products, a preallocated KV cache, SDPA.

`FastDecoder(model, choice, product)` reads the weights of a transformers Llama-family model (Llama 2/3,
SmolLM, Mistral, Qwen2 with its q/k/v biases, Qwen3 with its q/k norms) into its own (runtime/weights.py) and
runs the same computation in a few tensor operations per layer:

- the q, k and v projections are one product, and so are the gate and up projections (runtime/products.py);
- keys and values go to a cache the decoder writes to and attends over through one protocol
  (`runtime/cache.py`: `KVCache` for one sequence, a batched step's bands in runtime/batch.py);
- rotary tables are computed once, by the model's own rotary module (every static rope scaling it knows);
- short inputs use the products and attention kernels this machine runs fastest (`runtime/choice.py`).

`unsupported(model)` says why a model cannot run here (another architecture, a rope scaling that
changes with the length, an attention that is not plain softmax); the runner then keeps transformers.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from mtptrain.runtime.attention import (batch_attention, batch_mask, causal_mask, for_mask, layer_mask,
                                        row_attention, usable)
from mtptrain.runtime.cache import Attends
from mtptrain.runtime.native_kernels import layer_ops, prefetch_from_kernel, step_attention_kernel
from mtptrain.runtime.products import PRODUCTS
from mtptrain.runtime.weights import layer_weights

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
STATIC_ROPE = (None, "default", "linear", "llama3", "yarn", "longrope")


def unsupported(model: nn.Module) -> str | None:
    """Why `model` cannot run on the fast decoder, or None when it can."""
    config = model.config
    if config.model_type not in SUPPORTED:
        return f"model_type {config.model_type} (the native runtime runs {', '.join(SUPPORTED)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act}"
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if kind not in STATIC_ROPE:
        return f"rope scaling {kind!r}, which changes with the sequence length"
    if getattr(config, "attention_dropout", 0.0) or getattr(config, "pretraining_tp", 1) != 1:
        return "attention dropout or pretraining_tp"
    decoder = model.get_decoder()
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1 or next(iter(devices)).type == "meta":
        return "the model is split over several devices or not loaded"
    if not all(hasattr(layer.self_attn, "q_proj") and hasattr(layer.mlp, "gate_proj") for layer in decoder.layers):
        return "layers without q/k/v and gate/up projections"
    return None


class RopeTables:
    """cos, sin [B, T, D] for positions [B, T], from tables a model's rotary module fills once (and again,
    twice as long, when a position outruns them)."""

    def __init__(self, rotary: nn.Module, dtype: torch.dtype, device: torch.device):
        self.rotary, self.dtype, self.device = rotary, dtype, device
        self._cos = self._sin = None

    def __call__(self, positions: torch.Tensor, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`bound`: a number above every position, known on the host (a cache's end): reading the largest position
        from the tensor instead waits for the GPU on every forward, which stops the host queueing work ahead."""
        self._cover(bound if bound is not None else int(positions.max()) + 1)
        return self._cos[positions], self._sin[positions]

    def span(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, count, D] for the positions start .. start + count - 1: views of the tables, where
        `__call__` gathers rows into new tensors."""
        self._cover(start + count)
        return self._cos[None, start:start + count], self._sin[None, start:start + count]

    def _cover(self, needed: int) -> None:
        """Tables of at least `needed` positions."""
        if self._cos is None or self._cos.shape[0] < needed:
            size = max(needed, 2 * (0 if self._cos is None else self._cos.shape[0]), 4096)
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = self.rotary(probe, torch.arange(size, device=self.device)[None])
            self._cos, self._sin = cos[0], sin[0]


class LayerKernels:
    """One decoder layer's attention and MLP on given products and attention kernels: the target's layers run
    here, and so does a draft head's single layer (mtptrain/heads/fast.py)."""

    def __init__(self, config, product, attention_one, attention_many, attention_batch=None):
        self.product = product  # (x [..., in], weight [out, in], bias) -> [..., out]
        self.attention_one, self.attention_many = attention_one, attention_many  # (q, k, v, mask, causal)
        self.attention_batch = attention_batch or attention_one  # one new token in each of many rows
        # True where the kernel for several tokens takes `causal` with cached positions before them (new tokens
        # last, each seeing the cache and the new ones up to itself), so a chain needs no mask
        self.causal_after_cache = getattr(attention_many, "causal_after_cache", False)
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps

    def attention_for(self, count: int, batched: bool = False):
        if count > 1:
            return self.attention_many
        return self.attention_batch if batched else self.attention_one

    def run(self, layer, h: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            cache: Attends, index: int, start: int, mask: torch.Tensor | None, causal: bool, attention,
            next_norm: torch.Tensor | None = None):
        """residual + attention(h) and then the MLP block, for h [B, T, in] (the attention's input, already
        normed), with keys and values written to layer `index` of the cache at [start, start + T). With
        `next_norm` (the next layer's input norm weight), also the next layer's input: (x, RMSNorm(x) * it),
        computed in the same pass as the MLP's residual sum."""
        batch, count = h.shape[:2]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        qkv = self.product(h, layer.qkv, layer.qkv_bias)
        # q and k as one [B, T, H + Hkv, D] tensor: their norms (Qwen3) and rotations in one pass each
        qk = qkv[..., : q_size + kv_size].view(batch, count, self.heads + self.kv_heads, self.head_dim)
        v = qkv[..., q_size + kv_size :].view(batch, count, self.kv_heads, self.head_dim).transpose(1, 2)
        if layer.qk_norm is not None:
            qk = F.rms_norm(qk, (self.head_dim,), None, self.eps) * layer.qk_norm
        qk = rope(qk, cos, sin)
        q, k = qk[:, :, : self.heads].transpose(1, 2), qk[:, :, self.heads :].transpose(1, 2)
        attended = cache.attend(index, q, k, v, self, start, mask, causal, attention)
        attended = attended.transpose(1, 2).reshape(batch, count, q_size)
        x, h = add_rms_norm(residual, self.product(attended, layer.out, None), layer.norm_post, self.eps)
        mlp = self.product(silu_mul(self.product(h, layer.gate_up, None)), layer.down, None)
        return x + mlp if next_norm is None else add_rms_norm(x, mlp, next_norm, self.eps)


class FastDecoder:
    """The decoder stack and LM head of one model on the runtime's own weights, read from the model once, in the
    layout of `product` (a key of runtime/products.py's PRODUCTS) and with the attention kernels of `choice` (the
    measured runtime/choice.py Choice); `forward` runs new tokens against a cache. The model's embedding, norms
    and plain LM head are read where they lie (the heads read them too); a model cast or moved afterwards needs
    a new decoder."""

    def __init__(self, model: nn.Module, choice, product: str):
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"the native runtime cannot run this model: {why}")
        config, decoder = model.config, model.get_decoder()
        self.config = config
        self.choice = choice
        self.product = product
        self.kernels = LayerKernels(config, PRODUCTS[product], row_attention(choice.attention_one),
                                    row_attention(choice.attention_many), batch_attention(choice.attention_batch))
        self.eps = config.rms_norm_eps
        self.window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        self.embed = decoder.embed_tokens.weight.detach()
        self.norm = decoder.norm.weight.detach()
        # Built outside inference mode, so that the model stays usable where autograd runs later (the modules'
        # weights may be pointed at the fused tensors, and inference tensors cannot enter a recorded graph).
        with torch.inference_mode(False), torch.no_grad():
            self.lm_head = PRODUCTS[product].lay_out(model.get_output_embeddings().weight.detach())
            self.layers = [layer_weights(layer, product, share=True) for layer in decoder.layers]
        self.rope = RopeTables(decoder.rotary_emb, self.dtype, self.device)
        # the fewest rows of a product's pass that prefetches its weights, set before each forward (process-wide in
        # the kernels); None leaves it as it is. runtime/runner.py's load_decoder sets it (runtime/prefetch.py).
        self.prefetch_from: int | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def truncated(self, layers: int) -> "FastDecoder":
        """This decoder cut to its first `layers` layers, sharing every tensor (a draft model that costs no memory:
        engine/draft_model.py)."""
        total = len(self.layers)
        if not 1 <= layers < total:
            raise ValueError(f"a truncated target keeps 1..{total - 1} of its {total} layers, not {layers}")
        cut = copy.copy(self)
        cut.layers = self.layers[:layers]
        return cut

    def describe(self) -> str:
        """The dtype and kernels it runs with, for reports."""
        prefetch = "" if self.prefetch_from is None else f", prefetch from {self.prefetch_from} rows"
        return self.choice.describe() + prefetch

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's dtype: float32 where the measured attention kernel reads a float32 cache."""
        return self.choice.cache_dtype

    @property
    def batch_cache_dtype(self) -> torch.dtype:
        """The KV cache's dtype of batched decoding (runtime/batch.py): what the batch attention kernel reads."""
        return self.choice.batch_cache_dtype

    def batch_mask(self, seen: torch.Tensor) -> torch.Tensor:
        """The mask [B, 1, 1, S] (True = seen) of a batched step, in the form its attention kernel reads fastest."""
        return batch_mask(seen, self.choice.attention_batch, self.dtype)

    @property
    def step_kernel(self):
        """The fused kernel that writes and attends a length band's part of a batched step in one call
        (`native_kernels.step_attention_kernel`) where the measured batch kernel is the fused one, else None."""
        if usable(self.choice.attention_batch) != "fused":
            return None
        return step_attention_kernel()

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def kv_heads(self) -> int:
        return self.kernels.kv_heads

    @property
    def head_dim(self) -> int:
        return self.kernels.head_dim

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: Attends, start: int,
                mask: torch.Tensor | None,
                capture: tuple[int, ...] = (), last_only: bool = False, logits: bool = True,
                logits_for: int | None = None) -> tuple[torch.Tensor | None, dict]:
        """Logits [B, T, V] (or [B, 1, V] with `last_only`, [B, logits_for, V] with `logits_for`: the first tokens'
        only; None without `logits`) for ids [B, T] at `positions` [B, T], whose keys and values are written to
        the cache at [start, start + T) (`NoCache`: a forward over these tokens alone); `mask` [B, 1, T, start + T]
        (True = seen) or None for plain causal attention over everything cached. Also the states after each
        layer of `capture`. A cache that masks itself (a step of batched decoding, runtime/batch.py) writes and
        attends the tokens with its own masks and kernels."""
        batch, count = ids.shape
        if self.prefetch_from is not None:
            prefetch_from_kernel()(self.prefetch_from)
        x = F.embedding(ids, self.embed)
        end = cache.end(start, count)  # every position is below it
        cos, sin = self.rope(positions, end)
        cos, sin = cos[:, :, None], sin[:, :, None]  # [B, T, 1, D]: broadcast over heads
        parted = cache.masks_itself
        if self.window is not None and end > self.window:
            raise ValueError(f"context of {end} tokens is longer than the model's sliding window ({self.window}): "
                             "the fast decoder keeps full attention only")
        causal = not parted and mask is None and count > 1 and (start == 0 or self.kernels.causal_after_cache)
        if not parted and mask is None and count > 1 and not causal:
            mask = causal_mask(count, start, ids.device)[None, None]
        attention = for_mask(self.kernels.attention_for(count), mask)
        if not parted and mask is not None and mask.dtype == torch.bool:
            mask = layer_mask(mask, self.choice.attention_many if count > 1 else self.choice.attention_one,
                              self.dtype)
        captured = {}
        h = rms_norm(x, self.layers[0].norm_in, self.eps)
        for index, layer in enumerate(self.layers):
            if index + 1 < len(self.layers):
                x, h = self.kernels.run(layer, h, x, cos, sin, cache, index, start, mask, causal, attention,
                                        self.layers[index + 1].norm_in)
            else:
                x = self.kernels.run(layer, h, x, cos, sin, cache, index, start, mask, causal, attention)
            if index in capture:
                captured[index] = x
        if not logits:
            return None, captured
        if last_only:
            x = x[:, -1:]
        elif logits_for is not None:
            x = x[:, :logits_for]
        x = rms_norm(x, self.norm, self.eps)
        return self.kernels.product(x, self.lm_head, None), captured


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The rotary embedding's partner of x: its halves swapped, the first negated (x * cos + this * sin)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# A decoder layer's elementwise steps, each one pass of the runtime's C++ (csrc/layer_ops.cpp) for float32 and
# bfloat16 tensors on the CPU, torch's operations otherwise (a GPU, float64 and float16, or no compiler here).
# Both round where torch's operations round, so they differ by the order of a sum and the last bit of an exp.
# Measured on a 2-core AMD EPYC, 160 rows of SmolLM2-135M in bfloat16: an RMSNorm 79 us, an add 16 us, the
# rotary embedding 102 us and silu(gate) * up 137 us through torch (see docs/runtime.md for the fused ones).
NATIVE = (torch.float32, torch.bfloat16)


def _native(x: torch.Tensor):
    return layer_ops() if x.device.type == "cpu" and x.dtype in NATIVE else None


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x = residual + delta, and RMSNorm(x) * weight over the last dimension."""
    ops = _native(residual)
    if ops is not None and delta.dtype == residual.dtype == weight.dtype:
        return ops.add_rms_norm(residual, delta, weight, eps)
    x = residual + delta
    return x, F.rms_norm(x, (x.shape[-1],), weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight (None: no weight) over the last dimension: `F.rms_norm`, bit for bit, in one pass."""
    ops = _native(x)
    if ops is not None and (weight is None or weight.dtype == x.dtype):
        return ops.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
    ops = _native(gate_up)
    if ops is not None:
        return ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x [B, T, heads, D] and cos, sin [B, T, 1, D]."""
    ops = _native(x)
    if ops is not None and cos.dtype == x.dtype and x.stride(-1) == 1:
        return ops.rope(x, cos, sin)
    return x * cos + rotate_half(x) * sin

