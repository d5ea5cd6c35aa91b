// Attention kernels over the paged KV pool: the K/V store and decode attention read straight from the
// pool (a speculative verification's k + 1 entries as one run sharing each key tile), with a sliding
// window, per-head sinks and a logit softcap (prefill's extend attention: extend_attention.cpp).
// Scores and accumulators stay in float throughout; with bf16 queries and cache on a CPU with
// AVX512-BF16, decode attention multiplies by the bf16 dot-product instruction and so rounds its
// probabilities to bf16 before P @ V, as PyTorch's bf16 attention does (attention_bf16.h). The tests
// compare them with the float32 oracle, strata.layers.attention.reference_attention.
//
// The SIMD paths are written once against the 16-float vector of simd.h (one __m512 with AVX-512,
// two __m256 with AVX2 + FMA + F16C) under STRATA_SIMD16; the scalar loops are the fallback and
// the reference.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "attention_bf16.h"
#include "attention_common.h"
#include "common.h"
#include "ops.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <unistd.h>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// ---------------------------------------------------------------------------------------------
// Paged attention.
//
// Token t (of T) belongs to request owner[t] and sits at absolute position positions[t]; it
// attends keys 0 .. positions[t] of that request (with a window W, only the last W of them:
// positions[t] - W + 1 .. positions[t]; keys before are never read, nor their pages). Key j of
// request b is at slot page_table[b][j / page_size] * page_size + j % page_size. The new tokens' K/V are first stored
// at out_slots. Query head h reads KV head h / (H / Hkv). Softmax is online, in float.
// ---------------------------------------------------------------------------------------------
constexpr int64_t kSplitKeys = 256;  // decode attention: keys per range a long sequence is split into
// decode attention: key ranges per thread from which a work item takes all of a range's KV heads
constexpr int64_t kRangesPerThread = 4;

template <typename QT, typename CT>
void store_kv_impl(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                   const at::Tensor& out_slots) {
  const int64_t T = k.size(0), row = k.size(1) * k.size(2);
  const int64_t ks = k.stride(0), vs = v.stride(0);
  const QT* kp = k.data_ptr<QT>();
  const QT* vp = v.data_ptr<QT>();
  CT* kc = k_cache.data_ptr<CT>();
  CT* vc = v_cache.data_ptr<CT>();
  const int64_t* slots = out_slots.data_ptr<int64_t>();
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      CT* kd = kc + slots[t] * row;
      CT* vd = vc + slots[t] * row;
      if constexpr (std::is_same_v<QT, CT>) {
        std::memcpy(kd, kp + t * ks, row * sizeof(CT));
        std::memcpy(vd, vp + t * vs, row * sizeof(CT));
        continue;
      }
      int64_t i = 0;
#if defined(STRATA_SIMD16)
      if constexpr (kHasLoad16<QT> && kHasLoad16<CT>) {
        for (; i + 16 <= row; i += 16) {
          store16(kd + i, load16(kp + t * ks + i));
          store16(vd + i, load16(vp + t * vs + i));
        }
      }
#endif
      for (; i < row; ++i) {
        kd[i] = static_cast<CT>(to_f(kp[t * ks + i]));
        vd[i] = static_cast<CT>(to_f(vp[t * vs + i]));
      }
    }
  });
}

// The cache lines of a row of n elements, asked for ahead of their use.
template <typename CT>
inline void prefetch_row(const CT* row, int64_t n) {
  const char* c = reinterpret_cast<const char*>(row);
  for (int64_t o = 0; o < n * static_cast<int64_t>(sizeof(CT)); o += 64) __builtin_prefetch(c + o, 0, 3);
}

// Two rows of n elements (a slot's keys and values) into L2 (prefetcht1), line by line.
template <typename CT>
inline void prefetch_rows_l2(const CT* a, const CT* b, int64_t n) {
  const char *x = reinterpret_cast<const char*>(a), *y = reinterpret_cast<const char*>(b);
  for (int64_t o = 0; o < n * static_cast<int64_t>(sizeof(CT)); o += 64) {
    __builtin_prefetch(x + o, 0, 2);
    __builtin_prefetch(y + o, 0, 2);
  }
}

// The CPU's L2 cache per core in bytes (1 MiB where the OS does not say).
inline int64_t l2_bytes() {
  static const int64_t bytes = [] {
    const long b = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return b > 0 ? static_cast<int64_t>(b) : int64_t{1} << 20;
  }();
  return bytes;
}

