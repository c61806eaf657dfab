// The kernels one extension calls in another, by address (the decode stack, engine/models/
// decode_stack, runs a model's layers through the GEMMs, norms, RoPE, K/V write and decode
// attention that other extensions build). Each exporter hands its function to `address`,
// whose overloads take exactly these types: a signature that drifts fails to compile on
// both sides instead of crashing at a call.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <map>
#include <string>
#include <tuple>

namespace kvgate {

using Opt = c10::optional<at::Tensor>;
// gemm(x, packed, n, half, mode, bias, residual): engine/models/gemm.
using GemmFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                              const Opt&, const Opt&);
// qlinear(x, blocks, type, bias, residual, float_out): engine/models/quant.
using QLinearFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, int64_t, const Opt&,
                                 const Opt&, bool);
// qlinear_swiglu(x, blocks, type).
using QGatedFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, int64_t);
// rms_norm(x, weight, eps): engine/cpu_ops.
using NormFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, double);
// rope(heads, q_heads, cos, sin) -> (q, k).
using RopeFn = std::tuple<at::Tensor, at::Tensor> (*)(const at::Tensor&, int64_t,
                                                      const at::Tensor&, const at::Tensor&);
// write_kv(k_cache, v_cache, k, v, slots).
using WriteKvFn = void (*)(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&);
// paged_decode(q, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, scale, window,
// softcap): engine/attention/cpu.
using DecodeFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, double, int64_t, double);

using Entries = std::map<std::string, int64_t>;

template <typename Fn>
inline int64_t to_int(Fn fn) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(fn));
}
inline int64_t address(GemmFn fn) { return to_int(fn); }
inline int64_t address(QLinearFn fn) { return to_int(fn); }
inline int64_t address(QGatedFn fn) { return to_int(fn); }
inline int64_t address(NormFn fn) { return to_int(fn); }
inline int64_t address(RopeFn fn) { return to_int(fn); }
inline int64_t address(WriteKvFn fn) { return to_int(fn); }
inline int64_t address(DecodeFn fn) { return to_int(fn); }

// The function an `address` gave, as its type.
template <typename Fn>
inline Fn from_address(int64_t address) {
  return reinterpret_cast<Fn>(static_cast<uintptr_t>(address));
}

}  // namespace kvgate
