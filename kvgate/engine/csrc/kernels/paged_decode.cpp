// Paged decode attention on the CPU, reading K/V where they lie in the cache.
//
// One query token per entry; entries at consecutive positions of one sequence (a step verifying
// drafted tokens) share their walk (`same_keys`). Work items are (sequence, KV head) pairs, or
// (sequence, span of adjacent KV heads) where sequences outnumber the threads: the G query heads sharing a KV
// head walk that head's blocks once for the scores and once for the values, so nothing is
// gathered or padded and each K/V byte is read from memory once. Block by block: a
// block's rows are contiguous, so no key costs an index division, and kWidth keys' dot
// products are reduced in one shuffle tree. Sums are fp32. A bf16 or fp8 row is widened once
// for all G queries (fp8's per-token scales applied to the scores and the weights); where the
// build has vdpbf16ps (AVX512-BF16), a bf16 cache is not widened at all (`PairsHead`). The
// library's ISA variant picks the AVX-512 or AVX2+FMA vectors below (scalar elsewhere).

#include "kvgate_simd.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace kvgate {
namespace {

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

// The K or V rows of `span` adjacent KV heads of one sequence from `head` on (keys from
// position ``first``), walked a block at a time: within a block the span's rows are contiguous
// (head after head), and so are fp8's per-token scales.
template <typename T>
struct Rows {
  const T* cache;
  const float* scales;  // [blocks, kv_heads, block_size], or nullptr
  const int32_t* table;
  int64_t first, keys, kv_heads, head, span, block_size, dim;

  // fn(h, key, rows, scales, n) for each run of n keys sharing a block and each head h of the
  // span (0 = `head`): that head's rows [n, dim] from key ``key`` on, scales [n] (nullptr: all
  // 1). The block after next is prefetched first (the blocks lie anywhere in the cache: the
  // hardware prefetcher cannot guess the jump).
  template <typename Fn>
  void for_each_block(Fn&& fn) const {
    for (int64_t key = 0; key < keys;) {
      const int64_t pos = first + key, block = pos / block_size, offset = pos % block_size;
      const int64_t n = std::min(block_size - offset, keys - key);
      if (key == 0) prefetch(block + 1);
      prefetch(block + 2);
      const int64_t slot = (static_cast<int64_t>(table[block]) * kv_heads + head) * block_size + offset;
      for (int64_t h = 0; h < span; ++h) {
        const int64_t at = slot + h * block_size;
        fn(h, key, cache + at * dim, scales == nullptr ? nullptr : scales + at, n);
      }
      key += n;
    }
  }

  void prefetch(int64_t block) const {
    if (block * block_size >= first + keys) return;
    const int64_t slot = (static_cast<int64_t>(table[block]) * kv_heads + head) * block_size;
    const char* rows = reinterpret_cast<const char*>(cache + slot * dim);
    const int64_t bytes = span * block_size * dim * static_cast<int64_t>(sizeof(T));
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(rows + offset);
    if (scales != nullptr)
      for (int64_t h = 0; h < span; ++h) __builtin_prefetch(scales + slot + h * block_size);
  }
};

// Queries of a group a value row is widened once for: as many as keep their accumulators
// (Vectors each) within kAccumulatorRegs, at most 4.
template <int64_t Vectors>
constexpr int64_t group_tile() {
  return std::clamp<int64_t>(kAccumulatorRegs / Vectors, 1, 4);
}

// ``Vectors`` vectors of kWidth floats make one head; fixed at compile time, the accumulators
// of a head stay in registers.
template <typename T, int64_t Vectors>
struct Head {
  static constexpr int64_t dim = Vectors * kWidth;

  // q . k as kWidth partial sums (their total is the dot product).
  template <typename K>
  static Vec dot_lanes(const float* q, const K* k) {
    Vec partial[Vectors];
#pragma GCC unroll 32
    for (int64_t i = 0; i < Vectors; ++i) partial[i] = load(q + i * kWidth) * load(k + i * kWidth);
#pragma GCC unroll 32
    for (int64_t live = Vectors; live > 1; live = (live + 1) / 2)  // pairwise, any count
      for (int64_t i = 0; i < live / 2; ++i) partial[i] = partial[i] + partial[i + (live + 1) / 2];
    return partial[0];
  }

