// A linear layer's product x @ W.T (+ bias) from W held in int8, one float32 scale per output feature: half the
// bytes of bfloat16, for a draft head's weights, which a chain step reads again from memory right after each
// target forward (docs/benchmarks.md, "Where the cold drafting goes"). The target never runs on it: its outputs
// must be the target's own.
//
// Quantization (runtime/products.py, `int8_blocked`): symmetric per output feature, W[o, k] ~ scale[o] q[o, k],
// q = round(W / scale) in [-127, 127], scale[o] = max_k |W[o, k]| / 127. Layout: q [G, K, 32], blocks[g, k, i] =
// q[32 g + i, k] (zero past O), so a group's 32 features' weights for input k are the 32 bytes after input k-1's.
//
// The loop is blocked_linear.cpp's float32 one (`run`, `group_rows_f32`: kernels.cpp includes that file first):
// each step widens the group's next 32 int8 weights to float32 (exact) and multiply-adds every row's input k
// into them. Each output element is one float32 sum over the inputs in order, times the feature's scale,
// + bias, rounded once to x's dtype: a row's result does not depend on the rows computed with it.
//
// Builds: AVX-512, or AVX2 with FMA; `int8_supports()` says whether this build has it.

namespace {

constexpr bool INT8 = F32;  // blocked_linear.cpp's float32 loop runs it

// x [..., K] (float32 or bfloat16), blocks [G, K, 32] int8, scales [O] float32, bias [O] of any float dtype or
// None. Returns x @ (scales[:, None] * q).T + bias as [..., O] in x's dtype.
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& blocks, const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  const char* name = "int8_linear";
  TORCH_CHECK(INT8, name, ": this build has no int8 product (it needs AVX-512, or AVX2 with FMA)");
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu() && scales.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(blocks.scalar_type() == at::kChar && blocks.dim() == 3 && blocks.size(2) == GROUP &&
              blocks.is_contiguous(), name, ": the blocks must be a contiguous int8 [groups, inputs, ", GROUP,
              "], got ", blocks.scalar_type(), " ", blocks.sizes());
  const int64_t G = blocks.size(0), K = x.size(-1), O = out_features;
  TORCH_CHECK(blocks.size(1) == K, name, ": x has ", K, " features, the blocks hold ", blocks.size(1));
  TORCH_CHECK(O > (G - 1) * GROUP && O <= G * GROUP, name, ": ", O, " output features do not fill ", G,
              " groups of ", GROUP);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == O && scales.is_contiguous(), name,
              ": the scales must be a contiguous float32 [", O, "], got ", scales.scalar_type(), " ", scales.sizes());
  // the inputs in float32, read once per group: bfloat16 rows widened here (exact)
  const torch::Tensor rows = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t R = rows.size(0);
  const torch::Tensor bias32 = float_bias(bias, O, name);
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  torch::Tensor out = output_for(x, O);
  if (R == 0) return out;
  const int8_t* w = blocks.data_ptr<int8_t>();
  if (x.scalar_type() == at::kBFloat16)
    run(w, rows.data_ptr<float>(), b, out.data_ptr<bf16>(), R, O, K, K, G, scales.data_ptr<float>());
  else
    run(w, rows.data_ptr<float>(), b, out.data_ptr<float>(), R, O, K, K, G, scales.data_ptr<float>());
  return out;
}

}  // namespace

void bind_int8_linear(pybind11::module& m) {
  m.def("int8_linear", &int8_linear, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "x @ (scales * q).T + bias from int8 weights q laid out in blocks of 32 output features "
        "(runtime/products.py: int8_blocked)",
        pybind11::arg("x"), pybind11::arg("blocks"), pybind11::arg("scales"), pybind11::arg("bias"),
        pybind11::arg("out_features"));
  m.def("int8_supports", []() { return INT8; }, "whether this build has the int8 product");
}
