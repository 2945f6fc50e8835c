// Thin torch binding of the launchers in ops.h: checks dtypes, devices, shapes and layouts, then launches on
// the current CUDA stream. Output tensors are allocated by the caller (rill/kernels/cuda.py), so the calls are
// CUDA-graph safe.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "ops.h"
#include "torch_checks.h"

namespace {

using rill_binding::check_index_vector;
using rill_binding::check_like;
using rill_binding::check_same_dtype;
using rill_binding::rows_stride;

rill::DType to_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return rill::DType::kFloat32;
    case at::kHalf: return rill::DType::kFloat16;
    case at::kBFloat16: return rill::DType::kBFloat16;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type(), " (float32, float16, bfloat16)");
  }
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
}

void check_ok(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

bool is_aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

void check_pool(const at::Tensor& pool, const at::Tensor& like, const char* name) {
  check_cuda(pool, name);
  TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous(), name, " must be a contiguous [blocks, block_size, kv_heads, head_dim]");
  check_same_dtype(pool, like, name);
  TORCH_CHECK(is_aligned16(pool), name, " must be 16-byte aligned");
}

rill::PagedAttentionParams attention_params(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_pool,
                                            const at::Tensor& v_pool, const at::Tensor& block_tables,
                                            const at::Tensor& context_lens, double scale) {
  check_cuda(q, "q");
  check_cuda(out, "out");
  check_pool(k_pool, q, "k_pool");
  check_pool(v_pool, q, "v_pool");
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes(), "k_pool and v_pool shapes differ");
  const int64_t q_token_stride = rows_stride(q, "q");
  check_like(out, q, "out", "q");
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(k_pool.size(3) == head_dim, "pool head_dim ", k_pool.size(3), " != q head_dim ", head_dim);
  TORCH_CHECK(q.size(1) % k_pool.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.size(1) / k_pool.size(2) <= rill::kMaxGroupSize, "at most ", rill::kMaxGroupSize,
              " query heads per KV head");
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "head_dim must be 64 or 128, got ", head_dim);
  TORCH_CHECK(is_aligned16(q) && (q_token_stride * q.element_size()) % 16 == 0, "q rows must be 16-byte aligned");
  check_cuda(block_tables, "block_tables");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "block_tables must be int64 [num_seqs, max_blocks] with contiguous rows");
  check_cuda(context_lens, "context_lens");
  check_index_vector(context_lens, block_tables.size(0), at::kInt, "context_lens");
  rill::PagedAttentionParams p{};
  p.dtype = to_dtype(q);
  p.out = out.data_ptr();
  p.q = q.data_ptr();
  p.q_token_stride = q_token_stride;
  p.k_pool = k_pool.data_ptr();
  p.v_pool = v_pool.data_ptr();
  p.block_tables = block_tables.data_ptr<int64_t>();
  p.block_table_stride = block_tables.stride(0);
  p.context_lens = context_lens.data_ptr<int32_t>();
  p.num_seqs = static_cast<int>(block_tables.size(0));
  p.num_heads = static_cast<int>(q.size(1));
  p.num_kv_heads = static_cast<int>(k_pool.size(2));
  p.head_dim = static_cast<int>(head_dim);
  p.block_size = static_cast<int>(k_pool.size(1));
  p.scale = static_cast<float>(scale);
  return p;
}

void paged_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                            at::Tensor block_tables, at::Tensor context_lens, double scale, int64_t num_splits,
                            at::Tensor partial_out, at::Tensor partial_lse) {
  const c10::cuda::CUDAGuard guard(q.device());
  auto p = attention_params(out, q, k_pool, v_pool, block_tables, context_lens, scale);
  TORCH_CHECK(q.size(0) == p.num_seqs, "decode takes one query token per sequence");
  TORCH_CHECK(num_splits >= 1, "num_splits must be >= 1");
  float* partial_out_ptr = nullptr;
  float* partial_lse_ptr = nullptr;
  if (num_splits > 1) {
    TORCH_CHECK(partial_out.scalar_type() == at::kFloat && partial_out.is_contiguous() &&
                    partial_out.numel() >= q.numel() * num_splits,
                "partial_out must be float32 with num_seqs * num_heads * num_splits * head_dim elements");
    TORCH_CHECK(partial_lse.scalar_type() == at::kFloat && partial_lse.is_contiguous() &&
                    partial_lse.numel() >= q.size(0) * q.size(1) * num_splits,
                "partial_lse must be float32 with num_seqs * num_heads * num_splits elements");
    partial_out_ptr = partial_out.data_ptr<float>();
    partial_lse_ptr = partial_lse.data_ptr<float>();
  }
  check_ok(rill::paged_decode_attention(p, static_cast<int>(num_splits), partial_out_ptr, partial_lse_ptr,
                                        at::cuda::getCurrentCUDAStream()),
           "paged_decode_attention");
}

