// The attention kernels' bf16 arithmetic on CPUs with AVX512-BF16 (vdpbf16ps: 32 bf16 products per
// instruction, summed in pairs into float lanes), for bf16 queries and a bf16 cache. Decode
// attention (attention_ops.cpp) scores a row's keys in 16-key blocks, or, for a verification's
// many rows, transposed with the same sums; both kernels multiply the probabilities, rounded to bf16
// as PyTorch's bf16 attention rounds them, into the values two keys per instruction. Every lane's
// arithmetic is its own row's, so a row's bits do not depend on the rows it is batched with.
#pragma once

#include <c10/util/BFloat16.h>

#include "common.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kKeyTile = 64;  // decode attention: keys per tile (the stride of its score rows)

// The bf16 P @ V paths (AVX512-BF16) multiply two keys per instruction, each lane a dimension's pair
// of values (the unpack of two value rows); a row's accumulator then holds each 32-dimension chunk in
// the unpack's order: position p holds dimension values_dim(p).
inline int64_t values_dim(int64_t p) { return p < 16 ? 8 * (p / 4) + p % 4 : 8 * ((p - 16) / 4) + 4 + (p - 16) % 4; }

// A row's accumulator back in dimension order (see values_dim); D % 32 == 0.
inline void values_unpermute(float* acc, int64_t D) {
#if defined(__AVX512F__)
  struct Order {  // where dimension d sits: chunk position (d < 16: from the low half, else the high)
    alignas(64) int32_t pos[32];
    Order() {
      for (int p = 0; p < 32; ++p) pos[values_dim(p)] = p;
    }
  };
  static const Order order;
  const __m512i lo = _mm512_load_si512(order.pos), hi = _mm512_load_si512(order.pos + 16);
  for (int64_t c = 0; c < D; c += 32) {
    const __m512 a = _mm512_loadu_ps(acc + c), b = _mm512_loadu_ps(acc + c + 16);
    _mm512_storeu_ps(acc + c, _mm512_permutex2var_ps(a, lo, b));
    _mm512_storeu_ps(acc + c + 16, _mm512_permutex2var_ps(a, hi, b));
  }
#else
  float chunk[32];
  for (int64_t c = 0; c < D; c += 32) {
    for (int64_t p = 0; p < 32; ++p) chunk[values_dim(p)] = acc[c + p];
    std::copy(chunk, chunk + 32, acc + c);
  }
#endif
}

#if defined(__AVX512BF16__)
// ---------------------------------------------------------------------------------------------
// Decode attention
// ---------------------------------------------------------------------------------------------
// Keys [jj, jj + 16) scored for every head, each key by the same instructions whichever lanes it
// shares (the last key's pointer stands in for keys past the tile: their lanes are not stored).
inline void block_scores_bf16(const c10::BFloat16* qb, int64_t G, int64_t D, const c10::BFloat16* const* keys,
                              int64_t jj, __mmask16 store, float* scores) {
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[16];
    for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(qb + g * D + d);
      for (int k = 0; k < 16; ++k) {
        acc[k] = _mm512_dpbf16_ps(acc[k], qv, (__m512bh)_mm512_loadu_si512(keys[jj + k] + d));
      }
    }
    _mm512_mask_storeu_ps(scores + g * kKeyTile + jj, store, reduce16(acc));
  }
}

// bf16 queries and keys: scores with the bf16 dot-product instruction (32 products per
// instruction, no widening of the keys). qb: G rows of D bf16; unscaled, the caller scales. A
// tile's last keys (fewer than 16) go as a 16-key block of their own: a key's score is the same
// whichever tile position or row length put it there.
inline void tile_scores_bf16(const c10::BFloat16* qb, int64_t G, int64_t D, const c10::BFloat16* const* keys,
                             int64_t jn, float* scores) {
  int64_t jj = 0;
  for (; jj + 16 <= jn; jj += 16) block_scores_bf16(qb, G, D, keys, jj, 0xFFFF, scores);
  if (jj < jn) {
    const c10::BFloat16* padded[kKeyTile + 16];
    const int64_t rest = jn - jj;
    for (int64_t k = 0; k < 16; ++k) padded[jj + k] = keys[jj + std::min(k, rest - 1)];
    block_scores_bf16(qb, G, D, padded, jj, static_cast<__mmask16>((1u << rest) - 1), scores);
  }
}

