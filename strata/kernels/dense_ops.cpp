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

void check_dense(const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias, int64_t N) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(wp, "wp");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, K], got sizes ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "x must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(wp.scalar_type() == x.scalar_type(), "wp (", wp.scalar_type(), ") must have x's dtype (",
              x.scalar_type(), ")");
  const int64_t K = x.size(1);
  TORCH_CHECK(N > 0, "N must be positive, got ", N);
  const int64_t G = (N + kGroup - 1) / kGroup;
  if (x.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(K % 2 == 0, "a bf16 dense linear needs an even K, got ", K);
    TORCH_CHECK(wp.sizes() == at::IntArrayRef({G, K / 2, kGroup, 2}), "wp must be [", G, ", ", K / 2, ", 16, 2] for N = ",
                N, " and K = ", K, ", got sizes ", wp.sizes());
  } else {
    TORCH_CHECK(wp.sizes() == at::IntArrayRef({G, K, kGroup}), "wp must be [", G, ", ", K, ", 16] for N = ", N,
                " and K = ", K, ", got sizes ", wp.sizes());
  }
  if (bias) {
    check_cpu_contiguous(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == at::kFloat, "bias must be float32, got ", bias->scalar_type());
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must be [", N, "], got sizes ", bias->sizes());
  }
}

// x [M, K] (bf16 or float32) @ packed weight of N rows^T (+ bias) -> [M, N] in x's dtype.
at::Tensor dense_linear(at::Tensor x, at::Tensor wp, c10::optional<at::Tensor> bias, int64_t N) {
  check_dense(x, wp, bias, N);
  const int64_t M = x.size(0), K = x.size(1), G = wp.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  if (K == 0) return bias ? bias->to(x.scalar_type()).expand({M, N}).contiguous() : out.zero_();
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  const int64_t group_bytes = K * kGroup * static_cast<int64_t>(x.element_size());
  // each thread a run of whole groups: ~even shares, at least 2 groups (a lone row's work is tiny)
  const int64_t grain = std::max<int64_t>(2, (G + at::get_num_threads() - 1) / at::get_num_threads());
  auto run = [&](const auto& w, const auto* xp, auto* op) {
    at::parallel_for(0, G, grain, [&](int64_t g0, int64_t g1) { linear_groups(w, xp, M, K, g0, g1, b, op, N, group_bytes); });
  };
  if (x.scalar_type() == at::kBFloat16) {
    run(Bf16Weights{reinterpret_cast<const uint16_t*>(wp.data_ptr()), K}, reinterpret_cast<const uint16_t*>(x.data_ptr()),
        out.data_ptr<at::BFloat16>());
  } else {
    run(F32Weights{wp.data_ptr<float>(), K}, x.data_ptr<float>(), out.data_ptr<float>());
  }
  return out;
}

}  // namespace

namespace strata_ops {  // ops.h: for the decode loop (decode_loop.cpp)
at::Tensor dense_linear(at::Tensor x, at::Tensor wp, c10::optional<at::Tensor> bias, int64_t N) {
  return ::dense_linear(x, wp, bias, N);
}
}  // namespace strata_ops

void register_dense_ops(pybind11::module_& m) {
  m.def("dense_linear", &dense_linear, pybind11::arg("x"), pybind11::arg("wp"), pybind11::arg("bias"),
        pybind11::arg("N"),
        "x [M, K] @ packed bf16/float32 weight of N rows^T (+ float32 bias) -> [M, N]; each row's bits "
        "independent of the other rows");
}
