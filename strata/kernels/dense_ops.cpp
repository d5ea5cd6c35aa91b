// Dense linear layers for the CPU: y = x @ W^T + b with bf16 or float32 weights, computed so that a
// row of y depends only on the same row of x: its bits are the same whether the call has 1 row or
// 500, and wherever the row sits among them.
//
// BLAS does not promise that. oneDNN and MKL choose blocking, K splits and code paths by the matrix
// sizes, so a lone row can come out rounded differently from the same row among others, and a
// speculative verification of k + 1 rows then disagrees with the 1-row steps it stands for. Here
// every output element is one float32 accumulator that walks K in order with the same instructions
// whatever the tile of rows and outputs around it, and threads split the outputs, never K.
//
// Weights are packed once (strata.layers.dense), 16 output rows side by side:
//
//   bf16      wp [G, K/2, 16, 2]   each 16 x 2 block: channels 2p, 2p + 1 of 16 rows (one vdpbf16ps)
//   float32   wp [G, K, 16]        channel k of 16 rows
//
// with G = ceil(N / 16) and the last group's missing rows zero. Activations have the weights' dtype;
// bias (optional) is added in float32 before the output is rounded to x's dtype.
//
// Paths: AVX-512 BF16 (vdpbf16ps on the bf16 pairs), AVX-512F and AVX2 + FMA (bf16 pairs widened to
// float32: two FMAs per pair, even channel first), and a scalar loop with the AVX2 path's order. A
// build runs one path for every call, so the invariance holds per machine; the paths agree with
// each other and with F.linear to rounding.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "common.h"

#if defined(__AVX512F__)
#define STRATA_DENSE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define STRATA_DENSE_AVX2 1
#endif
#if defined(STRATA_DENSE_AVX512) || defined(STRATA_DENSE_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGroup = 16;                  // output rows packed side by side
constexpr int64_t kChunkBytes = 192 * 1024;     // weight bytes a thread keeps in L2 across the row tiles

