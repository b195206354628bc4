// Decode attention over a batch of rows that each take one new token: row r's query heads attend over the
// first lengths[r] positions of its own keys and values, and over nothing past them (never read: the cache's
// tail may hold anything). Built by mtptrain/runtime/native_kernels.py with -O3 -march=native -fopenmp.
//
// decode_attention(q, keys, values, lengths) -> out
//   q        [R, H, 1, D]         any strides, float32 or bfloat16
//   keys     [Rcap, Hkv, C, D]    q's dtype, Rcap >= R (rows past R are not read); strides [*, *, D, 1]: a
//                                 cache, or a view of its first C positions
//   values   [Rcap, Hkv, C, D]    likewise, with the keys' strides
//   lengths  [R] int64            1 <= lengths[r] <= C
//   returns  [R, H, 1, D]         q's dtype: softmax(q.k * D^-0.5) . v, accumulated in float32
//
// causal_attention(q, keys, values) -> out: one row's T new tokens [T, H, D], causally after the cache's first
// S - T positions (a chain verified after a prefix), each token computed as decode_attention computes a row.
//
// tree_attention(q, keys, values, lengths, gather, gathered) -> out: a verified tree's nodes [T, H, D] after one
// row's cache, each over the row's prefix and then its ancestors and itself, gathered: as decode_attention
// computes a row holding that sequence.
//
// step_attention(q, k_new, v_new, keys, values, tokens, rows, positions, out): one length band's part of a
// batched step (mtptrain/runtime/batch.py), whose tokens are its rows' new tokens and the prompt chunks of
// rows just given a request. Entry m writes token tokens[m]'s key and value at position positions[m] of cache
// row rows[m], then attends over that row's positions 0 .. positions[m] into out[tokens[m]]: a chunk's tokens
// attend causally among themselves, and the step needs no mask, no index tensor of its own and no copy.
//
// One work item is an (entry, kv head), an entry being a row of decode_attention: the G = H / Hkv query heads of its group share every key and value
// loaded. Two passes per item: the keys give G x n float32 scores (a per-thread buffer, a few KB, in L1), a
// max-subtracted softmax turns them into weights in place, and the values are summed under them. Keys and
// values are each read once, in order. The threads (at::parallel_for, torch's thread count) take runs of
// items of about equal length.

#include "torch_api.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DECODE_ATTENTION_VECTORS 1  // 256-bit vectors and FMA: the scores' code, shared by both vector paths
#endif

#include "float_math.h"

namespace {

using namespace mtptrain_kernels;

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// A run of memory to bring into L2 ahead of its use, a few cache lines at a time, while the work before it
// computes: a row's values during its key pass, the next item's keys during the value pass. The hardware
// prefetcher finds a stream only after its first misses, and an item's keys (a few KB to a few hundred) start
// a new stream; fetching them ahead keeps more of the memory's requests in flight.
struct Ahead {
  const char* at = nullptr;
  const char* end = nullptr;

  void set(const void* start, int64_t bytes) {
    at = static_cast<const char*>(start);
    end = at + bytes;
  }
  inline void step(int64_t lines) {
    for (int64_t i = 0; i < lines && at < end; ++i, at += 64) __builtin_prefetch(at, 0, 2);
  }
  // The same, out of line: for loops the compiler vectorises, whose code (and so the order of their sums)
  // must not depend on whether anything is left to fetch.
  __attribute__((noinline)) void step_apart(int64_t lines) { step(lines); }
};

// Per-thread scratch, sized once per parallel chunk for the longest row.
struct Scratch {
  std::vector<float> q;       // G x D: the group's queries in float32
  std::vector<bf16> q16;      // G x D: the same in bfloat16 (the bf16 dot-product instruction reads these)
  std::vector<float> scores;  // G x stride: scores, then softmax weights
  std::vector<float> acc;     // G x D: the weighted sum of values
  std::vector<float> row;     // 16 x D floats: a row's last block of keys zero-padded, or keys widened
  std::vector<float> sums;    // G: the softmax denominators
  int64_t stride = 0;         // positions per head in `scores`, a multiple of 16
  Ahead values_ahead;         // this item's values, fetched during its key pass
  Ahead keys_ahead;           // the next item's keys, fetched during this item's value pass

