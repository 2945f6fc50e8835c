// y = x @ w^T on the CPU with a result per row that does not depend on how many rows are in x (batch
// invariance without padding), float32 or bfloat16 storage, float32 accumulation.
//
// Every output y[r, n] is computed the same way whatever the row count, the tile it falls in or the thread
// that runs it: 16 float32 partial sums, lane l accumulating k = l, l + 16, l + 32, ... in ascending order with
// fused multiply-adds (bfloat16: `vdpbf16ps` pairs k, k + 1 into lane l of each 32-element chunk), then one
// fixed reduction of the 16 lanes. Tiles only decide which outputs share loads (up to 4 rows x 4 weight rows,
// so each loaded vector feeds 4 FMAs); they never change an output's arithmetic. The K tail (K not a multiple
// of the chunk) is read with masked loads that fill zeros, so it adds exact zeros.
//
// Registered as torch.ops.rill_cpu.linear(x, w) -> y. x: [M, K], w: [N, K], both contiguous, same dtype.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kRowTile = 4;     // x rows sharing each weight load
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
inline void tile_bf16(const c10::BFloat16* const* xs, const c10::BFloat16* const* ws, int64_t k,
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
        lanes[idx % 16] = std::fmaf(static_cast<float>(xs[i][idx]), static_cast<float>(ws[j][idx]),
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
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
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
    for (int j = 0; j < W; ++j) y[(r0 + i) * n + n0 + j] = static_cast<Out>(out[i][j]);
}

template <typename T, typename Out, int W>
inline void run_rows(const T* x, const T* w, Out* y, int64_t m, int64_t k, int64_t n, int64_t n0) {
  int64_t r = 0;
  for (; r + kRowTile <= m; r += kRowTile) run_tile<T, Out, kRowTile, W>(x, w, y, k, n, r, n0);
  switch (m - r) {
    case 3: run_tile<T, Out, 3, W>(x, w, y, k, n, r, n0); break;
    case 2: run_tile<T, Out, 2, W>(x, w, y, k, n, r, n0); break;
    case 1: run_tile<T, Out, 1, W>(x, w, y, k, n, r, n0); break;
    default: break;
  }
}

// Work item g covers weight rows [g * kWeightTile, ...) for every x row, so each group of weight rows is read
// from memory once and stays in cache while all x rows pass over it.
template <typename T, typename Out>
void linear_impl(const T* x, const T* w, Out* y, int64_t m, int64_t k, int64_t n) {
  const int64_t num_groups = (n + kWeightTile - 1) / kWeightTile;
  // Enough groups per task that scheduling costs little, few enough that both cores get work.
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(64, num_groups / 16));
  at::parallel_for(0, num_groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kWeightTile;
      switch (std::min<int64_t>(kWeightTile, n - n0)) {
        case 4: run_rows<T, Out, 4>(x, w, y, m, k, n, n0); break;
        case 3: run_rows<T, Out, 3>(x, w, y, m, k, n, n0); break;
        case 2: run_rows<T, Out, 2>(x, w, y, m, k, n, n0); break;
        default: run_rows<T, Out, 1>(x, w, y, m, k, n, n0); break;
      }
    }
  });
}

// out_dtype: the result's dtype (x's dtype, or float32 for logits straight from bfloat16 weights).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, c10::ScalarType out_dtype) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "rill_cpu.linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "rill_cpu.linear: x [M, K] and w [N, K]");
  TORCH_CHECK(x.size(1) == w.size(1), "rill_cpu.linear: x has K=", x.size(1), ", w has K=", w.size(1));
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rill_cpu.linear: x and w dtypes differ");
  TORCH_CHECK(out_dtype == x.scalar_type() || out_dtype == at::kFloat,
              "rill_cpu.linear: out_dtype must be x's dtype or float32");
  const auto xc = x.contiguous();
  const auto wc = w.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = wc.size(0);
  auto y = torch::empty({m, n}, xc.options().dtype(out_dtype));
  if (m == 0 || n == 0) return y;
  if (xc.scalar_type() == at::kFloat) {
    linear_impl<float, float>(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), m, k, n);
  } else if (xc.scalar_type() == at::kBFloat16) {
    const auto* xp = xc.data_ptr<c10::BFloat16>();
    const auto* wp = wc.data_ptr<c10::BFloat16>();
    if (out_dtype == at::kFloat) {
      linear_impl<c10::BFloat16, float>(xp, wp, y.data_ptr<float>(), m, k, n);
    } else {
      linear_impl<c10::BFloat16, c10::BFloat16>(xp, wp, y.data_ptr<c10::BFloat16>(), m, k, n);
    }
  } else {
    TORCH_CHECK(false, "rill_cpu.linear: float32 or bfloat16 only, got ", xc.scalar_type());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rill_cpu, m) {
  m.def("linear(Tensor x, Tensor w, ScalarType out_dtype) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
}
