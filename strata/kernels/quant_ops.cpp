// Block-quantized linear layers for the CPU: y = x @ W^T with W stored in blocks of 32 input
// channels, computed with 8-bit integer dot products, as llama.cpp does.
//
// Two weight formats (strata.layers.quant owns them; GGUF types are converted into them losslessly):
//
//   q4   qs uint8 [N, K/2], d, m [N, K/32]:   w[n, 32b + j] = d[n, b] * q + m[n, b], q in 0..15,
//        with q = qs[n, 16b + j] & 15 for j < 16 and qs[n, 16b + j - 16] >> 4 for j >= 16
//        (ggml's Q4_0 / Q4_1 byte order; Q4_0, Q4_1 and Q4_K all map onto it).
//   q8   qs int8 [N, K], d [N, K/S] with S = 16 or 32:  w[n, k] = d[n, k / S] * qs[n, k]
//        (Q8_0 with S = 32; Q6_K with S = 16).
//
// Scales and offsets are float32, or float16 where that holds them exactly (GGUF's Q4_0, Q4_1 and
// Q8_0 store them so): a quarter fewer bytes per q4 block (20 instead of 24 per 32 weights) for a
// step that is bound by the bytes it reads.
//
// Activations are quantized per block of 32 (per row): xd = max|x| / 127, xq = round(x / xd),
// xs = the block's float sum (for the q4 offset term m * sum(x)) and xc = 8 (xs - xd sum_j xq_j), the
// rounding error of the block's sum. Then per block
//
//   q4:  dot = d * xd * sum_j q_j xq_j + m * xs + d * xc   q8: dot = sum_sub d_sub * xd * sum_j q_j xq_j
//
// The d * xc term makes the q4 error that of centred weights, d sum_j (q_j - 8) e_j with e_j the
// rounding error of x_j, instead of d sum_j q_j e_j (q_j in 0..15 is all positive: 2x the error).
//
// The integer sums are exact; only the float accumulation order differs between the SIMD paths and
// the scalar loop, which stays as the reference. QuantLinear.emulated_mm (strata.layers.quant)
// reproduces the same arithmetic in PyTorch for the tests. Three SIMD paths: AVX2 (one block of 32 per
// 256-bit step, vpmaddubsw + vpmaddwd), AVX-512BW (two blocks per 512-bit step, the same two
// instructions) and AVX-512 VNNI (two blocks per step, one vpdpbusd); the AVX-512 builds finish an
// odd block count with the AVX2 step.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "simd.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define STRATA_QUANT_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define STRATA_QUANT_AVX512 1
#endif
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// One scale or offset as float: the element types they are stored in (float32, or float16 when exact).
inline float scale1(const float* p) { return *p; }
inline float scale1(const c10::Half* p) {
#if defined(__F16C__)
  return _cvtsh_ss(p->x);
#else
  return static_cast<float>(*p);
#endif
}

// The scales' dtype as a type: f(float{}) or f(c10::Half{}).
template <typename F>
void with_scale_type(at::ScalarType dtype, F&& f) {
  if (dtype == at::kHalf) {
    f(c10::Half{});
  } else {
    f(float{});
  }
}

constexpr int64_t kBlock = 32;     // input channels per activation block (and per q4 weight block)
constexpr int64_t kRowTile = 4;    // activation rows sharing one unpacked weight block
constexpr int64_t kRowBlock = 64;  // activation rows kept in cache while a thread walks its weight rows

// Activation rows quantized: q [M, K] int8; d, s, c [M, K / 32] float.
struct QuantRows {
  std::vector<int8_t> q;
  std::vector<float> d, s, c;
};

template <typename T>
void quantize_row(const T* x, int64_t K, int8_t* q, float* d, float* s, float* c) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const T* xb = x + b * kBlock;
    float amax = 0.f, sum = 0.f;
    float v[kBlock];
    for (int64_t j = 0; j < kBlock; ++j) {
      v[j] = static_cast<float>(xb[j]);
      amax = std::max(amax, std::fabs(v[j]));
      sum += v[j];
    }
    const float scale = amax / 127.f;
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    int32_t qsum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      q[b * kBlock + j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));  // |v * inv| <= 127
      qsum += q[b * kBlock + j];
    }
    d[b] = scale;
    s[b] = sum;
    c[b] = 8.f * (sum - scale * static_cast<float>(qsum));
  }
}

