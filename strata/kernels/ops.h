// The kernels' entry points as another translation unit calls them (decode_loop.cpp): the same
// functions the Python module exposes, with the same argument checks. Each is defined in the file
// that owns the kernel (cpu_ops.cpp, attention_ops.cpp, quant_ops.cpp) as a forwarder to its implementation there.
#pragma once

#include <torch/extension.h>

#include <tuple>

namespace strata_ops {

at::Tensor q4_linear(at::Tensor x, at::Tensor qp, at::Tensor dp, at::Tensor mp, int64_t N);
at::Tensor q8_linear(at::Tensor x, at::Tensor qp, at::Tensor dp, int64_t N);
at::Tensor dense_linear(at::Tensor x, at::Tensor wp, c10::optional<at::Tensor> bias, int64_t N);
void store_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor out_slots);
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor page_table,
                     at::Tensor owner, at::Tensor positions, int64_t page_size, double scale, int64_t window,
                     double softcap, c10::optional<at::Tensor> sinks);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_embedding(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin, at::Tensor positions);
at::Tensor silu_and_mul(at::Tensor gate_up);

}  // namespace strata_ops
