// Quantized weights as GGUF files ship them (ops.h, "Quantized matrices"): y = x @ w^T with w's blocks read as
// they are, and rows of w de-quantized for an embedding lookup.
//
// A weight sub-block of 32 inputs decodes to 32 small integers q with a float scale d and min m (the weight is
// d * q + m, m = 0 for the types without one; Q6_K's integer scale per 16 inputs goes into q). Three ways to
// multiply it, chosen per matrix when it is packed (QuantHeader::activations):
//
// - float activations (the file's quality, no rounding beyond float32 sums): per sub-block and row, eight float
//   lanes s_l = x_l q_l + x_{8+l} q_{8+l} + x_{16+l} q_{16+l} + x_{24+l} q_{24+l} (a multiply, then fused
//   multiply-adds), acc_l = fma(s_l, d, acc_l), and the min term m * sum(x of the sub-block) in a chain of its own.
// - int8 activations (llama.cpp's way, fewer instructions per weight): each row of x quantized on its own, in
//   blocks of 32, to int8 with one float scale dx = max|x| / 127 (q_x = round-half-even(x * (1 / dx))); per
//   sub-block the exact integer sum isum = sum_i q_i q_x,i (no int16 saturation is possible for these value
//   ranges, and |isum| < 2^24, so float(isum) is exact too), then acc = fma(float(isum), d * dx, acc) and, for
//   the types with a min, acc = fma(m, dx * sum(q_x), acc): one chain per output. An integer sum has one value
//   whatever the order of its additions, so each path adds its products the way its registers make cheapest.
// - int16 activations (close to the float product, at under half its instructions): the same with
//   dx = max|x| / (127 * 254), so |q_x| <= 32258, written as two int8 digits q_x = 254 * hi + lo (|hi| <= 127,
//   -127 <= lo <= 126). The int8 product runs once per digit (the weights unpacked once) and the block's sum
//   is fma(float(isum_hi), 254, float(isum_lo)), then as above. An input's error is at most dx / 2, 1 / 64516
//   of its block's largest: finer than bfloat16's rounding of the input itself.
//
// Either way every output is computed one fixed way, whatever the row count, the tile or the thread: the chains
// over the sub-blocks in order (float: then a fixed tree over the eight lanes and the min chain). So a row's bits
// do not depend on the batch. The portable path (any CPU; `portable` forces it) runs the same arithmetic and is
// bitwise equal to the AVX2 one. Where the build has AVX512-VNNI, the integer tiles sum four byte products per
// int32 lane in one vpdpbusd instead of maddubs, adds and madd, and with AVX-512 they run on 512-bit vectors over
// groups of 16 weight rows: integer sums, the same values, so the same bits.
//
// Work: decode batches are split over the weight rows (each weight byte read once); prefill over blocks of x rows
// times chunks of weight rows, so a chunk of weights stays in cache while the rows' tiles pass over it. A float
// tile is one weight row against up to kTileRows rows of x (the weight sub-block decoded once per tile; a whole
// tile reads its rows' block sums as a vector), or, for a batch of one or two rows, kWeightRows weight rows at
// once (independent chains, x loaded once). An integer tile is one group of an interleaved part (ops.h: 8 or 16
// weight rows, a lane each), or kTileRows rows decoded one by one (Q5_0 and Q5_1), against up to kInt8Rows rows of
// x: the weight rows' integer sums of a sub-block are one vector, so one conversion and one fused multiply-add
// advance all their outputs. x is quantized 8 inputs at a time where the build has AVX2.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RILL_QUANT_AVX2 1
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define RILL_QUANT_VNNI 1
#endif
#endif