  // scores[g * stride + i] = q_g . rows[i] * scales[i] for the n rows of one block and each of
  // the group's queries: kWidth keys' partial sums reduced together (`transpose_sum`). A bf16
  // or fp8 chunk of rows is widened once into `wide` (L1), not once per query.
  static void score(const float* q, int64_t group, const T* rows, const float* scales, int64_t n,
                    float* scores, int64_t stride) {
    alignas(64) float wide[std::is_same_v<T, float> ? 1 : kWidth * dim];
    int64_t i = 0;
    for (; i + kWidth <= n; i += kWidth) {
      const float* chunk;
      if constexpr (std::is_same_v<T, float>) {
        chunk = rows + i * dim;
      } else {
        for (int64_t j = 0; j < kWidth * Vectors; ++j)
          store(wide + j * kWidth, load(rows + i * dim + j * kWidth));
        chunk = wide;
      }
      for (int64_t g = 0; g < group; ++g) {
        Vec partial[kWidth];
        for (int64_t j = 0; j < kWidth; ++j) partial[j] = dot_lanes(q + g * dim, chunk + j * dim);
        Vec s = transpose_sum(partial);
        if (scales != nullptr) s = s * load(scales + i);
        store(scores + g * stride + i, s);
      }
    }
    for (; i < n; ++i)
      for (int64_t g = 0; g < group; ++g)
        scores[g * stride + i] = sum(dot_lanes(q + g * dim, rows + i * dim)) *
                                 (scales == nullptr ? 1.f : scales[i]);
  }

  // out[g] += sum over the n rows of weights[g * stride + i] * scales[i] * rows[i] for the
  // group's queries, Tile at a time: each row vector widened once for the tile's queries.
  template <int64_t Tile>
  static void accumulate_tile(const float* weights, int64_t stride, const T* rows,
                              const float* scales, int64_t n, float* out) {
    Vec acc[Tile][Vectors];
#pragma GCC unroll 4
    for (int64_t g = 0; g < Tile; ++g)
#pragma GCC unroll 32
      for (int64_t i = 0; i < Vectors; ++i) acc[g][i] = load(out + g * dim + i * kWidth);
    for (int64_t key = 0; key < n; ++key) {
      const float scale = scales == nullptr ? 1.f : scales[key];
      Vec w[Tile];
#pragma GCC unroll 4
      for (int64_t g = 0; g < Tile; ++g) w[g] = splat(weights[g * stride + key] * scale);
      const T* v = rows + key * dim;
#pragma GCC unroll 32
      for (int64_t i = 0; i < Vectors; ++i) {
        const Vec vv = load(v + i * kWidth);
#pragma GCC unroll 4
        for (int64_t g = 0; g < Tile; ++g) acc[g][i] = fmadd(w[g], vv, acc[g][i]);
      }
    }
#pragma GCC unroll 4
    for (int64_t g = 0; g < Tile; ++g)
#pragma GCC unroll 32
      for (int64_t i = 0; i < Vectors; ++i) store(out + g * dim + i * kWidth, acc[g][i]);
  }

  // The group in tiles of Tile queries, what is left in smaller ones.
  template <int64_t Tile = group_tile<Vectors>()>
  static void accumulate(const float* weights, int64_t stride, int64_t group, const T* rows,
                         const float* scales, int64_t n, float* out) {
    int64_t g = 0;
    for (; g + Tile <= group; g += Tile)
      accumulate_tile<Tile>(weights + g * stride, stride, rows, scales, n, out + g * dim);
    if constexpr (Tile > 1)
      if (g < group)
        accumulate<Tile - 1>(weights + g * stride, stride, group - g, rows, scales, n, out + g * dim);
  }
};

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bf16 queries over a bf16 cache, on vdpbf16ps: nothing is widened. Scores multiply the stored
// pairs of dimensions as they are; values take the softmax weights rounded to bf16 (as the
// prefill kernel's do) and pair two keys' rows a dimension at a time (`unpack`), so their
// accumulators hold the head's dimensions permuted (`at` reads them back in order). A head is
// Chunks vectors of 32 bf16.
template <int64_t Chunks>
struct PairsHead {
  static constexpr int64_t dim = Chunks * 32;
  static constexpr int64_t Vectors = 2 * Chunks;  // fp32 accumulators per query

