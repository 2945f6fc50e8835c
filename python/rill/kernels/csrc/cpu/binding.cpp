// Torch binding of the CPU kernels (ops.h): checks devices, dtypes, shapes and layouts, raising a clear
// RuntimeError on misuse, then dispatches on float32 / bfloat16. Outputs are allocated by the caller
// (rill/kernels/cpu.py). Parallel regions use torch's intra-op thread count (torch.set_num_threads).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "../torch_checks.h"
#include "ops.h"

namespace {

using rill_cpu::bf16;

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

using rill_binding::check_like;
using rill_binding::check_same_dtype;

// [tokens, heads, head_dim] CPU rows (rill_binding::rows_stride); returns the token stride in elements.
int64_t rows_stride(const at::Tensor& t, const char* name) {
  check_cpu(t, name);
  return rill_binding::rows_stride(t, name);
}

// Calls f(float{}) or f(bf16{}) for t's dtype (check_cpu has checked it is one of them).
template <typename F>
void dispatch_float(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    f(bf16{});
  }
}

// A layer's K and V pools: V [num_blocks, block_size, num_kv_heads, head_dim], K the same or, bfloat16 where the
// build has AVX512-BF16, in pairs [num_blocks, num_kv_heads, head_dim / 2, block_size, 2] (ops.h, kPairedK); or
// int8 pools, both in rows, with float32 scale pools [num_blocks, block_size, num_kv_heads].
struct PoolShape {
  int64_t num_blocks, block_size, num_kv_heads, head_dim;
  bool paired_k;
  bool is_int8;
  bool operator==(const PoolShape& o) const {
    return num_blocks == o.num_blocks && block_size == o.block_size && num_kv_heads == o.num_kv_heads &&
           head_dim == o.head_dim && paired_k == o.paired_k && is_int8 == o.is_int8;
  }
};

using OptionalTensor = c10::optional<at::Tensor>;

// The pools of `like`'s dtype, or int8 pools when their scale pools (both) are given.
PoolShape pool_shape(const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& like,
                     const OptionalTensor& k_scales = {}, const OptionalTensor& v_scales = {}) {
  TORCH_CHECK(k_scales.has_value() == v_scales.has_value(), "k_scales and v_scales must be given together");
  const bool is_int8 = k_scales.has_value();
  for (const auto& [pool, name] : {std::pair{&k_pool, "k_pool"}, std::pair{&v_pool, "v_pool"}}) {
    if (is_int8) {
      TORCH_CHECK(pool->device().is_cpu() && pool->scalar_type() == at::kChar, name,
                  " must be an int8 CPU tensor (scale pools were given), got ", pool->scalar_type());
    } else {
      check_cpu(*pool, name);
      check_same_dtype(*pool, like, name);
    }
    TORCH_CHECK(pool->is_contiguous(), name, " must be contiguous");
  }
  TORCH_CHECK(v_pool.dim() == 4, "v_pool must be [num_blocks, block_size, num_kv_heads, head_dim]");
  const PoolShape shape{v_pool.size(0), v_pool.size(1), v_pool.size(2), v_pool.size(3), k_pool.dim() == 5, is_int8};
  if (is_int8) {
    TORCH_CHECK(k_pool.sizes() == v_pool.sizes(), "int8 k_pool and v_pool shapes differ");
    for (const auto& [scales, name] : {std::pair{&*k_scales, "k_scales"}, std::pair{&*v_scales, "v_scales"}}) {
      TORCH_CHECK(scales->device().is_cpu() && scales->scalar_type() == at::kFloat && scales->is_contiguous() &&
                      scales->sizes() == v_pool.sizes().slice(0, 3),
                  name, " must be a contiguous float32 CPU tensor [num_blocks, block_size, num_kv_heads] = ",
                  v_pool.sizes().slice(0, 3), ", got ", scales->scalar_type(), " ", scales->sizes());
    }
    return shape;
  }
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

template <typename T>
T* ptr(at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}
template <typename T>
const T* optional_ptr(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? static_cast<const T*>(t->data_ptr()) : nullptr;
}

void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor block_tables,
                     at::Tensor cu_seqlens_q, at::Tensor positions, double scale, int64_t sliding_window,
                     double softcap, const OptionalTensor& k_scales, const OptionalTensor& v_scales) {
  const int64_t q_stride = rows_stride(q, "q");
  const PoolShape pools = pool_shape(k_pool, v_pool, q, k_scales, v_scales);
  check_like(out, q, "out", "q");
  AttentionBatch batch = attention_batch(q.size(0), q.size(1), q.size(2), pools, block_tables, cu_seqlens_q,
                                         positions, scale, sliding_window, softcap);
  rill_cpu::PagedAttentionArgs& args = batch.args;
  args.out = out.data_ptr();
  args.q = q.data_ptr();
  args.q_token_stride = q_stride;
  args.k_pool = k_pool.data_ptr();
  args.v_pool = v_pool.data_ptr();
  args.k_scales = optional_ptr<float>(k_scales);
  args.v_scales = optional_ptr<float>(v_scales);
  dispatch_float(q, [&](auto zero) { rill_cpu::paged_attention<decltype(zero)>(args); });
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

void store_kv(at::Tensor k, at::Tensor v, at::Tensor k_pool, at::Tensor v_pool, at::Tensor slot_mapping,
              const OptionalTensor& k_scales, const OptionalTensor& v_scales) {
  const int64_t k_stride = rows_stride(k, "k");
  const int64_t v_stride = rows_stride(v, "v");
  const PoolShape pools = pool_shape(k_pool, v_pool, k, k_scales, v_scales);
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v.sizes() == k.sizes(), "k and v must match");
  TORCH_CHECK(k.size(1) == pools.num_kv_heads && k.size(2) == pools.head_dim, "k rows do not match the pool");
  const at::Tensor slots = checked_slots(slot_mapping, k.size(0), pools.num_blocks * pools.block_size);
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  dispatch_float(k, [&](auto zero) {
    using T = decltype(zero);
    if (pools.is_int8) {
      rill_cpu::store_kv_int8(ptr<const T>(k), k_stride, ptr<const T>(v), v_stride, ptr<int8_t>(k_pool),
                              ptr<int8_t>(v_pool), k_scales->data_ptr<float>(), v_scales->data_ptr<float>(), slot_ptr,
                              k.size(0), pools.num_kv_heads, pools.head_dim, num_threads());
      return;
    }
    rill_cpu::store_kv(ptr<const T>(k), k_stride, ptr<const T>(v), v_stride, ptr<T>(k_pool), ptr<T>(v_pool),
                       slot_ptr, k.size(0), pools.num_kv_heads, pools.head_dim, pools.block_size, pools.paired_k,
                       num_threads());
  });
}

