// Small-batch matmuls on GGUF-quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K),
// kept as the file's blocks.
//
// The weight stays in the file's own blocks, one row of blocks per output feature: 32 weights
// each, with an fp16 scale d (and Q4_1's fp16 minimum m) before the 4- or 8-bit values; or
// the K-quants' super-blocks of 256 (eight 32-value sub-blocks whose 6- or 8-bit scales are
// themselves scaled by the super-block's fp16 d). Each call quantizes its activation rows
// once to int16 per 32-block (a float scale dx each), then every (output row, 32-block) pair
// is an integer dot product of 32 int16 pairs (`madd_epi16`: AVX-512BW 32 pairs, AVX2 16 per
// instruction), scaled in fp32 by the block's weight scale times dx:
//   Q8_0:  w = d*q           (q in -127..127)  dot = d*dx*sum(q*xq)
//   Q4_0:  w = d*(q - 8)     (q in 0..15)      dot = d*dx*sum((q-8)*xq)
//   Q4_1:  w = d*q + m       (q in 0..15)      dot = d*dx*sum(q*xq) + m*dx*sum(xq)
//   Q5_0, Q5_1: as Q4_0 (offset 16), Q4_1, with q in 0..31: a fifth bit per value from 4 bytes
//          (llama.cpp's fallback where a K-quant file's rows are not whole super-blocks)
//   Q4_K:  w = d*s*q - n*m   (q in 0..15; s, m 6-bit per sub-block; d, n fp16 per 256)
//   Q5_K:  w = d*s*q - n*m   (q in 0..31: Q4_K's nibble and a fifth bit from 32 bytes)
//   Q6_K:  w = d*s*(q - 32)  (q in 0..63; s int8 per 16 values: each half its own scale)
// llama.cpp quantizes the activations to int8 instead (Q8_0/Q8_1); on SmolLM2-135M Q4_1 that
// alone turns "The capital of France is Paris." into "L'Étoile, la Marseillaise, ..." (the
// dequantized model with its activations fake-quantized to int8 per block answers the same).
// int16 activations err by at most amax/65534 per block, below bf16's own rounding, so this
// computes what the dequantized weights compute; the dot costs the same instructions per block.
// Products never overflow: |q*xq| <= 128*32767, two summed per int32 lane per block.
// Sums accumulate in fp32; the output is rounded once to the activations' dtype (bf16 or fp32),
// after the fused epilogue (SwiGLU over the two halves of the rows, or a residual add).
//
// One weight block is decoded once and used for up to 4 activation rows; threads split the
// output rows (torch's thread count). AVX-512BW in the AVX-512 variants of the library, AVX2 in
// avx2 (engine/native_variants.py); without AVX2, a scalar path. Q4_0 and Q4_1 weights can be
// held with 8 rows interleaved (`qgemm_interleave`; see "The interleaved layout" below), where
// extra activation rows cost far less: every vector build's choice (`qgemm_layout`).

