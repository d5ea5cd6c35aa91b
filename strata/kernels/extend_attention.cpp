// Extend (prefill) attention over the paged KV pool, flash-style, with a sliding window, per-head
// sinks and a logit softcap; scores and accumulators in float (the tests compare with the float32
// oracle, strata.layers.attention.reference_attention; bf16 on AVX512-BF16: attention_bf16.h).
//
// Request b feeds q_len[b] tokens starting at flattened token q_start[b]; after this step it has
// kv_len[b] keys, so its token i sits at position kv_len - q_len + i and sees keys 0 .. that (with
// a window W, the last W of them). A work item is (request, KV head, block of tokens); its rows, one
// per (token, query head of that KV head) in token-major order, lie across the 16 lanes of vectors,
// the queries transposed once per item ([D][16] floats per vector). Against a tile of 16 keys a
// vector's scores for key k are one vector: D FMAs of key k's elements, broadcast, into the query
// columns. So the online softmax (max, rescale, sum) is lane-wise, with no horizontal reduction,
// and a row computes the same arithmetic whichever rows share its vector: tiles start at multiples
// of 16 keys, and a tile that a row does not see leaves its state exactly as it was (scores masked
// to -inf, p = 0, a rescale by exp(0) = 1). P @ V then runs row by row, the value rows shared by the
// item's rows. Needs a SIMD build (AVX2 + FMA + F16C, or AVX-512).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "amx.h"
#include "attention_bf16.h"
#include "attention_common.h"
#include "common.h"
#include "simd.h"

#if defined(STRATA_AMX) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define STRATA_ATTENTION_AMX 1
#endif

#include <algorithm>
#include <atomic>
#include <cstring>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

#if defined(STRATA_SIMD16)
constexpr int64_t kItemRows = 64;  // rows (tokens x query heads) per work item, at least one token
constexpr int64_t kTileItemRows = 256, kMinItemsPerThread = 4;  // the same on the AMX tiles (see extend_attention)
// keys scored per pass over a vector's queries: all 16 in zmm registers (AVX-512's 32), 4 with AVX2
// (8 of its 16 ymm)
constexpr int kKeyGroup = kRegsPerV16 == 1 ? 16 : 4;
// a row's running max before it has seen a key: finite, so that a tile it does not see rescales it
// by exp(0) = 1 instead of exp(-inf + inf)
constexpr float kNoMax = -1e30f;

// s[k] = the scores of one vector's 16 rows (qt: their queries, scaled, [D][16]) against key k of
// the tile (kt: the 16 keys transposed, [D][16]), k < 16.
inline void tile_scores_t(const float* qt, const float* kt, int64_t D, V16* s) {
  for (int k0 = 0; k0 < 16; k0 += kKeyGroup) {
    V16 a[kKeyGroup];
    for (int k = 0; k < kKeyGroup; ++k) a[k] = vzero();
    for (int64_t d = 0; d < D; ++d) {
      const V16 qv = load16(qt + d * 16);
      const float* kd = kt + d * 16 + k0;
      for (int k = 0; k < kKeyGroup; ++k) a[k] = vfmadd(vset1(kd[k]), qv, a[k]);
    }
    for (int k = 0; k < kKeyGroup; ++k) s[k0 + k] = a[k];
  }
}