void fused_add_rms_norm(at::Tensor out, at::Tensor residual_out, at::Tensor x, c10::optional<at::Tensor> residual,
                        at::Tensor weight, double eps) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [num_rows, hidden]");
  check_like(out, x, "out", "x");
  check_cpu(weight, "weight");
  check_same_dtype(weight, x, "weight");
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1),
              "weight must be a contiguous [hidden]");
  if (residual.has_value()) {
    check_cpu(*residual, "residual");
    check_same_dtype(*residual, x, "residual");
    check_like(*residual, x, "residual", "x");
    check_like(residual_out, x, "residual_out", "x");
  }
  dispatch_float(x, [&](auto zero) {
    using T = decltype(zero);
    rill_cpu::fused_add_rms_norm(ptr<T>(out), ptr<T>(residual_out), ptr<const T>(x), optional_ptr<T>(residual),
                                 ptr<const T>(weight), x.size(0), x.size(1), static_cast<float>(eps), num_threads());
  });
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
  dispatch_float(q, [&](auto zero) {
    using T = decltype(zero);
    rill_cpu::rotary_embedding(ptr<T>(q), q_stride, q.size(1), ptr<T>(k), k_stride, k.size(1), ptr<const T>(cos),
                               ptr<const T>(sin), q.size(0), q.size(2), num_threads());
  });
}

void silu_and_mul(at::Tensor out, at::Tensor x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "x must be a contiguous [num_tokens, 2 * I]");
  const int64_t intermediate = x.size(1) / 2;
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == intermediate &&
                  out.scalar_type() == x.scalar_type(),
              "out must be a contiguous [num_tokens, I] of x's dtype");
  dispatch_float(x, [&](auto zero) {
    using T = decltype(zero);
    rill_cpu::silu_and_mul(ptr<T>(out), ptr<const T>(x), x.size(0), intermediate, num_threads());
  });
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

