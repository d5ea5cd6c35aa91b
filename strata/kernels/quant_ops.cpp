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
// reproduces the same arithmetic in PyTorch for the tests.
//
// The kernels read the weights packed (layout below, made once by strata.layers.quant): 16 output
// rows side by side, so each dot-product instruction adds 4 channels of 16 rows at once against
// 4 activation bytes broadcast to every lane, and a block's unpacked weights serve every activation
// row of a tile. Three SIMD paths: AVX-512 VNNI (vpdpbusd), AVX-512BW (vpmaddubsw + vpmaddwd, 16
// lanes) and AVX2 (the same two instructions, the 16 rows as two halves of 8). Without VNNI, a q4
// block adds its vpmaddubsw pair sums as int16 (they cannot overflow: see Q4Packed::dot) and widens
// them to int32 once per block instead of once per instruction.
//
// On CPUs with AMX (Sapphire Rapids and later), calls of many rows can take the tile path instead
// (`int8_tile_rows`): per 32-channel block one tile product (tdpbsud for q4's unsigned nibbles,
// tdpbssd for q8) gives the integer sums of 16 activation rows x 16 weight rows, and the same float
// steps as the dot-product path turn them into outputs, in the same order, so a row comes out with
// the same bits on either path and whatever else shares the call (the tests check it per path).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "common.h"
#include "ops.h"
#include "simd.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define STRATA_QUANT_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define STRATA_QUANT_AVX512 1
#include "amx.h"
#if defined(__AVX512VNNI__) && defined(STRATA_AMX) && defined(__AMX_INT8__)
#define STRATA_QUANT_AMX 1
#endif
#endif
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
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
// Most activation rows sharing one unpacked weight block: as many as the registers hold. AVX-512's 32
// keep 9 rows' integer sums and float accumulators (a speculative verification of 8 drafts is one
// tile); AVX2's 16 hold 4 rows of each 8-lane half.
#if defined(STRATA_QUANT_AVX512)
constexpr int64_t kRowTile = 9;
#else
constexpr int64_t kRowTile = 4;
#endif
constexpr int64_t kRowBlock = 64;  // activation rows kept in cache while a thread walks its weight rows

// Activation rows quantized: q [M, K] int8; d, s, c [M, K / 32] float. The SIMD builds keep each
// tile's rows (for_each_tile) interleaved: a tile of rn rows from r0 holds its bytes at
// q[r0 K + ((8 b + j) rn + r) 4 + t] (byte 4 j + t of block b of its row r) and its block values at
// d[r0 nb + b rn + r], so the dot products of all its rows read one pointer at fixed offsets. The
// scalar build keeps rows whole (row m at q[m K], d[m nb]).
struct QuantRows {
  std::vector<int8_t> q;
  std::vector<float> d, s, c;
};

// The tiles of M activation rows: kRowBlock rows at a time (kept in cache while a thread walks its
// weight rows), each split into as few tiles of at most kRowTile rows as there can be, as even as
// they go (AVX2, 5 rows: 2 + 3, not 4 + 1): much of a tile's cost is per weight block (reading and
// unpacking it), so a nearly empty tile costs much of a full one. f(block_start, block_end, r0, rn).
template <typename F>
inline void for_each_tile(int64_t M, F&& f) {
  for (int64_t mt = 0; mt < M; mt += kRowBlock) {
    const int64_t m_end = std::min(M, mt + kRowBlock);
    const int64_t tiles = (m_end - mt + kRowTile - 1) / kRowTile;
    for (int64_t t = 0, r0 = mt; t < tiles; ++t) {
      const int64_t rn = (m_end - r0) / (tiles - t);  // the rest shared evenly: earlier tiles never larger
      f(mt, m_end, r0, rn);
      r0 += rn;
    }
  }
}

#if defined(STRATA_SIMD16_AVX512)
// 16 codes: x rounded to int8 at q (|x| <= 127: nothing saturates), and their values as floats.
inline V16 store_codes(int8_t* q, V16 x) {
  const __m512i c = _mm512_cvtps_epi32(x);  // rounds to nearest even, as nearbyint does
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(c));
  return _mm512_cvtepi32_ps(c);
}
#elif defined(STRATA_SIMD16_AVX2)
inline V16 store_codes(int8_t* q, V16 x) {
  const __m256i lo = _mm256_cvtps_epi32(x.lo), hi = _mm256_cvtps_epi32(x.hi);
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);  // 16 int16, in order
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q),
                   _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
  return {_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)};
}
#endif

template <typename T>
void quantize_row(const T* x, int64_t K, int8_t* q, float* d, float* s, float* c) {
#if defined(STRATA_SIMD16)
  if constexpr (kHasLoad16<T>) {
    // 16 blocks at a time, one per lane: their maxima, sums and code sums reduced together as
    // transpose trees (reduce16_max, reduce16) instead of three horizontal reductions a block. The
    // same scales and codes as the scalar loop; the float sums are added in another order.
    const int64_t nb = K / kBlock;
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
      const int64_t n = std::min<int64_t>(16, nb - b0);
      const T* xb = x + b0 * kBlock;
      V16 amax[16], sum[16];
      for (int64_t i = 0; i < 16; ++i) {
        if (i < n) {
          const V16 lo = load16(xb + i * kBlock), hi = load16(xb + i * kBlock + 16);
          amax[i] = vmax(vabs(lo), vabs(hi));
          sum[i] = vadd(lo, hi);
        } else {
          amax[i] = sum[i] = vzero();
        }
      }
      const V16 scale = vdiv(reduce16_max(amax), vset1(127.f));
      const V16 sums = reduce16(sum);
      alignas(64) float inv[16];
      store16(inv, vselect(vle(scale, vzero()), vzero(), vdiv(vset1(1.f), scale)));
      V16 qsum[16];  // per block, its codes' sums in 16 lanes (exact in float: |sum| <= 32 * 127)
      for (int64_t i = 0; i < 16; ++i) {
        if (i >= n) {
          qsum[i] = vzero();
          continue;
        }
        const V16 iv = vset1(inv[i]);
        int8_t* qb = q + (b0 + i) * kBlock;
        qsum[i] = vadd(store_codes(qb, vmul(load16(xb + i * kBlock), iv)),
                       store_codes(qb + 16, vmul(load16(xb + i * kBlock + 16), iv)));
      }
      alignas(64) float out[3][16];
      store16(out[0], scale);
      store16(out[1], sums);
      store16(out[2], vmul(vset1(8.f), vfnmadd(scale, reduce16(qsum), sums)));
      std::copy(out[0], out[0] + n, d + b0);
      std::copy(out[1], out[1] + n, s + b0);
      std::copy(out[2], out[2] + n, c + b0);
    }
    return;
  }
