// Paged attention on the CPU: one call for a whole batch of decode rows and prefill chunks.
//
// Work items are (sequence, tile of up to kRowsPerItem / group queries, KV head): all query heads of a KV head
// are computed together, so each K/V row is read from memory once per item, and items run in parallel.
//
// Batch invariance (the output for one query does not depend on the rest of the call, nor on the thread
// count): a query at position p walks the keys it sees, [lo, p] (lo = 0, or p - sliding_window + 1), in fixed
// tiles [n * kKeyTile, (n + 1) * kKeyTile) counted from position 0, skipping tiles it has no key in, with an
// online softmax in float32 (running max, running sum, rescaled accumulator). Each step's arithmetic order is
// fixed by the query's own position: dot products over head_dim in 16-lane chunks reduced by a fixed tree;
// the tile max and exp lane-wise; the tile sum in lanes by key position then the tree; the accumulator
// lane-wise in key order. Nothing is shared between rows, and one row is never split across threads.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"

namespace rill_cpu {
namespace {

constexpr int64_t kKeyTile = 64;     // keys per online-softmax step
constexpr int64_t kRowsPerItem = 32;  // (query, head) rows per work item, at least one query
constexpr int kMaxPiece = 8;         // accumulator chunks held in registers at once (128 dims)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct WorkItem {
  int64_t seq;
  int64_t query_begin;
  int64_t query_end;
  int64_t kv_head;
};

// Per-thread buffers, sized once per call.
template <typename T>
struct Scratch {
  Scratch(int64_t max_rows, int64_t head_dim)
      : q(max_rows * head_dim), acc(max_rows * head_dim), scores(kKeyTile), row_max(max_rows),
        row_sum(max_rows), lo(max_rows), hi(max_rows), q_raw(max_rows), k_rows(kKeyTile), v_rows(kKeyTile) {}
  std::vector<float> q;  // scaled queries, float32
  std::vector<float> acc;
  std::vector<float> scores;  // one row's scores, then probabilities, for the current tile
  std::vector<float> row_max, row_sum;
  std::vector<int64_t> lo, hi;  // the keys row r sees: [lo, hi)
  std::vector<const T*> q_raw;
  std::vector<const T*> k_rows, v_rows;  // the current tile's K/V rows for this item's KV head
};

template <typename T>
inline float dot(const float* q, const T* k, int64_t num_chunks) {
  Vec16 sum = zeros();
  for (int64_t c = 0; c < num_chunks; ++c) sum = fmadd(load(q + c * kLanes), load(k + c * kLanes), sum);
  return reduce_add(sum);
}

// q . k * scale for one query row and key; bfloat16 uses AVX512-BF16 pairs of products when available.
template <typename T>
inline float score(const float* q_scaled, const T* /*q_raw*/, const T* k, int64_t num_chunks, float /*scale*/) {
  return dot(q_scaled, k, num_chunks);
}

#if defined(__AVX512BF16__)
template <>
inline float score<bf16>(const float*, const bf16* q_raw, const bf16* k, int64_t num_chunks, float scale) {
  __m512 sum = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 2 <= num_chunks; c += 2) {
    const __m512i qv = _mm512_loadu_si512(q_raw + c * kLanes);
    const __m512i kv = _mm512_loadu_si512(k + c * kLanes);
    sum = _mm512_dpbf16_ps(sum, (__m512bh)qv, (__m512bh)kv);
  }
  if (c < num_chunks) {  // one chunk of 16 left: the upper pairs load as zeros
    const __m512i qv = _mm512_maskz_loadu_epi16(0xffff, q_raw + c * kLanes);
    const __m512i kv = _mm512_maskz_loadu_epi16(0xffff, k + c * kLanes);
    sum = _mm512_dpbf16_ps(sum, (__m512bh)qv, (__m512bh)kv);
  }
  return reduce_add({sum}) * scale;
}
#endif