// A quantized matrix (ops.h, "Quantized matrices"): its header, checked against the buffer it sits in.
rill_cpu::QuantHeader quant_header(const at::Tensor& packed, const char* what) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 1 &&
                  packed.is_contiguous() && packed.numel() >= static_cast<int64_t>(sizeof(rill_cpu::QuantHeader)),
              what, " must be a quantized matrix (a contiguous uint8 buffer from pack_quantized)");
  rill_cpu::QuantHeader header;
  std::memcpy(&header, packed.const_data_ptr(), sizeof header);
  TORCH_CHECK(header.magic == rill_cpu::kQuantMagic, what, " is not a quantized matrix (bad magic)");
  TORCH_CHECK(header.num_parts >= 1 && header.num_parts <= rill_cpu::kMaxQuantParts, what, " has ",
              header.num_parts, " parts");
  TORCH_CHECK(header.activations >= rill_cpu::kActFloat32 && header.activations <= rill_cpu::kActInt16, what,
              " is malformed");
  int64_t rows = 0;
  for (int64_t p = 0; p < header.num_parts; ++p) {
    const rill_cpu::QuantPart& part = header.parts[p];
    const int64_t elems = rill_cpu::quant_block_elems(part.qtype);
    TORCH_CHECK(elems != 0 && header.k % elems == 0 && part.rows >= 0 && part.offset >= 0 &&
                    part.offset + rill_cpu::quant_stored_rows(part.qtype, header.activations, part.rows) *
                                          (header.k / elems) * rill_cpu::quant_block_bytes(part.qtype) <=
                        packed.numel(),
                what, ": part ", p, " is malformed");
    rows += part.rows;
  }
  TORCH_CHECK(rows == header.n, what, ": its parts hold ", rows, " rows, the header says ", header.n);
  return header;
}

void check_packed(const at::Tensor& packed, at::ScalarType dtype, int64_t n, int64_t k, const char* what) {
  if (packed.scalar_type() == at::kByte) {
    TORCH_CHECK(dtype == at::kFloat, what, " is a quantized matrix, which multiplies float32 activations only");
    const rill_cpu::QuantHeader header = quant_header(packed, what);
    TORCH_CHECK(header.n == n && header.k == k, what, " must be a quantized matrix of N = ", n, " and K = ", k,
                ", got ", header.n, " x ", header.k);
    return;
  }
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == dtype && packed.is_contiguous() &&
                  packed.sizes() == at::IntArrayRef(packed_shape(dtype, n, k)),
              what, " must be a ", dtype, " weight packed by pack_linear for K = ", k, " and N = ", n, ", got ",
              packed.scalar_type(), " ", packed.sizes());
}

// The bytes of a quantized matrix of these parts (types and row counts) for K inputs: the header, then each
// part 64-byte aligned. Also fills the header's parts when given one.
int64_t quant_layout(const std::vector<int64_t>& qtypes, const std::vector<int64_t>& rows, int64_t k,
                     rill_cpu::QuantHeader* header, int64_t activations) {
  TORCH_CHECK(!qtypes.empty() && qtypes.size() == rows.size() &&
                  qtypes.size() <= static_cast<size_t>(rill_cpu::kMaxQuantParts),
              "a quantized matrix has 1 to ", rill_cpu::kMaxQuantParts, " parts, each a type and a row count");
  TORCH_CHECK(activations >= rill_cpu::kActFloat32 && activations <= rill_cpu::kActInt16,
              "activations must be 0 (float32), 1 (int8) or 2 (int16), got ", activations);
  int64_t offset = 64 * ((static_cast<int64_t>(sizeof(rill_cpu::QuantHeader)) + 63) / 64), n = 0;
  for (size_t p = 0; p < qtypes.size(); ++p) {
    const int64_t elems = rill_cpu::quant_block_elems(qtypes[p]);
    TORCH_CHECK(elems != 0, "quantized type ", qtypes[p], " is not one these kernels multiply");
    TORCH_CHECK(k > 0 && k % elems == 0, "K = ", k, " is not a multiple of the type's block of ", elems);
    TORCH_CHECK(rows[p] >= 0, "a part's row count must be >= 0");
    if (header != nullptr) header->parts[p] = {qtypes[p], rows[p], offset};
    const int64_t stored = rill_cpu::quant_stored_rows(qtypes[p], activations, rows[p]);
    offset += 64 * ((stored * (k / elems) * rill_cpu::quant_block_bytes(qtypes[p]) + 63) / 64);
    n += rows[p];
  }
  if (header != nullptr) {
    header->magic = rill_cpu::kQuantMagic;
    header->n = n;
    header->k = k;
    header->num_parts = static_cast<int64_t>(qtypes.size());
    header->activations = activations;
  }
  return offset;
}

int64_t quant_packed_bytes(const std::vector<int64_t>& qtypes, const std::vector<int64_t>& rows, int64_t k,
                           int64_t activations) {
  return quant_layout(qtypes, rows, k, nullptr, activations);
}

