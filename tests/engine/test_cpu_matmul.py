"""The CPU linear-layer swap computes what nn.Linear computes, only inside its block."""

import torch
from conftest import make_tiny_llama

from mtptrain.engine.cpu_matmul import skinny_linears
from mtptrain.engine.generate import generate
from mtptrain.engine.ngram import NgramProposer
from mtptrain.runtime.runner import open_runner


def test_skinny_linears_match_the_stock_layers_and_are_restored():
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(3, 5, 16)
    stock = layer(x)
    with skinny_linears(layer, max_rows=8) as patched:
        assert patched == 1
        short = layer(x[:1])  # 5 rows: the W @ x.T path
        long = layer(x)  # 15 rows > 8: the stock path
    assert torch.allclose(short, stock[:1], atol=1e-6)
    assert torch.equal(long, stock)
    assert "forward" not in vars(layer)
    with skinny_linears(layer, enabled=False) as patched:
        assert patched == 0


def test_speculative_output_is_unchanged_with_skinny_linears():
    model = make_tiny_llama(400, seed=3).double()
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    reference = generate(open_runner(model), prompt, 30).tokens
    with skinny_linears(model):
        assert generate(open_runner(model), prompt, 30, NgramProposer(), k=4).tokens == reference
