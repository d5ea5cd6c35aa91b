// The attention kernels' bf16 arithmetic on CPUs with AVX512-BF16 (vdpbf16ps: 32 bf16 products per
// instruction, summed in pairs into float lanes), for bf16 queries and a bf16 cache. Decode
// attention (attention_ops.cpp) attends a tile of keys for all the query rows of a work item: the
// keys transposed, so a row's scores and softmax stay in the lanes of its 16-key blocks; extend
// attention puts the rows in the lanes. Both multiply the probabilities, rounded to bf16 as
// PyTorch's bf16 attention rounds them, into the values two keys per instruction. Every lane's
// arithmetic is its own row's, so a row's bits do not depend on the rows it is batched with.
#pragma once

#include <c10/util/BFloat16.h>

#include "attention_common.h"
#include "common.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

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

// P @ V, two keys per instruction: each lane holds a dimension's pair (value_j[d], value_j+1[d]) and
// the pair (p[j], p[j + 1]) is broadcast, so the probabilities go as bf16 (what a bf16 model's
// attention multiplies the values by in PyTorch). A row's accumulator holds each 32-dimension chunk
// as the unpack leaves it (values_dim); values_unpermute restores the order once its keys are done.
constexpr int64_t kValueHeadsBf16 = 12;  // 24 accumulators of the 32 registers