inline uint32_t load_u32(const void* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#if defined(STRATA_DENSE_AVX512)
// 16 float lanes: a group is one register.
struct Lanes {
  using F = __m512;
  static constexpr int kLanes = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  // the kLanes bf16 pairs at p widened: the even channel of each pair and the odd one
  static void widen_pairs(const uint16_t* p, F& even, F& odd) {
    const __m512i v = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};
// Most rows per tile: 9 rows x 2 groups of accumulators (and a speculative verification of 8
// drafts is one tile); fewer rows take more groups, so a lone row still runs 4 independent sums.
constexpr int kRowTile = 9;
constexpr int groups_per_tile(int rows) { return rows <= 4 ? 4 : 2; }
#elif defined(STRATA_DENSE_AVX2)
// 8 float lanes: a group is two registers (lanes 0-7, 8-15).
struct Lanes {
  using F = __m256;
  static constexpr int kLanes = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static void widen_pairs(const uint16_t* p, F& even, F& odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};
// 16 registers: 4 rows x 1 group (8 accumulators), or a lone row over 2 groups.
constexpr int kRowTile = 4;
constexpr int groups_per_tile(int rows) { return rows == 1 ? 2 : 1; }
#else
constexpr int kRowTile = 4;
constexpr int groups_per_tile(int) { return 1; }
#endif

#if defined(STRATA_DENSE_AVX512) || defined(STRATA_DENSE_AVX2)
constexpr int kHalves = kGroup / Lanes::kLanes;  // registers per group

// bf16 weights [G, K/2, 16, 2] against bf16 rows: acc[r][j * kHalves + h] += rows r . group g + j.
struct Bf16Weights {
  const uint16_t* w;
  int64_t K;
  using X = uint16_t;

  template <int RT, int NG>
  void dot(int64_t g, const uint16_t* x, int64_t ldx, Lanes::F (*acc)[NG * kHalves]) const {
    const int64_t pairs = K / 2;
    const uint16_t* wg = w + g * pairs * 2 * kGroup;
    for (int64_t p = 0; p < pairs; ++p) {
#if defined(__AVX512BF16__)
      __m512bh wv[NG];
      for (int j = 0; j < NG; ++j) {
        wv[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(wg + (j * pairs + p) * 2 * kGroup));
      }
      for (int r = 0; r < RT; ++r) {
        const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(load_u32(x + r * ldx + 2 * p))));
        for (int j = 0; j < NG; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xv);
      }
#else
      Lanes::F even[NG * kHalves], odd[NG * kHalves];
      for (int j = 0; j < NG; ++j) {
        for (int h = 0; h < kHalves; ++h) {
          Lanes::widen_pairs(wg + (j * pairs + p) * 2 * kGroup + h * 2 * Lanes::kLanes, even[j * kHalves + h],
                             odd[j * kHalves + h]);
        }
      }
      for (int r = 0; r < RT; ++r) {
        const Lanes::F xe = Lanes::set1(bf16_to_float(x[r * ldx + 2 * p]));
        const Lanes::F xo = Lanes::set1(bf16_to_float(x[r * ldx + 2 * p + 1]));
        for (int i = 0; i < NG * kHalves; ++i) acc[r][i] = Lanes::fmadd(odd[i], xo, Lanes::fmadd(even[i], xe, acc[r][i]));
      }
#endif
    }
  }
};

// float32 weights [G, K, 16] against float32 rows.
struct F32Weights {
  const float* w;
  int64_t K;
  using X = float;

  template <int RT, int NG>
  void dot(int64_t g, const float* x, int64_t ldx, Lanes::F (*acc)[NG * kHalves]) const {
    const float* wg = w + g * K * kGroup;
    for (int64_t k = 0; k < K; ++k) {
      Lanes::F wv[NG * kHalves];
      for (int j = 0; j < NG; ++j) {
        for (int h = 0; h < kHalves; ++h) wv[j * kHalves + h] = Lanes::load(wg + (j * K + k) * kGroup + h * Lanes::kLanes);
      }
      for (int r = 0; r < RT; ++r) {
        const Lanes::F xv = Lanes::set1(x[r * ldx + k]);
        for (int i = 0; i < NG * kHalves; ++i) acc[r][i] = Lanes::fmadd(wv[i], xv, acc[r][i]);
      }
    }
  }
};

// Rows [0, RT) of x against groups [g, g + NG): out rows get columns 16 g .. (at most N).
template <int RT, int NG, typename W, typename OT>
void tile(const W& w, int64_t g, const typename W::X* x, int64_t ldx, const float* bias, OT* out, int64_t N) {
  Lanes::F acc[RT][NG * kHalves];
  for (int r = 0; r < RT; ++r) {
    for (int i = 0; i < NG * kHalves; ++i) acc[r][i] = Lanes::zero();
  }
  w.template dot<RT, NG>(g, x, ldx, acc);
  float buf[Lanes::kLanes];
  for (int r = 0; r < RT; ++r) {
    for (int i = 0; i < NG * kHalves; ++i) {
      const int64_t n0 = g * kGroup + i * Lanes::kLanes;
      const int64_t cols = std::min<int64_t>(Lanes::kLanes, N - n0);
      if (cols <= 0) break;
      Lanes::store(buf, acc[r][i]);
      OT* o = out + r * N + n0;
      for (int64_t l = 0; l < cols; ++l) o[l] = static_cast<OT>(bias ? buf[l] + bias[n0 + l] : buf[l]);
    }
  }
}
#else
// The scalar loop: each output one sum over K in order (bf16 pairs: even channel, then odd).
struct Bf16Weights {
  const uint16_t* w;
  int64_t K;
  using X = uint16_t;
  float one(int64_t n, const uint16_t* x) const {
    const int64_t pairs = K / 2, g = n / kGroup, l = n % kGroup;
    const uint16_t* wg = w + g * pairs * 2 * kGroup + 2 * l;
    float acc = 0.f;
    for (int64_t p = 0; p < pairs; ++p) {
      acc = std::fma(bf16_to_float(wg[p * 2 * kGroup]), bf16_to_float(x[2 * p]), acc);
      acc = std::fma(bf16_to_float(wg[p * 2 * kGroup + 1]), bf16_to_float(x[2 * p + 1]), acc);
    }
    return acc;
  }
};
struct F32Weights {
  const float* w;
  int64_t K;
  using X = float;
  float one(int64_t n, const float* x) const {
    const float* wg = w + (n / kGroup) * K * kGroup + n % kGroup;
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc = std::fma(wg[k * kGroup], x[k], acc);
    return acc;
  }
};

template <int RT, int NG, typename W, typename OT>
void tile(const W& w, int64_t g, const typename W::X* x, int64_t ldx, const float* bias, OT* out, int64_t N) {
  for (int r = 0; r < RT; ++r) {
    for (int64_t n = g * kGroup; n < std::min(N, (g + NG) * kGroup); ++n) {
      const float v = w.one(n, x + r * ldx);
      out[r * N + n] = static_cast<OT>(bias ? v + bias[n] : v);
    }
  }
}
#endif

// Rows [0, M) against groups [g0, g1): the groups in chunks that stay in L2 while every tile of
// rows passes over them. Tiles: ceil(M / kRowTile) of them, as even as they go (earlier never larger).
template <typename W, typename OT>
void linear_groups(const W& w, const typename W::X* x, int64_t M, int64_t K, int64_t g0, int64_t g1,
                   const float* bias, OT* out, int64_t N, int64_t group_bytes) {
  const int64_t chunk = std::max<int64_t>(4, kChunkBytes / std::max<int64_t>(1, group_bytes));
  const int64_t tiles = (M + kRowTile - 1) / kRowTile;
  for (int64_t c0 = g0; c0 < g1; c0 += chunk) {
    const int64_t c1 = std::min(g1, c0 + chunk);
    for (int64_t t = 0, r0 = 0; t < tiles; ++t) {
      const int64_t rn = (M - r0) / (tiles - t);
      with_count<kRowTile>(rn, [&]<int RT>() {
        constexpr int NG = groups_per_tile(RT);
        for (int64_t g = c0; g < c1; g += NG) {
          with_count<NG>(c1 - g, [&]<int NGT>() {
            tile<RT, NGT>(w, g, x + r0 * K, K, bias, out + r0 * N, N);
          });
        }
      });
      r0 += rn;
    }
  }
}

// wp's sizes for N outputs over K inputs in `dtype`: [lead..., G, K/2, 16, 2] (bf16) or [lead..., G, K, 16].
std::vector<int64_t> packed_sizes(at::ScalarType dtype, std::vector<int64_t> lead, int64_t N, int64_t K) {
  lead.push_back((N + kGroup - 1) / kGroup);
  if (dtype == at::kBFloat16) {
    lead.insert(lead.end(), {K / 2, kGroup, 2});
  } else {
    lead.insert(lead.end(), {K, kGroup});
  }
  return lead;
}

// lead: wp's (and bias's) leading dims, {} for one weight, {E} for E weights.
void check_dense(const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias, int64_t N,
                 const std::vector<int64_t>& lead) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(wp, "wp");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, K], got sizes ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "x must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(wp.scalar_type() == x.scalar_type(), "wp (", wp.scalar_type(), ") must have x's dtype (",
              x.scalar_type(), ")");
  const int64_t K = x.size(1);
  TORCH_CHECK(N > 0 && K > 0, "N and K must be positive, got N = ", N, " and K = ", K);
  TORCH_CHECK(x.scalar_type() != at::kBFloat16 || K % 2 == 0, "a bf16 dense linear needs an even K, got ", K);
  const std::vector<int64_t> want = packed_sizes(x.scalar_type(), lead, N, K);
  TORCH_CHECK(wp.sizes() == at::IntArrayRef(want), "wp must be ", at::IntArrayRef(want), " for N = ", N, " and K = ",
              K, ", got sizes ", wp.sizes());
  if (bias) {
    check_cpu_contiguous(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == at::kFloat, "bias must be float32, got ", bias->scalar_type());
    std::vector<int64_t> bias_sizes = lead;
    bias_sizes.push_back(N);
    TORCH_CHECK(bias->sizes() == at::IntArrayRef(bias_sizes), "bias must be ", at::IntArrayRef(bias_sizes), ", got sizes ",
                bias->sizes());
  }
}