// acc[c0 * 16 .. (c0 + PIECE) * 16) = acc * rescale + sum over keys j in [begin, end), in order, of p[j] * v_j.
template <int PIECE, typename T>
inline void accumulate_piece(float* acc, float rescale, const float* p, const T* const* v_rows, int64_t begin,
                             int64_t end, int64_t c0) {
  Vec16 r[PIECE];
  const Vec16 factor = broadcast(rescale);
  for (int c = 0; c < PIECE; ++c) r[c] = mul(load(acc + (c0 + c) * kLanes), factor);
  for (int64_t j = begin; j < end; ++j) {
    const Vec16 pj = broadcast(p[j]);
    const T* v = v_rows[j] + c0 * kLanes;
    for (int c = 0; c < PIECE; ++c) r[c] = fmadd(pj, load(v + c * kLanes), r[c]);
  }
  for (int c = 0; c < PIECE; ++c) store(acc + (c0 + c) * kLanes, r[c]);
}

template <typename T>
void accumulate(float* acc, float rescale, const float* p, const T* const* v_rows, int64_t begin, int64_t end,
                int64_t num_chunks) {
  int64_t c0 = 0;
  for (; c0 + kMaxPiece <= num_chunks; c0 += kMaxPiece)
    accumulate_piece<kMaxPiece>(acc, rescale, p, v_rows, begin, end, c0);
  switch (num_chunks - c0) {
    case 0: break;
    case 1: accumulate_piece<1>(acc, rescale, p, v_rows, begin, end, c0); break;
    case 2: accumulate_piece<2>(acc, rescale, p, v_rows, begin, end, c0); break;
    case 3: accumulate_piece<3>(acc, rescale, p, v_rows, begin, end, c0); break;
    case 4: accumulate_piece<4>(acc, rescale, p, v_rows, begin, end, c0); break;
    case 5: accumulate_piece<5>(acc, rescale, p, v_rows, begin, end, c0); break;
    case 6: accumulate_piece<6>(acc, rescale, p, v_rows, begin, end, c0); break;
    default: accumulate_piece<7>(acc, rescale, p, v_rows, begin, end, c0); break;
  }
}

// One online-softmax step of row r over the tile's keys [begin, end) (tile-relative, non-empty).
template <typename T>
void attend_tile(const PagedAttentionArgs& a, Scratch<T>& s, int64_t r, int64_t begin, int64_t end) {
  const int64_t head_dim = a.head_dim;
  const int64_t num_chunks = head_dim / kLanes;
  const float* q = s.q.data() + r * head_dim;
  float* scores = s.scores.data();
  for (int64_t j = begin; j < end; ++j) {
    float x = score(q, s.q_raw[r], s.k_rows[j], num_chunks, a.scale);
    if (a.softcap > 0.0f) x = std::tanh(x / a.softcap) * a.softcap;
    scores[j] = x;
  }
  // Lanes are key positions within the tile; chunks cover [begin, end) and lanes outside it are masked.
  const int64_t first_chunk = begin / kLanes * kLanes;
  Vec16 tile_max = broadcast(kNegInf);
  for (int64_t c0 = first_chunk; c0 < end; c0 += kLanes) {
    const Mask valid = lane_range(static_cast<int>(begin - c0), static_cast<int>(end - c0));
    tile_max = max(tile_max, select(valid, load(scores + c0), broadcast(kNegInf)));
  }
  const float new_max = std::max(s.row_max[r], reduce_max(tile_max));
  const float rescale = std::exp(s.row_max[r] - new_max);  // 0 on the row's first tile (max was -inf)
  const Vec16 shift = broadcast(new_max);
  Vec16 tile_sum = zeros();
  for (int64_t c0 = first_chunk; c0 < end; c0 += kLanes) {
    const Mask valid = lane_range(static_cast<int>(begin - c0), static_cast<int>(end - c0));
    const Vec16 p = select(valid, exp(sub(load(scores + c0), shift)), zeros());
    store(scores + c0, p);
    tile_sum = add(tile_sum, p);
  }
  s.row_sum[r] = s.row_sum[r] * rescale + reduce_add(tile_sum);
  accumulate(s.acc.data() + r * head_dim, rescale, scores, s.v_rows.data(), begin, end, num_chunks);
  s.row_max[r] = new_max;
}