// R rows' accumulators (acc: R rows of D floats; columns d .. d + 16 NB) = corr * acc + P @ V over
// the tile's first jn keys; pt: P transposed ([16 keys][16 lanes], the rows at lanes 0 .. R - 1).
template <int R, int NB>
inline void pv_rows(float* acc, const float* pt, const float* corr, const float* vf, int64_t D, int64_t d,
                    int64_t jn) {
  V16 a[R][NB];
  for (int r = 0; r < R; ++r) {
    const V16 c = vset1(corr[r]);
    for (int b = 0; b < NB; ++b) a[r][b] = vmul(load16(acc + r * D + d + 16 * b), c);
  }
  for (int64_t k = 0; k < jn; ++k) {
    V16 v[NB];
    for (int b = 0; b < NB; ++b) v[b] = load16(vf + k * D + d + 16 * b);
    for (int r = 0; r < R; ++r) {
      const V16 pk = vset1(pt[k * 16 + r]);
      for (int b = 0; b < NB; ++b) a[r][b] = vfmadd(pk, v[b], a[r][b]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < NB; ++b) store16(acc + r * D + d + 16 * b, a[r][b]);
  }
}

// Four rows (acc: their accumulators) through pv_rows, in d-blocks that fit the registers: 4 x 4
// accumulators with AVX-512, 4 x 1 with AVX2.
inline void pv_four(float* acc, const float* pt, const float* corr, const float* vf, int64_t D, int64_t jn) {
  if (kRegsPerV16 == 1 && D % 64 == 0) {
    for (int64_t d = 0; d < D; d += 64) pv_rows<4, 4>(acc, pt, corr, vf, D, d, jn);
  } else {
    for (int64_t d = 0; d < D; d += 16) pv_rows<4, 1>(acc, pt, corr, vf, D, d, jn);
  }
}

// What one thread keeps for the item it works on (sized for the largest item).
struct ItemBuffers {
  std::vector<float> qt, acc, m, l, pos, first, kt, vf, pt, corr;
  // the bf16 paths': queries as pairs, probability pairs, unpacked value pairs, a zero key or value;
  // the tiles' (a span of key tiles, sized by reserve_span): the keys gathered, their scores, the
  // probabilities row by row, each tile's rescales and whether any row's max moved
  std::vector<int32_t> qpairs, ppairs, vpairs, zeros, keys, prows;
  std::vector<float> scores, tile_corr;
  std::vector<char> moved;
  ItemBuffers(int64_t lanes, int64_t D)
      : qt(lanes * D), acc(lanes * D), m(lanes), l(lanes), pos(lanes), first(lanes), kt(D * 16), vf(16 * D),
        pt(256), corr(16), qpairs(lanes * D / 2), ppairs(256), vpairs(16 * D), zeros(D / 2), scores(1024) {}
};

// An item's rows r = (token r / G, query head r % G of KV head kvh), 16 to a vector, the lanes past
// the last row repeating it (never written out): positions, window starts, softmax state (a sink
// joins the softmax as a score with no value) and zero accumulators.
inline void start_rows(int64_t rows, int64_t nvec, int64_t G, int64_t kvh, int64_t pos0, int64_t D, int64_t window,
                       const float* sinks, ItemBuffers& w) {
  for (int64_t r = 0; r < nvec * 16; ++r) {
    const int64_t row = std::min(r, rows - 1), i = row / G, g = row % G;
    w.pos[r] = static_cast<float>(pos0 + i);
    w.first[r] = static_cast<float>(window_start(pos0 + i, window));
    w.m[r] = sinks ? sinks[kvh * G + g] : kNoMax;
    w.l[r] = sinks ? 1.f : 0.f;
  }
  std::fill(w.acc.begin(), w.acc.begin() + nvec * 16 * D, 0.f);
}

// The item's queries as bf16 pairs for the bf16 paths (extend_item's and the tiles'): per vector of
// 16 rows, [D / 2][16] dwords, a row's pairs down its column (Q^T in pairs).
template <typename QT>
inline void query_pairs(const QT* qp, int64_t q_stride, int64_t tok0, int64_t G, int64_t kvh, int64_t D,
                        int64_t rows, int64_t nvec, int32_t* out) {
  const int64_t half_d = D / 2;
  for (int64_t r = 0; r < nvec * 16; ++r) {
    const int64_t row = std::min(r, rows - 1);
    const int32_t* pairs = reinterpret_cast<const int32_t*>(qp + (tok0 + row / G) * q_stride + (kvh * G + row % G) * D);
    int32_t* column = out + (r / 16) * half_d * 16 + r % 16;
    for (int64_t d = 0; d < half_d; ++d) column[d * 16] = pairs[d];
  }
}

// The online softmax over NK keys j0 .. j0 + NK - 1 for one vector of rows (s: their scores, one
// vector per key, the rows in lanes; keys a row does not see are masked out unless `whole`): the
// running max m and sum l move on, corr gets each row's rescale of its accumulator and s the
// probabilities. A row that sees none of the keys keeps its state (p = 0, rescaled by exp(0) = 1).
// seen[k]: the rows (lanes) that see key j0 + k (from their window start `first` to their position
// `pos`); s[k] (its scores) -inf in the other lanes.
template <int NK>
inline void mask_unseen(V16* s, const float* pos, const float* first, int64_t j0, Mask16* seen) {
  const V16 minus_inf = vset1(-std::numeric_limits<float>::infinity());
  const V16 pos_v = load16(pos), first_v = load16(first);
  for (int k = 0; k < NK; ++k) {
    const V16 j = vset1(static_cast<float>(j0 + k));
    seen[k] = mask_and(vle(first_v, j), vle(j, pos_v));
    s[k] = vselect(seen[k], s[k], minus_inf);
  }
}

template <int NK>
inline void online_softmax(V16* s, const float* pos, const float* first, int64_t j0, bool whole, float* m, float* l,
                           float* corr) {
  Mask16 seen[NK];
  if (!whole) mask_unseen<NK>(s, pos, first, j0, seen);
  V16 top = s[0];
  for (int k = 1; k < NK; ++k) top = vmax(top, s[k]);
  const V16 m_old = load16(m), m_new = vmax(m_old, top);
  const V16 c = exp16(vsub(m_old, m_new));
  V16 sum = vzero();
  for (int k = 0; k < NK; ++k) {
    V16 p = exp16(vsub(s[k], m_new));
    if (!whole) p = vselect(seen[k], p, vzero());
    s[k] = p;
    sum = vadd(sum, p);
  }
  store16(m, m_new);
  store16(l, vadd(vmul(load16(l), c), sum));
  store16(corr, c);
}

// Writes an item's rows of out: each accumulator over its softmax sum (`paired`: the accumulators
// hold the bf16 P @ V's order, values_dim).
template <typename QT>
inline void finish_rows(QT* op, int64_t rows, int64_t G, int64_t Hkv, int64_t kvh, int64_t D, int64_t tok0,
                        bool paired, ItemBuffers& w) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / G, g = r % G;
    QT* dst = op + ((tok0 + i) * Hkv * G + kvh * G + g) * D;
    float* acc = w.acc.data() + r * D;
    const float inv = 1.f / w.l[r];
#if defined(__AVX512BF16__)
    if (paired) values_unpermute(acc, D);
#endif
    for (int64_t d = 0; d < D; ++d) dst[d] = round_to<QT>(acc[d] * inv);
  }
}