#include "ops.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kvgate {
namespace {

// ggml's type ids.
constexpr int64_t kQ4_0 = 2;
constexpr int64_t kQ4_1 = 3;
constexpr int64_t kQ5_0 = 6;
constexpr int64_t kQ5_1 = 7;
constexpr int64_t kQ8_0 = 8;
constexpr int64_t kQ4_K = 12;
constexpr int64_t kQ5_K = 13;
constexpr int64_t kQ6_K = 14;
constexpr int64_t kBlock = 32;    // the activations' blocks, and every type's (sub-)blocks
constexpr int64_t kSuper = 256;   // a K-quant's super-block

constexpr bool is_k_quant(int64_t type) {
  return type == kQ4_K || type == kQ5_K || type == kQ6_K;
}

// Bytes of one block (32 values), or of one K-quant super-block (256).
constexpr int64_t group_bytes(int64_t type) {
  return type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : type == kQ5_0 ? 22 : type == kQ5_1 ? 24
       : type == kQ8_0 ? 34
       : type == kQ4_K ? 144 : type == kQ5_K ? 176 : type == kQ6_K ? 210 : 0;
}

// The 32-value block types: a minimum m added to each weight (else an offset taken off q), and
// a fifth bit per value (4 bytes after the fp16 scale, and Q5_1's fp16 minimum).
constexpr bool has_min(int64_t type) { return type == kQ4_1 || type == kQ5_1; }
constexpr bool five_bits(int64_t type) { return type == kQ5_0 || type == kQ5_1; }
constexpr int32_t offset_of(int64_t type) { return type == kQ4_0 ? 8 : type == kQ5_0 ? 16 : 0; }
constexpr int64_t high_bits_at(int64_t type) { return has_min(type) ? 4 : 2; }
constexpr int64_t nibbles_at(int64_t type) {
  return high_bits_at(type) + (five_bits(type) ? 4 : 0);
}

void check_type(int64_t type) {
  TORCH_CHECK(group_bytes(type) > 0, "qgemm: unsupported ggml type ", type);
}

// The bytes of a row of k values; k must be whole groups.
int64_t row_bytes(int64_t type, int64_t k) {
  const int64_t values = is_k_quant(type) ? kSuper : kBlock;
  TORCH_CHECK(k % values == 0, "qgemm: K must be a multiple of ", values, " for this type");
  return k / values * group_bytes(type);
}

// One 32-value block b of a row: the scales of its halves (values 0-15 and 16-31; equal but
// for Q6_K) and the minimum added to each weight (Q4_1, Q4_K; zero elsewhere).
struct Scales {
  float lo, hi, min;
};

// Q4_K's 6-bit scale and minimum of sub-block j, from the super-block's 12 bytes (ggml's
// get_scale_min_k4).
inline void scale_min_k4(int64_t j, const uint8_t* q, int32_t& scale, int32_t& min) {
  if (j < 4) {
    scale = q[j] & 63;
    min = q[j + 4] & 63;
  } else {
    scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; c10::Half's conversion is a dozen
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// 32-blocks per scale group: a K-quant super-block's 8, or one block.
template <int64_t TYPE>
constexpr int64_t kGroup = is_k_quant(TYPE) ? 8 : 1;

// The scales of group g's kGroup blocks (a K-quant's decoded once per super-block).
template <int64_t TYPE>
inline void group_scales(const uint8_t* row, int64_t g, Scales* out) {
  const uint8_t* blk = row + g * group_bytes(TYPE);
  if constexpr (TYPE == kQ4_K || TYPE == kQ5_K) {  // the same 12 bytes of scales and minimums
    const float d = half_at(blk), n = half_at(blk + 2);
    for (int64_t j = 0; j < 8; ++j) {
      int32_t scale, min;
      scale_min_k4(j, blk + 4, scale, min);
      const float s = d * static_cast<float>(scale);
      out[j] = {s, s, -(n * static_cast<float>(min))};
    }
  } else if constexpr (TYPE == kQ6_K) {
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = half_at(blk + 208);
    for (int64_t j = 0; j < 8; ++j) {
      out[j] = {d * static_cast<float>(scales[2 * j]), d * static_cast<float>(scales[2 * j + 1]),
                0.0f};
    }
  } else {
    const float d = half_at(blk);
    out[0] = {d, d, has_min(TYPE) ? half_at(blk + 2) : 0.0f};
  }
}

// Block b's 32 weights as integers q (w = scale * q + min): the scalar path and dequantizing.
template <int64_t TYPE>
inline void block_values(const uint8_t* row, int64_t b, int32_t* q) {
  if constexpr (TYPE == kQ4_K) {
    // Sub-blocks 2g and 2g+1: the low and the high nibbles of the same 32 bytes.
    const uint8_t* qs = row + (b / 8) * group_bytes(TYPE) + 16 + 32 * ((b % 8) / 2);
    const int shift = 4 * (b % 2);
    for (int64_t i = 0; i < kBlock; ++i) q[i] = (qs[i] >> shift) & 0x0F;
  } else if constexpr (TYPE == kQ5_K) {
    // As Q4_K's nibbles (after 32 bytes of high bits), plus bit b % 8 of each high-bit byte.
    const uint8_t* blk = row + (b / 8) * group_bytes(TYPE);
    const uint8_t* qs = blk + 48 + 32 * ((b % 8) / 2);
    const int shift = 4 * (b % 2), bit = b % 8;
    for (int64_t i = 0; i < kBlock; ++i)
      q[i] = ((qs[i] >> shift) & 0x0F) | (((blk[16 + i] >> bit) & 1) << 4);
  } else if constexpr (TYPE == kQ6_K) {
    // Per 128 values: 64 bytes of low nibbles (two 32-blocks each), 32 of 2-bit pairs (four).
    const uint8_t* blk = row + (b / 8) * group_bytes(TYPE);
    const int64_t chunk = (b % 8) / 4, t = b % 4;
    const uint8_t* ql = blk + 64 * chunk + 32 * (t % 2);
    const uint8_t* qh = blk + 128 + 32 * chunk;
    const int low_shift = t >= 2 ? 4 : 0;
    for (int64_t i = 0; i < kBlock; ++i)
      q[i] = (((ql[i] >> low_shift) & 0x0F) | (((qh[i] >> (2 * t)) & 3) << 4)) - 32;
  } else if constexpr (TYPE == kQ8_0) {
    const uint8_t* blk = row + b * group_bytes(TYPE);
    for (int64_t i = 0; i < kBlock; ++i) q[i] = static_cast<int8_t>(blk[2 + i]);
  } else {
    const uint8_t* blk = row + b * group_bytes(TYPE);
    const uint8_t* qs = blk + nibbles_at(TYPE);
    uint32_t high = 0;  // bit i: value i's fifth bit
    if constexpr (five_bits(TYPE)) std::memcpy(&high, blk + high_bits_at(TYPE), 4);
    for (int64_t i = 0; i < 16; ++i) {
      q[i] = ((qs[i] & 0x0F) | ((high >> i) & 1) << 4) - offset_of(TYPE);
      q[i + 16] = ((qs[i] >> 4) | ((high >> (i + 16)) & 1) << 4) - offset_of(TYPE);
    }
  }
}

// The activations quantized: per row, int16 values, and per 32-block the scale dx and
// dx * sum(xq) (Q4_1's minimum multiplies it).
struct Activations {
  int64_t rows, blocks;
  std::vector<int16_t> q;
  std::vector<float> d, ds;
};

constexpr float kLevels = 32767.0f;

template <typename T>
Activations quantize_rows(const T* x, int64_t rows, int64_t k) {
  Activations a{rows, k / kBlock, std::vector<int16_t>(rows * k),
                std::vector<float>(rows * (k / kBlock)), std::vector<float>(rows * (k / kBlock))};
  float values[kBlock];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < a.blocks; ++b) {
      const T* src = x + r * k + b * kBlock;
      float amax = 0.0f;
      for (int64_t i = 0; i < kBlock; ++i) {
        values[i] = static_cast<float>(src[i]);
        amax = std::max(amax, std::fabs(values[i]));
      }
      const float d = amax / kLevels;
      const float inv = d > 0.0f ? 1.0f / d : 0.0f;
      int32_t sum = 0;
      int16_t* q = a.q.data() + r * k + b * kBlock;
      for (int64_t i = 0; i < kBlock; ++i) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(values[i] * inv));
        q[i] = static_cast<int16_t>(v);
        sum += v;
      }
      a.d[r * a.blocks + b] = d;
      a.ds[r * a.blocks + b] = d * static_cast<float>(sum);
    }
  }
  return a;
}

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Block b's 32 weights as bytes in order: Q8_0's and Q6_K's signed values (Q6_K's offset of
// 32 taken off), or the 4-bit ones (0..15). As `block_values`, in vectors.
template <int64_t TYPE>
inline __m256i weight_bytes(const uint8_t* row, int64_t b) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (TYPE == kQ4_K) {
    const uint8_t* qs = row + (b / 8) * group_bytes(TYPE) + 16 + 32 * ((b % 8) / 2);
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    if (b % 2) v = _mm256_srli_epi16(v, 4);
    return _mm256_and_si256(v, low4);
  } else if constexpr (TYPE == kQ5_K) {
    const uint8_t* blk = row + (b / 8) * group_bytes(TYPE);
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 48 + 32 * ((b % 8) / 2)));
    if (b % 2) v = _mm256_srli_epi16(v, 4);
    __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
    hi = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(static_cast<int>(b % 8))),
                          _mm256_set1_epi8(1));
    return _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_slli_epi16(hi, 4));
  } else if constexpr (TYPE == kQ6_K) {
    const uint8_t* blk = row + (b / 8) * group_bytes(TYPE);
    const int64_t chunk = (b % 8) / 4, t = b % 4;
    __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * chunk + 32 * (t % 2)));
    if (t >= 2) lo = _mm256_srli_epi16(lo, 4);
    __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * chunk));
    hi = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(static_cast<int>(2 * t))),
                          _mm256_set1_epi8(3));
    const __m256i q = _mm256_or_si256(_mm256_and_si256(lo, low4), _mm256_slli_epi16(hi, 4));
    return _mm256_sub_epi8(q, _mm256_set1_epi8(32));
  } else if constexpr (TYPE == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * group_bytes(TYPE) + 2));
  } else {
    const uint8_t* blk = row + b * group_bytes(TYPE);
    const __m128i packed =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + nibbles_at(TYPE)));
    const __m128i low4x = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(packed, low4x);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low4x);
    const __m256i nibbles = _mm256_set_m128i(hi, lo);  // values 0..15 then 16..31
    if constexpr (!five_bits(TYPE)) return nibbles;
    // Bit i of the 4 bytes to byte i: each byte gets the one of the 4 holding its bit, all
    // its other bits set, so it equals 0xFF exactly where that bit is set.
    uint32_t high;
    std::memcpy(&high, blk + high_bits_at(TYPE), 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int32_t>(high)),
        _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i others = _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFE);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi8(-1));
    return _mm256_or_si256(nibbles, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
  }
}
#endif