#endif
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
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  QuantRows r;
  r.q.resize(M * K);
  r.d.resize(M * nb);
  r.s.resize(M * nb);
  r.c.resize(M * nb);
#if defined(STRATA_QUANT_AVX2)
  std::vector<int64_t> tile_start(M), tile_rows(M);  // each row's tile
  for_each_tile(M, [&](int64_t, int64_t, int64_t r0, int64_t rn) {
    for (int64_t m = r0; m < r0 + rn; ++m) tile_start[m] = r0, tile_rows[m] = rn;
  });
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
#if defined(STRATA_QUANT_AVX2)
      std::vector<int8_t> q(K);
      std::vector<float> d(nb), s(nb), c(nb);
      for (int64_t m = m0; m < m1; ++m) {
        quantize_row(xp + m * K, K, q.data(), d.data(), s.data(), c.data());
        const int64_t r0 = tile_start[m], rn = tile_rows[m], row = m - r0;
        int8_t* tq = r.q.data() + r0 * K + row * 4;
        for (int64_t b = 0; b < nb; ++b) {
          for (int64_t j = 0; j < 8; ++j) std::memcpy(tq + (8 * b + j) * rn * 4, q.data() + b * kBlock + 4 * j, 4);
          const int64_t o = r0 * nb + b * rn + row;
          r.d[o] = d[b], r.s[o] = s[b], r.c[o] = c[b];
        }
      }
#else
      for (int64_t m = m0; m < m1; ++m) {
        const int64_t o = m * nb;
        quantize_row(xp + m * K, K, r.q.data() + m * K, r.d.data() + o, r.s.data() + o, r.c.data() + o);
      }
#endif
    });
  });
  return r;
}

// ----------------------------------------------------------------------------------------------
// Weights as the kernels keep them: 16 output rows interleaved (strata.layers.quant packs them).
//
//   q4  qp uint8 [G, K/32, 4, 16, 4], dp, mp [G, K/32, 16]   (G = ceil(N / 16); rows past N are 0)
//       qp[g, b, j, l, t] = byte 16b + 4j + t of row 16g + l in the row-major layout above: its low
//       nibble is channel 32b + 4j + t, its high nibble channel 32b + 16 + 4j + t.
//   q8  qp int8 [G, K/32, 8, 16, 4], dp [G, K/32, 32/S, 16]
//       qp[g, b, j, l, t] = weight (16g + l, 32b + 4j + t); dp[g, b, s, l] the scale of its sub-block s.
//
// So one 64-byte load holds 4 consecutive channels of 16 rows, one per 32-bit lane, and one dot-
// product instruction with 4 activation bytes broadcast to every lane adds 16 rows x 4 channels:
// no horizontal sums, the unpacked weights serve every activation row of a tile, and the scales of
// 16 rows are one vector. (AVX2 takes the 16 lanes as two halves of 8.)

