// CPU kernels for the elementwise ops of a forward step: residual add + RMSNorm, rotary embedding in
// place, SiLU(gate) * up, each row's argmax (greedy sampling); and the Python module that registers
// every kernel file's entry points (attention_ops.cpp: the K/V store and decode attention;
// extend_attention.cpp: prefill attention; quant_ops.cpp: block-quantized matmuls; decode_loop.cpp:
// the native layer loop).
//
// The kernels reproduce the rounding of the PyTorch code they replace (RMSNorm.reference,
// RotaryEmbedding.reference, the MLP's silu * up): values are computed in float and rounded to the
// tensor's dtype wherever the PyTorch version materialises an intermediate, so the two agree to the
// last bit in most elements (exp may differ by an ulp).
//
// The SIMD paths are written once against the 16-float vector of simd.h (one __m512 with AVX-512,
// two __m256 with AVX2 + FMA + F16C) under STRATA_SIMD16; the scalar loops are the fallback and
// the reference.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "common.h"
#include "ops.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// RMSNorm: out = w * dtype(x * rsqrt(mean(x^2) + eps)), with an optional residual added first
// (residual <- x + residual, in the residual's dtype, and the sum is what is normalised).
// ---------------------------------------------------------------------------------------------
// One row: [residual_out = x + residual;] out = w * round(v * rsqrt(mean(v^2) + eps)), v the (summed) row.
template <typename T>
void rms_norm_row(const T* x, const T* res, T* res_out, const T* w, T* out, int64_t n, float eps, float* buf) {
  int64_t i = 0;
  float ss = 0.f;
#if defined(STRATA_SIMD16)
  if constexpr (kHasLoad16<T>) {
    V16 acc = vzero();
    for (; i + 16 <= n; i += 16) {
      V16 v = load16(x + i);
      if (res) {
        v = round16<T>(vadd(v, load16(res + i)));
        store16(res_out + i, v);
      }
      store16(buf + i, v);
      acc = vfmadd(v, v, acc);
    }
    ss = reduce_add(acc);
  }
#endif
  for (; i < n; ++i) {
    float v = to_f(x[i]);
    if (res) {
      v = rounded<T>(v + to_f(res[i]));
      res_out[i] = round_to<T>(v);
    }
    buf[i] = v;
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  i = 0;
#if defined(STRATA_SIMD16)
  if constexpr (kHasLoad16<T>) {
    const V16 vinv = vset1(inv);
    for (; i + 16 <= n; i += 16) {
      const V16 normed = round16<T>(vmul(load16(buf + i), vinv));
      store16(out + i, vmul(load16(w + i), normed));
    }
  }
#endif
  for (; i < n; ++i) out[i] = round_to<T>(to_f(w[i]) * rounded<T>(buf[i] * inv));
}

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor* residual_in,
                   at::Tensor* residual_out, const at::Tensor& weight, double eps) {
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  const T* xp = x.data_ptr<T>();
  const T* rp = residual_in ? residual_in->data_ptr<T>() : nullptr;
  T* ro = residual_out ? residual_out->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    for (int64_t r = begin; r < end; ++r) {
      rms_norm_row<T>(xp + r * n, rp ? rp + r * n : nullptr, ro ? ro + r * n : nullptr, wp, op + r * n, n,
                      static_cast<float>(eps), buf.data());
    }
  });
}

// x [..., hidden] and weight [hidden]: contiguous CPU tensors of one float dtype.
void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  check_cpu_contiguous(x, "x");
  check_float(x, "x");
  TORCH_CHECK(x.dim() >= 1, "x must be [..., hidden], got a 0-dim tensor");
  check_cpu_contiguous(weight, "weight");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "weight must be [hidden = ", x.size(-1),
              "] (x's last dim), got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight (", weight.scalar_type(), ") and x (", x.scalar_type(),
              ") must share a dtype");
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_norm_args(x, weight);
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(out, x, nullptr, nullptr, weight, eps);
  });
  return out;
}