#if defined(__AVX512BW__)
using Acc = __m512;
inline Acc acc_zero() { return _mm512_setzero_ps(); }
inline float acc_sum(Acc v) { return _mm512_reduce_add_ps(v); }
// The block's weights as 32 int16 (Q4_0's offset of 8 taken off).
template <int64_t TYPE>
inline __m512i weight_words(const uint8_t* row, int64_t b) {
  const __m256i bytes = weight_bytes<TYPE>(row, b);
  if constexpr (TYPE == kQ8_0 || TYPE == kQ6_K) return _mm512_cvtepi8_epi16(bytes);
  const __m512i words = _mm512_cvtepu8_epi16(bytes);
  if constexpr (offset_of(TYPE) != 0)
    return _mm512_sub_epi16(words, _mm512_set1_epi16(offset_of(TYPE)));
  return words;
}
// acc += (w . xq) * scale, the 32 products summed pairwise into 16 int32 lanes.
inline Acc block_dot(Acc acc, __m512i w, const int16_t* xq, float scale) {
  const __m512i dot = _mm512_madd_epi16(w, _mm512_loadu_si512(xq));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(scale), acc);
}
// The same with a scale per half: lanes 0-7 hold the products of values 0-15.
inline Acc block_dot(Acc acc, __m512i w, const int16_t* xq, float lo, float hi) {
  const __m512i dot = _mm512_madd_epi16(w, _mm512_loadu_si512(xq));
  const __m512 scale = _mm512_mask_mov_ps(_mm512_set1_ps(lo), 0xFF00, _mm512_set1_ps(hi));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
}
#elif defined(__AVX2__)
using Acc = __m256;
inline Acc acc_zero() { return _mm256_setzero_ps(); }
inline float acc_sum(Acc v) { return hsum(v); }
struct Words {
  __m256i lo, hi;
};
template <int64_t TYPE>
inline Words weight_words(const uint8_t* row, int64_t b) {
  const __m256i bytes = weight_bytes<TYPE>(row, b);
  const __m128i b0 = _mm256_castsi256_si128(bytes), b1 = _mm256_extracti128_si256(bytes, 1);
  Words w;
  if constexpr (TYPE == kQ8_0 || TYPE == kQ6_K) {
    w = {_mm256_cvtepi8_epi16(b0), _mm256_cvtepi8_epi16(b1)};
  } else {
    w = {_mm256_cvtepu8_epi16(b0), _mm256_cvtepu8_epi16(b1)};
    if constexpr (offset_of(TYPE) != 0) {
      const __m256i offset = _mm256_set1_epi16(offset_of(TYPE));
      w = {_mm256_sub_epi16(w.lo, offset), _mm256_sub_epi16(w.hi, offset)};
    }
  }
  return w;
}
inline Acc block_dot(Acc acc, Words w, const int16_t* xq, float scale) {
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16));
  const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(w.lo, x0), _mm256_madd_epi16(w.hi, x1));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale), acc);
}
inline Acc block_dot(Acc acc, Words w, const int16_t* xq, float lo, float hi) {
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(w.lo, x0)), _mm256_set1_ps(lo), acc);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(w.hi, x1)), _mm256_set1_ps(hi), acc);
}
#endif

