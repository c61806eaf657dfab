// Small-batch matmuls on GGUF-quantized weights (Q8_0, Q4_0, Q4_1), kept as the file's blocks.
//
// The weight stays in the file's own blocks, one row of blocks per output feature: 32 weights
// each, with an fp16 scale d (and Q4_1's fp16 minimum m) before the 4- or 8-bit values. Each
// call quantizes its activation rows once to int16 per 32-block (a float scale dx each), then
// every (output row, block) pair is an integer dot product of 32 int16 pairs (`madd_epi16`:
// AVX-512BW 32 pairs, AVX2 16 per instruction), scaled in fp32 by d*dx:
//   Q8_0:  w = d*q        (q in -127..127)  dot = d*dx*sum(q*xq)
//   Q4_0:  w = d*(q - 8)  (q in 0..15)      dot = d*dx*sum((q-8)*xq)
//   Q4_1:  w = d*q + m    (q in 0..15)      dot = d*dx*sum(q*xq) + m*dx*sum(xq)
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
// output rows (torch's thread count). Built by engine/models/quantized_linear.py with
// -march=native (or -march=haswell: the AVX2 path); without AVX2, a scalar path.

#include <torch/extension.h>

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

namespace {

// ggml's type ids.
constexpr int64_t kQ4_0 = 2;
constexpr int64_t kQ4_1 = 3;
constexpr int64_t kQ8_0 = 8;
constexpr int64_t kBlock = 32;

int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    default: TORCH_CHECK(false, "qgemm: unsupported ggml type ", type);
  }
  return 0;
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

// A block's 32 weights as bytes in order: Q8_0's signed values, or the 4-bit ones (0..15).
template <int64_t TYPE>
inline __m256i weight_bytes(const uint8_t* blk) {
  if constexpr (TYPE == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i packed =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (TYPE == kQ4_0 ? 2 : 4)));
    const __m128i lo = _mm_and_si128(packed, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low4);
    return _mm256_set_m128i(hi, lo);  // values 0..15 then 16..31
  }
}
#endif

