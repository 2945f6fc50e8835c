// LoRA on the CPU (ops.h, lora_add): y[r] += B_s (A_s x[r]) for each row r whose slot s = row_slots[r] is >= 0,
// in two phases over the rows that have a slot, grouped by slot.
//
// Shrink: h[r, j] = A_s[j] . x[r] for the P * R rows j of A_s, each one dot over `in`: 16 float32 lanes of fused
// multiply-adds over chunks of 16 inputs in ascending order (the ragged tail zero-padded), then vec.h's fixed tree
// over the lanes; rounded to T (the reference's h is a tensor of T). Tasks: a row and 4 rows of A.
//
// Expand: for output o of part p, y[r, o] = T(y[r, o] + T(sum over k < R of B_s[o, k] * h[r, p * R + k])), the
// sum one chain of fused multiply-adds in ascending k from zero, vectorised over 16 outputs of one part at a time
// (their block of B transposed once per slot into [R][16], then every row of that slot passes over it). Tasks:
// a block of 16 outputs, for every slot in use.
//
// What a row's bits depend on: its x and y, its slot's A and B, `in`, R and the part ends; never the other rows
// (which rows share a task or a tile changes which loads are shared, not an output's chain), the thread count,
// or the slot's index. Zero padding past an adapter's rank adds exact zeros to each chain.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "ops.h"

