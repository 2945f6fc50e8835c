// Host-side launchers of Rill's CUDA kernels. Plain C++ types only (no torch), so the .cu files compile with
// nvcc alone; rill/kernels/csrc/binding.cpp checks torch tensors and calls these.
//
// Layout assumptions shared by every launcher (binding.cpp checks them):
// - the KV pool of one layer is [num_blocks, block_size, num_kv_heads, head_dim], contiguous;
//   position p of a sequence is slot block_table[p / block_size] * block_size + p % block_size;
// - q/k/v rows are [num_tokens, num_heads, head_dim] with the last two dims contiguous and any token stride;
// - query head h uses KV head h / (num_heads / num_kv_heads) (GQA, as the torch reference);
// - block tables are int64 [num_seqs, block_table_stride], padded with block 0; slots and positions int64;
//   context_lens and cu_seqlens_q int32 on the device.
// Each launcher returns the cudaError_t of its launch.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace rill {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct PagedAttentionParams {
  DType dtype;
  void* out;                     // [num_tokens, num_heads, head_dim], contiguous
  const void* q;                 // [num_tokens, num_heads, head_dim], token stride q_token_stride
  int64_t q_token_stride;        // elements
  const void* k_pool;            // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* v_pool;
  const int64_t* block_tables;   // [num_seqs, block_table_stride]
  int64_t block_table_stride;
  const int32_t* context_lens;   // [num_seqs]: keys at positions [0, context_len) are in the pool
  const int32_t* cu_seqlens_q;   // [num_seqs + 1] (prefill only)
  const int64_t* positions;      // [num_tokens] (prefill only): query at position p sees keys <= p
  int num_seqs;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int block_size;
  float scale;
};

// Decode: exactly one query token per sequence (token i belongs to sequence i). The context of each sequence
// is cut into `num_splits` ranges; each CTA handles one (kv head, sequence, range) for all query heads of the
// group, and a second kernel merges the ranges by log-sum-exp. `partial_out` (float,
// [num_seqs, num_heads, num_splits, head_dim]) and `partial_lse` (float, [num_seqs, num_heads, num_splits])
// are scratch, unused when num_splits == 1.
cudaError_t paged_decode_attention(const PagedAttentionParams& p, int num_splits, float* partial_out,
                                   float* partial_lse, cudaStream_t stream);

// Prefill / mixed: sequence i owns query rows [cu_seqlens_q[i], cu_seqlens_q[i+1]); every query attends to
// the keys of its sequence at positions <= its own (causal), all read from the pool (new K/V stored first).
cudaError_t paged_prefill_attention(const PagedAttentionParams& p, int max_query_len, cudaStream_t stream);

// Largest query heads per KV head the attention kernels support.
constexpr int kMaxGroupSize = 16;

// KV cache write: k/v [num_tokens, num_kv_heads, head_dim] (token strides in elements) go to flat slot
// slot_mapping[t] of the pools; a negative slot is skipped.
cudaError_t store_kv(DType dtype, const void* k, int64_t k_token_stride, const void* v, int64_t v_token_stride,
                     void* k_pool, void* v_pool, const int64_t* slot_mapping, int num_tokens, int num_kv_heads,
                     int head_dim, cudaStream_t stream);

// residual_out = x + residual (rounded to dtype); out = weight * round(r * rsqrt(mean(r^2) + eps)), r the
// rounded sum, as the torch reference. With residual == nullptr: out = rmsnorm(x), residual_out unused.
// All [num_rows, hidden] contiguous.
cudaError_t fused_add_rms_norm(DType dtype, void* out, void* residual_out, const void* x, const void* residual,
                               const void* weight, int num_rows, int hidden, float eps, cudaStream_t stream);

// In-place rotate-half rotary embedding of q [num_tokens, num_heads, head_dim] and k
// [num_tokens, num_kv_heads, head_dim] (token strides in elements) by cos, sin [num_tokens, head_dim / 2] in the
// same dtype (the shard's table, any attention factor included): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin,
// each product rounded to the dtype as the torch reference rounds it.
cudaError_t rotary_embedding(DType dtype, void* q, int64_t q_token_stride, void* k, int64_t k_token_stride,
                             const void* cos, const void* sin, int num_tokens, int num_heads, int num_kv_heads,
                             int head_dim, cudaStream_t stream);

}  // namespace rill