QuantRows quantize_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  QuantRows r;
  r.q.resize(M * K);
  r.d.resize(M * K / kBlock);
  r.s.resize(M * K / kBlock);
  r.c.resize(M * K / kBlock);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        const int64_t o = m * K / kBlock;
        quantize_row(xp + m * K, K, r.q.data() + m * K, r.d.data() + o, r.s.data() + o, r.c.data() + o);
      }
    });
  });
  return r;
}

#if defined(STRATA_QUANT_AVX2)
inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// 32 unsigned 4-bit weights of one q4 block, in input-channel order, as bytes.
inline __m256i unpack_q4(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// Eight int32 partial sums of u[i] * s[i] over 32 bytes (u unsigned <= 128, s signed >= -127):
// lanes 0-3 cover bytes 0-15, lanes 4-7 bytes 16-31.
inline __m256 dot_u8s8(__m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);  // 16 x int16, no saturation for these ranges
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif

#if defined(STRATA_QUANT_AVX512)
// Sixteen int32 partial sums of u[i] * s[i] over 64 bytes (two blocks; the same ranges as dot_u8s8):
// lanes 0-7 cover block 0 (bytes 0-31), lanes 8-15 block 1.
inline __m512 dot2_u8s8(__m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s));
#else
  const __m512i pairs = _mm512_maddubs_epi16(u, s);
  return _mm512_cvtepi32_ps(_mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}

// p[0], p[1] (p[0..3]) as the low lanes of a float vector.
inline __m128 load2(const float* p) { return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p))); }
inline __m128 load2(const c10::Half* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}
inline __m128 load4(const float* p) { return _mm_loadu_ps(p); }
inline __m128 load4(const c10::Half* p) { return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }

// p[0], p[1] spread over lanes 0-7 and 8-15 (one scale per block of a two-block step).
template <typename S>
inline __m512 spread2(const S* p) {
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(load2(p)));
}

// p[0..3] spread over lanes 0-3, 4-7, 8-11, 12-15 (one scale per 16 channels).
template <typename S>
inline __m512 spread4(const S* p) {
  const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(load4(p)));
}
#endif

// One block (AVX-512: two) of a weight row as the dot products take it: the weights as unsigned
// bytes, what gives x their sign (q8: w's sign; q4's are all positive: unused) and the scale per lane.
#if defined(STRATA_QUANT_AVX2)
struct Block {
  __m256i u, sign;
  __m256 scale;
};
#endif
#if defined(STRATA_QUANT_AVX512)
struct Block2 {
  __m512i u;
  __mmask64 sign;
  __m512 scale;
};
#endif