  Scratch(int64_t G, int64_t D, int64_t C)
      : q(G * D), q16(G * D), scores(G * round_up(C, 16)), acc(G * D), row(16 * D), sums(G),
        stride(round_up(C, 16)) {}
};

// Positions [begin, end) of an item's sequence, whose keys and values lie in runs of D from k and v (the
// rows of position `begin`). An item's sequence is one span, its cache row's first positions, or two: a tree
// node's first span ends at a multiple of 16 and its second holds the rest of the row's prefix and then the
// node's ancestors, gathered (tree_attention).
template <typename T>
struct Span {
  const T* k;
  const T* v;
  int64_t begin, end;
};

// ---------------------------------------------------------------------------------------------------------
// Portable path: any D, plain loops (vectorised by the compiler). Used for D other than 64 and 128, and for
// every D on CPUs without AVX2 and FMA.

template <int DC, typename T>  // DC: D known at compile time, or 0 to read it from `dim`
void item_portable(int64_t G, int64_t dim, const Span<T>* spans, int spans_count, float scale, Scratch& s) {
  const int64_t D = DC ? DC : dim;
  const int64_t n = spans[spans_count - 1].end;
  const int64_t lines = (D * int64_t(sizeof(T)) + 63) / 64;  // per position
  float* kf = s.row.data();
  for (int i = 0; i < spans_count; ++i) {
    const T* k = spans[i].k;
    for (int64_t t = spans[i].begin; t < spans[i].end; ++t) {
      if (t % 16 == 0) s.values_ahead.step_apart(16 * lines);
      const T* key = k + (t - spans[i].begin) * D;
      for (int64_t j = 0; j < D; ++j) kf[j] = to_float(key[j]);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = s.q.data() + g * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < D; ++j) dot += qg[j] * kf[j];
        s.scores[g * s.stride + t] = dot * scale;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* w = s.scores.data() + g * s.stride;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) top = std::max(top, w[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      w[t] = exp_clamped(w[t] - top);
      sum += w[t];
    }
    s.sums[g] = sum;
  }
  std::fill(s.acc.begin(), s.acc.end(), 0.0f);
  for (int i = 0; i < spans_count; ++i) {
    for (int64_t t = spans[i].begin; t < spans[i].end; ++t) {
      if (t % 16 == 0) s.keys_ahead.step_apart(16 * lines);
      const T* value = spans[i].v + (t - spans[i].begin) * D;
      for (int64_t j = 0; j < D; ++j) kf[j] = to_float(value[j]);
      for (int64_t g = 0; g < G; ++g) {
        const float p = s.scores[g * s.stride + t];
        float* a = s.acc.data() + g * D;
#pragma omp simd
        for (int64_t j = 0; j < D; ++j) a[j] += p * kf[j];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Vector paths for D = 64 and 128: AVX-512, and AVX2 with FMA. Both sum the scores over 256-bit vectors: on
// an AMD EPYC (Zen 4), which runs a 512-bit operation as two 256-bit halves, the same over 512-bit vectors
// (twice the shuffles per score) made the whole kernel 1.2x (float32) to 1.3x (bfloat16) slower over caches
// larger than L3. The AVX-512 path's value pass accumulates in 512-bit vectors (as many products per
// instruction, half the registers); the AVX2 path's in 256-bit ones, a 64-element slice of a head at a time.

#ifdef DECODE_ATTENTION_VECTORS

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define DECODE_ATTENTION_BF16_DOT 1  // vdpbf16ps: bfloat16 pairs multiplied and summed into float32 lanes
#endif

// The 8 sums of 8 vectors' lanes as one vector, in 7 adds and 14 shuffles instead of 8 horizontal sums.
// Lane 4h + j of the result is the sum of v[2j + h]: callers put position p's vector in slot `slot8(p)`.
inline __m256 sum_each8(const __m256* v) {
  __m256 w[4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // 128-bit half h of w[i]: four partial sums of v[2i + h]
    w[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  const __m256 e0 = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], 0x44), _mm256_shuffle_ps(w[0], w[1], 0xEE));
  const __m256 e1 = _mm256_add_ps(_mm256_shuffle_ps(w[2], w[3], 0x44), _mm256_shuffle_ps(w[2], w[3], 0xEE));
  return _mm256_add_ps(_mm256_shuffle_ps(e0, e1, 0x88), _mm256_shuffle_ps(e0, e1, 0xDD));
}

constexpr int slot8(int position) { return (position % 4) * 2 + position / 4; }  // 4h + j -> 2j + h

// Eight lanes whose sum is q . row.
template <int D>
inline __m256 dot8(const __m256* q, const float* row) {
  __m256 acc = _mm256_mul_ps(q[0], _mm256_loadu_ps(row));
#pragma GCC unroll 16
  for (int j = 1; j < D / 8; ++j) acc = _mm256_fmadd_ps(q[j], _mm256_loadu_ps(row + 8 * j), acc);
  return acc;
}

#ifdef DECODE_ATTENTION_BF16_DOT
template <int D>
inline __m256 dot8(const __m256bh* q, const bf16* row) {
  // Products of bfloat16 are exact in float32, so this is the arithmetic of converting and using FMAs, but
  // for subnormal inputs, which the instruction flushes to zero.
  __m256 acc = _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int j = 0; j < D / 16; ++j)
    acc = _mm256_dpbf16_ps(acc, q[j], (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * j)));
  return acc;
}
#endif

// Scores of 16 positions (rows of `block`, D apart) for each of the G queries, times `scale`.
template <int D, typename Q, typename K>
void score_block(int64_t G, const Q* q, const K* block, float* scores, int64_t stride, __m256 vscale) {
  constexpr int W = D / (sizeof(K) == 2 ? 16 : 8);  // 256-bit vectors of the query
  using Vec = std::conditional_t<sizeof(K) == 2, __m256bh, __m256>;
  for (int64_t g = 0; g < G; ++g) {
    Vec qv[W];
#pragma GCC unroll 16
    for (int j = 0; j < W; ++j) std::memcpy(&qv[j], q + g * D + j * (32 / sizeof(Q)), 32);
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      __m256 part[8];
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) part[slot8(p)] = dot8<D>(qv, block + (8 * half + p) * D);
      _mm256_storeu_ps(scores + g * stride + 8 * half, _mm256_mul_ps(sum_each8(part), vscale));
    }
  }
}