#if defined(__AVX512BW__)
using Acc = __m512;
inline Acc acc_zero() { return _mm512_setzero_ps(); }
inline float acc_sum(Acc v) { return _mm512_reduce_add_ps(v); }
// The block's weights as 32 int16 (Q4_0's offset of 8 taken off).
template <int64_t TYPE>
inline __m512i weight_words(const uint8_t* blk) {
  const __m256i bytes = weight_bytes<TYPE>(blk);
  if constexpr (TYPE == kQ8_0) return _mm512_cvtepi8_epi16(bytes);
  const __m512i words = _mm512_cvtepu8_epi16(bytes);
  if constexpr (TYPE == kQ4_0) return _mm512_sub_epi16(words, _mm512_set1_epi16(8));
  return words;
}
// acc += (w . xq) * scale, the 32 products summed pairwise into 16 int32 lanes.
inline Acc block_dot(Acc acc, __m512i w, const int16_t* xq, float scale) {
  const __m512i dot = _mm512_madd_epi16(w, _mm512_loadu_si512(xq));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(scale), acc);
}
#elif defined(__AVX2__)
using Acc = __m256;
inline Acc acc_zero() { return _mm256_setzero_ps(); }
inline float acc_sum(Acc v) { return hsum(v); }
struct Words {
  __m256i lo, hi;
};
template <int64_t TYPE>
inline Words weight_words(const uint8_t* blk) {
  const __m256i bytes = weight_bytes<TYPE>(blk);
  const __m128i b0 = _mm256_castsi256_si128(bytes), b1 = _mm256_extracti128_si256(bytes, 1);
  Words w;
  if constexpr (TYPE == kQ8_0) {
    w = {_mm256_cvtepi8_epi16(b0), _mm256_cvtepi8_epi16(b1)};
  } else {
    w = {_mm256_cvtepu8_epi16(b0), _mm256_cvtepu8_epi16(b1)};
    if constexpr (TYPE == kQ4_0) {
      const __m256i eight = _mm256_set1_epi16(8);
      w = {_mm256_sub_epi16(w.lo, eight), _mm256_sub_epi16(w.hi, eight)};
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
#endif

// y[r] = row n of W . activation row r, for the MT rows r0..r0+MT-1.
template <int64_t TYPE, int MT>
void dot_rows(const uint8_t* wrow, const Activations& a, int64_t r0, int64_t k, float* y) {
  constexpr int64_t bytes = TYPE == kQ4_0 ? 18 : TYPE == kQ4_1 ? 20 : 34;
  const int64_t nb = a.blocks;
  float corr[MT] = {};
#if defined(__AVX2__)
  Acc acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = acc_zero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + b * bytes;
    const float d = half_at(blk);
    const float min = TYPE == kQ4_1 ? half_at(blk + 2) : 0.0f;
    const auto w = weight_words<TYPE>(blk);
    for (int m = 0; m < MT; ++m) {
      const int64_t ab = (r0 + m) * nb + b;
      acc[m] = block_dot(acc[m], w, a.q.data() + (r0 + m) * k + b * kBlock, d * a.d[ab]);
      if constexpr (TYPE == kQ4_1) corr[m] += min * a.ds[ab];
    }
  }
  for (int m = 0; m < MT; ++m) y[m] = acc_sum(acc[m]) + corr[m];
#else
  float acc[MT] = {};
  int32_t w[kBlock];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + b * bytes;
    const float d = half_at(blk);
    if constexpr (TYPE == kQ8_0) {
      for (int64_t i = 0; i < kBlock; ++i) w[i] = static_cast<int8_t>(blk[2 + i]);
    } else {
      const int32_t offset = TYPE == kQ4_0 ? 8 : 0;
      const uint8_t* qs = blk + (TYPE == kQ4_0 ? 2 : 4);
      for (int64_t i = 0; i < 16; ++i) {
        w[i] = (qs[i] & 0x0F) - offset;
        w[i + 16] = (qs[i] >> 4) - offset;
      }
    }
    for (int m = 0; m < MT; ++m) {
      const int64_t at = (r0 + m) * k + b * kBlock;
      int32_t dot = 0;
      for (int64_t i = 0; i < kBlock; ++i) dot += w[i] * a.q[at + i];
      const int64_t ab = (r0 + m) * nb + b;
      acc[m] += d * a.d[ab] * static_cast<float>(dot);
      if constexpr (TYPE == kQ4_1) corr[m] += half_at(blk + 2) * a.ds[ab];
    }
  }
  for (int m = 0; m < MT; ++m) y[m] = acc[m] + corr[m];
#endif
}

// y[r, n] for every activation row r of one output row n (tiles of 4 rows).
template <int64_t TYPE>
void dot_all_rows(const uint8_t* wrow, const Activations& a, int64_t k, float* y, int64_t ystride) {
  float tile[4];
  int64_t r = 0;
  for (; r + 4 <= a.rows; r += 4) {
    dot_rows<TYPE, 4>(wrow, a, r, k, tile);
    for (int m = 0; m < 4; ++m) y[(r + m) * ystride] = tile[m];
  }
  const int64_t left = a.rows - r;
  if (left == 3) dot_rows<TYPE, 3>(wrow, a, r, k, tile);
  if (left == 2) dot_rows<TYPE, 2>(wrow, a, r, k, tile);
  if (left == 1) dot_rows<TYPE, 1>(wrow, a, r, k, tile);
  for (int64_t m = 0; m < left; ++m) y[(r + m) * ystride] = tile[m];
}

using RowFn = void (*)(const uint8_t*, const Activations&, int64_t, float*, int64_t);

RowFn row_fn(int64_t type) {
  switch (type) {
    case kQ4_0: return dot_all_rows<kQ4_0>;
    case kQ4_1: return dot_all_rows<kQ4_1>;
    case kQ8_0: return dot_all_rows<kQ8_0>;
    default: TORCH_CHECK(false, "qgemm: unsupported ggml type ", type);
  }
  return nullptr;
}

Activations quantize(const torch::Tensor& x) {
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

void check(const torch::Tensor& x, const torch::Tensor& w, int64_t type) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "qgemm: x must be a contiguous [M, K] matrix");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "qgemm: x must be bf16 or fp32");
  TORCH_CHECK(x.size(1) % kBlock == 0, "qgemm: K must be a multiple of 32");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kByte,
              "qgemm: w must be contiguous uint8 blocks [N, K/32 * block bytes]");
  TORCH_CHECK(w.size(1) == x.size(1) / kBlock * block_bytes(type),
              "qgemm: w's rows do not hold K values of this type");
}


// Output rows per task: enough to amortise the task, few enough to share 2..16 threads.
constexpr int64_t kGrain = 16;

}  // namespace

// y = x @ dequant(w).T (+ bias) (+ residual): [M, N] in x's dtype (fp32 with float_out: logits).
torch::Tensor qlinear(const torch::Tensor& x, const torch::Tensor& w, int64_t type,
                      const c10::optional<torch::Tensor>& bias,
                      const c10::optional<torch::Tensor>& residual, bool float_out) {
  check(x, w, type);
  const int64_t rows = x.size(0), k = x.size(1), n_out = w.size(0);
  const Activations a = quantize(x);
  const RowFn fn = row_fn(type);
  torch::Tensor b32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : torch::Tensor();
  torch::Tensor res = residual.has_value() ? residual->contiguous() : torch::Tensor();
  if (res.defined()) {
    TORCH_CHECK(res.size(0) == rows && res.size(1) == n_out, "qgemm: residual shape");
    res = res.to(at::kFloat);
  }
  torch::Tensor out = torch::empty({rows, n_out}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  const Output o{out.data_ptr(), out.scalar_type() == at::kBFloat16};
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  const float* rp = res.defined() ? res.data_ptr<float>() : nullptr;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  at::parallel_for(0, n_out, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> y(rows);
    for (int64_t n = begin; n < end; ++n) {
      fn(wp + n * row_bytes, a, k, y.data(), 1);
      for (int64_t r = 0; r < rows; ++r) {
        float v = y[r];
        if (bp) v += bp[n];
        if (rp) v += rp[r * n_out + n];
        o.put(r * n_out + n, v);
      }
    }
  });
  return out;
}