template <typename T>
void attend_item(const PagedAttentionArgs& a, const WorkItem& item, Scratch<T>& s) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t head_dim = a.head_dim;
  const int64_t num_rows = (item.query_end - item.query_begin) * group;
  const T* q_base = static_cast<const T*>(a.q);
  int64_t item_lo = std::numeric_limits<int64_t>::max();
  int64_t item_hi = 0;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t token = item.query_begin + r / group;
    const int64_t head = item.kv_head * group + r % group;
    const int64_t position = a.positions[token];
    s.lo[r] = a.sliding_window > 0 ? std::max<int64_t>(0, position - a.sliding_window + 1) : 0;
    s.hi[r] = position + 1;
    item_lo = std::min(item_lo, s.lo[r]);
    item_hi = std::max(item_hi, s.hi[r]);
    const T* q = q_base + token * a.q_token_stride + head * head_dim;
    s.q_raw[r] = q;
    for (int64_t d = 0; d < head_dim; ++d) s.q[r * head_dim + d] = to_float(q[d]) * a.scale;
    std::fill_n(s.acc.data() + r * head_dim, head_dim, 0.0f);
    s.row_max[r] = kNegInf;
    s.row_sum[r] = 0.0f;
  }
  const int64_t* table = a.block_tables + item.seq * a.block_table_stride;
  const T* k_pool = static_cast<const T*>(a.k_pool);
  const T* v_pool = static_cast<const T*>(a.v_pool);
  for (int64_t tile_start = item_lo / kKeyTile * kKeyTile; tile_start < item_hi; tile_start += kKeyTile) {
    const int64_t tile_end = std::min(tile_start + kKeyTile, item_hi);
    for (int64_t key = std::max(tile_start, item_lo); key < tile_end; ++key) {
      const int64_t slot = table[key / a.block_size] * a.block_size + key % a.block_size;
      const int64_t offset = (slot * a.num_kv_heads + item.kv_head) * head_dim;
      s.k_rows[key - tile_start] = k_pool + offset;
      s.v_rows[key - tile_start] = v_pool + offset;
    }
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t begin = std::max(s.lo[r], tile_start) - tile_start;
      const int64_t end = std::min(s.hi[r], tile_end) - tile_start;
      if (begin < end) attend_tile(a, s, r, begin, end);
    }
  }
  T* out = static_cast<T*>(a.out);
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t token = item.query_begin + r / group;
    const int64_t head = item.kv_head * group + r % group;
    T* row = out + (token * a.num_heads + head) * head_dim;
    const float* acc = s.acc.data() + r * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) row[d] = from_float<T>(acc[d] / s.row_sum[r]);
  }
}

}  // namespace

template <typename T>
void paged_attention(const PagedAttentionArgs& a) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t queries_per_item = std::max<int64_t>(1, kRowsPerItem / group);
  std::vector<WorkItem> items;
  for (int64_t seq = 0; seq < a.num_seqs; ++seq) {
    for (int64_t begin = a.cu_seqlens_q[seq]; begin < a.cu_seqlens_q[seq + 1]; begin += queries_per_item) {
      const int64_t end = std::min(begin + queries_per_item, a.cu_seqlens_q[seq + 1]);
      for (int64_t kv_head = 0; kv_head < a.num_kv_heads; ++kv_head) items.push_back({seq, begin, end, kv_head});
    }
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t max_rows = queries_per_item * group;
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(a.num_threads, num_items)))
  {
    Scratch<T> scratch(max_rows, a.head_dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) attend_item(a, items[i], scratch);
  }
}

template void paged_attention<float>(const PagedAttentionArgs&);
template void paged_attention<bf16>(const PagedAttentionArgs&);

}  // namespace rill_cpu