// Rows [r0, r1) of x against packed weight `index` (and bias row `index`).
struct Segment {
  int64_t r0, r1, index;
};

// x [M, K] against the segments' weights -> [M, N] in x's dtype. The work is (segment, group) units,
// each thread a run of them: ~even shares, at least 2 groups (a lone row's work is tiny).
at::Tensor run_segments(const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias, int64_t N,
                        const std::vector<Segment>& segments) {
  const int64_t M = x.size(0), K = x.size(1), G = (N + kGroup - 1) / kGroup;
  at::Tensor out = at::empty({M, N}, x.options());
  if (segments.empty()) return out;
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  const int64_t weight_elems = G * K * kGroup;  // per packed weight, bf16 or float32
  const int64_t group_bytes = K * kGroup * static_cast<int64_t>(x.element_size());
  const int64_t units = static_cast<int64_t>(segments.size()) * G;
  const int64_t grain = std::max<int64_t>(2, (units + at::get_num_threads() - 1) / at::get_num_threads());
  auto run = [&](auto make_weights, const auto* xp, auto* op) {
    at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
      for (int64_t s = u0 / G; s * G < u1; ++s) {
        const Segment& seg = segments[s];
        const int64_t g0 = std::max(u0, s * G) - s * G, g1 = std::min(u1, (s + 1) * G) - s * G;
        linear_groups(make_weights(seg.index), xp + seg.r0 * K, seg.r1 - seg.r0, K, g0, g1,
                      b ? b + seg.index * N : nullptr, op + seg.r0 * N, N, group_bytes);
      }
    });
  };
  if (x.scalar_type() == at::kBFloat16) {
    const auto* w = reinterpret_cast<const uint16_t*>(wp.data_ptr());
    run([&](int64_t e) { return Bf16Weights{w + e * weight_elems, K}; }, reinterpret_cast<const uint16_t*>(x.data_ptr()),
        out.data_ptr<at::BFloat16>());
  } else {
    const float* w = wp.data_ptr<float>();
    run([&](int64_t e) { return F32Weights{w + e * weight_elems, K}; }, x.data_ptr<float>(), out.data_ptr<float>());
  }
  return out;
}