// A block's m <= 16 rows of bfloat16 keys (D apart from k) widened to float32 rows of `block`, zeros after them.
#ifdef __AVX512F__
inline __m512 load16(const bf16* p) {  // 16 bfloat16 widened to float32
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

template <int D>
inline void widen_keys(const bf16* k, int64_t m, float* block) {
  for (int64_t i = 0; i < 16; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < D / 16; ++j)
      _mm512_storeu_ps(block + i * D + 16 * j, i < m ? load16(k + i * D + 16 * j) : _mm512_setzero_ps());
  }
}
#else
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {  // 8 bfloat16 widened to float32
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

template <int D>
inline void widen_keys(const bf16* k, int64_t m, float* block) {
  for (int64_t i = 0; i < 16; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < D / 8; ++j)
      _mm256_storeu_ps(block + i * D + 8 * j, i < m ? load8(k + i * D + 8 * j) : _mm256_setzero_ps());
  }
}
#endif

// Pass 1: scores[g][t] = q_g . k_t * scale, 16 positions at a time, each block of keys read from memory
// once and by the G queries from L1.
template <int D, typename T>
void key_scores(int64_t G, const Span<T>& span, float scale, Scratch& s) {
  constexpr int64_t row_bytes = D * sizeof(T);
#ifdef DECODE_ATTENTION_BF16_DOT
  constexpr bool direct = true;  // float32 keys, or bfloat16 ones with vdpbf16ps: read where they lie
#else
  constexpr bool direct = std::is_same_v<T, float>;
#endif
  const __m256 vscale = _mm256_set1_ps(scale);
  const T* k = span.k;
  for (int64_t t0 = span.begin; t0 < span.end; t0 += 16) {
    s.values_ahead.step(16 * row_bytes / 64);
    const int64_t m = std::min<int64_t>(16, span.end - t0);
    float* scores = s.scores.data() + t0;
    if constexpr (direct) {
      const T* block = k + (t0 - span.begin) * D;
      if (m < 16) {  // the row's last block: its positions, then zeros (what lies past the row is never read)
        T* padded = reinterpret_cast<T*>(s.row.data());
        std::memcpy(padded, block, m * row_bytes);
        std::memset(padded + m * D, 0, (16 - m) * row_bytes);
        block = padded;
      }
      if constexpr (std::is_same_v<T, float>) score_block<D>(G, s.q.data(), block, scores, s.stride, vscale);
#ifdef DECODE_ATTENTION_BF16_DOT
      else score_block<D>(G, s.q16.data(), block, scores, s.stride, vscale);
#endif
    } else {  // bfloat16 keys without vdpbf16ps: widened to float32 once, into `row`
      float* block = s.row.data();
      widen_keys<D>(k + (t0 - span.begin) * D, m, block);
      score_block<D>(G, s.q.data(), static_cast<const float*>(block), scores, s.stride, vscale);
    }
  }
}

#ifdef __AVX512F__

// exp(x) for x <= 0, 16 lanes: as exp_clamped (float_math.h), with the power of two applied by scalef.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  // max(c, x) returns x when x is NaN
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 first_lanes(int64_t count) {  // lanes 0 .. count-1 (count <= 16)
  return count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
}

// Scores to unnormalised softmax weights in place (lanes past n set to 0), and their sums.
inline void softmax_rows(int64_t G, int64_t n, Scratch& s) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < G; ++g) {
    float* w = s.scores.data() + g * s.stride;
    __m512 top = minus_inf;
    for (int64_t t = 0; t < n; t += 16)
      top = _mm512_max_ps(top, _mm512_mask_loadu_ps(minus_inf, first_lanes(n - t), w + t));
    const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
      const __m512 e = _mm512_maskz_mov_ps(first_lanes(n - t), exp16(_mm512_sub_ps(_mm512_loadu_ps(w + t), vmax)));
      _mm512_storeu_ps(w + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    s.sums[g] = _mm512_reduce_add_ps(sum);
  }
}

// One row of values as D / 16 float32 vectors. bfloat16 rows come in a pair order: each 32-bit lane holds
// elements 2i and 2i + 1, which a shift and a mask turn into float32 (two operations per 32 elements, where
// widening takes four); the accumulators keep that order, `unpair` restores the natural one at the end.
template <int D>
inline void load_values(const float* row, __m512* x) {
#pragma GCC unroll 8
  for (int j = 0; j < D / 16; ++j) x[j] = _mm512_loadu_ps(row + 16 * j);
}
template <int D>
inline void load_values(const bf16* row, __m512* x) {
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
#pragma GCC unroll 4
  for (int j = 0; j < D / 32; ++j) {
    const __m512i pairs = _mm512_loadu_si512(row + 32 * j);
    x[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));           // elements 32j + 2i
    x[2 * j + 1] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));      // elements 32j + 2i + 1
  }
}

template <int D>
inline void unpair(float* acc) {  // [even 16 | odd 16] per 32 elements back to their order
  const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int j = 0; j < D / 32; ++j) {
    const __m512 even = _mm512_loadu_ps(acc + 32 * j), odd = _mm512_loadu_ps(acc + 32 * j + 16);
    _mm512_storeu_ps(acc + 32 * j, _mm512_permutex2var_ps(even, low, odd));
    _mm512_storeu_ps(acc + 32 * j + 16, _mm512_permutex2var_ps(even, high, odd));
  }
}

