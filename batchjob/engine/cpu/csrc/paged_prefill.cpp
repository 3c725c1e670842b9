// Prefill attention for the CPU in bfloat16, on AVX512-BF16 dot products (vdpbf16ps): prompt chunks over the
// paged cache, and rows attended both ways (an encoder's, a vision tower's images) over their own keys.
//
// torch's CPU flash attention widens bfloat16 to float and runs float32 GEMMs: 40-70 GFLOP/s on a Zen 4
// core pair, where a bfloat16 GEMM runs at 400. Here the two products of attention run as bfloat16 pairs
// with float sums, as a bfloat16 GEMM does: scores = q.k in float, softmax in float, the probabilities
// rounded to bfloat16 (as torch's kernel rounds them for its second GEMM), out = sum p.v in float, divided
// by the float sum of the probabilities and rounded to the nearest even bfloat16.
//
// A call attends every chunk of a step, each q_len queries at positions [ctx - q_len, ctx) over keys
// [0, ctx): read through the chunk's block table from the paged cache (its new keys already written;
// layout as in paged_decode.cpp, [num_blocks, block_size, kv_heads, D]), or, without a table, the chunk's own
// q_len keys among the step's (ctx == q_len). Causal: query i sees keys up to ctx - q_len + i; else every
// key; a window (on either side, both ways) or a row's own key end narrows that (prefill_tasks.h's Task).
// q [heads, T, D], keys and values [tokens, kv_heads, D] addressed by their strides; out [T, heads, D].
//
// First each (chunk, KV head)'s keys and values are copied into the layouts the instruction takes: keys
// in blocks of 16 with their D values as 32-bit pairs key by key (one zmm: one pair of 16 keys), values as
// pairs of neighbouring keys dimension by dimension (one zmm: one key pair of 16 dimensions). Then tasks of
// 16 query rows (a row: one position and one query head of the KV head's group) compute their scores
// against the keys up to the last row's, the softmax of each row, and the weighted sum of values. The two
// phases run on the OpenMP team by the driver both prefill kernels share (prefill_tasks.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"
#include "prefill_tasks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define BATCHJOB_PREFILL 1
#else
#define BATCHJOB_PREFILL 0
#endif

extern "C" int batchjob_paged_prefill_available() { return BATCHJOB_PREFILL; }

#if BATCHJOB_PREFILL
namespace {

constexpr int64_t KB = 16;  // keys per block of packed keys: one zmm of float scores per query row
constexpr int R = 16;       // query rows per task (one accumulator each in the score loop)
constexpr int PR = 4;       // query rows per pass of the value loop (4 rows x 4 zmm of dimensions)
constexpr int RT = 4;       // query rows x key blocks a tile of the score loop (RT x NK accumulators)
constexpr int NK = 4;

using batchjob::bf16_bits;
using batchjob::Chunk;
using batchjob::softmax_row;
using Keys = batchjob::Keys<uint16_t>;
using Task = batchjob::Task<uint16_t>;

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }



// Keys [0, ctx) of one KV head, zero past ctx up to a whole block: kp[block][pair][key] as 32-bit pairs;
// values: vp[key pair][dim] as 32-bit pairs of the two keys' values.
void pack(const Keys& src, const Chunk& c, int64_t kvh, int64_t D, uint16_t* kp, uint16_t* vp) {
  static const uint16_t zeros[512] = {};  // D <= 512
  const int64_t blocks = (c.ctx + KB - 1) / KB, pairs = D / 2;
  uint32_t keys[KB][256];  // the block's keys as 32-bit pairs
  const uint32_t* key[KB];
  const uint16_t* value[KB];
  for (int64_t b = 0; b < blocks; ++b) {
    for (int jj = 0; jj < KB; ++jj) {
      const int64_t j = b * KB + jj, t = j < c.ctx ? src.token(c, j) : -1;
      std::memcpy(keys[jj], t < 0 ? zeros : src.k + t * src.k_tok + kvh * src.k_head, D * sizeof(uint16_t));
      key[jj] = keys[jj];
      value[jj] = t < 0 ? zeros : src.v + t * src.v_tok + kvh * src.v_head;
    }
    batchjob::transpose_keys<KB>(key, pairs, reinterpret_cast<uint32_t*>(kp) + b * pairs * KB);
    for (int jj = 0; jj < KB; jj += 2) {  // a pair of keys' values, interleaved dimension by dimension
      uint16_t* dst = vp + (b * KB + jj) * D;
      for (int64_t d = 0; d < D; ++d) {
        dst[2 * d] = value[jj][d];
        dst[2 * d + 1] = value[jj + 1][d];
      }
    }
  }
}

