// Paged attention on the CPU: one call for a whole batch of decode rows and prefill chunks.
//
// Work items are (sequence, tile of up to kRowsPerItem / group queries, run of KV heads): all query heads of a
// KV head are computed together, so each K/V row is read from memory once per item, and items run in parallel.
// A prefill chunk's items take one KV head each; a decode row's item takes all KV heads when there are enough
// decode rows to keep the threads busy, so it streams each slot's K/V (all heads, contiguous) in order. K/V are
// read in place through the block table.
//
// Splits: a query's keys are walked in splits of kSplit keys, [n * kSplit, (n + 1) * kSplit), each under an online
// softmax of its own; the splits' states are then merged in split order (merge_split). An item either walks all
// its queries' splits, merging as it goes, or, while the decode rows are too few to keep the threads busy, takes
// one split of one decode row, its state merged after all items ran, by the same function. So a batch-1 decode
// step's attention spreads over the threads (3 KV heads made 3 items for 2 threads) at no change in any bit.
//
// Batch invariance (the output for one query does not depend on the rest of the call, nor on the thread
// count): a query at position p walks the keys it sees, [lo, p] (lo = 0, or p - sliding_window + 1), in fixed
// tiles [n * kKeyTile, (n + 1) * kKeyTile) counted from position 0, skipping tiles it has no key in, with an
// online softmax in float32 (running max, running sum, rescaled accumulator) per split, the splits merged in
// order. Every step's arithmetic is fixed by the query's own position and keys:
// - score of key j: 16-lane partial products over head_dim chunks in order, then a fixed reduction tree chosen
//   by j % 16 (reduce16); keys the query does not see enter as zeros in their own lanes only. With K in pairs
//   (ops.h, kPairedK) a lane holds one key instead, and sums its pairs of dims times the query's in order (one
//   AVX512-BF16 step each), with no tree; lanes of keys the query does not see are masked out after;
// - tile max and exp lane-wise; tile sum in lanes by key position, then the fixed tree;
// - accumulator lane-wise: rescaled, then one multiply-add per visible key in key order (bfloat16 with
//   AVX512-BF16: one pair step per pair of keys (2m, 2m + 1), a key the query does not see entering as zeros).
// Rows share loads (several rows per pass over the V rows) but never arithmetic, and a row is divided among
// threads only at its fixed splits.
//
// int8 pools (k_scales set; rill/shard/kv_cache.py): the pools hold int8 rows, each (slot, KV head) with a
// float32 scale, dequantized on the fly: key j's score is its lane's sum of q_i * k_i (the int8 values exactly in
// float32, the order above) times scale_j, and V row j enters the accumulator as (p_j * scale_j) * v_i. Both
// factors are the key's own, so batch invariance holds as above. No pairs: the bfloat16 pair steps are for
// bfloat16 pools only.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops.h"