  static __m512bh chunk(const BF16* p, int64_t c) {
    return (__m512bh)_mm512_loadu_si512(p + c * 32);
  }

  // scores[g * stride + i] = (q_g . rows[i]) * scale: kWidth keys' partial sums reduced together.
  static void score(const BF16* q, int64_t group, const BF16* rows, int64_t n, float scale,
                    float* scores, int64_t stride) {
    int64_t i = 0;
    for (; i + kWidth <= n; i += kWidth)
      for (int64_t g = 0; g < group; ++g) {
        __m512bh qv[Chunks];
#pragma GCC unroll 16
        for (int64_t c = 0; c < Chunks; ++c) qv[c] = chunk(q + g * dim, c);
        Vec partial[kWidth];
#pragma GCC unroll 16
        for (int64_t j = 0; j < kWidth; ++j) {
          Vec s = zero();
#pragma GCC unroll 16
          for (int64_t c = 0; c < Chunks; ++c) s = _mm512_dpbf16_ps(s, qv[c], chunk(rows + (i + j) * dim, c));
          partial[j] = s;
        }
        store(scores + g * stride + i, transpose_sum(partial) * splat(scale));
      }
    for (; i < n; ++i)
      for (int64_t g = 0; g < group; ++g) {
        Vec s = zero();
        for (int64_t c = 0; c < Chunks; ++c)
          s = _mm512_dpbf16_ps(s, chunk(q + g * dim, c), chunk(rows + i * dim, c));
        scores[g * stride + i] = sum(s) * scale;
      }
  }

  // out[g] (permuted) += sum over the n rows of weights[g * stride + i] * rows[i], two keys per
  // vdpbf16ps: weights are bf16, their pair (i, i+1) one 32-bit word; an odd last key is paired
  // with a zero row and a zero weight.
  template <int64_t Tile>
  static void accumulate_tile(const uint16_t* weights, int64_t stride, const BF16* rows,
                              int64_t n, float* out) {
    Vec acc[Tile][Vectors];
#pragma GCC unroll 4
    for (int64_t g = 0; g < Tile; ++g)
#pragma GCC unroll 32
      for (int64_t i = 0; i < Vectors; ++i) acc[g][i] = load(out + g * dim + i * kWidth);
    for (int64_t key = 0; key < n; key += 2) {
      const bool pair = key + 1 < n;
      __m512bh w[Tile];
#pragma GCC unroll 4
      for (int64_t g = 0; g < Tile; ++g) {
        uint32_t word = weights[g * stride + key];
        if (pair) word |= static_cast<uint32_t>(weights[g * stride + key + 1]) << 16;
        w[g] = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(word));
      }
      const BF16* a = rows + key * dim;
#pragma GCC unroll 16
      for (int64_t c = 0; c < Chunks; ++c) {
        const __m512i x = _mm512_loadu_si512(a + c * 32);
        const __m512i y = pair ? _mm512_loadu_si512(a + dim + c * 32) : _mm512_setzero_si512();
        const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(x, y);
        const __m512bh high = (__m512bh)_mm512_unpackhi_epi16(x, y);
#pragma GCC unroll 4
        for (int64_t g = 0; g < Tile; ++g) {
          acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], w[g], low);
          acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], w[g], high);
        }
      }
    }
#pragma GCC unroll 4
    for (int64_t g = 0; g < Tile; ++g)
