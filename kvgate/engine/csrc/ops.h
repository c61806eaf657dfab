// Every kernel of kvgate's native library, as the rest of the library calls it: registration.cpp
// makes each one a torch op (torch.ops.kvgate_<variant>.<name>, schemas there), and the decode
// stack calls them directly. Kernels take tensors and check them (TORCH_CHECK); where a dtype
// or head size is not one they compute, they refuse, and the Python wrappers run torch.
//
// Each file under kernels/ includes ATen's tensor core only (not torch/extension.h: pybind11
// and all of ATen's operators cost ~30 s a file to compile on 2 cores), so the library builds
// in the time its own code takes.
#pragma once

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

// The build names its ISA variant (-DKVGATE_VARIANT=avx2, engine/native_variants.py); the
// library's ops and classes live in the torch namespace kvgate_<variant>, so that two variants
// load side by side (the tests compare the AVX2 one with the machine's).
#if !defined(KVGATE_VARIANT) || !defined(KVGATE_SOURCES)
#error "build with -DKVGATE_VARIANT=<variant> -DKVGATE_SOURCES=<digest>: engine/native_variants.py"
#endif
#define KVGATE_CONCAT_(a, b) a##b
#define KVGATE_CONCAT(a, b) KVGATE_CONCAT_(a, b)
#define KVGATE_STRING_(x) #x
#define KVGATE_STRING(x) KVGATE_STRING_(x)
#define KVGATE_OPS KVGATE_CONCAT(kvgate_, KVGATE_VARIANT)
// TORCH_LIBRARY* pastes and quotes its namespace argument: these expand KVGATE_OPS first.
#define KVGATE_LIBRARY_(ns, m) TORCH_LIBRARY(ns, m)
#define KVGATE_LIBRARY(m) KVGATE_LIBRARY_(KVGATE_OPS, m)
#define KVGATE_LIBRARY_FRAGMENT_(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define KVGATE_LIBRARY_FRAGMENT(m) KVGATE_LIBRARY_FRAGMENT_(KVGATE_OPS, m)
#define KVGATE_LIBRARY_IMPL_(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)
#define KVGATE_LIBRARY_IMPL(key, m) KVGATE_LIBRARY_IMPL_(KVGATE_OPS, key, m)

namespace kvgate {

using OptTensor = std::optional<at::Tensor>;

// A new (uninitialized, contiguous) CPU tensor, allocated as ATen's own CPU kernels allocate
// theirs: no dispatch, and none of at::empty's header (~2 s of compile a file).
inline at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::detail::empty_cpu(sizes, dtype);
}

// cpu_ops.cpp: a step's small operations.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& heads, int64_t q_heads,
                                        const at::Tensor& cos, const at::Tensor& sin);
void write_kv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slots);
at::Tensor argmax(const at::Tensor& x);

// gemm.cpp: products over weights packed into its panels.
at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t half,
                int64_t mode, const OptTensor& bias, const OptTensor& residual);
std::tuple<int64_t, bool> gemm_layout();

// qgemm.cpp: products over GGUF blocks.
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& w, int64_t type, const OptTensor& bias,
                   const OptTensor& residual, bool float_out);
at::Tensor qlinear_swiglu(const at::Tensor& x, const at::Tensor& w, int64_t type);
at::Tensor dequantize_rows(const at::Tensor& w, int64_t type, int64_t k, const at::Tensor& ids,
                           bool bf16);
at::Tensor dequantize(const at::Tensor& w, int64_t type, int64_t k, bool bf16);
int64_t qgemm_layout(int64_t type, int64_t rows);
at::Tensor qgemm_interleave(const at::Tensor& w, int64_t type, int64_t k);

// paged_decode.cpp, paged_prefill.cpp: attention over the paged KV cache.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& k_scales, const at::Tensor& v_scales,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        int64_t window, double softcap);
std::vector<int64_t> decode_head_dims();
void paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& k_scales, const at::Tensor& v_scales,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   const at::Tensor& query_start, const at::Tensor& seqs, double scale,
                   int64_t window, double softcap, at::Tensor& out);
std::vector<int64_t> prefill_head_dims();
bool prefill_bf16_dot();

}  // namespace kvgate
