"""The greedy choice over logits: the runtime's argmax kernel (csrc/layer_ops.cpp, argmax_rows) gives each
row's first maximum, as torch's argmax does, for float32 and bfloat16, ties, infinities and every length a
vector loop can leave a tail of; a row with a NaN goes to torch (which takes the NaN as the maximum)."""

import pytest
import torch

from mtptrain.engine.verify import greedy_choice
from mtptrain.machine import cpu_flags
from mtptrain.runtime.native_kernels import argmax_kernel


def test_the_kernel_is_there_wherever_the_cpu_has_avx512():
    """Where it is not (an AVX2-only CPU), greedy_choice is torch's argmax: the cases below check that path."""
    assert (argmax_kernel() is not None) == ("avx512f" in (cpu_flags() or "").split())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 7, 15, 16, 17, 33, 8192, 49152])
def test_each_rows_choice_is_torchs_first_maximum(dtype, length):
    g = torch.Generator().manual_seed(length)
    for case in ("random", "ties", "all -inf", "+inf", "last", "first"):
        x = torch.randn(4, length, generator=g)
        if case == "ties":  # a few distinct values: the first maximum must win
            x = (x * 2).round()
        elif case == "all -inf":
            x[:] = float("-inf")
        elif case == "+inf":
            x[:, length // 2] = float("inf")
            x[1, -1] = float("inf")
        elif case == "last":
            x[:, -1] = 100.0
        elif case == "first":
            x[:, 0] = 100.0
        x = x.to(dtype)
        want = x.float().argmax(-1).tolist()
        assert greedy_choice(x) == want, case
        assert greedy_choice(x[2]) == want[2] and type(greedy_choice(x[2])) is int, case


def test_a_row_with_a_nan_is_chosen_as_torch_chooses_it():
    x = torch.randn(3, 100)
    x[1, 5] = float("nan")
    assert greedy_choice(x) == x.argmax(-1).tolist()
    assert greedy_choice(x)[1] == 5
    kernel = argmax_kernel()
    if kernel is not None:  # the kernel itself says -1 for that row, and only that row
        assert kernel(x) == [int(x[0].argmax()), -1, int(x[2].argmax())]


def test_what_the_kernel_does_not_take_goes_to_torch():
    x = torch.randn(2, 3, 50, dtype=torch.float64)  # another dtype, and a third dimension
    assert greedy_choice(x) == x.argmax(-1).tolist()
    y = torch.randn(2, 3, 50)
    assert greedy_choice(y) == y.argmax(-1).tolist()
    z = torch.randn(6, 40)[:, ::2]  # not contiguous
    assert greedy_choice(z) == z.argmax(-1).tolist()
