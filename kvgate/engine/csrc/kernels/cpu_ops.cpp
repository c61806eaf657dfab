// The small per-layer operations of a step, each one native call instead of 3-8 torch ops.
//
// A batch-8 decode step of a small model spends as much time between the matmuls as in them:
// every torch op costs a few microseconds of dispatch and a fresh tensor, and the ones that
// open an OpenMP region (LayerNorm, a 64K-element copy or argmax) wait for the second thread,
// which on a loaded 2-core machine can take milliseconds. These run on the caller's thread
// for decode-sized inputs (at::parallel_for with a grain of 64 rows: inline below that) and
// compute in fp32, rounding once per output where the torch formula they replace rounds.
// Called by engine/cpu_ops.py and the decode stack.

#include "kvgate_simd.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace kvgate {
namespace {

constexpr int64_t kGrainRows = 64;

template <typename T>
inline float f32(T x) {
  return static_cast<float>(x);
}

// transformers' RMSNorm: x * rsqrt(mean(x^2) + eps) in fp32, rounded to T, then times the
// weight (a product of two T values, rounded to T). Vectorized: a 2,000-token prefill runs 17
// of these over [2000, hidden].
template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* w, T* out, int64_t rows, int64_t size,
                   float eps) {
  const int64_t whole = size - size % kWidth;
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* o = out + r * size;
      Vec squares = zero();
      for (int64_t i = 0; i < whole; i += kWidth) {
        const Vec v = load(xr + i);
        squares = fmadd(v, v, squares);
      }
      float sum_sq = sum(squares);
      for (int64_t i = whole; i < size; ++i) sum_sq += f32(xr[i]) * f32(xr[i]);
      const float scale = 1.f / std::sqrt(sum_sq / static_cast<float>(size) + eps);
      for (int64_t i = 0; i < whole; i += kWidth) {
        store(o + i, load(xr + i) * splat(scale));  // rounded to T once ...
        store(o + i, load(o + i) * load(w + i));    // ... and again after the weight
      }
      for (int64_t i = whole; i < size; ++i)
        o[i] = static_cast<T>(f32(static_cast<T>(f32(xr[i]) * scale)) * f32(w[i]));
    }
  });
}

}  // namespace

// x [rows, size] (rows may be strided, elements contiguous), weight [size] -> a new [rows, size].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x [rows, size], rows contiguous");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "rms_norm: weight [size]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight dtype != x dtype");
  auto out = empty({x.size(0), x.size(1)}, x.scalar_type());
  if (x.scalar_type() == at::kBFloat16)
    rms_norm_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), weight.data_ptr<c10::BFloat16>(),
                  out.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), static_cast<float>(eps));
  else if (x.scalar_type() == at::kFloat)
    rms_norm_rows(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(),
                  out.data_ptr<float>(), x.size(0), x.size(1), static_cast<float>(eps));
  else
    TORCH_CHECK(false, "rms_norm: bf16 or fp32");
  return out;
}

namespace {

// RoPE, half-split layout, over heads [T, H, D] of one token row each; cos/signed_sin rows
// [T, D] of each token's position (the sign of rotate_half folded into the sine's first half). Output
// x * cos + swap_halves(x) * sin in fp32, rounded once. Heads [0, q_heads) go to q, the rest
// to k: both contiguous, as the attention kernels read them.
template <typename T>
void rope_rows(const T* x, int64_t token_stride, const T* cos, const T* sin, T* q, T* k,
               int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < q_heads + k_heads; ++h) {
        const T* in = x + t * token_stride + h * dim;
        T* o = h < q_heads ? q + (t * q_heads + h) * dim : k + (t * k_heads + h - q_heads) * dim;
        for (int64_t i = 0; i < half; ++i)
          o[i] = static_cast<T>(f32(in[i]) * f32(c[i]) + f32(in[i + half]) * f32(s[i]));
        for (int64_t i = half; i < dim; ++i)
          o[i] = static_cast<T>(f32(in[i]) * f32(c[i]) + f32(in[i - half]) * f32(s[i]));
      }
    }
  });
}

}  // namespace

