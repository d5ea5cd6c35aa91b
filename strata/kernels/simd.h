// A 16-float vector for the CPU kernels (cpu_ops.cpp, attention_ops.cpp, ...), so each kernel is written once for both
// instruction sets it has a SIMD path for:
//
//   AVX-512F            V16 is one __m512 (the code the kernels were first written and tuned with);
//   AVX2 + FMA + F16C   V16 is two __m256 (lo = lanes 0-7, hi = lanes 8-15).
//
// STRATA_SIMD16 is defined when either is available; without it (plain x86-64, other
// architectures) the kernels use only their scalar loops, which stay the reference.
//
// The AVX2 versions reproduce the AVX-512 ones lane for lane: the same exp polynomial and
// clamping (2^n applied in two exact steps so the result is rounded once, like scalef, subnormals
// included), the same round-to-nearest-even conversions to bf16/fp16, and reduce_add / reduce_max
// in the same order as _mm512_reduce_*_ps. Only reduce16 / dot16 sum in a different order.
//
// Everything is in an unnamed namespace: each translation unit (possibly compiled for a different
// -march) gets its own copy, so no inline function is shared between differently compiled objects.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#define STRATA_SIMD16 1
#define STRATA_SIMD16_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define STRATA_SIMD16 1
#define STRATA_SIMD16_AVX2 1
#endif

#if defined(STRATA_SIMD16)
#include <immintrin.h>
#endif

namespace {

// Element types load16 / store16 / round16 take.
template <typename T>
constexpr bool kHasLoad16 = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

#if defined(STRATA_SIMD16_AVX512)
// ---------------------------------------------------------------------------------------------
// AVX-512: one register per vector.
// ---------------------------------------------------------------------------------------------
using V16 = __m512;
using Mask16 = __mmask16;
constexpr int kSimdWidth = 16;   // floats per hardware register
constexpr int kRegsPerV16 = 1;  // hardware registers per V16 (32 zmm registers in all)

inline V16 vzero() { return _mm512_setzero_ps(); }
inline V16 vset1(float x) { return _mm512_set1_ps(x); }
inline V16 vadd(V16 a, V16 b) { return _mm512_add_ps(a, b); }
inline V16 vsub(V16 a, V16 b) { return _mm512_sub_ps(a, b); }
inline V16 vmul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
inline V16 vdiv(V16 a, V16 b) { return _mm512_div_ps(a, b); }
inline V16 vmax(V16 a, V16 b) { return _mm512_max_ps(a, b); }
inline V16 vabs(V16 x) { return _mm512_abs_ps(x); }
inline V16 vfmadd(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline V16 vfnmadd(V16 a, V16 b, V16 c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline float reduce_add(V16 x) { return _mm512_reduce_add_ps(x); }
inline float reduce_max(V16 x) { return _mm512_reduce_max_ps(x); }

// Lanes 0 .. n-1 (0 <= n <= 16); vselect: those lanes from x, the others from other.
inline Mask16 first_lanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
inline V16 vselect(Mask16 m, V16 x, V16 other) { return _mm512_mask_mov_ps(other, m, x); }
inline Mask16 vle(V16 a, V16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }  // lanes with a <= b
inline Mask16 mask_and(Mask16 a, Mask16 b) { return static_cast<__mmask16>(a & b); }

inline V16 load16(const float* p) { return _mm512_loadu_ps(p); }
inline V16 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline V16 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// exp(x) for 16 floats: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor
// polynomial (relative error ~1e-7); inputs are clamped to [-103, 88.7] (below about -103.3 the
// result would round to 0; at the clamp it is the smallest subnormal).
inline V16 exp16(V16 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-103.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Round 16 floats to T's precision (round to nearest even, like PyTorch's casts), kept as floats,
// and store 16 floats as T.
template <typename T>
inline V16 round16(V16 x);
template <>
inline V16 round16<float>(V16 x) { return x; }
template <>
inline V16 round16<double>(V16 x) { return x; }
template <>
inline V16 round16<c10::Half>(V16 x) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline __m512i bf16_bits(__m512 x) {  // upper 16 bits after round-to-nearest-even, in the low half
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
}
template <>
inline V16 round16<c10::BFloat16>(V16 x) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16)); }

inline void store16(float* p, V16 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::Half* p, V16 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store16(c10::BFloat16* p, V16 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
}

// Lane i of the result = all lanes of v[i] combined by op (a commutative float op on two __m512):
// 16 horizontal reductions as one transpose tree.
template <typename Op>
inline V16 reduce16_by(const V16* v, Op op) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i) {
    a[i] = op(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // b[i] holds rows 4i..4i+3 in every 128-bit chunk; combine the chunks, keeping rows in order
  const __m512 d01 = op(_mm512_shuffle_f32x4(b[0], b[1], 0x44), _mm512_shuffle_f32x4(b[0], b[1], 0xEE));
  const __m512 d23 = op(_mm512_shuffle_f32x4(b[2], b[3], 0x44), _mm512_shuffle_f32x4(b[2], b[3], 0xEE));
  return op(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xDD));
}