// One work item: tokens tok0 .. tok0 + ntok - 1 of a request, at positions pos0 .., with the G query
// heads of KV head kvh; writes their rows of out.
template <typename QT, typename CT>
void extend_item(const QT* qp, int64_t q_stride, QT* op, const CT* kc, const CT* vc, const int64_t* pages,
                 int64_t page_size, int64_t Hkv, int64_t kvh, int64_t G, int64_t D, int64_t tok0, int64_t ntok,
                 int64_t pos0, float scale, int64_t window, float softcap, const float* sinks, ItemBuffers& w) {
  const int64_t rows = ntok * G, nvec = (rows + 15) / 16;
  float *qt = w.qt.data(), *acc = w.acc.data(), *m = w.m.data(), *l = w.l.data();
  float *kt = w.kt.data(), *vf = w.vf.data(), *pt = w.pt.data(), *corr = w.corr.data();
  bool bf16 = false;  // the bf16 dot-product path (attention_bf16.h)
#if defined(__AVX512BF16__)
  bf16 = std::is_same_v<QT, c10::BFloat16> && std::is_same_v<CT, c10::BFloat16> && D % 32 == 0;
  const int64_t half_d = D / 2, chunks = D / 32;
  const int32_t* key_pairs[16];  // the tile's keys as bf16 pairs (a zero row where masked)
  const CT* value_rows[16];
#endif
  start_rows(rows, nvec, G, kvh, pos0, D, window, sinks, w);
#if defined(__AVX512BF16__)
  if (bf16) query_pairs(qp, q_stride, tok0, G, kvh, D, rows, nvec, w.qpairs.data());
#endif
  for (int64_t r = 0; r < nvec * 16 && !bf16; ++r) {  // the float path: scaled queries transposed
    const int64_t row = std::min(r, rows - 1);
    const QT* src = qp + (tok0 + row / G) * q_stride + (kvh * G + row % G) * D;
    float* column = qt + (r / 16) * D * 16 + r % 16;
    for (int64_t d = 0; d < D; ++d) column[d * 16] = to_f(src[d]) * scale;
  }
  // keys [first_key, n_keys): from the first token's window start to the last token's position
  const int64_t first_key = window_start(pos0, window), n_keys = pos0 + ntok;
  for (int64_t j0 = first_key / 16 * 16; j0 < n_keys; j0 += 16) {
    const int64_t jn = std::min<int64_t>(16, n_keys - j0);
    // the tile in float, keys transposed; keys before first_key (behind every row's window: their
    // pages may be freed) and past the last are zeros, masked out below
    for (int64_t k = 0; k < 16; ++k) {
      float* vd = vf + k * D;
      const int64_t j = j0 + k;
      const bool outside = j < first_key || k >= jn;
#if defined(__AVX512BF16__)
      if (bf16) {
        const int64_t slot = outside ? 0 : pages[j / page_size] * page_size + j % page_size;
        key_pairs[k] = outside ? w.zeros.data() : reinterpret_cast<const int32_t*>(kc + (slot * Hkv + kvh) * D);
        value_rows[k] = outside ? reinterpret_cast<const CT*>(w.zeros.data()) : vc + (slot * Hkv + kvh) * D;
        continue;
      }
#endif
      if (outside) {
        for (int64_t d = 0; d < D; ++d) kt[d * 16 + k] = 0.f;
        std::fill(vd, vd + D, 0.f);
        continue;
      }
      const int64_t slot = pages[j / page_size] * page_size + j % page_size;
      const CT* krow = kc + (slot * Hkv + kvh) * D;
      const CT* vrow = vc + (slot * Hkv + kvh) * D;
      for (int64_t d = 0; d < D; ++d) kt[d * 16 + k] = to_f(krow[d]);
      if constexpr (kHasLoad16<CT>) {  // D % 16 == 0
        for (int64_t d = 0; d < D; d += 16) store16(vd + d, load16(vrow + d));
      } else {
        load_row(vrow, vd, D);
      }
    }
#if defined(__AVX512BF16__)
    const int64_t npairs = (jn + 1) / 2;  // key pairs P @ V reads (a pair past jn weighs zero)
    if (bf16) unpack_value_pairs(value_rows, npairs, chunks, w.vpairs.data());
#endif
    for (int64_t v = 0; v < nvec; ++v) {
      // lanes are in token order: lane 0 holds the vector's least position and window start
      const float* pos = w.pos.data() + v * 16;
      const float* first = w.first.data() + v * 16;
      if (j0 > pos[15] || j0 + jn - 1 < first[0]) continue;  // no row of the vector sees the tile
      const bool whole = jn == 16 && j0 + 15 <= pos[0] && j0 >= first[15];  // every row sees every key
      V16 s[16];
#if defined(__AVX512BF16__)
      if (bf16) lane_scores_bf16(w.qpairs.data() + v * half_d * 16, key_pairs, half_d, scale, s);
#endif
      if (!bf16) tile_scores_t(qt + v * D * 16, kt, D, s);
      if (softcap > 0) {
        for (int k = 0; k < 16; ++k) s[k] = softcap16(s[k], softcap);
      }
      online_softmax<16>(s, pos, first, j0, whole, m + v * 16, l + v * 16, corr);
#if defined(__AVX512BF16__)
      if (bf16) {
        probability_pairs(s, w.ppairs.data());
        for (int64_t r0 = 0; r0 < 16 && v * 16 + r0 < rows; r0 += 4) {
          pv_four_bf16(acc + (v * 16 + r0) * D, w.ppairs.data() + r0, corr + r0, w.vpairs.data(), D, npairs);
        }
        continue;
      }
#endif
      for (int k = 0; k < 16; ++k) store16(pt + k * 16, s[k]);
      for (int64_t r0 = 0; r0 < 16 && v * 16 + r0 < rows; r0 += 4) {
        pv_four(acc + (v * 16 + r0) * D, pt + r0, corr + r0, vf, D, jn);
      }
    }
  }
  finish_rows(op, rows, G, Hkv, kvh, D, tok0, bf16, w);
}

