// A native loop over a decoder's layers for the steps in which every token decodes (one-stream and
// small-batch decode, where a step is mostly per-op dispatch from Python). The layers' own kernels
// (ops.h) are called back to back from C++, in the order and with the arguments the PyTorch modules
// use (strata/models/decoder.py: Attention, DecoderLayer in the "pre" norm layout, MLP with SiLU),
// so the result is the same to the last bit; strata/models/native_decode.py decides when a model
// and a step qualify, and keeps the Python loop as the oracle.
//
// Per layer, for x [T, hidden] and the residual stream beside it:
//
//   h, residual = add_rms_norm(x, residual)           (the first layer: residual = x, h = rms_norm(x))
//   q | k | v   = qkv(h)                              views of one [T, q + 2 kv] projection
//   rope(q, k) in place; store k, v at out_slots[group]; attention over the group's pages
//   h, residual = add_rms_norm(o(attention), residual)
//   x           = down(silu(gate) * up)   with gate | up = gate_up(h)
//
// Linears are q4 / q8 blocks (the int8 dot-product kernels), packed bf16 / float32 weights (the dense
// kernel, strata.layers.packed.DenseLinear) or plain float weights (at::linear, as F.linear computes
// them), each with an optional bias. With LoRA adapters served (set_lora), each linear then adds the
// step's adapters' deltas on their rows (lora_ops.cpp), as strata.layers.lora.LoRALinear does.
#include <torch/extension.h>

#include <memory>
#include <tuple>
#include <vector>

#include "lora.h"
#include "ops.h"

namespace {

enum class LinearKind : int64_t { kQ4 = 0, kQ8 = 1, kFloat = 2, kDense = 3 };

struct Linear {
  LinearKind kind;
  at::Tensor a, b, c;  // q4: qp, dp, mp; q8: qp, dp (packed, strata.layers.quant); float: the weight;
                       // dense: the packed weight (strata.layers.packed)
  c10::optional<at::Tensor> bias;  // dense: float32, added before rounding (DenseLinear.forward's)
  int64_t rows;  // output features
  int64_t lora_module = -1;  // its index in the LoRA table (-1: not adapted)

  at::Tensor base(const at::Tensor& x) const {
    if (kind == LinearKind::kFloat) return at::linear(x, a, bias);
    if (kind == LinearKind::kDense) return strata_ops::dense_linear(x, a, bias, rows);
    at::Tensor out = kind == LinearKind::kQ4 ? strata_ops::q4_linear(x, a, b, c, rows)
                                             : strata_ops::q8_linear(x, a, b, rows);
    if (bias) out.add_(bias->to(out.scalar_type()));  // QuantLinear.forward's order
    return out;
  }
};

// The step's rows under adapters (LoRATable::apply's rows, seg_off, seg_slot); no table: none.
struct LoRAStep {
  const strata_ops::LoRATable* table = nullptr;
  at::Tensor rows, seg_off, seg_slot;

