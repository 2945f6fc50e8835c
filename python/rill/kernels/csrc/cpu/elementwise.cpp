// The CPU kernels besides attention: KV cache write, fused residual add + RMSNorm, rotary, SiLU-and-mul. Each
// rounds to the storage type exactly where its torch reference does; all are per-row, hence batch-invariant.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "ops.h"

namespace rill_cpu {

template <typename T>
void store_kv(const T* k, int64_t k_token_stride, const T* v, int64_t v_token_stride, T* k_pool, T* v_pool,
              const int64_t* slots, int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
              bool paired_k, int num_threads) {
  const int64_t row_elems = num_kv_heads * head_dim;
#pragma omp parallel for num_threads(threads_for(num_tokens * row_elems, num_threads))
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(v_pool + slots[t] * row_elems, v + t * v_token_stride, row_elems * sizeof(T));
    if (!paired_k) {
      std::memcpy(k_pool + slots[t] * row_elems, k + t * k_token_stride, row_elems * sizeof(T));
      continue;
    }
    // Pair p of KV head h goes to row (block, h, p) of the block's pairs, at the slot's column.
    const int64_t block = slots[t] / block_size, slot = slots[t] % block_size;
    T* pairs = k_pool + block * block_size * row_elems + 2 * slot;
    for (int64_t pair = 0; pair < row_elems / 2; ++pair) {
      std::memcpy(pairs + pair * 2 * block_size, k + t * k_token_stride + 2 * pair, 2 * sizeof(T));
    }
  }
}

namespace {

// One row of head_dim elements into int8: the float32 operations of quantize_int8, element by element (each is
// correctly rounded, so the bits are torch's).
template <typename T>
void quantize_row(const T* x, int64_t head_dim, int8_t* q, float* scale) {
  float amax = 0.0f;
  for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(to_float(x[d])));
  const float s = amax / 127.0f;
  *scale = s;
  for (int64_t d = 0; d < head_dim; ++d) {
    // nearbyint rounds half to even in the default rounding mode, as torch.round does.
    const float r = s > 0.0f ? std::nearbyint(to_float(x[d]) / s) : 0.0f;
    q[d] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
  }
}

}  // namespace

template <typename T>
void store_kv_int8(const T* k, int64_t k_token_stride, const T* v, int64_t v_token_stride, int8_t* k_pool,
                   int8_t* v_pool, float* k_scales, float* v_scales, const int64_t* slots, int64_t num_tokens,
                   int64_t num_kv_heads, int64_t head_dim, int num_threads) {
  const int64_t row_elems = num_kv_heads * head_dim;
#pragma omp parallel for num_threads(threads_for(num_tokens * row_elems, num_threads))
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0) continue;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t row = slots[t] * num_kv_heads + h;
      quantize_row(k + t * k_token_stride + h * head_dim, head_dim, k_pool + row * head_dim, k_scales + row);
      quantize_row(v + t * v_token_stride + h * head_dim, head_dim, v_pool + row * head_dim, v_scales + row);
    }
  }
}

template <typename T>
void fused_add_rms_norm(T* out, T* residual_out, const T* x, const T* residual, const T* weight,
                        int64_t num_rows, int64_t hidden, float eps, int num_threads) {
#pragma omp parallel for num_threads(threads_for(num_rows * hidden, num_threads))
  for (int64_t row = 0; row < num_rows; ++row) {
    const T* src = x + row * hidden;
    if (residual != nullptr) {
      T* sum = residual_out + row * hidden;
      const T* res = residual + row * hidden;
      for (int64_t d = 0; d < hidden; ++d) sum[d] = from_float<T>(to_float(src[d]) + to_float(res[d]));
      src = sum;
    }
    Vec16 squares = zeros();
    int64_t d = 0;
    for (; d + kLanes <= hidden; d += kLanes) {
      const Vec16 v = load(src + d);
      squares = add(squares, mul(v, v));  // squares rounded before the sum, as x.pow(2).mean() does
    }
    float sum_squares = reduce_add(squares);
    for (; d < hidden; ++d) sum_squares += to_float(src[d]) * to_float(src[d]);
    const float inv_rms = 1.0f / std::sqrt(sum_squares / static_cast<float>(hidden) + eps);
    T* dst = out + row * hidden;
    for (d = 0; d < hidden; ++d) {
      const float normed = to_float(from_float<T>(to_float(src[d]) * inv_rms));
      dst[d] = from_float<T>(to_float(weight[d]) * normed);
    }
  }
}

