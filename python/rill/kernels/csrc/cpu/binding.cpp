// Torch binding of the CPU kernels (ops.h): checks devices, dtypes, shapes and layouts, raising a clear
// RuntimeError on misuse, then dispatches on float32 / bfloat16. Outputs are allocated by the caller
// (rill/kernels/cpu.py). Parallel regions use torch's intra-op thread count (torch.set_num_threads).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <utility>
#include <vector>

#include "ops.h"

namespace {

using rill_cpu::bf16;

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

void check_same_dtype(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " dtype ", t.scalar_type(), " differs from ",
              like.scalar_type());
}

// [tokens, heads, head_dim] with the last two dims contiguous; returns the token stride in elements.
int64_t rows_stride(const at::Tensor& t, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.dim() == 3, name, " must be [num_tokens, num_heads, head_dim]");
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), name, " must have contiguous heads and head dims");
  return t.stride(0);
}

// A layer's K and V pools: V [num_blocks, block_size, num_kv_heads, head_dim], K the same or, bfloat16 where the
// build has AVX512-BF16, in pairs [num_blocks, num_kv_heads, head_dim / 2, block_size, 2] (ops.h, kPairedK).
struct PoolShape {
  int64_t num_blocks, block_size, num_kv_heads, head_dim;
  bool paired_k;
  bool operator==(const PoolShape& o) const {
    return num_blocks == o.num_blocks && block_size == o.block_size && num_kv_heads == o.num_kv_heads &&
           head_dim == o.head_dim && paired_k == o.paired_k;
  }
};

PoolShape pool_shape(const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& like) {
  for (const auto& [pool, name] : {std::pair{&k_pool, "k_pool"}, std::pair{&v_pool, "v_pool"}}) {
    check_cpu(*pool, name);
    check_same_dtype(*pool, like, name);
    TORCH_CHECK(pool->is_contiguous(), name, " must be contiguous");
  }
  TORCH_CHECK(v_pool.dim() == 4, "v_pool must be [num_blocks, block_size, num_kv_heads, head_dim]");
  const PoolShape shape{v_pool.size(0), v_pool.size(1), v_pool.size(2), v_pool.size(3), k_pool.dim() == 5};
  if (!shape.paired_k) {
    TORCH_CHECK(k_pool.sizes() == v_pool.sizes(), "k_pool and v_pool shapes differ");
    return shape;
  }
  TORCH_CHECK(rill_cpu::kPairedK && like.scalar_type() == at::kBFloat16,
              "a K pool in pairs needs bfloat16 and a build with AVX512-BF16");
  TORCH_CHECK(shape.block_size % rill_cpu::kLanes == 0,
              "a K pool in pairs needs a block_size that is a multiple of 16");
  TORCH_CHECK(k_pool.sizes() == at::IntArrayRef({shape.num_blocks, shape.num_kv_heads, shape.head_dim / 2,
                                                 shape.block_size, 2}),
              "k_pool in pairs must be [num_blocks, num_kv_heads, head_dim / 2, block_size, 2] of v_pool's "
              "[num_blocks, block_size, num_kv_heads, head_dim]");
  return shape;
}

at::Tensor int64_vector(const at::Tensor& t, int64_t numel, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.numel() == numel, name, " must be a CPU tensor of ",
              numel, " elements");
  TORCH_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, name, " must be int32 or int64");
  return t.to(at::kLong).contiguous();
}

int num_threads() { return at::get_num_threads(); }

// The int64 metadata of one attention batch, checked against the pools, and the PagedAttentionArgs every layer
// shares (q, out and the pools are the caller's to set). Keeps the int64 copies alive for the args' pointers.
struct AttentionBatch {
  at::Tensor cu_seqlens_q;
  at::Tensor positions;
  rill_cpu::PagedAttentionArgs args{};
};

