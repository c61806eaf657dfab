// Paged decode attention on the CPU, reading K/V where they lie in the cache.
//
// One query token per sequence. Work items are (sequence, KV head) pairs: the G query heads
// sharing a KV head walk that head's blocks once for the scores and once for the values,
// in fp32 throughout (a bf16 or fp8 cache is widened as it is read, fp8's per-token scales
// applied to the scores and the weights), so nothing is gathered or padded and each K/V byte
// is read once. Built at first use by engine/attention/cpu/__init__.py
// with -O3 -march=native, which picks the AVX-512 or AVX2+FMA vectors below (scalar elsewhere).

#include "kvgate_simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using namespace kvgate;

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
    return cache_slot(table, first + key, kv_heads, head, block_size);
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
  const bool fp8 = check_cache("paged_decode", q, k_cache, v_cache, k_scales, v_scales,
                               block_tables);
  TORCH_CHECK(seq_lens.device().is_cpu() && seq_lens.is_contiguous() &&
                  seq_lens.scalar_type() == torch::kInt32,
              "paged_decode: seq_lens must be contiguous CPU int32");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && seq_lens.size(0) == q.size(0),
              "paged_decode: shapes disagree");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t i = 0; i < seq_lens.size(0); ++i)
    check_sequence("paged_decode", tables + i * block_tables.size(1), block_tables.size(1),
                   lens[i], k_cache.size(2), k_cache.size(0));
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