#if defined(STRATA_ATTENTION_AMX)
// ---------------------------------------------------------------------------------------------
// AMX bf16 tiles (tdpbf16ps), for bf16 queries and cache with D % 32 == 0, where the OS grants them.
// Keys go kTileKeys at a time (tiles start at multiples of 32 positions), gathered kSpanTiles tiles
// at a time; within a span each vector of 16 rows runs through the span's key tiles with its output
// held in tile registers (up to 64 dims at a time, tmm0-3) from the span's first tile to its last:
//   scores  S^T [32 keys][16 rows] = K [keys][32 dims] x Q^T [16 dim pairs][16 rows], per 32-dim
//           chunk, two tiles of 16 keys (tmm4-7); stored, they are the lane-wise layout above (one
//           vector per key, the rows in lanes), scaled, capped and masked as on the other paths;
//   P @ V   O [16 rows][16 dims] += P [16 rows][32 keys] x V [16 key pairs][16 dims].
// The softmax runs in log2 units (scores times log2(e), probabilities 2^(s - m)) and rescales
// lazily: a row's reference max moves only when a tile's scores pass it by more than kRescaleSlack
// (its probabilities stay below 2^slack meanwhile, exact enough in float and bf16), so most tiles
// leave the output in its registers; where one row moves, the vector's output
// goes to memory, those rows are rescaled there, and it comes back. Heads wider than 64 dims run the
// span once per 64 dims, the first pass keeping each tile's probabilities and rescales for the rest.
// A tile product sums its products in its own order (not the dot-product instruction's: measured,
// a third of the sums differ in the last bits), so this is its own arithmetic; each output of a tile
// product depends only on its own row and column, the key tiles start at fixed positions, and a row's
// reference max moves on its own scores alone, so a row's bits still do not depend on the rows beside
// it or on how its prompt is chunked. The choice is the process's (set_attention_tiles), never the
// call's.
constexpr int64_t kTileKeys = 32;
constexpr int64_t kSpanTiles = 16;  // key tiles gathered at a time (512 keys)
constexpr int64_t kGroupTiles = 4;  // output tiles held in registers (64 dims)
constexpr float kRescaleSlack = 12.f;  // in log2 units (e^8.3)
constexpr float kLog2e = 1.44269504f;
// tmm0-3: the output; scores: tmm4-5 (two tiles of 16 keys), keys tmm6, queries tmm7; P @ V: P tmm4,
// values tmm5 and tmm6 in turn
constexpr int kTileS0 = 4, kTileS1 = 5, kTileK = 6, kTileQ = 7, kTileP = 4, kTileV0 = 5, kTileV1 = 6;

inline bool attention_tiles_available() { return tiles_permitted(); }

inline void configure_attention_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.set(t, 16, 64);
  cfg.load();
}

