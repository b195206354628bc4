"""A draft head's drafting steps on the runtime's kernels.

Drafting calls a head once per draft token, for one new position. Through transformers' modules each call builds a
mask, a rotary table and a cache update in Python around a dozen small products; here the head's single decoder
layer runs as the target's layers do (`runtime.model.LayerKernels`): fused q/k/v and gate/up products (packed for
oneDNN where this machine measured that faster), rotary tables built once, and a preallocated `KVCache` whose
rollback is a length change. The head's modules are left as they are (the stepper holds the runtime's copy of the
layer's weights, runtime/weights.py), so a head being trained can be stepped for validation.

Results equal the head's own forward up to float rounding (`tests/heads/test_fast_step.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from mtptrain.runtime.cache import KVCache
from mtptrain.runtime.attention import causal_mask, for_mask, row_attention
from mtptrain.runtime.choice import choose
from mtptrain.runtime.model import LayerKernels, RopeTables
from mtptrain.runtime.products import INT8, PRODUCTS, usable_product
from mtptrain.runtime.weights import layer_weights

INITIAL_CAPACITY = 512  # positions; the cache doubles when a generation outgrows it

# (feature [B, T, H], ids [B, T]) -> (the attention's input, already normed; the residual it is added to)
Inputs = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class Drafting:
    """What a head computes around its layer while drafting: `inputs` (above); `draft_input`, the feature [1, n, H]
    it drafts from out of the target's captured states (layer -> [n, H]); `output`, what a step returns of the
    layer's output (the state the next step reads; None: the output itself)."""

    inputs: Inputs
    draft_input: Callable[[dict[int, torch.Tensor]], torch.Tensor]
    output: Callable[[torch.Tensor], torch.Tensor] | None = None


class HeadStepper:
    """Runs a head's layer over new positions after those in its cache: `step(feature, ids)` is
    `head(feature, ids, cache=...)` for the head's KV cache, and `draft_input(hidden)` is the head's
    `draft_input(hidden, spec)`.

    A head may hand it `inputs`, `output` and `draft_input` built for drafting: its small norms and concatenations
    as a few fused operations on copies of its weights (Eagle3Head.stepper). Drafting runs right after a target
    forward that streamed every target weight through the caches, so each of a step's operations starts cold:
    on a 2-core AMD EPYC (avx512_bf16), a K=3 chain step's drafting took 2.54 ms right after a target forward
    against 1.65 ms back to back, and 2.03 ms with the fused operations (benchmarks/head_drafting.py)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, config, drafting: Callable[["HeadStepper"], Drafting], *,
                 lm_head: nn.Linear, logits_input: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 lm_head_for: Callable | None = None, int8: bool = False):
        """`drafting(self)` gives the head's `Drafting`, once the stepper knows its device, dtype and product
        (`lay_out`). `int8`: every product of the head (its layer, fc, LM head) from int8 weights with a scale
        per output feature (runtime/products.py, INT8) instead of this machine's product: half the bytes each
        drafting step reads, and drafts that may differ from the head's own (verification keeps the outputs
        exact)."""
        weight = layer.post_attention_layernorm.weight
        self.device, self.dtype = weight.device, weight.dtype
        choice = choose(config, self.device, str(self.dtype).removeprefix("torch."))
        choice = dataclasses.replace(choice, product=usable_product(choice.product, self.dtype))
        self.choice = choice
        product = INT8 if int8 else PRODUCTS[choice.product]
        self.layer = layer_weights(layer, product)  # the runtime's copy: the modules stay as they are
        self.kernels = LayerKernels(config, product, row_attention(choice.attention_one),
                                    row_attention(choice.attention_many))
        self.rope = RopeTables(rotary, self.dtype, self.device)
        k = self.kernels
        self.cache = KVCache(1, 1, k.kv_heads, k.head_dim, INITIAL_CAPACITY, choice.cache_dtype, self.device)
        drafting = drafting(self)
        self.inputs, self.draft_input, self.output = drafting.inputs, drafting.draft_input, drafting.output
        # The LM head `logits` multiplies, on the same product as the layer, in its layout: packed, a one-row
        # product over an 8,192-token draft vocabulary takes 69 us instead of 243 us (AMD EPYC, avx512_bf16),
        # three times a chain step at K=3. A head's own LM head is laid out as it is now (a head being trained
        # gets a new stepper after each change); the target's frozen one, shared, once (`lm_head_for`).
        self.logits_input = logits_input
        self.lm_head_dtype, self.lm_head_device = lm_head.weight.dtype, lm_head.weight.device
        if lm_head_for is not None:
            self.lm_head = lm_head_for(product)
        else:
            with torch.inference_mode(False), torch.no_grad():
                self.lm_head = product.lay_out(lm_head.weight)  # the plain products read the weight itself

    def lay_out(self, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """x -> x @ weight.T on this stepper's product, `weight` [out, in] laid out now (a copy where the product
        lays out; the plain products read the weight itself)."""
        product = self.kernels.product
        with torch.inference_mode(False), torch.no_grad():
            laid_out = product.lay_out(weight.detach().to(self.device, self.dtype))
        return lambda x: product(x, laid_out, None)

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """Logits over the head's vocabulary from what a step returned: the head's own `logits`, up to float
        rounding."""
        x = state if self.logits_input is None else self.logits_input(state)
        # the target's LM head sits on the last GPU of a split target, the head with its embedding on the first
        logits = self.kernels.product(x.to(self.lm_head_device, self.lm_head_dtype), self.lm_head, None)
        return logits.to(x.device)

    @property
    def length(self) -> int:
        return self.cache.length

    def rollback(self, length: int) -> None:
        """Keep the first `length` cached positions."""
        self.cache.length = min(length, self.cache.length)

    def step(self, feature: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor | None = None,
             seen: torch.Tensor | None = None) -> torch.Tensor:
        """The head's output [1, T, H] for features [1, T, H] and the tokens after them, appended after the
        cached positions: at the next T positions under causal attention, or at `positions` [1, T] under `seen`
        [1, 1, T, cached + T] (True = attended; a draft tree's nodes)."""
        start, count = self.cache.length, ids.shape[1]
        self.cache.reserve(start + count)
        if positions is None:  # the next positions: views of the rotary tables
            cos, sin = self.rope.span(start, count)
        else:
            cos, sin = self.rope(positions, start + count)  # a bound known on the host: no wait for the device
        h, residual = self.inputs(feature, ids)
        causal = seen is None and count > 1 and (start == 0 or self.kernels.causal_after_cache)
        if seen is None and count > 1 and not causal:
            seen = causal_mask(count, start, ids.device)[None, None]
        out = self.kernels.run(self.layer, h, residual, cos[:, :, None], sin[:, :, None], self.cache, 0, start,
                               seen, causal, for_mask(self.kernels.attention_for(count), seen))
        self.cache.length = start + count
        return out if self.output is None else self.output(out)