// max(s[0], ..., s[n - 1]) for n >= 1 (exact: the order does not matter).
inline float max_of(const float* s, int64_t n) {
  float top = s[0];
  int64_t i = 0;
#if defined(STRATA_SIMD16)
  if (n >= 16) {
    V16 acc = load16(s);
    for (i = 16; i + 16 <= n; i += 16) acc = vmax(acc, load16(s + i));
    top = reduce_max(acc);
  }
#endif
  for (; i < n; ++i) top = std::max(top, s[i]);
  return top;
}

// s[i] = exp(s[i] - shift) for i < n; returns the sum.
inline float exp_shifted(float* s, int64_t n, float shift) {
  float sum = 0.f;
  int64_t i = 0;
#if defined(STRATA_SIMD16)
  const V16 sh = vset1(shift);
  V16 acc = vzero();
  for (; i + 16 <= n; i += 16) {
    const V16 e = exp16(vsub(load16(s + i), sh));
    store16(s + i, e);
    acc = vadd(acc, e);
  }
  sum = reduce_add(acc);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - shift);
    sum += s[i];
  }
  return sum;
}

// s[i] = cap * tanh(s[i] / cap) for i < n.
inline void softcap_scores(float* s, int64_t n, float cap) {
  int64_t i = 0;
#if defined(STRATA_SIMD16)
  for (; i + 16 <= n; i += 16) store16(s + i, softcap16(load16(s + i), cap));
#endif
  for (; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
}

// Keys [j_from, j_to) of a tile scored one by one: scores[g * kKeyTile + jj] = q_g . key_jj. Kept out
// of line, so that every caller runs the same arithmetic (decode attention recomputes a short
// row's last keys with it: see attention_impl).
template <typename CT>
__attribute__((noinline)) void scalar_scores(const float* qf, int64_t G, int64_t D, const CT* const* keys,
                                             int64_t j_from, int64_t j_to, float* scores) {
  if (j_from >= j_to) return;  // a tile scored 16 at a time throughout
  std::vector<float> kf(D);
  for (int64_t jj = j_from; jj < j_to; ++jj) {
    load_row(keys[jj], kf.data(), D);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qg[d] * kf[d];
      scores[g * kKeyTile + jj] = s;
    }
  }
}

// How many of a tile's first jn keys tile_scores scores 16 at a time (the rest: scalar_scores).
template <typename CT>
inline int64_t simd_keys(int64_t D, int64_t jn) {
#if defined(STRATA_SIMD16)
  if constexpr (kHasLoad16<CT>) {
    if (D % 16 == 0 && D <= 256) return jn / 16 * 16;
  }
#endif
  return 0;
}

// scores[g * kKeyTile + jj] = q_g . key_jj for the keys of one tile (qf: G rows of D floats).
template <typename CT>
inline void tile_scores(const float* qf, int64_t G, int64_t D, const CT* const* keys, int64_t jn, float* scores) {
  const int64_t simd = simd_keys<CT>(D, jn);
#if defined(STRATA_SIMD16)
  if constexpr (kHasLoad16<CT>) {
    alignas(64) float kt[16 * 256];
    for (int64_t jj = 0; jj < simd; jj += 16) {  // 16 keys at a time: widen once, then one reduction tree per head
      for (int k = 0; k < 16; ++k) {
        for (int64_t d = 0; d < D; d += 16) store16(kt + k * D + d, load16(keys[jj + k] + d));
      }
      for (int64_t g = 0; g < G; ++g) store16(scores + g * kKeyTile + jj, dot16(qf + g * D, kt, D));
    }
  }
#endif
  scalar_scores<CT>(qf, G, D, keys, simd, jn, scores);
}

#if defined(STRATA_SIMD16)
// Columns d .. d + 15 of heads g0 .. g0 + GN - 1: acc_g += sum_jj p[g][jj] * value_jj, the GN
// accumulators in registers (GN a template argument so they are not kept in memory).
template <int GN, typename CT>
inline void values_block(const float* probs, int64_t D, const CT* const* values, int64_t jn, float* acc, int64_t g0,
                         int64_t d) {
  V16 a[GN];
  for (int g = 0; g < GN; ++g) a[g] = load16(acc + (g0 + g) * D + d);
  for (int64_t jj = 0; jj < jn; ++jj) {
    const V16 vv = load16(values[jj] + d);
    for (int g = 0; g < GN; ++g) a[g] = vfmadd(vset1(probs[(g0 + g) * kKeyTile + jj]), vv, a[g]);
  }
  for (int g = 0; g < GN; ++g) store16(acc + (g0 + g) * D + d, a[g]);
}