namespace rill_cpu {
namespace {

constexpr int kTileRows = 8;          // rows of x a tile carries: 8 accumulators of the 16 AVX2 registers
constexpr int kWeightRows = 4;        // weight rows a float tile carries for a batch of at most 2 rows
constexpr int kInt8Rows = 4;          // rows of x an int8 tile carries
constexpr int64_t kRowBlock = 64;     // rows of x a prefill task keeps in cache
constexpr int64_t kWeightChunk = 16;  // weight rows per task
static_assert(kWeightChunk % kInterleavedRows == 0, "a task's weight rows are whole interleaved groups");
constexpr int64_t kSub = 32;          // inputs per activation block and per weight sub-block

float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block (its 12 packed bytes).
void scale_min_k4(int j, const uint8_t* q, int* scale, int* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One sub-block of 32 weights, decoded: q as 32 small integers (signed types: -128..127; unsigned: 0..31), its
// float scale d and min m (w = d * q * scale16 + m), and for Q6_K the integer scale of each half (else 1).
struct SubBlock {
  int8_t q[kSub];
  float d;
  float m;
  int16_t scale16[2];
};

template <int64_t QT>
constexpr bool kSigned = QT == kQ8_0 || QT == kQ6_K;
template <int64_t QT>
constexpr bool kHasMin = !kSigned<QT>;
template <int64_t QT>
constexpr int64_t kBlockElems = (QT == kQ4_K || QT == kQ5_K || QT == kQ6_K) ? 256 : 32;

// The scale d and min m of sub-block s of the block at `b` (w = d * q + m; m untouched for the types without).
template <int64_t QT>
inline void sub_scales(const uint8_t* b, int s, float* d, float* m) {
  if constexpr (QT == kQ6_K) {
    *d = half_to_float(b + 208);
  } else if constexpr (QT == kQ8_0) {
    *d = half_to_float(b);
  } else if constexpr (QT == kQ4_0 || QT == kQ4_1 || QT == kQ5_0 || QT == kQ5_1) {
    *d = half_to_float(b);
    *m = QT == kQ4_0 ? -8.0f * *d : QT == kQ5_0 ? -16.0f * *d : half_to_float(b + 2);
  } else {  // Q4_K, Q5_K
    int scale, min;
    scale_min_k4(s, b + 4, &scale, &min);
    *d = half_to_float(b) * static_cast<float>(scale);
    *m = -(half_to_float(b + 2) * static_cast<float>(min));
  }
}

// Sub-block s (0 .. kBlockElems / 32) of the block at `b`, portable.
template <int64_t QT>
void decode(const uint8_t* b, int s, SubBlock* out) {
  out->scale16[0] = out->scale16[1] = 1;
  out->m = 0.0f;
  sub_scales<QT>(b, s, &out->d, &out->m);
  if constexpr (QT == kQ8_0) {
    std::memcpy(out->q, b + 2, kSub);
  } else if constexpr (QT == kQ4_0 || QT == kQ4_1) {
    const uint8_t* qs = b + (QT == kQ4_0 ? 2 : 4);
    for (int i = 0; i < 16; ++i) {
      out->q[i] = static_cast<int8_t>(qs[i] & 0xf);
      out->q[i + 16] = static_cast<int8_t>(qs[i] >> 4);
    }
  } else if constexpr (QT == kQ5_0 || QT == kQ5_1) {
    const int head = QT == kQ5_0 ? 2 : 4;
    uint32_t qh;
    std::memcpy(&qh, b + head, sizeof qh);
    const uint8_t* qs = b + head + 4;
    for (int i = 0; i < 16; ++i) {
      out->q[i] = static_cast<int8_t>((qs[i] & 0xf) | (((qh >> i) & 1u) << 4));
      out->q[i + 16] = static_cast<int8_t>((qs[i] >> 4) | (((qh >> (i + 16)) & 1u) << 4));
    }
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
    const uint8_t* qh = b + 16;  // Q5_K only
    const uint8_t* qs = b + (QT == kQ4_K ? 16 : 48) + 32 * (s / 2);
    for (int i = 0; i < kSub; ++i) {
      int v = s % 2 == 0 ? (qs[i] & 0xf) : (qs[i] >> 4);
      if constexpr (QT == kQ5_K) v |= ((qh[i] >> s) & 1) << 4;
      out->q[i] = static_cast<int8_t>(v);
    }
  } else {  // Q6_K: ql[128], qh[64], int8 scales[16], half d
    const int half = s / 4, t = s % 4;
    const uint8_t* ql = b + 64 * half + 32 * (t % 2);
    const uint8_t* qh = b + 128 + 32 * half;
    const auto* scales = reinterpret_cast<const int8_t*>(b + 192 + 8 * half);
    out->scale16[0] = scales[2 * t];
    out->scale16[1] = scales[2 * t + 1];
    for (int i = 0; i < kSub; ++i) {
      const int low = t < 2 ? (ql[i] & 0xf) : (ql[i] >> 4);
      out->q[i] = static_cast<int8_t>((low | (((qh[i] >> (2 * t)) & 3) << 4)) - 32);
    }
  }
}

// The de-quantized values of one block, as ggml's reference de-quantization computes them (scale, then min).
template <int64_t QT>
void dequantize_block(const uint8_t* b, float* out) {
  for (int s = 0; s < kBlockElems<QT> / kSub; ++s) {
    SubBlock sub;
    decode<QT>(b, s, &sub);
    for (int i = 0; i < kSub; ++i) {
      if constexpr (QT == kQ6_K) {
        out[s * kSub + i] = sub.d * static_cast<float>(sub.scale16[i / 16]) * static_cast<float>(sub.q[i]);
      } else if constexpr (QT == kQ8_0) {
        out[s * kSub + i] = static_cast<float>(sub.q[i]) * sub.d;
      } else if constexpr (QT == kQ4_0 || QT == kQ5_0) {  // (q - offset) * d, the offset folded out of m
        const float offset = QT == kQ4_0 ? 8.0f : 16.0f;
        out[s * kSub + i] = (static_cast<float>(sub.q[i]) - offset) * sub.d;
      } else {  // Q4_1, Q5_1: d * q + m; Q4_K, Q5_K: d * q - min
        out[s * kSub + i] = sub.d * static_cast<float>(sub.q[i]) + sub.m;
      }
    }
  }
}

// x as the tiles read it: float32 rows as they are, with sx = the sum of each block of 32 (in order); or, for
// integer activations, q [m, k] int8 (int16: the high digits, lo the low ones) with each block's scale dx and
// sx = dx * sum(q_x). dx and sx are laid out in groups of kTileRows rows, block-major within a group
// ([m / kTileRows][blocks][kTileRows], rows past m zero), so a float tile of kTileRows rows reads a block's
// eight sums as one vector (dx, read a row at a time, shares the layout); `at` finds one row's.
struct QuantizedRows {
  const float* x;
  int64_t blocks;
  std::vector<int8_t> q, lo;
  std::vector<float> dx, sx;

  // Where block g of row r is in dx and sx.
  int64_t at(int64_t r, int64_t g) const { return (r / kTileRows * blocks + g) * kTileRows + r % kTileRows; }
};

constexpr int kDigit = 254;  // the base of int16 activations' two digits

// One block of 32 inputs of a row to integers (int8, or with `wide` int16 as two digits: q = 254 * hi + lo, q in
// q[], lo in lo[]): its scale *dx and *sx = dx * sum(q_x).
void quantize_block(const float* v, bool wide, int8_t* q, int8_t* lo, float* dx, float* sx) {
  float amax = 0.0f;
  for (int j = 0; j < kSub; ++j) amax = std::max(amax, std::fabs(v[j]));
  const float d = amax / (wide ? 127.0f * kDigit : 127.0f);
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  int sum = 0;
  for (int j = 0; j < kSub; ++j) {
    const int value = static_cast<int>(std::nearbyint(v[j] * id));
    sum += value;
    if (!wide) {
      q[j] = static_cast<int8_t>(value);
      continue;
    }
    const int hi = (value + kDigit / 2 + kDigit * 128) / kDigit - 128;  // round(value / 254)
    q[j] = static_cast<int8_t>(hi);
    lo[j] = static_cast<int8_t>(value - kDigit * hi);
  }
  *dx = d;
  *sx = d * static_cast<float>(sum);
}

#if defined(RILL_QUANT_AVX2)
// quantize_block on 8 lanes at a time, the same values: a maximum and an integer sum are exact in any order, the
// products are the same IEEE operations, vroundps rounds half to even as nearbyint does (the default mode), and
// hi = floor((value + 127) / 254) in float is exact (a quotient that is not an integer is at least 1/254 from
// one, far more than the division's rounding).
void quantize_block_avx2(const float* v, bool wide, int8_t* q, int8_t* lo, float* dx, float* sx) {
  __m256 x[4], amax = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int j = 0; j < 4; ++j) {
    x[j] = _mm256_loadu_ps(v + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_and_ps(x[j], magnitude));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float d = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_movehdup_ps(m4))) / (wide ? 127.0f * kDigit : 127.0f);
  const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  // 32 int32 lanes (4 vectors, inputs in order) -> 32 int8: packs interleave the 128-bit halves, a permute undoes it.
  const auto narrow = [](const __m256i* w, int8_t* out) {
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3]));
    const __m256i order = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), order);
  };
  __m256i values[4], highs[4], lows[4], sum = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    const __m256 value = _mm256_round_ps(_mm256_mul_ps(x[j], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    values[j] = _mm256_cvtps_epi32(value);
    sum = _mm256_add_epi32(sum, values[j]);
    if (wide) {
      const __m256 hi = _mm256_floor_ps(_mm256_div_ps(_mm256_add_ps(value, _mm256_set1_ps(kDigit / 2)),
                                                      _mm256_set1_ps(kDigit)));
      highs[j] = _mm256_cvtps_epi32(hi);
      lows[j] = _mm256_cvtps_epi32(_mm256_fnmadd_ps(hi, _mm256_set1_ps(kDigit), value));  // exact
    }
  }
  if (wide) {
    narrow(highs, q);
    narrow(lows, lo);
  } else {
    narrow(values, q);
  }
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  *dx = d;
  *sx = d * static_cast<float>(_mm_cvtsi128_si32(s4));
}
#endif

// x for the tiles (QuantizedRows), each block of 32 on its own; `portable` keeps to the plain C++ (the same values).
void prepare_rows(const float* x, int64_t m, int64_t k, int64_t activations, QuantizedRows* out, int num_threads,
                  bool portable) {
  const int64_t blocks = k / kSub, grouped = (m + kTileRows - 1) / kTileRows * kTileRows * blocks;
  const bool wide = activations == kActInt16;
  out->x = x;
  out->blocks = blocks;
  out->sx.resize(grouped);
  if (activations != kActFloat32) {
    out->q.resize(m * k);
    out->lo.resize(wide ? m * k : 0);
    out->dx.resize(grouped);
  }
#if defined(RILL_QUANT_AVX2)
  const auto quantize = portable ? quantize_block : quantize_block_avx2;
#else
  (void)portable;
  const auto quantize = quantize_block;
#endif
  at::parallel_for(0, m * blocks, num_threads > 1 && m * k >= (1 << 16) ? 256 : m * blocks + 1,
                   [&](int64_t begin, int64_t end) {
                     for (int64_t i = begin; i < end; ++i) {
                       const int64_t offset = (i / blocks) * k + (i % blocks) * kSub;
                       const int64_t at = out->at(i / blocks, i % blocks);
                       if (activations == kActFloat32) {
                         float sum = 0.0f;
                         for (int j = 0; j < kSub; ++j) sum += x[offset + j];
                         out->sx[at] = sum;
                       } else {
                         quantize(x + offset, wide, out->q.data() + offset, wide ? out->lo.data() + offset : nullptr,
                                  &out->dx[at], &out->sx[at]);
                       }
                     }
                   });
}

// The fixed tree over eight lanes: (l0 + l4, l1 + l5, l2 + l6, l3 + l7), then pairs 2 apart, then the last two.
inline float lane_tree(const float* l) {
  const float a0 = l[0] + l[4], a1 = l[1] + l[5], a2 = l[2] + l[6], a3 = l[3] + l[7];
  const float b0 = a0 + a2, b1 = a1 + a3;
  return b0 + b1;
}