#if defined(STRATA_QUANT_AVX2)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// 32 unsigned 4-bit weights of one q4 block, in input-channel order, as bytes.
inline __m256i unpack_q4(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Eight lanes: rows 8h .. 8h + 7 of a group.
struct Lanes8 {
  static constexpr int kLanes = 8;
  using I = __m256i;
  using F = __m256;
  static I load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static I bcast(const int8_t* p) { return _mm256_set1_epi32(load_i32(p)); }
  static I low_nibbles(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  static I high_nibbles(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
  // acc + the 4-byte dot products of u (unsigned, <= 128) and s (signed, >= -127): no saturation
  static I dot(I acc, I u, I s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  // dot() in two halves: int16 pair sums added up first (pair_dot), widened to int32 once (widen)
  static constexpr bool kPairSums = true;
  static I pair_dot(I acc16, I u, I s) { return _mm256_add_epi16(acc16, _mm256_maddubs_epi16(u, s)); }
  static I widen(I acc16) { return _mm256_madd_epi16(acc16, _mm256_set1_epi16(1)); }
  static I abs8(I w) { return _mm256_abs_epi8(w); }
  static I sign_of(I x, I w) { return _mm256_sign_epi8(x, w); }  // 0 where w is 0: |w| is too
  static I zero_i() { return _mm256_setzero_si256(); }
  static F zero() { return _mm256_setzero_ps(); }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  template <typename S>
  static F scales(const S* p) { return load8(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};
#endif

#if defined(STRATA_QUANT_AVX512)
inline __m512 load16f(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16f(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Sixteen lanes: a whole group.
struct Lanes16 {
  static constexpr int kLanes = 16;
  using I = __m512i;
  using F = __m512;
  static I load(const void* p) { return _mm512_loadu_si512(p); }
  static I bcast(const int8_t* p) { return _mm512_set1_epi32(load_i32(p)); }
  static I low_nibbles(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static I high_nibbles(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
  static I dot(I acc, I u, I s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
  }
#if defined(__AVX512VNNI__)
  static constexpr bool kPairSums = false;  // one instruction already: nothing to save
  // dot(acc, u, bcast(p)) with the 4 bytes at p broadcast by the instruction itself ({1to16}): GCC
  // does not fold the broadcast into vpdpbusd, and a separate one costs a uop per row and 4 channels
  static I dot_bcast(I acc, I u, const int8_t* p) {
    asm("vpdpbusd %[x]%{1to16%}, %[u], %[acc]" : [acc] "+v"(acc) : [u] "v"(u), [x] "m"(*reinterpret_cast<const int32_t*>(p)));
    return acc;
  }
#else
  static constexpr bool kPairSums = true;
#endif
  static I pair_dot(I acc16, I u, I s) { return _mm512_add_epi16(acc16, _mm512_maddubs_epi16(u, s)); }
#if defined(__AVX512VNNI__)
  // q8 with unsigned activations (kQ8UnsignedX): the weight sum per lane, and isum - 128 * wsum
  static I sum_bytes(I acc, I w) { return _mm512_dpbusd_epi32(acc, _mm512_set1_epi8(1), w); }
  static I sub_128x(I isum, I wsum) { return _mm512_sub_epi32(isum, _mm512_slli_epi32(wsum, 7)); }
#endif
  static I widen(I acc16) { return _mm512_madd_epi16(acc16, _mm512_set1_epi16(1)); }
  static I abs8(I w) { return _mm512_abs_epi8(w); }
  static I sign_of(I x, I w) { return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x); }
  static I zero_i() { return _mm512_setzero_si512(); }
  static F zero() { return _mm512_setzero_ps(); }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  template <typename S>
  static F scales(const S* p) { return load16f(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#endif

constexpr int64_t kGroup = 16;  // weight rows interleaved in one group

// q8 with VNNI: vpdpbusd takes the activations, stored as x + 128 (their sign bits flipped), for its
// unsigned operand and the weights as they are, instead of |w| and x with w's sign (two more
// instructions per row); the difference is 128 times a weight sum, one instruction per weight
// vector for every row of the tile. Not with vpmaddubsw (AVX2, AVX-512BW): its int16 pair sums of
// 255 x 127 would saturate.
#if defined(STRATA_QUANT_AVX512) && defined(__AVX512VNNI__)
constexpr bool kQ8UnsignedX = true;
#else
constexpr bool kQ8UnsignedX = false;
#endif

// A step streams each weight from memory once; with the hardware prefetcher alone an AVX-512 tile of
// several rows stalls on its lines (on Zen 4, a 1536 x 576 q4 weight out of cache at 9 rows took
// ~53 us against ~43 with this), so each block asks for the block this many ahead (the next group's
// too, a thread's groups being contiguous) and its scales. Not on AVX2: there the kernel is
// compute-bound past one row, and the same prefetches measured slower (9 rows ~91 -> ~98 us).
#if defined(STRATA_QUANT_AVX512)
constexpr bool kPrefetch = true;
#else
constexpr bool kPrefetch = false;
#endif
constexpr int64_t kPrefetchBlocks = 8;
// The weight bytes of the block kPrefetchBlocks after `block` (Bytes a block).
template <int64_t Bytes>
inline void prefetch_weights(const void* block) {
  const char* c = static_cast<const char*>(block) + kPrefetchBlocks * Bytes;
  for (int64_t o = 0; o < Bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
}
// The scales of the block kPrefetchBlocks after the one whose scales start at `scales` (PerBlock a block).
template <int64_t PerBlock, typename S>
inline void prefetch_scales(const S* scales) {
  __builtin_prefetch(scales + kPrefetchBlocks * PerBlock, 0, 3);
}

// A packed q4 weight: qp [G, nb, 4, 16, 4], dp and mp [G, nb, 16] of S.
template <typename S>
struct Q4Packed {
  const uint8_t* q;
  const S* d;
  const S* m;
  int64_t nb;
  static constexpr bool kFlipX = false;
  static constexpr bool kTileUnsigned = true;  // nibbles 0..15: the tiles take them as unsigned bytes
  static constexpr int kTileSubs = 1;           // tile products per block

  // acc + one block's part from its integer sum (as float) for one activation row: d * (xd * isum + xc)
  // + m * xs, in this order on every path (the dot products and the tiles), so a row's bits agree
  template <typename V>
  static typename V::F scale_sum(typename V::F acc, typename V::F isum, typename V::F dv, typename V::F mv, float xd,
                                 float xc, float xs) {
    const typename V::F t = V::fmadd(isum, V::set1(xd), V::set1(xc));
    return V::fmadd(mv, V::set1(xs), V::fmadd(dv, t, acc));
  }

  // lanes [h * V::kLanes, ...) of group g for the RT activation rows of one tile (xq, xd, xs, xc: the
  // tile's, interleaved as QuantRows says): out[r][lane] += its dot products. d * (xd * isum + xc) +
  // m * xs per block (see the top).
  template <typename V, int RT>
  void dot(int64_t g, int h, const int8_t* xq, const float* xd, const float* xs, const float* xc,
           typename V::F* acc) const {
    const int64_t lane0 = h * V::kLanes;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* qb = q + (g * nb + b) * 256 + lane0 * 4;
      if constexpr (kPrefetch) {
        prefetch_weights<256>(q + (g * nb + b) * 256);
        prefetch_scales<kGroup>(d + (g * nb + b) * kGroup);
        prefetch_scales<kGroup>(m + (g * nb + b) * kGroup);
      }
      typename V::I isum[RT];
      for (int r = 0; r < RT; ++r) isum[r] = V::zero_i();
      for (int j = 0; j < 4; ++j) {
        const typename V::I v = V::load(qb + j * 64);
        const typename V::I lo = V::low_nibbles(v), hi = V::high_nibbles(v);
        for (int r = 0; r < RT; ++r) {
          const int8_t* x = xq + ((8 * b + j) * RT + r) * 4;  // channels 4j.. (low nibbles)
          const int8_t* x16 = x + 4 * RT * 4;                  // channels 16 + 4j.. (high nibbles)
          if constexpr (V::kPairSums) {
            // a block's 8 int16 pair sums per lane stay within int16: |sum| <= 8 * 2 * 15 * 127 = 30480
            // (nibbles <= 15, activations in -127..127), so they add as int16 and widen once below
            isum[r] = V::pair_dot(V::pair_dot(isum[r], lo, V::bcast(x)), hi, V::bcast(x16));
          } else {
            isum[r] = V::dot_bcast(V::dot_bcast(isum[r], lo, x), hi, x16);
          }
        }
      }
      if constexpr (V::kPairSums) {
        for (int r = 0; r < RT; ++r) isum[r] = V::widen(isum[r]);
      }
      const typename V::F dv = V::scales(d + (g * nb + b) * kGroup + lane0);
      const typename V::F mv = V::scales(m + (g * nb + b) * kGroup + lane0);
      for (int r = 0; r < RT; ++r) {
        const int64_t o = b * RT + r;
        acc[r] = scale_sum<V>(acc[r], V::to_float(isum[r]), dv, mv, xd[o], xc[o], xs[o]);
      }
    }
  }

  // The scalar reference: weight row 16g + l with one activation row.
  float scalar(int64_t g, int64_t l, const int8_t* xq, const float* xd, const float* xs, const float* xc) const {
    float sum = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      int32_t isum = 0;
      for (int64_t j = 0; j < 4; ++j) {
        const uint8_t* p = q + (g * nb + b) * 256 + j * 64 + l * 4;
        for (int64_t t = 0; t < 4; ++t) {
          isum += (p[t] & 15) * xq[b * kBlock + 4 * j + t] + (p[t] >> 4) * xq[b * kBlock + 16 + 4 * j + t];
        }
      }
      const int64_t o = (g * nb + b) * kGroup + l;
      sum += scale1(d + o) * (xd[b] * static_cast<float>(isum) + xc[b]) + scale1(m + o) * xs[b];
    }
    return sum;
  }
};

// A packed q8 weight with one scale per G input channels: qp [G, nb, 8, 16, 4], dp [G, nb, 32/G, 16].
template <int G, typename S>
struct Q8Packed {
  const int8_t* q;
  const S* d;
  int64_t nb;
  static constexpr int kSubs = kBlock / G;
  static constexpr bool kFlipX = kQ8UnsignedX;  // dot() takes the activation bytes as x + 128
  static constexpr bool kTileUnsigned = false;
  static constexpr int kTileSubs = kSubs;

  // acc + one sub-block's part from its integer sum (as float) for one activation row, on every path
  template <typename V>
  static typename V::F scale_sum(typename V::F acc, typename V::F isum, typename V::F dv, float xd) {
    return V::fmadd(dv, V::mul(isum, V::set1(xd)), acc);
  }

  template <typename V, int RT>
  void dot(int64_t g, int h, const int8_t* xq, const float* xd, const float*, const float*,
           typename V::F* acc) const {
    const int64_t lane0 = h * V::kLanes;
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* qb = q + (g * nb + b) * 512 + lane0 * 4;
      if constexpr (kPrefetch) {
        prefetch_weights<512>(q + (g * nb + b) * 512);
        prefetch_scales<kSubs * kGroup>(d + (g * nb + b) * kSubs * kGroup);
      }
      for (int sub = 0; sub < kSubs; ++sub) {
        typename V::I isum[RT];
        for (int r = 0; r < RT; ++r) isum[r] = V::zero_i();
        if constexpr (kFlipX) {
          // sum (x + 128) w - 128 sum w = sum x w, exact in int32
          typename V::I wsum = V::zero_i();
          for (int j = sub * (8 / kSubs); j < (sub + 1) * (8 / kSubs); ++j) {
            const typename V::I w = V::load(qb + j * 64);
            wsum = V::sum_bytes(wsum, w);
            for (int r = 0; r < RT; ++r) isum[r] = V::dot(isum[r], V::bcast(xq + ((8 * b + j) * RT + r) * 4), w);
          }
          for (int r = 0; r < RT; ++r) isum[r] = V::sub_128x(isum[r], wsum);
        } else {
          for (int j = sub * (8 / kSubs); j < (sub + 1) * (8 / kSubs); ++j) {
            const typename V::I w = V::load(qb + j * 64);
            const typename V::I u = V::abs8(w);
            for (int r = 0; r < RT; ++r) {
              isum[r] = V::dot(isum[r], u, V::sign_of(V::bcast(xq + ((8 * b + j) * RT + r) * 4), w));
            }
          }
        }
        const typename V::F dv = V::scales(d + ((g * nb + b) * kSubs + sub) * kGroup + lane0);
        for (int r = 0; r < RT; ++r) acc[r] = scale_sum<V>(acc[r], V::to_float(isum[r]), dv, xd[b * RT + r]);
      }
    }
  }

  float scalar(int64_t g, int64_t l, const int8_t* xq, const float* xd, const float*, const float*) const {
    float sum = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      for (int sub = 0; sub < kSubs; ++sub) {
        int32_t isum = 0;
        for (int64_t j = sub * (8 / kSubs); j < (sub + 1) * (8 / kSubs); ++j) {
          const int8_t* p = q + (g * nb + b) * 512 + j * 64 + l * 4;
          for (int64_t t = 0; t < 4; ++t) isum += p[t] * xq[b * kBlock + 4 * j + t];
        }
        sum += scale1(d + ((g * nb + b) * kSubs + sub) * kGroup + l) * xd[b] * static_cast<float>(isum);
      }
    }
    return sum;
  }
};

// Rows [r0, r0 + rows) of group g's outputs (result[r][lane], the first `cols` lanes) into out [M, N].
template <typename OT>
inline void store_group_rows(OT* out, int64_t N, int64_t g, int64_t r0, int64_t rows, int64_t cols,
                             const float (*result)[kGroup]) {
  for (int64_t r = 0; r < rows; ++r) {
    OT* o = out + (r0 + r) * N + g * kGroup;
    for (int64_t l = 0; l < cols; ++l) o[l] = static_cast<OT>(result[r][l]);
  }
}

#if defined(STRATA_QUANT_AMX)
// ----------------------------------------------------------------------------------------------
// AMX int8 tiles (amx.h: where the OS refuses them, the dot-product path runs).
//
// Tiles as configured: C0, C1 the int32 sums of 16 activation rows x 16 weight rows; A0, A1 16
// activation rows x 32 channels (one block); B0, B1 one block of a group's 16 weight rows, 8 rows of
// 4 channels x 16 weight rows (the q8 packing is that layout already; q4's nibbles are unpacked
// into it); AH, BH the halves for 16-channel sub-blocks (q8 with S = 16).
constexpr int kTileC0 = 0, kTileC1 = 1, kTileA0 = 2, kTileA1 = 3, kTileB0 = 4, kTileB1 = 5, kTileAH = 6,
              kTileBH = 7;
constexpr int64_t kTileRows = 16;    // activation rows a tile product takes
constexpr int64_t kTileChunk = 64;   // activation rows whose outputs stay in cache while a thread walks its groups
constexpr int64_t kTileAhead = 4;    // tile products stored ahead of the step whose sums are scaled (even)
constexpr int64_t kTileRing = kTileAhead + 2;  // stored sums in flight

inline void configure_tiles() {
  TileConfig cfg;
  cfg.set(kTileC0, kTileRows, 64);
  cfg.set(kTileC1, kTileRows, 64);
  cfg.set(kTileA0, kTileRows, kBlock);
  cfg.set(kTileA1, kTileRows, kBlock);
  cfg.set(kTileB0, kBlock / 4, 64);
  cfg.set(kTileB1, kBlock / 4, 64);
  cfg.set(kTileAH, kTileRows, kBlock / 2);
  cfg.set(kTileBH, kBlock / 8, 64);
  cfg.load();
}
#endif

// Per format (kQ4, kQ8): calls of at least this many rows take the tiles (0: never). Set from a
// timing at load (strata.layers.quant.choose_int8_tiles); the result is the same either way.
enum Format { kQ4 = 0, kQ8 = 1 };
std::atomic<int64_t> g_tile_min_rows[2] = {0, 0};

bool tiles_available() {
#if defined(STRATA_QUANT_AMX)
  return tiles_permitted();
#else
  return false;
#endif
}

#if defined(STRATA_QUANT_AMX)
// Activation rows for the tiles: row-major codes q [Mp, K] (Mp = M rounded up to kTileRows, the
// padding rows zero) and d, s, c block-major [K / 32, Mp], so a block's values for a tile's rows
// sit at fixed offsets from one pointer.
struct TileRows {
  std::vector<int8_t> q;
  std::vector<float> d, s, c;
  int64_t rows = 0;
};

TileRows quantize_tile_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  TileRows r;
  r.rows = (M + kTileRows - 1) / kTileRows * kTileRows;
  r.q.assign(r.rows * K, 0);
  r.d.assign(r.rows * nb, 0.f);
  r.s.assign(r.rows * nb, 0.f);
  r.c.assign(r.rows * nb, 0.f);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_tile_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      std::vector<float> d(nb), s(nb), c(nb);
      for (int64_t m = m0; m < m1; ++m) {
        quantize_row(xp + m * K, K, r.q.data() + m * K, d.data(), s.data(), c.data());
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t o = b * r.rows + m;
          r.d[o] = d[b], r.s[o] = s[b], r.c[o] = c[b];
        }
      }
    });
  });
  return r;
}

// Tile loads and stores (amx.h's form). No memory clobbers: they would make the compiler keep the
// accumulators in memory. A tile load reads what was written before the kernel's loop
// (tile_linear_groups fences the unpacked weights); a tile store says which 16 x 16 sums it writes.
template <int T>
inline void tile_load(const void* p, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T));
}
template <int T>
inline void tile_store(int32_t* sums) {
  asm volatile("tilestored %%tmm%c2, (%1,%3,1)"
               : "=m"(*reinterpret_cast<int32_t(*)[kTileRows * kGroup]>(sums))
               : "r"(sums), "i"(T), "r"(int64_t{64}));
}

// One tile product into C from A (rows of the activations from a, `stride` bytes apart) and B (at
// b, rows 64 bytes apart): q4 multiplies signed activations by unsigned weights, q8 both signed.
template <bool kUnsignedW, int C, int A, int B>
inline void tile_product(const int8_t* a, int64_t stride, const void* b) {
  tile_zero<C>();
  tile_load<A>(a, stride);
  tile_load<B>(b, 64);
  if constexpr (kUnsignedW) {  // AT&T order: B, A, C
    asm volatile("tdpbsud %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C));
  } else {
    asm volatile("tdpbssd %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C));
  }
}

// q4: block b of group g's weights as tile B rows (unsigned bytes), into out[512].
template <typename S>
inline void unpack_q4_tile(const Q4Packed<S>& w, int64_t g, int64_t b, uint8_t* out) {
  const uint8_t* qb = w.q + (g * w.nb + b) * 256;
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(qb + j * 64);
    _mm512_store_si512(out + j * 64, Lanes16::low_nibbles(v));         // channels 4j..4j+3
    _mm512_store_si512(out + (4 + j) * 64, Lanes16::high_nibbles(v));  // channels 16+4j..
  }
}

// acc[r] (16 weight rows) += block b's part for activation rows r of the tile at m0, from the integer
// sums isum (a stored C tile): each format's scale_sum, as its dot() takes it.
template <typename S>
inline void tile_block(const Q4Packed<S>& w, int64_t g, int64_t b, int, const TileRows& x, int64_t m0,
                          const int32_t* isum, __m512* acc) {
  const int64_t nb = w.nb;
  const __m512 dv = Lanes16::scales(w.d + (g * nb + b) * kGroup);
  const __m512 mv = Lanes16::scales(w.m + (g * nb + b) * kGroup);
  const int64_t o = b * x.rows + m0;
  const float *xd = x.d.data() + o, *xs = x.s.data() + o, *xc = x.c.data() + o;
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) {
    const __m512 i = Lanes16::to_float(_mm512_load_si512(isum + r * kGroup));
    acc[r] = Q4Packed<S>::template scale_sum<Lanes16>(acc[r], i, dv, mv, xd[r], xc[r], xs[r]);
  }
}

template <int G, typename S>
inline void tile_block(const Q8Packed<G, S>& w, int64_t g, int64_t b, int sub, const TileRows& x, int64_t m0,
                          const int32_t* isum, __m512* acc) {
  constexpr int kSubs = Q8Packed<G, S>::kSubs;
  const __m512 dv = Lanes16::scales(w.d + ((g * w.nb + b) * kSubs + sub) * kGroup);
  const float* xd = x.d.data() + b * x.rows + m0;
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) {
    const __m512 i = Lanes16::to_float(_mm512_load_si512(isum + r * kGroup));
    acc[r] = Q8Packed<G, S>::template scale_sum<Lanes16>(acc[r], i, dv, xd[r]);
  }
}

