// Rill's CPU kernels: plain C++ over raw pointers (the torch binding in binding.cpp checks shapes, dtypes and
// layouts first). T is float or bf16 (vec.h); arithmetic is float32. See docs/kernels.md, "CPU kernels".
#pragma once

#include <cstdint>

#include "vec.h"

namespace rill_cpu {

// Threads for a call over num_elems elements: one below 2^15 (a parallel region costs a few microseconds).
inline int threads_for(int64_t num_elems, int num_threads) {
  return num_elems >= (int64_t{1} << 15) ? (num_threads > 1 ? num_threads : 1) : 1;
}

struct PagedAttentionArgs {
  void* out;                 // [num_tokens, num_heads, head_dim], contiguous
  const void* q;             // [num_tokens, num_heads, head_dim], rows `q_token_stride` elements apart
  int64_t q_token_stride;
  const void* k_pool;        // [num_blocks, block_size, num_kv_heads, head_dim], contiguous; or in pairs (paired_k)
  const void* v_pool;
  // int8 pools: the float32 scale of each (slot, KV head) row, [num_blocks, block_size, num_kv_heads]; the pools
  // then hold int8 (row ~ int8 row * scale), in rows. Null: the pools hold T.
  const float* k_scales;
  const float* v_scales;
  int64_t block_size;
  int64_t num_kv_heads;
  int64_t num_heads;
  int64_t head_dim;          // a multiple of 16
  const int64_t* block_tables;  // [num_seqs, block_table_stride]
  int64_t block_table_stride;
  const int64_t* cu_seqlens_q;  // [num_seqs + 1]
  int64_t num_seqs;
  const int64_t* positions;  // [num_tokens]: a query at p sees its sequence's keys 0..p
  float scale;
  int64_t sliding_window;    // > 0: only keys at positions > p - sliding_window
  float softcap;             // > 0: scores become softcap * tanh(score / softcap)
  int num_threads;
  bool paired_k;             // k_pool in pairs: see kPairedK
};

// A bfloat16 K pool may be kept in pairs, [num_blocks, num_kv_heads, head_dim / 2, block_size, 2]: per block and
// KV head, row p holds dims (2p, 2p + 1) of each slot side by side. Attention then scores 16 keys per AVX512-BF16
// step straight from the pool. Only where the build has AVX512-BF16, and with block_size a multiple of 16.
#if defined(__AVX512BF16__)
constexpr bool kPairedK = true;
#else
constexpr bool kPairedK = false;
#endif

template <typename T>
void paged_attention(const PagedAttentionArgs& args);

// Copies row t of k and v ([num_kv_heads * head_dim] elements each) into flat slot slots[t] of the pools (of
// `block_size` slots a block; k_pool in pairs when paired_k); negative slots are skipped.
template <typename T>
void store_kv(const T* k, int64_t k_token_stride, const T* v, int64_t v_token_stride, T* k_pool, T* v_pool,
              const int64_t* slots, int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
              bool paired_k, int num_threads);

// store_kv into int8 pools: each row of one KV head ([head_dim] elements of k or v) is quantized in float32, scale =
// amax(|x|) / 127, q = round-half-even(x / scale) clamped to [-127, 127] (q = 0 where scale is 0), as
// rill.shard.kv_cache.quantize_int8 does; q into the pool's slot, scale into the scale pool ([num_slots,
// num_kv_heads]). Negative slots are skipped.
template <typename T>
void store_kv_int8(const T* k, int64_t k_token_stride, const T* v, int64_t v_token_stride, int8_t* k_pool,
                   int8_t* v_pool, float* k_scales, float* v_scales, const int64_t* slots, int64_t num_tokens,
                   int64_t num_kv_heads, int64_t head_dim, int num_threads);

// residual_out = x + residual (rounded to T; skipped when residual is null, then x is normalized);
// out = weight * T(s * rsqrt(mean(s^2) + eps)) in T arithmetic, as RMSNorm in rill/shard/layers/norm.py.
template <typename T>
void fused_add_rms_norm(T* out, T* residual_out, const T* x, const T* residual, const T* weight,
                        int64_t num_rows, int64_t hidden, float eps, int num_threads);

// Rotate-half rotary in place on rows of q ([num_q_heads, head_dim] at q_token_stride) and k; cos/sin are
// [num_tokens, head_dim / 2], already rounded to T. Each op rounds to T as the torch reference does.
template <typename T>
void rotary_embedding(T* q, int64_t q_token_stride, int64_t num_q_heads, T* k, int64_t k_token_stride,
                      int64_t num_k_heads, const T* cos, const T* sin, int64_t num_tokens, int64_t head_dim,
                      int num_threads);

// out[t, i] = T(silu(x[t, i])) * x[t, intermediate + i], rounded to T.
template <typename T>
void silu_and_mul(T* out, const T* x, int64_t num_tokens, int64_t intermediate, int num_threads);

// Output features per panel of a packed weight.
constexpr int64_t kPanel = 32;

// Packs w [n, k] (row-major) into ceil(n / kPanel) panels, zero past row n: [k][kPanel] for float32,
// [ceil(k / 2)][kPanel][2] for bf16 (pairs of k, the last one zero-padded for an odd k). The layout `linear` reads.
template <typename T>
void pack_linear(const T* w, T* packed, int64_t n, int64_t k);

// y = x @ w^T for x [m, k], y [m, n] (row-major) and w packed by pack_linear. Each output is one chain over k in
// ascending order (float32: a fused multiply-add per k; bf16: an AVX512-BF16 pair product per two k, in float32,
// rounded to bf16 at the end) whatever m, the tile it falls in or the thread that computes it (linear.cpp), so a
// row's result does not depend on the batch. bf16 exists only in builds with AVX512-BF16 (HAS_AVX512_BF16).
template <typename T>
void linear(const T* x, const T* packed, T* y, int64_t m, int64_t k, int64_t n, int num_threads);

// Quantized matrices (quant.cpp): a weight [n, k] as GGUF files hold it, rows of blocks, in up to kMaxQuantParts
// parts of consecutive rows, each of one type (a fused q/k/v may mix Q4_K and Q6_K rows), behind a header in one
// uint8 buffer: QuantHeader, then each part's rows at its offset (64-byte aligned). The types are ggml's, by its
// numbers; k is a multiple of the type's block (256 for the K types, else 32).
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int64_t quant_block_bytes(int64_t qtype) {
  return qtype == kQ4_0 ? 18 : qtype == kQ4_1 ? 20 : qtype == kQ5_0 ? 22 : qtype == kQ5_1 ? 24 : qtype == kQ8_0 ? 34
       : qtype == kQ4_K ? 144 : qtype == kQ5_K ? 176 : qtype == kQ6_K ? 210 : 0;
}
constexpr int64_t quant_block_elems(int64_t qtype) {
  return qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K ? 256 : quant_block_bytes(qtype) != 0 ? 32 : 0;
}
constexpr int64_t kQuantMagic = 0x314d51524c4c4952;  // "RILLRQM1"
constexpr int kMaxQuantParts = 4;
struct QuantPart {
  int64_t qtype;
  int64_t rows;
  int64_t offset;  // bytes from the start of the buffer
};
// What a quantized matrix multiplies (quant.cpp): x as it is, or x quantized per row in blocks of 32 to int8, or
// to int16 (held as two int8 digits, so that the int8 product serves it).
enum QuantActivations : int64_t { kActFloat32 = 0, kActInt8 = 1, kActInt16 = 2 };
struct QuantHeader {
  int64_t magic;
  int64_t n;
  int64_t k;
  int64_t num_parts;
  int64_t activations;  // what x becomes for the product: QuantActivations
  QuantPart parts[kMaxQuantParts];
};

// A matrix packed for integer activations holds its Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K parts interleaved: each
// group of kInterleavedRows rows (the last padded with zero rows) block by block, each block's regions (below: the
// float16 scales, the packed 6-bit ones, the quants...) in the file's order, a region cut into units of a few bytes
// and stored unit by unit, each unit of the group's rows side by side. The same bytes, so that one vector holds the
// same unit of every row of a group (a float16 scale each, or 4 bytes of quants: the same 4 inputs' weights): a
// group is 16 rows where the build has AVX-512 with VNNI (512-bit vectors), else 8 (256-bit). Other parts, and
// matrices for float32 activations, keep the file's rows.
constexpr bool quant_interleaved(int64_t qtype, int64_t activations) {
  return activations != kActFloat32 &&
         (qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0 || qtype == kQ4_K || qtype == kQ5_K ||
          qtype == kQ6_K);
}
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RILL_QUANT_AVX512 1
constexpr int64_t kInterleavedRows = 16;
#else
constexpr int64_t kInterleavedRows = 8;
#endif
struct QuantRegion {
  int64_t start, bytes, unit;  // bytes [start, start + bytes) of a block, in units of `unit` bytes
};
// Region i of an interleaved type's block ({0, 0, 0} past the last).
constexpr QuantRegion quant_region(int64_t qtype, int i) {
  constexpr QuantRegion none{0, 0, 0};
  switch (qtype) {
    case kQ4_0: return i == 0 ? QuantRegion{0, 2, 2} : i == 1 ? QuantRegion{2, 16, 4} : none;        // d, qs
    case kQ4_1: return i < 2 ? QuantRegion{2 * i, 2, 2} : i == 2 ? QuantRegion{4, 16, 4} : none;     // d, m, qs
    case kQ8_0: return i == 0 ? QuantRegion{0, 2, 2} : i == 1 ? QuantRegion{2, 32, 4} : none;        // d, qs
    case kQ4_K:  // d, dmin, the 12 bytes of 6-bit scales and mins, qs
      return i < 2 ? QuantRegion{2 * i, 2, 2} : i == 2 ? QuantRegion{4, 12, 4} : i == 3 ? QuantRegion{16, 128, 4}
                                                                                         : none;
    case kQ5_K:  // d, dmin, the 12 bytes of 6-bit scales and mins, qh (the fifth bits), qs
      return i < 2 ? QuantRegion{2 * i, 2, 2} : i == 2 ? QuantRegion{4, 12, 4} : i == 3 ? QuantRegion{16, 32, 4}
           : i == 4 ? QuantRegion{48, 128, 4} : none;
    case kQ6_K:  // ql, qh, the 16 int8 scales, d
      return i == 0 ? QuantRegion{0, 128, 4} : i == 1 ? QuantRegion{128, 64, 4} : i == 2 ? QuantRegion{192, 16, 1}
           : i == 3 ? QuantRegion{208, 2, 2} : none;
    default: return none;
  }
}
// The rows a part stores (interleaved: its rows rounded up to a whole group).
constexpr int64_t quant_stored_rows(int64_t qtype, int64_t activations, int64_t rows) {
  const int64_t groups = (rows + kInterleavedRows - 1) / kInterleavedRows;
  return quant_interleaved(qtype, activations) ? groups * kInterleavedRows : rows;
}
// Where byte i of row r of an interleaved part (row_bytes per row) lies, from the part's start.
constexpr int64_t interleaved_offset(int64_t qtype, int64_t row_bytes, int64_t r, int64_t i) {
  const int64_t block = quant_block_bytes(qtype), lane = r % kInterleavedRows, t = i % block;
  const int64_t base = r / kInterleavedRows * kInterleavedRows * row_bytes + i / block * kInterleavedRows * block;
  int region = 0;
  while (t >= quant_region(qtype, region).start + quant_region(qtype, region).bytes) ++region;
  const QuantRegion g = quant_region(qtype, region);
  const int64_t within = t - g.start;
  return base + kInterleavedRows * (g.start + within / g.unit * g.unit) + lane * g.unit + within % g.unit;
}

// Row r of an interleaved part, unit by unit: from the file's bytes of the row (row_bytes at `from`) into the part
// (its start at `to`), or, `to_file`, from the part (its start at `from`) back to the file's bytes at `to`.
void copy_interleaved_row(int64_t qtype, int64_t row_bytes, int64_t r, const uint8_t* from, uint8_t* to,
                          bool to_file);

// y [m, n] = x [m, k] @ w^T for float32 x and a quantized matrix w, with float32 activations or (as the matrix
// says) int8 or int16 ones quantized per row in blocks of 32; a fixed float order per output (quant.cpp), so a
// row's bits do not depend on m nor the threads. `portable` runs the plain C++ path (bitwise equal to the AVX2
// one).
void quantized_linear(const float* x, const uint8_t* packed, float* y, int64_t m, int64_t k, int64_t n,
                      int num_threads, bool portable = false);
// out [num_rows, k] = rows `rows` of the quantized matrix, de-quantized as ggml does.
void dequantize_rows(const uint8_t* packed, const int64_t* rows, int64_t num_rows, int64_t k, float* out,
                     int num_threads);
// Whether quantized_linear has its AVX2 path in this build.
bool has_avx2_quant();

// LoRA (lora.cpp): for each row r of x [num_rows, in] whose slot s = row_slots[r] is >= 0, h = lora_a[s] x[r]
// (lora_a [S, P * R, in], part p's rows [p * R, (p + 1) * R)), then y[r, o] += lora_b[s, o] . h[p * R ..
// (p + 1) * R) for the outputs o of part p, [part_ends[p - 1], part_ends[p]) (lora_b [S, out, R], out =
// part_ends[P - 1]). Rows with slot -1 are not touched; slots must be < S. A row's bits depend only on its x and
// y and its slot's weights (float32 chains in a fixed order; T rounding where the torch reference stores a T).
template <typename T>
void lora_add(T* y, const T* x, const T* lora_a, const T* lora_b, const int32_t* row_slots, int64_t num_rows,
              int64_t in, int64_t rank, const int64_t* part_ends, int64_t num_parts, int num_threads);

// Sampler reductions over float32 rows x [num_rows, n] (rows.cpp). argmax_rows: the index of each row's first
// maximum, a NaN counting as the maximum (torch's max(dim=-1).indices). softmax_stats: each row's max and the log
// of its sum of exp(x - max), so that log_softmax(x)[j] = (x[j] - max) - log_sum.
void argmax_rows(const float* x, int64_t num_rows, int64_t n, int64_t* out, int num_threads);
void softmax_stats(const float* x, int64_t num_rows, int64_t n, float* row_maxes, float* log_sums,
                   int num_threads);

// One Llama-family decoder layer's weights, declared once: X(name, is_optional) for each, in the order the
// shard hands them over (binding.cpp exports the names as DECODER_LAYER_FIELDS, and rill/kernels/cpu.py builds
// each layer from them). Norms are [hidden]; projections are packed by pack_linear (qkv [q + k + v features,
// hidden], o_proj [hidden, num_heads * head_dim], gate_up [2 * intermediate, hidden] with the gate's rows first,
// down [hidden, intermediate]; any of them may be a quantized matrix instead); optional biases are [out features]; optional LoRA stacks are lora_add's lora_a
// [S, P * R, in] and lora_b [S, out, R] of a projection (parts: q, k, v; gate, up; one for o_proj and down).
#define RILL_DECODER_LAYER_WEIGHTS(X) \
  X(input_norm, false)                \
  X(qkv, false)                       \
  X(qkv_bias, true)                   \
  X(qkv_lora_a, true)                 \
  X(qkv_lora_b, true)                 \
  X(o_proj, false)                    \
  X(o_proj_bias, true)                \
  X(o_proj_lora_a, true)              \
  X(o_proj_lora_b, true)              \
  X(post_norm, false)                 \
  X(gate_up, false)                   \
  X(gate_up_bias, true)               \
  X(gate_up_lora_a, true)             \
  X(gate_up_lora_b, true)             \
  X(down, false)                      \
  X(down_bias, true)                  \
  X(down_lora_a, true)                \
  X(down_lora_b, true)

// A layer as the kernels read it (elements of T; an absent bias or LoRA stack is null).
struct DecoderLayer {
#define RILL_POINTER_FIELD(name, is_optional) const void* name;
  RILL_DECODER_LAYER_WEIGHTS(RILL_POINTER_FIELD)
#undef RILL_POINTER_FIELD
  int64_t qkv_lora_rank;   // R of each projection's LoRA stacks (their lora_b's last dim); 0 without them
  int64_t o_proj_lora_rank;
  int64_t gate_up_lora_rank;
  int64_t down_lora_rank;
  // Projections given as quantized matrices (quant.cpp) rather than packed float weights: bit 0 qkv, 1 o_proj,
  // 2 gate_up, 3 down. Only in float32 stacks.
  unsigned quantized;
  void* k_pool;            // this layer's pools, as for paged_attention
  void* v_pool;
  float* k_scales;         // int8 pools: their scale pools (null: pools of T)
  float* v_scales;
  int64_t sliding_window;  // 0: the layer sees every earlier position
};

struct DecoderStackArgs {
  const DecoderLayer* layers;
  int64_t num_layers;
  int64_t hidden_size;
  int64_t intermediate_size;
  float rms_norm_eps;
  int64_t num_tokens;
  // [num_tokens, hidden]: the stream entering the first layer, as LlamaDecoderLayer.forward takes it: `hidden`,
  // and `residual_in` (null for the model's first layer, whose residual is `hidden` itself; read only).
  const void* hidden;
  const void* residual_in;
  const void* cos;         // [num_tokens, head_dim / 2]
  const void* sin;
  const int64_t* slots;    // [num_tokens], as for store_kv
  const int32_t* lora_slots;  // [num_tokens], as for lora_add; null: no row has an adapter (no LoRA work)
  // Outputs, [num_tokens, hidden] each: the last layer's output and the residual stream (their sum is the
  // stream leaving the stack, which the model's next norm adds).
  void* out;
  void* residual;
  // Workspace, each [num_tokens, its width]: qkv (q + k + v features), attention output (num_heads * head_dim),
  // a norm's output (hidden), gate/up (2 * intermediate), activation (intermediate).
  void* qkv_out;
  void* attention_out;
  void* normed;
  void* gate_up_out;
  void* activation;
  // Everything paged attention needs but the pools, q and out, which change per layer.
  PagedAttentionArgs attention;
};

// Runs every layer as LlamaDecoderLayer.forward (rill/shard/models/llama.py) does on the CPU kernels: the same
// kernels in the same order on the same inputs, so the output is bitwise theirs (a bias is added as torch adds
// two tensors of T: in float32, rounded to T). Writes each layer's new K/V into its pools.
template <typename T>
void decoder_stack(const DecoderStackArgs& args);

}  // namespace rill_cpu
