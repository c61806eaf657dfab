// kvgate's native library as torch ops: torch.ops.kvgate_<variant>.<name> (ops.h), seen by
// torch's profiler and dispatcher like ATen's own. Kernels that read tensors are CPU kernels of
// the op; the few that describe the build (its variant, packing layout, head sizes) take no
// tensor and serve every dispatch key. The decode stack registers its classes itself
// (kernels/decode_stack.cpp).
//
// Why torch ops and not pybind11 functions: this file and the kernels build without
// torch/extension.h (pybind11 and all of ATen's operators: ~30 s a file on 2 cores), the
// library loads with no Python ABI of its own, and torch releases the GIL around every call.
// A call from Python costs ~1 us more than a pybind11 one (2-core Zen 4): ~30 us a decode step
// where the Python layers run, none where the decode stack does.

#include "ops.h"

#include <torch/library.h>

#include <string>

namespace {

std::string isa() { return KVGATE_STRING(KVGATE_VARIANT); }
std::string sources_digest() { return KVGATE_STRING(KVGATE_SOURCES); }

}  // namespace

KVGATE_LIBRARY(m) {
  m.def("isa() -> str", &isa);
  m.def("sources_digest() -> str", &sources_digest);
  // cpu_ops.cpp
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor heads, int q_heads, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots) -> ()");
  m.def("argmax(Tensor x) -> Tensor");
  // gemm.cpp
  m.def("gemm(Tensor x, Tensor packed, int n, int half, int mode, Tensor? bias, "
        "Tensor? residual) -> Tensor");
  m.def("gemm_layout() -> (int, bool)", &kvgate::gemm_layout);
  // qgemm.cpp
  m.def("qlinear(Tensor x, Tensor w, int type, Tensor? bias, Tensor? residual, "
        "bool float_out) -> Tensor");
  m.def("qlinear_swiglu(Tensor x, Tensor w, int type) -> Tensor");
  m.def("dequantize_rows(Tensor w, int type, int k, Tensor ids, bool bf16) -> Tensor");
  m.def("dequantize(Tensor w, int type, int k, bool bf16) -> Tensor");
  m.def("qgemm_layout(int type, int rows) -> int", &kvgate::qgemm_layout);
  m.def("qgemm_interleave(Tensor w, int type, int k) -> Tensor");
  // paged_decode.cpp, paged_prefill.cpp
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scales, "
        "Tensor v_scales, Tensor block_tables, Tensor seq_lens, float scale, int window, "
        "float softcap) -> Tensor");
  m.def("decode_head_dims() -> int[]", &kvgate::decode_head_dims);
  m.def("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scales, "
        "Tensor v_scales, Tensor block_tables, Tensor seq_lens, Tensor query_start, "
        "Tensor seqs, float scale, int window, float softcap, Tensor(a!) out) -> ()");
  m.def("prefill_head_dims() -> int[]", &kvgate::prefill_head_dims);
  m.def("prefill_bf16_dot() -> bool", &kvgate::prefill_bf16_dot);
}

KVGATE_LIBRARY_IMPL(CPU, m) {
  m.impl("rms_norm", &kvgate::rms_norm);
  m.impl("rope", &kvgate::rope);
  m.impl("write_kv", &kvgate::write_kv);
  m.impl("argmax", &kvgate::argmax);
  m.impl("gemm", &kvgate::gemm);
  m.impl("qlinear", &kvgate::qlinear);
  m.impl("qlinear_swiglu", &kvgate::qlinear_swiglu);
  m.impl("dequantize_rows", &kvgate::dequantize_rows);
  m.impl("dequantize", &kvgate::dequantize);
  m.impl("qgemm_interleave", &kvgate::qgemm_interleave);
  m.impl("paged_decode", &kvgate::paged_decode);
  m.impl("paged_prefill", &kvgate::paged_prefill);
}
