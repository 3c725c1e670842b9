// What the CPU attention kernels share: float's exp for the softmax, a row's softmax, and the rounding of float
// to bfloat16.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace batchjob {

// exp(x) for x <= 0 (a score less its row's maximum), vectorisable: x = n ln2 + r with |r| <= ln2 / 2, a
// degree-6 Taylor polynomial for e^r (relative error below 2e-7, a few float ulps) and 2^n from the exponent
// bits; below -87 (where e^x leaves float's normal range) it is 0. The scalar libm call it replaces kept the
// softmax loop scalar: it was about half of a bf16 decode call's time at Qwen2.5-0.5B's shape (14 heads, 150
// keys).
inline float exp_nonpositive(float x) {
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;  // ln2 split in two: r exact enough
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? 0.0f : p * scale;
}

// The softmax of a row of scores over its keys [lo, hi), in place and unnormalised: s[j] = exp(s[j] * scale
// - max) there, 0 below lo (past hi is the caller's); returns their sum, which the caller divides by. The row
// maximum and the sum as OpenMP simd reductions (1.10-1.31x a prefill call against the maximum kept scalar).
inline float softmax_row(float* s, int64_t lo, int64_t hi, float scale) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t j = lo; j < hi; ++j) m = std::max(m, s[j] * scale);
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = lo; j < hi; ++j) {
    const float e = exp_nonpositive(s[j] * scale - m);
    sum += e;
    s[j] = e;
  }
  std::fill(s, s + lo, 0.0f);
  return sum;
}

// The bfloat16 nearest to x (ties to even), as its 16 bits; a NaN stays a (quiet) NaN.
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace batchjob