// Integer dot products of one weight row with RT activation rows (RT a compile-time constant, so
// the accumulators live in registers), scaled per block: result[r] = sum_b scale_b,r * isum_b,r.
// Blocks are taken two at a time into separate accumulators (two independent FMA chains).
template <int RT, typename Weights>
inline void dot_rows(const Weights& w, const QuantRows& x, int64_t row0, int64_t K, int64_t nb, float* result) {
#if defined(STRATA_QUANT_AVX2)
  __m256 acc0[RT], acc1[RT];
  for (int r = 0; r < RT; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  const int8_t* xq = x.q.data() + row0 * K;
  const float* xd = x.d.data() + row0 * nb;
  int64_t b = 0;
#if defined(STRATA_QUANT_AVX512)
  // two blocks per step in one register; the odd last block (if any) takes the AVX2 step below
  __m512 acc[RT];
  for (int r = 0; r < RT; ++r) acc[r] = _mm512_setzero_ps();
  for (; b + 2 <= nb; b += 2) {
    const auto [u, sign, ws] = w.block2(b);
    for (int r = 0; r < RT; ++r) {
      const __m512i xv = _mm512_loadu_si512(xq + r * K + b * kBlock);
      const __m512 scale = _mm512_mul_ps(ws, spread2(xd + r * nb + b));
      acc[r] = _mm512_fmadd_ps(dot2_u8s8(u, w.signed_x2(xv, sign)), scale, acc[r]);
    }
  }
#endif
  for (; b + 2 <= nb; b += 2) {
    for (int half = 0; half < 2; ++half) {
      const int64_t bb = b + half;
      const auto [u, sign, ws] = w.block(bb);
      for (int r = 0; r < RT; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + bb * kBlock));
        const __m256 scale = _mm256_mul_ps(ws, _mm256_set1_ps(xd[r * nb + bb]));
        const __m256 dot = dot_u8s8(u, w.signed_x(xv, sign));
        if (half == 0) {
          acc0[r] = _mm256_fmadd_ps(dot, scale, acc0[r]);
        } else {
          acc1[r] = _mm256_fmadd_ps(dot, scale, acc1[r]);
        }
      }
    }
  }
  for (; b < nb; ++b) {
    const auto [u, sign, ws] = w.block(b);
    for (int r = 0; r < RT; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + b * kBlock));
      const __m256 scale = _mm256_mul_ps(ws, _mm256_set1_ps(xd[r * nb + b]));
      acc0[r] = _mm256_fmadd_ps(dot_u8s8(u, w.signed_x(xv, sign)), scale, acc0[r]);
    }
  }
  for (int r = 0; r < RT; ++r) result[r] = hsum8(_mm256_add_ps(acc0[r], acc1[r]));
#if defined(STRATA_QUANT_AVX512)
  for (int r = 0; r < RT; ++r) result[r] += _mm512_reduce_add_ps(acc[r]);
#endif
#else
  for (int r = 0; r < RT; ++r) {
    const int8_t* xq = x.q.data() + (row0 + r) * K;
    float sum = 0.f;
    for (int64_t b = 0; b < nb; ++b) sum += w.scalar_block(b, xq + b * kBlock) * x.d[(row0 + r) * nb + b];
    result[r] = sum;
  }
#endif
}

// One q4 weight row: unsigned nibbles, one scale per block (stored as S).
template <typename S>
struct Q4Row {
  const uint8_t* q;
  const S* d;
#if defined(STRATA_QUANT_AVX2)
  Block block(int64_t b) const { return {unpack_q4(q + b * 16), _mm256_setzero_si256(), _mm256_set1_ps(scale1(d + b))}; }
  static __m256i signed_x(__m256i xv, __m256i) { return xv; }
#endif
#if defined(STRATA_QUANT_AVX512)
  // blocks b and b + 1: their 32 bytes become [b low nibbles | b high | b+1 low | b+1 high]
  Block2 block2(int64_t b) const {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * 16));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1);
    const __m512i ordered = _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
    return {_mm512_and_si512(ordered, _mm512_set1_epi8(0x0F)), 0, spread2(d + b)};
  }
  static __m512i signed_x2(__m512i xv, __mmask64) { return xv; }
#endif
  // d_b * sum_j q_j xq_j (the caller multiplies by the activation scale)
  float scalar_block(int64_t b, const int8_t* xq) const {
    const uint8_t* qb = q + b * 16;
    int32_t isum = 0;
    for (int64_t j = 0; j < 16; ++j) isum += (qb[j] & 15) * xq[j] + (qb[j] >> 4) * xq[j + 16];
    return scale1(d + b) * static_cast<float>(isum);
  }
};