// Heads per values_block: 8 accumulators with AVX-512's 32 registers, 6 (12 of the 16 ymm) with AVX2.
constexpr int64_t kValueHeads = kRegsPerV16 == 1 ? 8 : 6;
#endif

// acc_g += sum_jj p[g][jj] * value_jj.
template <typename CT>
inline void tile_values(const float* probs, int64_t G, int64_t D, const CT* const* values, int64_t jn, float* acc) {
#if defined(STRATA_SIMD16)
  if constexpr (kHasLoad16<CT>) {
   if (D % 16 == 0) {
    const int64_t groups = (G + kValueHeads - 1) / kValueHeads;
    const int64_t gs = (G + groups - 1) / groups;  // heads per group, as even as possible
    for (int64_t d = 0; d < D; d += 16) {
      for (int64_t g0 = 0; g0 < G; g0 += gs) {
        with_count<kValueHeads>(std::min(gs, G - g0), [&]<int GN>() {
          values_block<GN>(probs, D, values, jn, acc, g0, d);
        });
      }
    }
    return;
   }
  }
#endif
  std::vector<float> vf(D);
  for (int64_t jj = 0; jj < jn; ++jj) {
    load_row(values[jj], vf.data(), D);
    for (int64_t g = 0; g < G; ++g) {
      const float p = probs[g * kKeyTile + jj];
      float* ag = acc + g * D;
      for (int64_t d = 0; d < D; ++d) ag[d] += p * vf[d];
    }
  }
}

// Runs of decode tokens that attend together: a verification's k + 1 entries (one request's
// consecutive positions over the same pages) share each tile of keys and values. The first token of
// each run, with T at the end. A token joins the run before it when its position is one more than the
// previous token's, its keys start where theirs do (no window cuts in between) and its page-table row
// holds the same pages over the keys it reads; runs hold at most kMaxRunRows tokens.
constexpr int64_t kMaxRunRows = 16;

std::vector<int64_t> attention_runs(int64_t T, const int64_t* own, const int64_t* pos, const int64_t* pt,
                                    int64_t pages_per_row, int64_t page_size, int64_t window) {
  std::vector<int64_t> starts{0};
  for (int64_t t = 1; t < T; ++t) {
    const int64_t first = window_start(pos[t], window);
    const int64_t used = pos[t] / page_size + 1;  // pages holding keys .. pos[t]
    const bool joins = t - starts.back() < kMaxRunRows && pos[t] == pos[t - 1] + 1 &&
                       first == window_start(pos[t - 1], window) &&
                       (own[t] == own[t - 1] ||
                        std::equal(pt + own[t] * pages_per_row + first / page_size, pt + own[t] * pages_per_row + used,
                                   pt + own[t - 1] * pages_per_row + first / page_size));
    if (!joins) starts.push_back(t);
  }
  starts.push_back(T);
  return starts;
}

// Decode attention. A work item is (run of tokens, KV head or all of them, key range): for each of
// its KV heads, its R tokens x G query heads read each tile of keys and values once. Every query
// row's arithmetic is what it would be alone (a run of one): its scores over its own keys (those a
// shorter row scored 16 at a time that it would score one by one are scored again one by one), its
// own online softmax, and zero probabilities for the keys past its own, so a token's result does not
// depend on its neighbours.
template <typename QT, typename CT>
void attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& page_table, const at::Tensor& owner,
                    const at::Tensor& positions, int64_t page_size, double scale, int64_t window, float softcap,
                    const float* sinks) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1);
  const int64_t G = H / Hkv;
  const int64_t pages_per_row = page_table.size(1);
  const int64_t q_stride = q.stride(0);
  const QT* qp = q.data_ptr<QT>();
  QT* op = out.data_ptr<QT>();
  const CT* kc = k_cache.data_ptr<CT>();
  const CT* vc = v_cache.data_ptr<CT>();
  const int64_t* pt = page_table.data_ptr<int64_t>();
  const int64_t* own = owner.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  const std::vector<int64_t> runs = attention_runs(T, own, pos, pt, pages_per_row, page_size, window);
  const int64_t num_runs = static_cast<int64_t>(runs.size()) - 1;
  int64_t max_run = 1;
  for (int64_t i = 0; i < num_runs; ++i) max_run = std::max(max_run, runs[i + 1] - runs[i]);

  // Long key ranges are split into ranges of kSplitKeys keys, attended in parallel, and their
  // partial softmaxes merged in order. The ranges depend on the token's own keys only, never on
  // the rest of the batch, so a token's result is the same whatever it is batched with (a lone
  // decode, or the k + 1 entries of a speculative verification).
  int64_t max_n = 0;
  for (int64_t t = 0; t < T; ++t) max_n = std::max(max_n, pos[t] + 1 - window_start(pos[t], window));
  const int64_t splits = std::max<int64_t>(1, (max_n + kSplitKeys - 1) / kSplitKeys);
  // every (token, KV head, range) is one work item's, which writes all of its entries: left uninitialized
  std::unique_ptr<float[]> part_m, part_l, part_acc;
  if (splits > 1) {
    part_m.reset(new float[T * Hkv * splits * G]);
    part_l.reset(new float[T * Hkv * splits * G]);
    part_acc.reset(new float[T * Hkv * splits * G * D]);
  }

  // bf16 queries and keys on a CPU with AVX512-BF16: scores and values by the bf16 dot-product instruction
  [[maybe_unused]] bool bf16_dots = false;
