// Scalar float helpers shared by the runtime's C++ kernels (decode_attention.cpp, layer_ops.cpp), written in
// plain arithmetic so that the compiler vectorises the loops that call them.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace mtptrain_kernels {

using bf16 = c10::BFloat16;

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {  // bfloat16 is the top half of a float32
  const uint32_t bits = uint32_t(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// x rounded to bfloat16 as c10::BFloat16 rounds (to nearest even; a NaN becomes 0x7FC0), as a float32 whose
// low half is zero.
inline float bf16_round(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u = x != x ? 0x7FC00000u : ((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
  float out;
  std::memcpy(&out, &u, sizeof out);
  return out;
}

// The bfloat16 of a float32 with a zero low half (bf16_round's result): its high half, as is.
inline uint16_t bf16_high(float rounded) {
  uint32_t u;
  std::memcpy(&u, &rounded, sizeof u);
  return uint16_t(u >> 16);
}

// exp(x), std::exp staying a scalar call without -ffast-math: x = n ln2 + r with |r| <= ln2/2, exp(r) by its
// Taylor polynomial to r^7 (relative error < 1e-8, below float32's rounding), 2^n put in the exponent bits.
// x is clamped to [-87, 88], where exp runs from about 1.6e-38 to 1.7e38: for a softmax weight against the
// max's exp(0) = 1, or for silu's x / (1 + exp(-x)), what lies past either end makes no difference in float.
inline float exp_clamped(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float shift = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  const float n = (x * 1.44269504088896341f + shift) - shift;
  float r = x - n * 0.693359375f;  // ln2 in two parts: the first exact in a float times n
  r = r - n * -2.12194440e-4f;
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;  // n in [-126, 127]: a normal power of two
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace mtptrain_kernels