// Tile loads and stores (amx.h's form), here clobbering memory: what a load reads was written by
// vector code just before, and what a store writes is read right after.
template <int T>
inline void tile_load(const void* p, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void tile_store(void* p, int64_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
}
template <int C, int A, int B>  // C += A x B (AT&T order: B, A, C)
inline void tile_bf16_product() {
  asm volatile("tdpbf16ps %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C));
}

// The output tiles 0 .. NO - 1 loaded from (kStore false) or stored to 16 rows of acc (row stride
// D floats), 16 floats apart.
template <bool kStore, int T>
inline void move_output_tile(float* acc, int64_t D) {
  if constexpr (kStore) {
    tile_store<T>(acc + 16 * T, D * 4);
  } else {
    tile_load<T>(acc + 16 * T, D * 4);
  }
}
template <bool kStore, int NO>
inline void move_output(float* acc, int64_t D) {
  move_output_tile<kStore, 0>(acc, D);
  move_output_tile<kStore, 1>(acc, D);
  if constexpr (NO > 2) {
    move_output_tile<kStore, 2>(acc, D);
    move_output_tile<kStore, 3>(acc, D);
  }
}
template <int NO>
inline void load_output(float* acc, int64_t D) { move_output<false, NO>(acc, D); }
template <int NO>
inline void store_output(float* acc, int64_t D) { move_output<true, NO>(acc, D); }

// Output tiles 0 .. NO - 1 += P (16 rows x 32 keys as bf16 pairs, row by row) x the tile's values
// (vp: the 16 key pairs' unpacked values from the group's first dims, rows stride apart).
template <int NO>
inline void pv_tiles(const int32_t* prows, const int32_t* vp, int64_t stride) {
  tile_load<kTileP>(prows, 64);
  tile_load<kTileV0>(vp, stride);
  tile_bf16_product<0, kTileP, kTileV0>();
  tile_load<kTileV1>(vp + 16, stride);
  tile_bf16_product<1, kTileP, kTileV1>();
  if constexpr (NO > 2) {
    tile_load<kTileV0>(vp + 32, stride);
    tile_bf16_product<2, kTileP, kTileV0>();
    tile_load<kTileV1>(vp + 48, stride);
    tile_bf16_product<3, kTileP, kTileV1>();
  }
}

// scores [32 keys][16 rows] of one vector (qv: its queries as pairs, [D / 2][16]) against a key tile
// (keys: 32 rows of D bf16).
inline void tile_scores(const int32_t* qv, const char* keys, int64_t chunks, int64_t row_bytes, float* scores) {
  tile_zero<kTileS0>();
  tile_zero<kTileS1>();
  for (int64_t c = 0; c < chunks; ++c) {
    tile_load<kTileQ>(qv + c * 256, 64);
    tile_load<kTileK>(keys + 64 * c, row_bytes);
    tile_bf16_product<kTileS0, kTileK, kTileQ>();
    tile_load<kTileK>(keys + 16 * row_bytes + 64 * c, row_bytes);
    tile_bf16_product<kTileS1, kTileK, kTileQ>();
  }
  tile_store<kTileS0>(scores, 64);
  tile_store<kTileS1>(scores + 256, 64);
}

// 2^x for 16 floats: 2^n p(r) with x = n + r, |r| <= 1/2, p the degree-5 Taylor polynomial of
// e^(r ln 2) (relative error below 3e-6, well inside the bf16 rounding of the probabilities). -inf
// gives NaN (the callers mask those lanes out) and very negative x 0.
inline __m512 exp2_16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.24022651f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.69314718f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The softmax of one vector's rows over a key tile (s: one vector per key, the rows in lanes; keys a
// row does not see are masked out unless `whole`), rescaling lazily: a row's reference max m moves
// only to a tile max above m + kRescaleSlack. corr gets each row's rescale (1 where m stayed), l the
// sum, s the probabilities; returns whether any row's m moved.
inline bool lazy_softmax(__m512* s, const float* pos, const float* first, int64_t j0, bool whole, float* m,
                         float* l, float* corr) {
  constexpr int NK = kTileKeys;
  __mmask16 seen[NK];
  if (!whole) mask_unseen<NK>(s, pos, first, j0, seen);
  __m512 top[8];
  for (int k = 0; k < 8; ++k) top[k] = s[k];
  for (int k = 8; k < NK; ++k) top[k % 8] = _mm512_max_ps(top[k % 8], s[k]);
  for (int w = 4; w >= 1; w /= 2) {
    for (int k = 0; k < w; ++k) top[k] = _mm512_max_ps(top[k], top[k + w]);
  }
  const __m512 m_old = _mm512_loadu_ps(m);
  const __mmask16 grow = _mm512_cmp_ps_mask(_mm512_add_ps(m_old, _mm512_set1_ps(kRescaleSlack)), top[0], _CMP_LT_OQ);
  const __m512 m_ref = _mm512_mask_mov_ps(m_old, grow, top[0]);
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 c = grow ? _mm512_mask_mov_ps(one, grow, exp2_16(_mm512_sub_ps(m_old, m_ref))) : one;
  __m512 sum = _mm512_setzero_ps();
  for (int k = 0; k < NK; ++k) {
    __m512 p = exp2_16(_mm512_sub_ps(s[k], m_ref));
    if (!whole) p = _mm512_maskz_mov_ps(seen[k], p);
    s[k] = p;
    sum = _mm512_add_ps(sum, p);
  }
  _mm512_storeu_ps(m, m_ref);
  _mm512_storeu_ps(l, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(l), c), sum));
  _mm512_storeu_ps(corr, c);
  return grow != 0;
}

inline void reserve_span(int64_t D, ItemBuffers& w) {
  if (w.moved.size() == kSpanTiles) return;
  w.keys.resize(kSpanTiles * 16 * D);
  w.vpairs.resize(kSpanTiles * 16 * D);
  w.prows.resize(kSpanTiles * 256);
  w.tile_corr.resize(kSpanTiles * 16);
  w.moved.resize(kSpanTiles);
}

// The tiles of one span an item's vectors read: keys row by row (zeros outside [first_key, n_keys):
// those pages may be freed) and their values unpacked in pairs, tile t's at keys + t 32 D bf16 and
// vpairs + t 16 D.
inline void gather_span(const c10::BFloat16* kc, const c10::BFloat16* vc, const int64_t* pages, int64_t page_size,
                        int64_t Hkv, int64_t kvh, int64_t D, int64_t s0, int64_t ntiles, int64_t first_key,
                        int64_t n_keys, ItemBuffers& w) {
  const c10::BFloat16* value_rows[kTileKeys];
  const int64_t row_bytes = D * 2, chunks = D / 32;
  for (int64_t t = 0; t < ntiles; ++t) {
    char* keys = reinterpret_cast<char*>(w.keys.data()) + t * kTileKeys * row_bytes;
    for (int64_t k = 0; k < kTileKeys; ++k) {
      const int64_t j = s0 + t * kTileKeys + k;
      __m512i* dst = reinterpret_cast<__m512i*>(keys + k * row_bytes);
      if (j < first_key || j >= n_keys) {
        for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_si512(dst + c, _mm512_setzero_si512());
        value_rows[k] = reinterpret_cast<const c10::BFloat16*>(w.zeros.data());
        continue;
      }
      const int64_t slot = (pages[j / page_size] * page_size + j % page_size) * Hkv + kvh;
      const __m512i* src = reinterpret_cast<const __m512i*>(kc + slot * D);
      for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_si512(dst + c, _mm512_loadu_si512(src + c));
      value_rows[k] = vc + slot * D;
    }
    unpack_value_pairs(value_rows, kTileKeys / 2, chunks, w.vpairs.data() + t * 16 * D);
  }
}

