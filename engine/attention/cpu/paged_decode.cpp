// Paged decode attention on the CPU, reading K/V where they lie in the cache.
//
// One query token per sequence. Work items are (sequence, KV head) pairs: the G query heads
// sharing a KV head walk that head's blocks once for the scores and once for the values,
// in fp32 throughout (a bf16 or fp8 cache is widened as it is read, fp8's per-token scales
// applied to the scores and the weights), so nothing is gathered or padded and each K/V byte
// is read once. Built at first use by engine/attention/cpu/__init__.py
// with -O3 -march=native, which picks the AVX-512 or AVX2+FMA vectors below (scalar elsewhere).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// fp8 e4m3 cache entries, as stored. Vectors widen them with integer ops (widen_fp8): the 7
// magnitude bits shifted into an fp32's exponent and mantissa make 2^(e-127) * 1.m (or the
// fp32 subnormal 0.m * 2^-126), and a product with 2^120 rebiases that to e4m3's 2^(e-7) * 1.m
// (0.m * 2^-6), subnormals included; then the sign bit. Exact for every finite e4m3 value (the
// cache holds no NaN: `quantize_fp8` clamps to +-448). The scalar build uses c10's conversion.
struct Fp8 {
  uint8_t bits;
};

// The widest float vector the build targets, as a handful of operations; caches of bf16 are
// widened on load (a bf16 is the top half of an fp32).
#if defined(__AVX512F__)
constexpr int64_t kWidth = 16;
using Vec = __m512;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec splat(float x) { return _mm512_set1_ps(x); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const c10::BFloat16* p) {
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
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float sum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline float max(Vec v) { return _mm512_reduce_max_ps(v); }
inline Vec floor(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline Vec pow2(Vec n) { return _mm512_scalef_ps(_mm512_set1_ps(1.f), n); }  // n integral
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kWidth = 8;
using Vec = __m256;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec splat(float x) { return _mm256_set1_ps(x); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const c10::BFloat16* p) {
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
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
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
inline Vec floor(Vec v) { return _mm256_floor_ps(v); }
inline Vec pow2(Vec n) {  // n integral, within the normal exponents
  const __m256i bits = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 23));
}
#else
constexpr int64_t kWidth = 1;
using Vec = float;
inline Vec zero() { return 0.f; }
inline Vec splat(float x) { return x; }
inline Vec load(const float* p) { return *p; }
inline Vec load(const c10::BFloat16* p) { return static_cast<float>(*p); }
inline Vec load(const Fp8* p) {
  return static_cast<float>(c10::Float8_e4m3fn(p->bits, c10::Float8_e4m3fn::from_bits()));
}
inline void store(float* p, Vec v) { *p = v; }
inline Vec fma(Vec a, Vec b, Vec c) { return a * b + c; }
inline float sum(Vec v) { return v; }
inline Vec vmax(Vec a, Vec b) { return std::max(a, b); }
inline float max(Vec v) { return v; }
inline Vec floor(Vec v) { return std::floor(v); }
inline Vec pow2(Vec n) { return std::ldexp(1.f, static_cast<int>(n)); }
#endif

// e^x for x <= 0 (softmax arguments), Cephes' expf: 2^n * p(r), r = x - n ln 2, |r| <= ln2/2;
// within 2 ulp of expf. Below -87 (where e^x leaves the normal floats) it gives ~e^-87.
inline Vec exp_nonpositive(Vec x) {
  x = vmax(x, splat(-87.f));
  const Vec n = floor(fma(x, splat(1.44269504088896341f), splat(0.5f)));
  Vec r = fma(n, splat(-0.693359375f), x);
  r = fma(n, splat(2.12194440e-4f), r);
  Vec p = splat(1.9875691500e-4f);
  p = fma(p, r, splat(1.3981999507e-3f));
  p = fma(p, r, splat(8.3334519073e-3f));
  p = fma(p, r, splat(4.1665795894e-2f));
  p = fma(p, r, splat(1.6666665459e-1f));
  p = fma(p, r, splat(5.0000001201e-1f));
  p = fma(p, r * r, r + splat(1.f));
  return p * pow2(n);
}

// In place: s = softmax(s) over n floats.
inline void softmax(float* s, int64_t n) {
  const int64_t whole = n - n % kWidth;
  Vec top_v = splat(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < whole; i += kWidth) top_v = vmax(top_v, load(s + i));
  float top = max(top_v);
  for (int64_t i = whole; i < n; ++i) top = std::max(top, s[i]);
  Vec total_v = zero();
  for (int64_t i = 0; i < whole; i += kWidth) {
    const Vec e = exp_nonpositive(load(s + i) - splat(top));
    store(s + i, e);
    total_v = total_v + e;
  }
  float total = sum(total_v);
  for (int64_t i = whole; i < n; ++i) {
    s[i] = std::exp(s[i] - top);
    total += s[i];
  }
  const Vec inv = splat(1.f / total);
  for (int64_t i = 0; i < whole; i += kWidth) store(s + i, load(s + i) * inv);
  for (int64_t i = whole; i < n; ++i) s[i] *= 1.f / total;
}

// The K or V rows of one sequence's KV head, by key index (keys from position ``first``),
// and each row's scale (fp8 caches: per token and head; 1 otherwise).
template <typename T>
struct Rows {
  const T* cache;
  const float* scales;  // [blocks, kv_heads, block_size], or nullptr
  const int32_t* table;
  int64_t first, keys, kv_heads, head, block_size, dim;

  int64_t slot(int64_t key) const {
    const int64_t pos = first + key, block = table[pos / block_size];
    return (block * kv_heads + head) * block_size + pos % block_size;
  }

  const T* operator()(int64_t key) const { return cache + slot(key) * dim; }

  float scale(int64_t key) const { return scales == nullptr ? 1.f : scales[slot(key)]; }

  // At a block's first key, ask for the next block's rows (contiguous, but anywhere in the
  // cache: the hardware prefetcher cannot guess the jump).
  void prefetch_next_block(int64_t key) const {
    if ((first + key) % block_size != 0) return;
    if (key == 0) prefetch(key + block_size);
    prefetch(key + 2 * block_size);
  }

  void prefetch(int64_t key) const {
    if (key >= keys) return;
    const char* rows = reinterpret_cast<const char*>((*this)(key - (first + key) % block_size));
    const int64_t bytes = block_size * dim * static_cast<int64_t>(sizeof(T));
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(rows + offset);
  }
};

// ``Vectors`` vectors of kWidth floats make one head; fixed at compile time, the accumulators
// of a head stay in registers.
template <typename T, int64_t Vectors>
struct Head {
  static float dot(const float* q, const T* k) {
    Vec partial[Vectors];
#pragma GCC unroll 32
    for (int64_t i = 0; i < Vectors; ++i) partial[i] = load(q + i * kWidth) * load(k + i * kWidth);
#pragma GCC unroll 32
    for (int64_t live = Vectors; live > 1; live = (live + 1) / 2)  // pairwise, any count
      for (int64_t i = 0; i < live / 2; ++i) partial[i] = partial[i] + partial[i + (live + 1) / 2];
    return sum(partial[0]);
  }

  // out = sum over keys of weights[i] * rows(i), rows(i) a value row.
  static void weighted_sum(const float* weights, int64_t keys, const Rows<T>& rows, float* out) {
    Vec acc[Vectors];
#pragma GCC unroll 32
    for (int64_t i = 0; i < Vectors; ++i) acc[i] = zero();
    for (int64_t key = 0; key < keys; ++key) {
      rows.prefetch_next_block(key);
      const Vec w = splat(weights[key] * rows.scale(key));
      const T* v = rows(key);
#pragma GCC unroll 32
      for (int64_t i = 0; i < Vectors; ++i) acc[i] = fma(w, load(v + i * kWidth), acc[i]);
    }
#pragma GCC unroll 32
    for (int64_t i = 0; i < Vectors; ++i) store(out + i * kWidth, acc[i]);
  }
};

// A cache tensor's entries as T (fp8 has no typed pointer of its own here).
template <typename T>
const T* entries(const torch::Tensor& cache) {
  return reinterpret_cast<const T*>(cache.data_ptr());
}

template <typename TQ, typename TC, int64_t Vectors>
void decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
            const float* k_scales, const float* v_scales, const torch::Tensor& block_tables,
            const torch::Tensor& seq_lens, double scale, int64_t window, double softcap,
            torch::Tensor& out) {
  constexpr int64_t dim = Vectors * kWidth;
  const int64_t seqs = q.size(0), heads = q.size(1);
  const int64_t kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = heads / kv_heads, table_width = block_tables.size(1);
  const TQ* q_ptr = q.data_ptr<TQ>();
  const TC* k_ptr = entries<TC>(k_cache);
  const TC* v_ptr = entries<TC>(v_cache);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TQ* out_ptr = out.data_ptr<TQ>();
  const float cap = static_cast<float>(softcap);

  at::parallel_for(0, seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / kv_heads, head = item % kv_heads;
      const int64_t len = lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t keys = len - first;
      const int32_t* table = tables + seq * table_width;
      const Rows<TC> k_rows{k_ptr, k_scales, table, first, keys, kv_heads, head, block_size, dim};
      const Rows<TC> v_rows{v_ptr, v_scales, table, first, keys, kv_heads, head, block_size, dim};
      const TQ* q_heads = q_ptr + (seq * heads + head * group) * dim;
      for (int64_t i = 0; i < group * dim; ++i)
        qf[i] = static_cast<float>(q_heads[i]) * static_cast<float>(scale);
      scores.resize(group * keys);

      // Scores: each key of this head read once, against the group's queries.
      for (int64_t key = 0; key < keys; ++key) {
        k_rows.prefetch_next_block(key);
        const TC* k = k_rows(key);
        const float k_scale = k_rows.scale(key);
        for (int64_t g = 0; g < group; ++g) {
          float s = Head<TC, Vectors>::dot(qf.data() + g * dim, k) * k_scale;
          if (cap > 0.f) s = cap * std::tanh(s / cap);
          scores[g * keys + key] = s;
        }
      }
      TQ* o = out_ptr + (seq * heads + head * group) * dim;
      for (int64_t g = 0; g < group; ++g) {
        // Softmax in fp32, then the weighted values (this head's rows stay in L2 for the group).
        float* s = scores.data() + g * keys;
        softmax(s, keys);
        Head<TC, Vectors>::weighted_sum(s, keys, v_rows, acc.data());
        for (int64_t d = 0; d < dim; ++d) o[g * dim + d] = static_cast<TQ>(acc[d]);
      }
    }
  });
}