// One q8 weight row with one scale (stored as S) per G input channels: |w| times x with w's sign.
template <int G, typename S>
struct Q8Row {
  const int8_t* q;
  const S* d;
  static constexpr int64_t kSubs = kBlock / G;
#if defined(STRATA_QUANT_AVX2)
  Block block(int64_t b) const {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * kBlock));
    // lanes 0-3 of the dot product hold channels 0-15 of the block, lanes 4-7 channels 16-31
    const __m256 scale = kSubs == 1 ? _mm256_set1_ps(scale1(d + b))
                                    : _mm256_set_m128(_mm_set1_ps(scale1(d + b * kSubs + kSubs - 1)),
                                                      _mm_set1_ps(scale1(d + b * kSubs)));
    return {_mm256_sign_epi8(w, w), w, scale};
  }
  static __m256i signed_x(__m256i xv, __m256i sign) { return _mm256_sign_epi8(xv, sign); }
#endif
#if defined(STRATA_QUANT_AVX512)
  // blocks b and b + 1: |w| as unsigned bytes and the lanes where w < 0 (x is negated there)
  Block2 block2(int64_t b) const {
    const __m512i w = _mm512_loadu_si512(q + b * kBlock);
    const __m512 scale = kSubs == 1 ? spread2(d + b) : spread4(d + b * kSubs);
    return {_mm512_abs_epi8(w), _mm512_movepi8_mask(w), scale};
  }
  static __m512i signed_x2(__m512i xv, __mmask64 sign) {
    return _mm512_mask_sub_epi8(xv, sign, _mm512_setzero_si512(), xv);
  }
#endif
  float scalar_block(int64_t b, const int8_t* xq) const {
    float sum = 0.f;
    for (int64_t sub = 0; sub < kSubs; ++sub) {
      int32_t isum = 0;
      for (int64_t j = sub * G; j < (sub + 1) * G; ++j) isum += q[b * kBlock + j] * xq[j];
      sum += scale1(d + b * kSubs + sub) * static_cast<float>(isum);
    }
    return sum;
  }
};

// sum_b m_b xs_b + d_b xc_b: the q4 offset and centring terms of one (weight row, activation row).
template <typename S>
inline float q4_offset(const S* m, const S* d, const float* xs, const float* xc, int64_t nb) {
  float offset = 0.f;
  int64_t b = 0;
#if defined(STRATA_QUANT_AVX2)
  __m256 off = _mm256_setzero_ps();
  for (; b + 8 <= nb; b += 8) {
    off = _mm256_fmadd_ps(load8(m + b), _mm256_loadu_ps(xs + b), off);
    off = _mm256_fmadd_ps(load8(d + b), _mm256_loadu_ps(xc + b), off);
  }
  offset = hsum8(off);
#endif
  for (; b < nb; ++b) offset += scale1(m + b) * xs[b] + scale1(d + b) * xc[b];
  return offset;
}

// Output columns [n0, n1) of all M rows: activation rows kRowBlock at a time (kept in cache while
// the thread walks its weight rows), kRowTile at a time per weight row. make_row(n) gives weight
// row n; offset(n, r, result) adds what the format adds per (weight row, activation row).
template <typename OT, typename MakeRow, typename Offset>
void linear_rows(const QuantRows& x, int64_t M, int64_t K, int64_t n0, int64_t n1, OT* out, int64_t N,
                 MakeRow make_row, Offset offset) {
  const int64_t nb = K / kBlock;
  float result[kRowTile];
  for (int64_t mt = 0; mt < M; mt += kRowBlock) {
    const int64_t m_end = std::min(M, mt + kRowBlock);
    for (int64_t n = n0; n < n1; ++n) {
      const auto w = make_row(n);
      for (int64_t r0 = mt; r0 < m_end; r0 += kRowTile) {
        const int64_t rn = std::min(kRowTile, m_end - r0);
        switch (rn) {
          case 1: dot_rows<1>(w, x, r0, K, nb, result); break;
          case 2: dot_rows<2>(w, x, r0, K, nb, result); break;
          case 3: dot_rows<3>(w, x, r0, K, nb, result); break;
          default: dot_rows<4>(w, x, r0, K, nb, result); break;
        }
        for (int64_t r = 0; r < rn; ++r) out[(r0 + r) * N + n] = static_cast<OT>(result[r] + offset(n, r0 + r));
      }
    }
  }
}