namespace rill_cpu {
namespace {

constexpr int kShrinkRows = 4;  // rows of A per shrink task: four accumulators share each load of x
constexpr int kExpandRows = 4;  // rows of y per expand tile: four independent chains share each load of B

// h[j] = dot(a + j * in, x) for j < J, each as the file's header says, rounded to T.
template <int J, typename T>
void shrink(const T* x, const T* a, int64_t in, float* h) {
  Vec16 acc[J];
  for (int j = 0; j < J; ++j) acc[j] = zeros();
  int64_t i = 0;
  for (; i + kLanes <= in; i += kLanes) {
    const Vec16 xv = load(x + i);
    for (int j = 0; j < J; ++j) acc[j] = fmadd(load(a + j * in + i), xv, acc[j]);
  }
  if (i < in) {  // the ragged tail, zero-padded to a chunk
    float tail_x[kLanes] = {}, tail_a[kLanes] = {};
    for (int64_t t = i; t < in; ++t) tail_x[t - i] = to_float(x[t]);
    const Vec16 xv = load(tail_x);
    for (int j = 0; j < J; ++j) {
      for (int64_t t = i; t < in; ++t) tail_a[t - i] = to_float(a[j * in + t]);
      acc[j] = fmadd(load(tail_a), xv, acc[j]);
    }
  }
  for (int j = 0; j < J; ++j) h[j] = to_float(from_float<T>(reduce_add(acc[j])));
}

template <typename T>
void shrink_some(int num, const T* x, const T* a, int64_t in, float* h) {
  switch (num) {
    case 1: return shrink<1>(x, a, in, h);
    case 2: return shrink<2>(x, a, in, h);
    case 3: return shrink<3>(x, a, in, h);
    default: return shrink<kShrinkRows>(x, a, in, h);
  }
}

// Rows rows[0..N) of y, outputs [o0, o0 + width) (width <= 16, one part), from bt [R][16] (the block of B,
// transposed) and each row's h of that part (row t's at h + t * h_stride).
template <int N, typename T>
void expand_tile(const int64_t* rows, const float* h, int64_t h_stride, const float* bt, int64_t rank, T* y,
                 int64_t out, int64_t o0, int64_t width) {
  Vec16 acc[N];
  for (int t = 0; t < N; ++t) acc[t] = zeros();
  for (int64_t k = 0; k < rank; ++k) {
    const Vec16 b = load(bt + k * kLanes);
    for (int t = 0; t < N; ++t) acc[t] = fmadd(broadcast(h[t * h_stride + k]), b, acc[t]);
  }
  for (int t = 0; t < N; ++t) {
    Vec16 product = acc[t];
    if constexpr (std::is_same_v<T, bf16>) product = round_bf16(product);  // the reference's product tensor
    T* dst = y + rows[t] * out + o0;
    if (width == kLanes) {
      store(dst, add(load(dst), product));
      continue;
    }
    float lanes[kLanes] = {};
    for (int64_t i = 0; i < width; ++i) lanes[i] = to_float(dst[i]);
    store(lanes, add(load(lanes), product));
    for (int64_t i = 0; i < width; ++i) dst[i] = from_float<T>(lanes[i]);
  }
}

template <typename T>
void expand_some(int num, const int64_t* rows, const float* h, int64_t h_stride, const float* bt, int64_t rank,
                 T* y, int64_t out, int64_t o0, int64_t width) {
  switch (num) {
    case 1: return expand_tile<1>(rows, h, h_stride, bt, rank, y, out, o0, width);
    case 2: return expand_tile<2>(rows, h, h_stride, bt, rank, y, out, o0, width);
    case 3: return expand_tile<3>(rows, h, h_stride, bt, rank, y, out, o0, width);
    default: return expand_tile<kExpandRows>(rows, h, h_stride, bt, rank, y, out, o0, width);
  }
}

}  // namespace

template <typename T>
void lora_add(T* y, const T* x, const T* lora_a, const T* lora_b, const int32_t* row_slots, int64_t num_rows,
              int64_t in, int64_t rank, const int64_t* part_ends, int64_t num_parts, int num_threads) {
  const int64_t out = part_ends[num_parts - 1], h_width = num_parts * rank;
  // The rows that have a slot, grouped by slot (ascending rows within one): rows[slot_begin[s]..slot_begin[s+1]).
  int64_t num_slots = 0;
  for (int64_t r = 0; r < num_rows; ++r) num_slots = std::max<int64_t>(num_slots, int64_t{row_slots[r]} + 1);
  if (num_slots == 0) return;
  std::vector<int64_t> slot_begin(num_slots + 1, 0);
  for (int64_t r = 0; r < num_rows; ++r) {
    if (row_slots[r] >= 0) ++slot_begin[row_slots[r] + 1];
  }
  for (int64_t s = 0; s < num_slots; ++s) slot_begin[s + 1] += slot_begin[s];
  const int64_t num_lora_rows = slot_begin[num_slots];
  std::vector<int64_t> rows(num_lora_rows), next(slot_begin.begin(), slot_begin.end() - 1);
  for (int64_t r = 0; r < num_rows; ++r) {
    if (row_slots[r] >= 0) rows[next[row_slots[r]]++] = r;
  }
  // h for rows[i] in row i: [num_lora_rows, P * R], float32 holding values of T.
  std::vector<float> h(num_lora_rows * h_width);
  const int64_t shrink_blocks = (h_width + kShrinkRows - 1) / kShrinkRows;
  const int threads = threads_for(num_lora_rows * (h_width * in + out * rank), num_threads);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t task = 0; task < num_lora_rows * shrink_blocks; ++task) {
      const int64_t i = task / shrink_blocks, j0 = task % shrink_blocks * kShrinkRows;
      const int64_t slot = row_slots[rows[i]];
      shrink_some(static_cast<int>(std::min<int64_t>(kShrinkRows, h_width - j0)), x + rows[i] * in,
                  lora_a + (slot * h_width + j0) * in, in, h.data() + i * h_width + j0);
    }
    // Blocks of 16 outputs, each within one part: part p's blocks start at its first output.
    std::vector<float> bt(rank * kLanes);
    int64_t num_blocks = 0;
    for (int64_t p = 0, start = 0; p < num_parts; start = part_ends[p++]) {
      num_blocks += (part_ends[p] - start + kLanes - 1) / kLanes;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t block = 0; block < num_blocks; ++block) {
      int64_t p = 0, start = 0, first_block = 0;  // the block's part, its first output, its first block
      while (block >= first_block + (part_ends[p] - start + kLanes - 1) / kLanes) {
        first_block += (part_ends[p] - start + kLanes - 1) / kLanes;
        start = part_ends[p++];
      }
      const int64_t o0 = start + (block - first_block) * kLanes;
      const int64_t width = std::min<int64_t>(kLanes, part_ends[p] - o0);
      for (int64_t s = 0; s < num_slots; ++s) {
        const int64_t begin = slot_begin[s], end = slot_begin[s + 1];
        if (begin == end) continue;
        const T* b = lora_b + (s * out + o0) * rank;
        std::fill(bt.begin(), bt.end(), 0.0f);
        for (int64_t i = 0; i < width; ++i) {
          for (int64_t k = 0; k < rank; ++k) bt[k * kLanes + i] = to_float(b[i * rank + k]);
        }
        for (int64_t i = begin; i < end; i += kExpandRows) {
          const int num = static_cast<int>(std::min<int64_t>(kExpandRows, end - i));
          expand_some(num, rows.data() + i, h.data() + i * h_width + p * rank, h_width, bt.data(), rank, y, out,
                      o0, width);
        }
      }
    }
  }
}

template void lora_add<float>(float*, const float*, const float*, const float*, const int32_t*, int64_t, int64_t,
                              int64_t, const int64_t*, int64_t, int);
template void lora_add<bf16>(bf16*, const bf16*, const bf16*, const bf16*, const int32_t*, int64_t, int64_t,
                             int64_t, const int64_t*, int64_t, int);

}  // namespace rill_cpu