AttentionBatch attention_batch(int64_t num_tokens, int64_t num_heads, int64_t head_dim, const PoolShape& pools,
                               const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                               const at::Tensor& positions, double scale, int64_t sliding_window, double softcap) {
  const int64_t num_blocks = pools.num_blocks, block_size = pools.block_size, num_kv_heads = pools.num_kv_heads;
  TORCH_CHECK(pools.head_dim == head_dim, "pool head_dim ", pools.head_dim, " != q head_dim ", head_dim);
  TORCH_CHECK(head_dim % rill_cpu::kLanes == 0 && head_dim > 0, "head_dim must be a multiple of 16, got ",
              head_dim);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads (", num_heads, ") must be a multiple of num_kv_heads (",
              num_kv_heads, ")");
  TORCH_CHECK(block_tables.device().is_cpu() && block_tables.scalar_type() == at::kLong &&
                  block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "block_tables must be a CPU int64 [num_seqs, max_blocks] with contiguous rows");
  const int64_t num_seqs = block_tables.size(0), max_blocks = block_tables.size(1);
  AttentionBatch batch;
  batch.cu_seqlens_q = int64_vector(cu_seqlens_q, num_seqs + 1, "cu_seqlens_q");
  batch.positions = int64_vector(positions, num_tokens, "positions");
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0");
  // Every key a query reads goes through a block-table entry that must name a block of the pool.
  const int64_t* cu_ptr = batch.cu_seqlens_q.data_ptr<int64_t>();
  const int64_t* pos_ptr = batch.positions.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  TORCH_CHECK(cu_ptr[0] == 0 && cu_ptr[num_seqs] == num_tokens, "cu_seqlens_q must run from 0 to num_tokens");
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    TORCH_CHECK(cu_ptr[seq] <= cu_ptr[seq + 1], "cu_seqlens_q must be non-decreasing");
    int64_t last_block = -1;
    for (int64_t t = cu_ptr[seq]; t < cu_ptr[seq + 1]; ++t) {
      TORCH_CHECK(pos_ptr[t] >= 0, "positions must be >= 0, got ", pos_ptr[t]);
      last_block = std::max(last_block, pos_ptr[t] / block_size);
    }
    TORCH_CHECK(last_block < max_blocks, "sequence ", seq, " reaches block ", last_block,
                " but block_tables has ", max_blocks, " columns");
    for (int64_t b = 0; b <= last_block; ++b) {
      const int64_t block = tables[seq * block_tables.stride(0) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", seq, ", ", b, "] = ", block,
                  " is outside the pool of ", num_blocks, " blocks");
    }
  }
  rill_cpu::PagedAttentionArgs& args = batch.args;
  args.block_size = block_size;
  args.num_kv_heads = num_kv_heads;
  args.num_heads = num_heads;
  args.head_dim = head_dim;
  args.block_tables = tables;
  args.block_table_stride = block_tables.stride(0);
  args.cu_seqlens_q = cu_ptr;
  args.num_seqs = num_seqs;
  args.positions = pos_ptr;
  args.scale = static_cast<float>(scale);
  args.sliding_window = sliding_window;
  args.softcap = static_cast<float>(softcap);
  args.num_threads = num_threads();
  args.paired_k = pools.paired_k;
  return batch;
}

void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor block_tables,
                     at::Tensor cu_seqlens_q, at::Tensor positions, double scale, int64_t sliding_window,
                     double softcap) {
  const int64_t q_stride = rows_stride(q, "q");
  const PoolShape pools = pool_shape(k_pool, v_pool, q);
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "out must be contiguous, with q's shape and dtype");
  AttentionBatch batch = attention_batch(q.size(0), q.size(1), q.size(2), pools, block_tables, cu_seqlens_q,
                                         positions, scale, sliding_window, softcap);
  rill_cpu::PagedAttentionArgs& args = batch.args;
  args.out = out.data_ptr();
  args.q = q.data_ptr();
  args.q_token_stride = q_stride;
  args.k_pool = k_pool.data_ptr();
  args.v_pool = v_pool.data_ptr();
  if (q.scalar_type() == at::kFloat) {
    rill_cpu::paged_attention<float>(args);
  } else {
    rill_cpu::paged_attention<bf16>(args);
  }
}