// Writes the quantized matrix of `parts` ((ggml type, uint8 [rows, row bytes]) each, in row order) into `out`,
// to be multiplied with `activations` (ops.h, QuantActivations).
void pack_quantized(at::Tensor out, const std::vector<std::tuple<int64_t, at::Tensor>>& parts, int64_t k,
                    int64_t activations) {
  std::vector<int64_t> qtypes, rows;
  for (const auto& [qtype, data] : parts) {
    qtypes.push_back(qtype);
    rows.push_back(data.dim() == 2 ? data.size(0) : -1);
  }
  rill_cpu::QuantHeader header{};
  const int64_t bytes = quant_layout(qtypes, rows, k, &header, activations);
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kByte && out.dim() == 1 && out.is_contiguous() &&
                  out.numel() == bytes,
              "out must be a contiguous uint8 buffer of ", bytes, " bytes");
  uint8_t* base = out.data_ptr<uint8_t>();
  std::memset(base, 0, bytes);
  std::memcpy(base, &header, sizeof header);
  for (size_t p = 0; p < parts.size(); ++p) {
    const at::Tensor& data = std::get<1>(parts[p]);
    const int64_t row_bytes = k / rill_cpu::quant_block_elems(qtypes[p]) * rill_cpu::quant_block_bytes(qtypes[p]);
    TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.size(1) == row_bytes,
                "part ", p, " must be a uint8 [rows, ", row_bytes, "] tensor of its type's blocks");
    const at::Tensor contiguous = data.contiguous();
    const auto* from = contiguous.const_data_ptr<uint8_t>();
    uint8_t* to = base + header.parts[p].offset;
    if (!rill_cpu::quant_interleaved(qtypes[p], activations)) {
      std::memcpy(to, from, rows[p] * row_bytes);
      continue;
    }
    at::parallel_for(0, rows[p], 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        rill_cpu::copy_interleaved_row(qtypes[p], row_bytes, r, from + r * row_bytes, to, false);
      }
    });
  }
}

// The rows of part `p` of a quantized matrix as the file holds them, uint8 [rows, row bytes].
at::Tensor quant_file_rows(const at::Tensor& packed, int64_t p) {
  const rill_cpu::QuantHeader header = quant_header(packed, "packed");
  TORCH_CHECK(p >= 0 && p < header.num_parts, "part ", p, " is outside [0, ", header.num_parts, ")");
  const rill_cpu::QuantPart& part = header.parts[p];
  const int64_t row_bytes = header.k / rill_cpu::quant_block_elems(part.qtype) *
                            rill_cpu::quant_block_bytes(part.qtype);
  auto out = at::empty({part.rows, row_bytes}, at::TensorOptions().dtype(at::kByte));
  const uint8_t* from = packed.const_data_ptr<uint8_t>() + part.offset;
  uint8_t* to = out.data_ptr<uint8_t>();
  if (!rill_cpu::quant_interleaved(part.qtype, header.activations)) {
    std::memcpy(to, from, part.rows * row_bytes);
    return out;
  }
  for (int64_t r = 0; r < part.rows; ++r) {
    rill_cpu::copy_interleaved_row(part.qtype, row_bytes, r, from, to + r * row_bytes, true);
  }
  return out;
}

std::tuple<int64_t, int64_t> quant_shape(const at::Tensor& packed) {
  const rill_cpu::QuantHeader header = quant_header(packed, "packed");
  return {header.n, header.k};
}

// Each part of a quantized matrix: (ggml type, rows); quant_file_rows gives its bytes.
std::vector<std::tuple<int64_t, int64_t>> quant_parts(const at::Tensor& packed) {
  const rill_cpu::QuantHeader header = quant_header(packed, "packed");
  std::vector<std::tuple<int64_t, int64_t>> parts;
  for (int64_t p = 0; p < header.num_parts; ++p) parts.emplace_back(header.parts[p].qtype, header.parts[p].rows);
  return parts;
}

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& packed, bool portable) {
  const rill_cpu::QuantHeader header = quant_header(packed, "the weight");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == header.k,
              "x must be a float32 CPU tensor [M, ", header.k, "], got ", x.scalar_type(), " ", x.sizes());
  const at::Tensor xc = x.contiguous();
  auto y = at::empty({xc.size(0), header.n}, xc.options());
  if (xc.size(0) == 0 || header.n == 0) return y;
  rill_cpu::quantized_linear(xc.const_data_ptr<float>(), packed.const_data_ptr<uint8_t>(), y.data_ptr<float>(),
                             xc.size(0), header.k, header.n, num_threads(), portable);
  return y;
}

