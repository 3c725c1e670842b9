// Prefill attention for the CPU in float32: the bf16 kernel's calls (paged_prefill.cpp: prompt chunks over
// the paged cache; sequences both ways or causal over their own rows), on float multiply-adds.
//
// torch's CPU flash attention runs each (row, head) block as small float GEMMs with their own packing, one
// call per prompt chunk and per encoder row; here a call takes every chunk of a step, and the two products
// run on vectors of W keys (scores) and W dimensions (values) written with GCC's vector extensions, so the
// same source builds for AVX-512 (W = 16) and AVX2 (W = 8). Scores, softmax and sums in float, as torch's.
//
// Per (chunk, KV head) the keys are copied into blocks of W keys, dimension by dimension (one vector: one
// dimension of W keys), the values key by key; then tasks of R query rows (a row: one position and one query
// head of the KV head's group) compute their scores, each row's softmax, and the weighted sum of values,
// driven as the bf16 kernel is (prefill_tasks.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"
#include "prefill_tasks.h"

namespace {

#if defined(__AVX512F__)
constexpr int W = 16;  // floats a vector
constexpr int R = 16;  // query rows a task
constexpr int RT = 4;  // query rows x key vectors a tile of the score loop: RT x NK accumulators (of 32)
constexpr int NK = 4;
constexpr int ND = 4;  // vectors of dimensions a pass of the value loop
#else
constexpr int W = 8;
constexpr int R = 12;
constexpr int RT = 3;  // of 16 vector registers
constexpr int NK = 3;
constexpr int ND = 2;
#endif
constexpr int PR = 4;  // query rows a pass of the value loop
constexpr int PR_NARROW = 8;  // the same where a head has fewer dimensions than ND vectors (MiniLM's 32)

typedef float vec __attribute__((vector_size(W * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }
inline vec splat(float x) { return vec{} + x; }

using batchjob::Chunk;
using batchjob::softmax_row;
using Keys = batchjob::Keys<float>;
using Task = batchjob::Task<float>;

// Keys [0, ctx) of one KV head, zero past ctx up to a whole block: kp[block][dim][key]; values vp[key][dim].
void pack(const Keys& src, const Chunk& c, int64_t kvh, int64_t D, float* kp, float* vp) {
  static const float zeros[512] = {};  // D <= 512
  const int64_t blocks = (c.ctx + W - 1) / W;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* key[W];
    for (int jj = 0; jj < W; ++jj) {
      const int64_t j = b * W + jj;
      const int64_t t = j < c.ctx ? src.token(c, j) : -1;
      key[jj] = t < 0 ? zeros : src.k + t * src.k_tok + kvh * src.k_head;
      std::memcpy(vp + j * D, t < 0 ? zeros : src.v + t * src.v_tok + kvh * src.v_head, D * sizeof(float));
    }
    batchjob::transpose_keys<W>(key, D, kp + b * D * W);
  }
}

// acc rows (D floats from dimension d0, N vectors) = sum over keys of p.v, PR rows at once.
template <int N>
inline void weigh_values(const float* const* prob, int rows, int64_t keys, const float* vp, int64_t D,
                         int64_t d0, float* const* acc) {
  vec sum[PR][N];
  for (int r = 0; r < PR; ++r)
    for (int n = 0; n < N; ++n) sum[r][n] = vec{};
  for (int64_t j = 0; j < keys; ++j) {
    vec v[N];
    for (int n = 0; n < N; ++n) v[n] = load(vp + j * D + d0 + n * W);
    for (int r = 0; r < PR; ++r) {
      if (r >= rows) break;
      const vec p = splat(prob[r][j]);
      for (int n = 0; n < N; ++n) sum[r][n] += p * v[n];
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int n = 0; n < N; ++n) store(acc[r] + d0 + n * W, sum[r][n]);
}

// scores[r][b0 * W ...] for RT rows from r0 and N key blocks from b0: each key vector loaded once for RT rows,
// each query value broadcast once for N key vectors.
template <int N>
inline void score_tile(const float* q, int64_t D, const float* kp, int64_t b0, float* scores, int64_t width) {
  vec acc[RT][N];
  for (int r = 0; r < RT; ++r)
    for (int n = 0; n < N; ++n) acc[r][n] = vec{};
  for (int64_t d = 0; d < D; ++d) {
    vec k[N];
    for (int n = 0; n < N; ++n) k[n] = load(kp + (b0 + n) * D * W + d * W);
    for (int r = 0; r < RT; ++r) {
      const vec qq = splat(q[r * D + d]);
      for (int n = 0; n < N; ++n) acc[r][n] += qq * k[n];
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int n = 0; n < N; ++n) store(scores + r * width + (b0 + n) * W, acc[r][n]);
}

// The same for heads of fewer than ND vectors of dimensions (N < ND), PR_NARROW rows at once, every row
// computed (a row past the task's last repeats it): 1.07-1.16x the loop above at MiniLM's 32 dimensions, where
// for 64 dimensions this form measured 0.85-0.93x it.
template <int N>
inline void weigh_narrow(const float* const* prob, int rows, int64_t keys, const float* vp, int64_t D,
                         float* acc) {
  for (int r0 = 0; r0 < rows; r0 += PR_NARROW) {
    vec sum[PR_NARROW][N];
    const float* p[PR_NARROW];
    for (int r = 0; r < PR_NARROW; ++r) {
      p[r] = prob[std::min(r0 + r, rows - 1)];
      for (int n = 0; n < N; ++n) sum[r][n] = vec{};
    }
    for (int64_t j = 0; j < keys; ++j) {
      vec v[N];
      for (int n = 0; n < N; ++n) v[n] = load(vp + j * D + n * W);
      for (int r = 0; r < PR_NARROW; ++r) {
        const vec pj = splat(p[r][j]);
        for (int n = 0; n < N; ++n) sum[r][n] += pj * v[n];
      }
    }
    for (int r = 0; r < std::min(PR_NARROW, rows - r0); ++r)
      for (int n = 0; n < N; ++n) store(acc + (r0 + r) * D + n * W, sum[r][n]);
  }
}

struct Scratch {
  std::vector<float> q;       // [R][D] the task's query rows
  std::vector<float> scores;  // [R][keys], then each row's probabilities
  std::vector<float> acc;     // [R][D]

  Scratch(int64_t D, int64_t widest)
      : q(static_cast<size_t>(R * D)), scores(static_cast<size_t>(R * widest)), acc(static_cast<size_t>(R * D)) {}
};

void attend(const Task& task, const Chunk& c, int64_t kvh, int64_t row0, const float* kp, const float* vp,
            Scratch& s) {
  const int64_t D = task.D;
  const float scale = task.scale;
  int64_t first[R], count[R];  // the keys each row sees: [first, count)
  const int rows = batchjob::task_rows<R>(task, c, kvh, row0, first, count, s.q.data());
  const int64_t keys = count[rows - 1], blocks = (keys + W - 1) / W, width = blocks * W;

  for (int r0 = 0; r0 < rows; r0 += RT) {  // scores, RT rows x NK * W keys at a time
    const float* qr = s.q.data() + r0 * D;
    float* sr = s.scores.data() + r0 * width;
    for (int64_t b0 = 0; b0 < blocks; b0 += NK) {
      batchjob::up_to_four(std::min<int64_t>(NK, blocks - b0), [&](auto n) {
        score_tile<decltype(n)::value>(qr, D, kp, b0, sr, width);
      });
    }
  }

  float inv_sum[R];
  const float* prob[R];
  for (int r = 0; r < rows; ++r) {  // softmax of each row over its own keys
    float* sr = s.scores.data() + r * width;
    inv_sum[r] = 1.0f / softmax_row(sr, first[r], count[r], scale);
    std::fill(sr + count[r], sr + width, 0.0f);
    prob[r] = sr;
  }

  if (D < ND * W && D / W <= 2) {  // weighted sums of values: a narrow head's
    if (D / W == 2)
      weigh_narrow<2>(prob, rows, keys, vp, D, s.acc.data());
    else
      weigh_narrow<1>(prob, rows, keys, vp, D, s.acc.data());
  } else {
    for (int r0 = 0; r0 < rows; r0 += PR) {  // weighted sums of values, PR rows x ND vectors at a time
      const int n = std::min(PR, rows - r0);
      float* accs[PR];
      for (int r = 0; r < PR; ++r) accs[r] = s.acc.data() + (r0 + std::min(r, n - 1)) * D;
      for (int64_t d0 = 0; d0 < D; d0 += ND * W) {
        batchjob::up_to_four(std::min<int64_t>(ND, (D - d0) / W), [&](auto nd) {
          weigh_values<decltype(nd)::value>(prob + r0, n, keys, vp, D, d0, accs);
        });
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    float* o = batchjob::out_row(task, c, kvh, row0 + r);
    const float* a = s.acc.data() + r * D;
    for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv_sum[r];
  }
}

// The kernel, as prefill_tasks.h drives it.
struct Kernel {
  using E = float;
  using Scratch = ::Scratch;
  static constexpr int64_t block_keys = W, task_rows = R;
  static constexpr auto pack = ::pack;
  static constexpr auto attend = ::attend;
};

}  // namespace

extern "C" {

// As batchjob_prefill_bf16 (paged_prefill.cpp), in float32; D a multiple of 16, at most 512.
int batchjob_prefill_f32(const float* q, int64_t q_head_stride, int64_t q_tok_stride, const float* k,
                         int64_t k_head_stride, int64_t k_tok_stride, const float* v, int64_t v_head_stride,
                         int64_t v_tok_stride, const int64_t* block_table, int64_t table_stride,
                         int64_t block_size, const int64_t* q_starts, const int64_t* q_lens,
                         const int64_t* ctx_lens, int64_t num_chunks, int64_t heads, int64_t kv_heads,
                         int64_t dim, double scale, int64_t causal, int64_t window,
                         const int64_t* key_ends, float* out) {
  const Keys src{k, v, k_head_stride, k_tok_stride, v_head_stride, v_tok_stride, block_size};
  const Task task{q, q_head_stride, q_tok_stride, heads, kv_heads, dim, static_cast<float>(scale), causal != 0,
                  window, key_ends, out};
  batchjob::run_prefill<Kernel>(task, src, block_table, table_stride, q_starts, q_lens, ctx_lens, num_chunks);
  return 0;
}

}  // extern "C"
