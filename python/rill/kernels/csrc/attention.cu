// Paged attention: decode (split along the context, flash-decoding style, merged by log-sum-exp) and
// prefill / mixed (variable-length causal query chunks over their cached prefix). Semantics: the torch
// reference in rill/shard/layers/attention.py. Layouts: ops.h.
#include <cfloat>

#include "common.cuh"
#include "ops.h"

namespace rill {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr float kNegInf = -INFINITY;

// ---------------------------------------------------------------------------------------------------------
// Decode. One CTA = (kv head, sequence, split). Each thread group of TPT = head_dim / VEC threads reads one
// token's K (then V) row with 16-byte loads; the CTA walks its split in tiles of TILE tokens with an online
// softmax whose state (max, sum) lives in shared memory per query head. All query heads of the group share
// each K/V load, so a KV block is read once per KV head.
template <typename T, int HD, int MAX_G>
__global__ void __launch_bounds__(kThreads)
    decode_kernel(const PagedAttentionParams p, const int num_splits, float* __restrict__ partial_out,
                  float* __restrict__ partial_lse) {
  using V = Vec16<T>;
  constexpr int VEC = V::N;
  constexpr int TPT = HD / VEC;  // threads per token row
  static_assert(HD % VEC == 0 && TPT <= 32 && 32 % TPT == 0, "unsupported head_dim for this dtype");
  constexpr int NTG = kThreads / TPT;  // token groups per CTA
  constexpr int UNROLL = MAX_G >= 16 ? 4 : 8;  // tokens in flight per thread (fewer: registers)
  constexpr int TILE = NTG * UNROLL;   // tokens per tile

  __shared__ float scores[MAX_G][TILE];
  __shared__ float row_max[MAX_G];
  __shared__ float row_sum[MAX_G];
  __shared__ float rescale[MAX_G];
  __shared__ float reduce_buf[kWarps][MAX_G][HD];

  const int kv_head = blockIdx.x;
  const int seq = blockIdx.y;
  const int split = blockIdx.z;
  const int group = p.num_heads / p.num_kv_heads;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int tg = tid / TPT;
  const int lt = tid % TPT;

  const int context_len = p.context_lens[seq];
  int split_len = ceil_div(context_len, num_splits);
  split_len = ceil_div(split_len, TILE) * TILE;
  const int start = split * split_len;
  const int end = min(context_len, start + split_len);

  const T* q = static_cast<const T*>(p.q);
  float qf[MAX_G][VEC];
#pragma unroll
  for (int g = 0; g < MAX_G; ++g) {
    if (g < group) {
      V qv;
      qv.load(q + seq * p.q_token_stride + (int64_t)(kv_head * group + g) * HD + lt * VEC);
      qv.to_floats(qf[g]);
#pragma unroll
      for (int e = 0; e < VEC; ++e) qf[g][e] *= p.scale;
    }
  }
  if (tid < MAX_G) {
    row_max[tid] = kNegInf;
    row_sum[tid] = 0.f;
  }
  float acc[MAX_G][VEC];
#pragma unroll
  for (int g = 0; g < MAX_G; ++g)
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[g][e] = 0.f;
  __syncthreads();

  const int64_t token_stride = (int64_t)p.num_kv_heads * HD;
  const int64_t head_offset = (int64_t)kv_head * HD + lt * VEC;
  const T* k_pool = static_cast<const T*>(p.k_pool) + head_offset;
  const T* v_pool = static_cast<const T*>(p.v_pool) + head_offset;
  const int64_t* block_table = p.block_tables + seq * p.block_table_stride;

  for (int tile_start = start; tile_start < end; tile_start += TILE) {
    int64_t row[UNROLL];  // slot of each of this thread's tokens, -1 past the split
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = tile_start + u * NTG + tg;
      row[u] = t < end ? block_table[t / p.block_size] * p.block_size + t % p.block_size : -1;
    }
    V kv[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (row[u] >= 0) kv[u].load(k_pool + row[u] * token_stride);
      else kv[u].zero();
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float kf[VEC];
      kv[u].to_floats(kf);
#pragma unroll
      for (int g = 0; g < MAX_G; ++g) {
        if (g < group) {  // uniform across the CTA, so the shuffles below see every lane
          float s = 0.f;
#pragma unroll
          for (int e = 0; e < VEC; ++e) s += qf[g][e] * kf[e];
          s = group_sum<TPT>(s);
          if (lt == 0) scores[g][u * NTG + tg] = row[u] >= 0 ? s : kNegInf;
        }
      }
    }
    __syncthreads();
    // Online softmax over this tile: one warp per query head.
    for (int g = warp; g < group; g += kWarps) {
      float tile_max = kNegInf;
      for (int j = lane; j < TILE; j += 32) tile_max = fmaxf(tile_max, scores[g][j]);
      tile_max = warp_max(tile_max);
      const float old_max = row_max[g];
      const float new_max = fmaxf(old_max, tile_max);
      const float safe_max = new_max == kNegInf ? 0.f : new_max;  // all masked so far: keep exp() finite
      float tile_sum = 0.f;
      for (int j = lane; j < TILE; j += 32) {
        const float prob = expf(scores[g][j] - safe_max);
        scores[g][j] = prob;
        tile_sum += prob;
      }
      tile_sum = warp_sum(tile_sum);
      if (lane == 0) {
        const float alpha = expf(old_max - safe_max);
        rescale[g] = alpha;
        row_sum[g] = row_sum[g] * alpha + tile_sum;
        row_max[g] = new_max;
      }
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (row[u] >= 0) kv[u].load(v_pool + row[u] * token_stride);
      else kv[u].zero();
    }
#pragma unroll
    for (int g = 0; g < MAX_G; ++g) {
      if (g < group) {
        const float alpha = rescale[g];
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[g][e] *= alpha;
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float vf[VEC];
      kv[u].to_floats(vf);
#pragma unroll
      for (int g = 0; g < MAX_G; ++g) {
        if (g < group) {
          const float prob = scores[g][u * NTG + tg];
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[g][e] += prob * vf[e];
        }
      }
    }
    __syncthreads();  // scores and rescale are rewritten by the next tile
  }

  // Sum the token groups: first within the warp (lanes TPT apart), then across warps in shared memory.
#pragma unroll
  for (int g = 0; g < MAX_G; ++g) {
    if (g < group) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
#pragma unroll
        for (int offset = 16; offset >= TPT; offset /= 2)
          acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], offset);
        if (lane < TPT) reduce_buf[warp][g][lt * VEC + e] = acc[g][e];
      }
    }
  }
  __syncthreads();
  for (int idx = tid; idx < group * HD; idx += kThreads) {
    const int g = idx / HD;
    const int d = idx % HD;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += reduce_buf[w][g][d];
    const float l = row_sum[g];
    const float value = l > 0.f ? sum / l : 0.f;
    const int64_t head_row = (int64_t)seq * p.num_heads + kv_head * group + g;
    if (num_splits == 1) {
      static_cast<T*>(p.out)[head_row * HD + d] = from_float<T>(value);
    } else {
      partial_out[(head_row * num_splits + split) * HD + d] = value;
      if (d == 0) partial_lse[head_row * num_splits + split] = l > 0.f ? row_max[g] + logf(l) : kNegInf;
    }
  }
}