// One weight row (its blocks at `w`) against `rows` rows of x starting at row r0 (float32 x, or the rows'
// integer blocks as Act says): y[i * ldy].
template <int64_t QT, int64_t Act>
void tile_portable(const uint8_t* w, int64_t k, const QuantizedRows& xr, int64_t r0, int rows, float* y,
                   int64_t ldy) {
  constexpr int64_t block_bytes = quant_block_bytes(QT), subs = kBlockElems<QT> / kSub;
  const int64_t blocks = k / kBlockElems<QT>;
  float acc[kTileRows][8] = {}, macc[kTileRows] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    for (int s = 0; s < subs; ++s) {
      SubBlock sub;
      decode<QT>(w + b * block_bytes, s, &sub);
      float q[kSub];
      if constexpr (Act == kActFloat32) {
        for (int e = 0; e < kSub; ++e) q[e] = static_cast<float>(sub.q[e] * sub.scale16[e / 16]);
      }
      const int64_t g = b * subs + s;
      for (int r = 0; r < rows; ++r) {
        if constexpr (Act != kActFloat32) {  // one chain, acc[r][0]
          const int64_t offset = (r0 + r) * k + g * kSub, at = xr.at(r0 + r, g);
          const auto isum = [&](const std::vector<int8_t>& xq) {
            int32_t sum = 0;
            for (int e = 0; e < kSub; ++e) sum += sub.q[e] * xq[offset + e] * sub.scale16[e / 16];
            return static_cast<float>(sum);
          };
          const float sum = Act == kActInt16 ? std::fmaf(isum(xr.q), kDigit, isum(xr.lo)) : isum(xr.q);
          acc[r][0] = std::fmaf(sum, sub.d * xr.dx[at], acc[r][0]);
          if constexpr (kHasMin<QT>) acc[r][0] = std::fmaf(sub.m, xr.sx[at], acc[r][0]);
        } else {
          const float* xv = xr.x + (r0 + r) * k + g * kSub;
          for (int l = 0; l < 8; ++l) {
            float lane = xv[l] * q[l];
            for (int part = 1; part < 4; ++part) lane = std::fmaf(xv[8 * part + l], q[8 * part + l], lane);
            acc[r][l] = std::fmaf(lane, sub.d, acc[r][l]);
          }
          if constexpr (kHasMin<QT>) macc[r] = std::fmaf(sub.m, xr.sx[xr.at(r0 + r, g)], macc[r]);
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r) y[r * ldy] = Act != kActFloat32 ? acc[r][0] : lane_tree(acc[r]) + macc[r];
}

#if defined(RILL_QUANT_AVX2)
// 16 bytes of nibbles -> 32 bytes: the low nibbles (inputs 0..15), then the high ones (16..31).
inline __m256i nibbles_16(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_set1_epi8(0xf);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
}

// Byte i = 0xff where bit i of `bits` is set, else 0.
inline __m256i bytes_from_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  // Every bit set but bit i % 8 of byte i: the byte is all ones exactly when that bit was set.
  return _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                           _mm256_set1_epi64x(-1));
}

// Sub-block s of the block at `b` as 32 bytes (signed types: int8; else unsigned 0..31), and the multipliers of
// the int16 pair sums (Q6_K's scale of each half; else ones).
template <int64_t QT>
inline __m256i quants_avx2(const uint8_t* b, int s, __m256i* mul) {
  const __m256i low4 = _mm256_set1_epi8(0xf);
  if constexpr (QT == kQ6_K) {
    const int half = s / 4, t = s % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32 * (t % 2)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
    const auto* scales = reinterpret_cast<const int8_t*>(b + 192 + 8 * half);
    *mul = _mm256_set_m128i(_mm_set1_epi16(scales[2 * t + 1]), _mm_set1_epi16(scales[2 * t]));
    const __m256i lowbits = _mm256_and_si256(t < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
    const __m256i highbits =
        _mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), _mm256_set1_epi8(3));  // 2 bits, in bits 0..1
    return _mm256_sub_epi8(_mm256_or_si256(lowbits, _mm256_slli_epi16(highbits, 4)), _mm256_set1_epi8(32));
  } else {
    *mul = _mm256_set1_epi16(1);
    if constexpr (QT == kQ8_0) {
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    } else if constexpr (QT == kQ4_0 || QT == kQ4_1) {
      return nibbles_16(b + (QT == kQ4_0 ? 2 : 4));
    } else if constexpr (QT == kQ5_0 || QT == kQ5_1) {
      const int head = QT == kQ5_0 ? 2 : 4;
      uint32_t qh;
      std::memcpy(&qh, b + head, sizeof qh);
      const __m256i high = _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(0x10));
      return _mm256_or_si256(nibbles_16(b + head + 4), high);
    } else {  // Q4_K, Q5_K
      const __m256i qs =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (QT == kQ4_K ? 16 : 48) + 32 * (s / 2)));
      __m256i v = _mm256_and_si256(s % 2 == 0 ? qs : _mm256_srli_epi16(qs, 4), low4);
      if constexpr (QT == kQ5_K) {
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << s));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
        v = _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
      }
      return v;
    }
  }
}

inline float lane_tree_avx2(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l_i + l_{i+4}
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));                                  // a_i + a_{i+2}
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));                              // b_0 + b_1
}

// 32 small integers as four vectors of 8 floats (Q6_K: times the integer scale of each half, exact in float).
template <int64_t QT>
inline void widen_avx2(__m256i q, __m256i mul, __m256* out) {
  const __m128i low = _mm256_castsi256_si128(q), high = _mm256_extracti128_si256(q, 1);
  const auto widen = [](__m128i v) { return kSigned<QT> ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v); };
  out[0] = _mm256_cvtepi32_ps(widen(low));
  out[1] = _mm256_cvtepi32_ps(widen(_mm_srli_si128(low, 8)));
  out[2] = _mm256_cvtepi32_ps(widen(high));
  out[3] = _mm256_cvtepi32_ps(widen(_mm_srli_si128(high, 8)));
  if constexpr (QT == kQ6_K) {
    const __m256 first = _mm256_set1_ps(static_cast<float>(static_cast<int16_t>(_mm256_extract_epi16(mul, 0))));
    const __m256 second = _mm256_set1_ps(static_cast<float>(static_cast<int16_t>(_mm256_extract_epi16(mul, 8))));
    out[0] = _mm256_mul_ps(out[0], first);
    out[1] = _mm256_mul_ps(out[1], first);
    out[2] = _mm256_mul_ps(out[2], second);
    out[3] = _mm256_mul_ps(out[3], second);
  } else {
    (void)mul;
  }
}

// The 32 weights q of sub-block s of the block at `b` as four vectors of 8 floats (inputs 0-7, 8-15, 16-23,
// 24-31): widen_avx2 of quants_avx2, except for the 4-bit types, whose bytes are widened straight from memory
// and split into nibbles as int32s (fewer instructions; the same values).
template <int64_t QT>
inline void weights_f32_avx2(const uint8_t* b, int s, __m256* out) {
  const __m256i low4 = _mm256_set1_epi32(0xf);
  const auto bytes8 = [](const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  };
  if constexpr (QT == kQ4_0 || QT == kQ4_1) {  // byte i: input i in its low nibble, 16 + i in its high one
    const uint8_t* qs = b + (QT == kQ4_0 ? 2 : 4);
    const __m256i first = bytes8(qs), second = bytes8(qs + 8);
    out[0] = _mm256_cvtepi32_ps(_mm256_and_si256(first, low4));
    out[1] = _mm256_cvtepi32_ps(_mm256_and_si256(second, low4));
    out[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4));
    out[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4));
  } else if constexpr (QT == kQ4_K) {  // byte i: input i of sub-block s, in the low nibble for an even s
    const uint8_t* qs = b + 16 + 32 * (s / 2);
    for (int j = 0; j < 4; ++j) {
      const __m256i v = bytes8(qs + 8 * j);
      out[j] = _mm256_cvtepi32_ps(s % 2 == 0 ? _mm256_and_si256(v, low4) : _mm256_srli_epi32(v, 4));
    }
  } else {
    __m256i mul;
    const __m256i q = quants_avx2<QT>(b, s, &mul);
    widen_avx2<QT>(q, mul, out);
  }
}