// y[r] = row n of W . activation row r, for the MT rows r0..r0+MT-1.
template <int64_t TYPE, int MT>
void dot_rows(const uint8_t* wrow, const Activations& a, int64_t r0, int64_t k, float* y) {
  constexpr bool with_min = has_min(TYPE) || TYPE == kQ4_K || TYPE == kQ5_K;
  const int64_t nb = a.blocks;
  float corr[MT] = {};
#if defined(__AVX2__)
  // Even and odd blocks into two accumulators: with one, a decode row's dot (MT = 1) was a
  // single chain of dependent FMAs, which bounded it more than the blocks' other work.
  Acc acc[MT], odd[MT];
  for (int m = 0; m < MT; ++m) acc[m] = odd[m] = acc_zero();
  if constexpr (!is_k_quant(TYPE)) {  // one block at a time (Q4_1 ~5% faster than the groups)
    auto block = [&](int64_t b, Acc* into) {
      const uint8_t* blk = wrow + b * group_bytes(TYPE);
      const float d = half_at(blk);
      const float min = has_min(TYPE) ? half_at(blk + 2) : 0.0f;
      const auto w = weight_words<TYPE>(wrow, b);
      for (int m = 0; m < MT; ++m) {
        const int64_t ab = (r0 + m) * nb + b;
        into[m] = block_dot(into[m], w, a.q.data() + (r0 + m) * k + b * kBlock, d * a.d[ab]);
        if constexpr (with_min) corr[m] += min * a.ds[ab];
      }
    };
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) block(b, acc), block(b + 1, odd);
    if (b < nb) block(b, acc);
  }
  for (int64_t g = 0; is_k_quant(TYPE) && g < nb / kGroup<TYPE>; ++g) {
    Scales group[kGroup<TYPE>];
    group_scales<TYPE>(wrow, g, group);
#pragma GCC unroll 8
    for (int64_t j = 0; j < kGroup<TYPE>; ++j) {
      const int64_t b = g * kGroup<TYPE> + j;
      const Scales s = group[j];
      const auto w = weight_words<TYPE>(wrow, b);
      for (int m = 0; m < MT; ++m) {
        const int64_t ab = (r0 + m) * nb + b;
        const int16_t* xq = a.q.data() + (r0 + m) * k + b * kBlock;
        Acc& into = j % 2 ? odd[m] : acc[m];
        if constexpr (TYPE == kQ6_K)
          into = block_dot(into, w, xq, s.lo * a.d[ab], s.hi * a.d[ab]);
        else
          into = block_dot(into, w, xq, s.lo * a.d[ab]);
        if constexpr (with_min) corr[m] += s.min * a.ds[ab];
      }
    }
  }
  for (int m = 0; m < MT; ++m) y[m] = acc_sum(acc[m] + odd[m]) + corr[m];
#else
  float acc[MT] = {};
  int32_t w[kBlock];
  Scales group[kGroup<TYPE>];
  for (int64_t b = 0; b < nb; ++b) {
    if (b % kGroup<TYPE> == 0) group_scales<TYPE>(wrow, b / kGroup<TYPE>, group);
    const Scales s = group[b % kGroup<TYPE>];
    block_values<TYPE>(wrow, b, w);
    for (int m = 0; m < MT; ++m) {
      const int64_t at = (r0 + m) * k + b * kBlock;
      int32_t lo = 0, hi = 0;
      for (int64_t i = 0; i < 16; ++i) lo += w[i] * a.q[at + i];
      for (int64_t i = 16; i < kBlock; ++i) hi += w[i] * a.q[at + i];
      const int64_t ab = (r0 + m) * nb + b;
      acc[m] += a.d[ab] * (s.lo * static_cast<float>(lo) + s.hi * static_cast<float>(hi));
      if constexpr (with_min) corr[m] += s.min * a.ds[ab];
    }
  }
  for (int m = 0; m < MT; ++m) y[m] = acc[m] + corr[m];
#endif
}

// y[r] for every activation row r of one output row (tiles of 4 rows).
template <int64_t TYPE>
void dot_all_rows(const uint8_t* wrow, const Activations& a, int64_t k, float* y) {
  int64_t r = 0;
  for (; r + 4 <= a.rows; r += 4) dot_rows<TYPE, 4>(wrow, a, r, k, y + r);
  const int64_t left = a.rows - r;
  if (left == 3) dot_rows<TYPE, 3>(wrow, a, r, k, y + r);
  if (left == 2) dot_rows<TYPE, 2>(wrow, a, r, k, y + r);
  if (left == 1) dot_rows<TYPE, 1>(wrow, a, r, k, y + r);
}

