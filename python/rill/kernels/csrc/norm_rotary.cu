// Fused residual add + RMSNorm, and in-place rotary embedding (ops.h). Semantics: rill/shard/layers/norm.py and
// rill/shard/layers/rotary.py; arithmetic in float32, rounding to the storage dtype where the reference rounds.
#include <algorithm>

#include "common.cuh"
#include "ops.h"

namespace rill {
namespace {

constexpr int kNormThreads = 256;

// One CTA per row. Pass 1 forms r = round(x + residual) and sums r^2; pass 2 normalizes (the row is re-read,
// from L1/L2). The reference computes round(r * rsqrt(mean(r^2) + eps)) and multiplies by weight in dtype.
template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    add_rms_norm_kernel(T* __restrict__ out, T* __restrict__ residual_out, const T* __restrict__ x,
                        const T* __restrict__ residual, const T* __restrict__ weight, const int hidden,
                        const float eps) {
  __shared__ float warp_sums[kNormThreads / 32];
  __shared__ float inv_rms;
  const int64_t offset = (int64_t)blockIdx.x * hidden;
  const T* x_row = x + offset;
  const T* src = x_row;
  float sum_sq = 0.f;
  if (residual != nullptr) {
    const T* res_row = residual + offset;
    T* res_out_row = residual_out + offset;
    for (int i = threadIdx.x; i < hidden; i += kNormThreads) {
      const T r = from_float<T>(to_float(x_row[i]) + to_float(res_row[i]));
      res_out_row[i] = r;
      const float rf = to_float(r);
      sum_sq += rf * rf;
    }
    src = res_out_row;
  } else {
    for (int i = threadIdx.x; i < hidden; i += kNormThreads) {
      const float xf = to_float(x_row[i]);
      sum_sq += xf * xf;
    }
  }
  sum_sq = warp_sum(sum_sq);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum_sq;
  __syncthreads();  // also orders this thread block's residual_out writes before the re-reads below
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int w = 0; w < kNormThreads / 32; ++w) total += warp_sums[w];
    inv_rms = rsqrtf(total / hidden + eps);
  }
  __syncthreads();
  T* out_row = out + offset;
  for (int i = threadIdx.x; i < hidden; i += kNormThreads) {
    const T normed = from_float<T>(to_float(src[i]) * inv_rms);
    out_row[i] = from_float<T>(to_float(weight[i]) * to_float(normed));
  }
}

// One CTA per token; a thread rotates the pair (i, i + head_dim / 2) of one head of q or k.
template <typename T>
__global__ void rotary_kernel(T* __restrict__ q, const int64_t q_token_stride, T* __restrict__ k,
                              const int64_t k_token_stride, const T* __restrict__ cos, const T* __restrict__ sin,
                              const int num_heads, const int num_kv_heads, const int head_dim) {
  const int64_t token = blockIdx.x;
  const int half = head_dim / 2;
  const int num_pairs = (num_heads + num_kv_heads) * half;
  const T* cos_row = cos + token * half;
  const T* sin_row = sin + token * half;
  for (int idx = threadIdx.x; idx < num_pairs; idx += blockDim.x) {
    const int head = idx / half;
    const int i = idx % half;
    T* row = head < num_heads ? q + token * q_token_stride + (int64_t)head * head_dim
                              : k + token * k_token_stride + (int64_t)(head - num_heads) * head_dim;
    // The reference (rotary.py, _rotate) computes x * cos + rotate_half(x) * sin in the storage dtype: each
    // product rounds, then their sum.
    const T x1 = row[i], x2 = row[i + half], c = cos_row[i], s = sin_row[i];
    const float x1c = to_float(from_float<T>(to_float(x1) * to_float(c)));
    const float x2s = to_float(from_float<T>(to_float(x2) * to_float(s)));
    const float x2c = to_float(from_float<T>(to_float(x2) * to_float(c)));
    const float x1s = to_float(from_float<T>(to_float(x1) * to_float(s)));
    row[i] = from_float<T>(x1c - x2s);
    row[i + half] = from_float<T>(x2c + x1s);
  }
}

template <typename T>
cudaError_t launch_norm(void* out, void* residual_out, const void* x, const void* residual, const void* weight,
                        int num_rows, int hidden, float eps, cudaStream_t stream) {
  add_rms_norm_kernel<T><<<num_rows, kNormThreads, 0, stream>>>(
      static_cast<T*>(out), static_cast<T*>(residual_out), static_cast<const T*>(x),
      static_cast<const T*>(residual), static_cast<const T*>(weight), hidden, eps);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_rotary(void* q, int64_t q_token_stride, void* k, int64_t k_token_stride, const void* cos,
                          const void* sin, int num_tokens, int num_heads, int num_kv_heads, int head_dim,
                          cudaStream_t stream) {
  const int num_pairs = (num_heads + num_kv_heads) * (head_dim / 2);
  const int threads = std::min(512, ceil_div(num_pairs, 32) * 32);
  rotary_kernel<T><<<num_tokens, threads, 0, stream>>>(static_cast<T*>(q), q_token_stride, static_cast<T*>(k),
                                                       k_token_stride, static_cast<const T*>(cos),
                                                       static_cast<const T*>(sin), num_heads, num_kv_heads,
                                                       head_dim);
  return cudaGetLastError();
}

}  // namespace

cudaError_t fused_add_rms_norm(DType dtype, void* out, void* residual_out, const void* x, const void* residual,
                               const void* weight, int num_rows, int hidden, float eps, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return launch_norm<float>(out, residual_out, x, residual, weight, num_rows, hidden, eps, stream);
    case DType::kFloat16:
      return launch_norm<__half>(out, residual_out, x, residual, weight, num_rows, hidden, eps, stream);
    case DType::kBFloat16:
      return launch_norm<__nv_bfloat16>(out, residual_out, x, residual, weight, num_rows, hidden, eps, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t rotary_embedding(DType dtype, void* q, int64_t q_token_stride, void* k, int64_t k_token_stride,
                             const void* cos, const void* sin, int num_tokens, int num_heads, int num_kv_heads,
                             int head_dim, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  if (head_dim % 2 != 0) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32:
      return launch_rotary<float>(q, q_token_stride, k, k_token_stride, cos, sin, num_tokens, num_heads,
                                  num_kv_heads, head_dim, stream);
    case DType::kFloat16:
      return launch_rotary<__half>(q, q_token_stride, k, k_token_stride, cos, sin, num_tokens, num_heads,
                                   num_kv_heads, head_dim, stream);
    case DType::kBFloat16:
      return launch_rotary<__nv_bfloat16>(q, q_token_stride, k, k_token_stride, cos, sin, num_tokens, num_heads,
                                          num_kv_heads, head_dim, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace rill
