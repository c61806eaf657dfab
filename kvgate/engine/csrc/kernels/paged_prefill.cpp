// Fused (flash-style) prefill attention on the CPU over the paged KV cache.
//
// Several queries per sequence, causal, the queries the last n_q positions of the context (a
// whole prompt, or a chunk after an already cached prefix). No score matrix is ever stored:
// work items are (sequence, KV head, tile of query positions), and a tile walks its keys a panel
// (kChunk keys) at a time, holding the scores of those keys for its G * Tq query rows, the running max and
// sum of an online softmax, and an fp32 output accumulator.
//
// Phase 1 repacks each served sequence's K/V (per KV head) from the cache's blocks into
// panels the inner loops read with unit stride: bf16 pairs for `vdpbf16ps` where the
// build has AVX512_BF16 and the cache is bf16, else fp32 (fp32 caches, fp8 caches widened
// with their per-token scales, bf16 on AVX2). Phase 2 runs the tiles, the heaviest first, on
// OpenMP's dynamic schedule with torch's thread count. Scores, softmax and the output sum are
// fp32; the bf16 path rounds the softmax weights to bf16 for the value product (as the torch
// path does). On AVX512_BF16 without soft-capping a row block's scores go from the dot
// products to its weights without leaving registers (`panel_weights`).
//
// The library's ISA variant picks the vectors: AVX-512 (vdpbf16ps in avx512bf16 and amx) or
// AVX2 + FMA.