// slot_mapping as int64, each slot below the pool's `num_slots` (negative slots are skipped by store_kv).
at::Tensor checked_slots(const at::Tensor& slot_mapping, int64_t num_tokens, int64_t num_slots) {
  at::Tensor slots = int64_vector(slot_mapping, num_tokens, "slot_mapping");
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slot_ptr[t] < num_slots, "slot_mapping[", t, "] = ", slot_ptr[t], " is outside the pool of ",
                num_slots, " slots");
  return slots;
}

void store_kv(at::Tensor k, at::Tensor v, at::Tensor k_pool, at::Tensor v_pool, at::Tensor slot_mapping) {
  const int64_t k_stride = rows_stride(k, "k");
  const int64_t v_stride = rows_stride(v, "v");
  const PoolShape pools = pool_shape(k_pool, v_pool, k);
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v.sizes() == k.sizes(), "k and v must match");
  TORCH_CHECK(k.size(1) == pools.num_kv_heads && k.size(2) == pools.head_dim, "k rows do not match the pool");
  const at::Tensor slots = checked_slots(slot_mapping, k.size(0), pools.num_blocks * pools.block_size);
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  if (k.scalar_type() == at::kFloat) {
    rill_cpu::store_kv(k.data_ptr<float>(), k_stride, v.data_ptr<float>(), v_stride, k_pool.data_ptr<float>(),
                       v_pool.data_ptr<float>(), slot_ptr, k.size(0), pools.num_kv_heads, pools.head_dim,
                       pools.block_size, pools.paired_k, num_threads());
  } else {
    rill_cpu::store_kv(static_cast<const bf16*>(k.data_ptr()), k_stride, static_cast<const bf16*>(v.data_ptr()),
                       v_stride, static_cast<bf16*>(k_pool.data_ptr()), static_cast<bf16*>(v_pool.data_ptr()),
                       slot_ptr, k.size(0), pools.num_kv_heads, pools.head_dim, pools.block_size, pools.paired_k,
                       num_threads());
  }
}

template <typename T>
T* ptr(at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}
template <typename T>
const T* optional_ptr(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? static_cast<const T*>(t->data_ptr()) : nullptr;
}

void fused_add_rms_norm(at::Tensor out, at::Tensor residual_out, at::Tensor x, c10::optional<at::Tensor> residual,
                        at::Tensor weight, double eps) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [num_rows, hidden]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "out must be contiguous, with x's shape and dtype");
  check_cpu(weight, "weight");
  check_same_dtype(weight, x, "weight");
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1),
              "weight must be a contiguous [hidden]");
  if (residual.has_value()) {
    check_cpu(*residual, "residual");
    check_same_dtype(*residual, x, "residual");
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "residual must be like x");
    TORCH_CHECK(residual_out.is_contiguous() && residual_out.sizes() == x.sizes() &&
                    residual_out.scalar_type() == x.scalar_type(),
                "residual_out must be like x");
  }
  if (x.scalar_type() == at::kFloat) {
    rill_cpu::fused_add_rms_norm(ptr<float>(out), ptr<float>(residual_out), ptr<const float>(x),
                                 optional_ptr<float>(residual), ptr<const float>(weight), x.size(0), x.size(1),
                                 static_cast<float>(eps), num_threads());
  } else {
    rill_cpu::fused_add_rms_norm(ptr<bf16>(out), ptr<bf16>(residual_out), ptr<const bf16>(x),
                                 optional_ptr<bf16>(residual), ptr<const bf16>(weight), x.size(0), x.size(1),
                                 static_cast<float>(eps), num_threads());
  }
}

void rotary_embedding(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin) {
  const int64_t q_stride = rows_stride(q, "q");
  const int64_t k_stride = rows_stride(k, "k");
  check_same_dtype(k, q, "k");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2), "q and k must have the same tokens and head_dim");
  TORCH_CHECK(q.size(2) % 2 == 0, "head_dim must be even");
  for (const auto* t : {&cos, &sin}) {
    check_same_dtype(*t, q, "cos/sin");
    TORCH_CHECK(t->is_contiguous() && t->dim() == 2 && t->size(0) == q.size(0) && t->size(1) == q.size(2) / 2,
                "cos and sin must be contiguous [num_tokens, head_dim / 2]");
  }
  if (q.scalar_type() == at::kFloat) {
    rill_cpu::rotary_embedding(ptr<float>(q), q_stride, q.size(1), ptr<float>(k), k_stride, k.size(1),
                               ptr<const float>(cos), ptr<const float>(sin), q.size(0), q.size(2), num_threads());
  } else {
    rill_cpu::rotary_embedding(ptr<bf16>(q), q_stride, q.size(1), ptr<bf16>(k), k_stride, k.size(1),
                               ptr<const bf16>(cos), ptr<const bf16>(sin), q.size(0), q.size(2), num_threads());
  }
}