// C weight rows (`row_bytes` apart) against R rows of float32 x: y[r * ldy + c]. Each (r, c) has its own
// chains; C > 1 serves small batches, whose single chain per output would otherwise wait on its own latency.
template <int64_t QT, int R, int C>
void tile_avx2(const uint8_t* w, int64_t row_bytes, int64_t k, const QuantizedRows& xr, int64_t r0, float* y,
               int64_t ldy) {
  constexpr int64_t block_bytes = quant_block_bytes(QT), subs = kBlockElems<QT> / kSub;
  const int64_t blocks = k / kBlockElems<QT>;
  __m256 acc[R][C];
  float macc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      acc[r][c] = _mm256_setzero_ps();
      macc[r][c] = 0.0f;
    }
  }
  for (int64_t b = 0; b < blocks; ++b) {
    for (int s = 0; s < subs; ++s) {
      const int64_t g = b * subs + s;
      __m256 wf[C][4];
      float d[C], m[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        m[c] = 0.0f;
        sub_scales<QT>(w + c * row_bytes + b * block_bytes, s, &d[c], &m[c]);
        weights_f32_avx2<QT>(w + c * row_bytes + b * block_bytes, s, wf[c]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float* xv = xr.x + (r0 + r) * k + g * kSub;
        const __m256 x0 = _mm256_loadu_ps(xv), x1 = _mm256_loadu_ps(xv + 8);
        const __m256 x2 = _mm256_loadu_ps(xv + 16), x3 = _mm256_loadu_ps(xv + 24);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          __m256 lane = _mm256_mul_ps(x0, wf[c][0]);
          lane = _mm256_fmadd_ps(x1, wf[c][1], lane);
          lane = _mm256_fmadd_ps(x2, wf[c][2], lane);
          lane = _mm256_fmadd_ps(x3, wf[c][3], lane);
          acc[r][c] = _mm256_fmadd_ps(lane, _mm256_set1_ps(d[c]), acc[r][c]);
        }
        if constexpr (kHasMin<QT>) {
#pragma GCC unroll 4
          for (int c = 0; c < C; ++c) macc[r][c] = std::fmaf(m[c], xr.sx[xr.at(r0 + r, g)], macc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) y[r * ldy + c] = lane_tree_avx2(acc[r][c]) + macc[r][c];
  }
}

// kTileRows rows of float32 x from r0 (a multiple of kTileRows) against one weight row: tile_avx2's arithmetic
// with R = kTileRows, C = 1, the rows' block sums read as a vector: per sub-block one fused multiply-add advances
// the eight min chains, each lane what the scalar operation computes.
template <int64_t QT>
void tile8_avx2(const uint8_t* w, int64_t k, const QuantizedRows& xr, int64_t r0, float* y, int64_t ldy) {
  constexpr int64_t block_bytes = quant_block_bytes(QT), subs = kBlockElems<QT> / kSub;
  const int64_t blocks = k / kBlockElems<QT>;
  __m256 acc[kTileRows], macc = _mm256_setzero_ps();
  for (int r = 0; r < kTileRows; ++r) acc[r] = _mm256_setzero_ps();
  const float* sx8 = xr.sx.data() + xr.at(r0, 0);
  for (int64_t b = 0; b < blocks; ++b) {
    for (int s = 0; s < subs; ++s) {
      const int64_t g = b * subs + s;
      float d, m = 0.0f;
      sub_scales<QT>(w + b * block_bytes, s, &d, &m);
      if constexpr (kHasMin<QT>) {
        macc = _mm256_fmadd_ps(_mm256_set1_ps(m), _mm256_loadu_ps(sx8 + g * kTileRows), macc);
      }
      __m256 wf[4];
      weights_f32_avx2<QT>(w + b * block_bytes, s, wf);
      const __m256 scale = _mm256_set1_ps(d);
#pragma GCC unroll 8
      for (int r = 0; r < kTileRows; ++r) {
        const float* xv = xr.x + (r0 + r) * k + g * kSub;
        __m256 lane = _mm256_mul_ps(_mm256_loadu_ps(xv), wf[0]);
        lane = _mm256_fmadd_ps(_mm256_loadu_ps(xv + 8), wf[1], lane);
        lane = _mm256_fmadd_ps(_mm256_loadu_ps(xv + 16), wf[2], lane);
        lane = _mm256_fmadd_ps(_mm256_loadu_ps(xv + 24), wf[3], lane);
        acc[r] = _mm256_fmadd_ps(lane, scale, acc[r]);
      }
    }
  }
  alignas(32) float mins[kTileRows];
  _mm256_store_ps(mins, macc);
  for (int r = 0; r < kTileRows; ++r) y[r * ldy] = lane_tree_avx2(acc[r]) + mins[r];
}

template <int64_t QT, int R, int C>
void tile_rows_avx2(int rows, const uint8_t* w, int64_t row_bytes, int64_t k, const QuantizedRows& xq, int64_t r0,
                    float* y, int64_t ldy) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows_avx2<QT, R - 1, C>(rows, w, row_bytes, k, xq, r0, y, ldy);
  }
  tile_avx2<QT, R, C>(w, row_bytes, k, xq, r0, y, ldy);
}

// Where region i of a block of an interleaved type starts in a group's block (ops.h: the group's regions before it).
constexpr int64_t region_at(int64_t qtype, int i) { return kInterleavedRows * quant_region(qtype, i).start; }

// The lines `bytes` long at kPrefetchAhead bytes past `p`, requested ahead of their use: a group's blocks are
// read in order, so the next few are. Only the first tile of rows of x over a group (`stream`) asks: the others
// find the group in cache.
constexpr int64_t kPrefetchAhead = 2048;
inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAhead + line), _MM_HINT_T0);
  }
}

// The integer tiles' vector operations at either width, so that each tile is written once: 256-bit vectors (8
// int32 or float lanes) and, where the build has AVX-512 with VNNI, 512-bit ones (16 lanes). An interleaved
// group's tiles use the width whose lanes are its rows (GroupI, GroupF); the row-by-row tile, 256-bit.
template <typename V>
V v_zero();
template <typename V>
V v_set1(float v);
template <typename V>
V v_set1_8(int v);
template <typename V>
V v_set1_32(int v);
template <typename V>
V v_load(const uint8_t* p);
template <typename V>
V v_halves(const uint8_t* p);  // a float16 per lane, as floats
template <typename V>
V v_scale_pairs(const uint8_t* p);  // an int8 per lane, in both int16 halves of its int32 lane