// Returns (norm(x + residual), x + residual).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_norm_args(x, weight);
  check_cpu_contiguous(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "residual (",
              residual.sizes(), ", ", residual.scalar_type(), ") must match x (", x.sizes(), ", ", x.scalar_type(),
              ")");
  auto out = at::empty_like(x);
  auto sum = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_impl<scalar_t>(out, x, &residual, &sum, weight, eps);
  });
  return {out, sum};
}

// ---------------------------------------------------------------------------------------------
// Rotary embedding in place on q [T, H, D] and k [T, Hkv, D] ("rotate_half" layout, the first
// rot_dim dims rotate). cos/sin: float tables [max_positions, rot_dim], rounded to the q dtype
// first like the PyTorch version (once per token, into c / s, shared by its q and k heads).
// ---------------------------------------------------------------------------------------------
template <typename T>
void rope_rows(T* x, int64_t heads, int64_t D, int64_t rot, const float* c, const float* s) {  // c, s rounded
  const int64_t half = rot / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* row = x + h * D;
    int64_t i = 0;
#if defined(STRATA_SIMD16)
    if constexpr (kHasLoad16<T>) {  // the same roundings as below, 16 pairs at a time
      for (; i + 16 <= half; i += 16) {
        const V16 x1 = load16(row + i), x2 = load16(row + i + half);
        const V16 c1 = load16(c + i), s1 = load16(s + i);
        const V16 c2 = load16(c + i + half), s2 = load16(s + i + half);
        // round(-x2 * s1) = -round(x2 * s1) (rounding to nearest even is symmetric), and p + -q = p - q
        const V16 a = vsub(round16<T>(vmul(x1, c1)), round16<T>(vmul(x2, s1)));
        const V16 b = vadd(round16<T>(vmul(x2, c2)), round16<T>(vmul(x1, s2)));
        store16(row + i, a);
        store16(row + i + half, b);
      }
    }
#endif
    for (; i < half; ++i) {
      const float x1 = to_f(row[i]), x2 = to_f(row[i + half]);
      const float c1 = c[i], s1 = s[i], c2 = c[i + half], s2 = s[i + half];
      const float a = rounded<T>(x1 * c1) + rounded<T>(-x2 * s1);
      const float b = rounded<T>(x2 * c2) + rounded<T>(x1 * s2);
      row[i] = round_to<T>(a);
      row[i + half] = round_to<T>(b);
    }
  }
}

void rotary_embedding(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin, at::Tensor positions) {
  check_token_rows(q, "q");
  check_token_rows(k, "k");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "k (", k.scalar_type(), ") and q (", q.scalar_type(),
              ") must share a dtype");
  check_cpu_contiguous(cos, "cos");
  check_cpu_contiguous(sin, "sin");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "cos/sin must be float32, got ",
              cos.scalar_type(), "/", sin.scalar_type());
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes(), "cos and sin must be [max_positions, rot_dim] alike, got ",
              cos.sizes(), " and ", sin.sizes());
  const int64_t T = q.size(0), H = q.size(1), Hkv = k.size(1), D = q.size(2), rot = cos.size(1);
  const int64_t qs = q.stride(0), ks = k.stride(0);
  TORCH_CHECK(k.size(0) == T && k.size(2) == D, "k ", k.sizes(), " must be [tokens = ", T, ", kv_heads, head_dim = ", D,
              "] like q");
  TORCH_CHECK(rot <= D && rot % 2 == 0, "rotary dim (", rot, ") must be even and at most head_dim (", D, ")");
  const int64_t* pos = index_data(positions, 1, "positions", "[tokens]");
  TORCH_CHECK(positions.numel() == T, "positions has ", positions.numel(), " entries for ", T, " tokens");
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "positions[", t, "] = ", pos[t],
                " is outside the rotary table [0, ", cos.size(0), ")");
  }
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_embedding", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> cs(2 * rot);
      float* c = cs.data();
      float* s = c + rot;
      for (int64_t t = begin; t < end; ++t) {
        const float* ct = cp + pos[t] * rot;
        const float* st = sp + pos[t] * rot;
        for (int64_t i = 0; i < rot; ++i) {
          c[i] = rounded<scalar_t>(ct[i]);
          s[i] = rounded<scalar_t>(st[i]);
        }
        rope_rows<scalar_t>(qp + t * qs, H, D, rot, c, s);
        rope_rows<scalar_t>(kp + t * ks, Hkv, D, rot, c, s);
      }
    });
  });
}