#if defined(__AVX512BF16__)
  bf16_dots = std::is_same_v<QT, c10::BFloat16> && std::is_same_v<CT, c10::BFloat16> && D % 32 == 0;
#endif
  // The work items, dealt to the threads costliest first, each to the least loaded so far: a
  // sequence's last key range is often short, and contiguous chunks of items could leave one thread
  // the long ranges (550 keys, 3 KV heads, 2 threads: 1062 against 588 keys). An item is a run's key
  // range for one KV head, or for all of them where there are enough ranges to balance the threads
  // (kRangesPerThread each): then a tile's keys are read as the cache holds them, a slot's heads side
  // by side, instead of one head's rows out of every slot's. Which thread attends an item, and with
  // which heads, does not change its arithmetic.
  // A run's first key (its tokens share it) and keys [jbeg, jend) of its range `split`: a token
  // attends them up to its own position (the run's last token, all of them).
  struct KeyRange { int64_t first, jbeg, jend; };
  auto key_range = [&](int64_t run, int64_t split) {
    const int64_t first = window_start(pos[runs[run]], window), end = pos[runs[run + 1] - 1] + 1;
    const int64_t jbeg = std::min(end, first + split * kSplitKeys);
    return KeyRange{first, jbeg, std::max(jbeg, std::min(end, first + (split + 1) * kSplitKeys))};
  };
  const int64_t most_threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t item_heads = num_runs * splits >= kRangesPerThread * most_threads ? Hkv : 1;
  const int64_t head_groups = Hkv / item_heads;
  // item (run, head group, split) is (run head_groups + group) splits + split; group k: KV heads from k item_heads
  const int64_t num_items = num_runs * head_groups * splits;
  const int64_t nthreads = std::min(most_threads, num_items);
  std::vector<int64_t> order, bounds{0};  // thread b's items: order[bounds[b] .. bounds[b + 1])
  {
    std::vector<std::pair<int64_t, int64_t>> costs;  // (rows x keys, plus a range's fixed work; item)
    for (int64_t item = 0; item < num_items; ++item) {
      const int64_t split = item % splits, run = item / splits / head_groups;
      const KeyRange kr = key_range(run, split);
      costs.emplace_back(item_heads * (runs[run + 1] - runs[run]) * (kr.jend - kr.jbeg + 16), item);
    }
    std::stable_sort(costs.begin(), costs.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    std::vector<std::vector<int64_t>> dealt(nthreads);
    std::vector<int64_t> load(nthreads, 0);
    for (const auto& [cost, item] : costs) {
      const int64_t b = std::min_element(load.begin(), load.end()) - load.begin();
      load[b] += cost;
      dealt[b].push_back(item);
    }
    for (const auto& items : dealt) {
      order.insert(order.end(), items.begin(), items.end());
      bounds.push_back(static_cast<int64_t>(order.size()));
    }
  }
  // the slot of key j of a page-table row
  auto slot_in = [&](const int64_t* pages, int64_t j) {
    return page_size == 1 ? pages[j] : pages[j / page_size] * page_size + j % page_size;
  };
  // Where a call reads more keys and values than the threads' L2 caches hold, they come from memory
  // or a shared cache each step: items of all KV heads then also ask for a share of the thread's
  // next item's rows into L2 at each tile, beside the next tile's into L1 (64 requests of 320 keys,
  // each decoded key in a slot of its own: ~43 -> ~30 ms over 30 layers; where a call's rows stay in
  // cache from step to step it measured ~5% slower, hence only above that size).
  int64_t kv_bytes = 0;
  for (int64_t run = 0; run < num_runs; ++run) {
    const int64_t keys_read = pos[runs[run + 1] - 1] + 1 - window_start(pos[runs[run]], window);
    kv_bytes += keys_read * Hkv * D * 2 * static_cast<int64_t>(sizeof(CT));
  }
  const bool lookahead = item_heads == Hkv && Hkv > 1 && kv_bytes > nthreads * l2_bytes();
  // An item's page-table row, first KV head and key range
  struct ItemKeys { const int64_t* pages; int64_t kvh0; KeyRange kr; };
  auto item_keys = [&](int64_t item) {
    const int64_t rk = item / splits, run = rk / head_groups;
    return ItemKeys{pt + own[runs[run + 1] - 1] * pages_per_row, rk % head_groups * item_heads,
                    key_range(run, item % splits)};
  };
  // K and V rows of keys [from, to) of KV heads kvh0 .. kvh0 + item_heads - 1, asked for ahead of use
  // (pages: a page-table row)
  auto prefetch_keys = [&](const int64_t* pages, int64_t kvh0, int64_t from, int64_t to) {
    for (int64_t j = from; j < to; ++j) {
      const int64_t slot = slot_in(pages, j);
      prefetch_row(kc + (slot * Hkv + kvh0) * D, item_heads * D);
      prefetch_row(vc + (slot * Hkv + kvh0) * D, item_heads * D);
    }
  };
  at::parallel_for(0, nthreads, 1, [&](int64_t b0, int64_t b1) {
    // per query row (h, r, g) of an item (head h of its group, row r of its run), at (h R + r) G + g
    const int64_t most_rows = item_heads * max_run * G;
    std::vector<float> qf, acc, scores, m(most_rows), l(most_rows);
    std::vector<int64_t> row_end(max_run), row_keys(max_run * G), slots(kKeyTile);
    const CT* keys[kKeyTile];
    const CT* values[kKeyTile + 1];  // one more: tile_attend_bf16 pairs an odd tile's last key
#if defined(__AVX512BF16__)
    std::vector<const c10::BFloat16*> qrows(most_rows);
    std::vector<std::unique_ptr<DecodeRowsBf16>> rows_bf16;  // per head of an item
    if (bf16_dots) {
      for (int64_t h = 0; h < item_heads; ++h) rows_bf16.push_back(std::make_unique<DecodeRowsBf16>(max_run * G, D));
    }
#endif
    if (!bf16_dots) {
      qf.resize(most_rows * D);
      acc.resize(most_rows * D);
      scores.resize(most_rows * kKeyTile);
    }
    for (int64_t at_item = bounds[b0]; at_item < bounds[b1]; ++at_item) {
      const int64_t item = order[at_item];
      const int64_t split = item % splits, rk = item / splits;
      const int64_t run = rk / head_groups, kvh0 = rk % head_groups * item_heads;
      const int64_t t0 = runs[run], R = runs[run + 1] - t0, last = t0 + R - 1, RG = R * G;
      const auto [first, jbeg, jend] = key_range(run, split);
      for (int64_t r = 0; r < R; ++r) {  // below their own ends, the run's tokens share the range
        row_end[r] = std::min(pos[t0 + r] + 1, first + (split + 1) * kSplitKeys);  // keys [jbeg, row_end)
      }
      const int64_t* pages = pt + own[last] * pages_per_row;
      // query row i of KV head kvh: its softmax state before its keys: in the first range, the sink
      // joins it as a score with no value (exp(sink - m) = 1); else nothing yet
      const bool sink_here = sinks && split == 0;
      auto start_max = [&](int64_t kvh, int64_t i) {
        return sink_here ? sinks[kvh * G + i % G] : -std::numeric_limits<float>::infinity();
      };
      const float start_sum = sink_here ? 1.f : 0.f;
#if defined(__AVX512BF16__)
      if (bf16_dots) {
        for (int64_t h = 0; h < item_heads; ++h) {
          DecodeRowsBf16& st = *rows_bf16[h];
          for (int64_t i = 0; i < RG; ++i) {
            qrows[h * RG + i] = reinterpret_cast<const c10::BFloat16*>(qp + (t0 + i / G) * q_stride +
                                                                       ((kvh0 + h) * G + i % G) * D);
            st.m[i] = start_max(kvh0 + h, i);
            std::fill(st.l.begin() + 16 * i, st.l.begin() + 16 * (i + 1), 0.f);
            st.l[16 * i] = start_sum;
          }
          std::fill(st.acc.begin(), st.acc.begin() + RG * D, 0.f);
        }
      }
#endif
      if (!bf16_dots) {
        for (int64_t i = 0; i < item_heads * RG; ++i) {
          const int64_t h = i / RG, r = i % RG / G, g = i % G;
          const QT* src = qp + (t0 + r) * q_stride + ((kvh0 + h) * G + g) * D;
          for (int64_t d = 0; d < D; ++d) qf[i * D + d] = to_f(src[d]) * fscale;
          m[i] = start_max(kvh0 + h, i % RG);
          l[i] = start_sum;
        }
        std::fill(acc.begin(), acc.begin() + item_heads * RG * D, 0.f);
      }
      for (int64_t j0 = jbeg; j0 < jend; j0 += kKeyTile) {
        const int64_t jn = std::min(kKeyTile, jend - j0);
        for (int64_t jj = 0; jj < jn; ++jj) slots[jj] = slot_in(pages, j0 + jj);
        // The next tile's keys and values asked for while this one is attended (on the last tile, the
        // first of the thread's next item; on the first, its own values, read after its scores): a
        // request's slots need not be consecutive (concurrent requests interleave their decode slots,
        // a cached prefix sits wherever it was written), and the hardware prefetcher follows only
        // regular strides.
        if (j0 == jbeg) {
          for (int64_t jj = 0; jj < jn; ++jj) prefetch_row(vc + (slots[jj] * Hkv + kvh0) * D, item_heads * D);
        }
        if (lookahead && at_item + 1 < bounds[b1]) {  // share ti of ntiles of the next item's rows
          const auto [next_pages, next_kvh0, kr] = item_keys(order[at_item + 1]);
          const int64_t ntiles = (jend - jbeg + kKeyTile - 1) / kKeyTile, ti = (j0 - jbeg) / kKeyTile;
          const int64_t share = (kr.jend - kr.jbeg + ntiles - 1) / ntiles;
          for (int64_t j = kr.jbeg + ti * share; j < std::min(kr.jend, kr.jbeg + (ti + 1) * share); ++j) {
            const int64_t slot = slot_in(next_pages, j);
            prefetch_rows_l2(kc + slot * Hkv * D, vc + slot * Hkv * D, Hkv * D);
          }
        }
        if (j0 + kKeyTile < jend) {
          prefetch_keys(pages, kvh0, j0 + kKeyTile, std::min(jend, j0 + 2 * kKeyTile));
        } else if (at_item + 1 < bounds[b1]) {
          const auto [next_pages, next_kvh0, kr] = item_keys(order[at_item + 1]);
          prefetch_keys(next_pages, next_kvh0, kr.jbeg, std::min(kr.jend, kr.jbeg + kKeyTile));
        }
        for (int64_t h = 0; h < item_heads; ++h) {
          const int64_t kvh = kvh0 + h;
          for (int64_t jj = 0; jj < jn; ++jj) {
            keys[jj] = kc + (slots[jj] * Hkv + kvh) * D;
            values[jj] = vc + (slots[jj] * Hkv + kvh) * D;
          }
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<QT, c10::BFloat16> && std::is_same_v<CT, c10::BFloat16>) {
            if (bf16_dots) {
              for (int64_t i = 0; i < RG; ++i) row_keys[i] = std::min(jn, row_end[i / G] - j0);
              tile_attend_bf16(qrows.data() + h * RG, RG, D, keys, values, jn, row_keys.data(), fscale, softcap,
                               *rows_bf16[h]);
              continue;
            }
          }
#endif
          const float* qh = qf.data() + h * RG * D;
          float *sh = scores.data() + h * RG * kKeyTile, *ah = acc.data() + h * RG * D;
          float *mh = m.data() + h * RG, *lh = l.data() + h * RG;
          tile_scores<CT>(qh, RG, D, keys, jn, sh);
          const int64_t simd = simd_keys<CT>(D, jn);
          for (int64_t r = 0; r < R; ++r) {  // a shorter row scores its last keys as it would alone
            const int64_t rn = std::min(jn, row_end[r] - j0), own_simd = simd_keys<CT>(D, rn);
            if (rn > 0 && own_simd < simd) {
              scalar_scores<CT>(qh + r * G * D, G, D, keys, own_simd, rn, sh + r * G * kKeyTile);
            }
          }
          for (int64_t r = 0; r < R; ++r) {
            const int64_t rn = std::min(jn, row_end[r] - j0);  // this row's keys in the tile
            for (int64_t g = 0; g < G; ++g) {
              const int64_t i = r * G + g;
              float* sg = sh + i * kKeyTile;
              if (rn <= 0) {  // past this row's keys: no weight, its state untouched
                std::fill(sg, sg + jn, 0.f);
                continue;
              }
              if (softcap > 0) softcap_scores(sg, rn, softcap);
              const float new_max = std::max(mh[i], max_of(sg, rn));
              const float correction = std::exp(mh[i] - new_max);  // exp(-inf) = 0 on the first tile
              lh[i] = lh[i] * correction + exp_shifted(sg, rn, new_max);
              mh[i] = new_max;
              if (correction != 1.f) {
                float* ag = ah + i * D;
                for (int64_t d = 0; d < D; ++d) ag[d] *= correction;
              }
              std::fill(sg + rn, sg + jn, 0.f);
            }
          }
          tile_values<CT>(sh, RG, D, values, jn, ah);
        }
      }
      for (int64_t h = 0; h < item_heads; ++h) {
        const int64_t kvh = kvh0 + h;
        float* accp = acc.data() + h * RG * D;
        float *mh = m.data() + h * RG, *lh = l.data() + h * RG;
#if defined(__AVX512BF16__)
        if (bf16_dots) {  // the lanes' sums added up, acc back in dimension order
          DecodeRowsBf16& st = *rows_bf16[h];
          accp = st.acc.data();
          for (int64_t i = 0; i < RG; ++i) {
            mh[i] = st.m[i];
            lh[i] = _mm512_reduce_add_ps(_mm512_loadu_ps(st.l.data() + 16 * i));
            values_unpermute(accp + i * D, D);
          }
        }
#endif
        for (int64_t r = 0; r < R; ++r) {
          const int64_t t = t0 + r;
          if (splits > 1) {
            const int64_t base = ((t * Hkv + kvh) * splits + split) * G;
            for (int64_t g = 0; g < G; ++g) {
              part_m[base + g] = mh[r * G + g];
              part_l[base + g] = lh[r * G + g];
              std::copy(accp + (r * G + g) * D, accp + (r * G + g + 1) * D, part_acc.get() + (base + g) * D);
            }
            continue;
          }
          for (int64_t g = 0; g < G; ++g) {
            QT* dst = op + (t * H + kvh * G + g) * D;
            const float inv = 1.f / lh[r * G + g];
            for (int64_t d = 0; d < D; ++d) dst[d] = round_to<QT>(accp[(r * G + g) * D + d] * inv);
          }
        }
      }
    }
  });
  if (splits == 1) return;
  // merge: rescale each range to the common max (a verification's rows in parallel: its T x Hkv x G
  // merges would otherwise run on one thread after the others finish)
  at::parallel_for(0, T * Hkv, 8, [&](int64_t tk0, int64_t tk1) {
    std::vector<float> sum(D);
    for (int64_t tk = tk0; tk < tk1; ++tk) {
      const int64_t t = tk / Hkv, kvh = tk % Hkv;
      for (int64_t g = 0; g < G; ++g) {
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t sp = 0; sp < splits; ++sp) top = std::max(top, part_m[(tk * splits + sp) * G + g]);
        float total = 0.f;
        std::fill(sum.begin(), sum.end(), 0.f);
        for (int64_t sp = 0; sp < splits; ++sp) {
          const int64_t idx = (tk * splits + sp) * G + g;
          if (part_l[idx] == 0.f) continue;  // an empty range
          const float w = std::exp(part_m[idx] - top);
          total += w * part_l[idx];
          for (int64_t d = 0; d < D; ++d) sum[d] += w * part_acc[idx * D + d];
        }
        QT* dst = op + (t * H + kvh * G + g) * D;
        const float inv = 1.f / total;  // as the unsplit path: one range gives bit-identical results
        for (int64_t d = 0; d < D; ++d) dst[d] = round_to<QT>(sum[d] * inv);
      }
    }
  });
}