// Outputs of groups [g0, g1) for all M rows through the tiles (the thread's own tile state).
template <typename OT, typename W>
void tile_linear_groups(const W& w, const TileRows& x, int64_t M, int64_t K, int64_t g0, int64_t g1, OT* out,
                        int64_t N) {
  configure_tiles();
  const int64_t nb = K / kBlock;
  alignas(64) int32_t isum[kTileRing][kTileRows * kGroup];
  alignas(64) float result[kTileRows][kGroup];
  std::vector<uint8_t> unpacked;
  for (int64_t mc = 0; mc < x.rows; mc += kTileChunk) {
    const int64_t mc_end = std::min(x.rows, mc + kTileChunk);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t cols = std::min(kGroup, N - g * kGroup);
      // each block's B tile: q8's packing as it is; q4's nibbles unpacked once for the chunk's rows
      const uint8_t* wb;
      if constexpr (W::kTileUnsigned) {
        unpacked.resize(nb * 512 + 64);
        uint8_t* u = unpacked.data() + (64 - reinterpret_cast<uintptr_t>(unpacked.data()) % 64) % 64;
        for (int64_t b = 0; b < nb; ++b) unpack_q4_tile(w, g, b, u + b * 512);
        wb = u;
        asm volatile("" ::: "memory");  // the unpacked blocks are in memory before the tiles load them
      } else {
        wb = reinterpret_cast<const uint8_t*>(w.q) + g * nb * 512;
      }
      for (int64_t m0 = mc; m0 < mc_end; m0 += kTileRows) {
        __m512 acc[kTileRows];  // in registers: indexed by constants only
#pragma GCC unroll 16
        for (int r = 0; r < kTileRows; ++r) acc[r] = _mm512_setzero_ps();
        const int8_t* xa = x.q.data() + m0 * K;
        // Steps: one tile product each (a block, or a 16-channel sub-block of q8 with S = 16). A
        // step's sums are stored kTileAhead steps before they are scaled: a load straight after the
        // tile store that feeds it waits for the store to retire, which stalls the whole window.
        constexpr int kSubs = W::kTileSubs;
        const int64_t steps = nb * kSubs;
        const auto product = [&]<int C>(int64_t step) {
          if (step >= steps) return;
          const int64_t b = step / kSubs, sub = step % kSubs;
          constexpr int A = kSubs == 1 ? (C == kTileC0 ? kTileA0 : kTileA1) : kTileAH;
          constexpr int B = kSubs == 1 ? (C == kTileC0 ? kTileB0 : kTileB1) : kTileBH;
          tile_product<W::kTileUnsigned, C, A, B>(xa + b * kBlock + sub * (kBlock / kSubs), K,
                                                  wb + b * 512 + sub * (512 / kSubs));
          tile_store<C>(isum[step % kTileRing]);
        };
        for (int64_t step = 0; step < kTileAhead; step += 2) {
          product.template operator()<kTileC0>(step);
          product.template operator()<kTileC1>(step + 1);
        }
        for (int64_t step = 0; step < steps; step += 2) {
          product.template operator()<kTileC0>(step + kTileAhead);
          product.template operator()<kTileC1>(step + kTileAhead + 1);
          tile_block(w, g, step / kSubs, step % kSubs, x, m0, isum[step % kTileRing], acc);
          if (step + 1 < steps) {
            tile_block(w, g, (step + 1) / kSubs, (step + 1) % kSubs, x, m0, isum[(step + 1) % kTileRing], acc);
          }
        }
#pragma GCC unroll 16
        for (int r = 0; r < kTileRows; ++r) _mm512_store_ps(result[r], acc[r]);
        store_group_rows(out, N, g, m0, std::min(kTileRows, M - m0), cols, result);
      }
    }
  }
  release_tiles();
}
#endif