#include "kvgate_simd.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace kvgate {
namespace {

#ifndef KVGATE_PREFILL_CHUNK
#define KVGATE_PREFILL_CHUNK 64
#endif
// Keys per panel: the online softmax's per-row work (max, sum, rescale) is paid once a panel;
// one thread, bf16, a 2,000-token bench55m layer: 16 keys 37.6 ms, 32 keys 27.2, 64 keys 24.5.
constexpr int64_t kChunk = KVGATE_PREFILL_CHUNK;

constexpr int64_t kChunkVectors = kChunk / kWidth;
// Query rows whose scores are accumulated together (their accumulators stay in registers).
constexpr int64_t kRowBlock = std::max<int64_t>(1, std::min<int64_t>(8, 16 / kChunkVectors));

inline uint16_t bf16_bits(c10::BFloat16 x) { return x.x; }

// One served sequence.
struct Seq {
  int64_t q_start, n_q, len, chunks;
  const int32_t* table;
  int64_t panel_offset;  // into the packed buffer, in panel units (per KV head: chunks panels)
};

struct Item {
  int64_t seq, head, t0, t1, cost;
};

// Packed panels of kChunk keys. fp32: K as [D][kChunk] (key-minor), V as [kChunk][D]. bf16
// pairs: K as [D/2][kChunk] pairs of dims, V as [kChunk/2][D] pairs of keys. Keys past the context are zero.
template <bool Bf16>
struct Panels {
  using Word = std::conditional_t<Bf16, uint32_t, float>;
  static constexpr int64_t words(int64_t dim) { return Bf16 ? kChunk * dim / 2 : kChunk * dim; }
};

template <typename TC, bool Bf16>
void pack(const TC* cache, const float* scales, const Seq& s, int64_t head, int64_t kv_heads,
          int64_t block_size, int64_t dim, bool is_key, typename Panels<Bf16>::Word* out) {
  using Word = typename Panels<Bf16>::Word;
  const int64_t panel_words = Panels<Bf16>::words(dim);
  // Keys past the context are zero: they lie in the last panel (the others are written whole).
  std::memset(out + (s.chunks - 1) * panel_words, 0, sizeof(Word) * panel_words);
  int64_t j = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (Bf16 && std::is_same_v<TC, c10::BFloat16>) {
    // Whole runs of keys with vector moves; the rest (a context's tail) as below.
    if (is_key && block_size % kWidth == 0) {
      // K: word (d/2, k) is word d/2 of key k's row: kWidth keys of one block (rows dim
      // apart) gathered per word.
      const __m512i apart = _mm512_mullo_epi32(
          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
          _mm512_set1_epi32(static_cast<int32_t>(dim / 2)));
      for (; j + kWidth <= s.len; j += kWidth) {
        const int32_t* rows = reinterpret_cast<const int32_t*>(
            cache + cache_slot(s.table, j, kv_heads, head, block_size) * dim);
        Word* panel = out + (j / kChunk) * panel_words + j % kChunk;
        for (int64_t d2 = 0; d2 < dim / 2; ++d2)
          _mm512_storeu_si512(panel + d2 * kChunk, _mm512_i32gather_epi32(apart, rows + d2, 4));
      }
    } else if (!is_key && dim % 32 == 0) {
      // V: word (k/2, d) pairs keys k and k+1 at dim d: two rows interleaved, 32 dims a time.
      alignas(64) int16_t order[32];  // x0 y0 x1 y1 ... x15 y15 (y's lanes from 32)
      for (int16_t i = 0; i < 16; ++i) order[2 * i] = i, order[2 * i + 1] = 32 + i;
      const __m512i low = _mm512_load_si512(order);
      const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
      for (; j + 2 <= s.len; j += 2) {
        const BF16* a = cache + cache_slot(s.table, j, kv_heads, head, block_size) * dim;
        const BF16* b = cache + cache_slot(s.table, j + 1, kv_heads, head, block_size) * dim;
        Word* panel = out + (j / kChunk) * panel_words + (j % kChunk / 2) * dim;
        for (int64_t d = 0; d < dim; d += 32) {
          const __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
          _mm512_storeu_si512(panel + d, _mm512_permutex2var_epi16(x, low, y));
          _mm512_storeu_si512(panel + d + 16, _mm512_permutex2var_epi16(x, high, y));
        }
      }
    }
  }
#endif
  for (; j < s.len; ++j) {
    const int64_t slot = cache_slot(s.table, j, kv_heads, head, block_size);
    const TC* row = cache + slot * dim;
    Word* panel = out + (j / kChunk) * panel_words;
    const int64_t k = j % kChunk;
    if constexpr (Bf16) {
      uint16_t* half = reinterpret_cast<uint16_t*>(panel);
      if constexpr (std::is_same_v<TC, c10::BFloat16>) {
        for (int64_t d = 0; d < dim; ++d) {
          // K: word (d/2, k), half d%2. V: word (k/2, d), half k%2.
          const int64_t at = is_key ? ((d / 2) * kChunk + k) * 2 + d % 2
                                    : ((k / 2) * dim + d) * 2 + k % 2;
          half[at] = bf16_bits(row[d]);
        }
      }
    } else {
      const float scale = scales == nullptr ? 1.f : scales[slot];
      for (int64_t d = 0; d < dim; ++d) {
        const float x = widen(row[d]) * scale;
        if (is_key) panel[d * kChunk + k] = x;
        else panel[k * dim + d] = x;
      }
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// acc[r][i] = q_r . k over a panel of bf16-pair keys, for a row block's kRowBlock rows (q_r:
// each row's bf16 pairs of dims).
inline void bf16_panel_dots(const uint32_t* const* q, const uint32_t* k, int64_t dim,
                            __m512 (&acc)[kRowBlock][kChunkVectors]) {
  for (int64_t r = 0; r < kRowBlock; ++r)
    for (int64_t i = 0; i < kChunkVectors; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < dim / 2; ++d2) {
    __m512bh kv[kChunkVectors];
    for (int64_t i = 0; i < kChunkVectors; ++i)
      kv[i] = (__m512bh)_mm512_loadu_si512(k + d2 * kChunk + i * kWidth);
#pragma GCC unroll 8
    for (int64_t r = 0; r < kRowBlock; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(q[r][d2]);
      for (int64_t i = 0; i < kChunkVectors; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], b, kv[i]);
    }
  }
}
#endif

// scores[r][0..kChunk) = q_r . k_j for the rows of a tile, one panel of keys.
template <bool Bf16>
void panel_scores(const void* const* rows, int64_t n_rows, const typename Panels<Bf16>::Word* k,
                  int64_t dim, float* scores) {
  for (int64_t r0 = 0; r0 < n_rows; r0 += kRowBlock) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if constexpr (Bf16) {
      __m512 acc[kRowBlock][kChunkVectors];
      const uint32_t* q[kRowBlock];
      for (int64_t r = 0; r < kRowBlock; ++r) q[r] = static_cast<const uint32_t*>(rows[r0 + r]);
      bf16_panel_dots(q, k, dim, acc);
      for (int64_t r = 0; r < kRowBlock; ++r)
        for (int64_t i = 0; i < kChunkVectors; ++i)
          _mm512_storeu_ps(scores + (r0 + r) * kChunk + i * kWidth, acc[r][i]);
      continue;
    }
#endif
    if constexpr (!Bf16) {
      Vec acc[kRowBlock][kChunkVectors];
      const float* q[kRowBlock];
      for (int64_t r = 0; r < kRowBlock; ++r) {
        q[r] = static_cast<const float*>(rows[r0 + r]);
        for (int64_t i = 0; i < kChunkVectors; ++i) acc[r][i] = zero();
      }
      for (int64_t d = 0; d < dim; ++d) {
        Vec kv[kChunkVectors];
        for (int64_t i = 0; i < kChunkVectors; ++i) kv[i] = load(k + d * kChunk + i * kWidth);
#pragma GCC unroll 8
        for (int64_t r = 0; r < kRowBlock; ++r) {
          const Vec b = splat(q[r][d]);
          for (int64_t i = 0; i < kChunkVectors; ++i) acc[r][i] = fmadd(b, kv[i], acc[r][i]);
        }
      }
      for (int64_t r = 0; r < kRowBlock; ++r)
        for (int64_t i = 0; i < kChunkVectors; ++i)
          store(scores + (r0 + r) * kChunk + i * kWidth, acc[r][i]);
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The bf16 path without soft-capping, one row block against one panel of keys: the scores stay
// in registers from the dot products through the online-softmax update to the weights as bf16
// pairs. The generic path below stores them and makes four passes (scale, max, exp, mask);
// this one folds the scale into the exponent's FMA, masks with lane masks and skips the
// rescale's exp where a row's maximum holds. A 2,000-token bench55m layer on a 2-core Zen 4:
// 16.9 ms on the generic path, 13.8 fused, 13.1 with `exp2_weight`. pos[b]: row b's
// position, -1 for a padding row.
// 2^t for a row's weights, t <= 0: 2^n * p(t - n), p a degree-4 fit of 2^f on [-1/2, 1/2]
// (relative error 2.6e-6, far under the weights' bf16 rounding, 2^-9): 8 operations where
// `exp_nonpositive` takes 17, and scalef gives 0 far below the normal floats.
inline __m512 exp2_weight(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.009570102f), f, _mm512_set1_ps(0.05591786f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024744f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69312179f));
  return _mm512_scalef_ps(_mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99999928f)), n);
}

void panel_weights(const void* const* rows, const uint32_t* k, int64_t dim, float scale,
                   const int64_t* pos, int64_t j0, bool masked, int64_t window, float* m,
                   float* l, float* alpha, uint32_t* pairs) {
  __m512 acc[kRowBlock][kChunkVectors];
  const uint32_t* q[kRowBlock];
  for (int64_t r = 0; r < kRowBlock; ++r) q[r] = static_cast<const uint32_t*>(rows[r]);
  bf16_panel_dots(q, k, dim, acc);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#pragma GCC unroll 8
  for (int64_t b = 0; b < kRowBlock; ++b) {
    uint32_t* out = pairs + b * (kChunk / 2);
    if (pos[b] < 0) {  // a padding row: no weights, nothing kept
      std::memset(out, 0, sizeof(uint32_t) * kChunk / 2);
      alpha[b] = 0.f;
      continue;
    }
    // Keys the row must not see: past its position, or (sliding window) too far behind it.
    __mmask16 seen[kChunkVectors];
    for (int64_t i = 0; i < kChunkVectors; ++i) {
      seen[i] = 0xFFFF;
      if (masked) {
        const __m512i key = _mm512_add_epi32(lanes, _mm512_set1_epi32(j0 + i * kWidth));
        seen[i] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(pos[b]));
        if (window > 0)
          seen[i] &= _mm512_cmpgt_epi32_mask(key, _mm512_set1_epi32(pos[b] - window));
      }
    }
    __m512 top_v = _mm512_set1_ps(kNegInf);
    for (int64_t i = 0; i < kChunkVectors; ++i)
      top_v = _mm512_mask_max_ps(top_v, seen[i], top_v, acc[b][i]);
    const float top = std::max(m[b], _mm512_reduce_max_ps(top_v) * scale);
    if (top == kNegInf) {  // nothing seen yet: the row stays empty
      std::memset(out, 0, sizeof(uint32_t) * kChunk / 2);
      alpha[b] = 1.f;
      continue;
    }
    alpha[b] = top == m[b] ? 1.f : std::exp(m[b] - top);
    // e^(s * scale - top) as 2^(s * scale * log2(e) - top * log2(e)): one FMA.
    constexpr float kLog2e = 1.44269504088896341f;
    const __m512 factor = _mm512_set1_ps(scale * kLog2e), shift = _mm512_set1_ps(-top * kLog2e);
    __m512 total = _mm512_setzero_ps();
    for (int64_t i = 0; i < kChunkVectors; ++i) {
      const __m512 e =
          _mm512_maskz_mov_ps(seen[i], exp2_weight(_mm512_fmadd_ps(acc[b][i], factor, shift)));
      total = _mm512_add_ps(total, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * kWidth / 2),
                          (__m256i)_mm512_cvtneps_pbh(e));
    }
    m[b] = top;
    l[b] = l[b] * alpha[b] + _mm512_reduce_add_ps(total);
  }
}
#endif