// k_cache[out_slots[t]] = k[t], v_cache[out_slots[t]] = v[t] (converted to the cache dtype).
void store_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor out_slots) {
  check_token_rows(k, "k");
  check_token_rows(v, "v");
  check_caches(k_cache, v_cache);
  TORCH_CHECK(v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type(), "v (", v.sizes(), ", ", v.scalar_type(),
              ") must match k (", k.sizes(), ", ", k.scalar_type(), ")");
  TORCH_CHECK(k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(2), "k has ", k.size(1), " heads of ",
              k.size(2), " but the caches hold ", k_cache.size(1), " KV heads of ", k_cache.size(2));
  const int64_t T = k.size(0), num_slots = k_cache.size(0);
  const int64_t* slots = index_data(out_slots, 1, "out_slots", "[tokens]");
  TORCH_CHECK(out_slots.numel() == T, "out_slots has ", out_slots.numel(), " slots for ", T, " new tokens");
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "out_slots[", t, "] = ", slots[t],
                " is outside the KV pool's slots [0, ", num_slots, ")");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "store_kv_k", [&] {
    using QT = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "store_kv_cache", [&] {
      store_kv_impl<QT, scalar_t>(k, v, k_cache, v_cache, out_slots);
    });
  });
}

// `window` of them when window > 0); softcap and sinks as in check_layer_options.
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor page_table,
                     at::Tensor owner, at::Tensor positions, int64_t page_size, double scale, int64_t window,
                     double softcap, c10::optional<at::Tensor> sinks) {
  const int64_t num_pages = check_attention_io(out, q, k_cache, v_cache, page_table, page_size);
  const float* sink_logits = check_layer_options(q.size(1), softcap, sinks);
  const int64_t T = q.size(0), B = page_table.size(0), pages_per_row = page_table.size(1);
  const int64_t* own = index_data(owner, 1, "owner", "[tokens]");
  const int64_t* pos = index_data(positions, 1, "positions", "[tokens]");
  TORCH_CHECK(owner.numel() == T && positions.numel() == T, "owner (", owner.numel(), ") and positions (",
              positions.numel(), ") need one entry per query token (", T, ")");
  const int64_t capacity = key_capacity(pages_per_row, page_size);
  // per page-table row: its tokens read keys first_read .. end_read - 1 (the union of their ranges)
  std::vector<int64_t> first_read(B, std::numeric_limits<int64_t>::max()), end_read(B, 0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(own[t] >= 0 && own[t] < B, "owner[", t, "] = ", own[t], " is not a row of the page table [0, ", B, ")");
    TORCH_CHECK(pos[t] >= 0 && pos[t] < capacity, "positions[", t, "] = ", pos[t], " is past the request's pages [0, ",
                capacity, ") (", pages_per_row, " pages of ", page_size, ")");
    first_read[own[t]] = std::min(first_read[own[t]], window_start(pos[t], window));
    end_read[own[t]] = std::max(end_read[own[t]], pos[t] + 1);
  }
  const int64_t* pt = page_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    check_pages_read(pt, pages_per_row, b, first_read[b], end_read[b], page_size, num_pages);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_q", [&] {
    using QT = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_attention_kv", [&] {
      attention_impl<QT, scalar_t>(out, q, k_cache, v_cache, page_table, owner, positions, page_size, scale, window,
                                   static_cast<float>(softcap), sink_logits);
    });
  });
}

}  // namespace

namespace strata_ops {  // ops.h: for the decode loop (decode_loop.cpp)
void store_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor out_slots) {
  ::store_kv(k, v, k_cache, v_cache, out_slots);
}
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor page_table,
                     at::Tensor owner, at::Tensor positions, int64_t page_size, double scale, int64_t window,
                     double softcap, c10::optional<at::Tensor> sinks) {
  ::paged_attention(out, q, k_cache, v_cache, page_table, owner, positions, page_size, scale, window, softcap, sinks);
}
}  // namespace strata_ops

void register_attention_ops(pybind11::module_& m) {
  m.def("store_kv", &store_kv);
  m.def("paged_attention", &paged_attention, pybind11::arg("out"), pybind11::arg("q"), pybind11::arg("k_cache"),
        pybind11::arg("v_cache"), pybind11::arg("page_table"), pybind11::arg("owner"), pybind11::arg("positions"),
        pybind11::arg("page_size"), pybind11::arg("scale"), pybind11::arg("window") = 0,
        pybind11::arg("softcap") = 0.0, pybind11::arg("sinks") = pybind11::none());
}
