// y = x @ w^T on the CPU with a result per row that does not depend on how many rows are in x (batch
// invariance without padding), float32 or bfloat16 storage, float32 accumulation.
//
// Every output y[r, n] is computed the same way whatever the row count, the tile it falls in or the thread
// that runs it: 16 float32 partial sums, lane l accumulating k = l, l + 16, l + 32, ... in ascending order with
// fused multiply-adds (bfloat16: `vdpbf16ps` pairs k, k + 1 into lane l of each 32-element chunk), then one
// fixed reduction of the 16 lanes. Tiles only decide which outputs share loads (up to 6 rows x 4 weight rows,
// so each loaded vector feeds 4 to 6 FMAs); they never change an output's arithmetic. The K tail (K not a multiple
// of the chunk) is read with masked loads that fill zeros, so it adds exact zeros.
//
// x: [M, K] and w: [N, K], row-major; y: [M, N]. The torch binding (binding.cpp) checks the tensors.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace rill_cpu {
namespace {

constexpr int kRowTile = 6;     // x rows sharing each weight load
constexpr int kWeightTile = 4;  // weight rows sharing each x load

#if defined(__AVX512F__)

inline __mmask16 tail_mask16(int64_t remaining) {
  return remaining >= 16 ? __mmask16(0xffff) : __mmask16((1u << remaining) - 1u);
}

inline __mmask32 tail_mask32(int64_t remaining) {
  return remaining >= 32 ? __mmask32(0xffffffffu) : __mmask32((uint64_t(1) << remaining) - 1u);
}

// acc[i][j] over the whole K for x rows xs[0..R) and weight rows ws[0..W); out[i][j] = reduced sums.
template <int R, int W>
inline void tile_f32(const float* const* xs, const float* const* ws, int64_t k, float out[R][W]) {
  __m512 acc[R][W];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < W; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t base = 0; base < k; base += 16) {
    const __mmask16 mask = tail_mask16(k - base);
    __m512 wv[W];
    for (int j = 0; j < W; ++j) wv[j] = _mm512_maskz_loadu_ps(mask, ws[j] + base);
    for (int i = 0; i < R; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, xs[i] + base);
      for (int j = 0; j < W; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < W; ++j) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

#if defined(__AVX512BF16__)
template <int R, int W>
inline void tile_bf16(const bf16* const* xs, const bf16* const* ws, int64_t k,
                      float out[R][W]) {
  __m512 acc[R][W];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < W; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t base = 0; base < k; base += 32) {
    const __mmask32 mask = tail_mask32(k - base);
    __m512bh wv[W];
    for (int j = 0; j < W; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, ws[j] + base);
    for (int i = 0; i < R; ++i) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xs[i] + base);
      for (int j = 0; j < W; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < W; ++j) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}
#endif

#endif  // __AVX512F__

// The portable form of the same arithmetic: 16 lanes, lane l summing k = l (mod 16) in order with fmaf, then
// a fixed halving reduction. (Not bitwise equal to the AVX-512 build; each build is invariant on its own.)
template <typename T, int R, int W>
inline void tile_portable(const T* const* xs, const T* const* ws, int64_t k, float out[R][W]) {
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < W; ++j) {
      float lanes[16] = {};
      for (int64_t idx = 0; idx < k; ++idx) {
        lanes[idx % 16] = std::fmaf(to_float(xs[i][idx]), to_float(ws[j][idx]),
                                    lanes[idx % 16]);
      }
      for (int width = 8; width >= 1; width /= 2)
        for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
      out[i][j] = lanes[0];
    }
  }
}

template <typename T, int R, int W>
inline void tile(const T* const* xs, const T* const* ws, int64_t k, float out[R][W]) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    tile_f32<R, W>(xs, ws, k, out);
    return;
  }
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    tile_bf16<R, W>(xs, ws, k, out);
    return;
  }
#endif
#endif
  tile_portable<T, R, W>(xs, ws, k, out);
}

