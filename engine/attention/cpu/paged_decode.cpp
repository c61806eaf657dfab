// Paged decode attention on the CPU, reading K/V where they lie in the cache.
//
// One query token per sequence. Work items are (sequence, KV head) pairs: the G query heads
// sharing a KV head walk that head's blocks once for the scores and once for the values,
// in fp32 throughout (a bf16 or fp8 cache is widened as it is read, fp8's per-token scales
// applied to the scores and the weights), so nothing is gathered or padded and each K/V byte
// is read from memory once. Block by block: a block's rows are contiguous, so no key costs
// an index division, and kWidth keys' dot products are reduced in one shuffle tree. Built at
// first use by engine/attention/cpu/__init__.py with -O3 -march=native, which picks the
// AVX-512 or AVX2+FMA vectors below (scalar elsewhere).

#include "kvgate_entries.h"
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

// The K or V rows of one sequence's KV head (keys from position ``first``), walked a block at
// a time: within a block a head's rows are contiguous, and so are fp8's per-token scales.
template <typename T>
struct Rows {
  const T* cache;
  const float* scales;  // [blocks, kv_heads, block_size], or nullptr
  const int32_t* table;
  int64_t first, keys, kv_heads, head, block_size, dim;

  // fn(key, rows, scales, n) for each run of n keys sharing a block: rows [n, dim] from key
  // ``key`` on, scales [n] (nullptr: all 1). The block after next is prefetched first (the
  // blocks lie anywhere in the cache: the hardware prefetcher cannot guess the jump).
  template <typename Fn>
  void for_each_block(Fn&& fn) const {
    for (int64_t key = 0; key < keys;) {
      const int64_t pos = first + key, block = pos / block_size, offset = pos % block_size;
      const int64_t n = std::min(block_size - offset, keys - key);
      if (key == 0) prefetch(block + 1);
      prefetch(block + 2);
      const int64_t slot = (static_cast<int64_t>(table[block]) * kv_heads + head) * block_size + offset;
      fn(key, cache + slot * dim, scales == nullptr ? nullptr : scales + slot, n);
      key += n;
    }
  }

  void prefetch(int64_t block) const {
    if (block * block_size >= first + keys) return;
    const int64_t slot = (static_cast<int64_t>(table[block]) * kv_heads + head) * block_size;
    const char* rows = reinterpret_cast<const char*>(cache + slot * dim);
    const int64_t bytes = block_size * dim * static_cast<int64_t>(sizeof(T));
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(rows + offset);
    if (scales != nullptr) __builtin_prefetch(scales + slot);
  }
};

// ``Vectors`` vectors of kWidth floats make one head; fixed at compile time, the accumulators
// of a head stay in registers.
template <typename T, int64_t Vectors>
struct Head {
  // q . k as kWidth partial sums (their total is the dot product).
  static Vec dot_lanes(const float* q, const T* k) {
    Vec partial[Vectors];
#pragma GCC unroll 32
    for (int64_t i = 0; i < Vectors; ++i) partial[i] = load(q + i * kWidth) * load(k + i * kWidth);
#pragma GCC unroll 32
    for (int64_t live = Vectors; live > 1; live = (live + 1) / 2)  // pairwise, any count
      for (int64_t i = 0; i < live / 2; ++i) partial[i] = partial[i] + partial[i + (live + 1) / 2];
    return partial[0];
  }

  // scores[g * stride + i] = q_g . rows[i] * scales[i] for the n rows of one block and each of
  // the group's queries: kWidth keys' partial sums reduced together (`transpose_sum`), the
  // rows read from L1 for every query after the first.
  static void score(const float* q, int64_t group, const T* rows, const float* scales, int64_t n,
                    float* scores, int64_t stride) {
    int64_t i = 0;
    for (; i + kWidth <= n; i += kWidth)
      for (int64_t g = 0; g < group; ++g) {
        Vec partial[kWidth];
        for (int64_t j = 0; j < kWidth; ++j)
          partial[j] = dot_lanes(q + g * Vectors * kWidth, rows + (i + j) * Vectors * kWidth);
        Vec s = transpose_sum(partial);
        if (scales != nullptr) s = s * load(scales + i);
        store(scores + g * stride + i, s);
      }
    for (; i < n; ++i)
      for (int64_t g = 0; g < group; ++g)
        scores[g * stride + i] = sum(dot_lanes(q + g * Vectors * kWidth, rows + i * Vectors * kWidth)) *
                                 (scales == nullptr ? 1.f : scales[i]);
  }

  // out += sum over the n rows of weights[i] * scales[i] * rows[i]. Two keys at a time where a
  // head is 4 vectors or fewer: FMA chains enough to hide their latency.
  static void accumulate(const float* weights, const T* rows, const float* scales, int64_t n,
                         float* out) {
    constexpr int64_t Sets = Vectors <= 4 ? 2 : 1;
    Vec acc[Sets][Vectors];
#pragma GCC unroll 32
    for (int64_t i = 0; i < Vectors; ++i) {
      acc[0][i] = load(out + i * kWidth);
      if constexpr (Sets == 2) acc[1][i] = zero();
    }
    int64_t key = 0;
    for (; key + Sets <= n; key += Sets)
#pragma GCC unroll 2
      for (int64_t set = 0; set < Sets; ++set) {
        const int64_t k = key + set;
        const Vec w = splat(scales == nullptr ? weights[k] : weights[k] * scales[k]);
        const T* v = rows + k * Vectors * kWidth;
#pragma GCC unroll 32
        for (int64_t i = 0; i < Vectors; ++i) acc[set][i] = fmadd(w, load(v + i * kWidth), acc[set][i]);
      }
    for (; key < n; ++key) {
      const Vec w = splat(scales == nullptr ? weights[key] : weights[key] * scales[key]);
      const T* v = rows + key * Vectors * kWidth;
#pragma GCC unroll 32
      for (int64_t i = 0; i < Vectors; ++i) acc[0][i] = fmadd(w, load(v + i * kWidth), acc[0][i]);
    }
#pragma GCC unroll 32
    for (int64_t i = 0; i < Vectors; ++i) {
      if constexpr (Sets == 2) acc[0][i] = acc[0][i] + acc[1][i];
      store(out + i * kWidth, acc[0][i]);
    }
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
  using H = Head<TC, Vectors>;
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
    std::vector<float> qf(group * dim), acc(group * dim), scores;
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

      // Scores [group, keys]: each key of this head read once, against the group's queries.
      k_rows.for_each_block([&](int64_t key, const TC* rows, const float* row_scales, int64_t n) {
        H::score(qf.data(), group, rows, row_scales, n, scores.data() + key, keys);
      });
      if (cap > 0.f)
        for (float& s : scores) s = cap * std::tanh(s / cap);
      for (int64_t g = 0; g < group; ++g) softmax(scores.data() + g * keys, keys);

      // Values: each block's rows read once from memory, then from L1 for the group's others.
      std::fill(acc.begin(), acc.end(), 0.f);
      v_rows.for_each_block([&](int64_t key, const TC* rows, const float* row_scales, int64_t n) {
        for (int64_t g = 0; g < group; ++g)
          H::accumulate(scores.data() + g * keys + key, rows, row_scales, n, acc.data() + g * dim);
      });
      TQ* o = out_ptr + (seq * heads + head * group) * dim;
      for (int64_t i = 0; i < group * dim; ++i) o[i] = static_cast<TQ>(acc[i]);
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
  m.def("entries", [] { return kvgate::Entries{{"paged_decode", kvgate::address(&paged_decode)}}; },
        "the address of paged_decode for other extensions (kvgate_entries.h)");
}
