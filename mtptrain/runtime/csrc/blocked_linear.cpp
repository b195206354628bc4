// A linear layer's product x @ W.T (+ bias) over any number of rows, from the weight laid out once in blocks
// that the product reads front to back: decoding's 1 row, verification's 2 to 16 and a batch's hundreds alike.
//
// Layout (runtime/products.py makes it, `blocked`): W [O, K] becomes blocks [G, KP, 32, P], G = ceil(O / 32)
// groups of 32 output features, P = 2 for bfloat16 (pairs of inputs, as vdpbf16ps takes them) and 1 for
// float32, KP = ceil(K / P); blocks[g, p, i, e] = W[32 g + i, P p + e], zero past O and K. A group's weights
// are one contiguous run, and each step of the inner loop reads the next 128 bytes of it. A float32 product
// also takes bfloat16 blocks (a float32 weight whose values are all bfloat16): it widens each pair as it reads
// it and sums as over float32 blocks, bit for bit the same from half the bytes.
//
// The loop: for a group and a block of up to 12 rows, two (float32 on AVX2: four) vectors of 16 (8) float32
// sums per row, one per output feature; each step loads the group's next inputs of all 32 features, broadcasts
// each row's next input (pair) and multiply-adds it in. No horizontal sums, and the weights stream once per row
// block: at one row the product runs at the memory's speed (measured on a 2-core AMD EPYC, Zen 4, SmolLM2-135M's
// 30 layers in bfloat16: 8.0 ms for 1 to 8 rows against 13-15 ms for oneDNN's packed weights, and 85 ms against
// 95 ms for 160 rows).
//
// Each output element is one float32 sum over the inputs in order (pairs in order for bfloat16), then + bias,
// rounded once to the dtype (to nearest even, as torch rounds). The order depends on nothing but K: a row's
// result is the same bit for bit whatever other rows are computed with it, and by whichever thread. Decoding
// one token and verifying it among a draft give the same logits.
//
// Builds: bfloat16 needs avx512_bf16; float32 (over float32 or bfloat16 blocks) needs AVX-512 or AVX2 with
// FMA. `blocked_supports(dtype)` says which this build has (torch's products serve the rest).

#include <ATen/Parallel.h>
#include "torch_api.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "float_math.h"

