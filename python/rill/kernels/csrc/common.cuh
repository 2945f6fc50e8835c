// Shared device helpers for Rill's kernels: dtype conversion, 16-byte vector loads, warp reductions.
// Every kernel is templated on the element type T (float, __half, __nv_bfloat16); arithmetic is float.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace rill {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// A 16-byte vector of N = 16 / sizeof(T) elements; the pointer it is loaded from must be 16-byte aligned.
template <typename T>
struct Vec16 {
  static constexpr int N = 16 / sizeof(T);
  union {
    uint4 raw;
    T elems[N];
  };
  __device__ __forceinline__ void load(const T* ptr) { raw = *reinterpret_cast<const uint4*>(ptr); }
  __device__ __forceinline__ void store(T* ptr) const { *reinterpret_cast<uint4*>(ptr) = raw; }
  __device__ __forceinline__ void zero() { raw = make_uint4(0, 0, 0, 0); }
  __device__ __forceinline__ void to_floats(float* out) const {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(elems[i]);
  }
};

// Sum over `width` consecutive lanes (width a power of two <= 32); every lane of the group gets the result.
template <int WIDTH>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int offset = WIDTH / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ __forceinline__ float warp_sum(float x) { return group_sum<32>(x); }

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

__host__ __device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace rill