// One group's 16 outputs for RT activation rows from r0: result[r][lane].
template <int RT, typename W>
inline void group_rows(const W& w, const QuantRows& x, int64_t g, int64_t r0, int64_t K, int64_t nb,
                       float (*result)[kGroup]) {
  const int8_t* xq = x.q.data() + r0 * K;
  const float *xd = x.d.data() + r0 * nb, *xs = x.s.data() + r0 * nb, *xc = x.c.data() + r0 * nb;
#if defined(STRATA_QUANT_AVX512)
  using V = Lanes16;
#elif defined(STRATA_QUANT_AVX2)
  using V = Lanes8;
#endif
#if defined(STRATA_QUANT_AVX2)
  for (int h = 0; h < kGroup / V::kLanes; ++h) {
    typename V::F acc[RT];
    for (int r = 0; r < RT; ++r) acc[r] = V::zero();
    w.template dot<V, RT>(g, h, xq, xd, xs, xc, acc);
    for (int r = 0; r < RT; ++r) V::store(result[r] + h * V::kLanes, acc[r]);
  }
#else
  for (int r = 0; r < RT; ++r) {
    for (int64_t l = 0; l < kGroup; ++l) result[r][l] = w.scalar(g, l, xq + r * K, xd + r * nb, xs + r * nb, xc + r * nb);
  }
#endif
}