namespace rill_cpu {
namespace {

constexpr int64_t kKeyTile = 64;      // keys per online-softmax step; a multiple of 16
constexpr int64_t kRowsPerItem = 32;  // (query, head) rows per work item, at least one query
constexpr int64_t kDecodeRowsPerThread = 4;  // decode rows per thread from which an item takes all KV heads
constexpr int64_t kSplit = 256;       // keys per split (a multiple of kKeyTile): see "Splits" above
// Accumulator chunks of one row held in registers at once. A chunk takes one of AVX-512's 32 registers but two of
// AVX2's 16: there a pass holds one row of 64 dims (accumulate), its V loads folded into the multiply-adds.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int kMaxPiece = 4;
#else
constexpr int kMaxPiece = 8;
#endif
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// bfloat16 uses AVX512-BF16 (pairs of bfloat16 products summed into float32 lanes) where the CPU has it: for the
// scores, and for the accumulate with the probabilities rounded to bfloat16.
template <typename T>
constexpr bool kPairedBf16 = kPairedK && std::is_same_v<T, bf16>;

// Loads the byte at p and drops it: brings its cache line in.
inline void touch(const char* p) { asm volatile("" : : "r"(*reinterpret_cast<const volatile char*>(p))); }

// Contiguous bytes of K or V rows.
struct Span {
  const char* begin;
  int64_t bytes;
};

struct WorkItem {
  int64_t seq;
  int64_t query_begin;
  int64_t query_end;
  int64_t kv_head;      // the first KV head
  int64_t num_kv_heads;  // KV heads [kv_head, kv_head + num_kv_heads)
  int64_t key_begin;    // the keys of the item's splits: [key_begin, key_end), split-aligned
  int64_t key_end;
  // >= 0: the item is one split of a decode row, whose state goes to SplitStates at index state + head * max_splits
  // + split (merged after all items ran); -1: the item merges its splits itself and writes out
  int64_t state;
};

// The online-softmax state of one (query, head) row over one split: running max, sum, and the accumulator
// (head_dim floats).
struct SplitStates {
  int64_t max_splits = 0;  // states per (query, head) row
  std::vector<float> max, sum, acc;
};

// Folds a split's state (max2, sum2, acc2) into the running one (max, sum, acc): both rescaled to the larger
// max. One function for both merge paths (in an item, after the items), so they round alike.
inline void merge_split(float& max, float& sum, float* acc, float max2, float sum2, const float* acc2,
                        int64_t head_dim) {
  const float m = std::max(max, max2);
  const float a = std::exp(max - m), b = std::exp(max2 - m);
  sum = std::fma(sum2, b, sum * a);
  const Vec16 va = broadcast(a), vb = broadcast(b);
  for (int64_t d = 0; d < head_dim; d += kLanes) store(acc + d, fmadd(load(acc2 + d), vb, mul(load(acc + d), va)));
  max = m;
}

// A row's output: its merged accumulator over its merged sum.
template <typename T>
inline void write_row(T* row, const float* acc, float sum, int64_t head_dim) {
  for (int64_t d = 0; d < head_dim; ++d) row[d] = from_float<T>(acc[d] / sum);
}

// Per-thread buffers, sized once per call. T: q and out; P: the pools' elements (T, or int8_t with scale pools).
template <typename T, typename P>
struct Scratch {
  Scratch(int64_t max_rows, int64_t max_kv_heads, int64_t head_dim)
      : q(max_rows * head_dim), acc(max_rows * head_dim), probs(max_rows * kKeyTile), row_max(max_rows),
        row_sum(max_rows), rescale(max_rows), lo(max_rows), hi(max_rows), begin(max_rows), end(max_rows),
        active(max_rows), q_raw(max_rows), kv_offset(max_rows), merged_acc(max_rows * head_dim),
        merged_max(max_rows), merged_sum(max_rows), merged(max_rows), zero_row(head_dim), k_rows(kKeyTile),
        v_rows(kKeyTile), k_groups(max_kv_heads * (kKeyTile / kLanes)),
        k_scale_rows(kKeyTile), v_scale_rows(kKeyTile), probs_bf16(kPairedBf16<P> ? max_rows * kKeyTile : 0) {}
  std::vector<float> q;      // scaled queries, float32, [rows, head_dim]
  std::vector<float> acc;    // [rows, head_dim]
  std::vector<float> probs;  // this tile's scores, then probabilities, [rows, kKeyTile]
  std::vector<float> row_max, row_sum, rescale;
  std::vector<int64_t> lo, hi;      // the keys row r sees: positions [lo, hi)
  std::vector<int64_t> begin, end;  // ... and within the current tile (tile-relative)
  std::vector<int64_t> active;      // rows that see a key of the current tile
  std::vector<const T*> q_raw;
  std::vector<int64_t> kv_offset;  // row r's K/V within a slot's row of the item's first KV head
  // the row's splits so far, merged (items that merge their own splits)
  std::vector<float> merged_acc, merged_max, merged_sum;
  std::vector<char> merged;  // ... whether it has one yet
  std::vector<P> zero_row;  // stands in for keys a row does not see
  std::vector<const P*> k_rows, v_rows;  // the current tile's K (in rows) / V rows, at the item's first KV head
  // K in pairs: the current tile's groups of 16 keys in the pool, [KV head of the item][group]: row p of a
  // group (block_size 32-bit pairs apart) holds pair p of each key
  std::vector<const uint32_t*> k_groups;
  // int8 pools: the current tile's keys' K / V scales, at the item's first KV head
  std::vector<const float*> k_scale_rows, v_scale_rows;
  std::vector<bf16> probs_bf16;  // paired bfloat16 only: probs rounded to bfloat16, [rows, kKeyTile]
  std::vector<Span> next_spans;  // the next tile's K/V bytes to prefetch (decode items)
  size_t next_span = 0;          // the first span not yet prefetched in full
  int64_t next_byte = 0;         // ... and how far into it
  int64_t prefetch_per_group = 0;  // cache lines to prefetch per group of 16 scores
  int64_t prefetch_per_key = 0;    // ... and per key step of the accumulate
};

// Prefetches the next n cache lines of the next tile into L2.
template <typename T, typename P>
inline void prefetch_next(Scratch<T, P>& s, int64_t n) {
  for (; n > 0 && s.next_span < s.next_spans.size(); ++s.next_span, s.next_byte = 0) {
    const Span& span = s.next_spans[s.next_span];
    const int64_t stop = std::min(span.bytes, s.next_byte + n * 64);
    for (int64_t byte = s.next_byte; byte < stop; byte += 64) __builtin_prefetch(span.begin + byte, 0, 2);
    n -= (stop - s.next_byte + 63) / 64;
    if (stop < span.bytes) {
      s.next_byte = stop;
      return;
    }
  }
}

// Cache lines of the next tile not yet prefetched.
template <typename T, typename P>
inline int64_t lines_left(const Scratch<T, P>& s) {
  int64_t lines = -s.next_byte / 64;
  for (size_t i = s.next_span; i < s.next_spans.size(); ++i) lines += (s.next_spans[i].bytes + 63) / 64;
  return lines;
}

// Scores (scaled) of one row for the 16 keys k[0..15] of a group: lane i = q . k[i] (int8 keys: before their
// scales).
template <typename T, typename P>
inline Vec16 group_scores(const float* q_scaled, const T* q_raw, const P* const* k, int64_t head_dim,
                          float scale) {
  Vec16 acc[kLanes];
  for (int i = 0; i < kLanes; ++i) acc[i] = zeros();
  if constexpr (kPairedBf16<P>) {
#if defined(__AVX512BF16__)
    for (int64_t d = 0; d < head_dim; d += 2 * kLanes) {
      const __mmask32 pairs = head_dim - d >= 2 * kLanes ? 0xffffffffu : 0xffffu;  // head_dim % 32 == 16
      const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(pairs, q_raw + d);
      for (int i = 0; i < kLanes; ++i)
        acc[i].v = _mm512_dpbf16_ps(acc[i].v, qv, (__m512bh)_mm512_maskz_loadu_epi16(pairs, k[i] + d));
    }
    return mul(reduce16(acc), broadcast(scale));
#endif
  } else {
#if defined(__AVX2__) && !defined(__AVX512F__)
    // 16 keys' accumulators would take 32 of AVX2's 16 registers: keys go four at a time, each reduced as reduce16
    // reduces it (reduce_add), so the sums are the same.
    alignas(32) float sums[kLanes];
    for (int i0 = 0; i0 < kLanes; i0 += 4) {
      Vec16 part[4] = {zeros(), zeros(), zeros(), zeros()};
      for (int64_t d = 0; d < head_dim; d += kLanes) {
        const Vec16 qv = load(q_scaled + d);
        for (int i = 0; i < 4; ++i) part[i] = fmadd(qv, load(k[i0 + i] + d), part[i]);
      }
      for (int i = 0; i < 4; ++i) sums[i0 + i] = reduce_add(part[i]);
    }
    return load(sums);
#endif
    for (int64_t d = 0; d < head_dim; d += kLanes) {
      const Vec16 qv = load(q_scaled + d);
      for (int i = 0; i < kLanes; ++i) acc[i] = fmadd(qv, load(k[i] + d), acc[i]);
    }
  }
  return reduce16(acc);
}

// Row r's scores (scaled) for the tile's keys [begin, end), into probs. int8 keys: lane i's sum times key i's
// scale, in float32 (a key the row does not see: zeros times 0).
template <typename T, typename P>
void row_scores(const PagedAttentionArgs& a, Scratch<T, P>& s, int64_t r) {
  const int64_t begin = s.begin[r], end = s.end[r];
  const P* keys[kLanes];
  alignas(64) float key_scales[kLanes];
  const int64_t kv_head = s.kv_offset[r] / a.head_dim;  // within the item's
  for (int64_t g0 = begin / kLanes * kLanes; g0 < end; g0 += kLanes) {
    for (int i = 0; i < kLanes; ++i) {
      const int64_t j = g0 + i;
      const bool sees = j >= begin && j < end;
      keys[i] = sees ? s.k_rows[j] + s.kv_offset[r] : s.zero_row.data();
      if constexpr (std::is_same_v<P, int8_t>) key_scales[i] = sees ? s.k_scale_rows[j][kv_head] : 0.0f;
    }
    Vec16 scores = group_scores(s.q.data() + r * a.head_dim, s.q_raw[r], keys, a.head_dim, a.scale);
    if constexpr (std::is_same_v<P, int8_t>) scores = mul(scores, load(key_scales));
    store(s.probs.data() + r * kKeyTile + g0, scores);
    prefetch_next(s, s.prefetch_per_group);
  }
}

#if defined(__AVX512BF16__)
// K in pairs: scores (scaled) of ROWS rows of one KV head for GROUPS groups of 16 keys, k[g] the group's first
// row of pairs: lane i of group g sums q's pairs of dims times key 16 g + i's, pair by pair. Prefetches the next
// tile's lines spread over the pairs: `prefetch` lines per 8 pairs.
template <int ROWS, int GROUPS>
void paired_scores(Scratch<bf16, bf16>& s, const bf16* const* q, const uint32_t* const* k, int64_t pair_stride,
                   int64_t pairs, float scale, float* const* out, int64_t prefetch) {
  __m512 acc[ROWS][GROUPS];
  for (int r = 0; r < ROWS; ++r) {
    for (int g = 0; g < GROUPS; ++g) acc[r][g] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    if (p % 8 == 0) prefetch_next(s, prefetch);
    __m512bh kp[GROUPS];
    for (int g = 0; g < GROUPS; ++g) kp[g] = (__m512bh)_mm512_loadu_si512(k[g] + p * pair_stride);
    for (int r = 0; r < ROWS; ++r) {
      int32_t pair;
      std::memcpy(&pair, q[r] + 2 * p, sizeof pair);
      const __m512bh qp = (__m512bh)_mm512_set1_epi32(pair);
      for (int g = 0; g < GROUPS; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], qp, kp[g]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int g = 0; g < GROUPS; ++g) {
      _mm512_storeu_ps(out[r] + g * kLanes, _mm512_mul_ps(acc[r][g], _mm512_set1_ps(scale)));
    }
  }
}

constexpr int kPairedRows = 4;  // rows per paired_scores call: 16 accumulators at 4 groups, with the 4 key loads
using PairedScores = void (*)(Scratch<bf16, bf16>&, const bf16* const*, const uint32_t* const*, int64_t, int64_t, float,
                              float* const*, int64_t);
template <int ROWS>
constexpr PairedScores kPairedScores[kKeyTile / kLanes] = {paired_scores<ROWS, 1>, paired_scores<ROWS, 2>,
                                                           paired_scores<ROWS, 3>, paired_scores<ROWS, 4>};
static_assert(kKeyTile / kLanes == 4, "kPairedScores lists one instance per group count of a tile");

// K in pairs: the active rows' scores for the tile, into probs. Runs of up to kPairedRows consecutive rows of one
// KV head share the key loads, each over the groups its rows see; keys of a group a row does not see are masked
// by the softmax step.
inline void paired_tile_scores(const PagedAttentionArgs& a, Scratch<bf16, bf16>& s, int64_t num_active) {
  const int64_t pairs = a.head_dim / 2;
  const int64_t* active = s.active.data();
  for (int64_t k = 0; k < num_active;) {
    int n = 1;
    while (n < kPairedRows && k + n < num_active && s.kv_offset[active[k + n]] == s.kv_offset[active[k]]) ++n;
    int64_t g_lo = kKeyTile, g_hi = 0;
    const bf16* q[kPairedRows];
    for (int i = 0; i < n; ++i) {
      g_lo = std::min(g_lo, s.begin[active[k + i]] / kLanes);
      g_hi = std::max(g_hi, (s.end[active[k + i]] + kLanes - 1) / kLanes);
      q[i] = s.q_raw[active[k + i]];
    }
    float* out[kPairedRows];
    for (int i = 0; i < n; ++i) out[i] = s.probs.data() + active[k + i] * kKeyTile + g_lo * kLanes;
    const uint32_t* const* keys = s.k_groups.data() + s.kv_offset[active[k]] / a.head_dim * (kKeyTile / kLanes) + g_lo;
    const int64_t groups = g_hi - g_lo;
    const int64_t prefetch = (s.prefetch_per_group * n * groups + (pairs + 7) / 8 - 1) / ((pairs + 7) / 8);
    switch (n) {
      case 1: kPairedScores<1>[groups - 1](s, q, keys, a.block_size, pairs, a.scale, out, prefetch); break;
      case 2: kPairedScores<2>[groups - 1](s, q, keys, a.block_size, pairs, a.scale, out, prefetch); break;
      case 3: kPairedScores<3>[groups - 1](s, q, keys, a.block_size, pairs, a.scale, out, prefetch); break;
      default: kPairedScores<4>[groups - 1](s, q, keys, a.block_size, pairs, a.scale, out, prefetch); break;
    }
    k += n;
  }
}
#endif

// Row r's online-softmax step over its scores in probs for the tile's keys [begin, end): probabilities in place
// of the scores, the rescale of its running state, and its running max and sum updated.
template <typename T, typename P>
void softmax_update(const PagedAttentionArgs& a, Scratch<T, P>& s, int64_t r) {
  const int64_t begin = s.begin[r], end = s.end[r];
  float* scores = s.probs.data() + r * kKeyTile;
  const int64_t first_group = begin / kLanes * kLanes;
  if (a.softcap > 0.0f) {
    for (int64_t j = begin; j < end; ++j) scores[j] = std::tanh(scores[j] / a.softcap) * a.softcap;
  }
  Vec16 tile_max = broadcast(kNegInf);
  for (int64_t c0 = first_group; c0 < end; c0 += kLanes) {
    const Mask valid = lane_range(static_cast<int>(begin - c0), static_cast<int>(end - c0));
    tile_max = max(tile_max, select(valid, load(scores + c0), broadcast(kNegInf)));
  }
  const float new_max = std::max(s.row_max[r], reduce_max(tile_max));
  s.rescale[r] = std::exp(s.row_max[r] - new_max);  // 0 on the row's first tile (its max was -inf)
  const Vec16 shift = broadcast(new_max);
  Vec16 tile_sum = zeros();
  for (int64_t c0 = first_group; c0 < end; c0 += kLanes) {
    const Mask valid = lane_range(static_cast<int>(begin - c0), static_cast<int>(end - c0));
    const Vec16 p = select(valid, exp(sub(load(scores + c0), shift)), zeros());
    store(scores + c0, p);
#if defined(__AVX512BF16__)
    if constexpr (kPairedBf16<P>) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.probs_bf16.data() + r * kKeyTile + c0),
                          (__m256i)_mm512_cvtneps_pbh(p.v));
    }
#endif
    tile_sum = add(tile_sum, p);
  }
  s.row_sum[r] = s.row_sum[r] * s.rescale[r] + reduce_add(tile_sum);
  s.row_max[r] = new_max;
}

