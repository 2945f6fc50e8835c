// KV cache write: scatters the new tokens' K and V rows into their slots of the paged pool (ops.h).
#include <algorithm>

#include "common.cuh"
#include "ops.h"

namespace rill {
namespace {

// One CTA per token; VEC elements per thread access (16-byte vectors when every address is aligned).
template <typename T, int VEC>
__global__ void store_kv_kernel(const T* __restrict__ k, const int64_t k_token_stride, const T* __restrict__ v,
                                const int64_t v_token_stride, T* __restrict__ k_pool, T* __restrict__ v_pool,
                                const int64_t* __restrict__ slot_mapping, const int row_elems) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;
  const T* k_row = k + token * k_token_stride;
  const T* v_row = v + token * v_token_stride;
  T* k_dst = k_pool + slot * row_elems;
  T* v_dst = v_pool + slot * row_elems;
  for (int i = threadIdx.x * VEC; i < row_elems; i += blockDim.x * VEC) {
    if constexpr (VEC == 1) {
      k_dst[i] = k_row[i];
      v_dst[i] = v_row[i];
    } else {
      *reinterpret_cast<uint4*>(k_dst + i) = *reinterpret_cast<const uint4*>(k_row + i);
      *reinterpret_cast<uint4*>(v_dst + i) = *reinterpret_cast<const uint4*>(v_row + i);
    }
  }
}

bool is_aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <typename T>
cudaError_t launch(const void* k, int64_t k_token_stride, const void* v, int64_t v_token_stride, void* k_pool,
                   void* v_pool, const int64_t* slot_mapping, int num_tokens, int row_elems, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  const bool is_vectorizable = row_elems % VEC == 0 && k_token_stride % VEC == 0 && v_token_stride % VEC == 0 &&
                               is_aligned16(k) && is_aligned16(v) && is_aligned16(k_pool) && is_aligned16(v_pool);
  const int threads = std::min(256, std::max(32, row_elems / (is_vectorizable ? VEC : 1)));
  if (is_vectorizable) {
    store_kv_kernel<T, VEC><<<num_tokens, threads, 0, stream>>>(
        static_cast<const T*>(k), k_token_stride, static_cast<const T*>(v), v_token_stride, static_cast<T*>(k_pool),
        static_cast<T*>(v_pool), slot_mapping, row_elems);
  } else {
    store_kv_kernel<T, 1><<<num_tokens, threads, 0, stream>>>(
        static_cast<const T*>(k), k_token_stride, static_cast<const T*>(v), v_token_stride, static_cast<T*>(k_pool),
        static_cast<T*>(v_pool), slot_mapping, row_elems);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t store_kv(DType dtype, const void* k, int64_t k_token_stride, const void* v, int64_t v_token_stride,
                     void* k_pool, void* v_pool, const int64_t* slot_mapping, int num_tokens, int num_kv_heads,
                     int head_dim, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const int row_elems = num_kv_heads * head_dim;
  switch (dtype) {
    case DType::kFloat32:
      return launch<float>(k, k_token_stride, v, v_token_stride, k_pool, v_pool, slot_mapping, num_tokens,
                           row_elems, stream);
    case DType::kFloat16:
      return launch<__half>(k, k_token_stride, v, v_token_stride, k_pool, v_pool, slot_mapping, num_tokens,
                            row_elems, stream);
    case DType::kBFloat16:
      return launch<__nv_bfloat16>(k, k_token_stride, v, v_token_stride, k_pool, v_pool, slot_mapping,
                                   num_tokens, row_elems, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace rill