// The interleaved layout: 8 output rows' blocks side by side (Q4_0, Q4_1).
//
// In the file's layout every (output row, block, activation row) costs its own int32-to-fp32
// conversion, scale multiply, FMA and finally a horizontal sum, around just two madds: cheap
// next to reading the weight when one row is multiplied (a decode step), but the whole cost of
// each further row (a step verifying drafted tokens, a few streams batched): ~4.7 ms a row
// for SmolLM2-135M on a 2-core Zen 3. With 8 output rows interleaved, one block's 8 outputs
// are the 8 lanes of one vector: the block's 32 products per activation row are 16 madds of
// broadcast activation pairs, summed exactly in int32, then one conversion and one FMA for
// all 8 outputs (llama.cpp repacks Q4_0 into 8x8 tiles for the same reason).
//
// Per group of 8 output rows and 32-block: the 8 rows' fp16 scales d, Q4_1's 8 fp16 minimums
// m, then chunks of 16 bytes, chunk c's byte 2j + t being row j's file byte 2c + t of the
// block's values. Q4_0/Q4_1: 8 chunks, byte 2c + t holding value 2c + t in its low nibble and
// 16 + 2c + t in its high one, so a chunk's low nibbles are the 8 rows' value pair c, its high
// nibbles pair 8 + c. Q8_0 (kept for the output projection of many GGUF files, SmolLM2's
// among them): 16 chunks, chunk c the rows' value pair c, so chunks c and 8 + c hold what one
// Q4 chunk holds. Each is widened to the 16 int16 one madd takes.
// A row's arithmetic does not depend on how many rows are multiplied with it: a step verifying
// drafts computes each row exactly as a one-row decode step would.
constexpr int64_t kInterleaved = 256;  // added to a ggml type id: that type, interleaved
constexpr int64_t kLanes = 8;          // output rows per group

constexpr bool interleavable(int64_t type) {
  return type == kQ4_0 || type == kQ4_1 || type == kQ8_0;
}
// Bytes of one 32-block of the 8 rows, where its chunks of values start, and how many there
// are: a chunk holds 8 rows' 2 bytes, a value pair of Q8_0 or two of Q4 (low and high nibbles).
constexpr int64_t lanes_block_bytes(int64_t type) { return kLanes * group_bytes(type); }
constexpr int64_t chunks_at(int64_t type) { return has_min(type) ? 32 : 16; }
constexpr int64_t chunks_of(int64_t type) { return type == kQ8_0 ? 16 : 8; }

#if defined(__AVX2__)
// acc + the pairwise products of a and b (int16 pairs summed into int32 lanes): one VNNI
// instruction where the variant has it, else madd then add; the same sums either way (a
// lane's 32 products of a block total at most 32 * 128 * 32767 < 2^28).
inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
#endif

// y[r * 8 + j] = output row j of the group . activation row r, for rows r0..r0+MT-1.
template <int64_t TYPE, int MT>
void dot_lanes(const uint8_t* group, const Activations& a, int64_t r0, int64_t k, float* y) {
  constexpr int64_t block_bytes = lanes_block_bytes(TYPE);
  const int64_t nb = a.blocks;
#if defined(__AVX2__)
  const __m128i low4 = _mm_set1_epi8(0x0F);
  auto pair = [](const int16_t* x) {  // two int16 activations, broadcast
    int32_t v;
    std::memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
  };
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * block_bytes;
    const int16_t* xq = a.q.data() + r0 * k + b * kBlock;
    __m256i dot[MT];
    for (int m = 0; m < MT; ++m) dot[m] = _mm256_setzero_si256();
    // Not unrolled: unrolled, GCC reassociates the integer sums into a tree over all 16 * MT
    // products and spills them to the stack (~2x slower at 5 rows).
#pragma GCC unroll 1
    for (int64_t c = 0; c < 8; ++c) {
      // The 8 rows' value pairs c (lo) and 8 + c (hi), as int16.
      const uint8_t* chunk = blk + chunks_at(TYPE) + 16 * c;
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk));
      __m256i lo, hi;
      if constexpr (TYPE == kQ8_0) {
        lo = _mm256_cvtepi8_epi16(raw);
        hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 128)));
      } else {
        lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low4));
        hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
        if constexpr (offset_of(TYPE) != 0) {
          const __m256i offset = _mm256_set1_epi16(offset_of(TYPE));
          lo = _mm256_sub_epi16(lo, offset);
          hi = _mm256_sub_epi16(hi, offset);
        }
      }
      for (int m = 0; m < MT; ++m) {
        const int16_t* x = xq + m * k;
        dot[m] = madd_add(dot[m], lo, pair(x + 2 * c));
        dot[m] = madd_add(dot[m], hi, pair(x + 16 + 2 * c));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256 mins = has_min(TYPE) ? _mm256_cvtph_ps(_mm_loadu_si128(
                                            reinterpret_cast<const __m128i*>(blk + 16)))
                                      : _mm256_setzero_ps();
    for (int m = 0; m < MT; ++m) {
      const int64_t ab = (r0 + m) * nb + b;
      const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(a.d[ab]));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), scale, acc[m]);
      if constexpr (has_min(TYPE)) acc[m] = _mm256_fmadd_ps(mins, _mm256_set1_ps(a.ds[ab]), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(y + (r0 + m) * kLanes, acc[m]);
#else
  for (int m = 0; m < MT; ++m) {
    for (int64_t j = 0; j < kLanes; ++j) {
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = group + b * block_bytes;
        const int16_t* x = a.q.data() + (r0 + m) * k + b * kBlock;
        int32_t dot = 0;
        for (int64_t c = 0; c < chunks_of(TYPE); ++c) {
          for (int64_t t = 0; t < 2; ++t) {
            const uint8_t byte = blk[chunks_at(TYPE) + 16 * c + 2 * j + t];
            if constexpr (TYPE == kQ8_0) {
              dot += static_cast<int8_t>(byte) * x[2 * c + t];
              continue;
            }
            dot += ((byte & 0x0F) - offset_of(TYPE)) * x[2 * c + t];
            dot += ((byte >> 4) - offset_of(TYPE)) * x[16 + 2 * c + t];
          }
        }
        const int64_t ab = (r0 + m) * nb + b;
        acc = std::fma(static_cast<float>(dot), half_at(blk + 2 * j) * a.d[ab], acc);
        if constexpr (has_min(TYPE)) acc = std::fma(half_at(blk + 16 + 2 * j), a.ds[ab], acc);
      }
      y[(r0 + m) * kLanes + j] = acc;
    }
  }