template <>
inline __m256i v_zero() { return _mm256_setzero_si256(); }
template <>
inline __m256 v_zero() { return _mm256_setzero_ps(); }
template <>
inline __m256 v_set1(float v) { return _mm256_set1_ps(v); }
template <>
inline __m256i v_set1_8(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
template <>
inline __m256i v_set1_32(int v) { return _mm256_set1_epi32(v); }
template <>
inline __m256i v_load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
template <>
inline __m256 v_halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <>
inline __m256i v_scale_pairs(const uint8_t* p) {
  const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(v, 16));
}
inline __m256i v_and(__m256i a, __m256i b) { return _mm256_and_si256(a, b); }
inline __m256i v_or(__m256i a, __m256i b) { return _mm256_or_si256(a, b); }
inline __m256i v_sub8(__m256i a, __m256i b) { return _mm256_sub_epi8(a, b); }
inline __m256i v_add16(__m256i a, __m256i b) { return _mm256_add_epi16(a, b); }
inline __m256i v_add32(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }
inline __m256i v_srl16(__m256i a, int n) { return _mm256_srli_epi16(a, n); }
inline __m256i v_sll16(__m256i a, int n) { return _mm256_slli_epi16(a, n); }
inline __m256i v_srl32(__m256i a, int n) { return _mm256_srli_epi32(a, n); }
inline __m256i v_sll32(__m256i a, int n) { return _mm256_slli_epi32(a, n); }
inline __m256i v_bcast32(__m256i, const int32_t* p) { return _mm256_set1_epi32(*p); }
inline __m256i v_maddubs(__m256i u, __m256i s) { return _mm256_maddubs_epi16(u, s); }
// |w| and x with w's signs (negated where w < 0): the unsigned-by-signed byte products give w * x.
inline void v_abs_signed(__m256i w, __m256i x, __m256i* aw, __m256i* sx) {
  *aw = _mm256_sign_epi8(w, w);
  *sx = _mm256_sign_epi8(x, w);
}
// acc + the int16 pair products of a and b, summed per int32 lane.
inline __m256i v_dpwssd(__m256i acc, __m256i a, __m256i b) {
#if defined(RILL_QUANT_VNNI)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
#if defined(RILL_QUANT_VNNI)
// acc + the 4 unsigned-by-signed byte products of each int32 lane, summed.
inline __m256i v_dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#endif
inline __m256 v_cvt(__m256i a) { return _mm256_cvtepi32_ps(a); }
inline __m256 v_mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
inline __m256 v_fmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 v_neg(__m256 a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
inline void v_store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

#if defined(RILL_QUANT_AVX512)
template <>
inline __m512i v_zero() { return _mm512_setzero_si512(); }
template <>
inline __m512 v_zero() { return _mm512_setzero_ps(); }
template <>
inline __m512 v_set1(float v) { return _mm512_set1_ps(v); }
template <>
inline __m512i v_set1_8(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
template <>
inline __m512i v_set1_32(int v) { return _mm512_set1_epi32(v); }
template <>
inline __m512i v_load(const uint8_t* p) { return _mm512_loadu_si512(p); }
template <>
inline __m512 v_halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <>
inline __m512i v_scale_pairs(const uint8_t* p) {
  const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(v, 16));
}
inline __m512i v_and(__m512i a, __m512i b) { return _mm512_and_si512(a, b); }
inline __m512i v_or(__m512i a, __m512i b) { return _mm512_or_si512(a, b); }
inline __m512i v_sub8(__m512i a, __m512i b) { return _mm512_sub_epi8(a, b); }
inline __m512i v_add16(__m512i a, __m512i b) { return _mm512_add_epi16(a, b); }
inline __m512i v_add32(__m512i a, __m512i b) { return _mm512_add_epi32(a, b); }
inline __m512i v_srl16(__m512i a, int n) { return _mm512_srl_epi16(a, _mm_cvtsi32_si128(n)); }
inline __m512i v_sll16(__m512i a, int n) { return _mm512_sll_epi16(a, _mm_cvtsi32_si128(n)); }
inline __m512i v_srl32(__m512i a, int n) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)); }
inline __m512i v_sll32(__m512i a, int n) { return _mm512_sll_epi32(a, _mm_cvtsi32_si128(n)); }
inline __m512i v_bcast32(__m512i, const int32_t* p) { return _mm512_set1_epi32(*p); }
inline __m512i v_maddubs(__m512i u, __m512i s) { return _mm512_maddubs_epi16(u, s); }
inline void v_abs_signed(__m512i w, __m512i x, __m512i* aw, __m512i* sx) {
  *aw = _mm512_abs_epi8(w);  // -128 -> 128 as an unsigned byte, as vpsignb gives
  *sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);  // where w = 0, |w| x = 0
}
inline __m512i v_dpwssd(__m512i acc, __m512i a, __m512i b) { return _mm512_dpwssd_epi32(acc, a, b); }
inline __m512i v_dpbusd(__m512i acc, __m512i u, __m512i s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline __m512 v_cvt(__m512i a) { return _mm512_cvtepi32_ps(a); }
inline __m512 v_mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
inline __m512 v_fmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 v_neg(__m512 a) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN)));
}
inline void v_store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
using GroupI = __m512i;
using GroupF = __m512;
#else
using GroupI = __m256i;
using GroupF = __m256;
#endif
static_assert(sizeof(GroupF) == 4 * kInterleavedRows, "a group vector holds a float (or 4 bytes) of each row");
constexpr int64_t kGroupBytes = sizeof(GroupI);  // one unit of 4 bytes of every row of a group

// The R accumulators of an integer tile (a lane per weight row), stored: y[r * ldy + c] for c < valid.
template <int R, typename V>
inline void store_rows(const V* acc, int valid, float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r) {
    alignas(64) float out[sizeof(V) / 4];
    v_store(out, acc[r]);
    std::memcpy(y + r * ldy, out, valid * sizeof(float));
  }
}

// The exact sums of one sub-block, a lane per row: pieces w[0..7] (w[p]: 4 inputs 4p..4p+3 of each row, unsigned,
// at most Max) against the sub-block's 32 int8 inputs of one row of x, xq (as 8 int32).
template <int Max, typename V>
inline V sums_unsigned(const V* w, const int32_t* xq) {
#if defined(RILL_QUANT_VNNI)
  // Two chains, so that a sub-block waits on four vpdpbusd latencies, not eight.
  V even = v_zero<V>(), odd = v_zero<V>();
#pragma GCC unroll 4
  for (int p = 0; p < 8; p += 2) {
    even = v_dpbusd(even, w[p], v_bcast32(even, xq + p));
    odd = v_dpbusd(odd, w[p + 1], v_bcast32(odd, xq + p + 1));
  }
  return v_add32(even, odd);
#else
  // maddubs' pair sums (each at most 2 * Max * 127) added in int16 while they fit: 8 pieces of 4-bit weights, 4 of
  // 5-bit ones; then to int32.
  constexpr int run = Max <= 15 ? 8 : 4;
  static_assert(run * 2 * Max * 127 <= 32767, "the int16 sums would saturate");
  __m256i isum = _mm256_setzero_si256();
  for (int first = 0; first < 8; first += run) {
    __m256i pairs = _mm256_maddubs_epi16(w[first], _mm256_set1_epi32(xq[first]));
#pragma GCC unroll 8
    for (int p = first + 1; p < first + run; ++p) {
      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[p], _mm256_set1_epi32(xq[p])));
    }
    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  return isum;
#endif
}

// sums_unsigned for signed weights (Q8_0: w[p] the int8 weights of inputs 4p..4p+3): |w| against x with w's signs.
template <typename V>
inline V sums_signed(const V* w, const int32_t* xq) {
  V even = v_zero<V>(), odd = v_zero<V>();
#pragma GCC unroll 4
  for (int p = 0; p < 8; p += 2) {
    V aw, sx;
    v_abs_signed(w[p], v_bcast32(even, xq + p), &aw, &sx);
#if defined(RILL_QUANT_VNNI)
    even = v_dpbusd(even, aw, sx);
    v_abs_signed(w[p + 1], v_bcast32(odd, xq + p + 1), &aw, &sx);
    odd = v_dpbusd(odd, aw, sx);
#else
    even = _mm256_add_epi32(even, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1)));
    v_abs_signed(w[p + 1], v_bcast32(odd, xq + p + 1), &aw, &sx);
    odd = _mm256_add_epi32(odd, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1)));
#endif
  }
  return v_add32(even, odd);
}