void silu_and_mul(at::Tensor out, at::Tensor x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "x must be a contiguous [num_tokens, 2 * I]");
  const int64_t intermediate = x.size(1) / 2;
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == intermediate &&
                  out.scalar_type() == x.scalar_type(),
              "out must be a contiguous [num_tokens, I] of x's dtype");
  if (x.scalar_type() == at::kFloat) {
    rill_cpu::silu_and_mul(ptr<float>(out), ptr<const float>(x), x.size(0), intermediate, num_threads());
  } else {
    rill_cpu::silu_and_mul(ptr<bf16>(out), ptr<const bf16>(x), x.size(0), intermediate, num_threads());
  }
}

// The packed shape of a weight [N, K] of `dtype`: float32 [ceil(N / kPanel), K, kPanel]; bfloat16
// [ceil(N / kPanel), ceil(K / 2), kPanel, 2].
std::vector<int64_t> packed_shape(at::ScalarType dtype, int64_t n, int64_t k) {
  const int64_t panels = (n + rill_cpu::kPanel - 1) / rill_cpu::kPanel;
  if (dtype == at::kFloat) return {panels, k, rill_cpu::kPanel};
  return {panels, (k + 1) / 2, rill_cpu::kPanel, 2};
}

void check_linear_dtype(const at::Tensor& t, const char* what) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, what, " must be float32 or bfloat16, got ", dtype);
#if !defined(__AVX512BF16__)
  TORCH_CHECK(dtype == at::kFloat, what, " is bfloat16, which these kernels multiply only on a CPU with AVX512-BF16");
#endif
}

void check_packed(const at::Tensor& packed, at::ScalarType dtype, int64_t n, int64_t k, const char* what) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == dtype && packed.is_contiguous() &&
                  packed.sizes() == at::IntArrayRef(packed_shape(dtype, n, k)),
              what, " must be a ", dtype, " weight packed by pack_linear for K = ", k, " and N = ", n, ", got ",
              packed.scalar_type(), " ", packed.sizes());
}

// w must be a CPU weight [N, K] of a dtype `linear` multiplies.
void check_weight(const at::Tensor& w) {
  check_cpu(w, "w");
  TORCH_CHECK(w.dim() == 2, "pack_linear needs a weight [N, K], got ", w.sizes());
  check_linear_dtype(w, "pack_linear's weight");
}

// The packed shape of weight w [N, K] (packed_shape).
std::vector<int64_t> packed_shape_of(const at::Tensor& w) {
  check_weight(w);
  return packed_shape(w.scalar_type(), w.size(0), w.size(1));
}

// Writes w [N, K] into `packed` (of packed_shape_of(w)) in the layout `linear` reads.
void pack_linear(const at::Tensor& w, at::Tensor packed) {
  check_weight(w);
  auto wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1);
  check_packed(packed, wc.scalar_type(), n, k, "pack_linear's output");
  if (wc.scalar_type() == at::kFloat) {
    rill_cpu::pack_linear(ptr<const float>(wc), ptr<float>(packed), n, k);
  } else {
#if defined(__AVX512BF16__)
    rill_cpu::pack_linear(ptr<const bf16>(wc), ptr<bf16>(packed), n, k);
#endif
  }
}