// Pass 2 for NG query heads (g0 ..): acc[g] += sum over t in [t0, t1) of w[g][t] * v_t, the NG x D
// accumulators held in registers (NG * D / 16 <= 16 of the 32), each row of values (position t0's at v)
// loaded once for them.
template <int D, int NG, typename T>
void add_values(int64_t g0, const T* v, int64_t t0, int64_t t1, Scratch& s) {
  constexpr int W = D / 16;
  __m512 a[NG][W];
  const float* w[NG];
#pragma GCC unroll 8
  for (int g = 0; g < NG; ++g) {
    w[g] = s.scores.data() + (g0 + g) * s.stride;
#pragma GCC unroll 8
    for (int j = 0; j < W; ++j) a[g][j] = _mm512_loadu_ps(s.acc.data() + (g0 + g) * D + 16 * j);
  }
  for (int64_t t = t0; t < t1; ++t) {
    s.keys_ahead.step(D * sizeof(T) / 64);
    __m512 x[W];
    load_values<D>(v + (t - t0) * D, x);
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) {
      const __m512 p = _mm512_set1_ps(w[g][t]);
#pragma GCC unroll 8
      for (int j = 0; j < W; ++j) a[g][j] = _mm512_fmadd_ps(p, x[j], a[g][j]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < NG; ++g) {
#pragma GCC unroll 8
    for (int j = 0; j < W; ++j) _mm512_storeu_ps(s.acc.data() + (g0 + g) * D + 16 * j, a[g][j]);
  }
}

template <int D, typename T>
void add_values_heads(int64_t g0, int64_t count, const T* v, int64_t t0, int64_t t1, Scratch& s) {
  static_assert(D == 64 || D == 128, "");
  switch (count) {  // at most 16 accumulator registers: 4 heads of 64, 2 of 128
    case 1: return add_values<D, 1>(g0, v, t0, t1, s);
    case 2: return add_values<D, 2>(g0, v, t0, t1, s);
    case 3: if constexpr (D == 64) return add_values<D, 3>(g0, v, t0, t1, s); break;
    case 4: if constexpr (D == 64) return add_values<D, 4>(g0, v, t0, t1, s); break;
  }
  TORCH_CHECK(false, "decode_attention: internal error, ", count, " heads in one value pass");
}

// The spans' keys and values in order: a head's sums run over the positions in the same order, and stop only to
// be stored and loaded again, whatever the spans, so an item split in two spans sums as one would.
template <int D, typename T>
void item_avx512(int64_t G, const Span<T>* spans, int spans_count, float scale, Scratch& s) {
  for (int i = 0; i < spans_count; ++i) key_scores<D>(G, spans[i], scale, s);
  softmax_rows(G, spans[spans_count - 1].end, s);
  std::fill(s.acc.begin(), s.acc.end(), 0.0f);
  constexpr int64_t per_pass = D == 64 ? 4 : 2;
  for (int i = 0; i < spans_count; ++i) {
    const Span<T>& span = spans[i];
    if (G <= per_pass) {
      add_values_heads<D>(0, G, span.v, span.begin, span.end, s);
      continue;
    }
    // More heads than registers hold: blocks of positions small enough to stay in L1 while each group of
    // heads reads them, so the values still come from memory once.
    constexpr int64_t block = 16384 / (D * sizeof(T));
    for (int64_t t0 = span.begin; t0 < span.end; t0 += block) {
      const int64_t t1 = std::min(span.end, t0 + block);
      const T* v = span.v + (t0 - span.begin) * D;
      for (int64_t g0 = 0; g0 < G; g0 += per_pass) add_values_heads<D>(g0, std::min(per_pass, G - g0), v, t0, t1, s);
    }
  }
  if constexpr (std::is_same_v<T, bf16>)
    for (int64_t g = 0; g < G; ++g) unpair<D>(s.acc.data() + g * D);
}

#else  // AVX2 and FMA without AVX-512

// exp(x) for x <= 0, 8 lanes: as exp_clamped (float_math.h): the same polynomial, 2^n put in the exponent bits.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // max(c, x) returns x when x is NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // n in [-126, 0] here: 2^n is a normal float32 whose exponent bits are n + 127
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline __m256 first_lanes(int64_t count) {  // all bits set in lanes 0 .. count-1 (count >= 1), clear above
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int32_t c = int32_t(std::min<int64_t>(count, 8));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(c), lane));
}

inline float reduce_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float reduce_add8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// Scores to unnormalised softmax weights in place (lanes past n up to the next multiple of 8 set to 0: the
// buffer's stride is a multiple of 16), and their sums.
inline void softmax_rows(int64_t G, int64_t n, Scratch& s) {
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < G; ++g) {
    float* w = s.scores.data() + g * s.stride;
    __m256 top = minus_inf;
    for (int64_t t = 0; t < n; t += 8)
      top = _mm256_max_ps(top, _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(w + t), first_lanes(n - t)));
    const __m256 vmax = _mm256_set1_ps(reduce_max8(top));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t += 8) {
      const __m256 e = _mm256_and_ps(first_lanes(n - t), exp8(_mm256_sub_ps(_mm256_loadu_ps(w + t), vmax)));
      _mm256_storeu_ps(w + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    s.sums[g] = reduce_add8(sum);
  }
}