// Rows [r0, r0 + R) x weight rows [n0, n0 + W) of y.
template <typename T, typename Out, int R, int W>
inline void run_tile(const T* x, const T* w, Out* y, int64_t k, int64_t n, int64_t r0, int64_t n0) {
  const T* xs[R];
  const T* ws[W];
  for (int i = 0; i < R; ++i) xs[i] = x + (r0 + i) * k;
  for (int j = 0; j < W; ++j) ws[j] = w + (n0 + j) * k;
  float out[R][W];
  tile<T, R, W>(xs, ws, k, out);
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < W; ++j) y[(r0 + i) * n + n0 + j] = from_float<Out>(out[i][j]);
}

// Rows [r_begin, r_end) against weight rows [n0, n0 + W).
template <typename T, typename Out, int W>
inline void run_rows(const T* x, const T* w, Out* y, int64_t r_begin, int64_t r_end, int64_t k, int64_t n,
                     int64_t n0) {
  int64_t r = r_begin;
  for (; r + kRowTile <= r_end; r += kRowTile) run_tile<T, Out, kRowTile, W>(x, w, y, k, n, r, n0);
  switch (r_end - r) {
    case 5: run_tile<T, Out, 5, W>(x, w, y, k, n, r, n0); break;
    case 4: run_tile<T, Out, 4, W>(x, w, y, k, n, r, n0); break;
    case 3: run_tile<T, Out, 3, W>(x, w, y, k, n, r, n0); break;
    case 2: run_tile<T, Out, 2, W>(x, w, y, k, n, r, n0); break;
    case 1: run_tile<T, Out, 1, W>(x, w, y, k, n, r, n0); break;
    default: break;
  }
}

// A task is a chunk of kRowChunk x rows against a block of kGroupBlock groups of kWeightTile weight rows: both
// stay in cache while the block's groups pass over the chunk's rows (each group's rows stay in L1 meanwhile).
// A decode batch is one row chunk, so its tasks split the weights and every weight is read from memory once.
constexpr int64_t kRowChunk = 64;
constexpr int64_t kGroupBlock = 16;

}  // namespace

template <typename T, typename Out>
void linear(const T* x, const T* w, Out* y, int64_t m, int64_t k, int64_t n) {
  const int64_t num_groups = (n + kWeightTile - 1) / kWeightTile;
  const int64_t num_group_blocks = (num_groups + kGroupBlock - 1) / kGroupBlock;
  const int64_t num_row_chunks = (m + kRowChunk - 1) / kRowChunk;
  at::parallel_for(0, num_row_chunks * num_group_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r_begin = task / num_group_blocks * kRowChunk;
      const int64_t r_end = std::min(m, r_begin + kRowChunk);
      const int64_t g_begin = task % num_group_blocks * kGroupBlock;
      const int64_t g_end = std::min(num_groups, g_begin + kGroupBlock);
      for (int64_t g = g_begin; g < g_end; ++g) {
        const int64_t n0 = g * kWeightTile;
        switch (std::min<int64_t>(kWeightTile, n - n0)) {
          case 4: run_rows<T, Out, 4>(x, w, y, r_begin, r_end, k, n, n0); break;
          case 3: run_rows<T, Out, 3>(x, w, y, r_begin, r_end, k, n, n0); break;
          case 2: run_rows<T, Out, 2>(x, w, y, r_begin, r_end, k, n, n0); break;
          default: run_rows<T, Out, 1>(x, w, y, r_begin, r_end, k, n, n0); break;
        }
      }
    }
  });
}

template void linear<float, float>(const float*, const float*, float*, int64_t, int64_t, int64_t);
template void linear<bf16, bf16>(const bf16*, const bf16*, bf16*, int64_t, int64_t, int64_t);
template void linear<bf16, float>(const bf16*, const bf16*, float*, int64_t, int64_t, int64_t);

}  // namespace rill_cpu