// silu(x @ G.T) * (x @ U.T) where w's first half of rows is G, its second U: [M, N/2].
torch::Tensor qlinear_swiglu(const torch::Tensor& x, const torch::Tensor& w, int64_t type) {
  check(x, w, type);
  TORCH_CHECK(w.size(0) % 2 == 0, "qgemm: swiglu needs gate and up rows");
  const int64_t rows = x.size(0), k = x.size(1), half = w.size(0) / 2;
  const Activations a = quantize(x);
  const RowFn fn = row_fn(type);
  torch::Tensor out = torch::empty({rows, half}, x.options());
  const Output o{out.data_ptr(), out.scalar_type() == at::kBFloat16};
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  at::parallel_for(0, half, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(rows), up(rows);
    for (int64_t n = begin; n < end; ++n) {
      fn(wp + n * row_bytes, a, k, gate.data(), 1);
      fn(wp + (n + half) * row_bytes, a, k, up.data(), 1);
      for (int64_t r = 0; r < rows; ++r) {
        const float g = gate[r];
        o.put(r * half + n, g / (1.0f + std::exp(-g)) * up[r]);
      }
    }
  });
  return out;
}

namespace {

// One row of blocks dequantized into `out` (bf16 or fp32) from column 0.
void dequantize_row(const uint8_t* row, int64_t type, int64_t k, const Output& out, int64_t at) {
  const int64_t bytes = block_bytes(type);
  float o[kBlock];
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const uint8_t* blk = row + b * bytes;
    const float d = half_at(blk);
    if (type == kQ8_0) {
      for (int64_t j = 0; j < kBlock; ++j) o[j] = d * static_cast<float>(static_cast<int8_t>(blk[2 + j]));
    } else {
      const int32_t offset = type == kQ4_0 ? 8 : 0;
      const float m = type == kQ4_0 ? 0.0f : half_at(blk + 2);
      const uint8_t* qs = blk + (type == kQ4_0 ? 2 : 4);
      for (int64_t j = 0; j < 16; ++j) {
        o[j] = d * static_cast<float>((qs[j] & 0x0F) - offset) + m;
        o[j + 16] = d * static_cast<float>((qs[j] >> 4) - offset) + m;
      }
    }
    for (int64_t j = 0; j < kBlock; ++j) out.put(at + b * kBlock + j, o[j]);
  }
}

void check_blocks(const torch::Tensor& w, int64_t type, int64_t k) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kByte,
              "qgemm: w must be contiguous uint8 blocks");
  TORCH_CHECK(k % kBlock == 0 && w.size(1) == k / kBlock * block_bytes(type),
              "qgemm: w's rows do not hold K values of this type");
}

}  // namespace

// Rows `ids` of dequant(w), in bf16 or fp32: the embedding lookup.
torch::Tensor dequantize_rows(const torch::Tensor& w, int64_t type, int64_t k,
                              const torch::Tensor& ids, bool bf16) {
  check_blocks(w, type, k);
  const torch::Tensor idx = ids.to(at::kLong).contiguous().view(-1);
  const int64_t count = idx.size(0);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < w.size(0), "qgemm: row id out of range");
  }
  torch::Tensor out = torch::empty({count, k}, torch::dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const Output o{out.data_ptr(), bf16};
  const uint8_t* wp = w.data_ptr<uint8_t>();
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequantize_row(wp + ip[i] * w.size(1), type, k, o, i * k);
  });
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  return out.reshape(shape);
}

// All of dequant(w), [N, k] in bf16 or fp32: the dense weight a prefill-sized product uses.
torch::Tensor dequantize(const torch::Tensor& w, int64_t type, int64_t k, bool bf16) {
  check_blocks(w, type, k);
  const int64_t rows = w.size(0);
  torch::Tensor out = torch::empty({rows, k}, torch::dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const Output o{out.data_ptr(), bf16};
  const uint8_t* wp = w.data_ptr<uint8_t>();
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequantize_row(wp + i * w.size(1), type, k, o, i * k);
  });
  return out;
}

// The instruction set the integer dot products use in this build (for the tests and logs).
std::string isa() {
#if defined(__AVX512BW__)
  return "avx512bw";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &qlinear, "x @ dequant(w).T (+ bias) (+ residual)");
  m.def("qlinear_swiglu", &qlinear_swiglu, "silu(x @ gate.T) * (x @ up.T)");
  m.def("dequantize_rows", &dequantize_rows, "rows of dequant(w): an embedding lookup");
  m.def("dequantize", &dequantize, "all of dequant(w)");
  m.def("isa", &isa, "the dot-product instructions of this build");
}