  at::Tensor operator()(const Linear& linear, const at::Tensor& x) const {
    at::Tensor y = linear.base(x);
    if (table != nullptr && linear.lora_module >= 0) table->apply(linear.lora_module, y, x, rows, seg_off, seg_slot);
    return y;
  }
};

Linear make_linear(int64_t kind, at::Tensor a, c10::optional<at::Tensor> b, c10::optional<at::Tensor> c,
                   c10::optional<at::Tensor> bias, int64_t rows) {
  TORCH_CHECK(kind >= 0 && kind <= 3, "linear kind must be 0 (q4), 1 (q8), 2 (float) or 3 (dense), got ", kind);
  const auto k = static_cast<LinearKind>(kind);
  TORCH_CHECK(k == LinearKind::kFloat || k == LinearKind::kDense || b.has_value(), "a q4/q8 linear needs its scales");
  TORCH_CHECK(k != LinearKind::kQ4 || c.has_value(), "a q4 linear needs its offsets");
  return {k, a, b.value_or(at::Tensor()), c.value_or(at::Tensor()), bias, rows};
}

struct Layer {
  at::Tensor in_norm, post_norm;  // RMSNorm weights [hidden]
  double eps;
  Linear qkv, o, gate_up, down;
  int64_t num_heads, num_kv_heads, head_dim;
  at::Tensor cos, sin;  // the layer's rotary tables [max_positions, rot_dim], float32
  double scale;
  int64_t window;  // 0: none
  double softcap;  // 0: none
  c10::optional<at::Tensor> sinks;  // float32 [num_heads]
};

class DecodeLoop {
 public:
  // One layer, appended in order; linears as (kind, a, b, c, bias, rows) (see make_linear).
  void add_layer(at::Tensor in_norm, at::Tensor post_norm, double eps, std::vector<pybind11::object> linears,
                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, at::Tensor cos, at::Tensor sin,
                 double scale, int64_t window, double softcap, c10::optional<at::Tensor> sinks) {
    TORCH_CHECK(linears.size() == 4, "a layer has 4 linears (qkv, o, gate_up, down), got ", linears.size());
    std::vector<Linear> lin;
    for (const auto& spec : linears) {
      auto [kind, a, b, c, bias, rows] =
          spec.cast<std::tuple<int64_t, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                               c10::optional<at::Tensor>, int64_t>>();
      lin.push_back(make_linear(kind, a, b, c, bias, rows));
    }
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0 && num_heads % num_kv_heads == 0,
                "heads (", num_heads, ") must be a positive multiple of kv heads (", num_kv_heads, ")");
    layers_.push_back({in_norm, post_norm, eps, lin[0], lin[1], lin[2], lin[3], num_heads, num_kv_heads, head_dim, cos,
                       sin, scale, window, softcap, sinks});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The adapters' table and each linear's index in it: [layer][qkv, o, gate_up, down], -1 where an
  // adapter cannot adapt that linear.
  void set_lora(std::shared_ptr<strata_ops::LoRATable> table, const std::vector<std::vector<int64_t>>& modules) {
    TORCH_CHECK(static_cast<int64_t>(modules.size()) == num_layers(), "need the LoRA modules of every layer (",
                num_layers(), "), got ", modules.size());
    for (int64_t i = 0; i < num_layers(); ++i) {
      TORCH_CHECK(modules[i].size() == 4, "a layer has 4 linears (qkv, o, gate_up, down), got ", modules[i].size());
      Linear* lin[4] = {&layers_[i].qkv, &layers_[i].o, &layers_[i].gate_up, &layers_[i].down};
      for (int j = 0; j < 4; ++j) {
        TORCH_CHECK(modules[i][j] >= -1 && modules[i][j] < table->num_modules(), "LoRA module ", modules[i][j],
                    " is outside [-1, ", table->num_modules(), ")");
        lin[j]->lora_module = modules[i][j];
      }
    }
    lora_ = std::move(table);
  }

  bool has_lora() const { return lora_ != nullptr; }