#define KVGATE_HEAD_VECTORS(X) X(1) X(2) X(4) X(5) X(6) X(8) X(10) X(12) X(16) X(32)

template <typename TQ, typename TC>
void decode_any(const torch::Tensor& q, const torch::Tensor& k_cache,
                const torch::Tensor& v_cache, const float* k_scales, const float* v_scales,
                const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                int64_t window, double softcap, torch::Tensor& out) {
  switch (q.size(2) % kWidth == 0 ? q.size(2) / kWidth : 0) {
#define KVGATE_DIM(n) \
  case n:             \
    return decode<TQ, TC, n>(q, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, \
                             scale, window, softcap, out);
    KVGATE_HEAD_VECTORS(KVGATE_DIM)
#undef KVGATE_DIM
    default:
      TORCH_CHECK(false, "paged_decode: head_dim ", q.size(2), " is not supported");
  }
}

}  // namespace

// q [B, Hq, D] bf16 or fp32; caches [blocks, Hkv, block_size, D] in q's dtype, or fp8 e4m3
// with fp32 scales [blocks, Hkv, block_size] (empty tensors otherwise); block_tables [B, W]
// int32; seq_lens [B] int32 (keys per sequence, the query's own included). window <= 0: none;
// softcap <= 0: none. Returns [B, Hq, D] in q's dtype.
torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, const torch::Tensor& k_scales,
                           const torch::Tensor& v_scales, const torch::Tensor& block_tables,
                           const torch::Tensor& seq_lens, double scale, int64_t window,
                           double softcap) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  k_scales.device().is_cpu() && v_scales.device().is_cpu() &&
                  block_tables.device().is_cpu() && seq_lens.device().is_cpu(),
              "paged_decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged_decode: bad shapes");
  const bool fp8 = k_cache.scalar_type() == torch::kFloat8_e4m3fn;
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (fp8 || q.scalar_type() == k_cache.scalar_type()),
              "paged_decode: the caches must share q's dtype or be fp8 e4m3");
  if (fp8) {
    const auto rows = k_cache.sizes().slice(0, 3);
    TORCH_CHECK(k_scales.sizes() == rows && v_scales.sizes() == rows &&
                    k_scales.scalar_type() == torch::kFloat32 &&
                    v_scales.scalar_type() == torch::kFloat32 && k_scales.is_contiguous() &&
                    v_scales.is_contiguous(),
                "paged_decode: an fp8 cache needs contiguous fp32 scales [blocks, Hkv, block]");
  }
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode: tensors must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 &&
                  seq_lens.scalar_type() == torch::kInt32,
              "paged_decode: block_tables and seq_lens must be int32");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(1) == 0 &&
                  block_tables.size(0) == q.size(0) && seq_lens.size(0) == q.size(0),
              "paged_decode: shapes disagree");
  const int64_t capacity = block_tables.size(1) * k_cache.size(2), blocks = k_cache.size(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t i = 0; i < seq_lens.size(0); ++i)
    TORCH_CHECK(lens[i] > 0 && lens[i] <= capacity, "paged_decode: seq_len out of range");
  for (int64_t i = 0; i < block_tables.numel(); ++i)
    TORCH_CHECK(tables[i] >= 0 && tables[i] < blocks, "paged_decode: block id out of range");
  const float* ks = fp8 ? k_scales.data_ptr<float>() : nullptr;
  const float* vs = fp8 ? v_scales.data_ptr<float>() : nullptr;
  auto out = torch::empty_like(q);
  const auto run = [&](auto query, auto entry) {
    using TQ = decltype(query);
    using TC = decltype(entry);
    decode_any<TQ, TC>(q, k_cache, v_cache, ks, vs, block_tables, seq_lens, scale, window,
                       softcap, out);
  };
  if (q.scalar_type() == torch::kBFloat16) {
    fp8 ? run(c10::BFloat16(), Fp8()) : run(c10::BFloat16(), c10::BFloat16());
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kFloat32, "paged_decode: bf16 or fp32 queries only");
    fp8 ? run(float(), Fp8()) : run(float(), float());
  }
  return out;
}

// The head sizes paged_decode takes on this build.
std::vector<int64_t> head_dims() {
  std::vector<int64_t> dims;
#define KVGATE_DIM(n) dims.push_back(n * kWidth);
  KVGATE_HEAD_VECTORS(KVGATE_DIM)
#undef KVGATE_DIM
  return dims;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("head_dims", &head_dims, "the head sizes paged_decode takes on this build");
  m.def("paged_decode", &paged_decode, "paged decode attention over the KV cache");
}
