// What kvgate's CPU kernels (engine/csrc/kernels/) share: the build's widest float vector as a
// handful of operations, bf16 and fp8 widening, the softmax exponential, and the paged cache's
// slot arithmetic and argument checks. Everything here is inline; each ISA variant of the
// library compiles it with its own vectors.

#pragma once

#include <ATen/core/Tensor.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace kvgate {

using BF16 = c10::BFloat16;

// fp8 e4m3 cache entries, as stored. Vectors widen them with integer ops: the 7 magnitude bits
// shifted into an fp32's exponent and mantissa make 2^(e-127) * 1.m (or the fp32 subnormal
// 0.m * 2^-126), and a product with 2^120 rebiases that to e4m3's 2^(e-7) * 1.m (0.m * 2^-6),
// subnormals included; then the sign bit. Exact for every finite e4m3 value (the cache holds
// no NaN: `quantize_fp8` clamps to +-448). Scalars use c10's conversion.
struct Fp8 {
  uint8_t bits;
};

inline float widen(float x) { return x; }
inline float widen(BF16 x) { return static_cast<float>(x); }
inline float widen(Fp8 x) {
  return static_cast<float>(c10::Float8_e4m3fn(x.bits, c10::Float8_e4m3fn::from_bits()));
}

#if defined(__AVX512F__) || defined(__AVX2__)
// Eight 8-float vectors -> one whose lane i is the sum of v[i]'s lanes: a tree of horizontal
// adds, 9 operations for 8 sums where 8 separate reductions take 32.
inline __m256 transpose_sum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  // u0 = [v0..v3's sums of lanes 0-3 | v0..v3's sums of lanes 4-7], u1 likewise for v4..v7
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// The widest float vector of the build (AVX-512 or AVX2, by the library's ISA variant); a plain
// float elsewhere. GCC and Clang give the vector types + - * /; a bf16 is the top half
// of an fp32, so it widens by a shift.
#if defined(__AVX512F__)
constexpr int64_t kWidth = 16;
using Vec = __m512;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec splat(float x) { return _mm512_set1_ps(x); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const BF16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline Vec load(const Fp8* p) {  // see Fp8
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i magnitude = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7F)), 20);
  const __m512 value = _mm512_mul_ps(_mm512_castsi512_ps(magnitude), _mm512_set1_ps(0x1p120f));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign));
}
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline void store(BF16* p, Vec v) {  // rounded to nearest even, NaN kept quiet: as c10 rounds
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded,
                                    _mm512_set1_epi32(0x7FC00000));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float sum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline float max(Vec v) { return _mm512_reduce_max_ps(v); }
inline Vec vabs(Vec v) { return _mm512_abs_ps(v); }
inline Vec floor(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline Vec pow2(Vec n) { return _mm512_scalef_ps(_mm512_set1_ps(1.f), n); }  // n integral
inline Vec if_nonnegative(Vec x, Vec a, Vec b) {  // a where x >= 0, else b
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), b, a);
}
// kWidth vectors -> one whose lane i is the sum of v[i]'s lanes: each folded to the sum of its
// two 8-float halves, then two trees of eight.
inline Vec transpose_sum(const Vec* v) {
  __m256 halves[16];
  for (int i = 0; i < 16; ++i)
    halves[i] = _mm256_add_ps(_mm512_castps512_ps256(v[i]),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[i]), 1)));
  const __m256d low = _mm256_castps_pd(transpose_sum8(halves));
  const __m256d high = _mm256_castps_pd(transpose_sum8(halves + 8));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(low), high, 1));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kWidth = 8;