#pragma GCC unroll 32
      for (int64_t i = 0; i < Vectors; ++i) store(out + g * dim + i * kWidth, acc[g][i]);
  }

  template <int64_t Tile = group_tile<Vectors>()>
  static void accumulate(const uint16_t* weights, int64_t stride, int64_t group,
                         const BF16* rows, int64_t n, float* out) {
    int64_t g = 0;
    for (; g + Tile <= group; g += Tile)
      accumulate_tile<Tile>(weights + g * stride, stride, rows, n, out + g * dim);
    if constexpr (Tile > 1)
      if (g < group) accumulate<Tile - 1>(weights + g * stride, stride, group - g, rows, n, out + g * dim);
  }

  // Accumulator lane 4l + t of vector 2c (2c + 1) holds dimension 32c + 8l + t (+ 4): the
  // 128-bit lanes unpack interleaves.
  static float at(const float* permuted, int64_t d) {
    const int64_t c = d / 32, l = d % 32 / 8, t = d % 8;
    return permuted[(2 * c + t / 4) * kWidth + 4 * l + t % 4];
  }
};
#endif

// Entries first..first+count-1 of a batch that read the same cache blocks, each no further
// than the next: a step verifying drafted tokens asks for one sequence at consecutive
// positions. They are walked as one, each block read once for all of them (a verifying row
// otherwise reads the whole context again: at 1,000 tokens of SmolLM2-135M, ~3 ms a row).
// Each row's arithmetic is the one it gets alone: the same keys in the same runs, its last
// block's run ending at its own length.
struct SameKeys {
  int64_t first, count;
};

std::vector<SameKeys> same_keys(const int32_t* tables, int64_t width, const int32_t* lens,
                                int64_t seqs, int64_t block_size, int64_t window,
                                int64_t kv_heads, int64_t threads) {
  std::vector<SameKeys> runs;
  for (int64_t i = 0; i < seqs; ++i) {
    if (!runs.empty() && window <= 0) {  // a window starts each row's keys elsewhere
      SameKeys& run = runs.back();
      const int64_t prev = run.first + run.count - 1;
      const int64_t blocks = (lens[prev] + block_size - 1) / block_size;
      if (lens[i] >= lens[prev] &&
          std::equal(tables + prev * width, tables + prev * width + blocks, tables + i * width)) {
        ++run.count;
        continue;
      }
    }
    runs.push_back({i, 1});
  }
  // Fewer items than two a thread: halve the largest runs (each half reads the blocks again,
  // cheaper than an idle thread).
  while (static_cast<int64_t>(runs.size()) * kv_heads < 2 * threads) {
    const auto largest = std::max_element(
        runs.begin(), runs.end(), [](SameKeys a, SameKeys b) { return a.count < b.count; });
    if (largest->count < 2) break;
    const SameKeys front{largest->first, largest->count / 2};
    largest->first += front.count;
    largest->count -= front.count;
    runs.insert(largest, front);
  }
  return runs;
}

// A cache tensor's entries as T (fp8 has no typed pointer of its own here).
template <typename T>
const T* entries(const at::Tensor& cache) {
  return reinterpret_cast<const T*>(cache.data_ptr());
}

