// What the kernel files (cpu_ops.cpp, attention_ops.cpp) share: float conversions and the argument
// checks every entry point runs before it touches a data pointer.
//
// Everything is in an unnamed namespace, as in simd.h: each translation unit gets its own copy.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace {

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }

template <typename T>
inline float rounded(float v) { return static_cast<float>(static_cast<T>(v)); }

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// f.template operator()<N>() with N = n, for 1 <= n <= Max (n past Max: Max): a run-time count as a
// template argument, for the kernels whose accumulators are register arrays of that size.
template <int Max, typename F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (Max > 1) {
    if (n < Max) return with_count<Max - 1>(n, f);
  }
  f.template operator()<Max>();
}

// ---------------------------------------------------------------------------------------------
// Argument checks. Every entry point checks the dtypes, devices, layouts and sizes of its tensors
// and every index it will follow (slots, page-table entries, positions, token ranges) before any
// pointer arithmetic, so bad metadata raises a RuntimeError that names the argument, the bad value
// and the valid range instead of reading or writing out of bounds. They take one pass over the
// index tensors and sit outside the ISA-specific code, so every build and path is covered.
// ---------------------------------------------------------------------------------------------
inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
}

inline void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous, got sizes ", t.sizes(), " with strides ", t.strides());
}

// The dtypes the kernels are compiled for (AT_DISPATCH_FLOATING_TYPES_AND2(kBFloat16, kHalf, ...)).
inline void check_float(const at::Tensor& t, const char* name) {
  const at::ScalarType dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble, name,
              " must be float32, bfloat16, float16 or float64, got ", dtype);
}

// [tokens, heads, head_dim] floats with each token's heads contiguous; tokens may be strided (views
// of a fused qkv projection).
inline void check_token_rows(const at::Tensor& t, const char* name) {
  check_cpu(t, name);
  check_float(t, name);
  TORCH_CHECK(t.dim() == 3, name, " must be [tokens, heads, head_dim], got sizes ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), name,
              " must have each token's heads contiguous, got sizes ", t.sizes(), " with strides ", t.strides());
}

// A contiguous int64 CPU tensor of `dim` dims (`shape` names them for the message); returns its data.
inline const int64_t* index_data(const at::Tensor& t, int64_t dim, const char* name, const char* shape) {
  check_cpu_contiguous(t, name);
  TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must be ", shape, ", got sizes ", t.sizes());
  return t.data_ptr<int64_t>();
}

}  // namespace