// 16 rows of 16 dwords transposed: out[c] lane k = r[k] lane c (unpack 32, unpack 64, two 128-bit shuffles).
inline void transpose16_epi32(const __m512i* r, __m512i* out) {
  __m512i t[16], w[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // w[4i + k], 128-bit chunk c: column 4c + k of rows 4i .. 4i + 3
    w[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    w[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    w[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    w[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i y0 = _mm512_shuffle_i32x4(w[k], w[4 + k], 0x44), y1 = _mm512_shuffle_i32x4(w[k], w[4 + k], 0xEE);
    const __m512i z0 = _mm512_shuffle_i32x4(w[8 + k], w[12 + k], 0x44);
    const __m512i z1 = _mm512_shuffle_i32x4(w[8 + k], w[12 + k], 0xEE);
    out[k] = _mm512_shuffle_i32x4(y0, z0, 0x88);
    out[4 + k] = _mm512_shuffle_i32x4(y0, z0, 0xDD);
    out[8 + k] = _mm512_shuffle_i32x4(y1, z1, 0x88);
    out[12 + k] = _mm512_shuffle_i32x4(y1, z1, 0xDD);
  }
}

// From this many query rows (a verification's rows x the heads of a KV head) a 16-key block is
// scored transposed: its keys turned once into D / 2 vectors of one bf16 pair per key, so each row's
// 16 scores need no horizontal sums. The sums are block_scores_bf16's, lane for lane and in its
// reduction tree's order (pair l of chunk h into lane l's partial, then
// ((l0 + l2) + (l1 + l3)) per four lanes, then (q0 + q2) + (q1 + q3)): the same bits, so a row's
// scores do not depend on which path its run took. Fewer rows do not pay back the transpose.
constexpr int64_t kTransposedRows = 6;

// scores[i * kKeyTile + jj] = q_i . key_jj for the n query rows q[i] (32 C bf16 each) and the tile's
// jn keys; unscaled, the caller scales. C a template argument: the chunk loop unrolled, the 16 lane
// partials in registers.
template <int C>
void tile_scores_bf16_transposed(const c10::BFloat16* const* q, int64_t n, const c10::BFloat16* const* keys,
                                 int64_t jn, float* scores) {
  alignas(64) __m512i kt[16 * C];  // kt[16 h + l] lane k: bf16 pair l of chunk h of key k
  for (int64_t jj = 0; jj < jn; jj += 16) {
    const int64_t last = std::min<int64_t>(16, jn - jj) - 1;
    for (int h = 0; h < C; ++h) {
      __m512i r[16];
      for (int64_t k = 0; k < 16; ++k) r[k] = _mm512_loadu_si512(keys[jj + std::min(k, last)] + 32 * h);
      transpose16_epi32(r, kt + 16 * h);
    }
    const __mmask16 store = static_cast<__mmask16>((1u << (last + 1)) - 1);
    for (int64_t i = 0; i < n; ++i) {
      const int32_t* qd = reinterpret_cast<const int32_t*>(q[i]);
      __m512 s[16];
      for (int l = 0; l < 16; ++l) {
        __m512 a = _mm512_setzero_ps();
        for (int h = 0; h < C; ++h) {
          a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_set1_epi32(qd[16 * h + l]), (__m512bh)kt[16 * h + l]);
        }
        s[l] = a;
      }
      __m512 c[4];
      for (int m = 0; m < 4; ++m) {
        c[m] = _mm512_add_ps(_mm512_add_ps(s[4 * m], s[4 * m + 2]), _mm512_add_ps(s[4 * m + 1], s[4 * m + 3]));
      }
      const __m512 total = _mm512_add_ps(_mm512_add_ps(c[0], c[2]), _mm512_add_ps(c[1], c[3]));
      _mm512_mask_storeu_ps(scores + i * kKeyTile + jj, store, total);
    }
  }
}

// The transposed scoring for D = 32 C, C <= 8; false (nothing scored) for other D.
inline bool tile_scores_bf16_transposed(const c10::BFloat16* const* q, int64_t n, int64_t D,
                                        const c10::BFloat16* const* keys, int64_t jn, float* scores) {
  if (D % 32 != 0 || D > 256) return false;
  with_count<8>(D / 32, [&]<int C>() { tile_scores_bf16_transposed<C>(q, n, keys, jn, scores); });
  return true;
}

// bf16 values: acc_i += sum_jj p_i[jj] * value_jj with the bf16 dot-product instruction, two keys
// per instruction: each lane holds a dimension's pair (value_j[d], value_j+1[d]) and the pair
// (p[j], p[j + 1]) is broadcast, so the probabilities go as bf16 (what a bf16 model's attention
// multiplies the values by in PyTorch) and a row's products and sums are its own whatever rows it
// shares the tile with. A row's accumulator holds each 32-dimension chunk as the unpack leaves it
// (values_dim); values_unpermute restores the order once its keys are done.
constexpr int64_t kValueHeadsBf16 = 12;  // 24 accumulators of the 32 registers

// Chunk c (dimensions 32c .. 32c + 31) of rows i0 .. i0 + GN - 1; pairs: per row, kKeyTile / 2 dwords.
template <int GN>
inline void values_block_bf16(const int32_t* pairs, int64_t D, const c10::BFloat16* const* values, int64_t npairs,
                              float* acc, int64_t i0, int64_t c) {
  __m512 lo[GN], hi[GN];
  for (int g = 0; g < GN; ++g) {
    lo[g] = _mm512_loadu_ps(acc + (i0 + g) * D + 32 * c);
    hi[g] = _mm512_loadu_ps(acc + (i0 + g) * D + 32 * c + 16);
  }
  for (int64_t p = 0; p < npairs; ++p) {
    const __m512i a = _mm512_loadu_si512(values[2 * p] + 32 * c), b = _mm512_loadu_si512(values[2 * p + 1] + 32 * c);
    const __m512bh vlo = (__m512bh)_mm512_unpacklo_epi16(a, b), vhi = (__m512bh)_mm512_unpackhi_epi16(a, b);
    for (int g = 0; g < GN; ++g) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(pairs[(i0 + g) * (kKeyTile / 2) + p]);
      lo[g] = _mm512_dpbf16_ps(lo[g], vlo, w);
      hi[g] = _mm512_dpbf16_ps(hi[g], vhi, w);
    }
  }
  for (int g = 0; g < GN; ++g) {
    _mm512_storeu_ps(acc + (i0 + g) * D + 32 * c, lo[g]);
    _mm512_storeu_ps(acc + (i0 + g) * D + 32 * c + 16, hi[g]);
  }
}

// acc_i += sum_jj probs_i[jj] * value_jj for n rows (probs: kKeyTile floats per row, zero past a
// row's keys) and the tile's jn keys; D % 32 == 0. `values` has room for one more pointer.
inline void tile_values_bf16(const float* probs, int64_t n, int64_t D, const c10::BFloat16** values, int64_t jn,
                             float* acc, int32_t* pairs) {
  const int64_t npairs = (jn + 1) / 2;
  for (int64_t i = 0; i < n; ++i) {  // each row's probabilities as bf16 (round to nearest even)
    c10::BFloat16* pb = reinterpret_cast<c10::BFloat16*>(pairs + i * (kKeyTile / 2));
    for (int64_t jj = 0; jj < jn; jj += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(probs + i * kKeyTile + jj));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + jj), (__m256i)h);
    }
    if (jn % 2) pb[jn] = c10::BFloat16(0.f);
  }
  if (jn % 2) values[jn] = values[jn - 1];  // weighs zero
  const int64_t groups = (n + kValueHeadsBf16 - 1) / kValueHeadsBf16;
  const int64_t gs = (n + groups - 1) / groups;
  for (int64_t c = 0; c < D / 32; ++c) {
    for (int64_t i0 = 0; i0 < n; i0 += gs) {
      with_count<kValueHeadsBf16>(std::min(gs, n - i0), [&]<int GN>() {
        values_block_bf16<GN>(pairs, D, values, npairs, acc, i0, c);
      });
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Extend attention: the rows of a work item across the 16 lanes
// ---------------------------------------------------------------------------------------------
// Scores: a vector's queries as bf16 pairs ([D / 2][16] dwords, unscaled) against each key's pairs
// broadcast, then scaled. P @ V: two keys per instruction, each lane a dimension's pair of values
// (values_dim) and the rows' probabilities in bf16 pairs.
inline void lane_scores_bf16(const int32_t* qpairs, const int32_t* const* keys, int64_t half_d, float scale, V16* s) {
  __m512 a[16];
  for (int k = 0; k < 16; ++k) a[k] = _mm512_setzero_ps();
  for (int64_t i = 0; i < half_d; ++i) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(qpairs + i * 16);
    for (int k = 0; k < 16; ++k) a[k] = _mm512_dpbf16_ps(a[k], qv, (__m512bh)_mm512_set1_epi32(keys[k][i]));
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int k = 0; k < 16; ++k) s[k] = _mm512_mul_ps(a[k], sc);
}

// pairs[16 kp + r] = row r's probabilities of keys 2 kp and 2 kp + 1 as a bf16 pair (p: the 16 keys'
// probabilities, one vector per key, the rows in lanes).
inline void probability_pairs(const V16* p, int32_t* pairs) {
  alignas(64) static const int16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(order);
  for (int kp = 0; kp < 8; ++kp) {
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p[2 * kp + 1], p[2 * kp]);  // keys 2kp, 2kp + 1
    _mm512_storeu_si512(pairs + 16 * kp, _mm512_permutexvar_epi16(idx, both));
  }
}