// Chunk c (dimensions 32c .. 32c + 31) of rows i0 .. i0 + GN - 1: acc = corr * acc + P @ V over the
// tile's npairs key pairs; pairs: per row, kKeyTile / 2 dwords.
template <int GN>
inline void values_block_bf16(const int32_t* pairs, const float* corr, int64_t D, const c10::BFloat16* const* values,
                              int64_t npairs, float* acc, int64_t i0, int64_t c) {
  __m512 lo[GN], hi[GN];
  for (int g = 0; g < GN; ++g) {
    const __m512 f = _mm512_set1_ps(corr[i0 + g]);
    lo[g] = _mm512_mul_ps(_mm512_loadu_ps(acc + (i0 + g) * D + 32 * c), f);
    hi[g] = _mm512_mul_ps(_mm512_loadu_ps(acc + (i0 + g) * D + 32 * c + 16), f);
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

// Where decode attention's n query rows stand after each tile: row i's running max m[i], its
// probability sums per lane (l[16 i .. 16 i + 15], added up once its keys are done), its output
// accumulator (acc[i D ..], in values_dim order), and scratch for one tile.
struct DecodeRowsBf16 {
  std::vector<float> m, l, acc, corr;
  std::vector<int32_t> pairs;  // per row, the tile's probabilities as kKeyTile / 2 bf16 pairs
  std::vector<__m512i> kt;     // the tile's keys transposed: (block b, chunk h) at 16 (b C + h)
  DecodeRowsBf16(int64_t n, int64_t D)
      : m(n), l(16 * n), acc(n * D), corr(n), pairs(n * kKeyTile / 2), kt(kKeyTile / 16 * D / 2) {}
};

// Scores of RB query rows (q: their D / 2 bf16 pairs) against the tile's first BB 16-key blocks of
// transposed keys (kt), each lane one key: row r's sum over its pairs p = 0 .. D / 2 - 1 in order, one
// chain per (row, block), the RB x BB chains in registers (a block's keys loaded once for all rows).
template <int RB, int BB>
inline void block_scores_bf16(const int32_t* const* q, const __m512i* kt, int64_t half_d, __m512* out) {
  __m512 a[RB][BB];
  for (int r = 0; r < RB; ++r) {
    for (int b = 0; b < BB; ++b) a[r][b] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < half_d; ++p) {
    __m512i k[BB];
    for (int b = 0; b < BB; ++b) k[b] = kt[b * half_d + p];
    for (int r = 0; r < RB; ++r) {
      const __m512bh qp = (__m512bh)_mm512_set1_epi32(q[r][p]);
      for (int b = 0; b < BB; ++b) a[r][b] = _mm512_dpbf16_ps(a[r][b], qp, (__m512bh)k[b]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int b = 0; b < BB; ++b) out[r * (kKeyTile / 16) + b] = a[r][b];
  }
}

// One tile of keys (jn <= kKeyTile) for n query rows q[i] (D bf16 each, D % 32 == 0, unscaled), row
// i attending the first rn[i] of them (none when rn[i] <= 0: its state is left as it is).
//
// The keys are transposed once per 16-key block (lane k of vector 16 h + l: bf16 pair l of chunk h
// of key k), so a row's scores of 16 keys are the lanes of one vector: the sum of the row's D / 2
// pair products in order, then scaled. The softmax stays in those lanes up to the tile's max;
// probabilities past a row's keys are zero. Every lane's arithmetic is its own row's and key's, so a
// row gets the same bits alone or among a verification's rows, at any position in a tile. `values`
// has room for one more pointer (an odd tile's last key is paired with itself, weighing zero).
inline void tile_attend_bf16(const c10::BFloat16* const* q, int64_t n, int64_t D, const c10::BFloat16* const* keys,
                             const c10::BFloat16** values, int64_t jn, const int64_t* rn, float scale, float softcap,
                             DecodeRowsBf16& st) {
  constexpr int64_t kRowsPerPass = 3, kBlocks = kKeyTile / 16;  // 3 x 4 chains: the 1-row decode of a 3:1 GQA model
  const int64_t C = D / 32, nb = (jn + 15) / 16;
  __m512i* kt = st.kt.data();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t last = std::min<int64_t>(16, jn - 16 * b) - 1;  // its lanes past the tile repeat the last key
    for (int64_t h = 0; h < C; ++h) {
      __m512i r[16];
      for (int64_t k = 0; k < 16; ++k) r[k] = _mm512_loadu_si512(keys[16 * b + std::min(k, last)] + 32 * h);
      transpose16_epi32(r, kt + 16 * (b * C + h));
    }
  }
  const __m512 sc = _mm512_set1_ps(scale), none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i0 = 0; i0 < n; i0 += kRowsPerPass) {
    const int64_t rows = std::min(kRowsPerPass, n - i0);
    const int32_t* qd[kRowsPerPass];
    for (int64_t r = 0; r < rows; ++r) qd[r] = reinterpret_cast<const int32_t*>(q[i0 + r]);
    __m512 x[kRowsPerPass * kBlocks];
    with_count<kRowsPerPass>(rows, [&]<int RB>() {
      with_count<kBlocks>(nb, [&]<int BB>() { block_scores_bf16<RB, BB>(qd, kt, 16 * C, x); });
    });
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      int32_t* pr = st.pairs.data() + i * (kKeyTile / 2);
      if (rn[i] <= 0) {
        st.corr[i] = 1.f;
        std::fill(pr, pr + 8 * nb, 0);
        continue;
      }
      const int64_t rb = (rn[i] + 15) / 16;  // the row's blocks
      __m512* xr = x + r * kBlocks;
      __m512 top = none;
      for (int64_t b = 0; b < rb; ++b) {
        __m512 s = _mm512_mul_ps(xr[b], sc);
        if (softcap > 0) s = softcap16(s, softcap);
        const int64_t live = rn[i] - 16 * b;
        if (live < 16) s = _mm512_mask_mov_ps(none, static_cast<__mmask16>((1u << live) - 1), s);
        xr[b] = s;
        top = _mm512_max_ps(top, s);
      }
      const float m_old = st.m[i], m_new = std::max(m_old, _mm512_reduce_max_ps(top));
      const float corr = m_new == m_old ? 1.f : std::exp(m_old - m_new);  // exp(-inf) = 0 on a row's first keys
      st.m[i] = m_new;
      st.corr[i] = corr;
      const __m512 shift = _mm512_set1_ps(m_new);
      __m512 l = _mm512_mul_ps(_mm512_loadu_ps(st.l.data() + 16 * i), _mm512_set1_ps(corr));
      for (int64_t b = 0; b < rb; ++b) {
        __m512 p = exp16(_mm512_sub_ps(xr[b], shift));
        const int64_t live = rn[i] - 16 * b;
        if (live < 16) p = _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << live) - 1), p);
        l = _mm512_add_ps(l, p);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + 8 * b), (__m256i)_mm512_cvtneps_pbh(p));
      }
      std::fill(pr + 8 * rb, pr + 8 * nb, 0);
      _mm512_storeu_ps(st.l.data() + 16 * i, l);
    }
  }
  if (jn % 2) values[jn] = values[jn - 1];
  const int64_t npairs = (jn + 1) / 2;
  const int64_t groups = (n + kValueHeadsBf16 - 1) / kValueHeadsBf16;
  const int64_t gs = (n + groups - 1) / groups;  // rows per group, as even as possible
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t i0 = 0; i0 < n; i0 += gs) {
      with_count<kValueHeadsBf16>(std::min(gs, n - i0), [&]<int GN>() {
        values_block_bf16<GN>(st.pairs.data(), st.corr.data(), D, values, npairs, st.acc.data(), i0, c);
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

// The values of npairs key pairs (rows[2 kp], rows[2 kp + 1]) unpacked for P @ V: vectors
// (kp C + c) 2 and (kp C + c) 2 + 1 of out hold chunk c's dimension pairs (values_dim order).
template <typename CT>
inline void unpack_value_pairs(const CT* const* rows, int64_t npairs, int64_t chunks, int32_t* out) {
  for (int64_t kp = 0; kp < npairs; ++kp) {
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512i a = _mm512_loadu_si512(rows[2 * kp] + 32 * c);
      const __m512i b = _mm512_loadu_si512(rows[2 * kp + 1] + 32 * c);
      int32_t* dst = out + (kp * chunks + c) * 32;
      _mm512_storeu_si512(dst, _mm512_unpacklo_epi16(a, b));
      _mm512_storeu_si512(dst + 16, _mm512_unpackhi_epi16(a, b));
    }
  }
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
