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
    assert type(layer) is torch.nn.Linear and not hasattr(layer, "laid_out")  # the same module, plain again
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


@pytest.mark.parametrize("product", PRODUCTS)
def test_inside_the_block_every_reference_to_a_layer_multiplies_with_the_product(product, monkeypatch):
    """The module itself is turned (not a copy swapped into its parent), so a reference held outside the module
    tree (a head's FrozenTarget holds the target's LM head that way) runs the product too, never F.linear, for
    short inputs; F.linear is back after the block."""
    from mtptrain.runtime.linears import ProductLinear
    from mtptrain.runtime.products import PRODUCTS as KNOWN

    layer = torch.nn.Linear(16, 8)
    held = {"lm_head": layer}
    x = torch.randn(2, 16)

    def refused(*args, **kwargs):
        raise AssertionError("F.linear ran inside the block")
    with fast_linears(torch.nn.Sequential(layer), product=product, max_rows=8) as patched:
        assert patched == 1 and isinstance(held["lm_head"], ProductLinear) and layer.laid_out is None
        with monkeypatch.context() as patch:
            patch.setattr(torch.nn.functional, "linear", refused)
            out = held["lm_head"](x)
        assert layer.laid_out is not None and torch.equal(out, KNOWN[product](x, layer.laid_out, layer.bias))
    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.functional, "linear", refused)
        with pytest.raises(AssertionError, match="F.linear ran"):
            held["lm_head"](x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_product_this_machine_offers_multiplies(dtype):
    """The products the machine's choice times (runtime/choice.py) are the ones that run here: oneDNN refuses to
    pack bfloat16 weights on a CPU without AVX-512, and a choice that timed it there would crash."""
    from mtptrain.runtime.products import PRODUCTS as KNOWN, products, usable_product

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=generator).to(dtype)
    x = torch.randn(3, 64, generator=generator).to(dtype)
    offered = products(dtype)
    assert {"linear", "skinny"} <= set(offered)
    for name in offered:
        out = KNOWN[name](x, KNOWN[name].lay_out(weight), None)
        assert torch.allclose(out.float(), torch.nn.functional.linear(x, weight).float(), rtol=2e-2, atol=2e-2), name
    for name in KNOWN:  # a cached choice names a product this machine lacks: what runs in its place is offered
        assert usable_product(name, dtype) in offered