// Eight int32 vectors -> one: lane c is the sum of p[c]'s eight lanes (integers: any order gives the same sum).
inline __m256i sum_lanes8(const __m256i* p) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  // a = (p0..p3 over lanes 0-3 | p0..p3 over lanes 4-7), b likewise for p4..p7.
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// The lanes' sums of one sub-block against one row of x whose int8 inputs start at `offset` of xr.q:
// float(sums(inputs)), or with Wide (int16 activations) fma(float(sums(high digits)), 254, float(sums(low
// digits))). sums(const int8_t*) gives a vector of exact integer sums (a lane per weight row) against 32 int8
// inputs.
template <bool Wide, typename Sums>
inline auto digit_sums(const QuantizedRows& xr, int64_t offset, const Sums& sums) {
  const auto hi = v_cvt(sums(xr.q.data() + offset));
  if constexpr (!Wide) return hi;
  return v_fmadd(hi, v_set1<std::remove_const_t<decltype(hi)>>(kDigit), v_cvt(sums(xr.lo.data() + offset)));
}

// kTileRows weight rows of a type kept row by row (Q5_0, Q5_1: `row_bytes` apart; `valid` of them real, the
// others repeat the last) against R rows of integer x from r0: y[r * ldy + c] for c < valid. Per sub-block the
// eight rows' exact integer sums against one row of x are one vector, converted and multiplied by the eight
// d * dx at once (each lane the scalar operations).
template <int64_t QT, int R, bool Wide>
void tile_int8_avx2(const uint8_t* w, int64_t row_bytes, int valid, int64_t k, const QuantizedRows& xr, int64_t r0,
                    float* y, int64_t ldy) {
  static_assert(!kSigned<QT> && !quant_interleaved(QT, kActInt8), "the interleaved types have tiles of their own");
  constexpr int64_t block_bytes = quant_block_bytes(QT), subs = kBlockElems<QT> / kSub;
  const int64_t blocks = k / kBlockElems<QT>;
  const uint8_t* rows[kTileRows];
  for (int c = 0; c < kTileRows; ++c) rows[c] = w + std::min(c, valid - 1) * row_bytes;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    // The 8 rows' d and m of every sub-block of the block first, [sub-block][row]: a K type's block scales are
    // converted once per block, not once per sub-block.
    alignas(32) float d[subs][kTileRows], m[subs][kTileRows] = {};
    for (int c = 0; c < kTileRows; ++c) {
      for (int s = 0; s < subs; ++s) sub_scales<QT>(rows[c] + b * block_bytes, s, &d[s][c], &m[s][c]);
    }
    for (int s = 0; s < subs; ++s) {
      const int64_t g = b * subs + s;
      __m256i q[kTileRows], mul;
#pragma GCC unroll 8
      for (int c = 0; c < kTileRows; ++c) q[c] = quants_avx2<QT>(rows[c] + b * block_bytes, s, &mul);
      const __m256 d8 = _mm256_load_ps(d[s]), m8 = _mm256_load_ps(m[s]);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 sum = digit_sums<Wide>(xr, (r0 + r) * k + g * kSub, [&](const int8_t* x) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
          __m256i p[kTileRows];
#pragma GCC unroll 8
          for (int c = 0; c < kTileRows; ++c) {
#if defined(RILL_QUANT_VNNI)
            p[c] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q[c], xv);
#else
            p[c] = _mm256_madd_epi16(_mm256_maddubs_epi16(q[c], xv), _mm256_set1_epi16(1));
#endif
          }
          return sum_lanes8(p);
        });
        const int64_t at = xr.at(r0 + r, g);
        acc[r] = _mm256_fmadd_ps(sum, _mm256_mul_ps(d8, _mm256_set1_ps(xr.dx[at])), acc[r]);
        acc[r] = _mm256_fmadd_ps(m8, _mm256_set1_ps(xr.sx[at]), acc[r]);
      }
    }
  }
  store_rows<R>(acc, valid, y, ldy);
}


// One group of an interleaved Q4_0, Q4_1 or Q8_0 part (ops.h; kInterleavedRows rows, `valid` of them real) against
// R rows of integer x from r0: y[r * ldy + c] for c < valid. A vector of a piece holds 4 inputs of each row of the
// group, so one product against those 4 inputs of x, broadcast, serves all its rows: tile_int8_avx2's sums,
// without a transpose.
template <int64_t QT, int R, bool Wide>
void tile_group(const uint8_t* group, int valid, int64_t k, const QuantizedRows& xr, int64_t r0, float* y,
                int64_t ldy, bool stream) {
  constexpr int64_t block_bytes = quant_block_bytes(QT);
  constexpr int pieces = QT == kQ8_0 ? 8 : 4;  // vectors of quants per block of the group
  const int64_t blocks = k / kSub;
  GroupF acc[R];
  for (int r = 0; r < R; ++r) acc[r] = v_zero<GroupF>();
  const GroupI low4 = v_set1_8<GroupI>(0xf);
  for (int64_t g = 0; g < blocks; ++g) {
    const uint8_t* b = group + g * kInterleavedRows * block_bytes;
    if (stream) prefetch_ahead(b, kInterleavedRows * block_bytes);
    const GroupF d8 = v_halves<GroupF>(b);  // region 0: d
    GroupF m8 = v_zero<GroupF>();
    if constexpr (QT == kQ4_0) m8 = v_mul(v_set1<GroupF>(-8.0f), d8);
    if constexpr (QT == kQ4_1) m8 = v_halves<GroupF>(b + region_at(QT, 1));  // region 1: m
    const uint8_t* quants = b + region_at(QT, QT == kQ4_1 ? 2 : 1);
    // Q4: piece p holds inputs 4p..4p+3 in its low nibbles, 16+4p..16+4p+3 in its high ones; Q8_0: 4p..4p+3.
    // w[p]: the weights of inputs 4p..4p+3.
    GroupI w[8];
#pragma GCC unroll 8
    for (int p = 0; p < pieces; ++p) {
      const GroupI v = v_load<GroupI>(quants + p * kGroupBytes);
      if constexpr (QT == kQ8_0) {
        w[p] = v;
      } else {
        w[p] = v_and(v, low4);
        w[p + 4] = v_and(v_srl16(v, 4), low4);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const GroupF sum = digit_sums<Wide>(xr, (r0 + r) * k + g * kSub, [&](const int8_t* x) {
        const auto* xq = reinterpret_cast<const int32_t*>(x);
        if constexpr (QT == kQ8_0) return sums_signed(w, xq);
        else return sums_unsigned<15>(w, xq);
      });
      const int64_t at = xr.at(r0 + r, g);
      acc[r] = v_fmadd(sum, v_mul(d8, v_set1<GroupF>(xr.dx[at])), acc[r]);
      if constexpr (kHasMin<QT>) acc[r] = v_fmadd(m8, v_set1<GroupF>(xr.sx[at]), acc[r]);
    }
  }
  store_rows<R>(acc, valid, y, ldy);
}

// tile_group for Q4_K and Q5_K: per super-block the group's d and dmin, and the 6-bit scales and mins as three
// vectors of words (a row's 12 bytes, lane by lane), unpacked for all rows at once with shifts and masks; Q5_K's
// fifth bit of input i of sub-block s is bit s of qh's byte i, merged into the nibble as 16.
template <int64_t QT, int R, bool Wide>
void tile_group_k4(const uint8_t* group, int valid, int64_t k, const QuantizedRows& xr, int64_t r0, float* y,
                   int64_t ldy, bool stream) {
  static_assert(QT == kQ4_K || QT == kQ5_K);
  constexpr int64_t block_bytes = quant_block_bytes(QT), quants = region_at(QT, QT == kQ5_K ? 4 : 3);
  const int64_t blocks = k / 256;
  GroupF acc[R];
  for (int r = 0; r < R; ++r) acc[r] = v_zero<GroupF>();
  const GroupI low4 = v_set1_8<GroupI>(0xf), six = v_set1_32<GroupI>(63), four = v_set1_32<GroupI>(15);
  const GroupI two = v_set1_32<GroupI>(3);
  for (int64_t sb = 0; sb < blocks; ++sb) {
    const uint8_t* b = group + sb * kInterleavedRows * block_bytes;
    if (stream) prefetch_ahead(b, kInterleavedRows * block_bytes);
    const auto load = [b](int64_t offset) { return v_load<GroupI>(b + offset); };
    const GroupF d8 = v_halves<GroupF>(b), dmin8 = v_halves<GroupF>(b + region_at(QT, 1));
    const int64_t scales = region_at(QT, 2);  // bytes 0-3, 4-7, 8-11 of the scales: 3 units
    const GroupI w0 = load(scales), w1 = load(scales + kGroupBytes), w2 = load(scales + 2 * kGroupBytes);
    for (int pair = 0; pair < 4; ++pair) {
      GroupI v[8];
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) v[p] = load(quants + (8 * pair + p) * kGroupBytes);
      for (int h = 0; h < 2; ++h) {
        const int s = 2 * pair + h;  // scale_min_k4, lane by lane
        GroupI scale, min;
        if (s < 4) {
          scale = v_and(v_srl32(w0, 8 * s), six);
          min = v_and(v_srl32(w1, 8 * s), six);
        } else {
          const int u = 8 * (s - 4);
          scale = v_or(v_and(v_srl32(w2, u), four), v_sll32(v_and(v_srl32(w0, u + 6), two), 4));
          min = v_or(v_and(v_srl32(w2, u + 4), four), v_sll32(v_and(v_srl32(w1, u + 6), two), 4));
        }
        const GroupF d = v_mul(d8, v_cvt(scale));
        const GroupF m = v_neg(v_mul(dmin8, v_cvt(min)));
        GroupI w[8];
#pragma GCC unroll 8
        for (int p = 0; p < 8; ++p) {
          w[p] = v_and(h == 0 ? v[p] : v_srl16(v[p], 4), low4);
          if constexpr (QT == kQ5_K) {  // bit s of each byte of qh's piece p, moved to bit 4 of its byte
            const GroupI bit = v_and(load(region_at(QT, 3) + p * kGroupBytes), v_set1_8<GroupI>(1 << s));
            w[p] = v_or(w[p], s < 4 ? v_sll16(bit, 4 - s) : v_srl16(bit, s - 4));
          }
        }
        const int64_t g = sb * 8 + s;
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const GroupF sum = digit_sums<Wide>(xr, (r0 + r) * k + g * kSub, [&](const int8_t* x) {
            return sums_unsigned<QT == kQ5_K ? 31 : 15>(w, reinterpret_cast<const int32_t*>(x));
          });
          const int64_t at = xr.at(r0 + r, g);
          acc[r] = v_fmadd(sum, v_mul(d, v_set1<GroupF>(xr.dx[at])), acc[r]);
          acc[r] = v_fmadd(m, v_set1<GroupF>(xr.sx[at]), acc[r]);
        }
      }
    }
  }
  store_rows<R>(acc, valid, y, ldy);
}