// For ROWS rows of one KV head at once (sharing the V loads): acc chunks [c0, c0 + PIECE) = acc * rescale, then
// acc += p[j] * v_j for each key j the row sees in this tile, in key order. SAME_KEYS: the rows see the same keys
// (a decode row's query heads always do), so no key needs a per-row check. int8 V: p[j] * scale_j times the int8
// row, the product in float32 (the rows of a pass share the KV head, hence the scale).
template <int PIECE, int ROWS, bool SAME_KEYS, typename T, typename P>
void accumulate(Scratch<T, P>& s, const int64_t* rows, int64_t head_dim, int64_t c0) {
  Vec16 acc[ROWS][PIECE];
  const int64_t kv_offset = s.kv_offset[rows[0]];
  int64_t lo = s.begin[rows[0]], hi = s.end[rows[0]];
  const float* probs[ROWS];
  for (int k = 0; k < ROWS; ++k) {
    const int64_t r = rows[k];
    lo = std::min(lo, s.begin[r]);
    hi = std::max(hi, s.end[r]);
    probs[k] = s.probs.data() + r * kKeyTile;
    const Vec16 factor = broadcast(s.rescale[r]);
    for (int c = 0; c < PIECE; ++c) acc[k][c] = mul(load(s.acc.data() + r * head_dim + (c0 + c) * kLanes), factor);
  }
  for (int64_t j = lo; j < hi; ++j) {
    prefetch_next(s, s.prefetch_per_key);
    Vec16 v[PIECE];
    for (int c = 0; c < PIECE; ++c) v[c] = load(s.v_rows[j] + kv_offset + (c0 + c) * kLanes);
    float v_scale = 1.0f;
    if constexpr (std::is_same_v<P, int8_t>) v_scale = s.v_scale_rows[j][kv_offset / head_dim];
    for (int k = 0; k < ROWS; ++k) {
      if (!SAME_KEYS && (j < s.begin[rows[k]] || j >= s.end[rows[k]])) continue;
      const Vec16 p = broadcast(std::is_same_v<P, int8_t> ? probs[k][j] * v_scale : probs[k][j]);
      for (int c = 0; c < PIECE; ++c) acc[k][c] = fmadd(p, v[c], acc[k][c]);
    }
  }
  for (int k = 0; k < ROWS; ++k) {
    for (int c = 0; c < PIECE; ++c) store(s.acc.data() + rows[k] * head_dim + (c0 + c) * kLanes, acc[k][c]);
  }
}