// Rows of a row block whose value sums run together: each value vector loaded is used by
// all of them, R * Vectors accumulators (kAccumulatorRegs).
template <int64_t Vectors>
constexpr int64_t value_rows() {
  int64_t rows = 1;
  while (rows * 2 <= kRowBlock && rows * 2 * Vectors <= kAccumulatorRegs) rows *= 2;
  return rows;
}

// For R rows r: o_r[0..dim) = o_r * alpha[r] + sum_k p_r[k] v_k over one panel of values (p_r:
// row r of `p`, kChunk apart; bf16: its weights as bf16 pairs of keys, kChunk / 2 apart).
template <bool Bf16, int64_t Vectors, int64_t R>
void values(const float* p, const uint32_t* pairs, const float* alpha,
            const typename Panels<Bf16>::Word* v, float* o) {
  constexpr int64_t dim = Vectors * kWidth;
  Vec acc[R][Vectors];
#pragma GCC unroll 32
  for (int64_t r = 0; r < R; ++r)
#pragma GCC unroll 32
    for (int64_t i = 0; i < Vectors; ++i) acc[r][i] = load(o + r * dim + i * kWidth) * splat(alpha[r]);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (Bf16) {
    (void)p;
    for (int64_t k2 = 0; k2 < kChunk / 2; ++k2) {
      __m512bh vv[Vectors];
#pragma GCC unroll 32
      for (int64_t i = 0; i < Vectors; ++i)
        vv[i] = (__m512bh)_mm512_loadu_si512(v + k2 * dim + i * kWidth);
#pragma GCC unroll 32
      for (int64_t r = 0; r < R; ++r) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(pairs[r * (kChunk / 2) + k2]);
#pragma GCC unroll 32
        for (int64_t i = 0; i < Vectors; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], w, vv[i]);
      }
    }
  }