#endif
}

// y[r * 8 + j] for every activation row r of one group of 8 output rows, in tiles of up to 8
// rows (a block's values are widened once per tile) as even as they split: 9 rows as 5 + 4,
// not 8 + 1, whose one-row tile would widen every block again for a single row.
template <int64_t TYPE>
void dot_all_lanes(const uint8_t* group, const Activations& a, int64_t k, float* y) {
  constexpr int64_t kTile = 8;
  const int64_t tiles = (a.rows + kTile - 1) / kTile;
  for (int64_t t = 0, r = 0; t < tiles; ++t) {
    const int64_t size = (a.rows - r) / (tiles - t);
    switch (size) {
      case 8: dot_lanes<TYPE, 8>(group, a, r, k, y); break;
      case 7: dot_lanes<TYPE, 7>(group, a, r, k, y); break;
      case 6: dot_lanes<TYPE, 6>(group, a, r, k, y); break;
      case 5: dot_lanes<TYPE, 5>(group, a, r, k, y); break;
      case 4: dot_lanes<TYPE, 4>(group, a, r, k, y); break;
      case 3: dot_lanes<TYPE, 3>(group, a, r, k, y); break;
      case 2: dot_lanes<TYPE, 2>(group, a, r, k, y); break;
      default: dot_lanes<TYPE, 1>(group, a, r, k, y); break;
    }
    r += size;
  }
}

// Output rows per row of `w` (a unit): one in the file's layout, 8 interleaved.
int64_t lanes_of(int64_t type) { return type >= kInterleaved ? kLanes : 1; }

// A weight's products by layout: each unit gives lanes_of(type) outputs per activation row,
// y[r * lanes + j].
using ProductFn = void (*)(const uint8_t*, const Activations&, int64_t, float*);

ProductFn product_fn(int64_t type) {
  switch (type) {
    case kQ4_0: return dot_all_rows<kQ4_0>;
    case kQ4_1: return dot_all_rows<kQ4_1>;
    case kQ5_0: return dot_all_rows<kQ5_0>;
    case kQ5_1: return dot_all_rows<kQ5_1>;
    case kQ8_0: return dot_all_rows<kQ8_0>;
    case kQ4_K: return dot_all_rows<kQ4_K>;
    case kQ5_K: return dot_all_rows<kQ5_K>;
    case kQ6_K: return dot_all_rows<kQ6_K>;
    case kQ4_0 + kInterleaved: return dot_all_lanes<kQ4_0>;
    case kQ4_1 + kInterleaved: return dot_all_lanes<kQ4_1>;
    case kQ8_0 + kInterleaved: return dot_all_lanes<kQ8_0>;
    default: TORCH_CHECK(false, "qgemm: unsupported ggml type ", type);
  }
  return nullptr;
}

Activations quantize(const at::Tensor& x) {
  const int64_t rows = x.size(0), k = x.size(1);
  if (x.scalar_type() == at::kBFloat16) {
    return quantize_rows(x.data_ptr<at::BFloat16>(), rows, k);
  }
  return quantize_rows(x.data_ptr<float>(), rows, k);
}

// Where results go: bf16 or fp32, rounded once.
struct Output {
  void* data;
  bool bf16;
  inline void put(int64_t at, float v) const {
    if (bf16) static_cast<at::BFloat16*>(data)[at] = static_cast<at::BFloat16>(v);
    else static_cast<float*>(data)[at] = v;
  }
};

// Bytes of one unit (a row of `w`) holding k values per output row, of a type or its
// interleaved layout.
int64_t unit_bytes(int64_t type, int64_t k) {
  if (type >= kInterleaved) {
    TORCH_CHECK(interleavable(type - kInterleaved), "qgemm: unsupported ggml type ", type);
    return kLanes * row_bytes(type - kInterleaved, k);
  }
  check_type(type);
  return row_bytes(type, k);
}

void check_blocks(const at::Tensor& w, int64_t type, int64_t k) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kByte,
              "qgemm: w must be contiguous uint8 blocks [N, row bytes]");
  TORCH_CHECK(w.size(1) == unit_bytes(type, k), "qgemm: w's rows do not hold K values of this type");
}