at::Tensor dequantize_rows(const at::Tensor& packed, const at::Tensor& ids) {
  const rill_cpu::QuantHeader header = quant_header(packed, "packed");
  TORCH_CHECK(ids.device().is_cpu() && ids.dim() == 1, "ids must be a CPU vector");
  const at::Tensor rows = ids.to(at::kLong).contiguous();
  const int64_t* row_ptr = rows.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(row_ptr[i] >= 0 && row_ptr[i] < header.n, "ids[", i, "] = ", row_ptr[i], " is outside [0, ",
                header.n, ")");
  }
  auto out = at::empty({rows.numel(), header.k}, at::TensorOptions().dtype(at::kFloat));
  rill_cpu::dequantize_rows(packed.const_data_ptr<uint8_t>(), row_ptr, rows.numel(), header.k,
                            out.data_ptr<float>(), num_threads());
  return out;
}

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
  if (packed.scalar_type() == at::kByte) {
    TORCH_CHECK(std::get<0>(quant_shape(packed)) == n, "linear's weight does not have ", n, " rows");
    return quantized_linear(x, packed, false);
  }
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

// One projection's LoRA stacks (lora_add, ops.h): contiguous CPU lora_a [S, num_parts * R, in] and lora_b
// [S, out, R] of `dtype`. Returns R.
int64_t check_lora(const at::Tensor& a, const at::Tensor& b, at::ScalarType dtype, int64_t in, int64_t out,
                   int64_t num_parts, const char* what) {
  for (const auto& [t, name] : {std::pair{&a, "lora_a"}, std::pair{&b, "lora_b"}}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == dtype && t->dim() == 3 && t->is_contiguous(), what,
                name, " must be a contiguous ", dtype, " CPU tensor [slots, rows, columns], got ", t->scalar_type(),
                " ", t->sizes());
  }
  const int64_t rank = b.size(2);
  TORCH_CHECK(rank >= 1 && b.size(0) == a.size(0) && b.size(1) == out, what, "lora_b must be [", a.size(0),
              " slots, ", out, " outputs, R >= 1], got ", b.sizes());
  TORCH_CHECK(a.size(1) == num_parts * rank && a.size(2) == in, what, "lora_a must be [", a.size(0), " slots, ",
              num_parts, " parts * R (", rank, "), ", in, " inputs], got ", a.sizes());
  return rank;
}

// row_slots: a contiguous CPU int32 [num_rows], each -1 (no adapter) or a slot below num_slots.
void check_lora_slots(const at::Tensor& row_slots, int64_t num_rows, int64_t num_slots) {
  TORCH_CHECK(row_slots.device().is_cpu(), "row_slots must be a CPU tensor");
  rill_binding::check_index_vector(row_slots, num_rows, at::kInt, "row_slots");
  const int32_t* slots = row_slots.const_data_ptr<int32_t>();
  for (int64_t r = 0; r < num_rows; ++r) {
    TORCH_CHECK(slots[r] >= -1 && slots[r] < num_slots, "row_slots[", r, "] = ", slots[r],
                " is neither -1 nor one of the ", num_slots, " LoRA slots");
  }
}

// y [rows, out] += each row's LoRA product (ops.h, lora_add), in place; part_ends ascending, the last = out.
void lora_add(at::Tensor y, at::Tensor x, at::Tensor lora_a, at::Tensor lora_b, const at::Tensor& row_slots,
              const std::vector<int64_t>& part_ends) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, in], got ", x.sizes());
  TORCH_CHECK(y.device().is_cpu() && y.scalar_type() == x.scalar_type() && y.dim() == 2 && y.is_contiguous() &&
                  y.size(0) == x.size(0),
              "y must be a contiguous [", x.size(0), ", out] of x's dtype ", x.scalar_type(), ", got ",
              y.scalar_type(), " ", y.sizes());
  TORCH_CHECK(!part_ends.empty() && part_ends.back() == y.size(1), "part_ends must end at y's ", y.size(1),
              " outputs");
  for (size_t p = 0; p < part_ends.size(); ++p) {
    TORCH_CHECK(part_ends[p] > (p == 0 ? 0 : part_ends[p - 1]), "part_ends must be strictly ascending from > 0");
  }
  const auto num_parts = static_cast<int64_t>(part_ends.size());
  const int64_t rank = check_lora(lora_a, lora_b, x.scalar_type(), x.size(1), y.size(1), num_parts, "");
  check_lora_slots(row_slots, x.size(0), lora_a.size(0));
  dispatch_float(x, [&](auto zero) {
    using T = decltype(zero);
    rill_cpu::lora_add(ptr<T>(y), ptr<const T>(x), ptr<const T>(lora_a), ptr<const T>(lora_b),
                       row_slots.const_data_ptr<int32_t>(), x.size(0), x.size(1), rank, part_ends.data(),
                       num_parts, num_threads());
  });
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

