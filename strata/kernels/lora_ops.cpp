// LoRA deltas on the rows of a step that use adapters (strata/layers/lora.py's LoRALinear, and the
// decode loop's linears): for each adapter present, y[row] += (x[row] @ A^T) @ (B * scale)^T on
// its own rows only, reading each adapter's weights where they were loaded (no per-step copies).
//
// Decode steps make this a memory-bound product: a row under an adapter reads that adapter's A and
// B once per linear (rank 16 on every projection of SmolLM2-135M: ~10 MB in bf16 per adapter and
// step), and does ~2 multiply-adds per weight read. So the kernel reads each weight once per step:
//
//   1. xa = A @ x for every row of the adapter's segment, one A row at a time (the segment's x rows
//      stay in cache), spread over (segment, A row) pairs;
//   2. y[:, o0:o1] += xa[:, r0:r1] @ bt per part, in column chunks of kChunk: a chunk's [r, kChunk]
//      slice of bt is read from memory once and reused from L1 for the segment's other rows; spread
//      over (segment, part, chunk) triples. Segments own disjoint rows and parts disjoint columns,
//      so no two threads write one element.
//
// Sums are float32; each y element is rounded once (y + delta), where the PyTorch path rounds the
// delta to y's dtype before adding it.
#include "lora.h"

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common.h"
#include "simd.h"

namespace strata_ops {

namespace {

constexpr int64_t kChunk = 64;  // output columns per phase-2 work item
constexpr int64_t kMaxSlots = 4096;

void check_weight(const at::Tensor& t, const char* name) {
  check_cpu_contiguous(t, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D, got sizes ", t.sizes());
}

// out[q * stride] = a . x_q over n elements for the N rows x_q = x + rows[q] * n, summed in float32
// (N independent accumulators, so the FMAs do not wait on each other; a lone row gets four).
template <int N, typename W, typename T>
inline void dots(const W* a, const T* x, const int64_t* rows, int64_t n, float* out, int64_t stride) {
  int64_t i = 0;
  float sum[N] = {};
#if defined(STRATA_SIMD16)
  if constexpr (kHasLoad16<T>) {
    if constexpr (N == 1) {
      const T* xr = x + rows[0] * n;
      V16 acc[4] = {vzero(), vzero(), vzero(), vzero()};
      for (; i + 64 <= n; i += 64) {
        for (int u = 0; u < 4; ++u) acc[u] = vfmadd(load16(a + i + 16 * u), load16(xr + i + 16 * u), acc[u]);
      }
      for (; i + 16 <= n; i += 16) acc[0] = vfmadd(load16(a + i), load16(xr + i), acc[0]);
      sum[0] = reduce_add(vadd(vadd(acc[0], acc[1]), vadd(acc[2], acc[3])));
    } else {
      V16 acc[N];
      for (int q = 0; q < N; ++q) acc[q] = vzero();
      for (; i + 16 <= n; i += 16) {
        const V16 va = load16(a + i);
        for (int q = 0; q < N; ++q) acc[q] = vfmadd(va, load16(x + rows[q] * n + i), acc[q]);
      }
      for (int q = 0; q < N; ++q) sum[q] = reduce_add(acc[q]);
    }
  }
#endif
  for (int q = 0; q < N; ++q) {
    const T* xr = x + rows[q] * n;
    for (int64_t k = i; k < n; ++k) sum[q] += to_f(a[k]) * to_f(xr[k]);
    out[q * stride] = sum[q];
  }
}

// y[c0:c1] += sum_k xa[k] * bt[k][c0:c1] for k < r (bt's rows `ld` apart), one rounding per element.
// Four column vectors at a time: four independent FMA chains over k.
template <typename W, typename T>
inline void add_columns(T* y, const float* xa, const W* bt, int64_t ld, int64_t r, int64_t c0, int64_t c1) {
  int64_t c = c0;
#if defined(STRATA_SIMD16)
  if constexpr (kHasLoad16<T>) {
    for (; c + 64 <= c1; c += 64) {
      V16 acc[4] = {vzero(), vzero(), vzero(), vzero()};
      for (int64_t k = 0; k < r; ++k) {
        const V16 xk = vset1(xa[k]);
        const W* b = bt + k * ld + c;
        for (int u = 0; u < 4; ++u) acc[u] = vfmadd(xk, load16(b + 16 * u), acc[u]);
      }
      for (int u = 0; u < 4; ++u) store16(y + c + 16 * u, vadd(load16(y + c + 16 * u), acc[u]));
    }
    for (; c + 16 <= c1; c += 16) {
      V16 acc = vzero();
      for (int64_t k = 0; k < r; ++k) acc = vfmadd(vset1(xa[k]), load16(bt + k * ld + c), acc);
      store16(y + c, vadd(load16(y + c), acc));
    }
  }
#endif
  for (; c < c1; ++c) {
    float acc = 0.f;
    for (int64_t k = 0; k < r; ++k) acc += xa[k] * to_f(bt[k * ld + c]);
    y[c] = round_to<T>(to_f(y[c]) + acc);
  }
}

struct Segment {
  const LoRADelta* delta;
  const int64_t* rows;
  int64_t n;       // rows
  int64_t xa_off;  // where its [n, R] xa block starts
};

template <typename W, typename T>
void apply_typed(const std::vector<Segment>& segs, T* y, int64_t y_ld, const T* x, int64_t in, float* xa) {
  std::vector<std::pair<int64_t, int64_t>> rank_items;      // (segment, A row)
  std::vector<std::tuple<int64_t, int64_t, int64_t>> cols;  // (segment, part, first column)
  for (int64_t s = 0; s < static_cast<int64_t>(segs.size()); ++s) {
    const LoRADelta& d = *segs[s].delta;
    for (int64_t k = 0; k < d.a.size(0); ++k) rank_items.emplace_back(s, k);
    for (int64_t p = 0; p < static_cast<int64_t>(d.parts.size()); ++p) {
      for (int64_t c = d.parts[p].o0; c < d.parts[p].o1; c += kChunk) cols.emplace_back(s, p, c);
    }
  }
  at::parallel_for(0, static_cast<int64_t>(rank_items.size()), 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [s, k] = rank_items[i];
      const Segment& seg = segs[s];
      const int64_t R = seg.delta->a.size(0);
      const W* a = seg.delta->a.data_ptr<W>() + k * in;
      for (int64_t j = 0; j < seg.n; j += 4) {
        with_count<4>(seg.n - j, [&]<int N>() { dots<N>(a, x, seg.rows + j, in, xa + seg.xa_off + j * R + k, R); });
      }
    }
  });
  at::parallel_for(0, static_cast<int64_t>(cols.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [s, p, c0] = cols[i];
      const Segment& seg = segs[s];
      const LoRAPart& part = seg.delta->parts[p];
      const int64_t R = seg.delta->a.size(0), ld = part.o1 - part.o0;
      const int64_t c1 = std::min(c0 + kChunk, part.o1);
      const W* bt = part.bt.data_ptr<W>();
      for (int64_t j = 0; j < seg.n; ++j) {
        // columns of bt are relative to the part; of y, absolute
        add_columns(y + seg.rows[j] * y_ld + part.o0, xa + seg.xa_off + j * R + part.r0, bt, ld, part.r1 - part.r0,
                    c0 - part.o0, c1 - part.o0);
      }
    }
  });
}

}  // namespace