// Pass 2 for a 64-element slice of query head g's output: acc[g][64c ..] += sum over t in [t0, t1) of
// w[g][t] * v_t[64c ..], its eight 256-bit accumulators in registers (of AVX2's 16), each value read from L1
// (the caller's block of positions) straight into its FMA.
template <int D, typename T>
void add_value_slice(int64_t g, int64_t c, const T* v, int64_t t0, int64_t t1, Scratch& s) {
  __m256 a[8];
  float* acc = s.acc.data() + g * D + 64 * c;
  const float* w = s.scores.data() + g * s.stride;
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) a[j] = _mm256_loadu_ps(acc + 8 * j);
  for (int64_t t = t0; t < t1; ++t) {
    const __m256 p = _mm256_set1_ps(w[t]);
    const T* row = v + (t - t0) * D + 64 * c;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(p, load8(row + 8 * j), a[j]);
  }
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) _mm256_storeu_ps(acc + 8 * j, a[j]);
}

// The spans' keys and values in order, as item_avx512 reads them: each slice's sums run over the positions in
// order, whatever the spans. The values come in blocks that stay in L1 while every head's slices read them, so
// they come from memory once.
template <int D, typename T>
void item_avx2(int64_t G, const Span<T>* spans, int spans_count, float scale, Scratch& s) {
  for (int i = 0; i < spans_count; ++i) key_scores<D>(G, spans[i], scale, s);
  softmax_rows(G, spans[spans_count - 1].end, s);
  std::fill(s.acc.begin(), s.acc.end(), 0.0f);
  constexpr int64_t block = 16384 / (D * sizeof(T));
  for (int i = 0; i < spans_count; ++i) {
    const Span<T>& span = spans[i];
    for (int64_t t0 = span.begin; t0 < span.end; t0 += block) {
      const int64_t t1 = std::min(span.end, t0 + block);
      s.keys_ahead.step((t1 - t0) * D * int64_t(sizeof(T)) / 64);
      const T* v = span.v + (t0 - span.begin) * D;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < D / 64; ++c) add_value_slice<D>(g, c, v, t0, t1, s);
    }
  }
}

#endif  // __AVX512F__
#endif  // DECODE_ATTENTION_VECTORS

// ---------------------------------------------------------------------------------------------------------

template <typename T>
void one_item(int64_t G, int64_t D, const Span<T>* spans, int spans_count, float scale, Scratch& s) {
#if defined(DECODE_ATTENTION_VECTORS) && defined(__AVX512F__)
  if (D == 64) return item_avx512<64>(G, spans, spans_count, scale, s);
  if (D == 128) return item_avx512<128>(G, spans, spans_count, scale, s);
#elif defined(DECODE_ATTENTION_VECTORS)
  if (D == 64) return item_avx2<64>(G, spans, spans_count, scale, s);
  if (D == 128) return item_avx2<128>(G, spans, spans_count, scale, s);
#else
  if (D == 64) return item_portable<64>(G, D, spans, spans_count, scale, s);
  if (D == 128) return item_portable<128>(G, D, spans, spans_count, scale, s);
#endif
  item_portable<0>(G, D, spans, spans_count, scale, s);
}

// The group's G query heads (head_stride apart, elements dim_stride apart) into s.q as float32 and, for
// bfloat16, into s.q16 as they are.
template <typename T>
void load_queries(const T* q, int64_t head_stride, int64_t dim_stride, int64_t G, int64_t D, Scratch& s) {
  for (int64_t g = 0; g < G; ++g) {
    const T* qg = q + g * head_stride;
    float* f = s.q.data() + g * D;
    for (int64_t j = 0; j < D; ++j) f[j] = to_float(qg[j * dim_stride]);
    if constexpr (std::is_same_v<T, bf16>)
      for (int64_t j = 0; j < D; ++j) s.q16[g * D + j] = qg[j * dim_stride];
  }
}

inline void store_output(float* out, const float* acc, float inv, int64_t D) {
  for (int64_t j = 0; j < D; ++j) out[j] = acc[j] * inv;
}

inline void store_output(bf16* out, const float* acc, float inv, int64_t D) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(out);
  for (int64_t j = 0; j < D; ++j) bits[j] = bf16_high(bf16_round(acc[j] * inv));
}

// Which attention each entry m computes: query token token[m] (a row of q, and of out) over the first
// length[m] positions of cache row row[m].
struct Plan {
  const int64_t* token;
  const int64_t* row;
  const int64_t* length;
  int64_t count;
  // Where set (tree_attention), entry m's sequence is the row's first length[m] - c positions and then c
  // gathered ones, positions gathered[gather[m]] .. gathered[gather[m + 1] - 1] of the row (c their count).
  const int64_t* gather = nullptr;
  const int64_t* gathered = nullptr;
};