using Vec = __m256;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec splat(float x) { return _mm256_set1_ps(x); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const BF16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline Vec load(const Fp8* p) {  // see Fp8
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7F)), 20);
  const __m256 value = _mm256_mul_ps(_mm256_castsi256_ps(magnitude), _mm256_set1_ps(0x1p120f));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(value), sign));
}
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline void store(BF16* p, Vec v) {  // rounded to nearest even, NaN kept quiet: as c10 rounds
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  rounded = _mm256_castps_si256(_mm256_blendv_ps(
      _mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
      _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i halves = _mm256_srli_epi32(rounded, 16);  // each below 2^16: packs unsaturated
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(halves, halves), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float sum(Vec v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline float max(Vec v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
inline Vec vabs(Vec v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }
inline Vec floor(Vec v) { return _mm256_floor_ps(v); }
inline Vec pow2(Vec n) {  // n integral, within the normal exponents
  const __m256i bits = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 23));
}
inline Vec if_nonnegative(Vec x, Vec a, Vec b) {
  return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
}
inline Vec transpose_sum(const Vec* v) { return transpose_sum8(v); }
#else
constexpr int64_t kWidth = 1;
using Vec = float;
inline Vec zero() { return 0.f; }
inline Vec splat(float x) { return x; }
inline Vec load(const float* p) { return *p; }
inline Vec load(const BF16* p) { return static_cast<float>(*p); }
inline Vec load(const Fp8* p) { return widen(*p); }
inline void store(float* p, Vec v) { *p = v; }
inline void store(BF16* p, Vec v) { *p = static_cast<BF16>(v); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return a * b + c; }
inline float sum(Vec v) { return v; }
inline Vec vmax(Vec a, Vec b) { return std::max(a, b); }
inline float max(Vec v) { return v; }
inline Vec vabs(Vec v) { return std::fabs(v); }
inline Vec floor(Vec v) { return std::floor(v); }
inline Vec pow2(Vec n) { return std::ldexp(1.f, static_cast<int>(n)); }
inline Vec if_nonnegative(Vec x, Vec a, Vec b) { return x >= 0.f ? a : b; }
inline Vec transpose_sum(const Vec* v) { return v[0]; }
#endif

// Accumulators a kernel's inner loop may hold: half the build's vector registers, the rest
// left to the operands.
#if defined(__AVX512F__)
constexpr int64_t kAccumulatorRegs = 16;
#elif defined(__AVX2__)
constexpr int64_t kAccumulatorRegs = 8;
#else
constexpr int64_t kAccumulatorRegs = 1;
#endif

// vdpbf16ps: bf16 pairs multiplied and summed into fp32, no widening.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

// e^x for x <= 0 (softmax arguments, sigmoids of -|x|), Cephes' expf: 2^n * p(r),
// r = x - n ln 2, |r| <= ln2/2; within 2 ulp of expf. Below -87 (where e^x leaves the normal
// floats) it gives ~e^-87, not 0.
inline Vec exp_nonpositive(Vec x) {
  x = vmax(x, splat(-87.f));
  const Vec n = floor(fmadd(x, splat(1.44269504088896341f), splat(0.5f)));
  Vec r = fmadd(n, splat(-0.693359375f), x);
  r = fmadd(n, splat(2.12194440e-4f), r);
  Vec p = splat(1.9875691500e-4f);
  p = fmadd(p, r, splat(1.3981999507e-3f));
  p = fmadd(p, r, splat(8.3334519073e-3f));
  p = fmadd(p, r, splat(4.1665795894e-2f));
  p = fmadd(p, r, splat(1.6666665459e-1f));
  p = fmadd(p, r, splat(5.0000001201e-1f));
  p = fmadd(p, r * r, r + splat(1.f));
  return p * pow2(n);
}

// The paged KV cache ([blocks, kv_heads, block_size, D], engine/attention/kv_cache.py): the
// row of key position `pos` of KV head `head` in a sequence whose block table is `table`.
inline int64_t cache_slot(const int32_t* table, int64_t pos, int64_t kv_heads, int64_t head,
                          int64_t block_size) {
  return (static_cast<int64_t>(table[pos / block_size]) * kv_heads + head) * block_size +
         pos % block_size;
}

// The checks every kernel over the paged cache makes before reading it (`who` names the
// kernel in the error): CPU tensors, caches of q's dtype or fp8 e4m3 with contiguous fp32
// per-token scales, int32 tables. Returns whether the cache is fp8.
inline bool check_cache(const char* who, const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& k_scales,
                        const at::Tensor& v_scales, const at::Tensor& block_tables) {
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &k_scales, &v_scales, &block_tables})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), who,
                ": contiguous CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(1) == 0 &&
                  block_tables.dim() == 2,
              who, ": bad shapes");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (fp8 || q.scalar_type() == k_cache.scalar_type()),
              who, ": the caches must share q's dtype or be fp8 e4m3");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, who,
              ": bf16 or fp32 queries only");
  if (fp8) {
    const auto rows = k_cache.sizes().slice(0, 3);
    TORCH_CHECK(k_scales.sizes() == rows && v_scales.sizes() == rows &&
                    k_scales.scalar_type() == at::kFloat && v_scales.scalar_type() == at::kFloat,
                who, ": an fp8 cache needs fp32 scales [blocks, Hkv, block]");
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kInt, who, ": int32 block tables only");
  return fp8;
}

// A sequence of `len` keys over block table `table` (`width` entries) reads only blocks the
// cache holds: checked before any is read.
inline void check_sequence(const char* who, const int32_t* table, int64_t width, int64_t len,
                           int64_t block_size, int64_t blocks) {
  TORCH_CHECK(len > 0 && len <= width * block_size, who, ": seq_len out of range");
  for (int64_t j = 0; j < (len + block_size - 1) / block_size; ++j)
    TORCH_CHECK(table[j] >= 0 && table[j] < blocks, who, ": block id out of range");
}

}  // namespace kvgate