// R rows' accumulators, chunks c0 .. c0 + NC - 1 (acc in values_dim order) = corr * acc + P @ V over
// the tile's npairs key pairs; vector (kp C + c) 2 + {0, 1} of vpairs: the unpacked values of pair kp,
// chunk c.
template <int R, int NC>
inline void pv_rows_bf16(float* acc, const int32_t* pairs, const float* corr, const int32_t* vpairs, int64_t D,
                         int64_t c0, int64_t npairs) {
  const int64_t C = D / 32;
  __m512 a[R][2 * NC];
  for (int r = 0; r < R; ++r) {
    const __m512 c = _mm512_set1_ps(corr[r]);
    for (int b = 0; b < 2 * NC; ++b) a[r][b] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 32 * c0 + 16 * b), c);
  }
  for (int64_t kp = 0; kp < npairs; ++kp) {
    const int32_t* v = vpairs + (kp * C + c0) * 32;
    for (int r = 0; r < R; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(pairs[16 * kp + r]);
      for (int b = 0; b < 2 * NC; ++b) {
        a[r][b] = _mm512_dpbf16_ps(a[r][b], (__m512bh)_mm512_loadu_si512(v + 16 * b), w);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < 2 * NC; ++b) _mm512_storeu_ps(acc + r * D + 32 * c0 + 16 * b, a[r][b]);
  }
}

// Four rows through pv_rows_bf16, two chunks (4 x 4 accumulators) at a time where D allows.
inline void pv_four_bf16(float* acc, const int32_t* pairs, const float* corr, const int32_t* vpairs, int64_t D,
                         int64_t npairs) {
  const int64_t C = D / 32;
  int64_t c = 0;
  for (; c + 2 <= C; c += 2) pv_rows_bf16<4, 2>(acc, pairs, corr, vpairs, D, c, npairs);
  if (c < C) pv_rows_bf16<4, 1>(acc, pairs, corr, vpairs, D, c, npairs);
}
#endif

}  // namespace