// Lane i of the result = the sum (reduce16) or the maximum (reduce16_max) of all lanes of v[i].
inline V16 reduce16(const V16* v) {
  return reduce16_by(v, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}
inline V16 reduce16_max(const V16* v) {
  return reduce16_by(v, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
}

// Lane k = q . rows[k], for the 16 rows of a row-major [16][D] float block; D % 16 == 0.
// One accumulator per row (16 of the 32 registers), then one reduction tree.
inline V16 dot16(const float* q, const float* rows, int64_t D) {
  __m512 acc[16];
  for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 qv = _mm512_loadu_ps(q + d);
    for (int k = 0; k < 16; ++k) acc[k] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows + k * D + d), acc[k]);
  }
  return reduce16(acc);
}

#elif defined(STRATA_SIMD16_AVX2)
// ---------------------------------------------------------------------------------------------
// AVX2 + FMA + F16C: two registers per vector.
// ---------------------------------------------------------------------------------------------
struct V16 {
  __m256 lo, hi;
};
struct Mask16 {
  __m256 lo, hi;  // all-ones lanes are selected
};
constexpr int kSimdWidth = 8;
constexpr int kRegsPerV16 = 2;  // 16 ymm registers in all

inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vset1(float x) {
  const __m256 v = _mm256_set1_ps(x);
  return {v, v};
}
inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 vsub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 vdiv(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 vabs(V16 x) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  return {_mm256_andnot_ps(sign, x.lo), _mm256_andnot_ps(sign, x.hi)};
}
inline V16 vfmadd(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 vfnmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}

// The same order as GCC's _mm512_reduce_add_ps / _mm512_reduce_max_ps: halves, quarters, pairs.
inline float reduce_add(V16 x) {
  const __m256 s = _mm256_add_ps(x.lo, x.hi);
  __m128 t = _mm_add_ps(_mm256_extractf128_ps(s, 1), _mm256_castps256_ps128(s));
  t = _mm_add_ps(t, _mm_shuffle_ps(t, t, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t) + _mm_cvtss_f32(_mm_shuffle_ps(t, t, 1));
}
inline float reduce_max(V16 x) {
  const __m256 s = _mm256_max_ps(x.lo, x.hi);
  __m128 t = _mm_max_ps(_mm256_extractf128_ps(s, 1), _mm256_castps256_ps128(s));
  t = _mm_max_ps(t, _mm_shuffle_ps(t, t, _MM_SHUFFLE(1, 0, 3, 2)));
  return std::max(_mm_cvtss_f32(t), _mm_cvtss_f32(_mm_shuffle_ps(t, t, 1)));
}

inline Mask16 first_lanes(int64_t n) {
  const __m256i count = _mm256_set1_epi32(static_cast<int>(n));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return {_mm256_castsi256_ps(_mm256_cmpgt_epi32(count, lane)),
          _mm256_castsi256_ps(_mm256_cmpgt_epi32(count, _mm256_add_epi32(lane, _mm256_set1_epi32(8))))};
}
inline V16 vselect(Mask16 m, V16 x, V16 other) {
  return {_mm256_blendv_ps(other.lo, x.lo, m.lo), _mm256_blendv_ps(other.hi, x.hi, m.hi)};
}
inline Mask16 vle(V16 a, V16 b) { return {_mm256_cmp_ps(a.lo, b.lo, _CMP_LE_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_LE_OQ)}; }
inline Mask16 mask_and(Mask16 a, Mask16 b) { return {_mm256_and_ps(a.lo, b.lo), _mm256_and_ps(a.hi, b.hi)}; }

inline __m256 widen_bf16(__m128i raw) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline V16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 load16(const c10::BFloat16* p) {
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  return {widen_bf16(_mm_loadu_si128(q)), widen_bf16(_mm_loadu_si128(q + 1))};
}
inline V16 load16(const c10::Half* p) {
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(q)), _mm256_cvtph_ps(_mm_loadu_si128(q + 1))};
}

// exp for 8 floats, as the AVX-512 exp16. AVX2 has no scalef, so 2^n (n in [-149, 128] after the
// clamp) is applied as 2^(n >> 1) * 2^(n - (n >> 1)): both factors are normal floats (exponents in
// [-75, 64]), the first product is exact and the second rounds once, which is what scalef does
// (including the subnormal results for x below about -87.3).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.7f)), _mm256_set1_ps(-103.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i ni = _mm256_cvtps_epi32(n);  // exact: n is an integer
  const __m256i n1 = _mm256_srai_epi32(ni, 1);
  const __m256i n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