  // x [T, hidden] (the embeddings), positions [T]; per layer its caches and its KV group's page table
  // [T, max_pages] (row t: token t's request) and out_slots [T]; owner [T]: page-table row per token.
  // lora: the step's rows under adapters as (rows, seg_off, seg_slot) (LoRATable::apply), or none.
  // capture_after: layers after which the stream is copied into `captured` [T, n * hidden], the j-th
  // into columns [j * hidden, (j + 1) * hidden) (-1: the embeddings, before the first layer).
  // Returns (x, residual) after the last layer: the stream is x + residual (the caller's final norm
  // adds them).
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, at::Tensor positions, std::vector<at::Tensor> k_caches,
                                             std::vector<at::Tensor> v_caches, std::vector<at::Tensor> page_tables,
                                             std::vector<at::Tensor> out_slots, at::Tensor owner, int64_t page_size,
                                             c10::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> lora,
                                             std::vector<int64_t> capture_after, c10::optional<at::Tensor> captured) {
    const int64_t L = num_layers();
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == L && static_cast<int64_t>(v_caches.size()) == L,
                "need one k and one v cache per layer (", L, "), got ", k_caches.size(), " and ", v_caches.size());
    TORCH_CHECK(static_cast<int64_t>(page_tables.size()) == L && static_cast<int64_t>(out_slots.size()) == L,
                "need one page table and one out_slots per layer (", L, "), got ", page_tables.size(), " and ",
                out_slots.size());
    TORCH_CHECK(x.dim() == 2, "x must be [tokens, hidden], got ", x.sizes());
    const int64_t T = x.size(0);
    LoRAStep linear;
    if (lora) {
      TORCH_CHECK(lora_ != nullptr, "a step with adapter rows needs set_lora first");
      linear = {lora_.get(), std::get<0>(*lora), std::get<1>(*lora), std::get<2>(*lora)};
    }
    const int64_t H = x.size(1);
    TORCH_CHECK(capture_after.empty() || (captured && captured->dim() == 2 && captured->size(0) == T &&
                                          captured->size(1) == H * static_cast<int64_t>(capture_after.size())),
                "captured must be [tokens, ", capture_after.size(), " * hidden] for the layers it captures");
    // the stream after layer `layer` (-1: the embeddings) into its columns of `captured`, if captured
    auto capture = [&](int64_t layer, const at::Tensor& stream, const at::Tensor* residual) {
      for (size_t j = 0; j < capture_after.size(); ++j) {
        if (capture_after[j] != layer) continue;
        at::Tensor out = captured->narrow(1, static_cast<int64_t>(j) * H, H);
        if (residual == nullptr) out.copy_(stream);
        else at::add_out(out, stream, *residual);
      }
    };
    capture(-1, x, nullptr);
    at::Tensor residual;
    for (int64_t i = 0; i < L; ++i) {
      const Layer& l = layers_[i];
      at::Tensor h;
      if (i == 0) {
        residual = x;
        h = strata_ops::rms_norm(x, l.in_norm, l.eps);
      } else {
        std::tie(h, residual) = strata_ops::add_rms_norm(x, residual, l.in_norm, l.eps);
      }
      const int64_t q_size = l.num_heads * l.head_dim, kv_size = l.num_kv_heads * l.head_dim;
      const at::Tensor qkv = linear(l.qkv, h);  // [T, q_size + 2 kv_size]
      const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, l.num_heads, l.head_dim});
      const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, l.num_kv_heads, l.head_dim});
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, l.num_kv_heads, l.head_dim});
      strata_ops::rotary_embedding(q, k, l.cos, l.sin, positions);
      strata_ops::store_kv(k, v, k_caches[i], v_caches[i], out_slots[i]);
      at::Tensor attn = at::empty(q.sizes(), q.options());
      strata_ops::paged_attention(attn, q, k_caches[i], v_caches[i], page_tables[i], owner, positions, page_size,
                                  l.scale, l.window, l.softcap, l.sinks);
      std::tie(h, residual) = strata_ops::add_rms_norm(linear(l.o, attn.view({T, q_size})), residual, l.post_norm, l.eps);
      x = linear(l.down, strata_ops::silu_and_mul(linear(l.gate_up, h)));
      capture(i, x, &residual);
    }
    return {x, residual};
  }

 private:
  std::vector<Layer> layers_;
  std::shared_ptr<strata_ops::LoRATable> lora_;
};

}  // namespace

void register_decode_loop(pybind11::module_& m) {
  pybind11::class_<DecodeLoop>(m, "DecodeLoop")
      .def(pybind11::init<>())
      .def("add_layer", &DecodeLoop::add_layer)
      .def("num_layers", &DecodeLoop::num_layers)
      .def("set_lora", &DecodeLoop::set_lora)
      .def("has_lora", &DecodeLoop::has_lora)
      // the step runs without the GIL: the engine's other threads (storage I/O, transfers) go on meanwhile
      .def("forward", &DecodeLoop::forward, pybind11::arg("x"), pybind11::arg("positions"), pybind11::arg("k_caches"),
           pybind11::arg("v_caches"), pybind11::arg("page_tables"), pybind11::arg("out_slots"), pybind11::arg("owner"),
           pybind11::arg("page_size"), pybind11::arg("lora") = pybind11::none(),
           pybind11::arg("capture_after") = std::vector<int64_t>{}, pybind11::arg("captured") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
