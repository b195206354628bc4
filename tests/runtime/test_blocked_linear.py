"""The runtime's own product (csrc/blocked_linear.cpp) on weights in its blocked layout, and the fused
one-token attention: what torch computes, within float rounding; each row's product the same bit for bit
whatever rows share the call; the layout undone exactly; clear errors for what the kernel does not take."""

import pytest
import torch
import torch.nn.functional as F

from mtptrain.runtime.attention import ATTENTION, causal_mask, fused_row, layer_mask, plain_attention, sdpa_attention
from mtptrain.runtime.native_kernels import blocked_linear_kernel
from mtptrain.runtime.products import blocked, blocked_product, holds_bfloat16, unblocked

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernel():
    """The kernel for float32 (every CPU this project runs on has AVX2 with FMA at least)."""
    built = blocked_linear_kernel(torch.float32)
    assert built is not None, "the runtime's C++ kernels did not build (see the warning logged above)"
    return built


def _has_kernel(dtype) -> bool:
    """Whether the runtime's product runs `dtype` here. Only bfloat16 may lack it, and only on a CPU without
    avx512_bf16: there `blocked_product` is torch's F.linear on the weight put back, which the tests check."""
    from mtptrain.machine import cpu_flags

    if blocked_linear_kernel(dtype) is not None:
        return True
    assert dtype == torch.bfloat16 and "avx512_bf16" not in (cpu_flags() or ""), f"no blocked product for {dtype}"
    return False


def _exact(x, w, b=None):
    out = x.double() @ w.double().T
    return out if b is None else out + b.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(13, 7), (64, 33), (200, 100), (96, 576), (3, 64), (33, 1)])
def test_the_blocked_product_computes_x_times_the_weight_within_rounding(kernel, dtype, shape):
    product = blocked_product  # the kernel, or where it has no product for dtype, torch's (same bounds)
    _has_kernel(dtype)
    out_features, in_features = shape
    g = torch.Generator().manual_seed(out_features + in_features)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype)
    laid_out = blocked(w)
    for rows in (1, 2, 5, 8, 9, 12, 13, 16, 37):
        x = torch.randn(rows, in_features, generator=g).to(dtype)
        for bias in (None, b):
            got, exact = product(x, laid_out, bias), _exact(x, w, bias)
            assert got.dtype == dtype and got.shape == (rows, out_features)
            scale = float((x.double().abs() @ w.double().abs().T).max())  # the largest sum of |terms|
            if dtype == torch.float32:  # float32 sums: errors far below an ulp of the sums' scale
                assert float((got.double() - exact).abs().max()) < 1e-6 * scale
            else:  # one rounding to bfloat16 (half an ulp, 2^-9 relative) on top of the float32 sum's error
                assert ((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-5 * scale).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_product_is_the_same_alone_or_among_other_rows(kernel, dtype):
    product = blocked_product
    g = torch.Generator().manual_seed(5)
    w = blocked(torch.randn(250, 576, generator=g).to(dtype))  # 250: 7 full groups of 32 and a part
    x = torch.randn(40, 576, generator=g).to(dtype)
    together = product(x, w, None)
    if not _has_kernel(dtype):  # torch's product stands in, exactly (torch promises no row independence)
        assert torch.equal(together, F.linear(x, unblocked(w)))
        return
    for rows in (1, 2, 3, 7, 8, 9, 11, 12, 13, 16, 17, 25, 40):
        assert torch.equal(product(x[:rows], w, None), together[:rows]), rows
    for r in range(0, 40, 3):
        assert torch.equal(product(x[r:r + 1], w, None), together[r:r + 1]), r
    threads = torch.get_num_threads()
    try:  # and whichever thread computed which features
        torch.set_num_threads(1)
        assert torch.equal(product(x, w, None), together)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("shape", [(13, 7), (64, 33), (250, 576), (33, 1), (40, 1537)])
def test_a_float32_weight_of_bfloat16_values_is_held_in_bfloat16_and_multiplies_bit_for_bit_as_float32(kernel, shape):
    """A bfloat16 checkpoint run in float32: its weights are laid out in bfloat16 blocks (half the bytes) and
    every product equals, bit for bit, the one over float32 blocks of the same values, whatever the rows; the
    weight comes back exactly, as float32."""
    out_features, in_features = shape
    g = torch.Generator().manual_seed(out_features * in_features)
    w = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16).float()
    b = torch.randn(out_features, generator=g)
    narrow, wide = blocked(w), blocked(w, narrow=False)
    assert narrow.blocks.dtype == torch.bfloat16 and narrow.blocks.shape[3] == 2 and narrow.dtype == torch.float32
    assert wide.blocks.dtype == torch.float32 and wide.blocks.shape[3] == 1
    assert unblocked(narrow).dtype == torch.float32 and torch.equal(unblocked(narrow), w)
    x = torch.randn(37, in_features, generator=g)
    for bias in (None, b):
        together = blocked_product(x, narrow, bias)
        assert together.dtype == torch.float32
        assert torch.equal(together, blocked_product(x, wide, bias))
        for rows in (1, 2, 3, 4, 5, 9, 12, 13):
            assert torch.equal(blocked_product(x[:rows], narrow, bias), together[:rows]), rows
    assert float((together.double() - _exact(x, w, b)).abs().max()) < 1e-6 * float(
        (x.double().abs() @ w.double().abs().T).max())


