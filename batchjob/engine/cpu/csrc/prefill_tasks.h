// What the two prefill kernels share (paged_prefill.cpp in bf16, prefill_f32.cpp in float32): where a chunk's
// keys are, and the driver that packs each (chunk, KV head)'s keys and values once and then runs the tasks
// of query rows on the OpenMP team. A kernel gives its element type, its block of packed keys and rows a
// task, its scratch, and its pack and attend functions:
//
//   struct Kernel {
//     using E = ...;                     // the stored element (uint16_t for bf16's bits, float)
//     static constexpr int64_t block_keys = ...;  // keys a packed block
//     static constexpr int64_t task_rows = ...;   // query rows a task
//     struct Scratch { Scratch(int64_t dim, int64_t widest); ... };  // a thread's buffers
//     static void pack(const Keys<E>&, const Chunk&, int64_t kvh, int64_t D, E* kp, E* vp);
//     static void attend(const Task<E>&, const Chunk&, int64_t kvh, int64_t row0, const E* kp, const E* vp,
//                        Scratch&);
//   };

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace batchjob {

struct Chunk {
  int64_t q_start, q_len, ctx;
  const int64_t* blocks;  // its block table; nullptr: its keys are the step's tokens [q_start, q_start + ctx)
  int64_t packed;         // offset of its KV heads' packed keys (and values) in the packed buffer, in elements
};

// Where keys and values are: token t, KV head h at k + t * k_tok + h * k_head (v likewise); a token is a
// slot of the paged cache (block * block_size + offset) or a row of the step.
template <typename E>
struct Keys {
  const E *k, *v;
  int64_t k_head, k_tok, v_head, v_tok, block_size;

  int64_t token(const Chunk& c, int64_t j) const {  // key j of the chunk
    return c.blocks ? c.blocks[j / block_size] * block_size + j % block_size : c.q_start + j;
  }
};

// One block of W keys' dim values each, transposed into dst[dim][W] (the layout both kernels' score loops read
// a vector of keys from); rows[jj] are the keys' values, a row of zeros past the chunk's last key. Built a
// column at a time, so stores are contiguous: float32's pack 2.3x faster than key by key strided stores, whole
// calls 1.02-1.12x (float32) and 1.03-1.35x (bf16: CLIP B/16's images the most), bit-identical.
template <int W, typename T>
void transpose_keys(const T* const* rows, int64_t dim, T* dst) {
  for (int64_t d = 0; d < dim; ++d) {
    T* col = dst + d * W;
    for (int jj = 0; jj < W; ++jj) col[jj] = rows[jj][d];
  }
}

// f(std::integral_constant<int, k>{}) for k = n clamped to [1, 4]: a tile's width in vectors or key blocks as a
// template argument, so each width's loop is unrolled with its accumulators in registers.
template <typename F>
inline void up_to_four(int64_t n, F&& f) {
  switch (std::min<int64_t>(n, 4)) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// The call's queries and output, and its shape: q [heads, T, D] by its strides, out [T, heads, D]; which keys
// a query sees: up to itself (causal) or all of its chunk's, within a window of keys less than ``window``
// positions before it (and after it, both ways; 0: no window), or up to key_ends[row] (per row of the step,
// past the last key it sees: Gemma 3's image tokens see their image to its end; nullptr: the rule).
template <typename E>
struct Task {
  const E* q;
  int64_t q_head_stride, q_tok_stride, heads, kv_heads, D;
  float scale;
  bool causal;
  int64_t window;
  const int64_t* key_ends;
  E* out;
};

// A task's query rows: how many of the R from row0 exist (the rest repeat the last), the keys each sees
// ([first, count): both grow with the row, so the last row's count is the task's widest), and their queries
// copied to q_rows ([R][D]). A row is one position and one query head of KV head kvh's group.
template <int64_t R, typename E>
int task_rows(const Task<E>& task, const Chunk& c, int64_t kvh, int64_t row0, int64_t* first, int64_t* count,
              E* q_rows) {
  const int64_t group = task.heads / task.kv_heads, D = task.D;
  const int rows = static_cast<int>(std::min<int64_t>(R, c.q_len * group - row0));
  for (int64_t r = 0; r < R; ++r) {
    const int64_t row = row0 + std::min<int64_t>(r, rows - 1);
    const int64_t i = row / group, h = kvh * group + row % group, at = c.ctx - c.q_len + i;  // its position
    count[r] = task.key_ends ? task.key_ends[c.q_start + i] : task.causal ? at + 1 : c.ctx;
    first[r] = 0;
    if (task.window > 0) {
      first[r] = std::max<int64_t>(0, at - task.window + 1);
      if (!task.causal) count[r] = std::min(count[r], at + task.window);
    }
    std::memcpy(q_rows + r * D, task.q + h * task.q_head_stride + (c.q_start + i) * task.q_tok_stride,
                D * sizeof(E));
  }
  return rows;
}

// Where the task's row row0 + r writes its D outputs in out [T, heads, D].
template <typename E>
E* out_row(const Task<E>& task, const Chunk& c, int64_t kvh, int64_t row) {
  const int64_t group = task.heads / task.kv_heads, i = row / group, h = kvh * group + row % group;
  return task.out + ((c.q_start + i) * task.heads + h) * task.D;
}

template <typename K>
void run_prefill(const Task<typename K::E>& task, const Keys<typename K::E>& src, const int64_t* block_table,
                 int64_t table_stride, const int64_t* q_starts, const int64_t* q_lens, const int64_t* ctx_lens,
                 int64_t num_chunks) {
  using E = typename K::E;
  constexpr int64_t KB = K::block_keys;
  const int64_t group = task.heads / task.kv_heads, kv_heads = task.kv_heads, dim = task.D;
  std::vector<Chunk> chunks(static_cast<size_t>(num_chunks));
  std::vector<int64_t> tasks;  // (chunk, kv head, first row) triples
  int64_t packed = 0, widest = 0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t width = (ctx_lens[c] + KB - 1) / KB * KB;
    const int64_t* blocks = block_table ? block_table + c * table_stride : nullptr;
    chunks[c] = Chunk{q_starts[c], q_lens[c], ctx_lens[c], blocks, packed};
    packed += kv_heads * 2 * width * dim;  // keys, then values, of each KV head
    widest = std::max(widest, width);
    for (int64_t g = 0; g < kv_heads; ++g)
      for (int64_t row = 0; row < q_lens[c] * group; row += K::task_rows) tasks.insert(tasks.end(), {c, g, row});
  }
  std::unique_ptr<E[]> kv(new E[packed]);  // not zeroed: the pack writes every element, padding included
  const int64_t num_tasks = static_cast<int64_t>(tasks.size()) / 3;
#pragma omp parallel
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t cg = 0; cg < num_chunks * kv_heads; ++cg) {
      const Chunk& c = chunks[cg / kv_heads];
      const int64_t g = cg % kv_heads, width = (c.ctx + KB - 1) / KB * KB;
      E* kp = kv.get() + c.packed + g * 2 * width * dim;
      K::pack(src, c, g, dim, kp, kp + width * dim);
    }
    typename K::Scratch s(dim, widest);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = num_tasks - 1; t >= 0; --t) {  // the last rows of a causal chunk see the most keys: first
      const Chunk& c = chunks[tasks[3 * t]];
      const int64_t g = tasks[3 * t + 1], width = (c.ctx + KB - 1) / KB * KB;
      const E* kp = kv.get() + c.packed + g * 2 * width * dim;
      K::attend(task, c, g, tasks[3 * t + 2], kp, kp + width * dim, s);
    }
  }
}

}  // namespace batchjob
