// A linear layer's product x @ W.T (+ bias) from W held in int8, one float32 scale per output feature: half the
// bytes of bfloat16, for a draft head's weights, which a chain step reads again from memory right after each
// target forward (docs/benchmarks.md, "Where the cold drafting goes"). The target never runs on it: its outputs
// must be the target's own.
//
// Quantization (runtime/products.py, `int8_blocked`): symmetric per output feature, W[o, k] ~ scale[o] q[o, k],
// q = round(W / scale) in [-127, 127], scale[o] = max_k |W[o, k]| / 127. Layout: q [G, K, 32], blocks[g, k, i] =
// q[32 g + i, k] (zero past O), so a group's 32 features' weights for input k are the 32 bytes after input k-1's.
//
// The loop is blocked_linear.cpp's float32 one (whose vector helpers this file uses: kernels.cpp includes it
// first): each step widens the group's next 32 int8 weights to float32 (exact) and multiply-adds every row's
// input k into them. Each output element is one float32 sum over the inputs in order, times the feature's scale,
// + bias, rounded once to x's dtype: a row's result does not depend on the rows computed with it.
//
// Builds: AVX-512, or AVX2 with FMA; `int8_supports()` says whether this build has it.

namespace {

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
constexpr bool INT8 = true;
#if defined(__AVX512F__)
inline lanes widen_int8(const int8_t* p) {  // 16 int8 -> 16 float32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#else
inline lanes widen_int8(const int8_t* p) {  // 8 int8 -> 8 float32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// sums[j * 32 + i] = sum_k x[r0 + j, k] q[32 g + i, k] for the group at `wg` ([K, 32] int8).
template <int RB, bool AHEAD>
inline void group_rows_int8(const int8_t* wg, const float* x, int64_t K, int64_t r0, float* sums) {
  lanes acc[VECTORS][RB];
#pragma GCC unroll 16
  for (int v = 0; v < VECTORS; ++v)
#pragma GCC unroll 16
    for (int j = 0; j < RB; ++j) acc[v][j] = zero();
  for (int64_t k = 0; k < K; ++k) {
    if ((k & 3) == 0) prefetch_ahead<RB, AHEAD>(wg + k * GROUP);  // 4 inputs' weights: the two lines it asks for
    lanes w[VECTORS];
#pragma GCC unroll 16
    for (int v = 0; v < VECTORS; ++v) w[v] = widen_int8(wg + k * GROUP + v * WIDTH);
#pragma GCC unroll 16
    for (int j = 0; j < RB; ++j) {
      const lanes xk = broadcast(x[(r0 + j) * K + k]);
#pragma GCC unroll 16
      for (int v = 0; v < VECTORS; ++v) acc[v][j] = mul_add(w[v], xk, acc[v][j]);
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < RB; ++j)
#pragma GCC unroll 16
    for (int v = 0; v < VECTORS; ++v) save(sums + j * GROUP + v * WIDTH, acc[v][j]);
}

template <typename T>
void run_int8(const int8_t* w, const float* scales, const float* x, const float* bias, T* out, int64_t R, int64_t O,
              int64_t K, int64_t G) {
  const int64_t passes = (R + ROW_BLOCK - 1) / ROW_BLOCK, per_pass = (R + passes - 1) / passes;
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    float sums[ROW_BLOCK * GROUP];
    for (int64_t g = g0; g < g1; ++g) {
      const int8_t* wg = w + g * K * GROUP;
      const int64_t o0 = g * GROUP, n = std::min<int64_t>(GROUP, O - o0);
      for (int64_t r0 = 0; r0 < R; r0 += per_pass) {
        const int64_t rb = std::min<int64_t>(per_pass, R - r0);
        in_row_blocks(r0, rb, sums, [&](auto block, auto ahead, int64_t r, float* at) {
          group_rows_int8<decltype(block)::value, decltype(ahead)::value>(wg, x, K, r, at);
        });
        for (int64_t j = 0; j < rb; ++j)
          for (int64_t i = 0; i < n; ++i) {
            const float s = sums[j * GROUP + i] * scales[o0 + i];
            store_out(out + (r0 + j) * O + o0 + i, bias != nullptr ? s + bias[o0 + i] : s);
          }
      }
    }
  });
}
#else
constexpr bool INT8 = false;
#endif

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
  torch::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == O, name, ": the bias has ", bias->numel(), " values for ", O, " features");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = O;
  torch::Tensor out = torch::empty(shape, x.options());
  if (R == 0) return out;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  const int8_t* w = blocks.data_ptr<int8_t>();
  if (x.scalar_type() == at::kBFloat16)
    run_int8(w, scales.data_ptr<float>(), rows.data_ptr<float>(), b, out.data_ptr<bf16>(), R, O, K, G);
  else
    run_int8(w, scales.data_ptr<float>(), rows.data_ptr<float>(), b, out.data_ptr<float>(), R, O, K, G);
#endif
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