#endif
  if constexpr (!Bf16) {
    (void)pairs;
    for (int64_t k = 0; k < kChunk; ++k) {
      Vec vv[Vectors];
#pragma GCC unroll 32
      for (int64_t i = 0; i < Vectors; ++i) vv[i] = load(v + k * dim + i * kWidth);
#pragma GCC unroll 32
      for (int64_t r = 0; r < R; ++r) {
        const Vec w = splat(p[r * kChunk + k]);
#pragma GCC unroll 32
        for (int64_t i = 0; i < Vectors; ++i) acc[r][i] = fmadd(w, vv[i], acc[r][i]);
      }
    }
  }
#pragma GCC unroll 32
  for (int64_t r = 0; r < R; ++r)
#pragma GCC unroll 32
    for (int64_t i = 0; i < Vectors; ++i) store(o + r * dim + i * kWidth, acc[r][i]);
}

template <typename TQ, typename TC, bool Bf16, int64_t Vectors>
void prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const float* k_scales, const float* v_scales, std::vector<Seq>& seqs, double scale,
             int64_t window, double softcap, at::Tensor& out) {
  using Word = typename Panels<Bf16>::Word;
  constexpr int64_t dim = Vectors * kWidth;
  const int64_t heads = q.size(1), kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t panel_words = Panels<Bf16>::words(dim);
  int64_t panels = 0;
  for (auto& s : seqs) {
    s.panel_offset = panels;
    panels += s.chunks * kv_heads;
  }
  // The calling thread's packing buffers, kept between calls: a fresh 2 MB each layer of a
  // chunk after a 2,000-token prefix cost as much as its attention (page faults, zeroing).
  static_assert(sizeof(Word) == sizeof(float), "panels of 4-byte words");
  thread_local std::vector<float> k_buffer, v_buffer;
  const size_t words = static_cast<size_t>(panels * panel_words);
  if (k_buffer.size() < words) k_buffer.resize(words), v_buffer.resize(words);
  Word* const k_packed = reinterpret_cast<Word*>(k_buffer.data());
  Word* const v_packed = reinterpret_cast<Word*>(v_buffer.data());
  const TC* k_ptr = reinterpret_cast<const TC*>(k_cache.data_ptr());
  const TC* v_ptr = reinterpret_cast<const TC*>(v_cache.data_ptr());
  const int64_t n_pack = static_cast<int64_t>(seqs.size()) * kv_heads * 2;
  const int threads = at::get_num_threads();

#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t item = 0; item < n_pack; ++item) {
    const int64_t which = item / 2, head = which % kv_heads;
    const Seq& s = seqs[which / kv_heads];
    const bool is_key = item % 2 == 0;
    Word* dst = (is_key ? k_packed : v_packed) +
                (s.panel_offset + head * s.chunks) * panel_words;
    pack<TC, Bf16>(is_key ? k_ptr : v_ptr, is_key ? k_scales : v_scales, s, head, kv_heads,
                   block_size, dim, is_key, dst);
  }

  // Tiles of Tq query positions: G * Tq rows (~64) share each panel of K/V.
  const int64_t tile = std::max<int64_t>(8, 64 / group);
  std::vector<Item> items;
  for (int64_t i = 0; i < static_cast<int64_t>(seqs.size()); ++i) {
    const Seq& s = seqs[i];
    for (int64_t t0 = 0; t0 < s.n_q; t0 += tile) {
      const int64_t t1 = std::min(t0 + tile, s.n_q);
      const int64_t last = s.len - s.n_q + t1 - 1;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, s.len - s.n_q + t0 - window + 1) : 0;
      for (int64_t h = 0; h < kv_heads; ++h) items.push_back({i, h, t0, t1, (last + 1 - lo) * (t1 - t0)});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });

  const TQ* q_ptr = q.data_ptr<TQ>();
  TQ* out_ptr = out.data_ptr<TQ>();
  const float cap = static_cast<float>(softcap), scale_f = static_cast<float>(scale);
  const int64_t max_rows = group * tile;
  const int64_t padded_rows = (max_rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  const int64_t n_items = static_cast<int64_t>(items.size());
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int64_t kValueRows = value_rows<Vectors>();

#pragma omp parallel num_threads(threads)
  {
    std::vector<float> qf(Bf16 ? 0 : padded_rows * dim), o(padded_rows * dim);
    std::vector<float> scores(kRowBlock * kChunk), m(padded_rows), l(padded_rows);
    std::vector<uint32_t> pairs(Bf16 ? kRowBlock * kChunk / 2 : 0);
    float alpha[kRowBlock];
    std::vector<const void*> rows(padded_rows);
    std::vector<TQ> zeros(dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const Item& item = items[it];
      const Seq& s = seqs[item.seq];
      const int64_t n_rows = (item.t1 - item.t0) * group;
      const int64_t offset = s.len - s.n_q;  // position of query 0
      const int64_t first = offset + item.t0, last = offset + item.t1 - 1;
      for (int64_t r = 0; r < padded_rows; ++r) {
        const TQ* src = r < n_rows ? q_ptr + ((s.q_start + item.t0 + r / group) * heads +
                                              item.head * group + r % group) * dim
                                   : zeros.data();
        if constexpr (Bf16) {
          rows[r] = src;
        } else {
          for (int64_t d = 0; d < dim; ++d) qf[r * dim + d] = static_cast<float>(src[d]);
          rows[r] = qf.data() + r * dim;
        }
      }
      std::fill(o.begin(), o.end(), 0.f);
      std::fill(m.begin(), m.begin() + n_rows, kNegInf);
      std::fill(l.begin(), l.begin() + n_rows, 0.f);
      const int64_t lo = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0;
      const Word* k_panels = k_packed + (s.panel_offset + item.head * s.chunks) * panel_words;
      const Word* v_panels = v_packed + (s.panel_offset + item.head * s.chunks) * panel_words;
      for (int64_t c = lo / kChunk; c <= last / kChunk; ++c) {
        const int64_t j0 = c * kChunk;
        // Keys any row of the tile must not see: past a row's position (or the context),
        // or (sliding window) too far behind it.
        const bool masked = j0 + kChunk - 1 > first || (window > 0 && j0 <= last - window);
        for (int64_t r0 = 0; r0 < n_rows; r0 += kRowBlock) {
          bool fused = false;  // the weights from `panel_weights`, else the generic passes
#if defined(__AVX512F__) && defined(__AVX512BF16__)
          if (Bf16 && cap == 0.f) {
            int64_t pos[kRowBlock];
            for (int64_t b = 0; b < kRowBlock; ++b)
              pos[b] = r0 + b < n_rows ? offset + item.t0 + (r0 + b) / group : -1;
            panel_weights(rows.data() + r0, reinterpret_cast<const uint32_t*>(k_panels + c * panel_words),
                          dim, scale_f, pos, j0, masked, window, m.data() + r0, l.data() + r0,
                          alpha, pairs.data());
            fused = true;
          }
#endif
          if (!fused) {
            panel_scores<Bf16>(rows.data() + r0, kRowBlock, k_panels + c * panel_words, dim,
                               scores.data());
            for (int64_t b = 0; b < kRowBlock; ++b) {
              const int64_t r = r0 + b;
              float* sr = scores.data() + b * kChunk;
              if (r >= n_rows) {  // a padding row: no weights, nothing kept
                std::fill(sr, sr + kChunk, 0.f);
                alpha[b] = 0.f;
                continue;
              }
              const int64_t pos = offset + item.t0 + r / group;
              for (int64_t i = 0; i < kChunkVectors; ++i)
                store(sr + i * kWidth, load(sr + i * kWidth) * splat(scale_f));
              if (cap > 0.f)
                for (int64_t k = 0; k < kChunk; ++k) sr[k] = cap * std::tanh(sr[k] / cap);
              if (masked)
                for (int64_t k = 0; k < kChunk; ++k) {
                  const int64_t j = j0 + k;
                  if (j > pos || (window > 0 && j <= pos - window)) sr[k] = kNegInf;
                }
              Vec top_v = splat(kNegInf);
              for (int64_t i = 0; i < kChunkVectors; ++i) top_v = vmax(top_v, load(sr + i * kWidth));
              const float top = std::max(m[r], max(top_v));
              if (top == kNegInf) {  // nothing seen yet: the row stays empty
                std::fill(sr, sr + kChunk, 0.f);
                alpha[b] = 1.f;
                continue;
              }
              alpha[b] = std::exp(m[r] - top);
              Vec total = zero();
              for (int64_t i = 0; i < kChunkVectors; ++i) {
                const Vec e = exp_nonpositive(load(sr + i * kWidth) - splat(top));
                store(sr + i * kWidth, e);
                total = total + e;
              }
              float row_sum = sum(total);
              if (masked)  // exp_nonpositive(-inf) is ~e^-87, not 0
                for (int64_t k = 0; k < kChunk; ++k)
                  if (sr[k] != 0.f && (j0 + k > pos || (window > 0 && j0 + k <= pos - window))) {
                    row_sum -= sr[k];
                    sr[k] = 0.f;
                  }
              m[r] = top;
              l[r] = l[r] * alpha[b] + row_sum;
            }
#if defined(__AVX512F__) && defined(__AVX512BF16__)
            if constexpr (Bf16)  // the weights as bf16 pairs of keys (as the torch path rounds)
              for (int64_t i = 0; i < kRowBlock * kChunkVectors; ++i)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs.data() + i * kWidth / 2),
                                    (__m256i)_mm512_cvtneps_pbh(load(scores.data() + i * kWidth)));
#endif
          }
          for (int64_t b = 0; b < kRowBlock; b += kValueRows)
            values<Bf16, Vectors, kValueRows>(scores.data() + b * kChunk,
                                              pairs.data() + b * (kChunk / 2), alpha + b,
                                              v_panels + c * panel_words,
                                              o.data() + (r0 + b) * dim);
        }
      }
      for (int64_t r = 0; r < n_rows; ++r) {
        TQ* dst = out_ptr + ((s.q_start + item.t0 + r / group) * heads + item.head * group +
                             r % group) * dim;
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<TQ>(o[r * dim + d] * inv);
      }
    }
  }
}