LoRATable::LoRATable(int64_t num_modules) : num_modules_(num_modules) {
  TORCH_CHECK(num_modules > 0, "a LoRA table needs at least one adapted linear, got ", num_modules);
}

void LoRATable::set(int64_t slot, int64_t module, at::Tensor a,
                    const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, at::Tensor>>& parts) {
  TORCH_CHECK(slot >= 0 && slot < kMaxSlots, "slot must be in [0, ", kMaxSlots, "), got ", slot);
  TORCH_CHECK(module >= 0 && module < num_modules_, "module must be in [0, ", num_modules_, "), got ", module);
  check_weight(a, "a");
  const int64_t R = a.size(0);
  LoRADelta delta{a, {}};
  for (const auto& [o0, o1, r0, r1, bt] : parts) {
    check_weight(bt, "bt");
    TORCH_CHECK(bt.scalar_type() == a.scalar_type(), "bt must have a's dtype ", a.scalar_type(), ", got ",
                bt.scalar_type());
    TORCH_CHECK(0 <= o0 && o0 < o1, "a part's columns [", o0, ", ", o1, ") are empty or negative");
    TORCH_CHECK(0 <= r0 && r0 < r1 && r1 <= R, "a part's A rows [", r0, ", ", r1, ") must lie in [0, ", R, ")");
    TORCH_CHECK(bt.size(0) == r1 - r0 && bt.size(1) == o1 - o0, "bt must be [", r1 - r0, ", ", o1 - o0,
                "], got sizes ", bt.sizes());
    for (const LoRAPart& other : delta.parts) {
      TORCH_CHECK(o1 <= other.o0 || other.o1 <= o0, "parts [", o0, ", ", o1, ") and [", other.o0, ", ", other.o1,
                  ") overlap");
    }
    delta.parts.push_back({o0, o1, r0, r1, bt});
  }
  if (static_cast<int64_t>(slots_.size()) <= slot) {
    slots_.resize(slot + 1);
    loaded_.resize(slot + 1, false);
  }
  if (slots_[slot].empty()) slots_[slot].resize(num_modules_);
  slots_[slot][module] = std::move(delta);
  loaded_[slot] = true;
}