// x [M, K] (bf16 or float32) @ packed weight of N rows^T (+ bias [N]) -> [M, N] in x's dtype.
at::Tensor dense_linear(at::Tensor x, at::Tensor wp, c10::optional<at::Tensor> bias, int64_t N) {
  check_dense(x, wp, bias, N, {});
  std::vector<Segment> segments;
  if (x.size(0) > 0) segments.push_back({0, x.size(0), 0});
  return run_segments(x, wp, bias, N, segments);
}

// x [M, K] with rows grouped by weight: rows [ends[e-1], ends[e]) (ends[-1] = 0) against packed weight
// e of wp [E, ...] (+ bias [E, N]) -> [M, N]: a mixture of experts' rows sorted by expert.
at::Tensor dense_grouped_linear(at::Tensor x, at::Tensor wp, at::Tensor ends, c10::optional<at::Tensor> bias,
                                int64_t N) {
  TORCH_CHECK(wp.dim() >= 1, "wp must be [E, ...], got sizes ", wp.sizes());
  const int64_t E = wp.size(0);
  check_dense(x, wp, bias, N, {E});
  const int64_t* end = index_data(ends, 1, "ends", "[E]");
  TORCH_CHECK(ends.size(0) == E, "ends must have one entry per weight (", E, "), got ", ends.size(0));
  std::vector<Segment> segments;
  for (int64_t e = 0, r0 = 0; e < E; r0 = end[e], ++e) {
    TORCH_CHECK(end[e] >= r0 && end[e] <= x.size(0), "ends must rise from 0 to the rows of x (", x.size(0), "), got ",
                end[e], " at ", e, " after ", r0);
    if (end[e] > r0) segments.push_back({r0, end[e], e});
  }
  TORCH_CHECK(E == 0 || end[E - 1] == x.size(0), "ends must end at the rows of x (", x.size(0), "), got ",
              E ? end[E - 1] : 0);
  return run_segments(x, wp, bias, N, segments);
}

}  // namespace

namespace strata_ops {  // ops.h: for the decode loop (decode_loop.cpp)
at::Tensor dense_linear(at::Tensor x, at::Tensor wp, c10::optional<at::Tensor> bias, int64_t N) {
  return ::dense_linear(x, wp, bias, N);
}
}  // namespace strata_ops

void register_dense_ops(pybind11::module_& m) {
  m.def("dense_grouped_linear", &dense_grouped_linear, pybind11::arg("x"), pybind11::arg("wp"), pybind11::arg("ends"),
        pybind11::arg("bias"), pybind11::arg("N"),
        "x [M, K] with rows grouped by weight (rows ends[e-1]:ends[e] take weight e of wp [E, ...]) -> [M, N]");
  m.def("dense_linear", &dense_linear, pybind11::arg("x"), pybind11::arg("wp"), pybind11::arg("bias"),
        pybind11::arg("N"),
        "x [M, K] @ packed bf16/float32 weight of N rows^T (+ float32 bias) -> [M, N]; each row's bits "
        "independent of the other rows");
}
