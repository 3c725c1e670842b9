// Paged decode attention for the CPU: one query token per request, keys and values read in place from
// the paged cache through the block table (no gathered copy), every query head of a request in one task.
//
// Layout (as in batchjob/engine/kv_cache.py): k_cache, v_cache [num_blocks, block_size, kv_heads, D];
// q and out [G, heads, D]; block_table [G, table_stride] int64; ctx_lens [G] int64 (keys of each request,
// its new token included). A request's query heads h attend to kv head h / (heads / kv_heads), keys
// [max(0, len - window), len) when window > 0. Two passes over the keys: scores (kept per token, all
// heads side by side), then the softmax-weighted sum of values. Accumulation is in T (float or double),
// as torch's CPU attention accumulates float inputs in float.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

namespace {

template <typename T>
inline void prefetch(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(c + i);
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

template <typename T, int DC>
void attend_one(const T* __restrict q, const T* __restrict k_cache, const T* __restrict v_cache,
                const int64_t* __restrict blocks, int64_t start, int64_t len, int64_t heads,
                int64_t kv_heads, int64_t dim_rt, int64_t block_size, T scale, T* __restrict out,
                T* __restrict scores, T* __restrict acc, T* __restrict row_max, T* __restrict row_sum) {
  const int64_t D = DC > 0 ? DC : dim_rt;
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = kv_heads * D;
  const int64_t n = len - start;

  for (int64_t h = 0; h < heads; ++h) row_max[h] = -INFINITY;
  for_each_key(k_cache, blocks, start, len, block_size, token_stride, [&](int64_t i, const T* kt) {
    T* st = scores + i * heads;
    for (int64_t h = 0; h < heads; ++h) {
      const T* qh = q + h * D;
      const T* kh = kt + (h / group) * D;
      T dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qh[d] * kh[d];
      dot *= scale;
      st[h] = dot;
      row_max[h] = std::max(row_max[h], dot);
    }
  });

  for (int64_t h = 0; h < heads; ++h) row_sum[h] = 0;
  for (int64_t i = 0; i < n; ++i) {
    T* si = scores + i * heads;
    for (int64_t h = 0; h < heads; ++h) {
      si[h] = std::exp(si[h] - row_max[h]);
      row_sum[h] += si[h];
    }
  }

  for (int64_t x = 0; x < heads * D; ++x) acc[x] = 0;
  for_each_key(v_cache, blocks, start, len, block_size, token_stride, [&](int64_t i, const T* vt) {
    const T* st = scores + i * heads;
    for (int64_t h = 0; h < heads; ++h) {
      const T p = st[h];
      const T* vh = vt + (h / group) * D;
      T* ah = acc + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ah[d] += p * vh[d];
    }
  });

  for (int64_t h = 0; h < heads; ++h) {
    const T inv = T(1) / row_sum[h];
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = acc[h * D + d] * inv;
  }
}

template <typename T, int DC>
void attend_all(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_table,
                int64_t table_stride, const int64_t* ctx_lens, int64_t num_seqs, int64_t heads,
                int64_t kv_heads, int64_t dim, int64_t block_size, double scale, int64_t window, T* out) {
  int64_t max_len = 1;
  for (int64_t g = 0; g < num_seqs; ++g) max_len = std::max(max_len, ctx_lens[g]);
#pragma omp parallel
  {
    std::vector<T> scores(static_cast<size_t>(heads * max_len));
    std::vector<T> acc(static_cast<size_t>(heads * dim));
    std::vector<T> row_max(static_cast<size_t>(heads)), row_sum(static_cast<size_t>(heads));
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < num_seqs; ++g) {
      const int64_t len = ctx_lens[g];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      attend_one<T, DC>(q + g * heads * dim, k_cache, v_cache, block_table + g * table_stride, start, len,
                        heads, kv_heads, dim, block_size, static_cast<T>(scale), out + g * heads * dim,
                        scores.data(), acc.data(), row_max.data(), row_sum.data());
    }
  }
}

template <typename T>
void dispatch(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_table, int64_t table_stride,
              const int64_t* ctx_lens, int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim,
              int64_t block_size, double scale, int64_t window, T* out) {
  // A compile-time head size lets the compiler unroll the inner loops for the common sizes.
  if (dim == 64)
    attend_all<T, 64>(q, k_cache, v_cache, block_table, table_stride, ctx_lens, num_seqs, heads, kv_heads, dim,
                      block_size, scale, window, out);
  else if (dim == 128)
    attend_all<T, 128>(q, k_cache, v_cache, block_table, table_stride, ctx_lens, num_seqs, heads, kv_heads, dim,
                       block_size, scale, window, out);
  else
    attend_all<T, 0>(q, k_cache, v_cache, block_table, table_stride, ctx_lens, num_seqs, heads, kv_heads, dim,
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

}  // extern "C"