// tile_group for Q6_K: a sub-block's quants from 8 pieces of ql and 8 of qh; each half of 16 inputs summed in
// int16 (4 * 2 * 32 * 127 fits) and multiplied by its rows' int8 scales in vpmaddwd.
template <int R, bool Wide>
void tile_group_q6k(const uint8_t* group, int valid, int64_t k, const QuantizedRows& xr, int64_t r0, float* y,
                    int64_t ldy, bool stream) {
  constexpr int64_t block_bytes = quant_block_bytes(kQ6_K);
  const int64_t blocks = k / 256;
  GroupF acc[R];
  for (int r = 0; r < R; ++r) acc[r] = v_zero<GroupF>();
  const GroupI low4 = v_set1_8<GroupI>(0xf), low2 = v_set1_8<GroupI>(3), offset = v_set1_8<GroupI>(32);
  for (int64_t sb = 0; sb < blocks; ++sb) {
    const uint8_t* b = group + sb * kInterleavedRows * block_bytes;
    if (stream) prefetch_ahead(b, kInterleavedRows * block_bytes);
    const auto load = [b](int64_t offset) { return v_load<GroupI>(b + offset); };
    const GroupF d8 = v_halves<GroupF>(b + region_at(kQ6_K, 3));
    for (int s = 0; s < 8; ++s) {
      const int half = s / 4, t = s % 4;
      GroupI q[8];
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        const GroupI ql = load(region_at(kQ6_K, 0) + (16 * half + 8 * (t % 2) + p) * kGroupBytes);
        const GroupI qh = load(region_at(kQ6_K, 1) + (8 * half + p) * kGroupBytes);
        const GroupI lowbits = v_and(t < 2 ? ql : v_srl16(ql, 4), low4);
        const GroupI highbits = v_and(v_srl16(qh, 2 * t), low2);
        q[p] = v_sub8(v_or(lowbits, v_sll16(highbits, 4)), offset);
      }
      // The rows' scales of inputs 0-15 and 16-31 (of the 16 scales, index 8 * half + 2 * t + i; the group's rows
      // side by side), each in both int16 halves of its row's lane.
      GroupI scales[2];
      for (int i = 0; i < 2; ++i) {
        scales[i] = v_scale_pairs<GroupI>(b + region_at(kQ6_K, 2) + kInterleavedRows * (8 * half + 2 * t + i));
      }
      const int64_t g = sb * 8 + s;
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const GroupF sum = digit_sums<Wide>(xr, (r0 + r) * k + g * kSub, [&](const int8_t* x) {
          const auto* xq = reinterpret_cast<const int32_t*>(x);
          GroupI isum = v_zero<GroupI>();
          for (int i = 0; i < 2; ++i) {
            GroupI pairs = v_zero<GroupI>();
#pragma GCC unroll 4
            for (int p = 4 * i; p < 4 * i + 4; ++p) {
              GroupI aq, sx;
              v_abs_signed(q[p], v_bcast32(pairs, xq + p), &aq, &sx);
              pairs = v_add16(pairs, v_maddubs(aq, sx));
            }
            isum = v_dpwssd(isum, pairs, scales[i]);
          }
          return isum;
        });
        const int64_t at = xr.at(r0 + r, g);
        acc[r] = v_fmadd(sum, v_mul(d8, v_set1<GroupF>(xr.dx[at])), acc[r]);
      }
    }
  }
  store_rows<R>(acc, valid, y, ldy);
}

template <int64_t QT, int R, bool Wide>
void tile_int8_rows_avx2(int rows, const uint8_t* w, int64_t row_bytes, int valid, int64_t k,
                         const QuantizedRows& xq, int64_t r0, float* y, int64_t ldy, bool stream) {
  if constexpr (R > 1) {
    if (rows < R) {
      return tile_int8_rows_avx2<QT, R - 1, Wide>(rows, w, row_bytes, valid, k, xq, r0, y, ldy, stream);
    }
  }
  if constexpr (QT == kQ4_K || QT == kQ5_K) {
    tile_group_k4<QT, R, Wide>(w, valid, k, xq, r0, y, ldy, stream);
  } else if constexpr (QT == kQ6_K) {
    tile_group_q6k<R, Wide>(w, valid, k, xq, r0, y, ldy, stream);
  } else if constexpr (quant_interleaved(QT, kActInt8)) {
    tile_group<QT, R, Wide>(w, valid, k, xq, r0, y, ldy, stream);
  } else {
    tile_int8_avx2<QT, R, Wide>(w, row_bytes, valid, k, xq, r0, y, ldy);
  }
}
#endif

