// Paged decode attention for the CPU: one query token per request, keys and values read in place from
// the paged cache through the block table (no gathered copy), every query head of a request in one task.
//
// Layout (as in batchjob/engine/kv_cache.py): k_cache, v_cache [num_blocks, block_size, kv_heads, D];
// q and out [G, heads, D]; block_table [G, table_stride] int64; ctx_lens [G] int64 (keys of each request,
// its new token included). A request's query heads h attend to kv head h / (heads / kv_heads), keys
// [max(0, len - window), len) when window > 0. Two passes over the keys: scores (kept per head, each
// head's side by side), then the softmax-weighted sum of values. Each storage type S has a compute type T:
// float and double compute in themselves (as torch's CPU attention accumulates float inputs in float);
// bfloat16 (its 16 bits stored as uint16_t) is widened to float on load, a bit shift, and rounded to the
// nearest even bfloat16 on store, so scores, softmax and accumulation are in float.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_math.h"

namespace {

struct bf16 {
  uint16_t bits;
};

template <typename S>
struct Compute {
  using type = S;
};
template <>
struct Compute<bf16> {
  using type = float;
};

inline float widen(float x) { return x; }
inline double widen(double x) { return x; }
inline float widen(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename S>
inline S narrow(typename Compute<S>::type x) {
  return x;
}
template <>
inline bf16 narrow<bf16>(float x) {
  return bf16{batchjob::bf16_bits(x)};
}

// float: the shared polynomial (cpu_math.h); double keeps std::exp, so the float64 path the exactness tests
// run is unchanged.
using batchjob::exp_nonpositive;
inline double exp_nonpositive(double x) { return std::exp(x); }

// Rows of float (and double) values are fetched into L2, bfloat16 ones into L1. float32 rows fetched into L1
// a block ahead made decode calls at 1,000 keys 1.15-1.6x slower than into L2 on a Zen 4 core pair (L1's
// 32 KB and its few outstanding misses are taken by rows not yet read); bf16 rows, half the bytes, ran as fast
// either way or 3% faster into L1 (BENCHMARKS.md, 2026-12-07).
template <typename T>
inline void prefetch(const T* p, int64_t n) {
  constexpr int locality = sizeof(T) >= 4 ? 2 : 3;
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(c + i, 0, locality);
}

// Calls body(i, row) for the keys start + i < len of one request in one cache (K or V), row pointing at
// the key's [kv_heads, D] entries. Blocks are scattered, so the hardware prefetcher cannot guess the next
// one: it is fetched a block ahead.
template <typename T, typename Body>
inline void for_each_key(const T* cache, const int64_t* blocks, int64_t start, int64_t len, int64_t block_size,
                         int64_t token_stride, Body&& body) {
  for (int64_t j = start; j < len;) {
    const int64_t offset = j % block_size;
    const int64_t count = std::min(block_size - offset, len - j);
    const T* base = cache + (blocks[j / block_size] * block_size + offset) * token_stride;
    const T* next = j + count < len ? cache + blocks[j / block_size + 1] * block_size * token_stride : nullptr;
    for (int64_t t = 0; t < count; ++t) {
      if (next != nullptr) prefetch(next + t * token_stride, token_stride);
      body(j - start + t, base + t * token_stride);
    }
    j += count;
  }
}

// One key's [kv_heads, D] entries in the compute type: bf16 ones widened once into ``wide`` (every query head
// of a group reads them: 7 heads per KV head at Qwen2.5-0.5B's shape), float and double ones as they are.
template <typename S, typename T>
inline const T* widen_row(const S* row, int64_t n, T* __restrict wide) {
  if constexpr (std::is_same_v<S, T>) {
    return row;
  } else {
#pragma omp simd
    for (int64_t x = 0; x < n; ++x) wide[x] = widen(row[x]);
    return wide;
  }
}

// The dot product of two rows of D values in 16 lanes, the lanes summed as a tree (four steps). A reduction
// left to the compiler (``omp simd reduction``) was summed lane by lane, 16 dependent scalar adds per query
// head and key, about half of a call's time; this and the heads walked by KV head (no integer division per
// head and key) made calls 1.1-1.4x faster on a Zen 4 core (BENCHMARKS.md, 2026-12-06). The sum's order is
// fixed, so a row's score is the same whoever else is in the call.
template <typename T, int DC>
inline T dot_row(const T* __restrict a, const T* __restrict b, int64_t dim_rt) {
  constexpr int W = 16;
  const int64_t D = DC > 0 ? DC : dim_rt;
  T lane[W] = {};
  int64_t d = 0;
  for (; d + W <= D; d += W) {
#pragma omp simd
    for (int l = 0; l < W; ++l) lane[l] += a[d + l] * b[d + l];
  }
  for (int l = 0; d + l < D; ++l) lane[l] += a[d + l] * b[d + l];
  for (int w = W / 2; w >= 1; w /= 2) {
#pragma omp simd
    for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
  }
  return lane[0];
}

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
// dot_row in float with the head size a multiple of 16, its 16 lanes summed in registers. dot_row's lane
// array went through the stack for the last steps (a store, then scalar loads of it: the call's hottest
// instructions at 1,000 keys); these are the same adds in the same order, so the same scores.
#define BATCHJOB_LANE_VECTORS 1
typedef float lanes16 __attribute__((vector_size(64)));
typedef float lanes8 __attribute__((vector_size(32)));
typedef float lanes4 __attribute__((vector_size(16)));

template <int D>
inline float dot_row16(const float* __restrict a, const float* __restrict b) {
  static_assert(D % 16 == 0, "whole vectors of 16 lanes");
  lanes16 lane = {};
  for (int d = 0; d < D; d += 16) {
    lanes16 x, y;
    std::memcpy(&x, a + d, sizeof x);
    std::memcpy(&y, b + d, sizeof y);
    lane += x * y;
  }
  const lanes8 l8 = __builtin_shufflevector(lane, lane, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(lane, lane, 8, 9, 10, 11, 12, 13, 14, 15);
  const lanes4 l4 = __builtin_shufflevector(l8, l8, 0, 1, 2, 3) + __builtin_shufflevector(l8, l8, 4, 5, 6, 7);
  const float l0 = l4[0] + l4[2], l1 = l4[1] + l4[3];
  return l0 + l1;
}
#endif
#endif

template <typename S, int DC, typename T = typename Compute<S>::type>
void attend_one(const S* __restrict q_in, const S* __restrict k_cache, const S* __restrict v_cache,
                const int64_t* __restrict blocks, int64_t start, int64_t len, int64_t heads,
                int64_t kv_heads, int64_t dim_rt, int64_t block_size, T scale, S* __restrict out,
                T* __restrict q, T* __restrict scores, T* __restrict acc, T* __restrict row_max,
                T* __restrict row_sum, T* __restrict wide) {
  const int64_t D = DC > 0 ? DC : dim_rt;
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = kv_heads * D;
  const int64_t n = len - start;

  for (int64_t x = 0; x < heads * D; ++x) q[x] = widen(q_in[x]);
  for (int64_t h = 0; h < heads; ++h) row_max[h] = -INFINITY;
  for_each_key(k_cache, blocks, start, len, block_size, token_stride, [&](int64_t i, const S* kt_in) {
    const T* kt = widen_row(kt_in, token_stride, wide);
    for (int64_t kv = 0, h = 0; kv < kv_heads; ++kv) {  // each KV head's query heads in turn (no h / group)
      const T* kh = kt + kv * D;
      for (int64_t r = 0; r < group; ++r, ++h) {
        const T* qh = q + h * D;
#ifdef BATCHJOB_LANE_VECTORS
        T dot;
        if constexpr (std::is_same_v<T, float> && DC > 0 && DC % 16 == 0)
          dot = dot_row16<DC>(qh, kh) * scale;
        else
          dot = dot_row<T, DC>(qh, kh, D) * scale;
#else
        const T dot = dot_row<T, DC>(qh, kh, D) * scale;
#endif
        scores[h * n + i] = dot;  // a head's scores side by side: the softmax below runs along them
        row_max[h] = std::max(row_max[h], dot);
      }
    }
  });

  for (int64_t h = 0; h < heads; ++h) {
    T* sh = scores + h * n;
    const T m = row_max[h];
    T sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      sh[i] = exp_nonpositive(sh[i] - m);
      sum += sh[i];
    }
    row_sum[h] = sum;
  }

  for (int64_t x = 0; x < heads * D; ++x) acc[x] = 0;
  for_each_key(v_cache, blocks, start, len, block_size, token_stride, [&](int64_t i, const S* vt_in) {
    const T* vt = widen_row(vt_in, token_stride, wide);
    for (int64_t kv = 0, h = 0; kv < kv_heads; ++kv) {
      const T* vh = vt + kv * D;
      for (int64_t r = 0; r < group; ++r, ++h) {
        const T p = scores[h * n + i];
        T* ah = acc + h * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ah[d] += p * vh[d];
      }
    }
  });

  for (int64_t h = 0; h < heads; ++h) {
    const T inv = T(1) / row_sum[h];
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = narrow<S>(acc[h * D + d] * inv);
  }
}

template <typename S, int DC>
void attend_all(const S* q, const S* k_cache, const S* v_cache, const int64_t* block_table,
                int64_t table_stride, const int64_t* ctx_lens, int64_t num_seqs, int64_t heads,
                int64_t kv_heads, int64_t dim, int64_t block_size, double scale, int64_t window, S* out) {
  using T = typename Compute<S>::type;
  int64_t max_len = 1;
  for (int64_t g = 0; g < num_seqs; ++g) max_len = std::max(max_len, ctx_lens[g]);
#pragma omp parallel
  {
    std::vector<T> qf(static_cast<size_t>(heads * dim));
    std::vector<T> scores(static_cast<size_t>(heads * max_len));
    std::vector<T> acc(static_cast<size_t>(heads * dim));
    std::vector<T> row_max(static_cast<size_t>(heads)), row_sum(static_cast<size_t>(heads));
    std::vector<T> wide(static_cast<size_t>(kv_heads * dim));
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < num_seqs; ++g) {
      const int64_t len = ctx_lens[g];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      attend_one<S, DC>(q + g * heads * dim, k_cache, v_cache, block_table + g * table_stride, start, len,
                        heads, kv_heads, dim, block_size, static_cast<T>(scale), out + g * heads * dim,
                        qf.data(), scores.data(), acc.data(), row_max.data(), row_sum.data(),
                        wide.data());
    }
  }
}

template <typename S>
void dispatch(const S* q, const S* k_cache, const S* v_cache, const int64_t* block_table, int64_t table_stride,
              const int64_t* ctx_lens, int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim,
              int64_t block_size, double scale, int64_t window, S* out) {
  // A compile-time head size lets the compiler unroll the inner loops for the common sizes.
  if (dim == 64)
    attend_all<S, 64>(q, k_cache, v_cache, block_table, table_stride, ctx_lens, num_seqs, heads, kv_heads, dim,
                      block_size, scale, window, out);
  else if (dim == 128)
    attend_all<S, 128>(q, k_cache, v_cache, block_table, table_stride, ctx_lens, num_seqs, heads, kv_heads, dim,
                       block_size, scale, window, out);
  else
    attend_all<S, 0>(q, k_cache, v_cache, block_table, table_stride, ctx_lens, num_seqs, heads, kv_heads, dim,
                     block_size, scale, window, out);
}

}  // namespace