// Every entry point checks dtypes, devices, layouts and that the weight's rows and block columns agree
// with K before it touches a data pointer: a mismatch raises a RuntimeError naming the argument, the
// sizes it has and the ones it needs, instead of reading out of bounds.

// A float32/bf16/fp16/fp64 dtype, the ones the kernels are compiled for.
void check_float_dtype(at::ScalarType dtype, const char* name) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble, name,
              " must be float32, bfloat16, float16 or float64, got ", dtype);
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor, got one on ", x.device());
  check_float_dtype(x.scalar_type(), "x");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, K], got sizes ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous, got sizes ", x.sizes(), " with strides ", x.strides());
  TORCH_CHECK(x.size(1) % kBlock == 0, "K (", x.size(1), ") must be a multiple of ", kBlock);
}

void check_param(const at::Tensor& t, at::ScalarType dtype, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous, got sizes ", t.sizes(), " with strides ", t.strides());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, name, " must be [", rows, ", ", cols,
              "], got ", t.sizes());
}

// Scales (or offsets): float32 or float16 [rows, cols].
void check_scales(const at::Tensor& t, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf, name,
              " must be float32 or float16, got ", t.scalar_type());
  check_param(t, t.scalar_type(), rows, cols, name);
}

// A q4 weight over K input channels: qs uint8 [N, K/2], d and m [N, K/32] of one dtype.
void check_q4(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m, int64_t K) {
  TORCH_CHECK(K % kBlock == 0, "K (", K, ") must be a multiple of ", kBlock);
  TORCH_CHECK(qs.dim() == 2, "qs must be [N, K / 2], got sizes ", qs.sizes());
  const int64_t N = qs.size(0);
  check_param(qs, at::kByte, N, K / 2, "qs");
  check_scales(d, N, K / kBlock, "d");
  check_scales(m, N, K / kBlock, "m");
  TORCH_CHECK(d.scalar_type() == m.scalar_type(), "d (", d.scalar_type(), ") and m (", m.scalar_type(),
              ") must share a dtype");
}

// A q8 weight over K input channels: qs int8 [N, K], d float32 or float16 [N, K/S]; returns S (16 or 32).
int64_t check_q8(const at::Tensor& qs, const at::Tensor& d, int64_t K) {
  TORCH_CHECK(K % kBlock == 0, "K (", K, ") must be a multiple of ", kBlock);
  TORCH_CHECK(qs.dim() == 2, "qs must be [N, K], got sizes ", qs.sizes());
  TORCH_CHECK(d.dim() == 2 && d.size(1) > 0 && K % d.size(1) == 0, "d must be [N, K / S] with K = ", K, ", got sizes ",
              d.sizes());
  const int64_t S = K / d.size(1);
  TORCH_CHECK(S == 16 || S == 32, "q8 weights take one scale per 16 or 32 input channels, got ", S);
  check_param(qs, at::kChar, qs.size(0), K, "qs");
  check_scales(d, qs.size(0), K / S, "d");
  return S;
}

void check_row_range(int64_t start, int64_t end, int64_t N) {
  TORCH_CHECK(0 <= start && start <= end && end <= N, "rows [", start, ", ", end, ") are not a range within the ", N,
              " weight rows [0, ", N, ")");
}

// Rows of output columns each thread takes: enough to amortise the dispatch, and an even split.
int64_t grain(int64_t N, int64_t M) {
  return std::max<int64_t>(1, std::min<int64_t>(64, N / (4 * at::get_num_threads()) / std::max<int64_t>(1, M / 16)));
}

// x [M, K] float/bf16/fp16 -> [M, N] in x's dtype.
at::Tensor q4_linear(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor m) {
  check_x(x);
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  check_q4(qs, d, m, K);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const QuantRows xq = quantize_rows(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "q4_linear", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    const uint8_t* q = qs.data_ptr<uint8_t>();
    const int64_t nb = K / kBlock;
    with_scale_type(d.scalar_type(), [&](auto tag) {
      using S = decltype(tag);
      const S* dp = static_cast<const S*>(d.data_ptr());
      const S* mp = static_cast<const S*>(m.data_ptr());
      at::parallel_for(0, N, grain(N, M), [&](int64_t n0, int64_t n1) {
        linear_rows(xq, M, K, n0, n1, op, N, [&](int64_t n) { return Q4Row<S>{q + n * (K / 2), dp + n * nb}; },
                    [&](int64_t n, int64_t row) {
                      return q4_offset(mp + n * nb, dp + n * nb, xq.s.data() + row * nb, xq.c.data() + row * nb, nb);
                    });
      });
    });
  });
  return out;
}

