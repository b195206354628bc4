"""The fused elementwise steps of a decoder layer (mtptrain/runtime/csrc/layer_ops.cpp) compute what torch's
operations compute: in float32 within a few units of the last place, in bfloat16 bit for bit but for a last-bit
rounding of the RMSNorm now and then (torch's rsqrt and sum order are not ours). runtime/model.py calls them
for float32 and bfloat16 on the CPU and torch's operations for anything else."""

import pytest
import torch
import torch.nn.functional as F

from mtptrain.runtime import model as runtime_model
from mtptrain.runtime.model import add_rms_norm, rope, rotate_half, silu_mul
from mtptrain.runtime.native_kernels import layer_ops


@pytest.fixture(scope="module")
def ops():
    module = layer_ops()
    assert module is not None, "the runtime's CPU kernels did not build (see the warning logged above)"
    return module


def _close(mine: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype, equal_share: float = 1.0) -> None:
    """float32: within a few ulps of each value, or of the largest where a sum cancels (the compiler may fuse a
    product and a sum into one rounding); bfloat16: at least `equal_share` of the values equal bit for bit and
    the rest one rounding step (2**-8 relative) away at most."""
    assert mine.dtype == theirs.dtype == dtype and mine.shape == theirs.shape
    a, b = mine.double(), theirs.double()
    if dtype == torch.float32:
        assert bool(((a - b).abs() <= 4e-7 * b.abs() + 2e-7 * b.abs().max()).all())
    else:
        relative = ((a - b).abs() / b.abs().clamp(min=1e-6)).max()
        assert float((mine == theirs).double().mean()) >= equal_share
        assert float(relative) <= 2 ** -7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_an_add_and_torchs_rms_norm(ops, dtype):
    g = torch.Generator().manual_seed(0)
    residual, delta = (torch.randn(1, 160, 576, generator=g).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    x, h = ops.add_rms_norm(residual, delta, weight, 1e-5)
    assert torch.equal(x, residual + delta)
    _close(h, F.rms_norm(residual + delta, (576,), weight, 1e-5), dtype, equal_share=0.999)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 576), (4, 3, 576), (1, 160, 576), (7, 33)])
def test_rms_norm_is_torchs_with_and_without_a_weight(ops, dtype, shape):
    g = torch.Generator().manual_seed(5)
    x = (3 * torch.randn(*shape, generator=g)).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    for w in (weight, None):
        mine, theirs = ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (shape[-1],), w, 1e-5)
        # bfloat16, as drafting and the decoder's first and last norms run it: bit for bit but for a rare last bit
        _close(mine, theirs, dtype, equal_share=0.999)
        assert torch.equal(runtime_model.rms_norm(x, w, 1e-5), mine)
    # a strided view is read as its values; a row of zeros gives zeros, as eps keeps the scale finite
    view = x.transpose(0, -1) if x.dim() == 2 else x[:, :1]
    _close(ops.rms_norm(view, None, 1e-5), F.rms_norm(view, (view.shape[-1],), None, 1e-5), dtype, 0.999)
    assert not ops.rms_norm(torch.zeros(2, shape[-1], dtype=dtype), weight, 1e-5).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_silu_of_the_gate_times_up(ops, dtype):
    g = torch.Generator().manual_seed(1)
    gate_up = (4 * torch.randn(3, 50, 2 * 1536, generator=g)).to(dtype)
    gate_up[0, 0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamped ends and zero
    gate, up = gate_up.chunk(2, dim=-1)
    _close(ops.silu_mul(gate_up), F.silu(gate) * up, dtype, equal_share=0.999)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_a_strided_view_as_torch_does(ops, dtype):
    """The runtime rotates q and k as a view of the fused qkv product: its tokens 960 apart, heads 64."""
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(2, 7, 960, generator=g).to(dtype)
    qk = qkv[..., :768].view(2, 7, 12, 64)
    cos, sin = (torch.randn(2, 7, 1, 64, generator=g).to(dtype) for _ in range(2))
    out = ops.rope(qk, cos, sin)
    assert out.is_contiguous()
    _close(out, qk * cos + rotate_half(qk) * sin, dtype)


def test_the_results_do_not_depend_on_the_thread_count(ops):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 576, generator=g).to(torch.bfloat16)
    w = torch.ones(576, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.add_rms_norm(x, x, w, 1e-5)[1], ops.silu_mul(x), ops.rms_norm(x, w, 1e-5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], ops.add_rms_norm(x, x, w, 1e-5)[1]) and torch.equal(one[1], ops.silu_mul(x))
    assert torch.equal(one[2], ops.rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("call, message", [
    (lambda o: o.add_rms_norm(torch.ones(2, 8), torch.ones(2, 8), torch.ones(7), 1e-5), "last dimension"),
    (lambda o: o.add_rms_norm(torch.ones(2, 8), torch.ones(2, 8).bfloat16(), torch.ones(8), 1e-5), "dtypes differ"),
    (lambda o: o.add_rms_norm(torch.ones(2, 8), torch.ones(3, 8), torch.ones(8), 1e-5), "differs from residual"),
    (lambda o: o.rms_norm(torch.ones(2, 8), torch.ones(7), 1e-5), "last dimension"),
    (lambda o: o.rms_norm(torch.ones(2, 8), torch.ones(8).bfloat16(), 1e-5), "dtypes differ"),
    (lambda o: o.rms_norm(torch.ones(2, 8, dtype=torch.float16), None, 1e-5), "float32 or bfloat16 only"),
    (lambda o: o.silu_mul(torch.ones(2, 7)), "gate and up"),
    (lambda o: o.silu_mul(torch.ones(2, 8, dtype=torch.float64)), "float32 or bfloat16 only"),
    (lambda o: o.rope(torch.ones(1, 2, 3, 8), torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4)), "cos and sin"),
    (lambda o: o.rope(torch.ones(1, 2, 8, 3).transpose(2, 3), torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8)),
     "unit stride"),
])
def test_bad_inputs_raise_a_clear_error(ops, call, message):
    with pytest.raises(RuntimeError, match=message):
        call(ops)


def test_the_decoder_keeps_torchs_operations_where_the_kernels_do_not_run(ops, monkeypatch):
    """float64 (and a GPU, float16, or no compiler) takes torch's operations, with torch's results exactly; float32
    takes the kernels."""
    calls = []
    monkeypatch.setattr(runtime_model, "layer_ops", lambda: (calls.append(1), ops)[1])
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 5, 2, 8, generator=g, dtype=torch.float64)
    cos, sin = torch.randn(1, 5, 1, 8, generator=g, dtype=torch.float64), torch.randn(1, 5, 1, 8, dtype=torch.float64)
    w = torch.randn(8, generator=g, dtype=torch.float64)
    assert torch.equal(rope(x, cos, sin), x * cos + rotate_half(x) * sin)
    assert torch.equal(silu_mul(x), F.silu(x[..., :4]) * x[..., 4:])
    summed, normed = add_rms_norm(x, x, w, 1e-6)
    assert torch.equal(summed, x + x) and torch.equal(normed, F.rms_norm(x + x, (8,), w, 1e-6))
    assert torch.equal(runtime_model.rms_norm(x, None, 1e-6), F.rms_norm(x, (8,), None, 1e-6))
    assert not calls
    add_rms_norm(x.float(), x.float(), w.float(), 1e-6)
    assert calls