extern "C" {

void batchjob_paged_decode_f32(const float* q, const float* k_cache, const float* v_cache,
                               const int64_t* block_table, int64_t table_stride, const int64_t* ctx_lens,
                               int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                               int64_t block_size, double scale, int64_t window, float* out) {
  dispatch<float>(q, k_cache, v_cache, block_table, table_stride, ctx_lens, num_seqs, heads, kv_heads, dim,
                  block_size, scale, window, out);
}

void batchjob_paged_decode_f64(const double* q, const double* k_cache, const double* v_cache,
                               const int64_t* block_table, int64_t table_stride, const int64_t* ctx_lens,
                               int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                               int64_t block_size, double scale, int64_t window, double* out) {
  dispatch<double>(q, k_cache, v_cache, block_table, table_stride, ctx_lens, num_seqs, heads, kv_heads, dim,
                   block_size, scale, window, out);
}

// bfloat16 as its 16 bits (torch.bfloat16 tensors viewed as uint16).
void batchjob_paged_decode_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                                const int64_t* block_table, int64_t table_stride, const int64_t* ctx_lens,
                                int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                                int64_t block_size, double scale, int64_t window, uint16_t* out) {
  static_assert(sizeof(bf16) == sizeof(uint16_t), "bf16 is its 16 bits");
  dispatch<bf16>(reinterpret_cast<const bf16*>(q), reinterpret_cast<const bf16*>(k_cache),
                 reinterpret_cast<const bf16*>(v_cache), block_table, table_stride, ctx_lens, num_seqs, heads,
                 kv_heads, dim, block_size, scale, window, reinterpret_cast<bf16*>(out));
}

}  // extern "C"