// The output's rows (the group's dims of 16 rows) rescaled where a tile moved their max: out of the
// tile registers, rescaled in memory, back.
template <int NO>
inline void rescale_output(float* acc, const float* corr, int64_t D) {
  store_output<NO>(acc, D);
  for (int r = 0; r < 16; ++r) {
    if (corr[r] == 1.f) continue;
    const __m512 c = _mm512_set1_ps(corr[r]);
    for (int64_t d = 0; d < NO * 16; d += 16) {
      _mm512_storeu_ps(acc + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), c));
    }
  }
  load_output<NO>(acc, D);
}

// Vector v's probabilities for key tile t of the span at s0 (scores: its stored scores): the
// softmax moves on, the tile's P (row by row), rescales and whether a row's max moved are kept.
inline void tile_probabilities(int64_t v, int64_t t, int64_t s0, int64_t n_keys, const float* scores, float scale,
                               float softcap, ItemBuffers& w) {
  const float* pos = w.pos.data() + v * 16;
  const float* first = w.first.data() + v * 16;
  const int64_t j0 = s0 + t * kTileKeys, jn = std::min(kTileKeys, n_keys - j0);
  const bool whole = jn == kTileKeys && j0 + kTileKeys - 1 <= pos[0] && j0 >= first[15];
  __m512 s[kTileKeys];
  if (softcap > 0) {
    const __m512 sc = _mm512_set1_ps(scale), log2e = _mm512_set1_ps(kLog2e);
    for (int k = 0; k < kTileKeys; ++k) {
      s[k] = _mm512_mul_ps(softcap16(_mm512_mul_ps(_mm512_loadu_ps(scores + 16 * k), sc), softcap), log2e);
    }
  } else {
    const __m512 sc = _mm512_set1_ps(scale * kLog2e);
    for (int k = 0; k < kTileKeys; ++k) s[k] = _mm512_mul_ps(_mm512_loadu_ps(scores + 16 * k), sc);
  }
  w.moved[t] = lazy_softmax(s, pos, first, j0, whole, w.m.data() + v * 16, w.l.data() + v * 16,
                            w.tile_corr.data() + t * 16);
  // P row by row: the 16 key pairs' probability pairs per row, transposed from per key pair
  probability_pairs(s, w.ppairs.data());
  probability_pairs(s + 16, w.ppairs.data() + 128);
  __m512i pairs_by_key[16], pairs_by_row[16];
  for (int kp = 0; kp < 16; ++kp) pairs_by_key[kp] = _mm512_loadu_si512(w.ppairs.data() + 16 * kp);
  transpose16_epi32(pairs_by_key, pairs_by_row);
  int32_t* prows = w.prows.data() + t * 256;
  for (int r = 0; r < 16; ++r) _mm512_storeu_si512(prows + 16 * r, pairs_by_row[r]);
}

// One vector's pass over key tiles t_a .. t_b - 1 of the span at s0 for output tiles 4 g .. 4 g + NO - 1
// (dims 64 g ..). The first pass (g = 0) scores the keys and keeps each tile's probabilities and
// rescales in the span's buffers, the others replay them. The first pass runs as a pipeline, the
// scores of tile t + 1 and the P @ V of tile t - 1 around tile t's softmax, so that no tile load
// waits on vector stores just made or vector loads on a tile store just made; the output sees the
// same operations in the same order (rescale for t, P @ V of t) either way.
template <int NO>
void vector_span(int64_t g, int64_t v, int64_t t_a, int64_t t_b, int64_t s0, int64_t n_keys, int64_t D,
                 float scale, float softcap, ItemBuffers& w) {
  const int64_t chunks = D / 32, row_bytes = D * 2;
  float* acc = w.acc.data() + v * 16 * D + 64 * g;
  const int32_t* vpairs = w.vpairs.data() + 64 * g;
  const auto pv = [&](int64_t t) { pv_tiles<NO>(w.prows.data() + t * 256, vpairs + t * 16 * D, chunks * 128); };
  load_output<NO>(acc, D);
  if (g > 0) {
    for (int64_t t = t_a; t < t_b; ++t) {
      if (w.moved[t]) rescale_output<NO>(acc, w.tile_corr.data() + t * 16, D);
      pv(t);
    }
  } else {
    const int32_t* qv = w.qpairs.data() + v * (D / 2) * 16;
    const char* keys = reinterpret_cast<const char*>(w.keys.data());
    float* scores = w.scores.data();  // two tiles' scores, [t % 2][32][16]
    const auto score = [&](int64_t t) {
      tile_scores(qv, keys + t * kTileKeys * row_bytes, chunks, row_bytes, scores + (t % 2) * 512);
    };
    score(t_a);
    for (int64_t t = t_a; t <= t_b; ++t) {
      if (t + 1 < t_b) score(t + 1);
      if (t < t_b) tile_probabilities(v, t, s0, n_keys, scores + (t % 2) * 512, scale, softcap, w);
      if (t > t_a) pv(t - 1);
      if (t < t_b && w.moved[t]) rescale_output<NO>(acc, w.tile_corr.data() + t * 16, D);
    }
  }
  store_output<NO>(acc, D);
}

