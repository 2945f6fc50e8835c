// y = x @ w^T on the CPU in float32 or bfloat16, with a result per row that does not depend on how many rows are in
// x (batch invariance without padding).
//
// Every output y[r, n] is one chain over k = 0, 1, ..., K - 1 in ascending order, starting from zero, whatever the
// row count, the tile it falls in or the thread that runs it. Tiles only decide which outputs share loads; they
// never change an output's arithmetic. float32: one fused multiply-add per k (the portable build runs the same
// chain with std::fmaf, bitwise equal to the AVX-512 one). bfloat16: one AVX512-BF16 `vdpbf16ps` per pair of k
// (both products added into a float32 accumulator), rounded to bfloat16 once at the end; it needs the CPU's
// AVX512-BF16 (the binding refuses otherwise and the shard keeps torch's matmul).
//
// The weight is packed once (pack_linear) into panels of kPanel = 32 output features. A step of a panel is 128
// bytes: one k for float32 ([K][32]), a pair of k for bfloat16 ([K/2][32][2], the pairs vdpbf16ps multiplies). At
// each step a tile of up to kMaxRows rows of x broadcasts its x[r, k] (or pair) and multiplies it into the panel's
// 32 outputs (two AVX-512 vectors), an outer product that needs no horizontal sums. A decode batch is one row
// block: every thread takes runs of panels and reads each weight from memory once, its rows passing over the
// panel while it stays in L2. Prefill rows are split into equal blocks of at most kRowBlock rows, each against
// every panel. Threads take work as they finish (guided or dynamic scheduling): on cores shared with the router, a
// thread that is descheduled for a while leaves the work not yet taken to the others.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace rill_cpu {
namespace {

constexpr int kMaxRows = 12;         // rows of x per tile: 12 x 2 accumulator vectors, 27 of the 32 registers
constexpr int64_t kRowBlock = 96;    // rows of x a prefill task keeps in L2 while it passes over its panels
constexpr int64_t kPanelBlock = 8;   // panels per prefill task

// y[r0 + i, n0 + j] for i < R, j < width (width <= kPanel) from the panel at `panel` ([k][kPanel]). With `next`,
// one step of the next panel is fetched into cache every `every` steps, so reading weights from memory overlaps
// the arithmetic (the tiles of a panel share the fetching of the next one evenly).
template <int R>
inline void tile(const float* x, int64_t k, const float* panel, const float* next, int64_t every, float* y,
                 int64_t ldy, int64_t width) {
#if defined(__AVX512F__)
  __m512 acc[R][2];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  int64_t countdown = every;
  for (int64_t step = 0; step < k; ++step) {
    const __m512 w0 = _mm512_loadu_ps(panel + step * kPanel);
    const __m512 w1 = _mm512_loadu_ps(panel + step * kPanel + 16);
    if (next != nullptr && --countdown == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + 16), _MM_HINT_T1);
      next += kPanel;
      countdown = every;
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * k + step]);
      acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
  const __mmask16 low = width >= 16 ? __mmask16(0xffff) : __mmask16((1u << width) - 1u);
  const __mmask16 high = width >= 32 ? __mmask16(0xffff) : width <= 16 ? 0 : __mmask16((1u << (width - 16)) - 1u);
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    _mm512_mask_storeu_ps(y + i * ldy, low, acc[i][0]);
    _mm512_mask_storeu_ps(y + i * ldy + 16, high, acc[i][1]);
  }