// q [N, H, D] (any strides), keys and values [Rcap, Hkv, C, D] contiguous, out [N, H, D] with unit stride
// along D: out[token[m]] = attention of q[token[m]] over row[m]'s first length[m] positions, for every m.
template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values, const Plan& plan,
         torch::Tensor& out) {
  const int64_t H = q.size(1), D = q.size(2);
  const int64_t Hkv = keys.size(1), C = keys.size(2), G = H / Hkv;
  const float scale = 1.0f / std::sqrt(float(D));
  const T* qp = q.data_ptr<T>();
  const int64_t q_token = q.stride(0), q_head = q.stride(1), q_dim = q.stride(2);
  const T* kp = keys.data_ptr<T>();
  const T* vp = values.data_ptr<T>();
  const int64_t row_stride = keys.stride(0), head_stride = keys.stride(1);  // positions D apart (check_cache)
  T* op = out.data_ptr<T>();
  const int64_t o_token = out.stride(0), o_head = out.stride(1);

  // Items (entry, kv head) cost their length plus a fixed part (the queries, the output: measured about 100 ns,
  // some 16 positions); the threads get contiguous runs of items of about equal cost (rows of different
  // lengths split evenly by count would leave one thread waiting).
  const int64_t items = plan.count * Hkv;
  std::vector<int64_t> start(items + 1, 0);
  for (int64_t i = 0; i < items; ++i) start[i + 1] = start[i] + plan.length[i / Hkv] + 16;
  const int64_t total = start[items];
  // A parallel region costs about 1 us (measured on 2 threads), a part of 256 positions 2 to 4 us.
  const int64_t min_part = 256;
  const int64_t threads = at::get_num_threads();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>({threads, items, total / min_part}));
  std::vector<int64_t> first(parts + 1);
  for (int64_t p = 0; p <= parts; ++p)
    first[p] = std::lower_bound(start.begin(), start.end(), total * p / parts) - start.begin();
  first[parts] = items;

  int64_t most_gathered = 0;
  for (int64_t m = 0; plan.gather != nullptr && m < plan.count; ++m)
    most_gathered = std::max(most_gathered, plan.gather[m + 1] - plan.gather[m]);

  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    Scratch s(G, D, C);
    // A gathering entry's second span: the row's positions from the last multiple of 16 before the gathered
    // ones, then those, one after another.
    std::vector<T> tail_k(most_gathered ? (15 + most_gathered) * D : 0), tail_v(tail_k.size());
    for (int64_t item = first[p0]; item < first[p1]; ++item) {
      const int64_t m = item / Hkv, h = item % Hkv, n = plan.length[m], t = plan.token[m];
      load_queries(qp + t * q_token + h * G * q_head, q_head, q_dim, G, D, s);
      const int64_t offset = plan.row[m] * row_stride + h * head_stride;
      // An entry of the same row as the entry before (a prompt chunk's or a chain's next token) finds that
      // row's keys and values in the CPU's caches: nothing to fetch ahead for it.
      const auto warm = [&](int64_t entry) { return entry > 0 && plan.row[entry] == plan.row[entry - 1]; };
      s.values_ahead.set(vp + offset, warm(m) ? 0 : n * D * int64_t(sizeof(T)));
      const int64_t next = item + 1, mn = next / Hkv;
      if (next < first[p1] && !warm(mn))
        s.keys_ahead.set(kp + plan.row[mn] * row_stride + (next % Hkv) * head_stride,
                         plan.length[mn] * D * int64_t(sizeof(T)));
      else
        s.keys_ahead.set(nullptr, 0);
      Span<T> spans[2] = {{kp + offset, vp + offset, 0, n}, {}};
      int spans_count = 1;
      const int64_t count = plan.gather != nullptr ? plan.gather[m + 1] - plan.gather[m] : 0;
      if (count > 0) {
        const int64_t base = n - count, cut = base / 16 * 16, lead = base - cut;
        const int64_t bytes = D * int64_t(sizeof(T));
        std::memcpy(tail_k.data(), kp + offset + cut * D, lead * bytes);
        std::memcpy(tail_v.data(), vp + offset + cut * D, lead * bytes);
        for (int64_t i = 0; i < count; ++i) {
          const int64_t position = plan.gathered[plan.gather[m] + i];
          std::memcpy(tail_k.data() + (lead + i) * D, kp + offset + position * D, bytes);
          std::memcpy(tail_v.data() + (lead + i) * D, vp + offset + position * D, bytes);
        }
        spans[0].end = cut;
        spans[1] = {tail_k.data(), tail_v.data(), cut, n};
        spans_count = 2;
      }
      one_item<T>(G, D, spans, spans_count, scale, s);
      for (int64_t g = 0; g < G; ++g)
        store_output(op + t * o_token + (h * G + g) * o_head, s.acc.data() + g * D, 1.0f / s.sums[g], D);
    }
  });
}

void check_cache(const char* name, const torch::Tensor& keys, const torch::Tensor& values, const torch::Tensor& q) {
  TORCH_CHECK(keys.device().is_cpu() && values.device().is_cpu() && q.device().is_cpu(), name,
              ": every tensor must be on the CPU");
  TORCH_CHECK(keys.dim() == 4, name, ": keys must be [rows, kv_heads, capacity, dim], got ", keys.sizes());
  TORCH_CHECK(values.sizes() == keys.sizes(), name, ": values ", values.sizes(), " differ from keys ", keys.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, name,
              ": q must be float32 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(keys.scalar_type() == q.scalar_type() && values.scalar_type() == q.scalar_type(), name, ": keys (",
              keys.scalar_type(), ") and values (", values.scalar_type(), ") must have q's dtype (", q.scalar_type(),
              ")");
  const int64_t H = q.size(1), D = q.size(-1), Hkv = keys.size(1);
  // A row's positions of one head D apart, each position's D values in a run (a cache, or a view of its first
  // positions); rows and heads at any distance, the same for keys and values.
  TORCH_CHECK(keys.stride(3) == 1 && keys.stride(2) == D && keys.strides() == values.strides(), name,
              ": keys and values must hold each head's positions one after another (strides [*, *, dim, 1], the same "
              "for both), got ", keys.strides(), " and ", values.strides());
  TORCH_CHECK(keys.size(3) == D, name, ": keys' dim ", keys.size(3), " differs from q's ", D);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, name, ": q's ", H, " heads are not a multiple of the ", Hkv, " kv heads");
  TORCH_CHECK(D > 0, name, ": dim must be positive");
}