// One group's outputs for rows [r0, r0 + rn), rn <= kRowTile, into result.
template <typename W>
inline void tile_rows(const W& w, const QuantRows& x, int64_t g, int64_t r0, int64_t rn, int64_t K, int64_t nb,
                      float (*result)[kGroup]) {
  with_count<kRowTile>(rn, [&]<int RT>() { group_rows<RT>(w, x, g, r0, K, nb, result); });
}

// Output columns of groups [g0, g1) for all M rows, tile by tile (for_each_tile), each block of
// rows over all the groups before the next.
template <typename OT, typename W>
void linear_groups(const W& w, const QuantRows& x, int64_t M, int64_t K, int64_t g0, int64_t g1, OT* out,
                   int64_t N) {
  const int64_t nb = K / kBlock;
  float result[kRowTile][kGroup];
  std::vector<std::pair<int64_t, int64_t>> tiles;  // one block of rows: (r0, rn)
  int64_t block_start = -1;
  auto run_block = [&]() {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t cols = std::min(kGroup, N - g * kGroup);
      for (const auto& [r0, rn] : tiles) {
        tile_rows(w, x, g, r0, rn, K, nb, result);
        store_group_rows(out, N, g, r0, rn, cols, result);
      }
    }
    tiles.clear();
  };
  for_each_tile(M, [&](int64_t mt, int64_t, int64_t r0, int64_t rn) {
    if (mt != block_start && !tiles.empty()) run_block();
    block_start = mt;
    tiles.emplace_back(r0, rn);
  });
  run_block();
}