#else
  // The same chain of fused multiply-adds per output, step by step; the panel's row is the inner loop, so the
  // compiler vectorizes it (AVX2: four 8-lane FMAs per row of x) instead of walking a column at a stride.
  (void)next;
  (void)every;
  float acc[R][kPanel];
  for (int i = 0; i < R; ++i) std::fill(acc[i], acc[i] + kPanel, 0.0f);
  for (int64_t step = 0; step < k; ++step) {
    const float* w = panel + step * kPanel;
    for (int i = 0; i < R; ++i) {
      const float xv = x[i * k + step];
      for (int j = 0; j < kPanel; ++j) acc[i][j] = std::fmaf(xv, w[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i) std::copy(acc[i], acc[i] + width, y + i * ldy);
#endif
}

#if defined(__AVX512BF16__)
// The bfloat16 tile: as the float32 one, a step being a pair of k (the last pair of an odd K has a zero second
// half, in x as in the packed weight).
template <int R>
inline void tile(const bf16* x, int64_t k, const bf16* panel, const bf16* next, int64_t every, bf16* y,
                 int64_t ldy, int64_t width) {
  __m512 acc[R][2];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  int64_t countdown = every;
  int64_t step = 0;
  for (; step < k / 2; ++step) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + step * 2 * kPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + step * 2 * kPanel + kPanel);
    if (next != nullptr && --countdown == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + kPanel), _MM_HINT_T1);
      next += 2 * kPanel;
      countdown = every;
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      uint32_t pair;
      std::memcpy(&pair, x + i * k + 2 * step, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, w1);
    }
  }
  if (k % 2 != 0) {  // the last k alone: (x, 0) times (w, 0)
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + step * 2 * kPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + step * 2 * kPanel + kPanel);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * k + k - 1]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, w1);
    }
  }
  const __mmask16 low = width >= 16 ? __mmask16(0xffff) : __mmask16((1u << width) - 1u);
  const __mmask16 high = width >= 32 ? __mmask16(0xffff) : width <= 16 ? 0 : __mmask16((1u << (width - 16)) - 1u);
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    _mm256_mask_storeu_epi16(y + i * ldy, low, (__m256i)_mm512_cvtneps_pbh(acc[i][0]));
    _mm256_mask_storeu_epi16(y + i * ldy + 16, high, (__m256i)_mm512_cvtneps_pbh(acc[i][1]));
  }
}
#endif

// Elements of one step of a panel (128 bytes), and of a whole packed panel for K inputs.
template <typename T>
constexpr int64_t kStepElems = kPanel * (sizeof(float) / sizeof(T));
template <typename T>
constexpr int64_t panel_elems(int64_t k) {
  constexpr int64_t k_per_step = sizeof(float) / sizeof(T);
  return (k + k_per_step - 1) / k_per_step * kStepElems<T>;
}

template <int R, typename T>
inline void tile_rows(int rows, const T* x, int64_t k, const T* panel, const T* next, int64_t every, T* y,
                      int64_t ldy, int64_t width) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<R - 1>(rows, x, k, panel, next, every, y, ldy, width);
  }
  tile<R>(x, k, panel, next, every, y, ldy, width);
}

// Rows [r_begin, r_end) of x against panel p, in tiles of equal size (at most kMaxRows rows each). Several tiles
// together fetch panel p + 1 (when there is one) for the next call, tile t its t-th share of the steps.
template <typename T>
inline void rows_by_panel(const T* x, const T* packed, T* y, int64_t r_begin, int64_t r_end, int64_t k, int64_t n,
                          int64_t p) {
  const int64_t num_rows = r_end - r_begin;
  const int64_t num_tiles = (num_rows + kMaxRows - 1) / kMaxRows;
  const int64_t n0 = p * kPanel;
  const int64_t width = std::min<int64_t>(kPanel, n - n0);
  const int64_t step_elems = kStepElems<T>, steps = panel_elems<T>(k) / step_elems;
  const T* panel = packed + p * panel_elems<T>(k);
  // A single tile is bound by the memory it streams, and a thread's panels are one sequential stream (decode
  // threads take runs of consecutive panels) that the hardware prefetcher follows on its own: software
  // prefetches two panels ahead only competed with it for the core's miss buffers (decode steps at context 512,
  // alternating in one process: float32 batch 1 / 4 / 8 16.7 / 22.6 / 25.8 -> 13.8 / 20.4 / 24.0 ms, bfloat16
  // batch 1 9.05 -> 8.3 ms). Several tiles spend longer on a panel: fetching the next one still pays there
  // (float32 batch 16, context 128: 28.5 -> 27.1 ms).
  const T* next = num_tiles > 1 && n0 + kPanel < n ? panel + panel_elems<T>(k) : nullptr;
  const int64_t base = num_rows / num_tiles, extra = num_rows % num_tiles;  // the first `extra` tiles take one more
  int64_t r = r_begin;
  for (int64_t t = 0; t < num_tiles; ++t) {
    const int rows = static_cast<int>(base + (t < extra ? 1 : 0));
    const T* next_share = next == nullptr ? nullptr : next + (t * steps / num_tiles) * step_elems;
    tile_rows<kMaxRows>(rows, x + r * k, k, panel, next_share, num_tiles, y + r * n + n0, n, width);
    r += rows;
  }
}

}  // namespace

