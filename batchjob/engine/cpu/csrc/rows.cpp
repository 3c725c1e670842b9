// A layer's per-row work that torch runs as several small ops, each dispatched on its own: at a decode
// step's few rows the dispatch costs more than the arithmetic (a SmolLM2-135M decode step of 16 rows ran
// ~2,260 torch ops, ~75 a layer, and spent ~40% of its time outside the GEMMs and attention). One call each:
//
// - the new keys and values of a step written into the paged cache (both caches, any strides of the
//   inputs: transformers hands them over as [1, kv_heads, T, D] views);
// - the RMS norm of transformers' Llama layout, w * (x * rsqrt(mean(x^2) + eps)) with the mean in float and
//   the normalised row rounded to the input's dtype before the weight multiplies it, as LlamaRMSNorm does,
//   and the sum of squares added in the order torch's own sum adds them: its output is LlamaRMSNorm's, bit
//   for bit.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_math.h"

// Each product rounded on its own, as torch's separate ops round it: no multiply-add contracted into one
// instruction (GCC and clang would, under -march=native), or the sum of squares leaves torch's by a bit.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

inline float widen(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

int64_t ceil_log2(int64_t x) {  // as ATen's utils::CeilLog2: 1 up to 2
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = static_cast<uint64_t>(x) - 1; v; v >>= 1) ++bits;
  return bits;
}

// The sum of sq(0) .. sq(n - 1) in the order torch's CPU sum adds a contiguous row (its "cascade" sum), so
// that the mean is torch's to the bit: the row read as vectors of L floats (L: the width of torch's
// vectors, which rows.py finds by trying; 1 when the row is narrower than one), the vectors
// taken four at a time into four accumulators, which carry into three more levels every 2^p groups; then the
// vectors left over into the first accumulator, the four accumulators added, and last, from 0, the floats
// past the last whole vector and the accumulator's lanes one by one.
template <int L, typename Sq>
float torch_sum(int64_t n, Sq sq) {
  const int64_t vectors = n / L, groups = vectors / 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(groups) / 4), step = int64_t{1} << power;
  float acc[4][4][L] = {};  // [level][accumulator][lane]
  auto add = [&](float* to, int64_t vector) {
    for (int l = 0; l < L; ++l) to[l] += sq(vector * L + l);
  };
  int64_t g = 0;
  while (g + step <= groups) {
    for (int64_t j = 0; j < step; ++j, ++g)
      for (int r = 0; r < 4; ++r) add(acc[0][r], g * 4 + r);
    for (int level = 1; level < 4; ++level) {
      for (int r = 0; r < 4; ++r)
        for (int l = 0; l < L; ++l) acc[level][r][l] += acc[level - 1][r][l], acc[level - 1][r][l] = 0.f;
      if (g & ((step - 1) << (level * power))) break;
    }
  }
  for (; g < groups; ++g)
    for (int r = 0; r < 4; ++r) add(acc[0][r], g * 4 + r);
  for (int level = 1; level < 4; ++level)
    for (int r = 0; r < 4; ++r)
      for (int l = 0; l < L; ++l) acc[0][r][l] += acc[level][r][l];
  for (int64_t v = groups * 4; v < vectors; ++v) add(acc[0][0], v);
  for (int r = 1; r < 4; ++r)
    for (int l = 0; l < L; ++l) acc[0][0][l] += acc[0][r][l];
  float total = 0.f;
  for (int64_t j = vectors * L; j < n; ++j) total += sq(j);
  for (int l = 0; l < L; ++l) total += acc[0][0][l];
  return total;
}

// Rows of n values of type S (float or bfloat16's 16 bits), row r at x + r * stride.
template <typename S>
void rms_norm(const S* x, int64_t rows, int64_t n, int64_t stride, const S* w, float eps, int64_t lanes, S* y) {
  auto load = [](S v) -> float {
    if constexpr (sizeof(S) == 2) return widen(v); else return v;
  };
  auto store = [](float v) -> S {
    if constexpr (sizeof(S) == 2) return batchjob::bf16_bits(v); else return v;
  };
  if (n < lanes) lanes = 1;
#pragma omp parallel for if (rows * n >= (1 << 17))
  for (int64_t r = 0; r < rows; ++r) {
    const S* xr = x + r * stride;
    S* yr = y + r * n;
    auto sq = [xr, &load](int64_t j) { const float v = load(xr[j]); return v * v; };
    const float sum = lanes == 16  ? torch_sum<16>(n, sq)
                      : lanes == 8 ? torch_sum<8>(n, sq)
                      : lanes == 4 ? torch_sum<4>(n, sq)
                                   : torch_sum<1>(n, sq);
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
    for (int64_t j = 0; j < n; ++j) yr[j] = store(load(w[j]) * load(store(load(xr[j]) * inv)));
  }
}

}  // namespace

extern "C" {

// Token t's keys [kv_heads, D] (head h at key + h * k_head + t * k_token elements of `bytes` each) and values
// go to slot slots[t] of caches laid out [slots, kv_heads, D].
void batchjob_write_kv(const char* key, int64_t k_head, int64_t k_token, const char* value, int64_t v_head,
                       int64_t v_token, const int64_t* slots, int64_t tokens, int64_t kv_heads, int64_t dim,
                       int64_t bytes, char* k_cache, char* v_cache) {
  const int64_t row = dim * bytes;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slots[t] * kv_heads * row;
    for (int64_t h = 0; h < kv_heads; ++h) {
      std::memcpy(k_cache + slot + h * row, key + (h * k_head + t * k_token) * bytes, row);
      std::memcpy(v_cache + slot + h * row, value + (h * v_head + t * v_token) * bytes, row);
    }
  }
}

void batchjob_rms_norm_f32(const float* x, int64_t rows, int64_t n, int64_t stride, const float* w, float eps,
                           int64_t lanes, float* y) {
  rms_norm(x, rows, n, stride, w, eps, lanes, y);
}

void batchjob_rms_norm_bf16(const uint16_t* x, int64_t rows, int64_t n, int64_t stride, const uint16_t* w,
                            float eps, int64_t lanes, uint16_t* y) {
  rms_norm(x, rows, n, stride, w, eps, lanes, y);
}

}  // extern "C"
