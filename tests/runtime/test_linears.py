"""The CPU linear-layer swap computes what nn.Linear computes, only inside its block."""

import pytest
import torch
from conftest import make_tiny_llama

from mtptrain.runtime.linears import fast_linears
from mtptrain.engine.generate import generate
from mtptrain.engine.ngram import NgramProposer
from mtptrain.runtime.runner import open_runner


PRODUCTS = ["skinny", "native"] + (["packed"] if torch.backends.mkldnn.is_available() else [])


@pytest.mark.parametrize("product", PRODUCTS)
def test_fast_linears_match_the_stock_layers_and_are_restored(product):
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(3, 5, 16)
    stock = layer(x)
    with fast_linears(layer, product=product, max_rows=8) as patched:
        assert patched == 1
        short = layer(x[:1])  # 5 rows: the W @ x.T path
        long = layer(x)  # 15 rows > 8: the stock path
    assert torch.allclose(short, stock[:1], atol=1e-6)
    assert torch.equal(long, stock)
    assert "forward" not in vars(layer)
    with fast_linears(layer, product=product, enabled=False) as patched:
        assert patched == 0
    with fast_linears(layer, product="linear") as patched:
        assert patched == 0


@pytest.mark.parametrize("product", PRODUCTS)
def test_speculative_output_is_unchanged_with_fast_linears(product):
    model = make_tiny_llama(400, seed=3).double()
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    reference = generate(open_runner(model, runtime="transformers"), prompt, 30).tokens
    with fast_linears(model, product=product):
        assert generate(open_runner(model, runtime="transformers"), prompt, 30, NgramProposer(), k=4).tokens == reference