// out rows[r] (D values, ND zmm of 16 from dimension d0) = sum over key pairs of p.v, for PR rows at once.
template <int ND>
inline void weigh_values(const uint16_t* const* prob, int rows, int64_t key_pairs, const uint16_t* vp, int64_t D,
                         int64_t d0, float* const* acc) {
  __m512 sum[PR][ND];
  for (int r = 0; r < PR; ++r)
    for (int n = 0; n < ND; ++n) sum[r][n] = _mm512_setzero_ps();
  for (int64_t m = 0; m < key_pairs; ++m) {
    __m512bh v[ND];
    for (int n = 0; n < ND; ++n) v[n] = as_bh(_mm512_loadu_si512(vp + (m * D + d0 + n * 16) * 2));
    for (int r = 0; r < PR; ++r) {
      if (r >= rows) break;
      uint32_t pair;
      std::memcpy(&pair, prob[r] + 2 * m, sizeof pair);
      const __m512bh p = as_bh(_mm512_set1_epi32(static_cast<int>(pair)));
      for (int n = 0; n < ND; ++n) sum[r][n] = _mm512_dpbf16_ps(sum[r][n], p, v[n]);
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int n = 0; n < ND; ++n) _mm512_storeu_ps(acc[r] + d0 + n * 16, sum[r][n]);
}

// scores[r][b0 * KB ...] for RT rows of q (pairs each) and N key blocks from b0: each key vector loaded once
// for RT rows, each query pair broadcast once for N key blocks.
template <int N>
inline void score_tile(const uint32_t* q, int64_t pairs, const uint16_t* kp, int64_t b0, float* scores,
                       int64_t width) {
  __m512 acc[RT][N];
  for (int r = 0; r < RT; ++r)
    for (int n = 0; n < N; ++n) acc[r][n] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh k[N];
    for (int n = 0; n < N; ++n) k[n] = as_bh(_mm512_loadu_si512(kp + ((b0 + n) * pairs + p) * KB * 2));
    for (int r = 0; r < RT; ++r) {
      const __m512bh qq = as_bh(_mm512_set1_epi32(static_cast<int>(q[r * pairs + p])));
      for (int n = 0; n < N; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], qq, k[n]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int n = 0; n < N; ++n) _mm512_storeu_ps(scores + r * width + (b0 + n) * KB, acc[r][n]);
}

struct Scratch {
  std::vector<uint32_t> q;      // [R][D/2] the task's query rows as pairs
  std::vector<float> scores;    // [R][keys]
  std::vector<uint16_t> probs;  // [R][keys] rounded to bf16, zero past each row's keys
  std::vector<float> acc;       // [R][D]

  Scratch(int64_t D, int64_t widest)
      : q(static_cast<size_t>(R * D / 2)), scores(static_cast<size_t>(R * widest)),
        probs(static_cast<size_t>(R * (widest + 2))), acc(static_cast<size_t>(R * D)) {}
};

void attend(const Task& task, const Chunk& c, int64_t kvh, int64_t row0, const uint16_t* kp, const uint16_t* vp,
            Scratch& s) {
  const int64_t D = task.D, pairs = D / 2;
  const float scale = task.scale;
  int64_t first[R], count[R];  // the keys each row sees: [first, count)
  const int rows = batchjob::task_rows<R>(task, c, kvh, row0, first, count, reinterpret_cast<uint16_t*>(s.q.data()));
  const int64_t keys = count[rows - 1], blocks = (keys + KB - 1) / KB, width = blocks * KB;

  for (int r0 = 0; r0 < rows; r0 += RT) {  // scores, RT rows x NK blocks of 16 keys at a time
    const uint32_t* qr = s.q.data() + r0 * pairs;
    float* sr = s.scores.data() + r0 * width;
    for (int64_t b0 = 0; b0 < blocks; b0 += NK) {
      batchjob::up_to_four(std::min<int64_t>(NK, blocks - b0), [&](auto n) {
        score_tile<decltype(n)::value>(qr, pairs, kp, b0, sr, width);
      });
    }
  }

  float inv_sum[R];
  const uint16_t* prob[R];
  for (int r = 0; r < rows; ++r) {  // softmax of each row over its own keys
    float* sr = s.scores.data() + r * width;
    uint16_t* pr = s.probs.data() + r * (width + 2);
    inv_sum[r] = 1.0f / softmax_row(sr, first[r], count[r], scale);
    for (int64_t j = 0; j < count[r]; ++j) pr[j] = bf16_bits(sr[j]);
    std::fill(pr + count[r], pr + width + 2, uint16_t{0});
    prob[r] = pr;
  }

  const int64_t key_pairs = (keys + 1) / 2;
  for (int r0 = 0; r0 < rows; r0 += PR) {  // weighted sums of values, 4 rows x 64 dimensions at a time
    const int n = std::min(PR, rows - r0);
    float* accs[PR];
    for (int r = 0; r < PR; ++r) accs[r] = s.acc.data() + (r0 + std::min(r, n - 1)) * D;
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      batchjob::up_to_four((D - d0) / 16, [&](auto nd) {
        weigh_values<decltype(nd)::value>(prob + r0, n, key_pairs, vp, D, d0, accs);
      });
    }
  }
  for (int r = 0; r < rows; ++r) {
    uint16_t* o = batchjob::out_row(task, c, kvh, row0 + r);
    const float* a = s.acc.data() + r * D;
    for (int64_t d = 0; d < D; ++d) o[d] = bf16_bits(a[d] * inv_sum[r]);
  }
}