// Merges the splits of one (sequence, head): out = sum_s exp(lse_s - M) * o_s / sum_s exp(lse_s - M).
template <typename T>
__global__ void merge_splits_kernel(T* __restrict__ out, const float* __restrict__ partial_out,
                                    const float* __restrict__ partial_lse, const int num_heads,
                                    const int num_splits, const int head_dim) {
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int64_t head_row = (int64_t)seq * num_heads + head;
  const float* lse = partial_lse + head_row * num_splits;
  float max_lse = kNegInf;
  for (int s = 0; s < num_splits; ++s) max_lse = fmaxf(max_lse, lse[s]);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float value = 0.f;
    if (max_lse != kNegInf) {
      float weight_sum = 0.f;
      for (int s = 0; s < num_splits; ++s) {
        const float weight = expf(lse[s] - max_lse);  // 0 for an empty split (lse = -inf)
        weight_sum += weight;
        value += weight * partial_out[(head_row * num_splits + s) * head_dim + d];
      }
      value /= weight_sum;
    }
    out[head_row * head_dim + d] = from_float<T>(value);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Prefill / mixed. One CTA = (kv head, sequence, tile of queries); its ROWS rows are (query, head-in-group)
// pairs, 4 per warp. K/V tiles of KEY_TILE keys are staged in shared memory as float; lane j scores key j,
// then each lane accumulates head dims lane, lane + 32, ... with an online softmax per row.
constexpr int kPrefillRows = 16;
constexpr int kKeyTile = 32;
constexpr int kRowsPerWarp = kPrefillRows / kWarps;

template <typename T, int HD>
__global__ void __launch_bounds__(kThreads) prefill_kernel(const PagedAttentionParams p) {
  using V = Vec16<T>;
  constexpr int VEC = V::N;
  constexpr int DIMS_PER_LANE = HD / 32;
  static_assert(HD % 32 == 0, "head_dim must be a multiple of 32");

  __shared__ float qs[kPrefillRows][HD];
  __shared__ float ks[kKeyTile][HD + 1];  // +1: lane j reads row j, conflict-free
  __shared__ float vs[kKeyTile][HD];
  __shared__ int64_t row_pos[kPrefillRows];

  const int kv_head = blockIdx.x;
  const int seq = blockIdx.y;
  const int group = p.num_heads / p.num_kv_heads;
  const int queries_per_cta = max(1, kPrefillRows / group);
  const int q_start = p.cu_seqlens_q[seq];
  const int q_len = p.cu_seqlens_q[seq + 1] - q_start;
  const int first_query = blockIdx.z * queries_per_cta;
  if (first_query >= q_len) return;  // uniform across the CTA
  const int context_len = p.context_lens[seq];
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;

  const T* q = static_cast<const T*>(p.q);
  for (int idx = tid; idx < kPrefillRows * HD; idx += kThreads) {
    const int r = idx / HD;
    const int d = idx % HD;
    const int qi = r / group;
    const bool is_valid = qi < queries_per_cta && first_query + qi < q_len;
    float value = 0.f;
    if (is_valid) {
      const int64_t token = q_start + first_query + qi;
      const int head = kv_head * group + r % group;
      value = to_float(q[token * p.q_token_stride + (int64_t)head * HD + d]) * p.scale;
    }
    qs[r][d] = value;
    if (d == 0) row_pos[r] = is_valid ? p.positions[q_start + first_query + qi] : -1;
  }
  __syncthreads();
  int64_t max_pos = -1;
  for (int r = 0; r < kPrefillRows; ++r) max_pos = max(max_pos, row_pos[r]);
  const int kv_end = (int)min((int64_t)context_len, max_pos + 1);

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][DIMS_PER_LANE];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    m[i] = kNegInf;
    l[i] = 0.f;
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) acc[i][c] = 0.f;
  }

  const int64_t token_stride = (int64_t)p.num_kv_heads * HD;
  const T* k_pool = static_cast<const T*>(p.k_pool) + (int64_t)kv_head * HD;
  const T* v_pool = static_cast<const T*>(p.v_pool) + (int64_t)kv_head * HD;
  const int64_t* block_table = p.block_tables + seq * p.block_table_stride;
  constexpr int VECS_PER_ROW = HD / VEC;

  for (int tile_start = 0; tile_start < kv_end; tile_start += kKeyTile) {
    for (int idx = tid; idx < kKeyTile * VECS_PER_ROW; idx += kThreads) {
      const int j = idx / VECS_PER_ROW;
      const int c = (idx % VECS_PER_ROW) * VEC;
      const int t = tile_start + j;
      float kf[VEC], vf[VEC];
      if (t < kv_end) {
        const int64_t slot = block_table[t / p.block_size] * p.block_size + t % p.block_size;
        V kv;
        kv.load(k_pool + slot * token_stride + c);
        kv.to_floats(kf);
        kv.load(v_pool + slot * token_stride + c);
        kv.to_floats(vf);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) kf[e] = vf[e] = 0.f;
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        ks[j][c + e] = kf[e];
        vs[j][c + e] = vf[e];
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = warp * kRowsPerWarp + i;
      const int64_t pos = row_pos[r];
      if (pos < tile_start) continue;  // invalid row (-1) or every key of the tile is in its future; warp-uniform
      float s = 0.f;
#pragma unroll 16
      for (int d = 0; d < HD; ++d) s += qs[r][d] * ks[lane][d];
      const int t = tile_start + lane;
      if (t > pos || t >= kv_end) s = kNegInf;
      const float new_max = fmaxf(m[i], warp_max(s));  // finite: key tile_start <= pos is unmasked
      const float prob = expf(s - new_max);
      const float alpha = expf(m[i] - new_max);
      l[i] = l[i] * alpha + warp_sum(prob);
      m[i] = new_max;
#pragma unroll
      for (int c = 0; c < DIMS_PER_LANE; ++c) acc[i][c] *= alpha;
      for (int j = 0; j < kKeyTile; ++j) {
        const float pj = __shfl_sync(0xffffffffu, prob, j);
#pragma unroll
        for (int c = 0; c < DIMS_PER_LANE; ++c) acc[i][c] += pj * vs[j][lane + 32 * c];
      }
    }
    __syncthreads();
  }

  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp * kRowsPerWarp + i;
    if (row_pos[r] < 0) continue;
    const int64_t token = q_start + first_query + r / group;
    const int head = kv_head * group + r % group;