// ---------------------------------------------------------------------------------------------
// SiLU(gate) * up for gate_up [..., 2I] -> [..., I].
// ---------------------------------------------------------------------------------------------
template <typename T>
void silu_and_mul_row(const T* g, const T* u, T* o, int64_t I) {
  int64_t i = 0;
#if defined(STRATA_SIMD16)
  if constexpr (kHasLoad16<T>) {
    for (; i + 16 <= I; i += 16) {
      const V16 x = load16(g + i);
      const V16 e = exp16(vsub(vzero(), x));
      const V16 act = round16<T>(vdiv(x, vadd(vset1(1.f), e)));
      store16(o + i, vmul(act, load16(u + i)));
    }
  }
#endif
  for (; i < I; ++i) {
    const float x = to_f(g[i]);
    const float act = rounded<T>(x / (1.f + std::exp(-x)));
    o[i] = round_to<T>(act * to_f(u[i]));
  }
}

at::Tensor silu_and_mul(at::Tensor gate_up) {
  check_cpu_contiguous(gate_up, "gate_up");
  check_float(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "gate_up must be [..., 2 * intermediate], got sizes ",
              gate_up.sizes());
  const int64_t I = gate_up.size(-1) / 2, rows = I == 0 ? 0 : gate_up.numel() / (2 * I);
  std::vector<int64_t> out_sizes = gate_up.sizes().vec();
  out_sizes.back() = I;
  auto out = at::empty(out_sizes, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    using T = scalar_t;
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* g = gp + r * 2 * I;
        const T* u = g + I;
        silu_and_mul_row<T>(g, u, op + r * I, I);
      }
    });
  });
  return out;
}

// Argmax of each row, as torch.argmax: the first NaN if the row has one, else the first maximum.
// Greedy sampling takes one per sampled row of the vocabulary's logits; PyTorch's reduction reads
// them one at a time (~80 us for a 49,152-entry row on Zen 4). Here a row is read 256 at a time by
// vector maxima, keeping the first chunk whose maximum is larger than every chunk's before it (max
// is exact, so the order within a chunk does not matter), and only that chunk is searched for the
// first index holding it. Infinities (a grammar's or a ban's -inf) need nothing more; a row with a
// NaN takes the scalar loop.
// ---------------------------------------------------------------------------------------------
int64_t argmax_scalar(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

int64_t argmax_row(const float* x, int64_t n) {
#if defined(STRATA_SIMD16)
  constexpr int64_t kChunk = 256;
  if (n >= kChunk) {
    float best = 0.f;
    int64_t best_chunk = -1;
    V16 nans = vzero();  // 1 per NaN seen (a NaN is not <= itself)
    const V16 zero = vzero(), one = vset1(1.f);
    const int64_t chunks = n / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      const float* p = x + c * kChunk;
      V16 m = load16(p);
      nans = vadd(nans, vselect(vle(m, m), zero, one));
      for (int64_t i = 16; i < kChunk; i += 16) {
        const V16 v = load16(p + i);
        m = vmax(m, v);
        nans = vadd(nans, vselect(vle(v, v), zero, one));
      }
      const float top = reduce_max(m);
      if (best_chunk < 0 || top > best) best = top, best_chunk = c;
    }
    if (reduce_add(nans) != 0.f) return argmax_scalar(x, n);
    int64_t at = best_chunk * kChunk;
    while (x[at] != best) ++at;  // the chunk holds it
    for (int64_t i = chunks * kChunk; i < n; ++i) {  // the tail
      if (std::isnan(x[i])) return i;
      if (x[i] > best) best = x[i], at = i;
    }
    return at;
  }
#endif
  return argmax_scalar(x, n);
}