#if defined(__AVX512BF16__)
// Lane i: the bfloat16 pair (a[i], b[i]), for 16 dims of two V rows.
inline __m512bh interleave16(__m512i order, const bf16* a, const bf16* b) {
  const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m512i both =
      _mm512_inserti64x4(_mm512_castsi256_si512(low), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
  return (__m512bh)_mm512_permutexvar_epi16(order, both);
}

// accumulate for paired bfloat16: the keys go in pairs (2m, 2m + 1), each pair one AVX512-BF16 step per 16 dims,
// acc += p[2m] * v[2m] + p[2m + 1] * v[2m + 1] with p rounded to bfloat16. A key of the pair the row does not see
// enters as a zero V row with p = 0, so the row's arithmetic depends on its own keys only.
template <int PIECE, int ROWS, bool SAME_KEYS>
void accumulate_paired(Scratch<bf16, bf16>& s, const int64_t* rows, int64_t head_dim, int64_t c0) {
  alignas(64) static constexpr uint16_t kOrder[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(kOrder);
  __m512 acc[ROWS][PIECE];
  const int64_t kv_offset = s.kv_offset[rows[0]];
  int64_t lo = s.begin[rows[0]], hi = s.end[rows[0]];
  const bf16* probs[ROWS];
  for (int k = 0; k < ROWS; ++k) {
    const int64_t r = rows[k];
    lo = std::min(lo, s.begin[r]);
    hi = std::max(hi, s.end[r]);
    probs[k] = s.probs_bf16.data() + r * kKeyTile;
    const __m512 factor = _mm512_set1_ps(s.rescale[r]);
    for (int c = 0; c < PIECE; ++c) {
      acc[k][c] = _mm512_mul_ps(_mm512_loadu_ps(s.acc.data() + r * head_dim + (c0 + c) * kLanes), factor);
    }
  }
  const bf16* zero = s.zero_row.data();
  for (int64_t j = lo & ~int64_t{1}; j < hi; j += 2) {
    prefetch_next(s, 2 * s.prefetch_per_key);
    const bool has0 = j >= lo, has1 = j + 1 < hi;  // the pass's rows see key j / j + 1
    const bf16* v0 = has0 ? s.v_rows[j] + kv_offset : zero;
    const bf16* v1 = has1 ? s.v_rows[j + 1] + kv_offset : zero;
    __m512bh v[PIECE];
    for (int c = 0; c < PIECE; ++c) v[c] = interleave16(order, v0 + (c0 + c) * kLanes, v1 + (c0 + c) * kLanes);
    for (int k = 0; k < ROWS; ++k) {
      int32_t pair;
      std::memcpy(&pair, probs[k] + j, sizeof pair);  // lanes the row does not see hold 0
      const __m512bh p = (__m512bh)_mm512_set1_epi32(pair);
      if (!SAME_KEYS) {
        const int64_t begin = s.begin[rows[k]], end = s.end[rows[k]];
        const bool sees0 = j >= begin && j < end, sees1 = j + 1 >= begin && j + 1 < end;
        if (!sees0 && !sees1) continue;
        if (sees0 != has0 || sees1 != has1) {  // an edge of its keys inside the pass's: its own V pair
          for (int c = 0; c < PIECE; ++c) {
            const __m512bh own = interleave16(order, (sees0 ? v0 : zero) + (c0 + c) * kLanes,
                                              (sees1 ? v1 : zero) + (c0 + c) * kLanes);
            acc[k][c] = _mm512_dpbf16_ps(acc[k][c], p, own);
          }
          continue;
        }
      }
      for (int c = 0; c < PIECE; ++c) acc[k][c] = _mm512_dpbf16_ps(acc[k][c], p, v[c]);
    }
  }
  for (int k = 0; k < ROWS; ++k) {
    for (int c = 0; c < PIECE; ++c) _mm512_storeu_ps(s.acc.data() + rows[k] * head_dim + (c0 + c) * kLanes, acc[k][c]);
  }
}
#endif

// Rows of one KV head that share the V loads of a pass: as many as leave registers for the V chunks (AVX2: none
// left, see kMaxPiece).
#if defined(__AVX2__) && !defined(__AVX512F__)
template <int PIECE>
constexpr int kRowsPerPass = 1;
#else
template <int PIECE>
constexpr int kRowsPerPass = PIECE <= 4 ? 4 : PIECE <= 6 ? 3 : 2;
#endif

template <int PIECE, int ROWS, typename T, typename P>
void accumulate_rows(Scratch<T, P>& s, const int64_t* rows, int64_t head_dim, int64_t c0) {
  bool same_keys = true;
  for (int k = 1; k < ROWS; ++k) {
    same_keys &= s.begin[rows[k]] == s.begin[rows[0]] && s.end[rows[k]] == s.end[rows[0]];
  }
  if constexpr (kPairedBf16<P>) {
#if defined(__AVX512BF16__)
    if (same_keys) {
      accumulate_paired<PIECE, ROWS, true>(s, rows, head_dim, c0);
    } else {
      accumulate_paired<PIECE, ROWS, false>(s, rows, head_dim, c0);
    }
#endif
  } else if (same_keys) {
    accumulate<PIECE, ROWS, true>(s, rows, head_dim, c0);
  } else {
    accumulate<PIECE, ROWS, false>(s, rows, head_dim, c0);
  }
}

// The active rows in passes of up to kRowsPerPass consecutive rows of one KV head.
template <int PIECE, typename T, typename P>
void accumulate_piece(Scratch<T, P>& s, int64_t num_active, int64_t head_dim, int64_t c0) {
  const int64_t* active = s.active.data();
  for (int64_t k = 0; k < num_active;) {
    int n = 1;
    while (n < kRowsPerPass<PIECE> && k + n < num_active && s.kv_offset[active[k + n]] == s.kv_offset[active[k]]) ++n;
    switch (n) {  // n <= kRowsPerPass<PIECE>: only those row counts are instantiated
      case 1: accumulate_rows<PIECE, 1>(s, active + k, head_dim, c0); break;
      case 2: accumulate_rows<PIECE, 2>(s, active + k, head_dim, c0); break;
      case 3: if constexpr (kRowsPerPass<PIECE> >= 3) accumulate_rows<PIECE, 3>(s, active + k, head_dim, c0); break;
      default: if constexpr (kRowsPerPass<PIECE> >= 4) accumulate_rows<PIECE, 4>(s, active + k, head_dim, c0);
    }
    k += n;
  }
}

template <typename T, typename P>
void accumulate_tile(Scratch<T, P>& s, int64_t num_active, int64_t head_dim) {
  const int64_t num_chunks = head_dim / kLanes;
  int64_t c0 = 0;
  for (; c0 + kMaxPiece <= num_chunks; c0 += kMaxPiece) accumulate_piece<kMaxPiece>(s, num_active, head_dim, c0);
  switch (num_chunks - c0) {
    case 0: break;
    case 1: accumulate_piece<1>(s, num_active, head_dim, c0); break;
    case 2: accumulate_piece<2>(s, num_active, head_dim, c0); break;
    case 3: accumulate_piece<3>(s, num_active, head_dim, c0); break;
    case 4: accumulate_piece<4>(s, num_active, head_dim, c0); break;
    case 5: accumulate_piece<5>(s, num_active, head_dim, c0); break;
    case 6: accumulate_piece<6>(s, num_active, head_dim, c0); break;
    default: accumulate_piece<7>(s, num_active, head_dim, c0); break;
  }
}

// The keys a query at `position` sees: [lo, position].
inline int64_t first_key(const PagedAttentionArgs& a, int64_t position) {
  return a.sliding_window > 0 ? std::max<int64_t>(0, position - a.sliding_window + 1) : 0;
}

// Calls visit(key, run, offset) for each run of the keys [first, end) of the sequence with block table `table`
// that lie in one block; offset: the run's first row in the pools, at KV head kv_head.
template <typename Visit>
inline void for_each_run(const PagedAttentionArgs& a, const int64_t* table, int64_t kv_head, int64_t first,
                         int64_t end, Visit&& visit) {
  for (int64_t key = first; key < end;) {
    const int64_t first_slot = key % a.block_size;
    const int64_t run = std::min(a.block_size - first_slot, end - key);
    visit(key, run, ((table[key / a.block_size] * a.block_size + first_slot) * a.num_kv_heads + kv_head) * a.head_dim);
    key += run;
  }
}

// Calls visit(span) for the item's K rows, then V rows, of the keys [first, end): a block's rows are one span when
// the item takes all KV heads, one span per row otherwise. K in pairs: a block's rows of pairs of the item's KV
// heads are one span when the keys fill the block, one span per row of pairs otherwise.
template <typename P, typename Visit>
inline void for_each_span(const PagedAttentionArgs& a, const WorkItem& item, int64_t first, int64_t end,
                          Visit&& visit) {
  const int64_t* table = a.block_tables + item.seq * a.block_table_stride;
  constexpr int64_t elem = sizeof(P);
  const int64_t row_bytes = item.num_kv_heads * a.head_dim * elem;
  const int64_t slot_bytes = a.num_kv_heads * a.head_dim * elem;
  if (a.paired_k) {
    const int64_t head_bytes = a.head_dim * a.block_size * elem;  // a KV head's rows of pairs in a block
    for_each_run(a, table, item.kv_head, first, end, [&](int64_t key, int64_t run, int64_t) {
      const char* heads = static_cast<const char*>(a.k_pool) +
                          (table[key / a.block_size] * a.num_kv_heads + item.kv_head) * head_bytes;
      if (run == a.block_size) {
        visit(Span{heads, item.num_kv_heads * head_bytes});
        return;
      }
      for (int64_t row = 0; row < item.num_kv_heads * a.head_dim / 2; ++row) {
        visit(Span{heads + (row * a.block_size + key % a.block_size) * 2 * elem, run * 2 * elem});
      }
    });
  }
  for (const void* pool : {a.k_pool, a.v_pool}) {
    if (a.paired_k && pool == a.k_pool) continue;
    for_each_run(a, table, item.kv_head, first, end, [&](int64_t, int64_t run, int64_t offset) {
      const char* row = static_cast<const char*>(pool) + offset * elem;
      if (item.num_kv_heads == a.num_kv_heads) {
        visit(Span{row, run * row_bytes});
      } else {
        for (int64_t i = 0; i < run; ++i) visit(Span{row + i * slot_bytes, row_bytes});
      }
    });
  }
}

// `next`: the item this thread takes after this one (or null); a decode item prefetches its first tile while it
// computes its own last.
template <typename T, typename P>
void attend_item(const PagedAttentionArgs& a, const WorkItem& item, const WorkItem* next, Scratch<T, P>& s,
                 SplitStates& states) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t head_dim = a.head_dim;
  const int64_t heads_per_query = item.num_kv_heads * group;  // rows are (query, head), head-minor
  const int64_t num_rows = (item.query_end - item.query_begin) * heads_per_query;
  const T* q_base = static_cast<const T*>(a.q);
  int64_t item_lo = std::numeric_limits<int64_t>::max();
  int64_t item_hi = 0;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t token = item.query_begin + r / heads_per_query;
    const int64_t head = item.kv_head * group + r % heads_per_query;
    s.kv_offset[r] = (head / group - item.kv_head) * head_dim;
    const int64_t position = a.positions[token];
    s.lo[r] = std::max(first_key(a, position), item.key_begin);
    s.hi[r] = std::min(position + 1, item.key_end);
    item_lo = std::min(item_lo, s.lo[r]);
    item_hi = std::max(item_hi, s.hi[r]);
    const T* q = q_base + token * a.q_token_stride + head * head_dim;
    s.q_raw[r] = q;
    for (int64_t d = 0; d < head_dim; ++d) s.q[r * head_dim + d] = to_float(q[d]) * a.scale;
    s.merged[r] = 0;
  }
  const int64_t* table = a.block_tables + item.seq * a.block_table_stride;
  const P* k_pool = static_cast<const P*>(a.k_pool);
  const P* v_pool = static_cast<const P*>(a.v_pool);
  const int64_t slot_stride = a.num_kv_heads * head_dim;
  const int64_t first_tile = item_lo / kKeyTile * kKeyTile;
  for (int64_t tile_start = first_tile; tile_start < item_hi; tile_start += kKeyTile) {
    const int64_t tile_end = std::min(tile_start + kKeyTile, item_hi);
    if (tile_start == first_tile || tile_start % kSplit == 0) {  // a split begins: every row starts afresh
      for (int64_t r = 0; r < num_rows; ++r) {
        std::fill_n(s.acc.data() + r * head_dim, head_dim, 0.0f);
        s.row_max[r] = kNegInf;
        s.row_sum[r] = 0.0f;
      }
    }
    for_each_run(a, table, item.kv_head, std::max(tile_start, item_lo), tile_end,
                 [&](int64_t key, int64_t run, int64_t offset) {
                   for (int64_t i = 0; i < run; ++i) {
                     if (!a.paired_k) s.k_rows[key + i - tile_start] = k_pool + offset + i * slot_stride;
                     s.v_rows[key + i - tile_start] = v_pool + offset + i * slot_stride;
                     if constexpr (std::is_same_v<P, int8_t>) {  // a row's scale: its offset / head_dim
                       s.k_scale_rows[key + i - tile_start] = a.k_scales + (offset + i * slot_stride) / head_dim;
                       s.v_scale_rows[key + i - tile_start] = a.v_scales + (offset + i * slot_stride) / head_dim;
                     }
                   }
                 });
    if (a.paired_k) {  // block_size is a multiple of 16, so a group of 16 keys lies in one block
      const auto* pairs = static_cast<const uint32_t*>(a.k_pool);
      for (int64_t g = (std::max(tile_start, item_lo) - tile_start) / kLanes; tile_start + g * kLanes < tile_end; ++g) {
        const int64_t key = tile_start + g * kLanes;
        for (int64_t h = 0; h < item.num_kv_heads; ++h) {
          s.k_groups[h * (kKeyTile / kLanes) + g] =
              pairs + ((table[key / a.block_size] * a.num_kv_heads + item.kv_head + h) * head_dim / 2) * a.block_size +
              key % a.block_size;
        }
      }
    }
    // The tile's K rows, then its V rows, are read into cache first, a byte per cache line in address order: the
    // hardware prefetcher follows such a stream, and the loads are independent, so many are in flight at once.
    // Left to the arithmetic's own order (16 keys' rows side by side, one 64-byte piece each at a time) the same
    // bytes came from memory at about a third of the speed (measured: a decode step's attention at batch 16,
    // context 512, 45 -> 32 ms on one thread).
    for_each_span<P>(a, item, std::max(tile_start, item_lo), tile_end, [](const Span& span) {
      for (int64_t byte = 0; byte < span.bytes; byte += 64) touch(span.begin + byte);
    });
    // A decode item's K/V come from memory once (a prefill item's are read again by the chunk's other items), so
    // the next tile's lines are prefetched into L2 while this tile is computed: half of them spread evenly over
    // the groups of 16 scores, the rest over the accumulate's key steps. That hides most of the next touch (the
    // batch-16, context-512 attention of 30 layers, 2 threads: about 25 -> 19 ms with all of them issued among
    // the scores; spread over the accumulate too, they wait less for free miss buffers: a float32 decode step
    // 39.6 -> 38.7 ms). Prefill items measured ~6% slower with it. The last tile prefetches the first tile
    // of the thread's next item when that is a decode item too.
    s.next_spans.clear();
    s.next_span = 0;
    s.next_byte = 0;
    int64_t next_lines = 0;
    const auto add_span = [&](const Span& span) {
      s.next_spans.push_back(span);
      next_lines += (span.bytes + 63) / 64;
    };
    if (item.query_end - item.query_begin == 1) {
      if (tile_end < item_hi) {
        for_each_span<P>(a, item, tile_end, std::min(tile_end + kKeyTile, item_hi), add_span);
      } else if (next != nullptr && next->query_end - next->query_begin == 1) {
        const int64_t position = a.positions[next->query_begin];
        const int64_t lo = std::max(first_key(a, position), next->key_begin);
        for_each_span<P>(a, *next, lo, std::min(lo / kKeyTile * kKeyTile + kKeyTile, position + 1), add_span);
      }
    }
    const int64_t num_groups = num_rows * (kKeyTile / kLanes);
    s.prefetch_per_group = (next_lines / 2 + num_groups - 1) / num_groups;
    s.prefetch_per_key = 0;
    int64_t num_active = 0;
    for (int64_t r = 0; r < num_rows; ++r) {
      s.begin[r] = std::max(s.lo[r], tile_start) - tile_start;
      s.end[r] = std::min(s.hi[r], tile_end) - tile_start;
      if (s.begin[r] >= s.end[r]) continue;
      s.active[num_active++] = r;
    }
    if (a.paired_k) {  // bfloat16 only (the binding checks)
#if defined(__AVX512BF16__)
      if constexpr (kPairedBf16<P>) paired_tile_scores(a, s, num_active);
#endif
      for (int64_t i = 0; i < num_active; ++i) softmax_update(a, s, s.active[i]);
    } else {
      for (int64_t i = 0; i < num_active; ++i) {
        row_scores(a, s, s.active[i]);
        softmax_update(a, s, s.active[i]);
      }
    }
    // About one pass over the tile's keys per KV head of the rows.
    const int64_t key_steps = std::max<int64_t>(1, (num_active + group - 1) / group * kKeyTile);
    s.prefetch_per_key = (lines_left(s) + key_steps - 1) / key_steps;
    accumulate_tile(s, num_active, head_dim);
    if (tile_end % kSplit == 0 || tile_end == item_hi) {  // a split ends: its state to the row's merge
      const int64_t split = tile_start / kSplit;
      for (int64_t r = 0; r < num_rows; ++r) {
        if (std::max(s.lo[r], split * kSplit) >= std::min(s.hi[r], (split + 1) * kSplit)) continue;  // no key
        float* acc = s.acc.data() + r * head_dim;
        if (item.state >= 0) {  // one decode row's split: merged after all items
          const int64_t head = item.kv_head * group + r % heads_per_query;
          const int64_t index = item.state + head * states.max_splits + split;
          states.max[index] = s.row_max[r];
          states.sum[index] = s.row_sum[r];
          std::copy_n(acc, head_dim, states.acc.data() + index * head_dim);
        } else if (!s.merged[r]) {
          s.merged_max[r] = s.row_max[r];
          s.merged_sum[r] = s.row_sum[r];
          std::copy_n(acc, head_dim, s.merged_acc.data() + r * head_dim);
          s.merged[r] = 1;
        } else {
          merge_split(s.merged_max[r], s.merged_sum[r], s.merged_acc.data() + r * head_dim, s.row_max[r],
                      s.row_sum[r], acc, head_dim);
        }
      }
    }
  }
  if (item.state >= 0) return;
  T* out = static_cast<T*>(a.out);
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t token = item.query_begin + r / heads_per_query;
    const int64_t head = item.kv_head * group + r % heads_per_query;
    write_row(out + (token * a.num_heads + head) * head_dim, s.merged_acc.data() + r * head_dim, s.merged_sum[r],
              head_dim);
  }
}

