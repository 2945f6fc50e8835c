// Row reductions over float32 logits for the sampler: the first maximum's index, and the two numbers that make
// log-softmax (the row's max and the log of its sum of exp(x - max)). Each row is reduced on its own, by one
// thread, in a fixed order: the results do not depend on the other rows or the thread count.
#include <algorithm>
#include <cmath>
#include <limits>

#include "ops.h"

namespace rill_cpu {
namespace {

// The largest element of x[0..n) (n >= 1) with NaNs left aside, and whether x holds a NaN: one pass.
struct RowMax {
  float max;
  bool has_nan;
};

RowMax row_max(const float* x, int64_t n) {
  Vec16 lanes = broadcast(-std::numeric_limits<float>::infinity());
  Mask nan_lanes = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec16 v = load(x + i);
    nan_lanes |= is_nan(v);
    lanes = max(v, lanes);  // a NaN lane of v loses to lanes
  }
  RowMax result{reduce_max(lanes), nan_lanes != 0};
  for (; i < n; ++i) {
    result.has_nan |= std::isnan(x[i]);
    result.max = x[i] > result.max ? x[i] : result.max;
  }
  return result;
}

// The first i in [0, n) whose lane `test` (Vec16 -> Mask) marks, or n. The ragged tail is read through a buffer
// filled with `pad`, which the test must not mark.
template <typename Test>
int64_t first_marked(const float* x, int64_t n, float pad, Test test) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Mask marked = test(load(x + i));
    if (marked != 0) return i + __builtin_ctz(marked);
  }
  if (i < n) {
    float tail[kLanes];
    std::fill_n(tail, kLanes, pad);
    std::copy(x + i, x + n, tail);
    const Mask marked = test(load(tail));
    if (marked != 0) return i + __builtin_ctz(marked);
  }
  return n;
}

}  // namespace

void argmax_rows(const float* x, int64_t num_rows, int64_t n, int64_t* out, int num_threads) {
#pragma omp parallel for num_threads(threads_for(num_rows * n, num_threads))
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* row = x + r * n;
    const RowMax m = row_max(row, n);
    if (m.has_nan) {  // as torch's max(dim=-1): a NaN is the maximum, the first one wins
      out[r] = first_marked(row, n, 0.0f, is_nan);
      continue;
    }
    const Vec16 target = broadcast(m.max);
    out[r] = first_marked(row, n, std::numeric_limits<float>::quiet_NaN(),
                          [&](Vec16 v) { return equal(v, target); });
  }
}

void softmax_stats(const float* x, int64_t num_rows, int64_t n, float* row_maxes, float* log_sums,
                   int num_threads) {
#pragma omp parallel for num_threads(threads_for(num_rows * n, num_threads))
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* row = x + r * n;
    const RowMax row_stats = row_max(row, n);
    const float m = row_stats.has_nan ? std::numeric_limits<float>::quiet_NaN() : row_stats.max;
    const Vec16 shift = broadcast(m);
    Vec16 sums = zeros();
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) sums = add(sums, exp(sub(load(row + i), shift)));
    if (i < n) {  // the ragged tail through a buffer padded with -inf, whose exp is 0
      float tail[kLanes];
      std::fill_n(tail, kLanes, -std::numeric_limits<float>::infinity());
      std::copy(row + i, row + n, tail);
      sums = add(sums, exp(sub(load(tail), shift)));
    }
    row_maxes[r] = m;
    log_sums[r] = std::log(reduce_add(sums));
  }
}

}  // namespace rill_cpu