// One decoder layer's weights as the shard hands them over (the fields of RILL_DECODER_LAYER_WEIGHTS, ops.h;
// an optional one may be None) and its sliding window.
struct DecoderLayerWeights {
#define RILL_TENSOR_FIELD(name, is_optional) c10::optional<at::Tensor> name;
  RILL_DECODER_LAYER_WEIGHTS(RILL_TENSOR_FIELD)
#undef RILL_TENSOR_FIELD
  int64_t sliding_window = 0;
};

// A run of Llama-family decoder layers whose forward is one call (decoder.cpp). Holds the weights, checked once
// here.
class DecoderStack {
 public:
  DecoderStack(std::vector<DecoderLayerWeights> layers, int64_t intermediate_size, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, double rms_norm_eps, double scale)
      : layers_(std::move(layers)),
        intermediate_(intermediate_size),
        num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        eps_(rms_norm_eps),
        scale_(scale) {
    TORCH_CHECK(!layers_.empty(), "a decoder stack needs at least one layer");
#define RILL_CHECK_PRESENT(name, is_optional)                                                              \
  for (const auto& layer : layers_) TORCH_CHECK(is_optional || layer.name.has_value(), #name " is missing");
    RILL_DECODER_LAYER_WEIGHTS(RILL_CHECK_PRESENT)
#undef RILL_CHECK_PRESENT
    const at::Tensor& first_norm = *layers_[0].input_norm;
    check_cpu(first_norm, "input_norm");
    check_linear_dtype(first_norm, "the decoder stack's dtype");
    dtype_ = first_norm.scalar_type();
    hidden_ = first_norm.size(0);
    const int64_t q_size = num_heads * head_dim, qkv_size = q_size + 2 * num_kv_heads * head_dim;
    const auto check_vector = [&](const c10::optional<at::Tensor>& t, int64_t size, const char* what) {
      if (!t.has_value()) return;  // an absent bias (the required fields were checked above)
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == dtype_ && t->dim() == 1 && t->size(0) == size &&
                      t->is_contiguous(),
                  what, " must be a contiguous ", dtype_, " [", size, "]");
    };
    for (const auto& layer : layers_) {
      check_vector(layer.input_norm, hidden_, "input_norm");
      check_vector(layer.post_norm, hidden_, "post_norm");
      check_packed(*layer.qkv, dtype_, qkv_size, hidden_, "qkv");
      check_vector(layer.qkv_bias, qkv_size, "qkv_bias");
      check_packed(*layer.o_proj, dtype_, hidden_, q_size, "o_proj");
      check_vector(layer.o_proj_bias, hidden_, "o_proj_bias");
      check_packed(*layer.gate_up, dtype_, 2 * intermediate_size, hidden_, "gate_up");
      check_vector(layer.gate_up_bias, 2 * intermediate_size, "gate_up_bias");
      check_packed(*layer.down, dtype_, hidden_, intermediate_size, "down");
      check_vector(layer.down_bias, hidden_, "down_bias");
      TORCH_CHECK(layer.sliding_window >= 0, "sliding_window must be >= 0");
      check_lora_pair(layer.qkv_lora_a, layer.qkv_lora_b, hidden_, qkv_size, 3, "qkv_");
      check_lora_pair(layer.o_proj_lora_a, layer.o_proj_lora_b, q_size, hidden_, 1, "o_proj_");
      check_lora_pair(layer.gate_up_lora_a, layer.gate_up_lora_b, hidden_, 2 * intermediate_size, 2, "gate_up_");
      check_lora_pair(layer.down_lora_a, layer.down_lora_b, intermediate_size, hidden_, 1, "down_");
    }
  }