// Runs the items on the threads, P the pools' element type.
template <typename T, typename P>
void attend_items(const PagedAttentionArgs& a, const std::vector<WorkItem>& items, int64_t max_rows,
                  int64_t decode_heads, SplitStates& states) {
  const int64_t num_items = static_cast<int64_t>(items.size());
  // Items go to the threads as they come free, one ahead: a thread takes its next item before it starts the
  // current one, so that the current one can prefetch the next one's first K/V.
  std::atomic<int64_t> taken{0};
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(a.num_threads, num_items)))
  {
    Scratch<T, P> scratch(max_rows, decode_heads, a.head_dim);
    for (int64_t i = taken++; i < num_items;) {
      const int64_t next = taken++;
      attend_item(a, items[i], next < num_items ? &items[next] : nullptr, scratch, states);
      i = next;
    }
  }
}

// The decode rows whose splits ran as items of their own: each (row, head)'s split states merged in split order,
// as attend_item merges them, then written out. split_seqs: their sequences; the i-th one's states start at
// i * num_heads * max_splits.
template <typename T>
void merge_split_items(const PagedAttentionArgs& a, const std::vector<int64_t>& split_seqs,
                       const SplitStates& states) {
  std::vector<float> acc(a.head_dim);
  for (size_t i = 0; i < split_seqs.size(); ++i) {
    const int64_t seq = split_seqs[i], state = static_cast<int64_t>(i) * a.num_heads * states.max_splits;
    const int64_t token = a.cu_seqlens_q[seq];
    const int64_t position = a.positions[token];
    const int64_t first = first_key(a, position) / kSplit, last = position / kSplit;
    for (int64_t head = 0; head < a.num_heads; ++head) {
      const int64_t index = state + head * states.max_splits;
      float max = states.max[index + first], sum = states.sum[index + first];
      std::copy_n(states.acc.data() + (index + first) * a.head_dim, a.head_dim, acc.data());
      for (int64_t split = first + 1; split <= last; ++split) {
        merge_split(max, sum, acc.data(), states.max[index + split], states.sum[index + split],
                    states.acc.data() + (index + split) * a.head_dim, a.head_dim);
      }
      write_row(static_cast<T*>(a.out) + (token * a.num_heads + head) * a.head_dim, acc.data(), sum, a.head_dim);
    }
  }
}

}  // namespace

