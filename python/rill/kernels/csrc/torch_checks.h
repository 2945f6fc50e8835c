// Tensor checks for a torch binding of C++ kernels (today the CPU's, cpu/binding.cpp; the GPU kernels are Triton
// and check in Python): each raises a RuntimeError naming the argument. Layout-specific checks (the pools) stay
// in the binding.
#pragma once

#include <torch/extension.h>

namespace rill_binding {

// [tokens, heads, head_dim] with the last two dims contiguous; returns the token stride in elements.
inline int64_t rows_stride(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3, name, " must be [num_tokens, num_heads, head_dim]");
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), name, " must have contiguous heads and head dims");
  return t.stride(0);
}

inline void check_same_dtype(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " dtype ", t.scalar_type(), " differs from ",
              like.scalar_type());
}

// An output (or a residual) that must be contiguous, with `like`'s shape and dtype.
inline void check_like(const at::Tensor& t, const at::Tensor& like, const char* name, const char* like_name) {
  TORCH_CHECK(t.is_contiguous() && t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type(), name,
              " must be contiguous, with ", like_name, "'s shape and dtype");
}

// A 1-D integer vector of `numel` elements of `dtype` (int32 or int64) on t's device, contiguous.
inline void check_index_vector(const at::Tensor& t, int64_t numel, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.numel() == numel && t.scalar_type() == dtype && t.is_contiguous(), name,
              " must be a contiguous ", dtype, " [", numel, "]");
}

}  // namespace rill_binding
