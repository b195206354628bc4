// The elementwise steps of a decoder layer, each one pass over its rows where torch takes three to five
// (an upcast, a power, a mean, a product, a cast back, each through memory). Built with decode_attention.cpp
// by mtptrain/runtime/native_kernels.py (-O3 -march=native -fopenmp); mtptrain/runtime/model.py calls them
// for float32 and bfloat16 on the CPU and keeps torch's operations elsewhere.
//
// Each op rounds where torch's own operations round (torch 2.13 on the CPU: the RMSNorm's product with the
// weight in float32, rounded once; silu and the rotary embedding's products and sums each rounded to the
// tensor's dtype), so results differ from torch's only by the last bits of a float32 step: the order of the
// mean's sum, torch's rsqrt (not correctly rounded on AVX-512), the exp in silu:
//
//   add_rms_norm(residual, delta, weight, eps) -> (x, h)
//       x = residual + delta; h = x * rsqrt(mean(x^2) + eps) * weight, the mean over the last dimension
//   rms_norm(x, weight, eps) -> x * rsqrt(mean(x^2) + eps) * weight (weight None: 1), torch's F.rms_norm
//   silu_mul(gate_up) -> silu(gate) * up, with gate_up = [gate | up] along the last dimension
//   rope(x, cos, sin) -> x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2 | x1] for x = [x1 | x2]
//
// And the greedy choice over logits, argmax_rows(x): per row the index of the first maximum, as torch's argmax.

#include "torch_api.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "float_math.h"

namespace {

using namespace mtptrain_kernels;

// float32 to T and back: the rounding a T tensor applies to a float result.
inline float round_as(float x, float) { return x; }
inline float round_as(float x, bf16) { return bf16_round(x); }

inline void store(float* p, float x) { *p = x; }
inline void store(bf16* p, float x) { p->x = bf16_high(x); }  // x already rounded by round_as

void check(const char* name, const torch::Tensor& t, const torch::Tensor& like) {
  TORCH_CHECK(t.device().is_cpu(), name, ": every tensor must be on the CPU");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, ": dtypes differ (", t.scalar_type(), " and ",
              like.scalar_type(), ")");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              ": float32 or bfloat16 only, got ", t.scalar_type());
}

// Threads take runs of rows; a run of fewer than about 16 KB of work is not worth a thread's start.
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 4096 / std::max<int64_t>(1, width)); }

// A row's normalized values h = x * scale * w (w null: 1) for scale = 1 / sqrt(mean(x^2) + eps) from the row's
// sum of squares, each rounded once from float32, as torch's F.rms_norm rounds.
template <typename T>
inline void scaled_row(const T* x, const T* w, T* h, int64_t width, float squares, float eps) {
  const float scale = 1.0f / std::sqrt(squares / float(width) + eps);
  if (w == nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) store(h + j, round_as(to_float(x[j]) * scale, T()));
  } else {
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) store(h + j, round_as(to_float(x[j]) * scale * to_float(w[j]), T()));
  }
}

template <typename T>
void add_rms_norm_rows(const T* r, const T* d, const T* w, T* x, T* h, int64_t rows, int64_t width, float eps) {
  at::parallel_for(0, rows, grain(width), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const T *ri = r + i * width, *di = d + i * width;
      T *xi = x + i * width, *hi = h + i * width;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t j = 0; j < width; ++j) {
        const float s = round_as(to_float(ri[j]) + to_float(di[j]), T());
        store(xi + j, s);
        squares += s * s;
      }
      scaled_row(xi, w, hi, width, squares, eps);
    }
  });
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& residual, const torch::Tensor& delta,
                                                      const torch::Tensor& weight, double eps) {
  const char* name = "add_rms_norm";
  check(name, residual, residual);
  check(name, delta, residual);
  check(name, weight, residual);
  TORCH_CHECK(delta.sizes() == residual.sizes(), name, ": delta ", delta.sizes(), " differs from residual ",
              residual.sizes());
  TORCH_CHECK(residual.dim() >= 1 && weight.dim() == 1 && weight.size(0) == residual.size(-1), name, ": weight ",
              weight.sizes(), " must have the last dimension of residual ", residual.sizes());
  const torch::Tensor r = residual.contiguous(), d = delta.contiguous(), w = weight.contiguous();
  torch::Tensor x = torch::empty_like(r), h = torch::empty_like(r);
  const int64_t width = r.size(-1), rows = width ? r.numel() / width : 0;
  if (residual.scalar_type() == at::kFloat)
    add_rms_norm_rows(r.data_ptr<float>(), d.data_ptr<float>(), w.data_ptr<float>(), x.data_ptr<float>(),
                      h.data_ptr<float>(), rows, width, float(eps));
  else
    add_rms_norm_rows(r.data_ptr<bf16>(), d.data_ptr<bf16>(), w.data_ptr<bf16>(), x.data_ptr<bf16>(),
                      h.data_ptr<bf16>(), rows, width, float(eps));
  return {x, h};
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* h, int64_t rows, int64_t width, float eps) {
  at::parallel_for(0, rows, grain(width), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const T* xi = x + i * width;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t j = 0; j < width; ++j) squares += to_float(xi[j]) * to_float(xi[j]);
      scaled_row(xi, w, h + i * width, width, squares, eps);
    }
  });
}

