"""The int8 product a draft head may draft with (csrc/int8_linear.cpp, runtime/products.py INT8): the
quantization's bounds, the kernel's product over the dequantized weight within float32 rounding, each row's
result the same bit for bit whatever rows share the call, clear errors for what it does not take, torch's
product where the kernel cannot run, and the runtime never picking it for a target."""

import pytest
import torch
import torch.nn.functional as F

from mtptrain.runtime.native_kernels import int8_linear_kernel
from mtptrain.runtime.products import INT8, PRODUCTS, int8_blocked, int8_dequantized, int8_product


@pytest.fixture(scope="module")
def kernel():
    """The kernel (every CPU this project runs on has AVX2 with FMA at least)."""
    built = int8_linear_kernel()
    assert built is not None, "the runtime's C++ kernels did not build (see the warning logged above)"
    return built


@pytest.mark.parametrize("shape", [(13, 7), (64, 33), (200, 100), (33, 1)])
def test_weights_are_rounded_to_127_steps_of_their_features_largest_magnitude(shape):
    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(*shape, generator=g)
    w[3] = 0.0  # a feature of zeros stays zeros
    q = int8_blocked(w)
    groups = -(-shape[0] // 32)
    assert q.blocks.dtype == torch.int8 and q.blocks.shape == (groups, shape[1], 32)
    assert q.blocks.abs().max() <= 127 and q.scales.dtype == torch.float32 and q.scales.shape == (shape[0],)
    back = int8_dequantized(q)
    assert back.shape == w.shape and torch.equal(back[3], torch.zeros(shape[1]))
    # within half a step of each feature's own scale, and each nonzero feature's largest weight exact
    assert ((back - w).abs() <= q.scales[:, None] / 2 * (1 + 1e-6)).all()
    largest = w.abs().amax(dim=1)
    assert torch.allclose(back.abs().amax(dim=1), largest, rtol=1e-6)
    padding = q.blocks.permute(0, 2, 1).reshape(groups * 32, shape[1])[shape[0]:]
    assert not padding.any()  # features past the weight are zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(13, 7), (64, 33), (200, 100), (96, 576), (33, 1)])
def test_the_product_is_x_times_the_dequantized_weight_within_rounding(kernel, dtype, shape):
    out_features, in_features = shape
    g = torch.Generator().manual_seed(out_features + in_features)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g).to(dtype)
    q = int8_blocked(w.to(dtype))
    exact_w = int8_dequantized(q).double()
    for rows in (1, 2, 5, 8, 9, 12, 13, 37):
        x = torch.randn(rows, in_features, generator=g).to(dtype)
        for bias in (None, b):
            got = int8_product(x, q, bias)
            exact = x.double() @ exact_w.T + (0 if bias is None else bias.double())
            assert got.dtype == dtype and got.shape == (rows, out_features)
            scale = float((x.double().abs() @ exact_w.abs().T).max())
            if dtype == torch.float32:
                assert float((got.double() - exact).abs().max()) < 1e-6 * scale
            else:  # one rounding to bfloat16 on top of the float32 sum's error
                assert ((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-5 * scale).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_product_is_the_same_alone_or_among_other_rows(kernel, dtype):
    g = torch.Generator().manual_seed(5)
    q = int8_blocked(torch.randn(100, 96, generator=g))
    x = torch.randn(2, 13, 96, generator=g).to(dtype)
    together = int8_product(x, q, None)
    assert together.shape == (2, 13, 100)  # leading dimensions kept
    for row in (0, 7, 12):
        assert torch.equal(together[1, row], int8_product(x[1, row:row + 1], q, None)[0])


@pytest.mark.parametrize("fault, message", [
    ("x dtype", "x must be float32 or bfloat16"),
    ("blocks dtype", "the blocks must be a contiguous int8"),
    ("features", "x has 41 features, the blocks hold 40"),
    ("out features", "do not fill 1 groups"),
    ("scales", r"the scales must be a contiguous float32 \[24\]"),
    ("bias", "the bias has 23 values for 24 features"),
])
def test_what_the_kernel_does_not_take_raises_a_clear_error(kernel, fault, message):
    q = int8_blocked(torch.randn(24, 40))
    x, blocks, scales, bias, out_features = torch.randn(3, 40), q.blocks, q.scales, None, 24
    if fault == "x dtype":
        x = x.double()
    elif fault == "blocks dtype":
        blocks = blocks.float()
    elif fault == "features":
        x = torch.randn(3, 41)
    elif fault == "out features":
        out_features = 40
    elif fault == "scales":
        scales = scales[:20].contiguous()
    elif fault == "bias":
        bias = torch.randn(23)
    with pytest.raises(RuntimeError, match=message):
        kernel(x, blocks, scales, bias, out_features)


def test_inputs_the_kernel_cannot_take_go_to_torch_on_the_dequantized_weight():
    q = int8_blocked(torch.randn(24, 40, dtype=torch.float64))
    x, b = torch.randn(5, 40, dtype=torch.float64), torch.randn(24, dtype=torch.float64)
    assert torch.equal(int8_product(x, q, b), F.linear(x, int8_dequantized(q).double(), b))


def test_the_runtime_never_picks_the_int8_product_for_a_target():
    """The runtime measures and caches its choice among PRODUCTS; the int8 product changes the values
    multiplied, so it stays out of them (a cached choice naming it is refused as an unknown product), and only a
    head that asks for it drafts with it."""
    from mtptrain.runtime.choice import SECTIONS

    assert INT8.name == "int8" and "int8" not in PRODUCTS
    assert "int8" not in SECTIONS["products"] and "int8" not in SECTIONS["products_batch"]