#pragma unroll
    for (int c = 0; c < DIMS_PER_LANE; ++c) {
      const float value = l[i] > 0.f ? acc[i][c] / l[i] : 0.f;
      out[(token * p.num_heads + head) * HD + lane + 32 * c] = from_float<T>(value);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
template <typename T, int HD, int MAX_G>
cudaError_t launch_decode(const PagedAttentionParams& p, int num_splits, float* partial_out,
                          float* partial_lse, cudaStream_t stream) {
  const dim3 grid(p.num_kv_heads, p.num_seqs, num_splits);
  decode_kernel<T, HD, MAX_G><<<grid, kThreads, 0, stream>>>(p, num_splits, partial_out, partial_lse);
  if (num_splits > 1) {
    merge_splits_kernel<T><<<dim3(p.num_heads, p.num_seqs), HD, 0, stream>>>(
        static_cast<T*>(p.out), partial_out, partial_lse, p.num_heads, num_splits, HD);
  }
  return cudaGetLastError();
}

template <typename T, int HD>
cudaError_t decode_by_group(const PagedAttentionParams& p, int num_splits, float* partial_out,
                            float* partial_lse, cudaStream_t stream) {
  const int group = p.num_heads / p.num_kv_heads;
  if (group == 1) return launch_decode<T, HD, 1>(p, num_splits, partial_out, partial_lse, stream);
  if (group <= 4) return launch_decode<T, HD, 4>(p, num_splits, partial_out, partial_lse, stream);
  if (group <= 8) return launch_decode<T, HD, 8>(p, num_splits, partial_out, partial_lse, stream);
  if (group <= kMaxGroupSize) return launch_decode<T, HD, 16>(p, num_splits, partial_out, partial_lse, stream);
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t decode_by_head_dim(const PagedAttentionParams& p, int num_splits, float* partial_out,
                               float* partial_lse, cudaStream_t stream) {
  if (p.head_dim == 64) return decode_by_group<T, 64>(p, num_splits, partial_out, partial_lse, stream);
  if (p.head_dim == 128) return decode_by_group<T, 128>(p, num_splits, partial_out, partial_lse, stream);
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t prefill_by_head_dim(const PagedAttentionParams& p, int max_query_len, cudaStream_t stream) {
  const int group = p.num_heads / p.num_kv_heads;
  if (group > kMaxGroupSize) return cudaErrorInvalidValue;
  const int queries_per_cta = max(1, kPrefillRows / group);
  const dim3 grid(p.num_kv_heads, p.num_seqs, ceil_div(max_query_len, queries_per_cta));
  if (p.head_dim == 64) prefill_kernel<T, 64><<<grid, kThreads, 0, stream>>>(p);
  else if (p.head_dim == 128) prefill_kernel<T, 128><<<grid, kThreads, 0, stream>>>(p);
  else return cudaErrorInvalidValue;
  return cudaGetLastError();
}

}  // namespace

cudaError_t paged_decode_attention(const PagedAttentionParams& p, int num_splits, float* partial_out,
                                   float* partial_lse, cudaStream_t stream) {
  if (p.num_seqs == 0) return cudaSuccess;
  if (num_splits < 1 || p.num_kv_heads < 1 || p.num_heads % p.num_kv_heads != 0) return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kFloat32: return decode_by_head_dim<float>(p, num_splits, partial_out, partial_lse, stream);
    case DType::kFloat16: return decode_by_head_dim<__half>(p, num_splits, partial_out, partial_lse, stream);
    case DType::kBFloat16:
      return decode_by_head_dim<__nv_bfloat16>(p, num_splits, partial_out, partial_lse, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t paged_prefill_attention(const PagedAttentionParams& p, int max_query_len, cudaStream_t stream) {
  if (p.num_seqs == 0 || max_query_len == 0) return cudaSuccess;
  if (p.num_kv_heads < 1 || p.num_heads % p.num_kv_heads != 0) return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kFloat32: return prefill_by_head_dim<float>(p, max_query_len, stream);
    case DType::kFloat16: return prefill_by_head_dim<__half>(p, max_query_len, stream);
    case DType::kBFloat16: return prefill_by_head_dim<__nv_bfloat16>(p, max_query_len, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace rill