void LoRATable::clear(int64_t slot) {
  TORCH_CHECK(slot >= 0 && slot < kMaxSlots, "slot must be in [0, ", kMaxSlots, "), got ", slot);
  if (slot < static_cast<int64_t>(slots_.size())) {
    slots_[slot].clear();
    slots_[slot].shrink_to_fit();
    loaded_[slot] = false;
  }
}

void LoRATable::apply(int64_t module, at::Tensor y, const at::Tensor& x, const at::Tensor& rows,
                      const at::Tensor& seg_off, const at::Tensor& seg_slot) const {
  TORCH_CHECK(module >= 0 && module < num_modules_, "module must be in [0, ", num_modules_, "), got ", module);
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(y, "y");
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "x and y must be [tokens, features], got ",
              x.sizes(), " and ", y.sizes());
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "x and y must have one dtype, got ", x.scalar_type(), " and ",
              y.scalar_type());
  const int64_t T = x.size(0), in = x.size(1);
  const int64_t* row = index_data(rows, 1, "rows", "[rows]");
  const int64_t* off = index_data(seg_off, 1, "seg_off", "[segments + 1]");
  const int64_t* slot = index_data(seg_slot, 1, "seg_slot", "[segments]");
  const int64_t S = seg_slot.numel(), N = rows.numel();
  TORCH_CHECK(seg_off.numel() == S + 1, "seg_off must have one entry more than seg_slot (", S + 1, "), got ",
              seg_off.numel());
  TORCH_CHECK(off[0] == 0 && off[S] == N, "seg_off must run from 0 to the number of rows (", N, "), got ", off[0],
              " .. ", off[S]);
  std::vector<char> seen(T, 0);
  for (int64_t j = 0; j < N; ++j) {
    TORCH_CHECK(row[j] >= 0 && row[j] < T, "rows[", j, "] = ", row[j], " is outside [0, ", T, ")");
    TORCH_CHECK(!seen[row[j]], "row ", row[j], " is in rows twice");
    seen[row[j]] = 1;
  }
  std::vector<Segment> segs;
  int64_t xa_size = 0;
  at::ScalarType wtype = at::kFloat;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(off[s] <= off[s + 1], "seg_off must not decrease, got ", off[s], " then ", off[s + 1]);
    TORCH_CHECK(slot[s] >= 0 && slot[s] < static_cast<int64_t>(loaded_.size()) && loaded_[slot[s]], "seg_slot[", s,
                "] = ", slot[s], " holds no adapter");
    const LoRADelta& d = slots_[slot[s]][module];
    if (!d.a.defined() || off[s] == off[s + 1]) continue;  // this adapter leaves the linear alone
    TORCH_CHECK(d.a.size(1) == in, "the adapter in slot ", slot[s], " takes ", d.a.size(1), " inputs; x has ", in);
    for (const LoRAPart& p : d.parts) {
      TORCH_CHECK(p.o1 <= y.size(1), "the adapter in slot ", slot[s], " writes columns up to ", p.o1, "; y has ",
                  y.size(1));
    }
    if (!segs.empty()) {
      TORCH_CHECK(d.a.scalar_type() == wtype, "one step's adapters must share a weight dtype, got ", wtype, " and ",
                  d.a.scalar_type());
    }
    wtype = d.a.scalar_type();
    segs.push_back({&d, row + off[s], off[s + 1] - off[s], xa_size});
    xa_size += (off[s + 1] - off[s]) * d.a.size(0);
  }
  if (segs.empty()) return;
  std::vector<float> xa(xa_size);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_apply", [&] {
    using T = scalar_t;
    if (wtype == at::kBFloat16) {
      apply_typed<c10::BFloat16, T>(segs, y.data_ptr<T>(), y.size(1), x.data_ptr<T>(), in, xa.data());
    } else {
      apply_typed<float, T>(segs, y.data_ptr<T>(), y.size(1), x.data_ptr<T>(), in, xa.data());
    }
  });
}

}  // namespace strata_ops

void register_lora_ops(pybind11::module_& m) {
  using strata_ops::LoRATable;
  // module_local: each build (native, x86-64-v3, ...) is its own extension module with its own
  // LoRATable, which only that build's DecodeLoop takes
  pybind11::class_<LoRATable, std::shared_ptr<LoRATable>>(m, "LoRATable", pybind11::module_local())
      .def(pybind11::init<int64_t>())
      .def("set", &LoRATable::set)
      .def("clear", &LoRATable::clear)
      .def("num_modules", &LoRATable::num_modules)
      .def("apply", &LoRATable::apply, pybind11::call_guard<pybind11::gil_scoped_release>());
}
