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

#include "attention_bf16.h"
#include "attention_common.h"
#include "common.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

#if defined(STRATA_SIMD16)
constexpr int64_t kItemRows = 64;  // rows (tokens x query heads) per work item, at least one token
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
  // the bf16 path's: queries as pairs, probability pairs, unpacked value pairs, a zero key or value
  std::vector<int32_t> qpairs, ppairs, vpairs, zeros;
  ItemBuffers(int64_t lanes, int64_t D)
      : qt(lanes * D), acc(lanes * D), m(lanes), l(lanes), pos(lanes), first(lanes), kt(D * 16), vf(16 * D),
        pt(256), corr(16), qpairs(lanes * D / 2), ppairs(128), vpairs(8 * D), zeros(D / 2) {}
};

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
  for (int64_t r = 0; r < nvec * 16; ++r) {
    const int64_t row = std::min(r, rows - 1);  // lanes past the last row repeat it (never written out)
    const int64_t i = row / G, g = row % G;
    const QT* src = qp + (tok0 + i) * q_stride + (kvh * G + g) * D;
#if defined(__AVX512BF16__)
    if (bf16) {
      int32_t* column = w.qpairs.data() + (r / 16) * half_d * 16 + r % 16;
      const int32_t* pairs = reinterpret_cast<const int32_t*>(src);
      for (int64_t d = 0; d < half_d; ++d) column[d * 16] = pairs[d];
    }
#endif
    float* column = qt + (r / 16) * D * 16 + r % 16;
    for (int64_t d = 0; d < D && !bf16; ++d) column[d * 16] = to_f(src[d]) * scale;
    w.pos[r] = static_cast<float>(pos0 + i);
    w.first[r] = static_cast<float>(window_start(pos0 + i, window));
    m[r] = sinks ? sinks[kvh * G + g] : kNoMax;  // a sink joins the softmax as a score with no value
    l[r] = sinks ? 1.f : 0.f;
  }
  std::fill(acc, acc + nvec * 16 * D, 0.f);
  const V16 minus_inf = vset1(-std::numeric_limits<float>::infinity());
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
    if (bf16) {
      for (int64_t kp = 0; kp < npairs; ++kp) {
        for (int64_t c = 0; c < chunks; ++c) {
          const __m512i a = _mm512_loadu_si512(value_rows[2 * kp] + 32 * c);
          const __m512i b = _mm512_loadu_si512(value_rows[2 * kp + 1] + 32 * c);
          int32_t* dst = w.vpairs.data() + (kp * chunks + c) * 32;
          _mm512_storeu_si512(dst, _mm512_unpacklo_epi16(a, b));
          _mm512_storeu_si512(dst + 16, _mm512_unpackhi_epi16(a, b));
        }
      }
    }
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
      Mask16 seen[16];
      if (!whole) {
        const V16 pos_v = load16(pos), first_v = load16(first);
        for (int k = 0; k < 16; ++k) {
          const V16 j = vset1(static_cast<float>(j0 + k));
          seen[k] = mask_and(vle(first_v, j), vle(j, pos_v));
          s[k] = vselect(seen[k], s[k], minus_inf);
        }
      }
      V16 top = s[0];
      for (int k = 1; k < 16; ++k) top = vmax(top, s[k]);
      const V16 m_old = load16(m + v * 16), m_new = vmax(m_old, top);
      const V16 c = exp16(vsub(m_old, m_new));
      V16 sum = vzero();
      for (int k = 0; k < 16; ++k) {
        V16 p = exp16(vsub(s[k], m_new));
        if (!whole) p = vselect(seen[k], p, vzero());
        s[k] = p;
        sum = vadd(sum, p);
      }
      store16(m + v * 16, m_new);
      store16(l + v * 16, vadd(vmul(load16(l + v * 16), c), sum));
      store16(corr, c);
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
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / G, g = r % G;
    QT* dst = op + ((tok0 + i) * Hkv * G + kvh * G + g) * D;
    const float inv = 1.f / l[r];
    if (bf16) values_unpermute(acc + r * D, D);  // from values_dim order
    for (int64_t d = 0; d < D; ++d) dst[d] = round_to<QT>(acc[r * D + d] * inv);
  }
}
#endif

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
  const int64_t block = std::max<int64_t>(1, kItemRows / G);  // tokens per work item
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
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
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
          for (int64_t tid = begin; tid < end; ++tid) {
            for (size_t it = tid; it < items.size(); it += nthreads) {
              const Item& w = items[it];
              extend_item<QT, CT>(qp, q.stride(0), op, kc, vc, pt + w.b * pages_per_row, page_size, Hkv, w.kvh, G, D,
                                  w.tok0, w.ntok, w.pos0, fscale, window, static_cast<float>(softcap), sink_logits,
                                  buf);
            }
          }
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
}