at::Tensor q8_linear(at::Tensor x, at::Tensor qs, at::Tensor d) {
  check_x(x);
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  const int64_t S = check_q8(qs, d, K);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const QuantRows xq = quantize_rows(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "q8_linear", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    const int8_t* q = qs.data_ptr<int8_t>();
    const auto none = [](int64_t, int64_t) { return 0.f; };
    with_scale_type(d.scalar_type(), [&](auto tag) {
      using ST = decltype(tag);
      const ST* dp = static_cast<const ST*>(d.data_ptr());
      at::parallel_for(0, N, grain(N, M), [&](int64_t n0, int64_t n1) {
        if (S == 16) {
          linear_rows(xq, M, K, n0, n1, op, N, [&](int64_t n) { return Q8Row<16, ST>{q + n * K, dp + n * (K / 16)}; },
                      none);
        } else {
          linear_rows(xq, M, K, n0, n1, op, N, [&](int64_t n) { return Q8Row<32, ST>{q + n * K, dp + n * (K / 32)}; },
                      none);
        }
      });
    });
  });
  return out;
}

// 32 weights of one block in OT: w[j] = q[j] * scale[j / 8] + offset (the matmul path for many rows
// dequantizes a chunk of weight rows into the activations' dtype and hands it to the BLAS). bf16 and
// fp16 are rounded to nearest even from the float result, as torch's conversion rounds.
#if defined(STRATA_QUANT_AVX2)
template <typename OT>
inline void store_block(OT* dst, __m256i bytes, bool is_signed, const float* scales, float offset) {
  const __m128i halves[2] = {_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1)};
  alignas(32) float w[kBlock];
  for (int i = 0; i < 4; ++i) {
    const __m128i eight = (i & 1) ? _mm_srli_si128(halves[i / 2], 8) : halves[i / 2];
    const __m256i ints = is_signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
    _mm256_storeu_ps((std::is_same_v<OT, float> ? reinterpret_cast<float*>(dst) : w) + 8 * i,
                     _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), _mm256_set1_ps(scales[i]), _mm256_set1_ps(offset)));
  }
  if constexpr (!std::is_same_v<OT, float>) {
    store16(dst, load16(w));
    store16(dst + 16, load16(w + 16));
  }
}

// The dtypes store_block writes.
template <typename OT>
constexpr bool kSimdDequant = std::is_same_v<OT, float> || std::is_same_v<OT, c10::BFloat16> || std::is_same_v<OT, c10::Half>;
#endif

template <typename OT, typename ST>
void q4_dequant_rows(const uint8_t* q, const ST* dp, const ST* mp, int64_t K, int64_t n0, int64_t n1,
                     int64_t start, OT* op) {
  const int64_t nb = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    OT* row = op + (n - start) * K;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* qb = q + n * (K / 2) + b * 16;
      const float db = scale1(dp + n * nb + b), mb = scale1(mp + n * nb + b);
#if defined(STRATA_QUANT_AVX2)
      if constexpr (kSimdDequant<OT>) {
        const float scales[4] = {db, db, db, db};
        store_block(row + b * kBlock, unpack_q4(qb), false, scales, mb);
        continue;
      }
#endif
      for (int64_t j = 0; j < 16; ++j) {
        row[b * kBlock + j] = static_cast<OT>(db * static_cast<float>(qb[j] & 15) + mb);
        row[b * kBlock + 16 + j] = static_cast<OT>(db * static_cast<float>(qb[j] >> 4) + mb);
      }
    }
  }
}