torch::Tensor index_tensor(const char* name, const char* what, const torch::Tensor& t, int64_t count) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == count, name, ": ",
              what, " must be an int64 CPU tensor of ", count, " entries, got ", t.scalar_type(), " ", t.sizes());
  return t.contiguous();
}

void dispatch(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values, const Plan& plan,
              torch::Tensor& out) {
  if (plan.count == 0) return;
  if (q.scalar_type() == at::kFloat) run<float>(q, keys, values, plan, out);
  else run<bf16>(q, keys, values, plan, out);
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                               const torch::Tensor& lengths) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "decode_attention: q must be [rows, heads, 1, dim], got ", q.sizes());
  check_cache("decode_attention", keys, values, q);
  const int64_t R = q.size(0), H = q.size(1), D = q.size(3), C = keys.size(2);
  TORCH_CHECK(keys.size(0) >= R, "decode_attention: keys hold ", keys.size(0), " rows, q has ", R);
  const torch::Tensor lens = index_tensor("decode_attention", "lengths", lengths, R);
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(lp[r] >= 1 && lp[r] <= C, "decode_attention: row ", r, " has length ", lp[r],
                ", outside 1 .. ", C, " (the cache's capacity)");
  std::vector<int64_t> rows(R);
  for (int64_t r = 0; r < R; ++r) rows[r] = r;
  torch::Tensor out = torch::empty({R, H, 1, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  torch::Tensor flat = out.select(2, 0);
  dispatch(q.select(2, 0), keys, values, Plan{rows.data(), rows.data(), lp, R}, flat);
  return out;
}

// The T new tokens of one row after what its cache holds, causally: q [T, H, D] (any strides), keys and values
// [1, Hkv, S, D] as check_cache takes them (the cache's first S positions, the T new ones last); token t attends
// positions 0 .. S - T + t. Each token's attention is computed as decode_attention computes a row's: the same
// arithmetic, so a token's output does not depend on the tokens verified with it.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values) {
  const char* name = "causal_attention";
  TORCH_CHECK(q.dim() == 3, name, ": q must be [tokens, heads, dim], got ", q.sizes());
  check_cache(name, keys, values, q);
  const int64_t T = q.size(0), S = keys.size(2);
  TORCH_CHECK(keys.size(0) == 1, name, ": keys must hold one row, got ", keys.size(0));
  TORCH_CHECK(T >= 1 && T <= S, name, ": ", T, " tokens after a cache of ", S, " positions");
  std::vector<int64_t> tokens(T), rows(T, 0), lengths(T);
  for (int64_t t = 0; t < T; ++t) {
    tokens[t] = t;
    lengths[t] = S - T + 1 + t;
  }
  torch::Tensor out = torch::empty({T, q.size(1), q.size(2)}, q.options().memory_format(at::MemoryFormat::Contiguous));
  dispatch(q, keys, values, Plan{tokens.data(), rows.data(), lengths.data(), T}, out);
  return out;
}

// A tree's nodes after what one row's cache holds: q [T, H, D] (any strides), keys and values [1, Hkv, S, D] as
// check_cache takes them, holding the cache's first S - T positions and then the T nodes; node t attends over its
// sequence: the row's first lengths[t] - c positions, then the c positions gathered[gather[t]] ..
// gathered[gather[t + 1] - 1] (its ancestors and itself, in the order a decoding step would have them). Each is
// computed as decode_attention computes a row holding that sequence, so the accepted path of a verified tree
// gets the outputs one-token steps give it.
torch::Tensor tree_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                             const torch::Tensor& lengths, const torch::Tensor& gather,
                             const torch::Tensor& gathered) {
  const char* name = "tree_attention";
  TORCH_CHECK(q.dim() == 3, name, ": q must be [tokens, heads, dim], got ", q.sizes());
  check_cache(name, keys, values, q);
  const int64_t T = q.size(0), S = keys.size(2);
  TORCH_CHECK(keys.size(0) == 1, name, ": keys must hold one row, got ", keys.size(0));
  const torch::Tensor lens = index_tensor(name, "lengths", lengths, T);
  const torch::Tensor from = index_tensor(name, "gather", gather, T + 1);
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* fp = from.data_ptr<int64_t>();
  TORCH_CHECK(fp[0] == 0, name, ": gather must start at 0, got ", fp[0]);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(fp[t + 1] >= fp[t] && lp[t] >= 1 && lp[t] <= S && fp[t + 1] - fp[t] <= lp[t], name, ": node ", t,
                " has length ", lp[t], " with ", fp[t + 1] - fp[t], " gathered positions (gather ", fp[t], " .. ",
                fp[t + 1], "): lengths must lie in 1 .. ", S, " and count at least their gathered positions");
  const torch::Tensor picked = index_tensor(name, "gathered", gathered, fp[T]);
  const int64_t* gp = picked.data_ptr<int64_t>();
  for (int64_t i = 0; i < fp[T]; ++i)
    TORCH_CHECK(gp[i] >= 0 && gp[i] < S, name, ": gathered position ", gp[i], " (entry ", i, ") outside 0 .. ", S - 1);
  std::vector<int64_t> tokens(T), rows(T, 0);
  for (int64_t t = 0; t < T; ++t) tokens[t] = t;
  torch::Tensor out = torch::empty({T, q.size(1), q.size(2)}, q.options().memory_format(at::MemoryFormat::Contiguous));
  Plan plan{tokens.data(), rows.data(), lp, T};
  plan.gather = fp;
  plan.gathered = gp;
  dispatch(q, keys, values, plan, out);
  return out;
}