// A standalone RMSNorm: the first layer's input norm, the final norm before the LM head, and a draft head's
// norms, where torch's F.rms_norm runs five operations through memory (a row of 576 in bfloat16 on a 2-core AMD
// EPYC Zen 4: about 15 us alone, 29 us inside a chain step, against 2-4 here; benchmarks/rms_norm.py).
torch::Tensor rms_norm(const torch::Tensor& input, const c10::optional<torch::Tensor>& weight, double eps) {
  const char* name = "rms_norm";
  check(name, input, input);
  TORCH_CHECK(input.dim() >= 1, name, ": x must have at least one dimension");
  const torch::Tensor x = input.contiguous();
  torch::Tensor w;
  if (weight.has_value()) {
    check(name, *weight, input);
    TORCH_CHECK(weight->dim() == 1 && weight->size(0) == input.size(-1), name, ": weight ", weight->sizes(),
                " must have the last dimension of x ", input.sizes());
    w = weight->contiguous();
  }
  torch::Tensor h = torch::empty_like(x);
  const int64_t width = x.size(-1), rows = width ? x.numel() / width : 0;
  if (input.scalar_type() == at::kFloat)
    rms_norm_rows(x.data_ptr<float>(), w.defined() ? w.data_ptr<float>() : nullptr, h.data_ptr<float>(), rows,
                  width, float(eps));
  else
    rms_norm_rows(x.data_ptr<bf16>(), w.defined() ? w.data_ptr<bf16>() : nullptr, h.data_ptr<bf16>(), rows, width,
                  float(eps));
  return h;
}

template <typename T>
void silu_mul_rows(const T* in, T* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, grain(3 * width), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const T *gate = in + i * 2 * width, *up = gate + width;
      T* o = out + i * width;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) {
        const float g = to_float(gate[j]);
        const float silu = round_as(g / (1.0f + exp_clamped(-g)), T());
        store(o + j, round_as(silu * to_float(up[j]), T()));
      }
    }
  });
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  const char* name = "silu_mul";
  check(name, gate_up, gate_up);
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, name, ": the last dimension of ", gate_up.sizes(),
              " must hold gate and up, of equal sizes");
  const torch::Tensor in = gate_up.contiguous();
  std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
  const int64_t width = shape.back() / 2;
  shape.back() = width;
  torch::Tensor out = torch::empty(shape, in.options());
  const int64_t rows = width ? in.numel() / (2 * width) : 0;
  if (in.scalar_type() == at::kFloat) silu_mul_rows(in.data_ptr<float>(), out.data_ptr<float>(), rows, width);
  else silu_mul_rows(in.data_ptr<bf16>(), out.data_ptr<bf16>(), rows, width);
  return out;
}

// x [B, T, H, D] with unit stride along D (any other strides), cos and sin [B, T, D] contiguous: out [B, T, H, D]
// contiguous.
template <typename T>
void rope_rows(const torch::Tensor& x, const T* cos, const T* sin, T* out) {
  const int64_t B = x.size(0), L = x.size(1), H = x.size(2), D = x.size(3), half = D / 2;
  const int64_t sb = x.stride(0), st = x.stride(1), sh = x.stride(2);
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, B * L, grain(H * D), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / L, t = i % L;
      const T *c = cos + i * D, *s = sin + i * D;
      for (int64_t h = 0; h < H; ++h) {
        const T* xi = xp + b * sb + t * st + h * sh;
        T* o = out + (i * H + h) * D;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {  // first half: x1 cos - x2 sin; second: x2 cos + x1 sin
          const float x1 = to_float(xi[j]), x2 = to_float(xi[j + half]);
          store(o + j, round_as(round_as(x1 * to_float(c[j]), T()) + round_as(-x2 * to_float(s[j]), T()), T()));
          store(o + j + half,
                round_as(round_as(x2 * to_float(c[j + half]), T()) + round_as(x1 * to_float(s[j + half]), T()), T()));
        }
      }
    }
  });
}

torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const char* name = "rope";
  check(name, x, x);
  check(name, cos, x);
  check(name, sin, x);
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0, name,
              ": x must be [batch, tokens, heads, dim] with unit stride along an even dim, got ", x.sizes());
  TORCH_CHECK(cos.numel() == x.size(0) * x.size(1) * x.size(3) && sin.numel() == cos.numel(), name,
              ": cos and sin must hold [batch, tokens, dim] = [", x.size(0), ", ", x.size(1), ", ", x.size(3),
              "] values, got ", cos.sizes(), " and ", sin.sizes());
  const torch::Tensor c = cos.contiguous(), s = sin.contiguous();
  torch::Tensor out = torch::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.scalar_type() == at::kFloat) rope_rows(x, c.data_ptr<float>(), s.data_ptr<float>(), out.data_ptr<float>());
  else rope_rows(x, c.data_ptr<bf16>(), s.data_ptr<bf16>(), out.data_ptr<bf16>());
  return out;
}

#if defined(__AVX512F__)
constexpr bool ARGMAX = true;
inline __m512 widened16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widened16(const bf16* p) {  // bfloat16 is the top half of a float32: widened exactly
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// The index of the first maximum of row[0 .. V), or -1 where the row holds a NaN (torch's argmax takes a NaN
// as the maximum: the caller asks torch then). Each of 16 lanes keeps its own first maximum (a later value
// replaces it only where strictly greater); the row's first maximum is the smallest index among the lanes
// holding the largest value, then the tail, in order.
template <typename T>
int64_t row_argmax(const T* row, int64_t V) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_at = _mm512_setzero_si512();
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i sixteen = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  int64_t v = 0;
  for (; v + 16 <= V; v += 16) {
    const __m512 x = widened16(row + v);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __mmask16 greater = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, greater, x);
    best_at = _mm512_mask_mov_epi32(best_at, greater, at);
    at = _mm512_add_epi32(at, sixteen);
  }
  if (nan) return -1;
  float top = _mm512_reduce_max_ps(best);
  const __mmask16 holding = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  int64_t index = _mm512_mask_reduce_min_epi32(holding, best_at);
  for (; v < V; ++v) {
    const float x = to_float(row[v]);
    if (x != x) return -1;
    if (x > top) top = x, index = v;
  }
  return index;
}
#else
constexpr bool ARGMAX = false;
template <typename T>
int64_t row_argmax(const T*, int64_t) { return -1; }
#endif

// Per row of x [..., V] (float32 or bfloat16, V < 2^31), the index of its first maximum, -1 for a row holding
// a NaN: what torch's argmax(-1) gives (without a NaN), in one pass that reads bfloat16 as it lies instead of
// a float32 copy first.
std::vector<int64_t> argmax_rows(const torch::Tensor& x) {
  const char* name = "argmax_rows";
  TORCH_CHECK(ARGMAX, name, ": this build has no argmax (it needs AVX-512)");
  TORCH_CHECK(x.device().is_cpu(), name, ": a CPU tensor only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              ": float32 or bfloat16 only, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.size(-1) < (int64_t(1) << 31), name,
              ": the last dimension must hold 1 to 2^31 - 1 values, got ", x.sizes());
  const int64_t V = x.size(-1);
  const torch::Tensor rows = x.reshape({-1, V}).contiguous();
  std::vector<int64_t> out(rows.size(0));
  for (int64_t r = 0; r < rows.size(0); ++r)
    out[r] = x.scalar_type() == at::kFloat ? row_argmax(rows.data_ptr<float>() + r * V, V)
                                           : row_argmax(rows.data_ptr<bf16>() + r * V, V);
  return out;
}

}  // namespace

void bind_layer_ops(pybind11::module& m) {
  m.def("argmax_rows", &argmax_rows, py::call_guard<py::gil_scoped_release>(),
        "per row, the index of the first maximum over the last dimension (-1 for a row with a NaN)", py::arg("x"));
  m.def("argmax_supported", []() { return ARGMAX; }, "whether this build has argmax_rows (AVX-512)");
  m.def("add_rms_norm", &add_rms_norm, py::call_guard<py::gil_scoped_release>(),
        "(residual + delta, RMSNorm(residual + delta) * weight)", py::arg("residual"), py::arg("delta"),
        py::arg("weight"), py::arg("eps"));
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>(), "RMSNorm(x) * weight (None: 1)",
        py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("silu_mul", &silu_mul, py::call_guard<py::gil_scoped_release>(), "silu(gate) * up of [gate | up]",
        py::arg("gate_up"));
  m.def("rope", &rope, py::call_guard<py::gil_scoped_release>(), "x * cos + rotate_half(x) * sin",
        py::arg("x"), py::arg("cos"), py::arg("sin"));
}