  // hidden [num_tokens, hidden] and residual (None: hidden is also the residual, as for the model's first layer),
  // as LlamaDecoderLayer.forward takes them; positions [num_tokens]; cos, sin [num_tokens, head_dim / 2] in the
  // stack's dtype; one K and one V pool per layer; block_tables, cu_seqlens_q and slot_mapping as for
  // paged_attention and store_kv; k_scales, v_scales: one scale pool per layer for int8 pools, else empty. Writes
  // every layer's new K/V and returns the last layer's (hidden, residual).
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& hidden, const c10::optional<at::Tensor>& residual,
                                             const at::Tensor& positions, const at::Tensor& cos,
                                             const at::Tensor& sin, const std::vector<at::Tensor>& k_pools,
                                             const std::vector<at::Tensor>& v_pools, const at::Tensor& block_tables,
                                             const at::Tensor& cu_seqlens_q, const at::Tensor& slot_mapping,
                                             const c10::optional<at::Tensor>& lora_slots,
                                             const std::vector<at::Tensor>& k_scales,
                                             const std::vector<at::Tensor>& v_scales) const {
    check_cpu(hidden, "hidden");
    TORCH_CHECK(hidden.scalar_type() == dtype_, "hidden must be ", dtype_, ", got ", hidden.scalar_type());
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == hidden_ && hidden.is_contiguous(),
                "hidden must be a contiguous [num_tokens, ", hidden_, "]");
    if (residual.has_value()) check_like(*residual, hidden, "residual", "hidden");
    const int64_t tokens = hidden.size(0);
    for (const auto* t : {&cos, &sin}) {
      check_same_dtype(*t, hidden, "cos/sin");
      TORCH_CHECK(t->is_contiguous() && t->dim() == 2 && t->size(0) == tokens && t->size(1) == head_dim_ / 2,
                  "cos and sin must be contiguous [num_tokens, head_dim / 2]");
    }
    const auto num_layers = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(static_cast<int64_t>(k_pools.size()) == num_layers &&
                    static_cast<int64_t>(v_pools.size()) == num_layers,
                "need one K and one V pool per layer (", num_layers, ")");
    const bool is_int8 = !k_scales.empty() || !v_scales.empty();
    TORCH_CHECK(!is_int8 || (static_cast<int64_t>(k_scales.size()) == num_layers &&
                             static_cast<int64_t>(v_scales.size()) == num_layers),
                "int8 pools need one K and one V scale pool per layer (", num_layers, ")");
    const auto layer_pools = [&](int64_t l) {
      return is_int8 ? pool_shape(k_pools[l], v_pools[l], hidden, k_scales[l], v_scales[l])
                     : pool_shape(k_pools[l], v_pools[l], hidden);
    };
    const PoolShape pools = layer_pools(0);
    for (int64_t l = 1; l < num_layers; ++l) {
      TORCH_CHECK(layer_pools(l) == pools, "every layer's pools must have the same shape");
    }
    AttentionBatch batch = attention_batch(tokens, num_heads_, head_dim_, pools, block_tables, cu_seqlens_q,
                                           positions, scale_, 0, 0.0);
    TORCH_CHECK(pools.num_kv_heads == num_kv_heads_, "the pools hold ", pools.num_kv_heads, " KV heads, the stack ",
                num_kv_heads_);
    const at::Tensor slots = checked_slots(slot_mapping, tokens, pools.num_blocks * pools.block_size);
    if (lora_slots.has_value()) check_lora_slots(*lora_slots, tokens, num_lora_slots_);
    const auto workspace = [&](int64_t width) { return at::empty({tokens, width}, hidden.options()); };
    const at::Tensor out = workspace(hidden_), residual_out = workspace(hidden_);
    if (tokens == 0) return {out, residual_out};
    const int64_t q_size = num_heads_ * head_dim_, qkv_size = q_size + 2 * num_kv_heads_ * head_dim_;
    const at::Tensor qkv = workspace(qkv_size), attention_out = workspace(q_size), normed = workspace(hidden_);
    const at::Tensor gate_up = workspace(2 * intermediate_), activation = workspace(intermediate_);
    std::vector<rill_cpu::DecoderLayer> layers(num_layers);
    for (int64_t l = 0; l < num_layers; ++l) {
      const DecoderLayerWeights& w = layers_[l];
      rill_cpu::DecoderLayer& layer = layers[l];
#define RILL_SET_POINTER(name, is_optional) layer.name = w.name.has_value() ? w.name->data_ptr() : nullptr;
      RILL_DECODER_LAYER_WEIGHTS(RILL_SET_POINTER)
#undef RILL_SET_POINTER
      layer.k_pool = k_pools[l].data_ptr();
      layer.v_pool = v_pools[l].data_ptr();
      layer.k_scales = is_int8 ? k_scales[l].data_ptr<float>() : nullptr;
      layer.v_scales = is_int8 ? v_scales[l].data_ptr<float>() : nullptr;
      layer.sliding_window = w.sliding_window;
      const auto rank = [](const c10::optional<at::Tensor>& b) { return b.has_value() ? b->size(2) : 0; };
      layer.qkv_lora_rank = rank(w.qkv_lora_b);
      layer.o_proj_lora_rank = rank(w.o_proj_lora_b);
      layer.gate_up_lora_rank = rank(w.gate_up_lora_b);
      layer.down_lora_rank = rank(w.down_lora_b);
      const auto quantized = [](const c10::optional<at::Tensor>& t, unsigned bit) {
        return t->scalar_type() == at::kByte ? 1u << bit : 0u;
      };
      layer.quantized = quantized(w.qkv, 0) | quantized(w.o_proj, 1) | quantized(w.gate_up, 2) | quantized(w.down, 3);
    }
    rill_cpu::DecoderStackArgs args{};
    args.layers = layers.data();
    args.num_layers = num_layers;
    args.hidden_size = hidden_;
    args.intermediate_size = intermediate_;
    args.rms_norm_eps = static_cast<float>(eps_);
    args.num_tokens = tokens;
    args.hidden = hidden.data_ptr();
    args.residual_in = residual.has_value() ? residual->data_ptr() : nullptr;
    args.cos = cos.data_ptr();
    args.sin = sin.data_ptr();
    args.slots = slots.data_ptr<int64_t>();
    args.lora_slots = lora_slots.has_value() ? lora_slots->const_data_ptr<int32_t>() : nullptr;
    args.out = out.data_ptr();
    args.residual = residual_out.data_ptr();
    args.qkv_out = qkv.data_ptr();
    args.attention_out = attention_out.data_ptr();
    args.normed = normed.data_ptr();
    args.gate_up_out = gate_up.data_ptr();
    args.activation = activation.data_ptr();
    args.attention = batch.args;
    if (dtype_ == at::kFloat) {
      rill_cpu::decoder_stack<float>(args);
    } else {
#if defined(__AVX512BF16__)
      rill_cpu::decoder_stack<bf16>(args);
#endif
    }
    return {out, residual_out};
  }

 private:
  // A projection's LoRA stacks: both or neither, shaped for it; the slots a call may name are those of every
  // stack of the run.
  void check_lora_pair(const c10::optional<at::Tensor>& a, const c10::optional<at::Tensor>& b, int64_t in,
                       int64_t out, int64_t num_parts, const char* what) {
    TORCH_CHECK(a.has_value() == b.has_value(), what, "lora_a and ", what, "lora_b must be given together");
    if (!a.has_value()) return;
    check_lora(*a, *b, dtype_, in, out, num_parts, what);
    num_lora_slots_ = std::min(num_lora_slots_, a->size(0));
  }

  std::vector<DecoderLayerWeights> layers_;
  int64_t num_lora_slots_ = std::numeric_limits<int64_t>::max();  // none without LoRA stacks: any slot is idle
  at::ScalarType dtype_ = at::kFloat;
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
  m.def("lora_add", &lora_add, release_gil);
  m.def("quant_packed_bytes", &quant_packed_bytes);
  m.def("pack_quantized", &pack_quantized, release_gil);
  m.def("quant_shape", &quant_shape);
  m.def("quant_parts", &quant_parts);
  m.def("quant_file_rows", &quant_file_rows);
  m.def("quantized_linear", &quantized_linear, py::arg("x"), py::arg("packed"), py::arg("portable") = false,
        release_gil);
  m.def("dequantize_rows", &dequantize_rows, release_gil);
  m.attr("HAS_AVX2_QUANT") = rill_cpu::has_avx2_quant();
  {
    py::class_<DecoderLayerWeights> weights(m, "DecoderLayerWeights");
    weights.def(py::init<>()).def_readwrite("sliding_window", &DecoderLayerWeights::sliding_window);
    py::list fields;
#define RILL_EXPORT_FIELD(name, is_optional)                         \
  weights.def_readwrite(#name, &DecoderLayerWeights::name);          \
  fields.append(py::make_tuple(#name, is_optional));
    RILL_DECODER_LAYER_WEIGHTS(RILL_EXPORT_FIELD)
#undef RILL_EXPORT_FIELD
    // (name, is_optional) of each weight, in declaration order: what rill/kernels/cpu.py fills.
    m.attr("DECODER_LAYER_FIELDS") = py::tuple(fields);
  }
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<std::vector<DecoderLayerWeights>, int64_t, int64_t, int64_t, int64_t, double, double>(),
           py::arg("layers"), py::arg("intermediate_size"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("rms_norm_eps"), py::arg("scale"))
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