void check(const at::Tensor& x, const at::Tensor& w, int64_t type) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "qgemm: x must be a contiguous [M, K] matrix");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "qgemm: x must be bf16 or fp32");
  TORCH_CHECK(x.size(1) % kBlock == 0, "qgemm: K must be a multiple of 32");
  check_blocks(w, type, x.size(1));
}

// Output rows per task: enough to amortise the task, few enough to share 2..16 threads.
constexpr int64_t kGrain = 16;

}  // namespace

// y = x @ dequant(w).T (+ bias) (+ residual): [M, N] in x's dtype (fp32 with float_out: logits).
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& w, int64_t type, const OptTensor& bias,
                   const OptTensor& residual, bool float_out) {
  check(x, w, type);
  const ProductFn fn = product_fn(type);
  const int64_t lanes = lanes_of(type);
  const int64_t rows = x.size(0), k = x.size(1), n_out = w.size(0) * lanes;
  const Activations a = quantize(x);
  at::Tensor b32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor res = residual.has_value() ? residual->contiguous() : at::Tensor();
  if (res.defined()) {
    TORCH_CHECK(res.size(0) == rows && res.size(1) == n_out, "qgemm: residual shape");
    res = res.to(at::kFloat);
  }
  at::Tensor out = empty({rows, n_out}, float_out ? at::kFloat : x.scalar_type());
  const Output o{out.data_ptr(), out.scalar_type() == at::kBFloat16};
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  const float* rp = res.defined() ? res.data_ptr<float>() : nullptr;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t unit = w.size(1);
  at::parallel_for(0, w.size(0), std::max<int64_t>(1, kGrain / lanes), [&](int64_t begin,
                                                                              int64_t end) {
    std::vector<float> y(rows * lanes);
    for (int64_t u = begin; u < end; ++u) {
      fn(wp + u * unit, a, k, y.data());
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < lanes; ++j) {
          const int64_t n = u * lanes + j;
          float v = y[r * lanes + j];
          if (bp) v += bp[n];
          if (rp) v += rp[r * n_out + n];
          o.put(r * n_out + n, v);
        }
      }
    }
  });
  return out;
}

// silu(x @ G.T) * (x @ U.T) where w's first half of rows is G, its second U: [M, N/2].
at::Tensor qlinear_swiglu(const at::Tensor& x, const at::Tensor& w, int64_t type) {
  check(x, w, type);
  TORCH_CHECK(w.size(0) % 2 == 0, "qgemm: swiglu needs gate and up rows (interleaved: groups)");
  const ProductFn fn = product_fn(type);
  const int64_t lanes = lanes_of(type);
  const int64_t rows = x.size(0), k = x.size(1), half = w.size(0) / 2, n_out = half * lanes;
  const Activations a = quantize(x);
  at::Tensor out = empty({rows, n_out}, x.scalar_type());
  const Output o{out.data_ptr(), out.scalar_type() == at::kBFloat16};
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t unit = w.size(1);
  at::parallel_for(0, half, std::max<int64_t>(1, kGrain / lanes), [&](int64_t begin,
                                                                         int64_t end) {
    std::vector<float> gate(rows * lanes), up(rows * lanes);
    for (int64_t u = begin; u < end; ++u) {
      fn(wp + u * unit, a, k, gate.data());
      fn(wp + (u + half) * unit, a, k, up.data());
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < lanes; ++j) {
          const float g = gate[r * lanes + j];
          o.put(r * n_out + u * lanes + j, g / (1.0f + std::exp(-g)) * up[r * lanes + j]);
        }
      }
    }
  });
  return out;
}

namespace {

// Output row `lane` of a unit (0 in the file's layout) dequantized into `out` from `at`.
template <int64_t TYPE>
void dequantize_row(const uint8_t* row, int64_t /*lane: 0*/, int64_t k, const Output& out,
                    int64_t at) {
  int32_t q[kBlock];
  Scales group[kGroup<TYPE>];
  for (int64_t b = 0; b < k / kBlock; ++b) {
    if (b % kGroup<TYPE> == 0) group_scales<TYPE>(row, b / kGroup<TYPE>, group);
    const Scales s = group[b % kGroup<TYPE>];
    block_values<TYPE>(row, b, q);
    for (int64_t j = 0; j < kBlock; ++j)
      out.put(at + b * kBlock + j, (j < 16 ? s.lo : s.hi) * static_cast<float>(q[j]) + s.min);
  }
}

template <int64_t TYPE>
void dequantize_lane(const uint8_t* group, int64_t lane, int64_t k, const Output& out,
                     int64_t at) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const uint8_t* blk = group + b * lanes_block_bytes(TYPE);
    const float d = half_at(blk + 2 * lane);
    const float min = has_min(TYPE) ? half_at(blk + 16 + 2 * lane) : 0.0f;
    for (int64_t c = 0; c < chunks_of(TYPE); ++c) {
      for (int64_t t = 0; t < 2; ++t) {
        const uint8_t byte = blk[chunks_at(TYPE) + 16 * c + 2 * lane + t];
        const int64_t v = b * kBlock + 2 * c + t;
        if constexpr (TYPE == kQ8_0) {
          out.put(at + v, d * static_cast<float>(static_cast<int8_t>(byte)));
          continue;
        }
        out.put(at + v, d * static_cast<float>((byte & 0x0F) - offset_of(TYPE)) + min);
        out.put(at + v + 16, d * static_cast<float>((byte >> 4) - offset_of(TYPE)) + min);
      }
    }
  }
}