namespace {

template <typename T>
inline T round_mul(float a, float b) {
  return from_float<T>(a * b);
}

// One row [num_heads, head_dim] rotated in place: x1' = x1 c - x2 s, x2' = x2 c + x1 s (rotate-half), each
// product and the sum rounded to T, as `x * cos + rotate_half(x) * sin` in torch.
template <typename T>
void rotate_row(T* row, int64_t num_heads, const T* cos, const T* sin, int64_t half) {
  for (int64_t h = 0; h < num_heads; ++h) {
    T* x = row + h * 2 * half;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
      const float c = to_float(cos[i]), s = to_float(sin[i]);
      x[i] = from_float<T>(to_float(round_mul<T>(x1, c)) + to_float(round_mul<T>(-x2, s)));
      x[i + half] = from_float<T>(to_float(round_mul<T>(x2, c)) + to_float(round_mul<T>(x1, s)));
    }
  }
}

}  // namespace

template <typename T>
void rotary_embedding(T* q, int64_t q_token_stride, int64_t num_q_heads, T* k, int64_t k_token_stride,
                      int64_t num_k_heads, const T* cos, const T* sin, int64_t num_tokens, int64_t head_dim,
                      int num_threads) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(threads_for(num_tokens * (num_q_heads + num_k_heads) * head_dim, num_threads))
  for (int64_t t = 0; t < num_tokens; ++t) {
    rotate_row(q + t * q_token_stride, num_q_heads, cos + t * half, sin + t * half, half);
    rotate_row(k + t * k_token_stride, num_k_heads, cos + t * half, sin + t * half, half);
  }
}

namespace {

// 16 outputs: silu(g) = g / (1 + exp(-g)), rounded to T, times up (the product rounded to T by the caller's store).
template <typename T>
inline Vec16 silu_mul(Vec16 g, Vec16 up) {
  Vec16 silu = div(g, add(broadcast(1.0f), exp(sub(zeros(), g))));
  if constexpr (std::is_same_v<T, bf16>) silu = round_bf16(silu);
  return mul(silu, up);
}

}  // namespace

template <typename T>
void silu_and_mul(T* out, const T* x, int64_t num_tokens, int64_t intermediate, int num_threads) {
#pragma omp parallel for num_threads(threads_for(num_tokens * intermediate, num_threads))
  for (int64_t t = 0; t < num_tokens; ++t) {
    const T* gate = x + t * 2 * intermediate;
    const T* up = gate + intermediate;
    T* dst = out + t * intermediate;
    int64_t i0 = 0;
    for (; i0 + kLanes <= intermediate; i0 += kLanes) store(dst + i0, silu_mul<T>(load(gate + i0), load(up + i0)));
    if (i0 < intermediate) {  // the ragged tail through zero-padded buffers: the same arithmetic
      const int64_t n = intermediate - i0;
      T g[kLanes] = {}, u[kLanes] = {}, result[kLanes];
      std::copy_n(gate + i0, n, g);
      std::copy_n(up + i0, n, u);
      store(result, silu_mul<T>(load(g), load(u)));
      std::copy_n(result, n, dst + i0);
    }
  }
}

#define RILL_INSTANTIATE(T)                                                                                    \
  template void store_kv<T>(const T*, int64_t, const T*, int64_t, T*, T*, const int64_t*, int64_t, int64_t,   \
                            int64_t, int64_t, bool, int);                                                     \
  template void store_kv_int8<T>(const T*, int64_t, const T*, int64_t, int8_t*, int8_t*, float*, float*,      \
                                 const int64_t*, int64_t, int64_t, int64_t, int);                             \
  template void fused_add_rms_norm<T>(T*, T*, const T*, const T*, const T*, int64_t, int64_t, float, int);     \
  template void rotary_embedding<T>(T*, int64_t, int64_t, T*, int64_t, int64_t, const T*, const T*, int64_t,  \
                                    int64_t, int);                                                            \
  template void silu_and_mul<T>(T*, const T*, int64_t, int64_t, int);
RILL_INSTANTIATE(float)
RILL_INSTANTIATE(bf16)
#undef RILL_INSTANTIATE

}  // namespace rill_cpu
