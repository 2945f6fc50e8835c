// Sixteen float lanes: one AVX-512 register when the build targets AVX-512 (-march=native on such a CPU), two
// AVX2 registers on a CPU with AVX2 and FMA, a plain array otherwise. Every operation is lane-wise except the two reductions, whose order is fixed (a
// halving tree), so a value computed in lane i does not depend on what the other lanes hold.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace rill_cpu {

using bf16 = uint16_t;  // bfloat16 as its raw bits; arithmetic always happens in float32
constexpr int kLanes = 16;
using Mask = uint32_t;  // bit i: lane i

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
T from_float(float x);
template <>
inline float from_float<float>(float x) {
  return x;
}
// Round to nearest even, NaN to the canonical quiet NaN: what torch's float -> bfloat16 conversion does.
template <>
inline bf16 from_float<bf16>(float x) {
  if (std::isnan(x)) return 0x7fc0;
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<bf16>(bits >> 16);
}

// Lanes [begin, end) of a 16-lane chunk, clamped to the chunk.
inline Mask lane_range(int begin, int end) {
  begin = begin < 0 ? 0 : begin;
  end = end > kLanes ? kLanes : end;
  if (begin >= end) return 0;
  return ((1u << (end - begin)) - 1u) << begin;
}

// exp(x) to about 1 ulp: x = n ln2 + r with |r| <= ln2 / 2, a polynomial for e^r, times 2^n. Inputs below
// -87.3 (where float32 results turn subnormal) give 0; inputs above 88.37 are clamped there.
constexpr float kExpHi = 88.3762626647949f;
constexpr float kExpLo = -87.3365447504f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(__AVX512F__)

struct Vec16 {
  __m512 v;
};
inline Vec16 zeros() { return {_mm512_setzero_ps()}; }
inline Vec16 broadcast(float x) { return {_mm512_set1_ps(x)}; }
inline Vec16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec16 load(const bf16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
inline Vec16 load(const int8_t* p) {  // an int8 KV row's values, exactly
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline void store(float* p, Vec16 a) { _mm512_storeu_ps(p, a.v); }
// Lane i: the bfloat16 bits of a[i] in the low half, rounded as from_float<bf16> rounds.
inline __m512i bf16_bits(Vec16 a) {
  const __m512i bits = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
}
inline void store(bf16* p, Vec16 a) {  // rounded to bfloat16
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(a)));
}
inline Vec16 round_bf16(Vec16 a) { return {_mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(a), 16))}; }
inline Vec16 add(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec16 sub(Vec16 a, Vec16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec16 mul(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec16 div(Vec16 a, Vec16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec16 max(Vec16 a, Vec16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec16 select(Mask m, Vec16 a, Vec16 b) {  // lane i: a where bit i is set, else b
  return {_mm512_mask_blend_ps(static_cast<__mmask16>(m), b.v, a.v)};
}
inline float reduce_add(Vec16 a) {
  const __m256 lo = _mm512_castps512_ps256(a.v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1));
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
inline float reduce_max(Vec16 a) { return _mm512_reduce_max_ps(a.v); }
inline Mask is_nan(Vec16 a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q); }
inline Mask equal(Vec16 a, Vec16 b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ); }
// out lane i = the sum of a[i]'s lanes, by a fixed tree per i (pairs of lanes, then pairs of pairs, ...); a[i]
// enters no other lane, so what the other vectors hold never changes lane i. Always inlined: called out of line
// (gcc did so in the bfloat16 score loop) its 16 inputs go through the stack (measured: a batch-16, context-512
// bfloat16 decode step's attention over 30 layers, 11.9 -> 10.7 ms).
__attribute__((always_inline)) inline Vec16 reduce16(const Vec16 (&a)[kLanes]) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i) {
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i].v, a[2 * i + 1].v),
                         _mm512_unpackhi_ps(a[2 * i].v, a[2 * i + 1].v));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    c[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // c[i]'s 128-bit lane L holds sources 4i..4i+3 summed over lane group L; add the four groups.
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xdd));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xdd))};
}

inline Vec16 exp(Vec16 x) {
  const __mmask16 underflow = _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(kExpLo), _CMP_LT_OQ);
  const __m512 xc = _mm512_max_ps(_mm512_min_ps(x.v, _mm512_set1_ps(kExpHi)), _mm512_set1_ps(kExpLo));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  const __m512i pow2n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(pow2n));
  return {_mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), y)};
}

#elif defined(__AVX2__) && defined(__FMA__)  // two 8-lane halves, lane-wise as the other builds

