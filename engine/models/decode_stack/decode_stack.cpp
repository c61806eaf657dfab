// A decode step's layers in one native call.
//
// In a decode step each layer is ~10 kernel calls on a few rows (norm, qkv GEMM, RoPE, K/V
// write, attention, o-proj + residual, norm, gate/up GEMM, down + residual), and on a small
// model the Python between them costs as much as the kernels: SmolLM2-135M on a 2-core Zen 4
// spent ~2 ms of a 10 ms token in its 30 layers outside the GEMMs and attention. Here the
// same kernels (each still built and tested by its own extension, called by address through
// kvgate_entries.h) run back to back from C++ with the GIL released, so the results are the
// Python path's, bit for bit. Built at first use by engine/models/decode_stack/__init__.py.

#include "kvgate_entries.h"

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace {

using namespace kvgate;

constexpr int64_t kLinear = 0;

// One weight's products through the kernel that holds it: our GEMM's panels or GGUF blocks.
struct Linear {
  at::Tensor weight;
  int64_t n = 0, half = 0, qtype = -1;
  GemmFn gemm = nullptr;
  QLinearFn qlinear = nullptr;
  QGatedFn qgated = nullptr;

  static Linear packed(at::Tensor weight, int64_t n, int64_t half, int64_t gemm) {
    return Linear{std::move(weight), n, half, -1, from_address<GemmFn>(gemm)};
  }

  static Linear blocks(at::Tensor weight, int64_t qtype, int64_t qlinear, int64_t qgated) {
    return Linear{std::move(weight), 0, 0, qtype, nullptr, from_address<QLinearFn>(qlinear),
                  from_address<QGatedFn>(qgated)};
  }

  // mode: kLinear, or the gated activation (1 SiLU, 2 GELU; quantized pairs take SiLU only).
  at::Tensor operator()(const at::Tensor& x, int64_t mode, const Opt& bias,
                        const Opt& residual) const {
    if (gemm) return gemm(x, weight, n, half, mode, bias, residual);
    if (mode != kLinear) return qgated(x, weight, qtype);
    return qlinear(x, weight, qtype, bias, residual, false);
  }
};

// RMSNorm over each head of x [T, H, D] (Qwen3's q/k norms) through the ATen ops the Python
// layers' `RMSNorm` runs for it (not one kernel), so that both give the same bits: a few
// rows through LayerNorm over [x, -x] (mean 0, variance mean(x^2)), more through the formula.
at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t size = x.size(-1);
  if (x.numel() <= 64 * size) {
    const at::Tensor both = at::cat({x, -x}, -1);
    return at::layer_norm(both, {2 * size}, {}, {}, eps).narrow(-1, 0, size) * weight;
  }
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor scale = xf.square().mean(-1, true).add_(eps).rsqrt_();
  return (xf * scale).to(x.scalar_type()).mul_(weight);
}

struct Layer {
  at::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
  Opt qkv_bias, q_norm, k_norm;
  int64_t act = 1;
  at::Tensor k_cache, v_cache;
  int64_t rope_table = 0, window = 0;
  double softcap = 0.0;
};

class DecodeStack {
 public:
  DecodeStack(std::vector<Layer> layers, const Entries& kernels, int64_t heads, int64_t kv_heads,
              int64_t head_dim, double eps, double scale)
      : layers_(std::move(layers)),
        norm_(from_address<NormFn>(kernels.at("rms_norm"))),
        rope_(from_address<RopeFn>(kernels.at("rope"))),
        write_kv_(from_address<WriteKvFn>(kernels.at("write_kv"))),
        decode_(from_address<DecodeFn>(kernels.at("paged_decode"))),
        heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {}

  // x [B, hidden] (one query row per sequence) -> the last layer's output; each layer's K/V
  // written at `slots` first. cos/sin: [B, D] rows per RoPE table.
  at::Tensor run(at::Tensor x, const std::vector<at::Tensor>& cos,
                 const std::vector<at::Tensor>& sin, const at::Tensor& slots,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens) const {
    pybind11::gil_scoped_release released;  // nothing below touches Python
    const int64_t rows = x.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    const at::Tensor no_scales = at::empty({0}, at::kFloat);
    for (const Layer& layer : layers_) {
      const at::Tensor qkv = layer.qkv(norm_(x, layer.input_norm, eps_), kLinear, layer.qkv_bias,
                                       c10::nullopt);
      at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({rows, heads_ + kv_heads_, head_dim_});
      if (layer.q_norm)
        qk = at::cat({head_norm(qk.narrow(1, 0, heads_), *layer.q_norm, eps_),
                      head_norm(qk.narrow(1, heads_, kv_heads_), *layer.k_norm, eps_)},
                     1);
      const auto [q, k] = rope_(qk, heads_, cos.at(layer.rope_table), sin.at(layer.rope_table));
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size)
                               .view({rows, kv_heads_, head_dim_});
      at::Tensor k_cache = layer.k_cache, v_cache = layer.v_cache;
      write_kv_(k_cache, v_cache, k, v, slots);
      const at::Tensor out = decode_(q, k_cache, v_cache, no_scales, no_scales, block_tables,
                                     seq_lens, scale_, layer.window, layer.softcap);
      x = layer.o(out.view({rows, q_size}), kLinear, c10::nullopt, x);
      const at::Tensor hidden = layer.gate_up(norm_(x, layer.post_norm, eps_), layer.act,
                                              c10::nullopt, c10::nullopt);
      x = layer.down(hidden, kLinear, c10::nullopt, x);
    }
    return x;
  }

 private:
  std::vector<Layer> layers_;
  NormFn norm_;
  RopeFn rope_;
  WriteKvFn write_kv_;
  DecodeFn decode_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Linear>(m, "Linear", "one weight and the kernel that multiplies by it")
      .def_static("packed", &Linear::packed, "gemm's panels: (packed, n, half, gemm address)")
      .def_static("blocks", &Linear::blocks,
                  "GGUF blocks: (blocks, type, qlinear address, qlinear_swiglu address)");
  pybind11::class_<Layer>(m, "Layer", "one decoder layer's weights and K/V cache")
      .def(pybind11::init([](at::Tensor input_norm, at::Tensor post_norm, Linear qkv, Opt qkv_bias,
                             Opt q_norm, Opt k_norm, Linear o, Linear gate_up, Linear down,
                             int64_t act, at::Tensor k_cache, at::Tensor v_cache,
                             int64_t rope_table, int64_t window, double softcap) {
        TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "Layer: q and k norms go together");
        return Layer{std::move(input_norm), std::move(post_norm), std::move(qkv), std::move(o),
                     std::move(gate_up), std::move(down), std::move(qkv_bias),
                     std::move(q_norm), std::move(k_norm), act, std::move(k_cache),
                     std::move(v_cache), rope_table, window, softcap};
      }));
  pybind11::class_<DecodeStack>(m, "DecodeStack", "a model's layers for decode steps")
      .def(pybind11::init<std::vector<Layer>, const Entries&, int64_t, int64_t, int64_t, double,
                          double>())
      .def("run", &DecodeStack::run, "x -> the last layer's output, K/V written");
}