// One band's part of a batched step, whose N tokens come as q [N, H, D], k_new and v_new [N, Hkv, D] (any
// strides): first every entry m's key and value are written at position positions[m] of cache row rows[m],
// then each attends over that row's positions 0 .. positions[m] (so a prompt chunk's tokens, entries of one
// row at consecutive positions, attend causally among themselves), into out[tokens[m]] ([N, H, D], unit
// stride along D). Tokens of the step that are not entries are neither read nor written.
void step_attention(const torch::Tensor& q, const torch::Tensor& k_new, const torch::Tensor& v_new,
                    torch::Tensor keys, torch::Tensor values, const torch::Tensor& tokens, const torch::Tensor& rows,
                    const torch::Tensor& positions, torch::Tensor out) {
  const char* name = "step_attention";
  TORCH_CHECK(q.dim() == 3, name, ": q must be [tokens, heads, dim], got ", q.sizes());
  check_cache(name, keys, values, q);
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), name, ": keys and values must be contiguous");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), Hkv = keys.size(1), C = keys.size(2);
  TORCH_CHECK(k_new.dim() == 3 && k_new.size(0) == N && k_new.size(1) == Hkv && k_new.size(2) == D &&
              v_new.sizes() == k_new.sizes(), name, ": k_new and v_new must be [", N, ", ", Hkv, ", ", D, "], got ",
              k_new.sizes(), " and ", v_new.sizes());
  TORCH_CHECK(k_new.scalar_type() == q.scalar_type() && v_new.scalar_type() == q.scalar_type(), name,
              ": k_new and v_new must have q's dtype");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.stride(2) == 1, name,
              ": out must be [", N, ", ", H, ", ", D, "] in q's dtype with unit stride along dim, got ", out.sizes());
  const int64_t M = tokens.dim() == 1 ? tokens.size(0) : -1;
  const torch::Tensor tok = index_tensor(name, "tokens", tokens, M);
  const torch::Tensor row = index_tensor(name, "rows", rows, M);
  const torch::Tensor pos = index_tensor(name, "positions", positions, M);
  const int64_t *tp = tok.data_ptr<int64_t>(), *rp = row.data_ptr<int64_t>(), *pp = pos.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(tp[m] >= 0 && tp[m] < N, name, ": entry ", m, " names token ", tp[m], ", outside 0 .. ", N - 1);
    TORCH_CHECK(rp[m] >= 0 && rp[m] < keys.size(0), name, ": entry ", m, " names cache row ", rp[m], ", outside 0 .. ",
                keys.size(0) - 1);
    TORCH_CHECK(pp[m] >= 0 && pp[m] < C, name, ": entry ", m, " writes position ", pp[m], ", outside 0 .. ", C - 1,
                " (the cache's capacity)");
  }
  // The writes: a few hundred rows of D elements, no work for threads.
  const int64_t elem = q.element_size();
  for (const auto& [src, dst] : {std::pair{&k_new, &keys}, std::pair{&v_new, &values}}) {
    const char* from = static_cast<const char*>(src->data_ptr());
    char* to = static_cast<char*>(dst->data_ptr());
    const int64_t s0 = src->stride(0), s1 = src->stride(1), s2 = src->stride(2);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t h = 0; h < Hkv; ++h) {
        char* at = to + ((rp[m] * Hkv + h) * C + pp[m]) * D * elem;
        const char* row = from + (tp[m] * s0 + h * s1) * elem;
        if (s2 == 1) std::memcpy(at, row, D * elem);
        else for (int64_t j = 0; j < D; ++j) std::memcpy(at + j * elem, row + j * s2 * elem, elem);
      }
  }
  std::vector<int64_t> lengths(M);
  for (int64_t m = 0; m < M; ++m) lengths[m] = pp[m] + 1;
  dispatch(q, keys, values, Plan{tp, rp, lengths.data(), M}, out);
}

}  // namespace

void bind_layer_ops(pybind11::module& m);       // layer_ops.cpp
void bind_blocked_linear(pybind11::module& m);  // blocked_linear.cpp
void bind_int8_linear(pybind11::module& m);     // int8_linear.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_layer_ops(m);
  bind_blocked_linear(m);
  bind_int8_linear(m);
  m.def("decode_attention", &decode_attention, py::call_guard<py::gil_scoped_release>(),
        "softmax(q.k * D^-0.5) . v for one new token per row over each row's first lengths[r] positions",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("lengths"));
  m.def("causal_attention", &causal_attention, py::call_guard<py::gil_scoped_release>(),
        "a row's new tokens, each over the cache up to its own position, as decode_attention computes one",
        py::arg("q"), py::arg("keys"), py::arg("values"));
  m.def("tree_attention", &tree_attention, py::call_guard<py::gil_scoped_release>(),
        "a tree's nodes over the row's prefix and each node's gathered ancestors, as decode_attention computes one",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("lengths"), py::arg("gather"),
        py::arg("gathered"));
  m.def("step_attention", &step_attention, py::call_guard<py::gil_scoped_release>(),
        "write a band's new keys and values, then each entry's attention over its row up to its position",
        py::arg("q"), py::arg("k_new"), py::arg("v_new"), py::arg("keys"), py::arg("values"), py::arg("tokens"),
        py::arg("rows"), py::arg("positions"), py::arg("out"));
}