// Every entry point checks dtypes, devices, layouts and that the weight's groups, blocks and rows
// agree with K and N before it touches a data pointer: a mismatch raises a RuntimeError naming the
// argument, the sizes it has and the ones it needs, instead of reading out of bounds.

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

void check_param(const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef sizes, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous, got sizes ", t.sizes(), " with strides ", t.strides());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == sizes, name, " must be ", sizes, ", got ", t.sizes());
}

// Scales (or offsets): float32 or float16 of `sizes`.
void check_scales(const at::Tensor& t, at::IntArrayRef sizes, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf, name,
              " must be float32 or float16, got ", t.scalar_type());
  check_param(t, t.scalar_type(), sizes, name);
}

// N output rows in G = ceil(N / 16) groups of a weight over K input channels.
int64_t check_groups(const at::Tensor& qp, int64_t K, int64_t N, int64_t quads) {
  TORCH_CHECK(K % kBlock == 0, "K (", K, ") must be a multiple of ", kBlock);
  TORCH_CHECK(qp.dim() == 5, "qp must be [G, K / 32, ", quads, ", 16, 4], got sizes ", qp.sizes());
  const int64_t G = qp.size(0);
  TORCH_CHECK(N > (G - 1) * kGroup && N <= G * kGroup, "N (", N, ") must be within the ", G, " groups of 16 rows of qp");
  return G;
}

// A packed q4 weight: qp uint8 [G, K/32, 4, 16, 4], dp and mp [G, K/32, 16] of one dtype.
void check_q4(const at::Tensor& qp, const at::Tensor& dp, const at::Tensor& mp, int64_t K, int64_t N) {
  const int64_t G = check_groups(qp, K, N, 4);
  check_param(qp, at::kByte, {G, K / kBlock, 4, kGroup, 4}, "qp");
  check_scales(dp, {G, K / kBlock, kGroup}, "dp");
  check_scales(mp, {G, K / kBlock, kGroup}, "mp");
  TORCH_CHECK(dp.scalar_type() == mp.scalar_type(), "dp (", dp.scalar_type(), ") and mp (", mp.scalar_type(),
              ") must share a dtype");
}

