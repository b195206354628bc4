"""The machine's fastest product for the linear layers of modules the runtime does not run itself: a draft
head's layers, a draft model's, and the target's under the transformers fallback.

Verification runs those layers over a handful of rows (the pending token and the draft). On CPU, torch's
`F.linear` re-lays out the weight on every call and, for 2 to ~16 rows, can take a GEMM path that costs
2-3 times a single-row product. `fast_linears(*models, product=...)` turns every CPU `nn.Linear` of `models`
into a `ProductLinear` for the duration of a `with` block: the same module (every reference to it sees the
change), its weight laid out for the product once, at its first short input (runtime/products.py), and
every short input multiplied by it.
"auto" is the product runtime/choice.py measured fastest on this machine for the modules' dtype. Inputs
with more than `max_rows` rows (a prefill) keep `F.linear`. Results equal it up to float rounding.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from mtptrain.runtime.choice import choose
from mtptrain.runtime.products import PRODUCTS, Product, runs_on


class ProductLinear(nn.Linear):
    """An `nn.Linear` whose inputs of up to `max_rows` rows go through `product` on its weight laid out once
    (`laid_out`, made at the first such input, so a module never called holds no copy; its weight must not
    change while it is a ProductLinear)."""

    product: Product
    max_rows: int
    laid_out: object

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // x.shape[-1] > self.max_rows:
            return F.linear(x, self.weight, self.bias)
        if self.laid_out is None:
            with torch.inference_mode(False), torch.no_grad():
                self.laid_out = self.product.lay_out(self.weight)
        return self.product(x, self.laid_out, self.bias)


def to_product_linears(*models: nn.Module, product: str, max_rows: int = 32) -> list[nn.Linear]:
    """Turn the CPU `nn.Linear` modules of `models` whose weights `product` multiplies into `ProductLinear`s;
    the modules turned (`to_plain_linears` turns them back; a process that only drafts keeps them)."""
    turned = []
    if product == "linear":
        return turned
    for module in (m for model in models for m in model.modules()):
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and runs_on(product, module.weight):
            module.__class__ = ProductLinear
            module.product, module.max_rows, module.laid_out = PRODUCTS[product], max_rows, None
            turned.append(module)
    return turned


def to_plain_linears(modules: list[nn.Linear]) -> None:
    for module in modules:
        module.__class__ = nn.Linear
        for name in ("product", "max_rows", "laid_out"):
            delattr(module, name)


@contextmanager
def fast_linears(*models: nn.Module, product: str = "skinny", max_rows: int = 32, enabled: bool = True):
    """Within the block, CPU linear layers of `models` compute short inputs with `product`."""
    turned = to_product_linears(*models, product=product, max_rows=max_rows) if enabled else []
    try:
        yield len(turned)
    finally:
        to_plain_linears(turned)


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