template <typename T>
void pack_linear(const T* w, T* packed, int64_t n, int64_t k) {
  constexpr int64_t k_per_step = sizeof(float) / sizeof(T);
  const int64_t num_panels = (n + kPanel - 1) / kPanel;
  const int64_t steps = panel_elems<T>(k) / kStepElems<T>;
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      T* panel = packed + p * panel_elems<T>(k);
      for (int64_t j = 0; j < kPanel; ++j) {
        const int64_t row = p * kPanel + j;
        for (int64_t step = 0; step < steps; ++step) {
          for (int64_t half = 0; half < k_per_step; ++half) {
            const int64_t col = step * k_per_step + half;
            panel[(step * kPanel + j) * k_per_step + half] = row < n && col < k ? w[row * k + col] : T(0);
          }
        }
      }
    }
  });
}

template <typename T>
void linear(const T* x, const T* packed, T* y, int64_t m, int64_t k, int64_t n, int num_threads) {
  const int64_t num_panels = (n + kPanel - 1) / kPanel;
  if (m <= kRowBlock) {
    // Decode (and small chunks): each weight is read once, the threads taking runs of panels as they come, each
    // run a share of the panels left (guided scheduling): long runs first, so the weights stream in order, and
    // runs of one panel at the end, so the threads finish together. Runs of fixed size left one thread waiting
    // for the other's last run: a float32 decode step at batch 16, context 512, 37.7 -> 36.6 ms (batch 32 77.0
    // -> 71.8 ms together with attention.cpp's spread prefetch).
#pragma omp parallel for schedule(guided, 1) \
    num_threads(std::max<int64_t>(1, std::min<int64_t>(num_threads, num_panels)))
    for (int64_t p = 0; p < num_panels; ++p) rows_by_panel(x, packed, y, 0, m, k, n, p);
    return;
  }
  // Prefill: tasks of a block of rows (blocks of equal size, at most kRowBlock) against a block of panels.
  const int64_t num_row_blocks = (m + kRowBlock - 1) / kRowBlock;
  const int64_t rows_per_block = (m + num_row_blocks - 1) / num_row_blocks;
  const int64_t num_panel_blocks = (num_panels + kPanelBlock - 1) / kPanelBlock;
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::max(1, num_threads))
  for (int64_t task = 0; task < num_row_blocks * num_panel_blocks; ++task) {
    const int64_t r_begin = task / num_panel_blocks * rows_per_block;
    const int64_t r_end = std::min(m, r_begin + rows_per_block);
    const int64_t p_begin = task % num_panel_blocks * kPanelBlock;
    const int64_t p_end = std::min(num_panels, p_begin + kPanelBlock);
    for (int64_t p = p_begin; p < p_end; ++p) rows_by_panel(x, packed, y, r_begin, r_end, k, n, p);
  }
}

template void pack_linear<float>(const float*, float*, int64_t, int64_t);
template void linear<float>(const float*, const float*, float*, int64_t, int64_t, int64_t, int);
#if defined(__AVX512BF16__)
template void pack_linear<bf16>(const bf16*, bf16*, int64_t, int64_t);
template void linear<bf16>(const bf16*, const bf16*, bf16*, int64_t, int64_t, int64_t, int);
#endif

}  // namespace rill_cpu