// A packed q8 weight: qp int8 [G, K/32, 8, 16, 4], dp float32 or float16 [G, K/32, 32/S, 16]; returns S.
int64_t check_q8(const at::Tensor& qp, const at::Tensor& dp, int64_t K, int64_t N) {
  const int64_t G = check_groups(qp, K, N, 8);
  check_param(qp, at::kChar, {G, K / kBlock, 8, kGroup, 4}, "qp");
  TORCH_CHECK(dp.dim() == 4 && (dp.size(2) == 1 || dp.size(2) == 2),
              "dp must be [G, K / 32, 32 / S, 16] with S = 16 or 32, got sizes ", dp.sizes());
  check_scales(dp, {G, K / kBlock, dp.size(2), kGroup}, "dp");
  return kBlock / dp.size(2);
}

// Groups each thread takes: enough to amortise the dispatch, and an even split.
int64_t grain(int64_t G, int64_t M) {
  return std::max<int64_t>(1, std::min<int64_t>(4, G / (4 * at::get_num_threads()) / std::max<int64_t>(1, M / 16)));
}

// x [M, K] float/bf16/fp16/fp64 @ weight^T -> [M, N] in x's dtype, groups split over the threads.
template <typename MakeWeights>
at::Tensor packed_linear(const at::Tensor& x, int64_t N, int64_t G, at::ScalarType scale_dtype, Format format,
                         MakeWeights make) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  // the tiles for calls of at least the format's rows (int8_tile_rows), else the dot products
#if defined(STRATA_QUANT_AMX)
  const int64_t tile_min = g_tile_min_rows[format].load(std::memory_order_relaxed);
  const bool tiles = tile_min > 0 && M >= tile_min && tiles_permitted();
  const TileRows xt = tiles ? quantize_tile_rows(x) : TileRows{};
#else
  (void)format;
  constexpr bool tiles = false;
#endif
  QuantRows xq = tiles ? QuantRows{} : quantize_rows(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_linear", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    with_scale_type(scale_dtype, [&](auto tag) {
      make(tag, [&](const auto& w) {
#if defined(STRATA_QUANT_AMX)
        if (tiles) {
          at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) { tile_linear_groups(w, xt, M, K, g0, g1, op, N); });
          return;
        }
#endif
        if constexpr (std::decay_t<decltype(w)>::kFlipX) {
          for (int8_t& v : xq.q) v = static_cast<int8_t>(v ^ 0x80);  // x + 128 as unsigned bytes
        }
        at::parallel_for(0, G, grain(G, M), [&](int64_t g0, int64_t g1) { linear_groups(w, xq, M, K, g0, g1, op, N); });
      });
    });
  });
  return out;
}

at::Tensor q4_linear(at::Tensor x, at::Tensor qp, at::Tensor dp, at::Tensor mp, int64_t N) {
  check_x(x);
  const int64_t K = x.size(1);
  check_q4(qp, dp, mp, K, N);
  return packed_linear(x, N, qp.size(0), dp.scalar_type(), kQ4, [&](auto tag, auto&& run) {
    using S = decltype(tag);
    run(Q4Packed<S>{qp.data_ptr<uint8_t>(), static_cast<const S*>(dp.data_ptr()), static_cast<const S*>(mp.data_ptr()),
                    K / kBlock});
  });
}

at::Tensor q8_linear(at::Tensor x, at::Tensor qp, at::Tensor dp, int64_t N) {
  check_x(x);
  const int64_t K = x.size(1);
  const int64_t S = check_q8(qp, dp, K, N);
  return packed_linear(x, N, qp.size(0), dp.scalar_type(), kQ8, [&](auto tag, auto&& run) {
    using ST = decltype(tag);
    const int8_t* q = qp.data_ptr<int8_t>();
    const ST* d = static_cast<const ST*>(dp.data_ptr());
    if (S == 16) {
      run(Q8Packed<16, ST>{q, d, K / kBlock});
    } else {
      run(Q8Packed<32, ST>{q, d, K / kBlock});
    }
  });
}

}  // namespace

namespace strata_ops {  // ops.h: for the decode loop (decode_loop.cpp)
at::Tensor q4_linear(at::Tensor x, at::Tensor qp, at::Tensor dp, at::Tensor mp, int64_t N) {
  return ::q4_linear(x, qp, dp, mp, N);
}
at::Tensor q8_linear(at::Tensor x, at::Tensor qp, at::Tensor dp, int64_t N) { return ::q8_linear(x, qp, dp, N); }
}  // namespace strata_ops

void register_quant_ops(pybind11::module_& m) {
  m.def("int8_tiles_available", &tiles_available,
        "whether q4_linear/q8_linear can use AMX int8 tiles here (built with them, the CPU has them, the OS grants them)");
  m.def(
      "set_int8_tile_rows",
      [](int64_t q4_rows, int64_t q8_rows) {
        TORCH_CHECK(q4_rows >= 0 && q8_rows >= 0, "rows must be >= 0 (0: never use the tiles), got ", q4_rows, " and ",
                    q8_rows);
        TORCH_CHECK((q4_rows == 0 && q8_rows == 0) || tiles_available(),
                    "AMX int8 tiles are not available in this build or on this CPU");
        g_tile_min_rows[kQ4].store(q4_rows);
        g_tile_min_rows[kQ8].store(q8_rows);
      },
      "calls of at least this many rows take the AMX int8 tiles, for q4 and q8 weights (0: never); the results "
      "are the same either way");
  m.def(
      "int8_tile_rows", [] { return std::make_pair(g_tile_min_rows[kQ4].load(), g_tile_min_rows[kQ8].load()); },
      "(q4, q8): the rows from which calls take the tiles (0: never)");
  m.def("q4_linear", &q4_linear, "x [M, K] @ packed q4 weight of N rows^T -> [M, N] (int8 dot products)");
  m.def("q8_linear", &q8_linear, "x [M, K] @ packed q8 weight of N rows^T -> [M, N] (int8 dot products)");
}