inline V16 exp16(V16 x) { return {exp8(x.lo), exp8(x.hi)}; }

inline __m256i bf16_bits(__m256 x) {  // upper 16 bits after round-to-nearest-even, in the low half
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
}
inline __m256 round_half8(__m256 x) { return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)); }
inline __m256 round_bf16_8(__m256 x) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x), 16)); }

template <typename T>
inline V16 round16(V16 x);
template <>
inline V16 round16<float>(V16 x) { return x; }
template <>
inline V16 round16<double>(V16 x) { return x; }
template <>
inline V16 round16<c10::Half>(V16 x) { return {round_half8(x.lo), round_half8(x.hi)}; }
template <>
inline V16 round16<c10::BFloat16>(V16 x) { return {round_bf16_8(x.lo), round_bf16_8(x.hi)}; }

inline void store16(float* p, V16 x) {
  _mm256_storeu_ps(p, x.lo);
  _mm256_storeu_ps(p + 8, x.hi);
}
inline void store16(c10::Half* p, V16 x) {
  __m128i* q = reinterpret_cast<__m128i*>(p);
  _mm_storeu_si128(q, _mm256_cvtps_ph(x.lo, _MM_FROUND_TO_NEAREST_INT));
  _mm_storeu_si128(q + 1, _mm256_cvtps_ph(x.hi, _MM_FROUND_TO_NEAREST_INT));
}
inline void store16(c10::BFloat16* p, V16 x) {
  // the 16-bit values (<= 0xFFFF, so no saturation) packed per 128-bit lane: lo0-3 hi0-3 lo4-7 hi4-7
  const __m256i packed = _mm256_packus_epi32(bf16_bits(x.lo), bf16_bits(x.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}

// Lane i of the result = the sum of all lanes of v[i], for 8 vectors of 8 floats.
inline __m256 reduce8(const __m256* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  // b0: per 128-bit half, the partial sums of v0..v3 (low half: lanes 0-3, high half: lanes 4-7)
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// Lane i of the result = the sum of all lanes of v[i].
inline V16 reduce16(const V16* v) {
  __m256 s[16];
  for (int i = 0; i < 16; ++i) s[i] = _mm256_add_ps(v[i].lo, v[i].hi);
  return {reduce8(s), reduce8(s + 8)};
}

// Lane i of the result = the maximum of all lanes of v[i], for 8 vectors of 8 floats (a transpose tree).
inline __m256 reduce8_max(const __m256* v) {
  __m256 t[4], u[2];
  for (int i = 0; i < 4; ++i) {  // per 128-bit half: [a0 a2, b0 b2, a1 a3, b1 b3] (a, b = v[2i], v[2i + 1])
    t[i] = _mm256_max_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 2; ++i) {  // per 128-bit half: the half's maxima of v[4i] .. v[4i + 3]
    const __m256d x = _mm256_castps_pd(t[2 * i]), y = _mm256_castps_pd(t[2 * i + 1]);
    u[i] = _mm256_max_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return _mm256_max_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

// Lane i of the result = the maximum of all lanes of v[i].
inline V16 reduce16_max(const V16* v) {
  __m256 s[16];
  for (int i = 0; i < 16; ++i) s[i] = _mm256_max_ps(v[i].lo, v[i].hi);
  return {reduce8_max(s), reduce8_max(s + 8)};
}

// Lane k = q . rows[k] for 8 rows of a row-major [.][D] block; D % 16 == 0.
inline __m256 dot8(const float* q, const float* rows, int64_t D) {
  __m256 acc[8];
  for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m256 q0 = _mm256_loadu_ps(q + d), q1 = _mm256_loadu_ps(q + d + 8);
    for (int k = 0; k < 8; ++k) {
      acc[k] = _mm256_fmadd_ps(q0, _mm256_loadu_ps(rows + k * D + d), acc[k]);
      acc[k] = _mm256_fmadd_ps(q1, _mm256_loadu_ps(rows + k * D + d + 8), acc[k]);
    }
  }
  return reduce8(acc);
}

// Lane k = q . rows[k], for the 16 rows of a row-major [16][D] float block; D % 16 == 0.
// Eight rows at a time: 16 accumulators would need all 32 ymm halves and spill.
inline V16 dot16(const float* q, const float* rows, int64_t D) { return {dot8(q, rows, D), dot8(q, rows + 8 * D, D)}; }
#endif

}  // namespace