// Rows [r_begin, r_end) of x against weight rows [w_begin, w_end) of one part, written to y's columns from
// `column`.
template <int64_t QT>
void part_rows(const uint8_t* part, int64_t k, int64_t activations, const QuantizedRows& xq, int64_t r_begin,
               int64_t r_end, int64_t w_begin, int64_t w_end, float* y, int64_t ldy, int64_t column,
               bool portable) {
  const int64_t row_bytes = k / kBlockElems<QT> * quant_block_bytes(QT);
#if defined(RILL_QUANT_AVX2)
  if (!portable && activations != kActFloat32) {
    const auto tile = activations == kActInt16 ? tile_int8_rows_avx2<QT, kInt8Rows, true>
                                               : tile_int8_rows_avx2<QT, kInt8Rows, false>;
    // An integer tile's weight rows: one interleaved group, or kTileRows rows kept row by row.
    const int64_t step = quant_interleaved(QT, activations) ? kInterleavedRows : kTileRows;
    for (int64_t j = w_begin; j < w_end; j += step) {
      const int valid = static_cast<int>(std::min<int64_t>(step, w_end - j));
      for (int64_t r = r_begin; r < r_end; r += kInt8Rows) {
        const int rows = static_cast<int>(std::min<int64_t>(kInt8Rows, r_end - r));
        tile(rows, part + j * row_bytes, row_bytes, valid, k, xq, r, y + r * ldy + column + j, ldy, r == r_begin);
      }
    }
    return;
  }
  // Small batches: kWeightRows weight rows per tile (their own chains), at most kTileRows / kWeightRows rows of x.
  if (!portable && r_end - r_begin <= kTileRows / kWeightRows) {
    const int rows = static_cast<int>(r_end - r_begin);
    int64_t j = w_begin;
    for (; j + kWeightRows <= w_end; j += kWeightRows) {
      tile_rows_avx2<QT, kTileRows / kWeightRows, kWeightRows>(rows, part + j * row_bytes, row_bytes, k, xq,
                                                               r_begin, y + r_begin * ldy + column + j, ldy);
    }
    for (; j < w_end; ++j) {
      tile_rows_avx2<QT, kTileRows / kWeightRows, 1>(rows, part + j * row_bytes, row_bytes, k, xq, r_begin,
                                                     y + r_begin * ldy + column + j, ldy);
    }
    return;
  }
#endif
  // The portable path (and the float tiles past the AVX2 branches above), a weight row at a time.
  std::vector<uint8_t> file_row(quant_interleaved(QT, activations) ? row_bytes : 0);
  for (int64_t j = w_begin; j < w_end; ++j) {
    const uint8_t* w = part + j * row_bytes;
    if (!file_row.empty()) {  // an interleaved part, portable path: the row as the file holds it
      copy_interleaved_row(QT, row_bytes, j, part, file_row.data(), true);
      w = file_row.data();
    }
    for (int64_t r = r_begin; r < r_end; r += kTileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, r_end - r));
      float* out = y + r * ldy + column + j;
#if defined(RILL_QUANT_AVX2)
      if (!portable && rows == kTileRows && r % kTileRows == 0) {
        tile8_avx2<QT>(w, k, xq, r, out, ldy);
        continue;
      }
      if (!portable) {
        tile_rows_avx2<QT, kTileRows, 1>(rows, w, row_bytes, k, xq, r, out, ldy);
        continue;
      }
#endif
      if (activations == kActInt16) {
        tile_portable<QT, kActInt16>(w, k, xq, r, rows, out, ldy);
      } else if (activations == kActInt8) {
        tile_portable<QT, kActInt8>(w, k, xq, r, rows, out, ldy);
      } else {
        tile_portable<QT, kActFloat32>(w, k, xq, r, rows, out, ldy);
      }
    }
  }
}

template <typename F>
void dispatch_qtype(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int64_t, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int64_t, kQ5_1>{});
    case kQ8_0: return f(std::integral_constant<int64_t, kQ8_0>{});
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int64_t, kQ5_K>{});
    case kQ6_K: return f(std::integral_constant<int64_t, kQ6_K>{});
    default: return;  // the binding accepts only the types above
  }
}

}  // namespace

void copy_interleaved_row(int64_t qtype, int64_t row_bytes, int64_t r, const uint8_t* from, uint8_t* to,
                          bool to_file) {
  const int64_t block = quant_block_bytes(qtype);
  for (int64_t b = 0; b < row_bytes; b += block) {
    for (int i = 0; quant_region(qtype, i).bytes != 0; ++i) {
      const QuantRegion g = quant_region(qtype, i);
      for (int64_t u = b + g.start; u < b + g.start + g.bytes; u += g.unit) {
        const int64_t in_part = interleaved_offset(qtype, row_bytes, r, u);
        std::memcpy(to + (to_file ? u : in_part), from + (to_file ? in_part : u), g.unit);
      }
    }
  }
}

bool has_avx2_quant() {
#if defined(RILL_QUANT_AVX2)
  return true;
#else
  return false;
#endif
}

void quantized_linear(const float* x, const uint8_t* packed, float* y, int64_t m, int64_t k, int64_t n,
                      int num_threads, bool portable) {
  QuantHeader header;
  std::memcpy(&header, packed, sizeof header);
  QuantizedRows xq;
  prepare_rows(x, m, k, header.activations, &xq, num_threads, portable);
  // Tasks: (a block of x rows) x (a chunk of weight rows of one part), in part order.
  struct Task {
    int64_t part, w_begin, w_end, r_begin, r_end, column;
  };
  std::vector<Task> tasks;
  const int64_t num_row_blocks = (m + kRowBlock - 1) / kRowBlock;
  // Blocks of about equal size, whole tiles (so that tiles start at multiples of kTileRows).
  const int64_t row_block = ((m + num_row_blocks - 1) / num_row_blocks + kTileRows - 1) / kTileRows * kTileRows;
  for (int64_t r = 0; r < m; r += row_block) {
    int64_t column = 0;
    for (int64_t p = 0; p < header.num_parts; ++p) {
      const int64_t rows = header.parts[p].rows;
      // One block of rows (a decode step): each weight byte is read once, so a task streams a long run of rows
      // (about 4 tasks a thread); prefill: short chunks, each kept in cache while the row tiles pass over it.
      const int64_t chunk = num_row_blocks > 1 ? kWeightChunk
                          : std::max(kWeightChunk, (rows + 4 * num_threads - 1) / (4 * num_threads) /
                                                       kWeightChunk * kWeightChunk);
      for (int64_t j = 0; j < rows; j += chunk) {
        tasks.push_back({p, j, std::min(rows, j + chunk), r, std::min(m, r + row_block), column});
      }
      column += rows;
    }
  }
  const auto num_tasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::max(1, std::min<int>(num_threads, num_tasks)))
  for (int64_t t = 0; t < num_tasks; ++t) {
    const Task& task = tasks[t];
    const QuantPart& part = header.parts[task.part];
    dispatch_qtype(part.qtype, [&](auto qt) {
      part_rows<decltype(qt)::value>(packed + part.offset, k, header.activations, xq, task.r_begin, task.r_end, task.w_begin,
                                     task.w_end, y, n, task.column, portable);
    });
  }
}

void dequantize_rows(const uint8_t* packed, const int64_t* rows, int64_t num_rows, int64_t k, float* out,
                     int num_threads) {
  QuantHeader header;
  std::memcpy(&header, packed, sizeof header);
  at::parallel_for(0, num_rows, num_threads > 1 && num_rows * k >= (1 << 16) ? 16 : num_rows + 1,
                   [&](int64_t begin, int64_t end) {
                     for (int64_t i = begin; i < end; ++i) {
                       int64_t row = rows[i], p = 0;
                       while (row >= header.parts[p].rows) row -= header.parts[p++].rows;
                       const QuantPart& part = header.parts[p];
                       dispatch_qtype(part.qtype, [&](auto qt) {
                         constexpr int64_t QT = decltype(qt)::value;
                         const int64_t blocks = k / kBlockElems<QT>, bytes = quant_block_bytes(QT);
                         const uint8_t* w = packed + part.offset + row * blocks * bytes;
                         std::vector<uint8_t> file_row;
                         if (quant_interleaved(QT, header.activations)) {
                           file_row.resize(blocks * bytes);
                           copy_interleaved_row(QT, blocks * bytes, row, packed + part.offset, file_row.data(),
                                                true);
                           w = file_row.data();
                         }
                         for (int64_t b = 0; b < blocks; ++b) {
                           dequantize_block<QT>(w + b * bytes, out + i * k + b * kBlockElems<QT>);
                         }
                       });
                     }
                   });
}

}  // namespace rill_cpu