// x [M, K] @ w^T with w [N, K] packed by pack_linear, in x's dtype (the weight's).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2, "linear needs x [M, K], got ", x.sizes());
  check_linear_dtype(x, "linear's x");
  check_packed(packed, x.scalar_type(), n, x.size(1), "linear's weight");
  auto xc = x.contiguous();
  auto y = at::empty({xc.size(0), n}, xc.options());
  if (xc.size(0) == 0 || n == 0) return y;
  if (xc.scalar_type() == at::kFloat) {
    rill_cpu::linear(ptr<const float>(xc), packed.const_data_ptr<float>(), ptr<float>(y), xc.size(0), xc.size(1), n,
                     num_threads());
  } else {
#if defined(__AVX512BF16__)
    rill_cpu::linear(ptr<const bf16>(xc), static_cast<const bf16*>(packed.const_data_ptr()), ptr<bf16>(y),
                     xc.size(0), xc.size(1), n, num_threads());
#endif
  }
  return y;
}

// x must be a contiguous float32 CPU matrix [rows, n] with n >= 1.
void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous float32 CPU tensor [rows, n], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) >= 1, "x must have at least one column");
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x);
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  rill_cpu::argmax_rows(x.const_data_ptr<float>(), x.size(0), x.size(1), out.data_ptr<int64_t>(), num_threads());
  return out;
}

std::tuple<at::Tensor, at::Tensor> softmax_stats(const at::Tensor& x) {
  check_rows(x);
  auto row_maxes = at::empty({x.size(0)}, x.options());
  auto log_sums = at::empty({x.size(0)}, x.options());
  rill_cpu::softmax_stats(x.const_data_ptr<float>(), x.size(0), x.size(1), row_maxes.data_ptr<float>(),
                          log_sums.data_ptr<float>(), num_threads());
  return {row_maxes, log_sums};
}

// One decoder layer's weights as the shard hands them over: norms [hidden], projections packed by pack_linear,
// optional biases [out features].
struct DecoderLayerWeights {
  at::Tensor input_norm;
  at::Tensor qkv;
  c10::optional<at::Tensor> qkv_bias;
  at::Tensor o_proj;
  c10::optional<at::Tensor> o_proj_bias;
  at::Tensor post_norm;
  at::Tensor gate_up;
  c10::optional<at::Tensor> gate_up_bias;
  at::Tensor down;
  c10::optional<at::Tensor> down_bias;
  int64_t sliding_window;
};