at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor, got one on ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && (x.size(0) <= 1 || x.stride(0) >= x.size(1)) && x.stride(1) == 1,
              "x must be [rows, n > 0] with each row contiguous, got sizes ", x.sizes(), " and strides ", x.strides());
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * stride, n);
  });
  return out;
}

}  // namespace

namespace strata_ops {  // ops.h: for the decode loop (decode_loop.cpp)
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) { return ::rms_norm(x, weight, eps); }
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  return ::add_rms_norm(x, residual, weight, eps);
}
void rotary_embedding(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin, at::Tensor positions) {
  ::rotary_embedding(q, k, cos, sin, positions);
}
at::Tensor silu_and_mul(at::Tensor gate_up) { return ::silu_and_mul(gate_up); }
}  // namespace strata_ops

void register_attention_ops(pybind11::module_& m);  // attention_ops.cpp
void register_extend_attention(pybind11::module_& m);  // extend_attention.cpp
void register_quant_ops(pybind11::module_& m);  // quant_ops.cpp
void register_decode_loop(pybind11::module_& m);  // decode_loop.cpp
void register_dense_ops(pybind11::module_& m);  // dense_ops.cpp
void register_lora_ops(pybind11::module_& m);  // lora_ops.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_attention_ops(m);
  register_extend_attention(m);
  register_quant_ops(m);
  register_decode_loop(m);
  register_dense_ops(m);
  register_lora_ops(m);
  m.def("has_avx512", [] {
#if defined(__AVX512F__)
    return true;
#else
    return false;
#endif
  });
  // Whether the kernels have their SIMD paths (AVX2 + FMA + F16C or AVX-512): extend_attention
  // needs them; the other kernels fall back to scalar loops without.
  m.def("has_simd", [] {
#if defined(STRATA_SIMD16)
    return true;
#else
    return false;
#endif
  });
  // Floats per vector register the SIMD paths use: 16 (AVX-512), 8 (AVX2) or 1 (scalar only).
  m.def("simd_width", [] {
#if defined(STRATA_SIMD16)
    return kSimdWidth;
#else
    return 1;
#endif
  });
  // The instruction-set extensions this build was compiled for (from the compiler's macros).
  m.def("compiled_isa", [] {
    std::vector<std::string> isa;
#if defined(__AVX2__)
    isa.push_back("avx2");
#endif
#if defined(__FMA__)
    isa.push_back("fma");
#endif
#if defined(__F16C__)
    isa.push_back("f16c");
#endif
#if defined(__AVX512F__)
    isa.push_back("avx512f");
#endif
#if defined(__AVX512BW__)
    isa.push_back("avx512bw");
#endif
#if defined(__AVX512VL__)
    isa.push_back("avx512vl");
#endif
#if defined(__AVX512BF16__)
    isa.push_back("avx512bf16");
#endif
#if defined(__AVX512VNNI__)
    isa.push_back("avx512vnni");
#endif
#if defined(__AVXVNNI__)
    isa.push_back("avxvnni");
#endif
#if defined(__AMX_TILE__)
    isa.push_back("amx_tile");
#endif
#if defined(__AMX_INT8__)
    isa.push_back("amx_int8");
#endif
#if defined(__AMX_BF16__)
    isa.push_back("amx_bf16");
#endif
    return isa;
  });
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rotary_embedding", &rotary_embedding);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("argmax_rows", &argmax_rows, "x [rows, n] float32 -> each row's argmax (torch.argmax's)");
}
