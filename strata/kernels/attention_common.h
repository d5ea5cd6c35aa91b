// What the attention kernels (attention_ops.cpp: decode; extend_attention.cpp: prefill) share: the
// argument checks of their entry points and the layer options' arithmetic.
//
// Everything is in an unnamed namespace, as in common.h: each translation unit gets its own copy.
#pragma once

#include <torch/extension.h>

#include "common.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

// The two caches: [slots, kv_heads, head_dim] float, contiguous, alike.
void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  check_cpu_contiguous(k_cache, "k_cache");
  check_cpu_contiguous(v_cache, "v_cache");
  check_float(k_cache, "k_cache");
  TORCH_CHECK(k_cache.dim() == 3, "k_cache must be [slots, kv_heads, head_dim], got sizes ", k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(), "v_cache (",
              v_cache.sizes(), ", ", v_cache.scalar_type(), ") must match k_cache (", k_cache.sizes(), ", ",
              k_cache.scalar_type(), ")");
}

// Keys a page-table row of `pages_per_row` pages holds (saturating instead of overflowing).
int64_t key_capacity(int64_t pages_per_row, int64_t page_size) {
  if (pages_per_row > 0 && page_size > std::numeric_limits<int64_t>::max() / pages_per_row) {
    return std::numeric_limits<int64_t>::max();
  }
  return pages_per_row * page_size;
}

// Keys first_key .. end_key - 1 of page-table row b are read from pages
// row[first_key / page_size .. ceil(end_key / page_size)): each must be one of the pool's num_pages
// pages (0 <= first_key and end_key <= key_capacity are the caller's checks). Pages before
// first_key (behind a sliding window) are not read, so their entries may be anything.
void check_pages_read(const int64_t* page_table, int64_t pages_per_row, int64_t b, int64_t first_key, int64_t end_key,
                      int64_t page_size, int64_t num_pages) {
  const int64_t* row = page_table + b * pages_per_row;
  const int64_t used = end_key <= first_key ? 0 : (end_key - 1) / page_size + 1;
  for (int64_t i = first_key / page_size; i < used; ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < num_pages, "page_table[", b, "][", i, "] = ", row[i],
                " is outside the KV pool's pages [0, ", num_pages, ") (read for the request's keys [", first_key,
                ", ", end_key, "))");
  }
}

// The layer options both attention kernels take: window (keys a query sees, itself included; <= 0:
// all), softcap (scores become softcap * tanh(scores / softcap); 0: off), sinks (float32 [H], one
// logit per query head that joins every softmax with no value row; None: none). Returns the sinks'
// data or nullptr.
const float* check_layer_options(int64_t H, double softcap, const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(softcap >= 0 && std::isfinite(softcap), "softcap must be finite and >= 0 (0: off), got ", softcap);
  if (!sinks.has_value()) return nullptr;
  check_cpu_contiguous(*sinks, "sinks");
  TORCH_CHECK(sinks->scalar_type() == at::kFloat, "sinks must be float32, got ", sinks->scalar_type());
  TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == H, "sinks must be [heads = ", H, "], got sizes ", sinks->sizes());
  return sinks->data_ptr<float>();
}

// The first key a query at `pos` sees.
inline int64_t window_start(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}


// What both attention entry points take: q [T, H, D] (token rows), out [T, H, D] contiguous in q's
// dtype, the two caches [slots, Hkv, D] alike, H a multiple of Hkv, an int64 page table
// [requests, max_pages], page_size >= 1. Returns the pool's pages, slots / page_size (the pool is
// num_pages * page_size slots, strata.cache.kv_pool).
int64_t check_attention_io(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& page_table, int64_t page_size) {
  check_token_rows(q, "q");
  check_cpu_contiguous(out, "out");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(), "out (", out.sizes(), ", ",
              out.scalar_type(), ") must match q (", q.sizes(), ", ", q.scalar_type(), ")");
  check_caches(k_cache, v_cache);
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D, "the caches' head_dim (", k_cache.size(2), ") must be q's (", D, ")");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "q's ", H, " heads must be a multiple of the caches' ", Hkv, " KV heads");
  index_data(page_table, 2, "page_table", "[requests, max_pages]");
  TORCH_CHECK(page_size >= 1, "page_size must be at least 1, got ", page_size);
  return k_cache.size(0) / page_size;
}


#if defined(STRATA_SIMD16)
// cap * tanh(x / cap), with tanh(y) = 1 - 2 / (exp(2y) + 1) (exp16 saturates: +-1 at the ends).
inline V16 softcap16(V16 x, float cap) {
  const V16 e = exp16(vmul(x, vset1(2.f / cap)));
  return vmul(vset1(cap), vsub(vset1(1.f), vdiv(vset1(2.f), vadd(e, vset1(1.f)))));
}
#endif

}  // namespace