// A Llama-family decoder stack whose forward is one call (decoder.cpp). Holds the weights, checked once here.
class DecoderStack {
 public:
  DecoderStack(std::vector<DecoderLayerWeights> layers, at::Tensor final_norm, int64_t intermediate_size,
               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double rms_norm_eps, double scale)
      : layers_(std::move(layers)),
        final_norm_(std::move(final_norm)),
        intermediate_(intermediate_size),
        num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        eps_(rms_norm_eps),
        scale_(scale) {
    TORCH_CHECK(!layers_.empty(), "a decoder stack needs at least one layer");
    check_cpu(final_norm_, "final_norm");
    check_linear_dtype(final_norm_, "the decoder stack's dtype");
    TORCH_CHECK(final_norm_.dim() == 1 && final_norm_.is_contiguous(), "final_norm must be a contiguous [hidden]");
    const auto dtype = final_norm_.scalar_type();
    hidden_ = final_norm_.size(0);
    const int64_t q_size = num_heads * head_dim, qkv_size = q_size + 2 * num_kv_heads * head_dim;
    const auto check_vector = [&](const at::Tensor& t, int64_t size, const char* what) {
      TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 1 && t.size(0) == size &&
                      t.is_contiguous(),
                  what, " must be a contiguous ", dtype, " [", size, "]");
    };
    const auto check_bias = [&](const c10::optional<at::Tensor>& bias, int64_t size, const char* what) {
      if (bias.has_value()) check_vector(*bias, size, what);
    };
    for (const auto& layer : layers_) {
      check_vector(layer.input_norm, hidden_, "input_norm");
      check_vector(layer.post_norm, hidden_, "post_norm");
      check_packed(layer.qkv, dtype, qkv_size, hidden_, "qkv");
      check_bias(layer.qkv_bias, qkv_size, "qkv_bias");
      check_packed(layer.o_proj, dtype, hidden_, q_size, "o_proj");
      check_bias(layer.o_proj_bias, hidden_, "o_proj_bias");
      check_packed(layer.gate_up, dtype, 2 * intermediate_size, hidden_, "gate_up");
      check_bias(layer.gate_up_bias, 2 * intermediate_size, "gate_up_bias");
      check_packed(layer.down, dtype, hidden_, intermediate_size, "down");
      check_bias(layer.down_bias, hidden_, "down_bias");
      TORCH_CHECK(layer.sliding_window >= 0, "sliding_window must be >= 0");
    }
  }

  // embedded [num_tokens, hidden]; positions [num_tokens]; cos, sin [num_tokens, head_dim / 2] in the stack's
  // dtype; one K and one V pool per layer; block_tables, cu_seqlens_q and slot_mapping as for paged_attention and
  // store_kv. Writes every layer's new K/V and returns the final norm's output [num_tokens, hidden].
  at::Tensor forward(const at::Tensor& embedded, const at::Tensor& positions, const at::Tensor& cos,
                     const at::Tensor& sin, const std::vector<at::Tensor>& k_pools,
                     const std::vector<at::Tensor>& v_pools, const at::Tensor& block_tables,
                     const at::Tensor& cu_seqlens_q, const at::Tensor& slot_mapping) const {
    check_cpu(embedded, "embedded");
    check_same_dtype(embedded, final_norm_, "embedded");
    TORCH_CHECK(embedded.dim() == 2 && embedded.size(1) == hidden_ && embedded.is_contiguous(),
                "embedded must be a contiguous [num_tokens, ", hidden_, "]");
    const int64_t tokens = embedded.size(0);
    for (const auto* t : {&cos, &sin}) {
      check_same_dtype(*t, embedded, "cos/sin");
      TORCH_CHECK(t->is_contiguous() && t->dim() == 2 && t->size(0) == tokens && t->size(1) == head_dim_ / 2,
                  "cos and sin must be contiguous [num_tokens, head_dim / 2]");
    }
    const auto num_layers = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(static_cast<int64_t>(k_pools.size()) == num_layers &&
                    static_cast<int64_t>(v_pools.size()) == num_layers,
                "need one K and one V pool per layer (", num_layers, ")");
    const PoolShape pools = pool_shape(k_pools[0], v_pools[0], embedded);
    for (int64_t l = 1; l < num_layers; ++l) {
      TORCH_CHECK(pool_shape(k_pools[l], v_pools[l], embedded) == pools,
                  "every layer's pools must have the same shape");
    }
    AttentionBatch batch = attention_batch(tokens, num_heads_, head_dim_, pools, block_tables, cu_seqlens_q,
                                           positions, scale_, 0, 0.0);
    TORCH_CHECK(pools.num_kv_heads == num_kv_heads_, "the pools hold ", pools.num_kv_heads,
                " KV heads, the stack ", num_kv_heads_);
    const at::Tensor slots = checked_slots(slot_mapping, tokens, pools.num_blocks * pools.block_size);
    auto out = at::empty({tokens, hidden_}, embedded.options());
    if (tokens == 0) return out;
    const int64_t q_size = num_heads_ * head_dim_, qkv_size = q_size + 2 * num_kv_heads_ * head_dim_;
    const auto workspace = [&](int64_t width) { return at::empty({tokens, width}, embedded.options()); };
    const at::Tensor qkv = workspace(qkv_size), attention_out = workspace(q_size), residual = workspace(hidden_);
    const at::Tensor layer_out = workspace(hidden_), gate_up = workspace(2 * intermediate_);
    const at::Tensor activation = workspace(intermediate_);
    const auto optional_data = [](const c10::optional<at::Tensor>& t) -> const void* {
      return t.has_value() ? t->data_ptr() : nullptr;
    };
    std::vector<rill_cpu::DecoderLayer> layers(num_layers);
    for (int64_t l = 0; l < num_layers; ++l) {
      const DecoderLayerWeights& w = layers_[l];
      rill_cpu::DecoderLayer& layer = layers[l];
      layer.input_norm = w.input_norm.data_ptr();
      layer.qkv = w.qkv.data_ptr();
      layer.qkv_bias = optional_data(w.qkv_bias);
      layer.o_proj = w.o_proj.data_ptr();
      layer.o_proj_bias = optional_data(w.o_proj_bias);
      layer.post_norm = w.post_norm.data_ptr();
      layer.gate_up = w.gate_up.data_ptr();
      layer.gate_up_bias = optional_data(w.gate_up_bias);
      layer.down = w.down.data_ptr();
      layer.down_bias = optional_data(w.down_bias);
      layer.k_pool = k_pools[l].data_ptr();
      layer.v_pool = v_pools[l].data_ptr();
      layer.sliding_window = w.sliding_window;
    }
    rill_cpu::DecoderStackArgs args{};
    args.layers = layers.data();
    args.num_layers = num_layers;
    args.final_norm = final_norm_.data_ptr();
    args.hidden_size = hidden_;
    args.intermediate_size = intermediate_;
    args.rms_norm_eps = static_cast<float>(eps_);
    args.num_tokens = tokens;
    args.out = out.data_ptr();
    args.embedded = embedded.data_ptr();
    args.cos = cos.data_ptr();
    args.sin = sin.data_ptr();
    args.slots = slots.data_ptr<int64_t>();
    args.qkv_out = qkv.data_ptr();
    args.attention_out = attention_out.data_ptr();
    args.residual = residual.data_ptr();
    args.layer_out = layer_out.data_ptr();
    args.gate_up_out = gate_up.data_ptr();
    args.activation = activation.data_ptr();
    args.attention = batch.args;
    if (embedded.scalar_type() == at::kFloat) {
      rill_cpu::decoder_stack<float>(args);
    } else {
#if defined(__AVX512BF16__)
      rill_cpu::decoder_stack<bf16>(args);
#endif
    }
    return out;
  }

 private:
  std::vector<DecoderLayerWeights> layers_;
  at::Tensor final_norm_;
  int64_t hidden_ = 0;
  int64_t intermediate_;
  int64_t num_heads_;
  int64_t num_kv_heads_;
  int64_t head_dim_;
  double eps_;
  double scale_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Rill's CPU kernels (see docs/kernels.md, \"CPU kernels\")";
  // The kernels touch only tensor memory: other Python threads (the shard's gRPC server) run meanwhile.
  const auto release_gil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_attention", &paged_attention, release_gil);
  m.def("store_kv", &store_kv, release_gil);
  m.def("fused_add_rms_norm", &fused_add_rms_norm, release_gil);
  m.def("rotary_embedding", &rotary_embedding, release_gil);
  m.def("silu_and_mul", &silu_and_mul, release_gil);
  m.def("packed_shape", &packed_shape_of);
  m.def("pack_linear", &pack_linear, release_gil);
  m.def("linear", &linear, release_gil);
  m.def("argmax_rows", &argmax_rows, release_gil);
  m.def("softmax_stats", &softmax_stats, release_gil);
  py::class_<DecoderLayerWeights>(m, "DecoderLayerWeights")
      .def(py::init<at::Tensor, at::Tensor, c10::optional<at::Tensor>, at::Tensor, c10::optional<at::Tensor>,
                    at::Tensor, at::Tensor, c10::optional<at::Tensor>, at::Tensor, c10::optional<at::Tensor>,
                    int64_t>(),
           py::arg("input_norm"), py::arg("qkv"), py::arg("qkv_bias"), py::arg("o_proj"), py::arg("o_proj_bias"),
           py::arg("post_norm"), py::arg("gate_up"), py::arg("gate_up_bias"), py::arg("down"),
           py::arg("down_bias"), py::arg("sliding_window"));
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<std::vector<DecoderLayerWeights>, at::Tensor, int64_t, int64_t, int64_t, int64_t, double,
                    double>(),
           py::arg("layers"), py::arg("final_norm"), py::arg("intermediate_size"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("rms_norm_eps"), py::arg("scale"))
      .def("forward", &DecoderStack::forward, release_gil);
#if defined(__AVX512F__)
  m.attr("HAS_AVX512") = true;
#else
  m.attr("HAS_AVX512") = false;
#endif
#if defined(__AVX512BF16__)
  m.attr("HAS_AVX512_BF16") = true;
#else
  m.attr("HAS_AVX512_BF16") = false;
#endif
}