using DequantizeFn = void (*)(const uint8_t*, int64_t, int64_t, const Output&, int64_t);

DequantizeFn dequantize_fn(int64_t type) {
  switch (type) {
    case kQ4_0: return dequantize_row<kQ4_0>;
    case kQ4_1: return dequantize_row<kQ4_1>;
    case kQ5_0: return dequantize_row<kQ5_0>;
    case kQ5_1: return dequantize_row<kQ5_1>;
    case kQ8_0: return dequantize_row<kQ8_0>;
    case kQ4_K: return dequantize_row<kQ4_K>;
    case kQ5_K: return dequantize_row<kQ5_K>;
    case kQ6_K: return dequantize_row<kQ6_K>;
    case kQ4_0 + kInterleaved: return dequantize_lane<kQ4_0>;
    case kQ4_1 + kInterleaved: return dequantize_lane<kQ4_1>;
    case kQ8_0 + kInterleaved: return dequantize_lane<kQ8_0>;
    default: TORCH_CHECK(false, "qgemm: unsupported ggml type ", type);
  }
  return nullptr;
}

}  // namespace

// Rows `ids` of dequant(w), in bf16 or fp32: the embedding lookup.
at::Tensor dequantize_rows(const at::Tensor& w, int64_t type, int64_t k,
                           const at::Tensor& ids, bool bf16) {
  check_blocks(w, type, k);
  const int64_t lanes = lanes_of(type);
  const at::Tensor idx = ids.to(at::kLong).contiguous().view(-1);
  const int64_t count = idx.size(0);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < w.size(0) * lanes, "qgemm: row id out of range");
  }
  at::Tensor out = empty({count, k}, bf16 ? at::kBFloat16 : at::kFloat);
  const Output o{out.data_ptr(), bf16};
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const DequantizeFn fn = dequantize_fn(type);
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      fn(wp + ip[i] / lanes * w.size(1), ip[i] % lanes, k, o, i * k);
  });
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  return out.reshape(shape);
}

// All of dequant(w), [N, k] in bf16 or fp32: the dense weight a prefill-sized product uses.
at::Tensor dequantize(const at::Tensor& w, int64_t type, int64_t k, bool bf16) {
  check_blocks(w, type, k);
  const int64_t lanes = lanes_of(type), rows = w.size(0) * lanes;
  at::Tensor out = empty({rows, k}, bf16 ? at::kBFloat16 : at::kFloat);
  const Output o{out.data_ptr(), bf16};
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const DequantizeFn fn = dequantize_fn(type);
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) fn(wp + i / lanes * w.size(1), i % lanes, k, o, i * k);
  });
  return out;
}

// The layout this build's products are fastest on for a weight of ggml type `type` with
// `rows` output rows: the interleaved one (type + 256) where it is written and measured
// faster, else the file's own: interleaved Q4_0, Q4_1 and Q8_0 wherever the build has AVX2.
// On a 2-core Zen 5 the AVX-512 builds' file-layout kernel took 1.4-2x as long as the
// interleaved one (whose 256-bit madds are VNNI's vpdpwssd there) for SmolLM2-135M's
// products, at one row as at nine.
int64_t qgemm_layout(int64_t type, int64_t rows) {
#if defined(__AVX2__)
  if (interleavable(type) && rows % kLanes == 0) return type + kInterleaved;
#endif
  (void)rows;
  return type;
}

// w's file-layout rows [N, row bytes] in the interleaved layout [N/8, 8 * row bytes].
at::Tensor qgemm_interleave(const at::Tensor& w, int64_t type, int64_t k) {
  TORCH_CHECK(interleavable(type), "qgemm: ggml type ", type, " has no interleaved layout");
  check_blocks(w, type, k);
  TORCH_CHECK(w.size(0) % kLanes == 0, "qgemm: interleaving needs rows in groups of 8");
  const int64_t groups = w.size(0) / kLanes, blocks = k / kBlock, in = w.size(1);
  constexpr int64_t kBytes = 2;  // a chunk takes 2 bytes of each row
  at::Tensor out = empty({groups, kLanes * in}, at::kByte);
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const auto copy = [&](auto type_tag) {
    constexpr int64_t TYPE = decltype(type_tag)::value;
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        for (int64_t b = 0; b < blocks; ++b) {
          uint8_t* to = dst + g * kLanes * in + b * lanes_block_bytes(TYPE);
          for (int64_t j = 0; j < kLanes; ++j) {
            const uint8_t* from = src + (g * kLanes + j) * in + b * group_bytes(TYPE);
            std::memcpy(to + 2 * j, from, 2);                                 // d
            if constexpr (has_min(TYPE)) std::memcpy(to + 16 + 2 * j, from + 2, 2);  // m
            for (int64_t c = 0; c < chunks_of(TYPE); ++c)
              std::memcpy(to + chunks_at(TYPE) + 16 * c + kBytes * j,
                          from + nibbles_at(TYPE) + kBytes * c, kBytes);
          }
        }
      }
    });
  };
  if (type == kQ4_0) copy(std::integral_constant<int64_t, kQ4_0>{});
  else if (type == kQ4_1) copy(std::integral_constant<int64_t, kQ4_1>{});
  else copy(std::integral_constant<int64_t, kQ8_0>{});
  return out;
}

}  // namespace kvgate