template <typename OT, typename ST>
void q8_dequant_rows(const int8_t* q, const ST* dp, int64_t K, int64_t S, int64_t n0, int64_t n1, int64_t start,
                     OT* op) {
  for (int64_t n = n0; n < n1; ++n) {
    OT* row = op + (n - start) * K;
    const ST* dn = dp + n * (K / S);
    int64_t k = 0;
#if defined(STRATA_QUANT_AVX2)
    if constexpr (kSimdDequant<OT>) {
      for (; k < K; k += kBlock) {
        const ST* sub = dn + k / S;
        const float lo = scale1(sub), hi = scale1(sub + (S == 16 ? 1 : 0));
        const float scales[4] = {lo, lo, hi, hi};
        store_block(row + k, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + n * K + k)), true, scales, 0.f);
      }
    }
#endif
    for (; k < K; ++k) row[k] = static_cast<OT>(scale1(dn + k / S) * static_cast<float>(q[n * K + k]));
  }
}

// Weight rows [start, end) of a q4 weight as `dtype` [end - start, K].
at::Tensor q4_dequantize(at::Tensor qs, at::Tensor d, at::Tensor m, int64_t start, int64_t end, at::ScalarType dtype) {
  TORCH_CHECK(qs.dim() == 2, "qs must be [N, K / 2], got sizes ", qs.sizes());
  const int64_t N = qs.size(0), K = qs.size(1) * 2;
  check_q4(qs, d, m, K);
  check_row_range(start, end, N);
  check_float_dtype(dtype, "dtype");
  at::Tensor out = at::empty({end - start, K}, qs.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "q4_dequantize", [&] {
    with_scale_type(d.scalar_type(), [&](auto tag) {
      using ST = decltype(tag);
      at::parallel_for(start, end, 16, [&](int64_t n0, int64_t n1) {
        q4_dequant_rows<scalar_t, ST>(qs.data_ptr<uint8_t>(), static_cast<const ST*>(d.data_ptr()),
                                      static_cast<const ST*>(m.data_ptr()), K, n0, n1, start, out.data_ptr<scalar_t>());
      });
    });
  });
  return out;
}

at::Tensor q8_dequantize(at::Tensor qs, at::Tensor d, int64_t start, int64_t end, at::ScalarType dtype) {
  TORCH_CHECK(qs.dim() == 2, "qs must be [N, K], got sizes ", qs.sizes());
  const int64_t N = qs.size(0), K = qs.size(1);
  const int64_t S = check_q8(qs, d, K);
  check_row_range(start, end, N);
  check_float_dtype(dtype, "dtype");
  at::Tensor out = at::empty({end - start, K}, qs.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "q8_dequantize", [&] {
    with_scale_type(d.scalar_type(), [&](auto tag) {
      using ST = decltype(tag);
      at::parallel_for(start, end, 16, [&](int64_t n0, int64_t n1) {
        q8_dequant_rows<scalar_t, ST>(qs.data_ptr<int8_t>(), static_cast<const ST*>(d.data_ptr()), K, S, n0, n1, start,
                                      out.data_ptr<scalar_t>());
      });
    });
  });
  return out;
}

}  // namespace

namespace strata_ops {  // ops.h: for the decode loop (decode_loop.cpp)
at::Tensor q4_linear(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor m) { return ::q4_linear(x, qs, d, m); }
at::Tensor q8_linear(at::Tensor x, at::Tensor qs, at::Tensor d) { return ::q8_linear(x, qs, d); }
}  // namespace strata_ops

void register_quant_ops(pybind11::module_& m) {
  m.def("q4_linear", &q4_linear, "x [M, K] @ q4 weight^T -> [M, N] (int8 dot products)");
  m.def("q8_linear", &q8_linear, "x [M, K] @ q8 weight^T -> [M, N] (int8 dot products)");
  m.def("q4_dequantize", &q4_dequantize, "q4 weight rows [start, end) -> [end - start, K]");
  m.def("q8_dequantize", &q8_dequantize, "q8 weight rows [start, end) -> [end - start, K]");
}