namespace {

using namespace mtptrain_kernels;

constexpr int64_t GROUP = 32;   // output features per group
constexpr int ROW_BLOCK = 12;   // rows per pass over a group's weights, at most (register sums: 2 x 12 vectors)

// Where a pass multiplies each weight by several rows, it may ask for the weights PREFETCH_AHEAD bytes ahead of
// the 128 it reads (the group's later steps, then the next group's: a thread's groups lie one after another).
// The hardware's own prefetching keeps a one-row pass at the memory's speed, but once the multiply-adds of a few
// rows take a while per step, its requests may no longer run far enough ahead and the memory's latency adds to
// the compute instead of hiding under it. Whether that happens, and from how many rows, depends on the CPU:
// measured on a 2-core AMD EPYC Zen 5, SmolLM2-135M's 121 products in bfloat16, interleaved: 1 row 4.07 ms both
// ways, 4 rows 5.30 -> 4.84, 8 rows 6.57 -> 5.05, 12 rows 8.14 -> 5.27, 160 rows 50.4 -> 46.4; on a Zen 4 the
// same model's whole verification forwards ran faster without it (none / ahead, medians of paired calls: 2 rows
// 0.90, 4 rows 0.88-0.94, 8 rows 0.92-0.98, 10 rows 0.83-0.84; 11 and 12 rows 0.96-1.03: docs/runtime.md). So
// passes of at least `prefetch_from` rows prefetch (2 by default: every pass of several rows), set by the runtime
// from its own measurement of the loaded model's verification steps (runtime/prefetch.py). One-row passes never
// prefetch (it cost 1-5% on the Zen 5). Prefetching never changes a pass's sums, only its speed. Prefetching past
// a tensor's end is harmless (a prefetch does not fault).
constexpr int64_t PREFETCH_AHEAD = 8192;
std::atomic<int64_t> prefetch_from{2};  // set by blocked_prefetch_from (process-wide)
template <int RB, bool AHEAD = true>
inline void prefetch_ahead(const void* weights) {
  if constexpr (RB > 1 && AHEAD) {
    const char* at = static_cast<const char*>(weights) + PREFETCH_AHEAD;
    __builtin_prefetch(at, 0, 3);  // read, keep in every cache level (as _MM_HINT_T0)
    __builtin_prefetch(at + 64, 0, 3);
  }
}

inline void store_out(float* p, float v) { *p = v; }
inline void store_out(bf16* p, float v) { p->x = bf16_high(bf16_round(v)); }

#if defined(__AVX512BF16__)
constexpr bool BF16 = true;
// sums[j * 32 + i] = the dot product of row r0 + j with feature i of the group at `wg` ([KP, 32, 2]).
template <int RB, bool AHEAD>
inline void group_rows(const bf16* wg, const bf16* x, int64_t K, int64_t KP, int64_t r0, float* sums) {
  __m512 acc[2][RB];
#pragma GCC unroll 16
  for (int j = 0; j < RB; ++j) acc[0][j] = acc[1][j] = _mm512_setzero_ps();
  const bf16* xr[RB];
#pragma GCC unroll 16
  for (int j = 0; j < RB; ++j) xr[j] = x + (r0 + j) * K;
  const int64_t whole = K / 2;  // pairs read as one 32-bit word; an odd K's last input alone, with a zero
  for (int64_t p = 0; p < KP; ++p) {
    const bf16* wp = wg + p * 2 * GROUP;
    prefetch_ahead<RB, AHEAD>(wp);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + GROUP);
#pragma GCC unroll 16
    for (int j = 0; j < RB; ++j) {
      int32_t pair;
      if (p < whole) {
        std::memcpy(&pair, xr[j] + 2 * p, sizeof pair);
      } else {
        pair = int32_t(uint16_t(xr[j][2 * p].x));
      }
      const __m512bh xp = (__m512bh)_mm512_set1_epi32(pair);
      acc[0][j] = _mm512_dpbf16_ps(acc[0][j], w0, xp);
      acc[1][j] = _mm512_dpbf16_ps(acc[1][j], w1, xp);
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < RB; ++j) {
    _mm512_storeu_ps(sums + j * GROUP, acc[0][j]);
    _mm512_storeu_ps(sums + j * GROUP + 16, acc[1][j]);
  }
}
#else
constexpr bool BF16 = false;
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
constexpr bool F32 = true;
#if defined(__AVX512F__)
using lanes = __m512;
constexpr int WIDTH = 16;
inline lanes zero() { return _mm512_setzero_ps(); }
inline lanes load(const float* p) { return _mm512_loadu_ps(p); }
inline lanes load(const int8_t* p) {  // 16 int8 weights widened to float32 (exact): int8_linear.cpp
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline lanes broadcast(float v) { return _mm512_set1_ps(v); }
inline lanes mul_add(lanes a, lanes b, lanes c) { return _mm512_fmadd_ps(a, b, c); }
inline void save(float* p, lanes v) { _mm512_storeu_ps(p, v); }
constexpr int F32_ROWS = 8;
#else
using lanes = __m256;
constexpr int WIDTH = 8;
inline lanes zero() { return _mm256_setzero_ps(); }
inline lanes load(const float* p) { return _mm256_loadu_ps(p); }
inline lanes load(const int8_t* p) {  // 8 int8 weights widened to float32 (exact)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline lanes broadcast(float v) { return _mm256_set1_ps(v); }
inline lanes mul_add(lanes a, lanes b, lanes c) { return _mm256_fmadd_ps(a, b, c); }
inline void save(float* p, lanes v) { _mm256_storeu_ps(p, v); }
constexpr int F32_ROWS = 2;  // 4 x 2 sums, 4 weight vectors and a broadcast in AVX2's 16 registers
#endif
constexpr int VECTORS = GROUP / WIDTH;

// As above for float32, the group at `wg` being [K, 32] of float32, or of int8 (csrc/int8_linear.cpp: each
// weight widened to float32 as it is read, exactly, the feature's scale applied by `run`); rows in blocks of
// F32_ROWS.
template <int RB, bool AHEAD, typename W>
inline void group_rows_f32(const W* wg, const float* x, int64_t K, int64_t r0, float* sums) {
  constexpr int64_t EVERY = 128 / (GROUP * sizeof(W));  // inputs per 128 bytes of weights: the lines prefetched
  lanes acc[VECTORS][RB];
#pragma GCC unroll 16
  for (int v = 0; v < VECTORS; ++v)
#pragma GCC unroll 16
    for (int j = 0; j < RB; ++j) acc[v][j] = zero();
  for (int64_t k = 0; k < K; ++k) {
    if (k % EVERY == 0) prefetch_ahead<RB, AHEAD>(wg + k * GROUP);
    lanes w[VECTORS];
#pragma GCC unroll 16
    for (int v = 0; v < VECTORS; ++v) w[v] = load(wg + k * GROUP + v * WIDTH);
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

// As group_rows_f32 for weights held in bfloat16 ([KP, 32, 2], the bfloat16 layout) and float32 inputs: each
// word of the group's next step holds one feature's inputs 2p and 2p + 1, widened to float32 by a shift (2p,
// the low half) and a mask (2p + 1); then multiply-adds in input order, as the float32 loop does. Widening
// is exact, so where W holds bfloat16 values this gives the float32 loop's sums bit for bit, reading half
// the bytes.
#if defined(__AVX512F__)
inline lanes low_half(__m512i words) { return _mm512_castsi512_ps(_mm512_slli_epi32(words, 16)); }
inline lanes high_half(__m512i words) {
  return _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}
inline __m512i load_words(const bf16* p) { return _mm512_loadu_si512(p); }
#else
inline lanes low_half(__m256i words) { return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16)); }
inline lanes high_half(__m256i words) {
  return _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}
inline __m256i load_words(const bf16* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
#endif

template <int RB, bool AHEAD>
inline void group_rows_widened(const bf16* wg, const float* x, int64_t K, int64_t KP, int64_t r0, float* sums) {
  lanes acc[VECTORS][RB];
#pragma GCC unroll 16
  for (int v = 0; v < VECTORS; ++v)
#pragma GCC unroll 16
    for (int j = 0; j < RB; ++j) acc[v][j] = zero();
  const int64_t whole = K / 2;  // an odd K's last step has input 2p alone (its high halves are zero padding)
  for (int64_t p = 0; p < whole; ++p) {
    const bf16* wp = wg + p * 2 * GROUP;
    prefetch_ahead<RB, AHEAD>(wp);
#pragma GCC unroll 16
    for (int v = 0; v < VECTORS; ++v) {
      const auto words = load_words(wp + v * 2 * WIDTH);
      const lanes low = low_half(words), high = high_half(words);
#pragma GCC unroll 16
      for (int j = 0; j < RB; ++j) {
        acc[v][j] = mul_add(low, broadcast(x[(r0 + j) * K + 2 * p]), acc[v][j]);
        acc[v][j] = mul_add(high, broadcast(x[(r0 + j) * K + 2 * p + 1]), acc[v][j]);
      }
    }
  }
  if (whole < KP) {
    const bf16* wp = wg + whole * 2 * GROUP;
#pragma GCC unroll 16
    for (int v = 0; v < VECTORS; ++v) {
      const lanes low = low_half(load_words(wp + v * 2 * WIDTH));
#pragma GCC unroll 16
      for (int j = 0; j < RB; ++j) acc[v][j] = mul_add(low, broadcast(x[(r0 + j) * K + 2 * whole]), acc[v][j]);
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < RB; ++j)
#pragma GCC unroll 16
    for (int v = 0; v < VECTORS; ++v) save(sums + j * GROUP + v * WIDTH, acc[v][j]);
}
#else
constexpr bool F32 = false;
constexpr int F32_ROWS = 1;
#endif

// The sums of rows r0 .. r0 + rb for one bfloat16 group (rb <= ROW_BLOCK), prefetching ahead or not (AHEAD).
template <bool AHEAD>
void group_block_bf16(const bf16* wg, const bf16* x, int64_t K, int64_t KP, int64_t r0, int64_t rb, float* sums) {
#if defined(__AVX512BF16__)
  switch (rb) {
    case 12: group_rows<12, AHEAD>(wg, x, K, KP, r0, sums); break;
    case 11: group_rows<11, AHEAD>(wg, x, K, KP, r0, sums); break;
    case 10: group_rows<10, AHEAD>(wg, x, K, KP, r0, sums); break;
    case 9: group_rows<9, AHEAD>(wg, x, K, KP, r0, sums); break;
    case 8: group_rows<8, AHEAD>(wg, x, K, KP, r0, sums); break;
    case 7: group_rows<7, AHEAD>(wg, x, K, KP, r0, sums); break;
    case 6: group_rows<6, AHEAD>(wg, x, K, KP, r0, sums); break;
    case 5: group_rows<5, AHEAD>(wg, x, K, KP, r0, sums); break;
    case 4: group_rows<4, AHEAD>(wg, x, K, KP, r0, sums); break;
    case 3: group_rows<3, AHEAD>(wg, x, K, KP, r0, sums); break;
    case 2: group_rows<2, AHEAD>(wg, x, K, KP, r0, sums); break;
    default: group_rows<1, AHEAD>(wg, x, K, KP, r0, sums); break;
  }
#endif
}

// The sums of rows r0 .. r0 + rb for one group (rb <= ROW_BLOCK), by the build's loop for T.
void group_block(const bf16* wg, const bf16* x, int64_t K, int64_t KP, int64_t r0, int64_t rb, float* sums) {
  if (rb >= prefetch_from.load(std::memory_order_relaxed))
    group_block_bf16<true>(wg, x, K, KP, r0, rb, sums);
  else
    group_block_bf16<false>(wg, x, K, KP, r0, rb, sums);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// One block of `n` rows from row r: rows(block, ahead, r, at), `block` a std::integral_constant of the block's
// rows and `ahead` a std::bool_constant, AHEAD (the loops take both as template arguments).
template <bool AHEAD, typename Rows>
inline void row_block(int64_t n, int64_t r, float* at, Rows rows) {
  const std::bool_constant<AHEAD> ahead;
  switch (n) {
#if defined(__AVX512F__)
    case 8: rows(std::integral_constant<int, 8>{}, ahead, r, at); break;
    case 7: rows(std::integral_constant<int, 7>{}, ahead, r, at); break;
    case 6: rows(std::integral_constant<int, 6>{}, ahead, r, at); break;
    case 5: rows(std::integral_constant<int, 5>{}, ahead, r, at); break;
    case 4: rows(std::integral_constant<int, 4>{}, ahead, r, at); break;
    case 3: rows(std::integral_constant<int, 3>{}, ahead, r, at); break;
#endif
    case 2: rows(std::integral_constant<int, 2>{}, ahead, r, at); break;
    default: rows(std::integral_constant<int, 1>{}, ahead, r, at); break;
  }
}

// Rows r0 .. r0 + rb of a group's float32 sums in blocks of up to F32_ROWS. The first block streams the group's
// weights from memory and prefetches ahead; the others read them again from the caches, where prefetching the
// next group's weights early only displaces this one's (AVX2 float32 weights, blocks of 2, 160 rows: 8% slower).
template <typename Rows>
inline void in_row_blocks(int64_t r0, int64_t rb, float* sums, Rows rows) {
  for (int64_t r = r0; r < r0 + rb; r += F32_ROWS) {
    const int64_t n = std::min<int64_t>(F32_ROWS, r0 + rb - r);
    if (r == r0 && rb >= prefetch_from.load(std::memory_order_relaxed))
      row_block<true>(n, r, sums, rows);
    else
      row_block<false>(n, r, sums + (r - r0) * GROUP, rows);
  }
}
#endif

// Float32 inputs over float32 or int8 weights.
template <typename W>
void group_block(const W* wg, const float* x, int64_t K, int64_t, int64_t r0, int64_t rb, float* sums) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  in_row_blocks(r0, rb, sums, [&](auto block, auto ahead, int64_t r, float* at) {
    group_rows_f32<decltype(block)::value, decltype(ahead)::value>(wg, x, K, r, at);
  });
#endif
}

// Float32 inputs over weights held in bfloat16, widened as they are read.
void group_block(const bf16* wg, const float* x, int64_t K, int64_t KP, int64_t r0, int64_t rb, float* sums) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  in_row_blocks(r0, rb, sums, [&](auto block, auto ahead, int64_t r, float* at) {
    group_rows_widened<decltype(block)::value, decltype(ahead)::value>(wg, x, K, KP, r, at);
  });
#endif
}

// W: the blocks' element type, X: the inputs', T: the outputs'. `scales` (int8 weights only, else null): each
// feature's sum is multiplied by its scale before the bias is added.
template <typename W, typename X, typename T>
void run(const W* w, const X* x, const float* bias, T* out, int64_t R, int64_t O, int64_t K, int64_t KP,
         int64_t G, const float* scales = nullptr) {
  // Threads take runs of whole groups. A group of the smallest layers (K = 576: 36 KB in bfloat16) is a few
  // microseconds of streaming, so a run of one group is not too fine against a parallel region's ~1 us.
  // Rows in as few passes over a group as ROW_BLOCK allows, of about equal size: 9 rows (a tree of 8 and its
  // pending token) in one pass, not 8 and 1. A second pass reads the group from L2 but pays its loads and its
  // loop again: measured over SmolLM2's 121 products in bfloat16 on Zen 4, 9 rows took 11.09 ms in passes of 8
  // and 1, 10.25 ms in one (1 to 8 rows: 9.6-10.2 ms).
  const int64_t passes = (R + ROW_BLOCK - 1) / ROW_BLOCK, per_pass = (R + passes - 1) / passes;
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    float sums[ROW_BLOCK * GROUP];
    for (int64_t g = g0; g < g1; ++g) {
      const W* wg = w + g * KP * (sizeof(W) == 2 ? 2 : 1) * GROUP;
      const int64_t o0 = g * GROUP, n = std::min<int64_t>(GROUP, O - o0);
      for (int64_t r0 = 0; r0 < R; r0 += per_pass) {
        const int64_t rb = std::min<int64_t>(per_pass, R - r0);
        group_block(wg, x, K, KP, r0, rb, sums);
        for (int64_t j = 0; j < rb; ++j)
          for (int64_t i = 0; i < n; ++i) {
            const float s = scales != nullptr ? sums[j * GROUP + i] * scales[o0 + i] : sums[j * GROUP + i];
            store_out(out + (r0 + j) * O + o0 + i, bias != nullptr ? s + bias[o0 + i] : s);
          }
      }
    }
  });
}

// The bias as a contiguous float32 [O] (checked against the O features), or an undefined tensor for none.
torch::Tensor float_bias(const c10::optional<torch::Tensor>& bias, int64_t O, const char* name) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->numel() == O, name, ": the bias has ", bias->numel(), " values for ", O, " features");
  return bias->to(at::kFloat).contiguous();
}

