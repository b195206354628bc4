"""The machine's fastest product for the linear layers of modules the runtime does not run itself: a draft
head's layers, a draft model's, and the target's under the transformers fallback.

Verification runs those layers over a handful of rows (the pending token and the draft). On CPU, torch's
`F.linear` re-lays out the weight on every call and, for 2 to ~16 rows, can take a GEMM path that costs
2-3 times a single-row product. `fast_linears(*models, product=...)` swaps the forward of every CPU
`nn.Linear` of `models` for the duration of a `with` block:

- "skinny": short inputs as `W @ x.T` (measured with PyTorch 2.13 / MKL on an AVX2 machine: the 49152 x 576
  LM head of SmolLM2 takes 8.6 ms for one row, 19-28 ms for two to four rows, and 5 ms as `W @ x.T`);
- "packed": the weight packed once for oneDNN (runtime/weights.py; the packed copy is kept on the module,
  beside the plain weight, and shared with the runtime's own packed LM head);
- "native": the runtime's own product (csrc/blocked_linear.cpp) on a copy of the weight in its blocked
  layout, kept on the module like the packed one;
- "linear": torch's stock path (nothing is swapped).

"auto" is the product runtime/choice.py measured fastest on this machine for the modules' dtype. Inputs
with more than `max_rows` rows (a prefill) keep the stock path. Results equal the stock path up to float
rounding.
"""

from __future__ import annotations

import types
from contextlib import contextmanager

import torch
from torch import nn

from mtptrain.runtime.choice import choose
from mtptrain.runtime.native_kernels import blocked_linear_kernel
from mtptrain.runtime.weights import blocked_product, laid_out_copy, packed_product

PACKABLE = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes oneDNN packs


def _forward(product: str, max_rows: int):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > max_rows:
            return nn.functional.linear(x, self.weight, self.bias)
        if product == "packed":
            if self.weight.dtype not in PACKABLE:
                return nn.functional.linear(x, self.weight, self.bias)
            return packed_product(x, laid_out_copy(self, "packed"), self.bias)
        if product == "native":
            if blocked_linear_kernel(self.weight.dtype) is None or x.dtype != self.weight.dtype:
                return nn.functional.linear(x, self.weight, self.bias)
            return blocked_product(x, laid_out_copy(self, "native"), self.bias)
        out = torch.matmul(self.weight, x.reshape(rows, x.shape[-1]).T).T
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.weight.shape[0])
    return forward


def product_for(setting: str, model: nn.Module, config=None) -> str:
    """A cpu_matmul setting (auto, skinny, packed, stock) as the product for `model`'s linear layers: "linear"
    (nothing swapped) off the CPU or for stock; for auto, what runtime/choice.py measured fastest on this CPU for
    the model's dtype, on the shapes of `config` (the target's; the model's own by default)."""
    weight = next(model.parameters())
    if weight.device.type != "cpu" or setting == "stock":
        return "linear"
    if setting != "auto":
        return setting
    return choose(config or model.config, torch.device("cpu"), str(weight.dtype).removeprefix("torch.")).product


@contextmanager
def fast_linears(*models: nn.Module, product: str = "skinny", max_rows: int = 32, enabled: bool = True):
    """Within the block, CPU linear layers of `models` compute short inputs with `product`."""
    patched = []
    if enabled and product != "linear":
        forward = _forward(product, max_rows)
        for module in (m for model in models for m in model.modules()):
            if isinstance(module, nn.Linear) and module.weight.device.type == "cpu" and "forward" not in vars(module):
                module.forward = types.MethodType(forward, module)
                patched.append(module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward  # back to the class's forward
