"""Faster linear layers for speculative verification on CPU.

Verification runs the target over a handful of tokens (the pending one and
the draft). On CPU, torch's `F.linear` for 2 to ~16 input rows goes through a
GEMM path that costs up to 2-3 times a single-row product (measured with
PyTorch 2.13 / MKL on an AVX2 machine: the 49152 x 576 LM head of SmolLM2
takes 8.6 ms for one row, 19-28 ms for two to four rows, and 5 ms as
`W @ x.T`). Computing the product as `W @ x.T` keeps a short verification
forward close to the cost of a one-token step, which is what makes drafting
pay on CPU (benchmarks/engine_speed.py measures both ways in one run).

`skinny_linears(*models)` swaps the forward of every `nn.Linear` on CPU for the
duration of a `with` block; inputs with more than `max_rows` rows (a prefill)
keep the stock path. Results equal the stock path up to float rounding.
"""

from __future__ import annotations

import types
from contextlib import contextmanager

import torch
from torch import nn


def _skinny_forward(max_rows: int):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > max_rows:
            return nn.functional.linear(x, self.weight, self.bias)
        out = torch.matmul(self.weight, x.reshape(rows, x.shape[-1]).T).T
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.weight.shape[0])
    return forward


@contextmanager
def skinny_linears(*models: nn.Module, max_rows: int = 32, enabled: bool = True):
    """Within the block, CPU linear layers of `models` compute short inputs as W @ x.T."""
    patched = []
    if enabled:
        forward = _skinny_forward(max_rows)
        for module in (m for model in models for m in model.modules()):
            if isinstance(module, nn.Linear) and module.weight.device.type == "cpu" and "forward" not in vars(module):
                module.forward = types.MethodType(forward, module)
                patched.append(module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward  # back to the class's forward