// The product's output for x [..., K]: [..., O] in x's dtype.
torch::Tensor output_for(const torch::Tensor& x, int64_t O) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = O;
  return torch::empty(shape, x.options());
}

bool supports(at::ScalarType dtype) {
  return (dtype == at::kBFloat16 && BF16) || (dtype == at::kFloat && F32);
}

// x [..., K] (float32 or bfloat16), blocks [G, KP, 32, P] of x's dtype, or of bfloat16 for a float32 x (the
// layout above), bias [O] of any float dtype or None. Returns x @ W.T + bias as [..., O] in x's dtype.
torch::Tensor blocked_linear(const torch::Tensor& x, const torch::Tensor& blocks, const c10::optional<torch::Tensor>& bias,
                             int64_t out_features) {
  const char* name = "blocked_linear";
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), name, ": CPU tensors only");
  const bool widened = x.scalar_type() == at::kFloat && blocks.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.scalar_type() == blocks.scalar_type() || widened, name, ": x (", x.scalar_type(),
              ") and the blocks (", blocks.scalar_type(), ") must share a dtype, or be float32 over bfloat16 blocks");
  TORCH_CHECK(supports(x.scalar_type()), name, ": this build has no ", x.scalar_type(),
              " product (bfloat16 needs avx512_bf16; float32 AVX-512 or AVX2 with FMA)");
  const int64_t P = blocks.scalar_type() == at::kBFloat16 ? 2 : 1;
  TORCH_CHECK(blocks.dim() == 4 && blocks.size(2) == GROUP && blocks.size(3) == P && blocks.is_contiguous(), name,
              ": the blocks must be a contiguous [groups, inputs / ", P, ", ", GROUP, ", ", P, "], got ", blocks.sizes());
  const int64_t G = blocks.size(0), KP = blocks.size(1), K = x.size(-1), O = out_features;
  TORCH_CHECK((K + P - 1) / P == KP, name, ": x has ", K, " features, the blocks hold ", KP * P);
  TORCH_CHECK(O > (G - 1) * GROUP && O <= G * GROUP, name, ": ", O, " output features do not fill ", G,
              " groups of ", GROUP);
  const torch::Tensor rows = x.reshape({-1, K}).contiguous();
  const int64_t R = rows.size(0);
  const torch::Tensor bias32 = float_bias(bias, O, name);
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  torch::Tensor out = output_for(x, O);
  if (R == 0) return out;
  if (x.scalar_type() == at::kBFloat16)
    run(blocks.data_ptr<bf16>(), rows.data_ptr<bf16>(), b, out.data_ptr<bf16>(), R, O, K, KP, G);
  else if (widened)
    run(blocks.data_ptr<bf16>(), rows.data_ptr<float>(), b, out.data_ptr<float>(), R, O, K, KP, G);
  else
    run(blocks.data_ptr<float>(), rows.data_ptr<float>(), b, out.data_ptr<float>(), R, O, K, KP, G);
  return out;
}

}  // namespace

void bind_blocked_linear(pybind11::module& m) {
  m.def("blocked_linear", &blocked_linear, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "x @ W.T + bias from W laid out in blocks of 32 output features (runtime/products.py: blocked)",
        pybind11::arg("x"), pybind11::arg("blocks"), pybind11::arg("bias"), pybind11::arg("out_features"));
  m.def("blocked_supports", [](bool bfloat16) { return supports(bfloat16 ? at::kBFloat16 : at::kFloat); },
        "whether this build has the blocked product for bfloat16 (True) or float32 (False)", pybind11::arg("bfloat16"));
  m.def("blocked_prefetch_from", [](int64_t rows) {
          TORCH_CHECK(rows >= 2, "blocked_prefetch_from: passes of one row never prefetch; rows must be >= 2, not ",
                      rows);
          prefetch_from.store(rows);
        },
        "passes over at least `rows` rows prefetch the weights PREFETCH_AHEAD bytes ahead (2: every pass of "
        "several rows; above 12, none)", pybind11::arg("rows"));
  m.def("blocked_prefetching_from", []() { return prefetch_from.load(); },
        "the fewest rows of a pass that prefetches (blocked_prefetch_from)");
}