template <typename TQ, typename TC, int64_t Vectors>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const float* k_scales, const float* v_scales, const at::Tensor& block_tables,
            const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
            at::Tensor& out) {
  using H = Head<TC, Vectors>;
  constexpr int64_t dim = Vectors * kWidth;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  constexpr bool pairs = std::is_same_v<TC, BF16> && Vectors % 2 == 0;
  using P = PairsHead<Vectors / 2>;
#else
  constexpr bool pairs = false;
#endif
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
  const int64_t threads = at::get_num_threads();
  const std::vector<SameKeys> runs_of =
      same_keys(tables, table_width, lens, seqs, block_size, window, kv_heads, threads);
  // KV heads an item walks together: as many as leave two items a thread, so that where
  // sequences are many each block is read whole (its heads lie side by side), not a head's
  // rows at a time.
  const int64_t runs = static_cast<int64_t>(runs_of.size());
  int64_t span = 1;
  for (int64_t s = 2; s <= kv_heads; ++s)
    if (kv_heads % s == 0 && runs * (kv_heads / s) >= 2 * threads) span = s;
  const int64_t parts = kv_heads / span;

  at::parallel_for(0, runs * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<TQ> qs;     // the pairs path's queries, gathered
    std::vector<float> qf, acc, scores;
    std::vector<uint16_t> weights;  // the pairs path's softmax weights, as bf16
    for (int64_t item = begin; item < end; ++item) {
      const SameKeys run = runs_of[item / parts];
      const int64_t head = item % parts * span;
      // Row r is entry last - r: the longest first, so the rows reading a whole run of keys
      // are always rows 0..c-1.
      const int64_t count = run.count, last = run.first + count - 1;
      const auto entry = [&](int64_t r) { return last - r; };
      const auto len = [&](int64_t r) { return static_cast<int64_t>(lens[entry(r)]); };
      const int64_t first = window > 0 ? std::max<int64_t>(0, len(0) - window) : 0;
      const auto keys_of = [&](int64_t r) { return len(r) - first; };
      const int64_t keys = keys_of(0), rq = count * group, queries = span * rq;
      const int32_t* table = tables + last * table_width;
      const Rows<TC> k_rows{k_ptr, k_scales, table, first, keys, kv_heads, head, span, block_size, dim};
      const Rows<TC> v_rows{v_ptr, v_scales, table, first, keys, kv_heads, head, span, block_size, dim};
      // Query (h, r, g) at (h * count + r) * group + g: a head's rows' queries side by side.
      const auto query_at = [&](int64_t h, int64_t r) {
        return q_ptr + (entry(r) * heads + (head + h) * group) * dim;
      };
      scores.resize(queries * keys);
      // fn(c, at, n) for the run of n keys from `key` of head h: rows 0..c-1 read all n (the
      // run is theirs too), then each shorter row its own n_r < n (its run, as it would walk
      // alone: its last block ends at its own length).
      const auto split = [&](int64_t key, int64_t n, auto&& fn) {
        int64_t c = 1;
        while (c < count && keys_of(c) >= key + n) ++c;
        fn(0, c, n);
        for (int64_t r = c; r < count && keys_of(r) > key; ++r) fn(r, 1, keys_of(r) - key);
      };

      // Scores [queries, keys]: each key of each head read once, against every row's queries.
      if constexpr (pairs) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        qs.resize(queries * dim);
        for (int64_t h = 0; h < span; ++h)
          for (int64_t r = 0; r < count; ++r)
            std::copy_n(query_at(h, r), group * dim, qs.data() + (h * count + r) * group * dim);
        k_rows.for_each_block([&](int64_t h, int64_t key, const TC* rows, const float*, int64_t n) {
          split(key, n, [&](int64_t r, int64_t c, int64_t m) {
            P::score(qs.data() + (h * count + r) * group * dim, c * group, rows, m,
                     static_cast<float>(scale), scores.data() + (h * count + r) * group * keys + key,
                     keys);
          });
        });
#endif
      } else {
        qf.resize(queries * dim);
        for (int64_t h = 0; h < span; ++h)
          for (int64_t r = 0; r < count; ++r) {
            const TQ* from = query_at(h, r);
            float* to = qf.data() + (h * count + r) * group * dim;
            for (int64_t i = 0; i < group * dim; ++i)
              to[i] = static_cast<float>(from[i]) * static_cast<float>(scale);
          }
        k_rows.for_each_block([&](int64_t h, int64_t key, const TC* rows, const float* row_scales,
                                  int64_t n) {
          split(key, n, [&](int64_t r, int64_t c, int64_t m) {
            H::score(qf.data() + (h * count + r) * group * dim, c * group, rows, row_scales, m,
                     scores.data() + (h * count + r) * group * keys + key, keys);
          });
        });
      }
      for (int64_t h = 0; h < span; ++h)
        for (int64_t r = 0; r < count; ++r)
          for (int64_t g = 0; g < group; ++g) {
            float* row = scores.data() + ((h * count + r) * group + g) * keys;
            if (cap > 0.f)
              for (int64_t i = 0; i < keys_of(r); ++i) row[i] = cap * std::tanh(row[i] / cap);
            softmax(row, keys_of(r));
          }

      // Values: each block's rows read once from memory, then from L1 for the others.
      acc.assign(queries * dim, 0.f);
      if constexpr (pairs) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        weights.resize(queries * keys + kWidth);
        const int64_t whole = queries * keys - queries * keys % kWidth;
        for (int64_t i = 0; i < whole; i += kWidth)
          store(reinterpret_cast<BF16*>(weights.data() + i), load(scores.data() + i));
        for (int64_t i = whole; i < queries * keys; ++i)
          weights[i] = static_cast<BF16>(scores[i]).x;
        v_rows.for_each_block([&](int64_t h, int64_t key, const TC* rows, const float*, int64_t n) {
          split(key, n, [&](int64_t r, int64_t c, int64_t m) {
            P::accumulate(weights.data() + (h * count + r) * group * keys + key, keys, c * group,
                          rows, m, acc.data() + (h * count + r) * group * dim);
          });
        });
#endif
      } else {
        v_rows.for_each_block([&](int64_t h, int64_t key, const TC* rows, const float* row_scales,
                                  int64_t n) {
          split(key, n, [&](int64_t r, int64_t c, int64_t m) {
            H::accumulate(scores.data() + (h * count + r) * group * keys + key, keys, c * group,
                          rows, row_scales, m, acc.data() + (h * count + r) * group * dim);
          });
        });
      }
      for (int64_t h = 0; h < span; ++h)
        for (int64_t r = 0; r < count; ++r) {
          TQ* o = out_ptr + (entry(r) * heads + (head + h) * group) * dim;
          const float* a = acc.data() + (h * count + r) * group * dim;
          for (int64_t i = 0; i < group * dim; ++i) {
            if constexpr (pairs) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
              o[i] = static_cast<TQ>(P::at(a + i / dim * dim, i % dim));
#endif
            } else {
              o[i] = static_cast<TQ>(a[i]);
            }
          }
        }
    }
  });
}