template <typename T>
void paged_attention(const PagedAttentionArgs& a) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t queries_per_item = std::max<int64_t>(1, kRowsPerItem / group);
  int64_t num_decode_rows = 0;
  for (int64_t seq = 0; seq < a.num_seqs; ++seq) num_decode_rows += a.cu_seqlens_q[seq + 1] - a.cu_seqlens_q[seq] == 1;
  const int64_t decode_heads = num_decode_rows >= kDecodeRowsPerThread * a.num_threads ? a.num_kv_heads : 1;
  // Too few decode rows to keep the threads busy: each split of a decode row is an item (policy only: the
  // arithmetic is the same either way).
  const bool split_items = a.num_threads > 1 && decode_heads == 1;
  SplitStates states;
  std::vector<int64_t> split_seqs;
  for (int64_t seq = 0; split_items && seq < a.num_seqs; ++seq) {
    if (a.cu_seqlens_q[seq + 1] - a.cu_seqlens_q[seq] != 1) continue;
    states.max_splits = std::max(states.max_splits, a.positions[a.cu_seqlens_q[seq]] / kSplit + 1);
    split_seqs.push_back(seq);
  }
  const size_t num_states = split_seqs.size() * a.num_heads * states.max_splits;
  states.max.resize(num_states);
  states.sum.resize(num_states);
  states.acc.resize(num_states * a.head_dim);
  std::vector<WorkItem> items;
  size_t next_split = 0;  // split_seqs' next
  for (int64_t seq = 0; seq < a.num_seqs; ++seq) {
    const int64_t first = a.cu_seqlens_q[seq], last = a.cu_seqlens_q[seq + 1];
    if (next_split < split_seqs.size() && split_seqs[next_split] == seq) {
      const int64_t position = a.positions[first];
      const int64_t state = static_cast<int64_t>(next_split++) * a.num_heads * states.max_splits;
      for (int64_t kv_head = 0; kv_head < a.num_kv_heads; ++kv_head) {
        for (int64_t split = first_key(a, position) / kSplit; split <= position / kSplit; ++split) {
          items.push_back({seq, first, last, kv_head, 1, split * kSplit, (split + 1) * kSplit, state});
        }
      }
      continue;
    }
    const int64_t heads_per_item = last - first == 1 ? decode_heads : 1;
    for (int64_t begin = first; begin < last; begin += queries_per_item) {
      const int64_t end = std::min(begin + queries_per_item, last);
      for (int64_t kv_head = 0; kv_head < a.num_kv_heads; kv_head += heads_per_item) {
        items.push_back({seq, begin, end, kv_head, heads_per_item, 0, std::numeric_limits<int64_t>::max(), -1});
      }
    }
  }
  const int64_t max_rows = std::max(queries_per_item * group, decode_heads * group);
  if (a.k_scales != nullptr) {
    attend_items<T, int8_t>(a, items, max_rows, decode_heads, states);
  } else {
    attend_items<T, T>(a, items, max_rows, decode_heads, states);
  }
  merge_split_items<T>(a, split_seqs, states);
}

template void paged_attention<float>(const PagedAttentionArgs&);
template void paged_attention<bf16>(const PagedAttentionArgs&);

}  // namespace rill_cpu