#define KVGATE_HEAD_VECTORS(X) X(1) X(2) X(4) X(5) X(6) X(8) X(10) X(12) X(16) X(32)

template <typename TQ, typename TC, bool Bf16>
void prefill_any(const at::Tensor& q, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, const float* k_scales, const float* v_scales,
                 std::vector<Seq>& seqs, double scale, int64_t window, double softcap,
                 at::Tensor& out) {
  switch (q.size(2) % kWidth == 0 ? q.size(2) / kWidth : 0) {
#define KVGATE_DIM(n)                                                                        \
  case n:                                                                                    \
    return prefill<TQ, TC, Bf16, n>(q, k_cache, v_cache, k_scales, v_scales, seqs, scale,    \
                                    window, softcap, out);
    KVGATE_HEAD_VECTORS(KVGATE_DIM)
#undef KVGATE_DIM
    default:
      TORCH_CHECK(false, "paged_prefill: head_dim ", q.size(2), " is not supported");
  }
}

}  // namespace

// q [T, Hq, D] bf16 or fp32; caches [blocks, Hkv, block_size, D] in q's dtype, or fp8 e4m3
// with fp32 scales [blocks, Hkv, block_size] (empty tensors otherwise); block_tables [B, W],
// seq_lens [B], query_start [B + 1] int32 (the step's metadata); seqs [S] int32: the
// sequences to serve (their query rows of `out` are written, no others). window <= 0: none;
// softcap <= 0: none.
void paged_prefill(const at::Tensor& q, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, const at::Tensor& k_scales,
                   const at::Tensor& v_scales, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, const at::Tensor& query_start,
                   const at::Tensor& seqs, double scale, int64_t window, double softcap,
                   at::Tensor& out) {
  const bool fp8 = check_cache("paged_prefill", q, k_cache, v_cache, k_scales, v_scales,
                               block_tables);
  for (const at::Tensor* t : {&seq_lens, &query_start, &seqs})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == at::kInt,
                "paged_prefill: contiguous CPU int32 metadata only");
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.sizes() == q.sizes() &&
                  out.scalar_type() == q.scalar_type(),
              "paged_prefill: out must be a contiguous CPU tensor like q");
  const int64_t batch = seq_lens.size(0);
  TORCH_CHECK(block_tables.size(0) == batch && query_start.size(0) == batch + 1,
              "paged_prefill: shapes disagree");
  const int64_t block_size = k_cache.size(2), blocks = k_cache.size(0);
  const int64_t width = block_tables.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* served = seqs.data_ptr<int32_t>();
  std::vector<Seq> list;
  for (int64_t i = 0; i < seqs.size(0); ++i) {
    const int64_t b = served[i];
    TORCH_CHECK(b >= 0 && b < batch, "paged_prefill: sequence index out of range");
    const int64_t len = lens[b], q_start = starts[b], n_q = starts[b + 1] - starts[b];
    const int32_t* table = tables + b * width;
    check_sequence("paged_prefill", table, width, len, block_size, blocks);
    TORCH_CHECK(n_q > 0 && n_q <= len && q_start >= 0 && q_start + n_q <= q.size(0),
                "paged_prefill: query rows out of range");
    list.push_back({q_start, n_q, len, (len + kChunk - 1) / kChunk, table, 0});
  }
  if (list.empty()) return;
  const float* ks = fp8 ? k_scales.data_ptr<float>() : nullptr;
  const float* vs = fp8 ? v_scales.data_ptr<float>() : nullptr;
  if (q.scalar_type() == at::kBFloat16) {
    if (fp8)
      prefill_any<c10::BFloat16, Fp8, false>(q, k_cache, v_cache, ks, vs, list, scale, window,
                                             softcap, out);
    else
      prefill_any<c10::BFloat16, c10::BFloat16, kBf16Dot>(q, k_cache, v_cache, ks, vs, list,
                                                          scale, window, softcap, out);
  } else {
    if (fp8)
      prefill_any<float, Fp8, false>(q, k_cache, v_cache, ks, vs, list, scale, window, softcap,
                                     out);
    else
      prefill_any<float, float, false>(q, k_cache, v_cache, ks, vs, list, scale, window, softcap,
                                       out);
  }
}

std::vector<int64_t> prefill_head_dims() {
  std::vector<int64_t> dims;
  for (int64_t n : {1, 2, 4, 5, 6, 8, 10, 12, 16, 32})
    if (!kBf16Dot || n * kWidth % 2 == 0) dims.push_back(n * kWidth);
  return dims;
}

bool prefill_bf16_dot() { return kBf16Dot; }

}  // namespace kvgate