void paged_prefill_attention(at::Tensor out, at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                             at::Tensor block_tables, at::Tensor context_lens, at::Tensor cu_seqlens_q,
                             at::Tensor positions, double scale, int64_t max_query_len) {
  const c10::cuda::CUDAGuard guard(q.device());
  auto p = attention_params(out, q, k_pool, v_pool, block_tables, context_lens, scale);
  check_cuda(cu_seqlens_q, "cu_seqlens_q");
  check_index_vector(cu_seqlens_q, p.num_seqs + 1, at::kInt, "cu_seqlens_q");
  check_cuda(positions, "positions");
  check_index_vector(positions, q.size(0), at::kLong, "positions");
  p.cu_seqlens_q = cu_seqlens_q.data_ptr<int32_t>();
  p.positions = positions.data_ptr<int64_t>();
  check_ok(rill::paged_prefill_attention(p, static_cast<int>(max_query_len), at::cuda::getCurrentCUDAStream()),
           "paged_prefill_attention");
}

void store_kv(at::Tensor k, at::Tensor v, at::Tensor k_pool, at::Tensor v_pool, at::Tensor slot_mapping) {
  const c10::cuda::CUDAGuard guard(k.device());
  check_cuda(k, "k");
  check_cuda(v, "v");
  check_pool(k_pool, k, "k_pool");
  check_pool(v_pool, k, "v_pool");
  const int64_t k_stride = rows_stride(k, "k");
  const int64_t v_stride = rows_stride(v, "v");
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v.sizes() == k.sizes(), "k and v must match");
  TORCH_CHECK(k.size(1) == k_pool.size(2) && k.size(2) == k_pool.size(3), "k rows do not match the pool");
  check_cuda(slot_mapping, "slot_mapping");
  check_index_vector(slot_mapping, k.size(0), at::kLong, "slot_mapping");
  check_ok(rill::store_kv(to_dtype(k), k.data_ptr(), k_stride, v.data_ptr(), v_stride, k_pool.data_ptr(),
                          v_pool.data_ptr(), slot_mapping.data_ptr<int64_t>(), static_cast<int>(k.size(0)),
                          static_cast<int>(k.size(1)), static_cast<int>(k.size(2)),
                          at::cuda::getCurrentCUDAStream()),
           "store_kv");
}

void fused_add_rms_norm(at::Tensor out, at::Tensor residual_out, at::Tensor x, c10::optional<at::Tensor> residual,
                        at::Tensor weight, double eps) {
  const c10::cuda::CUDAGuard guard(x.device());
  check_cuda(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [num_rows, hidden]");
  check_like(out, x, "out", "x");
  TORCH_CHECK(weight.is_cuda() && weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden] with x's dtype");
  const void* residual_ptr = nullptr;
  if (residual.has_value()) {
    check_cuda(*residual, "residual");
    check_like(*residual, x, "residual", "x");
    check_like(residual_out, x, "residual_out", "x");
    residual_ptr = residual->data_ptr();
  }
  check_ok(rill::fused_add_rms_norm(to_dtype(x), out.data_ptr(), residual_ptr ? residual_out.data_ptr() : nullptr,
                                    x.data_ptr(), residual_ptr, weight.data_ptr(), static_cast<int>(x.size(0)),
                                    static_cast<int>(x.size(1)), static_cast<float>(eps),
                                    at::cuda::getCurrentCUDAStream()),
           "fused_add_rms_norm");
}

void rotary_embedding(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin) {
  const c10::cuda::CUDAGuard guard(q.device());
  check_cuda(q, "q");
  check_cuda(k, "k");
  const int64_t q_stride = rows_stride(q, "q");
  const int64_t k_stride = rows_stride(k, "k");
  check_same_dtype(k, q, "k");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2), "q and k must have the same tokens and head_dim");
  for (const auto* t : {&cos, &sin}) {
    check_cuda(*t, "cos/sin");
    check_same_dtype(*t, q, "cos/sin");
    TORCH_CHECK(t->is_contiguous() && t->dim() == 2 && t->size(0) == q.size(0) && t->size(1) * 2 == q.size(2),
                "cos and sin must be contiguous [num_tokens, head_dim / 2]");
  }
  check_ok(rill::rotary_embedding(to_dtype(q), q.data_ptr(), q_stride, k.data_ptr(), k_stride, cos.data_ptr(),
                                  sin.data_ptr(), static_cast<int>(q.size(0)), static_cast<int>(q.size(1)),
                                  static_cast<int>(k.size(1)), static_cast<int>(q.size(2)),
                                  at::cuda::getCurrentCUDAStream()),
           "rotary_embedding");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Rill's CUDA kernels (see docs/kernels.md)";
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("paged_prefill_attention", &paged_prefill_attention);
  m.def("store_kv", &store_kv);
  m.def("fused_add_rms_norm", &fused_add_rms_norm);
  m.def("rotary_embedding", &rotary_embedding);
  m.attr("MAX_GROUP_SIZE") = rill::kMaxGroupSize;
}