def test_a_float32_weight_with_one_value_finer_than_bfloat16_stays_float32():
    w = torch.randn(64, 40).to(torch.bfloat16).float()
    w[17, 3] += 2.0 ** -20  # no longer a bfloat16
    laid_out = blocked(w)
    assert laid_out.blocks.dtype == torch.float32 and torch.equal(unblocked(laid_out), w)
    assert holds_bfloat16(w[:17]) and not holds_bfloat16(w) and not holds_bfloat16(w.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", [(13, 7), (64, 33), (32, 64)])
def test_the_layout_comes_back_exactly(dtype, shape):
    w = torch.randn(*shape).to(dtype)
    laid_out = blocked(w)
    assert laid_out.blocks.shape[2] == 32 and laid_out.blocks.is_contiguous()
    assert torch.equal(unblocked(laid_out), w)


def test_inputs_keep_their_leading_dimensions(kernel):
    w = torch.randn(24, 40)
    x = torch.randn(2, 3, 40)
    got = blocked_product(x, blocked(w), None)
    assert got.shape == (2, 3, 24)
    assert torch.equal(got.reshape(6, 24), blocked_product(x.reshape(6, 40), blocked(w), None))
    assert torch.allclose(got, F.linear(x, w), atol=1e-5)


@pytest.mark.parametrize("fault, message", [
    ("dtype", "must share a dtype"),
    ("bfloat16 over float32", "must share a dtype, or be float32 over bfloat16 blocks"),
    ("float64", "has no Double product"),
    ("features", "has 41 features, the blocks hold 40"),
    ("out features", "do not fill 1 groups"),
    ("bias", "the bias has 23 values for 24 features"),
])
def test_what_the_kernel_does_not_take_raises_a_clear_error(kernel, fault, message):
    x, w, bias, out_features = torch.randn(3, 40), blocked(torch.randn(24, 40)), None, 24
    if fault == "dtype":
        x = x.double()
    elif fault == "bfloat16 over float32":
        x = x.to(torch.bfloat16)
    elif fault == "float64":
        x, w = x.double(), blocked(torch.randn(24, 40).double())
    elif fault == "features":
        x = torch.randn(3, 41)
    elif fault == "out features":
        out_features = 40
    elif fault == "bias":
        bias = torch.randn(23)
    with pytest.raises(RuntimeError, match=message):
        kernel(x, w.blocks, bias, out_features)


def test_inputs_the_kernel_has_no_product_for_go_to_torch():
    """float64 (a reference model in the tests) and a dtype other than the weights': F.linear on the weight
    put back, so a caller never gets a wrong answer."""
    w, b = torch.randn(24, 40, dtype=torch.float64), torch.randn(24, dtype=torch.float64)
    x = torch.randn(5, 40, dtype=torch.float64)
    assert torch.equal(blocked_product(x, blocked(w), b), F.linear(x, w, b))
    x32 = torch.randn(5, 40)
    assert torch.equal(blocked_product(x32, blocked(w), None), F.linear(x32, w.float()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fused_row_attention_reads_the_cache_in_place_and_gives_a_chain_what_one_token_gets(dtype):
    """The cache hands out views of its first positions (strides of its capacity): the kernel reads them where
    they lie and agrees with the plain products; each token of a causal chain gets, bit for bit, what it gets
    decoded alone after the tokens before it; a mask (a tree) goes to the plain products."""
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, capacity, length = 8, 2, 64, 300, 171
    keys, values = (torch.randn(1, kv_heads, capacity, dim, generator=g).to(dtype) for _ in range(2))
    k, v = keys[:, :, :length], values[:, :, :length]
    assert not k.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    q = torch.randn(1, heads, 1, dim, generator=g).to(dtype)
    got, plain = fused_row(q, k, v, None, False), plain_attention(q, k, v, None, False)
    assert got.shape == plain.shape == (1, heads, 1, dim) and got.dtype == dtype
    assert float((got.float() - plain.float()).abs().max()) < tol
    chain = torch.randn(1, heads, 5, dim, generator=g).to(dtype)  # the last 5 of the 171 positions
    got = fused_row(chain, k, v, None, True)
    assert float((got.float() - plain_attention(chain, k, v, None, True).float()).abs().max()) < tol
    for t in range(5):
        alone = fused_row(chain[:, :, t:t + 1], k[:, :, :length - 4 + t], v[:, :, :length - 4 + t], None, False)
        assert torch.equal(got[:, :, t:t + 1], alone), t
    seen = torch.ones(1, 1, 1, length, dtype=torch.bool)
    seen[..., :40] = False
    assert torch.equal(fused_row(q, k, v, seen, False), plain_attention(q, k, v, seen, False))
    # several rows (a batched prefill) and trees: SDPA, causal after the cache as the kernel would be
    rows = torch.randn(3, heads, 5, dim, generator=g).to(dtype)
    k3, v3 = k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1)
    assert torch.equal(fused_row(rows, k3, v3, None, True), sdpa_attention(
        rows, k3, v3, causal_mask(5, length - 5)[None, None], False))
    tree = torch.ones(1, 1, 5, length, dtype=torch.bool).tril(length - 5)
    tree[..., 3, length - 5 + 1] = False  # token 3 does not see token 1: not a chain
    assert torch.equal(fused_row(chain, k, v, tree, False), sdpa_attention(chain, k, v, tree, False))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", ["sdpa", "plain", "sdpa-f32", "plain-f32"])
def test_a_mask_made_additive_once_a_step_gives_each_kernel_what_the_boolean_one_gives(kernel, dtype):
    """A verification's mask (a chain's causal one, a tree's) is made additive once for every layer
    (`layer_mask`): each kernel computes from it bit for bit what it computes from the boolean mask."""
    g = torch.Generator().manual_seed(9)
    heads, kv_heads, dim, past = 8, 2, 64, 150
    attend = ATTENTION[kernel]
    for count, mask in ((4, causal_mask(4, past)[None, None]),
                        (3, torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool))):
        if mask.shape[-1] == 3:  # a tree: a root and two children, after the cache
            mask = torch.cat([torch.ones(3, past, dtype=torch.bool), mask], dim=1)[None, None]
        q = torch.randn(1, heads, count, dim, generator=g).to(dtype)
        k, v = (torch.randn(1, kv_heads, past + count, dim, generator=g).to(dtype) for _ in range(2))
        additive = layer_mask(mask, kernel, dtype)
        assert additive.dtype == (dtype if kernel == "sdpa" else torch.float32)
        assert torch.equal(attend(q, k, v, additive, False), attend(q, k, v, mask, False)), count
    assert layer_mask(mask, "fused", dtype) is mask  # the fused kernels read the boolean mask