// The kernel, as prefill_tasks.h drives it.
struct Kernel {
  using E = uint16_t;
  using Scratch = ::Scratch;
  static constexpr int64_t block_keys = KB, task_rows = R;
  static constexpr auto pack = ::pack;
  static constexpr auto attend = ::attend;
};

}  // namespace
#endif

extern "C" {

// q [heads, T, D], k and v [tokens, kv_heads, D], each by its strides (a head's, a token's); per chunk:
// q_starts, q_lens, ctx_lens and its row of block_table (nullptr: keys are the chunk's own rows, ctx_lens its
// q_lens); D a multiple of 16, at most 512; heads a multiple of kv_heads; window (0: none) and key_ends ([T]
// or nullptr) as Task takes them (prefill_tasks.h). Returns 0, or -1 where this build has no AVX512-BF16.
int batchjob_prefill_bf16(const uint16_t* q, int64_t q_head_stride, int64_t q_tok_stride, const uint16_t* k,
                          int64_t k_head_stride, int64_t k_tok_stride, const uint16_t* v, int64_t v_head_stride,
                          int64_t v_tok_stride, const int64_t* block_table, int64_t table_stride,
                          int64_t block_size, const int64_t* q_starts, const int64_t* q_lens,
                          const int64_t* ctx_lens, int64_t num_chunks, int64_t heads, int64_t kv_heads,
                          int64_t dim, double scale, int64_t causal, int64_t window,
                          const int64_t* key_ends, uint16_t* out) {
#if BATCHJOB_PREFILL
  const Keys src{k, v, k_head_stride, k_tok_stride, v_head_stride, v_tok_stride, block_size};
  const Task task{q, q_head_stride, q_tok_stride, heads, kv_heads, dim, static_cast<float>(scale), causal != 0,
                  window, key_ends, out};
  batchjob::run_prefill<Kernel>(task, src, block_table, table_stride, q_starts, q_lens, ctx_lens, num_chunks);
  return 0;
#else
  (void)q, (void)q_head_stride, (void)q_tok_stride, (void)k, (void)k_head_stride, (void)k_tok_stride, (void)v;
  (void)v_head_stride, (void)v_tok_stride, (void)block_table, (void)table_stride, (void)block_size;
  (void)q_starts, (void)q_lens, (void)ctx_lens, (void)num_chunks, (void)heads, (void)kv_heads, (void)dim;
  (void)scale, (void)causal, (void)window, (void)key_ends, (void)out;
  return -1;
#endif
}

}  // extern "C"