struct Vec16 {
  __m256 lo, hi;
};
inline Vec16 zeros() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec16 broadcast(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen_bf16(const bf16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline Vec16 load(const bf16* p) { return {widen_bf16(p), widen_bf16(p + 8)}; }
inline __m256 widen_int8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec16 load(const int8_t* p) { return {widen_int8(p), widen_int8(p + 8)}; }  // exactly
inline void store(float* p, Vec16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
// Lane i: the bfloat16 bits of a[i] in the low half, rounded as from_float<bf16> rounds.
inline __m256i bf16_bits(__m256 a) {
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
}
inline void store(bf16* p, Vec16 a) {  // rounded to bfloat16
  // packus interleaves the 128-bit halves of its two inputs; the permute puts lanes 0..15 back in order.
  const __m256i packed = _mm256_packus_epi32(bf16_bits(a.lo), bf16_bits(a.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xd8));
}
inline Vec16 round_bf16(Vec16 a) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(a.lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(a.hi), 16))};
}
#define RILL_LANEWISE(name, op) \
  inline Vec16 name(Vec16 a, Vec16 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
RILL_LANEWISE(add, _mm256_add_ps)
RILL_LANEWISE(sub, _mm256_sub_ps)
RILL_LANEWISE(mul, _mm256_mul_ps)
RILL_LANEWISE(div, _mm256_div_ps)
RILL_LANEWISE(max, _mm256_max_ps)  // a > b ? a : b, as the portable build
#undef RILL_LANEWISE
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
// Bits [shift, shift + 8) of m as an all-ones / all-zeros lane mask.
inline __m256 lane_mask(Mask m, int shift) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i set = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>((m >> shift) & 0xffu)), bits);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(set, bits));
}
inline Vec16 select(Mask m, Vec16 a, Vec16 b) {  // lane i: a where bit i is set, else b
  return {_mm256_blendv_ps(b.lo, a.lo, lane_mask(m, 0)), _mm256_blendv_ps(b.hi, a.hi, lane_mask(m, 8))};
}
inline float reduce_add(Vec16 a) {  // the portable build's tree: lanes i + 8, then i + 4, then pairs
  const __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
inline float reduce_max(Vec16 a) {  // in lane order, as the portable build (a NaN in lane 0 stays)
  float v[kLanes];
  store(v, a);
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
inline Mask mask_of(__m256 lo, __m256 hi) {
  return static_cast<Mask>(_mm256_movemask_ps(lo)) | (static_cast<Mask>(_mm256_movemask_ps(hi)) << 8);
}
inline Mask is_nan(Vec16 a) {
  return mask_of(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q));
}
inline Mask equal(Vec16 a, Vec16 b) {
  return mask_of(_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ));
}
// out lane i = reduce_add(a[i]).
__attribute__((always_inline)) inline Vec16 reduce16(const Vec16 (&a)[kLanes]) {
  float sums[kLanes];
  for (int i = 0; i < kLanes; ++i) sums[i] = reduce_add(a[i]);
  return load(sums);
}
inline __m256 exp8(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLo), _CMP_LT_OQ);
  const __m256 xc = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(kExpHi)), _mm256_set1_ps(kExpLo));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
  return _mm256_andnot_ps(underflow, y);
}
inline Vec16 exp(Vec16 x) { return {exp8(x.lo), exp8(x.hi)}; }

#else  // portable: the same lane-wise arithmetic on an array (compilers vectorize these loops)

struct Vec16 {
  float v[kLanes];
};
inline Vec16 broadcast(float x) {
  Vec16 r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = x;
  return r;
}
inline Vec16 zeros() { return broadcast(0.0f); }
template <typename T>
inline Vec16 load(const T* p) {
  Vec16 r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = to_float(p[i]);
  return r;
}
inline Vec16 load(const int8_t* p) {
  Vec16 r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
inline void store(float* p, Vec16 a) { std::memcpy(p, a.v, sizeof a.v); }
inline void store(bf16* p, Vec16 a) {  // rounded to bfloat16
  for (int i = 0; i < kLanes; ++i) p[i] = from_float<bf16>(a.v[i]);
}
inline Vec16 round_bf16(Vec16 a) {
  Vec16 r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = to_float(from_float<bf16>(a.v[i]));
  return r;
}
#define RILL_LANEWISE(name, expr)                   \
  inline Vec16 name(Vec16 a, Vec16 b) {             \
    Vec16 r;                                        \
    for (int i = 0; i < kLanes; ++i) r.v[i] = expr; \
    return r;                                       \
  }
RILL_LANEWISE(add, a.v[i] + b.v[i])
RILL_LANEWISE(sub, a.v[i] - b.v[i])
RILL_LANEWISE(mul, a.v[i] * b.v[i])
RILL_LANEWISE(div, a.v[i] / b.v[i])
RILL_LANEWISE(max, a.v[i] > b.v[i] ? a.v[i] : b.v[i])
#undef RILL_LANEWISE
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) {
  Vec16 r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return r;
}
inline Vec16 select(Mask m, Vec16 a, Vec16 b) {
  Vec16 r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = (m >> i) & 1u ? a.v[i] : b.v[i];
  return r;
}
inline float reduce_add(Vec16 a) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = a.v[i] + a.v[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}
inline float reduce_max(Vec16 a) {
  float m = a.v[0];
  for (int i = 1; i < kLanes; ++i) m = a.v[i] > m ? a.v[i] : m;
  return m;
}
inline Mask is_nan(Vec16 a) {
  Mask m = 0;
  for (int i = 0; i < kLanes; ++i) m |= static_cast<Mask>(std::isnan(a.v[i])) << i;
  return m;
}
inline Mask equal(Vec16 a, Vec16 b) {
  Mask m = 0;
  for (int i = 0; i < kLanes; ++i) m |= static_cast<Mask>(a.v[i] == b.v[i]) << i;
  return m;
}
// out lane i = reduce_add(a[i]).
inline Vec16 reduce16(const Vec16 (&a)[kLanes]) {
  Vec16 r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = reduce_add(a[i]);
  return r;
}
inline Vec16 exp(Vec16 x) {
  Vec16 r;
  for (int i = 0; i < kLanes; ++i) {
    const float xc = std::fmax(std::fmin(x.v[i], kExpHi), kExpLo);
    const float n = std::nearbyint(xc * kLog2e);
    float t = std::fma(-n, kLn2Hi, xc);
    t = std::fma(-n, kLn2Lo, t);
    float y = kExpPoly[0];
    for (int k = 1; k < 6; ++k) y = std::fma(y, t, kExpPoly[k]);
    y = std::fma(y, t * t, t) + 1.0f;
    r.v[i] = x.v[i] < kExpLo ? 0.0f : std::ldexp(y, static_cast<int>(n));
  }
  return r;
}

#endif

}  // namespace rill_cpu