// One work item (as extend_item) on the tiles.
void extend_item_tiles(const c10::BFloat16* qp, int64_t q_stride, c10::BFloat16* op, const c10::BFloat16* kc,
                       const c10::BFloat16* vc, const int64_t* pages, int64_t page_size, int64_t Hkv, int64_t kvh,
                       int64_t G, int64_t D, int64_t tok0, int64_t ntok, int64_t pos0, float scale, int64_t window,
                       float softcap, const float* sinks, ItemBuffers& w) {
  const int64_t rows = ntok * G, nvec = (rows + 15) / 16, out_tiles = D / 16;
  start_rows(rows, nvec, G, kvh, pos0, D, window, sinks, w);
  if (sinks) {  // the softmax runs in log2 units here
    for (int64_t r = 0; r < nvec * 16; ++r) w.m[r] *= kLog2e;
  }
  query_pairs(qp, q_stride, tok0, G, kvh, D, rows, nvec, w.qpairs.data());
  reserve_span(D, w);
  const int64_t first_key = window_start(pos0, window), n_keys = pos0 + ntok;
  constexpr int64_t span_keys = kSpanTiles * kTileKeys;
  for (int64_t s0 = first_key / kTileKeys * kTileKeys; s0 < n_keys; s0 += span_keys) {
    const int64_t ntiles = std::min(kSpanTiles, (n_keys - s0 + kTileKeys - 1) / kTileKeys);
    gather_span(kc, vc, pages, page_size, Hkv, kvh, D, s0, ntiles, first_key, n_keys, w);
    for (int64_t v = 0; v < nvec; ++v) {
      // the span's tiles holding keys the vector's rows see: from the one with its first row's first
      // key to the one with its last row's last
      const int64_t lo = static_cast<int64_t>(w.first[v * 16]), hi = static_cast<int64_t>(w.pos[v * 16 + 15]);
      const int64_t t_a = std::max<int64_t>(0, (lo - s0) / kTileKeys);
      const int64_t t_b = hi < s0 ? 0 : std::min(ntiles, (hi - s0) / kTileKeys + 1);
      for (int64_t g = 0; g * kGroupTiles < out_tiles && t_a < t_b; ++g) {
        if (out_tiles - g * kGroupTiles >= kGroupTiles) {
          vector_span<4>(g, v, t_a, t_b, s0, n_keys, D, scale, softcap, w);
        } else {
          vector_span<2>(g, v, t_a, t_b, s0, n_keys, D, scale, softcap, w);
        }
      }
    }
  }
  finish_rows(op, rows, G, Hkv, kvh, D, tok0, true, w);
}
#endif
#endif

#if defined(STRATA_SIMD16)
// One work item on the tiles (bf16 only) or on extend_item.
template <typename QT, typename CT>
inline void run_item(bool tiles, const QT* qp, int64_t q_stride, QT* op, const CT* kc, const CT* vc,
                     const int64_t* pages, int64_t page_size, int64_t Hkv, int64_t kvh, int64_t G, int64_t D,
                     int64_t tok0, int64_t ntok, int64_t pos0, float scale, int64_t window, float softcap,
                     const float* sinks, ItemBuffers& w) {
#if defined(STRATA_ATTENTION_AMX)
  if constexpr (std::is_same_v<QT, c10::BFloat16> && std::is_same_v<CT, c10::BFloat16>) {
    if (tiles) {
      extend_item_tiles(qp, q_stride, op, kc, vc, pages, page_size, Hkv, kvh, G, D, tok0, ntok, pos0, scale, window,
                        softcap, sinks, w);
      return;
    }
  }
#endif
  (void)tiles;
  extend_item<QT, CT>(qp, q_stride, op, kc, vc, pages, page_size, Hkv, kvh, G, D, tok0, ntok, pos0, scale, window,
                      softcap, sinks, w);
}
#endif

// Whether bf16 extends take the AMX tiles: built with them, granted by the OS, and switched on (the
// default; set_attention_tiles). Either path keeps a row's bits independent of its batch and chunk,
// but the two round differently, so the switch is the process's, set before its first prefill.
#if !defined(STRATA_ATTENTION_AMX)
inline bool attention_tiles_available() { return false; }
#endif
std::atomic<bool> g_attention_tiles_wanted{true};
inline bool attention_tiles_on() {
  return g_attention_tiles_wanted.load(std::memory_order_relaxed) && attention_tiles_available();
}

// out[q_start[b] + i] = attention of request b's token i (see above); window, softcap and sinks as
// in check_layer_options. Needs a SIMD build (AVX2 or AVX-512: has_simd()) and head_dim % 16 == 0
// (at most 512); callers use SDPA otherwise.
void extend_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor page_table,
                      at::Tensor q_start, at::Tensor q_len, at::Tensor kv_len, int64_t page_size, double scale,
                      int64_t window, double softcap, c10::optional<at::Tensor> sinks) {
  const int64_t num_pages = check_attention_io(out, q, k_cache, v_cache, page_table, page_size);
  const float* sink_logits = check_layer_options(q.size(1), softcap, sinks);
  const int64_t T = q.size(0), D = q.size(2), B = page_table.size(0), pages_per_row = page_table.size(1);
  const int64_t* qs = index_data(q_start, 1, "q_start", "[requests]");
  const int64_t* ql = index_data(q_len, 1, "q_len", "[requests]");
  const int64_t* kl = index_data(kv_len, 1, "kv_len", "[requests]");
  TORCH_CHECK(q_start.numel() == B && q_len.numel() == B && kv_len.numel() == B, "q_start (", q_start.numel(),
              "), q_len (", q_len.numel(), ") and kv_len (", kv_len.numel(), ") need one entry per page-table row (",
              B, ")");
  TORCH_CHECK(D % 16 == 0 && D <= 512, "extend_attention needs head_dim % 16 == 0 and at most 512, got ", D);
  // Request b's tokens [q_start, q_start + q_len) lie in [0, T), in order and disjoint: they read
  // q and write out rows there, and keys window_start(kv_len - q_len) .. kv_len - 1 from their pages.
  const int64_t capacity = key_capacity(pages_per_row, page_size);
  const int64_t* pt = page_table.data_ptr<int64_t>();
  int64_t tokens_end = 0;  // end of the previous request's tokens
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ql[b] >= 0 && ql[b] <= T, "q_len[", b, "] = ", ql[b], " is outside [0, ", T, "], the query tokens");
    TORCH_CHECK(qs[b] >= tokens_end && qs[b] <= T - ql[b], "q_start[", b, "] = ", qs[b], " is outside [", tokens_end,
                ", ", T - ql[b], "]: request ", b, "'s ", ql[b], " tokens must lie within the ", T,
                " query tokens, after the previous request's");
    TORCH_CHECK(kl[b] >= ql[b], "kv_len[", b, "] = ", kl[b], " is less than q_len[", b, "] = ", ql[b],
                ": the keys include the new tokens");
    TORCH_CHECK(kl[b] <= capacity, "kv_len[", b, "] = ", kl[b], " is past [0, ", capacity, "]: request ", b,
                " has more keys than pages (", pages_per_row, " pages of ", page_size, ")");
    check_pages_read(pt, pages_per_row, b, window_start(kl[b] - ql[b], window), kl[b], page_size, num_pages);
    tokens_end = qs[b] + ql[b];
  }