// heads [T, Hq + Hk, D] (tokens strided, heads contiguous) -> (q [T, Hq, D], k [T, Hk, D]).
std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& heads, int64_t q_heads,
                                              const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(heads.dim() == 3 && heads.stride(2) == 1 && heads.stride(1) == heads.size(2),
              "rope: heads [T, H, D], each token's heads contiguous");
  const int64_t tokens = heads.size(0), dim = heads.size(2);
  const int64_t k_heads = heads.size(1) - q_heads;
  TORCH_CHECK(q_heads >= 0 && k_heads >= 0 && dim % 2 == 0, "rope: bad head counts or dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.size(0) == tokens && cos.size(1) == dim && sin.sizes() == cos.sizes(),
              "rope: cos, sin [T, D]");
  TORCH_CHECK(cos.scalar_type() == heads.scalar_type() && sin.scalar_type() == heads.scalar_type(),
              "rope: tables in the heads' dtype");
  auto q = empty({tokens, q_heads, dim}, heads.scalar_type());
  auto k = empty({tokens, k_heads, dim}, heads.scalar_type());
  if (heads.scalar_type() == at::kBFloat16)
    rope_rows(heads.data_ptr<c10::BFloat16>(), heads.stride(0), cos.data_ptr<c10::BFloat16>(),
              sin.data_ptr<c10::BFloat16>(), q.data_ptr<c10::BFloat16>(),
              k.data_ptr<c10::BFloat16>(), tokens, q_heads, k_heads, dim);
  else if (heads.scalar_type() == at::kFloat)
    rope_rows(heads.data_ptr<float>(), heads.stride(0), cos.data_ptr<float>(),
              sin.data_ptr<float>(), q.data_ptr<float>(), k.data_ptr<float>(), tokens,
              q_heads, k_heads, dim);
  else
    TORCH_CHECK(false, "rope: bf16 or fp32");
  return {q, k};
}

// K and V rows [T, Hkv, D] (tokens strided, heads contiguous) into caches
// [blocks, Hkv, block_size, D] of the same dtype at slots (block * block_size + offset);
// slots < 0 are skipped.
void write_kv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k,
              const at::Tensor& v, const at::Tensor& slots) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes(),
              "write_kv: caches [blocks, Hkv, block_size, D]");
  const int64_t blocks = k_cache.size(0), kv_heads = k_cache.size(1);
  const int64_t block_size = k_cache.size(2), dim = k_cache.size(3);
  const int64_t tokens = slots.numel();
  for (const auto* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(1) == kv_heads &&
                    t->size(2) == dim && t->stride(2) == 1 && t->stride(1) == dim,
                "write_kv: k, v [T, Hkv, D], each token's heads contiguous");
    TORCH_CHECK(t->scalar_type() == k_cache.scalar_type(), "write_kv: rows in the cache dtype");
  }
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "write_kv: cache dtypes differ");
  TORCH_CHECK(slots.is_contiguous() && slots.scalar_type() == at::kLong, "write_kv: int64 slots");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] < blocks * block_size, "write_kv: slot ", slot[t], " past the cache");
  const int64_t bytes = dim * k_cache.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kr = static_cast<const char*>(k.data_ptr());
  const auto* vr = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size(), v_stride = v.stride(0) * v.element_size();
  at::parallel_for(0, tokens, kGrainRows * 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) continue;
      const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t at = ((block * kv_heads + h) * block_size + offset) * bytes;
        std::memcpy(kc + at, kr + t * k_stride + h * bytes, bytes);
        std::memcpy(vc + at, vr + t * v_stride + h * bytes, bytes);
      }
    }
  });
}

namespace {

// The first index of each row's largest value (a NaN counts as the largest), as torch.argmax.
template <typename T>
void argmax_rows(const T* x, int64_t stride, int64_t rows, int64_t size, int64_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * stride;
    int64_t best = 0;
    float top = f32(xr[0]);
    if (!std::isnan(top)) {
      for (int64_t i = 1; i < size; ++i) {
        const float value = f32(xr[i]);
        if (std::isnan(value)) {
          best = i;
          break;
        }
        if (value > top) {
          top = value;
          best = i;
        }
      }
    }
    out[r] = best;
  }
}

}  // namespace

at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0, "argmax: x [rows, n > 0]");
  auto out = empty({x.size(0)}, at::kLong);
  if (x.scalar_type() == at::kBFloat16)
    argmax_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), x.size(0), x.size(1),
                out.data_ptr<int64_t>());
  else if (x.scalar_type() == at::kFloat)
    argmax_rows(x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1), out.data_ptr<int64_t>());
  else
    TORCH_CHECK(false, "argmax: bf16 or fp32");
  return out;
}

}  // namespace kvgate
