// LoRA adapters' weights as the kernels hold them (lora_ops.cpp), and the one call the decode loop
// (decode_loop.cpp) and the Python linears (strata/layers/lora.py) make per adapted linear.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace strata_ops {

// One part of a (possibly fused) linear's output that an adapter adapts: output columns [o0, o1)
// get xa[r0:r1] @ bt, where xa = A @ x and bt = (B * scale)^T, [r1 - r0, o1 - o0].
struct LoRAPart {
  int64_t o0, o1, r0, r1;
  at::Tensor bt;
};

// One adapter's delta on one linear; `a` undefined: the adapter leaves that linear alone.
struct LoRADelta {
  at::Tensor a;  // [R, in]: the parts' A rows stacked
  std::vector<LoRAPart> parts;
};

// Every loaded adapter's deltas by slot and linear ("module": the index the Python side gave each
// adapted linear). Slots are filled when an adapter is loaded and cleared when it leaves memory,
// so a step passes only which of its rows use which slot.
class LoRATable {
 public:
  explicit LoRATable(int64_t num_modules);

  // The delta of the adapter in `slot` on linear `module`: A [R, in] and its parts as
  // (o0, o1, r0, r1, bt). float32 or bfloat16 weights, all of one dtype, contiguous CPU tensors.
  void set(int64_t slot, int64_t module, at::Tensor a,
           const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, at::Tensor>>& parts);
  void clear(int64_t slot);  // the adapter in `slot` left memory
  int64_t num_modules() const { return num_modules_; }

  // y[rows[j]] += the delta of seg_slot[s]'s adapter on x[rows[j]] for j in [seg_off[s], seg_off[s + 1]),
  // in place. x [T, in] and y [T, out] contiguous, of one float dtype; rows, seg_off, seg_slot int64.
  // The delta is summed in float32 and added to y with one rounding.
  void apply(int64_t module, at::Tensor y, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& seg_off,
             const at::Tensor& seg_slot) const;

 private:
  int64_t num_modules_;
  std::vector<std::vector<LoRADelta>> slots_;  // [slot][module]
  std::vector<bool> loaded_;                   // [slot]
};

}  // namespace strata_ops
