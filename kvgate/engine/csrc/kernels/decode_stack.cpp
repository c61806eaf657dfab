// A decode step's layers in one native call.
//
// In a decode step each layer is ~10 kernel calls on a few rows (norm, qkv GEMM, RoPE, K/V
// write, attention, o-proj + residual, norm, gate/up GEMM, down + residual), and on a small
// model the Python between them costs as much as the kernels: SmolLM2-135M on a 2-core Zen 4
// spent ~2 ms of a 10 ms token in its 30 layers outside the GEMMs and attention. Here the
// same kernels (ops.h: each still a torch op of its own, tested as one) run back to back from
// C++, so the results are the Python path's, bit for bit. The stack is a torch class
// (torch.classes.kvgate_<variant>.DecodeStack), built by engine/models/decode_stack/__init__.py;
// torch calls its `run` with the GIL released.

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 reports a write "into a region of size 0" in the reference-count load of torch's
// IValue that the class registration at the end inlines: a false positive (an atomic load of a
// live object's count).
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#endif

#include "ops.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/layer_norm.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace kvgate {
namespace {

constexpr int64_t kLinear = 0;

// One weight's products through the kernel that holds it: our GEMM's panels (qtype < 0: n
// columns, gate/up halves of `half` each) or GGUF blocks in qgemm's layout `qtype` (a ggml
// type id, plus 256 where 8 rows are interleaved: `qgemm_layout`).
struct Linear : torch::CustomClassHolder {
  at::Tensor weight;
  int64_t n, half, qtype;

  Linear(at::Tensor weight, int64_t n, int64_t half, int64_t qtype)
      : weight(std::move(weight)), n(n), half(half), qtype(qtype) {}

  // mode: kLinear, or the gated activation (1 SiLU, 2 GELU; quantized pairs take SiLU only).
  at::Tensor operator()(const at::Tensor& x, int64_t mode, const OptTensor& bias,
                        const OptTensor& residual) const {
    if (qtype < 0) return gemm(x, weight, n, half, mode, bias, residual);
    if (mode != kLinear) return qlinear_swiglu(x, weight, qtype);
    return qlinear(x, weight, qtype, bias, residual, false);
  }
};

// RMSNorm over each head of x [T, H, D] (Qwen3's q/k norms) through the ATen ops the Python
// layers' `RMSNorm` runs for it (not one kernel), so that both give the same bits: a few
// rows through LayerNorm over [x, -x] (mean 0, variance mean(x^2)), more through the formula.
at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t size = x.size(-1);
  if (x.numel() <= 64 * size) {
    const at::Tensor both = at::cat({x, x.neg()}, -1);
    return at::layer_norm(both, {2 * size}, {}, {}, eps).narrow(-1, 0, size).mul(weight);
  }
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor scale = xf.square().mean(-1, true).add_(eps).rsqrt_();
  return xf.mul(scale).to(x.scalar_type()).mul_(weight);
}

using LinearPtr = c10::intrusive_ptr<Linear>;

// One decoder layer's weights and K/V cache.
struct Layer : torch::CustomClassHolder {
  at::Tensor input_norm, post_norm;
  LinearPtr qkv;
  OptTensor qkv_bias, q_norm, k_norm;
  LinearPtr o, gate_up, down;
  int64_t act;
  at::Tensor k_cache, v_cache;
  int64_t rope_table, window;
  double softcap;

  Layer(at::Tensor input_norm, at::Tensor post_norm, LinearPtr qkv, OptTensor qkv_bias,
        OptTensor q_norm, OptTensor k_norm, LinearPtr o, LinearPtr gate_up, LinearPtr down,
        int64_t act, at::Tensor k_cache, at::Tensor v_cache, int64_t rope_table, int64_t window,
        double softcap)
      : input_norm(std::move(input_norm)), post_norm(std::move(post_norm)), qkv(std::move(qkv)),
        qkv_bias(std::move(qkv_bias)), q_norm(std::move(q_norm)), k_norm(std::move(k_norm)),
        o(std::move(o)), gate_up(std::move(gate_up)), down(std::move(down)), act(act),
        k_cache(std::move(k_cache)), v_cache(std::move(v_cache)), rope_table(rope_table),
        window(window), softcap(softcap) {
    TORCH_CHECK(this->q_norm.has_value() == this->k_norm.has_value(),
                "Layer: q and k norms go together");
  }
};

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(std::vector<c10::intrusive_ptr<Layer>> layers, int64_t heads, int64_t kv_heads,
              int64_t head_dim, double eps, double scale)
      : layers_(std::move(layers)), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim),
        eps_(eps), scale_(scale) {}

  // x [B, hidden] (one query row per sequence) -> the last layer's output; each layer's K/V
  // written at `slots` first. cos/sin: [B, D] rows per RoPE table.
  at::Tensor run(at::Tensor x, const std::vector<at::Tensor>& cos,
                 const std::vector<at::Tensor>& sin, const at::Tensor& slots,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens) const {
    const int64_t rows = x.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    const at::Tensor no_scales = empty({0}, at::kFloat);
    for (const auto& layer : layers_) {
      const at::Tensor qkv = (*layer->qkv)(rms_norm(x, layer->input_norm, eps_), kLinear,
                                           layer->qkv_bias, std::nullopt);
      at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({rows, heads_ + kv_heads_, head_dim_});
      if (layer->q_norm)
        qk = at::cat({head_norm(qk.narrow(1, 0, heads_), *layer->q_norm, eps_),
                      head_norm(qk.narrow(1, heads_, kv_heads_), *layer->k_norm, eps_)},
                     1);
      const auto [q, k] = rope(qk, heads_, cos.at(layer->rope_table), sin.at(layer->rope_table));
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size)
                               .view({rows, kv_heads_, head_dim_});
      at::Tensor k_cache = layer->k_cache, v_cache = layer->v_cache;
      write_kv(k_cache, v_cache, k, v, slots);
      const at::Tensor out = paged_decode(q, k_cache, v_cache, no_scales, no_scales, block_tables,
                                          seq_lens, scale_, layer->window, layer->softcap);
      x = (*layer->o)(out.view({rows, q_size}), kLinear, std::nullopt, x);
      const at::Tensor hidden = (*layer->gate_up)(rms_norm(x, layer->post_norm, eps_), layer->act,
                                                  std::nullopt, std::nullopt);
      x = (*layer->down)(hidden, kLinear, std::nullopt, x);
    }
    return x;
  }

 private:
  std::vector<c10::intrusive_ptr<Layer>> layers_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
};

}  // namespace
}  // namespace kvgate

KVGATE_LIBRARY_FRAGMENT(m) {
  using namespace kvgate;
  m.class_<Linear>("Linear")
      .def(torch::init<at::Tensor, int64_t, int64_t, int64_t>(),
           "one weight and its kernel: (gemm's panels, n, half, -1) or (GGUF blocks, 0, 0, type)");
  m.class_<Layer>("Layer").def(
      torch::init<at::Tensor, at::Tensor, LinearPtr, OptTensor, OptTensor, OptTensor, LinearPtr,
                  LinearPtr, LinearPtr, int64_t, at::Tensor, at::Tensor, int64_t, int64_t,
                  double>(),
      "one decoder layer's weights and K/V cache");
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<std::vector<c10::intrusive_ptr<Layer>>, int64_t, int64_t, int64_t, double,
                       double>(),
           "a model's layers for decode steps")
      .def("run", &DecodeStack::run, "x -> the last layer's output, K/V written");
}