#define KVGATE_HEAD_VECTORS(X) X(1) X(2) X(4) X(5) X(6) X(8) X(10) X(12) X(16) X(32)

template <typename TQ, typename TC>
void decode_any(const at::Tensor& q, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const float* k_scales, const float* v_scales,
                const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                int64_t window, double softcap, at::Tensor& out) {
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
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& k_scales,
                           const at::Tensor& v_scales, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale, int64_t window,
                           double softcap) {
  const bool fp8 = check_cache("paged_decode", q, k_cache, v_cache, k_scales, v_scales,
                               block_tables);
  TORCH_CHECK(seq_lens.device().is_cpu() && seq_lens.is_contiguous() &&
                  seq_lens.scalar_type() == at::kInt,
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
  auto out = empty(q.sizes(), q.scalar_type());  // q is contiguous
  const auto run = [&](auto query, auto entry) {
    using TQ = decltype(query);
    using TC = decltype(entry);
    decode_any<TQ, TC>(q, k_cache, v_cache, ks, vs, block_tables, seq_lens, scale, window,
                       softcap, out);
  };
  if (q.scalar_type() == at::kBFloat16) {
    fp8 ? run(c10::BFloat16(), Fp8()) : run(c10::BFloat16(), c10::BFloat16());
  } else {
    fp8 ? run(float(), Fp8()) : run(float(), float());
  }
  return out;
}

// The head sizes paged_decode takes on this build.
std::vector<int64_t> decode_head_dims() {
  std::vector<int64_t> dims;
#define KVGATE_DIM(n) dims.push_back(n * kWidth);
  KVGATE_HEAD_VECTORS(KVGATE_DIM)
#undef KVGATE_DIM
  return dims;
}

}  // namespace kvgate
