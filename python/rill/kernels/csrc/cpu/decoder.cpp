// A Llama-family decoder stack in one call (ops.h, decoder_stack): the per-layer kernels chained in C++, with no
// Python between them. The order of operations is that of LlamaDecoderLayer.forward (pre-norm, the residual
// stream carried apart so each add fuses into the next norm). At least one layer.
#include <type_traits>

#include "ops.h"

namespace rill_cpu {
namespace {

template <typename T>
const T* as(const void* p) {
  return static_cast<const T*>(p);
}
template <typename T>
T* as(void* p) {
  return static_cast<T*>(p);
}

// A projection's LoRA for this call: its stacks (null: none) and part ends, and the rows' slots (null: none).
struct Lora {
  const void* a;
  const void* b;
  int64_t rank;
  const int32_t* slots;
  int64_t part_ends[3];
  int64_t num_parts;
};

// y = x @ w^T (w packed, or a quantized matrix), plus each row's LoRA product (lora_add), + bias (added in float32
// and rounded to T, as torch adds two tensors of T): the order of Linear.forward.
template <typename T>
void project(const T* x, const void* packed, bool quantized, const void* bias, const Lora& lora, T* y, int64_t m,
             int64_t k, int64_t n, int num_threads) {
  if constexpr (std::is_same_v<T, float>) {
    if (quantized) {
      quantized_linear(x, static_cast<const uint8_t*>(packed), y, m, k, n, num_threads);
    } else {
      linear(x, as<T>(packed), y, m, k, n, num_threads);
    }
  } else {
    linear(x, as<T>(packed), y, m, k, n, num_threads);  // the binding refuses quantized matrices here
  }
  if (lora.a != nullptr && lora.slots != nullptr) {
    lora_add(y, x, as<T>(lora.a), as<T>(lora.b), lora.slots, m, k, lora.rank, lora.part_ends, lora.num_parts,
             num_threads);
  }
  if (bias == nullptr) return;
  const T* b = as<T>(bias);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < n; ++j) y[r * n + j] = from_float<T>(to_float(y[r * n + j]) + to_float(b[j]));
  }
}

}  // namespace

template <typename T>
void decoder_stack(const DecoderStackArgs& a) {
  const int64_t tokens = a.num_tokens, hidden = a.hidden_size, inter = a.intermediate_size;
  const int64_t head_dim = a.attention.head_dim;
  const int64_t q_size = a.attention.num_heads * head_dim, kv_size = a.attention.num_kv_heads * head_dim;
  const int64_t qkv_size = q_size + 2 * kv_size;
  const int threads = a.attention.num_threads;
  T* qkv = as<T>(a.qkv_out);
  T* attention_out = as<T>(a.attention_out);
  T* residual = as<T>(a.residual);
  T* layer_out = as<T>(a.out);
  T* gate_up = as<T>(a.gate_up_out);
  T* activation = as<T>(a.activation);
  T* normed = as<T>(a.normed);
  PagedAttentionArgs attention = a.attention;
  attention.q = qkv;
  attention.q_token_stride = qkv_size;
  attention.out = attention_out;
  for (int64_t l = 0; l < a.num_layers; ++l) {
    const DecoderLayer& layer = a.layers[l];
    // The stream entering this layer: its output so far and the residual (the first layer's as given; the
    // model's first layer has no residual, its input being the residual).
    const T* in = l == 0 ? as<T>(a.hidden) : layer_out;
    const T* residual_in = l == 0 ? as<T>(a.residual_in) : residual;
    if (residual_in == nullptr) {
      fused_add_rms_norm<T>(normed, nullptr, in, nullptr, as<T>(layer.input_norm), tokens, hidden, a.rms_norm_eps,
                            threads);
      residual_in = in;
    } else {
      fused_add_rms_norm<T>(normed, residual, in, residual_in, as<T>(layer.input_norm), tokens, hidden,
                            a.rms_norm_eps, threads);
      residual_in = residual;
    }
    const Lora qkv_lora{layer.qkv_lora_a, layer.qkv_lora_b, layer.qkv_lora_rank, a.lora_slots,
                        {q_size, q_size + kv_size, qkv_size}, 3};
    project<T>(normed, layer.qkv, (layer.quantized >> 0) & 1u, layer.qkv_bias, qkv_lora, qkv, tokens, hidden, qkv_size, threads);
    rotary_embedding<T>(qkv, qkv_size, attention.num_heads, qkv + q_size, qkv_size, attention.num_kv_heads,
                        as<T>(a.cos), as<T>(a.sin), tokens, head_dim, threads);
    if (layer.k_scales != nullptr) {
      store_kv_int8<T>(qkv + q_size, qkv_size, qkv + q_size + kv_size, qkv_size, as<int8_t>(layer.k_pool),
                       as<int8_t>(layer.v_pool), layer.k_scales, layer.v_scales, a.slots, tokens,
                       attention.num_kv_heads, head_dim, threads);
    } else {
      store_kv<T>(qkv + q_size, qkv_size, qkv + q_size + kv_size, qkv_size, as<T>(layer.k_pool),
                  as<T>(layer.v_pool), a.slots, tokens, attention.num_kv_heads, head_dim, attention.block_size,
                  attention.paired_k, threads);
    }
    attention.k_pool = layer.k_pool;
    attention.v_pool = layer.v_pool;
    attention.k_scales = layer.k_scales;
    attention.v_scales = layer.v_scales;
    attention.sliding_window = layer.sliding_window;
    paged_attention<T>(attention);
    const Lora o_proj_lora{layer.o_proj_lora_a, layer.o_proj_lora_b, layer.o_proj_lora_rank, a.lora_slots,
                           {hidden}, 1};
    project<T>(attention_out, layer.o_proj, (layer.quantized >> 1) & 1u, layer.o_proj_bias, o_proj_lora, layer_out, tokens, q_size, hidden,
               threads);
    fused_add_rms_norm<T>(normed, residual, layer_out, residual_in, as<T>(layer.post_norm), tokens, hidden,
                          a.rms_norm_eps, threads);
    const Lora gate_up_lora{layer.gate_up_lora_a, layer.gate_up_lora_b, layer.gate_up_lora_rank, a.lora_slots,
                            {inter, 2 * inter}, 2};
    project<T>(normed, layer.gate_up, (layer.quantized >> 2) & 1u, layer.gate_up_bias, gate_up_lora, gate_up, tokens, hidden, 2 * inter,
               threads);
    silu_and_mul<T>(activation, gate_up, tokens, inter, threads);
    const Lora down_lora{layer.down_lora_a, layer.down_lora_b, layer.down_lora_rank, a.lora_slots, {hidden}, 1};
    project<T>(activation, layer.down, (layer.quantized >> 3) & 1u, layer.down_bias, down_lora, layer_out, tokens, inter, hidden, threads);
  }
}

template void decoder_stack<float>(const DecoderStackArgs&);
#if defined(__AVX512BF16__)
template void decoder_stack<bf16>(const DecoderStackArgs&);
#endif

}  // namespace rill_cpu
