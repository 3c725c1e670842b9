// A linear layer's product in bfloat16 on AVX512-BF16 dot products (vdpbf16ps), for a CPU without AMX:
// y = x W^T (+ bias), x [m, k] and y [m, n] bfloat16 rows, float sums rounded to the nearest even bfloat16.
//
// A decode step multiplies a few rows by every weight of the model, so its linear layers are bound by how
// fast the weights stream from memory and how fast a core turns each loaded weight into dot products. On
// a Zen 4 core pair oneDNN's bf16 kernel streamed 8-16 GB/s at 16 rows where a plain read of the same bytes
// runs at 30. Here a decode step's call reads each weight from memory once: a pair of 16-column blocks is
// loaded, prefetched a few KB ahead, and used by up to 14 rows at once (14 x 2 accumulators in registers, a
// row's pair of x values broadcast to all 16 lanes), so a 16-row call keeps the weights streaming while the
// products keep up (16-21 GB/s there).
// Large calls (prompt steps) take rows in chunks that stay in cache while the column pairs go by, which ran
// as fast as oneDNN's kernel there; weights are then held in one layout for every call.
//
// Layout (batchjob_pack_bf16): blocks of 16 output columns, each k/2 pairs x 16 columns x 2 values (one zmm
// per pair of inputs), the blocks' count rounded up to even and the padding zero. k must be even. Sums run
// over k in order, a pair at a time, as oneDNN's kernel sums them: the outputs measured equal its own but for
// ~20 elements in a million, a last bit apart.

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define BATCHJOB_LINEAR 1
#else
#define BATCHJOB_LINEAR 0
#endif

extern "C" int batchjob_linear_bf16_available() { return BATCHJOB_LINEAR; }

namespace {
constexpr int64_t COLS = 16;  // output columns a block (one zmm of float sums)
}

#if BATCHJOB_LINEAR
namespace {

constexpr int64_t CHUNK = 8 * 14;  // rows a pass over the weights keeps in cache (a multiple of the tile's)
constexpr int64_t AHEAD = 2048;    // prefetch distance in bfloat16 values (4 KB) along a block's stream

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

inline int32_t pair(const uint16_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof v);
  return v;
}

// R rows of x against one pair of column blocks (w and w + pairs * 32), written to y's columns [0, 32).
template <int R>
void tile(const uint16_t* x, int64_t k, const uint16_t* w, int64_t pairs, const float* bias, uint16_t* y,
          int64_t ldy, int64_t cols) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint16_t* w1 = w + pairs * 32;
  for (int64_t p = 0; p < pairs; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(w + p * 32 + AHEAD), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w1 + p * 32 + AHEAD), _MM_HINT_T0);
    const __m512bh b0 = as_bh(_mm512_loadu_si512(w + p * 32));
    const __m512bh b1 = as_bh(_mm512_loadu_si512(w1 + p * 32));
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
      const __m512bh a = as_bh(_mm512_set1_epi32(pair(x + r * k + 2 * p)));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
    }
  }
  for (int c = 0; c < 2; ++c) {
    const int64_t n = cols - c * COLS < COLS ? cols - c * COLS : COLS;
    if (n <= 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c * COLS) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][c], b)));
      _mm256_mask_storeu_epi16(y + r * ldy + c * COLS, mask, h);
    }
  }
}

// Rows [r, end) against one pair of column blocks, in tiles of 14 rows, then what is left.
void rows(const uint16_t* x, int64_t r, int64_t end, int64_t k, const uint16_t* w, int64_t pairs,
          const float* bias, uint16_t* y, int64_t n, int64_t col, int64_t cols) {
  while (r < end) {
    const int64_t left = end - r;
    const uint16_t* xr = x + r * k;
    uint16_t* yr = y + r * n + col;
    if (left >= 14) {
      tile<14>(xr, k, w, pairs, bias, yr, n, cols);
      r += 14;
    } else if (left >= 8) {
      tile<8>(xr, k, w, pairs, bias, yr, n, cols);
      r += 8;
    } else if (left >= 4) {
      tile<4>(xr, k, w, pairs, bias, yr, n, cols);
      r += 4;
    } else if (left >= 2) {
      tile<2>(xr, k, w, pairs, bias, yr, n, cols);
      r += 2;
    } else {
      tile<1>(xr, k, w, pairs, bias, yr, n, cols);
      r += 1;
    }
  }
}

}  // namespace
#endif

extern "C" {

// Values in the packed layout of an [n, k] weight (what the caller allocates for batchjob_pack_bf16).
int64_t batchjob_packed_bf16_size(int64_t n, int64_t k) {
  return ((n + 2 * COLS - 1) / (2 * COLS)) * 2 * COLS * k;
}

// w [n, k] row-major into the layout above; k even.
void batchjob_pack_bf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* out) {
  const int64_t blocks = batchjob_packed_bf16_size(n, k) / (COLS * k), pairs = k / 2;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    uint16_t* block = out + b * pairs * 2 * COLS;
    for (int64_t c = 0; c < COLS; ++c) {
      const int64_t row = b * COLS + c;
      for (int64_t p = 0; p < pairs; ++p) {
        block[(p * COLS + c) * 2] = row < n ? w[row * k + 2 * p] : 0;
        block[(p * COLS + c) * 2 + 1] = row < n ? w[row * k + 2 * p + 1] : 0;
      }
    }
  }
}

// y [m, n] = x [m, k] times the packed weight, plus bias (float [n], or nullptr). Returns 0, or -1 where this
// build has no AVX512-BF16.
int batchjob_linear_bf16(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, const float* bias,
                         int64_t n, uint16_t* y) {
#if BATCHJOB_LINEAR
  const int64_t pairs = k / 2, blocks = (n + 2 * COLS - 1) / (2 * COLS);
  for (int64_t r = 0; r < m; r += CHUNK) {
    const int64_t end = r + CHUNK < m ? r + CHUNK : m;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t col = b * 2 * COLS;
      rows(x, r, end, k, w + b * pairs * 64, pairs, bias ? bias + col : nullptr, y, n, col, n - col);
    }
  }
  return 0;
#else
  (void)x, (void)m, (void)k, (void)w, (void)bias, (void)n, (void)y;
  return -1;
#endif
}

}  // extern "C"