#if !defined(STRATA_SIMD16)
  TORCH_CHECK(false, "extend_attention needs AVX2 (with FMA and F16C) or AVX-512");
#else
  const int64_t Hkv = k_cache.size(1), G = q.size(1) / Hkv;
  const bool bf16_io = q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16;
  const bool tiles = bf16_io && D % 32 == 0 && attention_tiles_on();
  // Tokens per work item: kItemRows rows, or on the tiles (which gather each key tile once per item)
  // kTileItemRows where that still leaves every thread kMinItemsPerThread items.
  int64_t total_tokens = 0;
  for (int64_t b = 0; b < B; ++b) total_tokens += ql[b];
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t tile_block = std::max<int64_t>(1, kTileItemRows / G);
  const bool tile_items = tiles && total_tokens * Hkv >= kMinItemsPerThread * threads * tile_block;
  const int64_t block = tile_items ? tile_block : std::max<int64_t>(1, kItemRows / G);
  struct Item { int64_t b, kvh, tok0, ntok, pos0, cost; };
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i0 = 0; i0 < ql[b]; i0 += block) {
      const int64_t ntok = std::min(block, ql[b] - i0), pos0 = kl[b] - ql[b] + i0;
      for (int64_t h = 0; h < Hkv; ++h) {
        items.push_back({b, h, qs[b] + i0, ntok, pos0, ntok * (pos0 + ntok - window_start(pos0, window))});
      }
    }
  }
  // costliest first (rows x keys read), dealt round-robin so each thread gets a fair share
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(threads, items.size()));
  const float fscale = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "extend_attention_q", [&] {
    using QT = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "extend_attention_kv", [&] {
      using CT = scalar_t;
      {
        const QT* qp = q.data_ptr<QT>();
        QT* op = out.data_ptr<QT>();
        const CT* kc = k_cache.data_ptr<CT>();
        const CT* vc = v_cache.data_ptr<CT>();
        at::parallel_for(0, nthreads, 1, [&](int64_t begin, int64_t end) {
          ItemBuffers buf((block * G + 15) / 16 * 16, D);
#if defined(STRATA_ATTENTION_AMX)
          if (tiles) configure_attention_tiles();
#endif
          for (int64_t tid = begin; tid < end; ++tid) {
            for (size_t it = tid; it < items.size(); it += nthreads) {
              const Item& w = items[it];
              run_item<QT, CT>(tiles, qp, q.stride(0), op, kc, vc, pt + w.b * pages_per_row, page_size, Hkv, w.kvh, G,
                               D, w.tok0, w.ntok, w.pos0, fscale, window, static_cast<float>(softcap), sink_logits,
                               buf);
            }
          }
#if defined(STRATA_ATTENTION_AMX)
          if (tiles) release_tiles();
#endif
        });
      }
    });
  });
#endif
}

}  // namespace

void register_extend_attention(pybind11::module_& m) {
  m.def("extend_attention", &extend_attention, pybind11::arg("out"), pybind11::arg("q"), pybind11::arg("k_cache"),
        pybind11::arg("v_cache"), pybind11::arg("page_table"), pybind11::arg("q_start"), pybind11::arg("q_len"),
        pybind11::arg("kv_len"), pybind11::arg("page_size"), pybind11::arg("scale"), pybind11::arg("window") = 0,
        pybind11::arg("softcap") = 0.0, pybind11::arg("sinks") = pybind11::none());
  m.def("attention_tiles_available", &attention_tiles_available,
        "whether bf16 extend attention can use AMX bf16 tiles here (built with them, the CPU has them, the OS "
        "grants them)");
  m.def(
      "set_attention_tiles",
      [](bool on) {
        TORCH_CHECK(!on || attention_tiles_available(), "AMX bf16 tiles are not available in this build or on this CPU");
        g_attention_tiles_wanted.store(on);
      },
      "bf16 extend attention on the AMX tiles (True, the default where available) or the dot-product path; a "
      "process's prefills should all take one (the two round differently)");
  m.def("attention_tiles", &attention_tiles_on, "whether bf16 extend attention takes the AMX tiles now");
}
