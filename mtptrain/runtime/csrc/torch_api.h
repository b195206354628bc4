// The part of torch the runtime's kernels use besides torch's thread pool (ATen/Parallel.h, which each source
// includes): tensors, the two allocations, and the pybind11 casters that pass tensors to and from Python.
// torch/extension.h brings in the whole C++ frontend (autograd, nn, optim) besides: its parsing took 16.0 s of a
// 21.8 s build on a 2-core AMD EPYC (Zen 5), these headers 6.0 s, the build 11.7 s.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

// The kernels' signatures say torch::Tensor, as torch/extension.h would let them.
namespace torch {
using at::empty;
using at::empty_like;
using at::Tensor;
}  // namespace torch
