// Small-batch GEMM on the CPU over weights in a layout this file owns: y = x @ W^T.
//
// Decode-sized products (1-64 rows) are memory-bound: each weight byte is used by a few rows
// only, so the kernel's job is to stream the weights once at the machine's read rate. The
// weights are repacked at load (engine/models/gemm/__init__.py) into panels of kWidth output
// columns, each panel K-major: fp32 as [K][kWidth] (one vector load per k), bf16 as pairs
// ([K/2][kWidth][2]): AVX-512-BF16's vdpbf16ps multiplies two k at once, and other builds
// widen one load into k's and k+1's fp32 weights with a shift and a mask.
// Panels lie one after another, so a thread walking its columns reads one sequential stream;
// a software prefetch runs ahead of it (hardware prefetchers stop at page boundaries).
//
// A work unit is two adjacent panels (the gate and up panels of one column block for the
// SwiGLU/GeGLU epilogue); threads split the units (at::parallel_for: torch's thread count).
// Rows go kMaxRows at a time through one register tile of fp32 accumulators, then through an
// epilogue in fp32 (bias, residual add, act(gate) * up) rounded once to the output dtype.
//
// Each ISA variant of the library (engine/native_variants.py) picks its vectors: AVX-512F, with
// vdpbf16ps in the avx512bf16 and amx variants; AVX2 + FMA (bf16 widened to fp32) in avx2.
// Prefills run through the same tiles (8 rows at a time against each panel pair in L2).
//
// Where the build has AMX (amx_tile + amx_bf16: Xeon since Sapphire Rapids), bf16 products of
// kAmxMinRows rows or more whose K is a multiple of 32 go through tiles instead: the pairs
// layout is already AMX's B layout (a tile's 16 rows of 64 bytes are 16 k-pairs of one
// panel's 16 columns), so one packed copy serves both paths. 32 rows x the unit's 2 panels
// accumulate in 4 tiles of 16 x 16 fp32, then go through the same epilogue.

#include "kvgate_simd.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define KVGATE_AMX 1
#endif

namespace kvgate {
namespace {

#if defined(__AVX512F__)
constexpr int kMaxRows = 8;  // 8 rows x 2 panels: 16 of the 32 zmm registers accumulate
// 2 * kWidth bf16 stored as pairs (column c's k and k+1 side by side) -> (k, k+1) as fp32:
// a shift and a mask, no shuffle (a bf16 is the top half of an fp32).
inline void load_pairs(const BF16* p, Vec& even, Vec& odd) {
  const __m512i bits = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(-65536)));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kMaxRows = 6;  // 6 x 2 accumulators, 2 weights and a row's x: 15 of 16 ymm
inline void load_pairs(const BF16* p, Vec& even, Vec& odd) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(-65536)));
}
#else
constexpr int kMaxRows = 4;
inline void load_pairs(const BF16* p, Vec& even, Vec& odd) {
  even = static_cast<float>(p[0]);
  odd = static_cast<float>(p[1]);
}
#endif

// How far ahead of its reads a panel stream is prefetched: at one row on a Zen 4 core, 1 KiB
// read 25-26 GB/s, 4 KiB 27-29, none 22-23 (benchmarks/gemm.py shapes; noisy beyond 4 KiB).
constexpr int64_t kPrefetchBytes = 4096;

inline void prefetch(const void* p) {
#if defined(__AVX512F__) || defined(__AVX2__)
  _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
#else
  (void)p;
#endif
}

// acc[R][P] over k of x[r][k] * w_p[k][:], the panels `panel` elements apart; the tile goes to
// out[r][p * kWidth + c]. fp32 weights, [K][kWidth] panels.
template <int R, int P>
void tile_fma(const float* x, int64_t ldx, const float* w, int64_t panel, int64_t K, float* out) {
  Vec acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = zero();
  for (int64_t k = 0; k < K; ++k) {
    Vec wv[P];
    for (int p = 0; p < P; ++p) {
      const float* at = w + p * panel + k * kWidth;
      prefetch(at);
      wv[p] = load(at);
    }
    for (int r = 0; r < R; ++r) {
      const Vec xv = splat(x[r * ldx + k]);
      for (int p = 0; p < P; ++p) acc[r][p] = fmadd(xv, wv[p], acc[r][p]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) store(out + (r * P + p) * kWidth, acc[r][p]);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// The same over bf16 pairs: one vdpbf16ps adds x[2j] * w[2j] + x[2j+1] * w[2j+1] per column.
// An odd K's last pair holds x[K-1] and a zero (the packed weight's is zero too).
template <int R, int P>
void tile_pairs(const BF16* x, int64_t ldx, const BF16* w, int64_t panel, int64_t K, float* out) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  auto step = [&](int64_t j, const int32_t* xpair) {
    __m512bh wv[P];
    for (int p = 0; p < P; ++p) {
      const BF16* at = w + p * panel + j * 2 * kWidth;
      prefetch(at);
      wv[p] = (__m512bh)_mm512_loadu_si512(at);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xpair[r]);
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xv, wv[p]);
    }
  };
  int32_t xpair[R];
  for (int64_t j = 0; j < pairs; ++j) {
    for (int r = 0; r < R; ++r) std::memcpy(&xpair[r], x + r * ldx + 2 * j, sizeof(int32_t));
    step(j, xpair);
  }
  if (K % 2) {
    for (int r = 0; r < R; ++r) xpair[r] = static_cast<int32_t>(x[r * ldx + K - 1].x);
    step(pairs, xpair);
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(out + (r * P + p) * kWidth, acc[r][p]);
}
#endif

// bf16 pairs without vdpbf16ps: each load widened into k's and k+1's weights, two FMAs per
// row against the rows widened to fp32 (once per call, by `run`).
template <int R, int P>
void tile_widened(const float* x, int64_t ldx, const BF16* w, int64_t panel, int64_t K,
                  float* out) {
  Vec acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = zero();
  const int64_t pairs = K / 2;
  for (int64_t j = 0; j < pairs; ++j) {
    Vec even[P], odd[P];
    for (int p = 0; p < P; ++p) {
      const BF16* at = w + p * panel + j * 2 * kWidth;
      prefetch(at);
      load_pairs(at, even[p], odd[p]);
    }
    for (int r = 0; r < R; ++r) {
      const Vec x0 = splat(x[r * ldx + 2 * j]), x1 = splat(x[r * ldx + 2 * j + 1]);
      for (int p = 0; p < P; ++p) acc[r][p] = fmadd(x1, odd[p], fmadd(x0, even[p], acc[r][p]));
    }
  }
  if (K % 2) {  // the last pair: x[K-1] and the packing's zero
    Vec even[P], odd[P];
    for (int p = 0; p < P; ++p) load_pairs(w + p * panel + pairs * 2 * kWidth, even[p], odd[p]);
    for (int r = 0; r < R; ++r) {
      const Vec x0 = splat(x[r * ldx + K - 1]);
      for (int p = 0; p < P; ++p) acc[r][p] = fmadd(x0, even[p], acc[r][p]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) store(out + (r * P + p) * kWidth, acc[r][p]);
}

template <int R, int P, typename X, typename T>
void tile(const X* x, int64_t ldx, const T* w, int64_t panel, int64_t K, float* out) {
  if constexpr (std::is_same_v<T, float>) {
    tile_fma<R, P>(x, ldx, w, panel, K, out);
  } else if constexpr (std::is_same_v<X, float>) {
    tile_widened<R, P>(x, ldx, w, panel, K, out);
  } else {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    tile_pairs<R, P>(x, ldx, w, panel, K, out);
#endif
  }
}

template <int P, typename X, typename T>
void tile_rows(int rows, const X* x, int64_t ldx, const T* w, int64_t panel, int64_t K,
               float* out) {
  switch (rows) {
#define KVGATE_ROWS(R) \
  case R:              \
    return tile<R, P>(x, ldx, w, panel, K, out);
    KVGATE_ROWS(1)
    KVGATE_ROWS(2)
    KVGATE_ROWS(3)
    KVGATE_ROWS(4)
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    KVGATE_ROWS(5)
    KVGATE_ROWS(6)
#endif
#if defined(__AVX512F__)
    KVGATE_ROWS(7)
    KVGATE_ROWS(8)
#endif
#undef KVGATE_ROWS
    default:
      TORCH_CHECK(false, "gemm: a tile of ", rows, " rows");
  }
}

constexpr int kAmxRows = 32;  // two 16-row tiles of x against the unit's two panels
// Fewer rows stay on the vector tiles, bound by the weight stream either way. From 8 rows the
// vector tiles are bound by their FMAs on a 2-core Xeon with AMX, and the AMX tiles took
// 0.5-1.0x their time on every bench55m shape (benchmarks/gemm.py).
constexpr int64_t kAmxMinRows = 8;
constexpr int64_t kAmxK = 32;  // k per tile step: a tile row holds 64 bytes

#if defined(KVGATE_AMX)
// Linux hands out AMX's 8 KiB of tile state only to a process that asks (arch_prctl), once.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: the accumulators (2 * block + panel), 4-5: x's two 16-row blocks, 6-7: the two
// panels' 16 k-pairs. `rows` of x in this tile step (1-32); a block of none is left unset.
void configure_tiles(int rows) {
  TileConfig config;
  for (int block = 0; block < 2; ++block) {
    const int held = std::clamp(rows - 16 * block, 0, 16);
    for (int tile : {2 * block, 2 * block + 1, 4 + block}) {
      config.rows[tile] = static_cast<uint8_t>(held);
      config.colsb[tile] = held ? 64 : 0;
    }
  }
  for (int tile : {6, 7}) {
    config.rows[tile] = 16;
    config.colsb[tile] = 64;
  }
  _tile_loadconfig(&config);
}

// acc[r][p * kWidth + c] over the configured rows (<= 32) against P panels; K % 32 == 0.
template <int P>
void tile_amx(int rows, const BF16* x, int64_t ldx, const BF16* w, int64_t panel, int64_t K,
              float* out) {
  const bool two = rows > 16;  // the second block's tiles are unset otherwise: touching one faults
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t x_stride = ldx * static_cast<int64_t>(sizeof(BF16));
  for (int64_t k = 0; k < K; k += kAmxK) {
    _tile_loadd(6, w + k * kWidth, 64);  // k-pairs k/2 .. k/2+15: 64 bytes each
    if constexpr (P == 2) _tile_loadd(7, w + panel + k * kWidth, 64);
    _tile_loadd(4, x + k, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (P == 2) _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, x + 16 * ldx + k, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (P == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t out_stride = P * kWidth * static_cast<int64_t>(sizeof(float));
  float* lower = out + 16 * P * kWidth;
  _tile_stored(0, out, out_stride);
  if constexpr (P == 2) _tile_stored(1, out + kWidth, out_stride);
  if (two) {
    _tile_stored(2, lower, out_stride);
    if constexpr (P == 2) _tile_stored(3, lower + kWidth, out_stride);
  }
}
#endif

enum Mode : int64_t { kLinear = 0, kSiluMul = 1, kGeluMul = 2 };

// act(gate) * up over one panel's kWidth columns, in fp32.
// sigmoid(x) from e = e^-|x| (never overflows): 1 / (1 + e) for x >= 0, e / (1 + e) below.
inline Vec sigmoid(Vec x) {
  const Vec e = exp_nonpositive(splat(0.f) - vabs(x));
  const Vec s = splat(1.f) / (splat(1.f) + e);
  return if_nonnegative(x, s, e * s);
}

inline Vec gated(int64_t mode, const float* gate, const float* up) {
  const Vec g = load(gate);
  Vec act;
  if (mode == kSiluMul) {
    act = g * sigmoid(g);
  } else {  // gelu(approximate="tanh") = g * sigmoid(2y), y = sqrt(2/pi) (g + 0.044715 g^3)
    const Vec y = splat(0.7978845608028654f) * fmadd(splat(0.044715f) * g, g * g, g);
    act = g * sigmoid(y + y);
  }
  return act * load(up);
}

struct Problem {
  int64_t rows, K, panels, panel;  // panel: elements from one panel to the next
  int64_t n, half;                 // output columns; half > 0: gate/up panels alternate
  int64_t mode;
};

// One unit (panels 2u and 2u+1, or the last odd one) for rows [first, last), written to y.
// `tiles`: -1 where this call runs on the vector tiles, else the rows the AMX tiles are
// configured for (0: not yet on this thread).
template <typename X, typename T>
void unit(const Problem& pr, int64_t u, int64_t first, int64_t last, const X* x, const T* w,
          const T* bias, const T* residual, T* y, int& tiles) {
  const int P = (2 * u + 1 < pr.panels) ? 2 : 1;
  const int64_t step = tiles < 0 ? kMaxRows : kAmxRows;
  alignas(64) float acc[std::max(kMaxRows, kAmxRows) * 2 * kWidth];
  const int64_t ldy = pr.mode == kLinear ? pr.n : pr.half;
  // Where each panel's columns go, and how many of them are real (the last is padded).
  int64_t col[2], valid[2];
  for (int p = 0; p < P; ++p) {
    const int64_t index = 2 * u + p;
    if (pr.half > 0) {
      const int64_t start = (index / 2) * kWidth;
      col[p] = (index % 2) * pr.half + start;
      valid[p] = std::min<int64_t>(kWidth, pr.half - start);
    } else {
      col[p] = index * kWidth;
      valid[p] = std::min<int64_t>(kWidth, pr.n - col[p]);
    }
  }
  const T* panels = w + 2 * u * pr.panel;
  for (int64_t m0 = first; m0 < last; m0 += step) {
    const int rows = static_cast<int>(std::min<int64_t>(step, last - m0));
#if defined(KVGATE_AMX)
    if constexpr (std::is_same_v<X, BF16>) {
      if (tiles >= 0) {
        if (rows != tiles) configure_tiles(tiles = rows);
        if (P == 2)
          tile_amx<2>(rows, x + m0 * pr.K, pr.K, panels, pr.panel, pr.K, acc);
        else
          tile_amx<1>(rows, x + m0 * pr.K, pr.K, panels, pr.panel, pr.K, acc);
      }
    }
#endif
    if (tiles < 0) {
      if (P == 2)
        tile_rows<2>(rows, x + m0 * pr.K, pr.K, panels, pr.panel, pr.K, acc);
      else
        tile_rows<1>(rows, x + m0 * pr.K, pr.K, panels, pr.panel, pr.K, acc);
    }
    for (int r = 0; r < rows; ++r) {
      const int64_t m = m0 + r;
      const float* a = acc + r * P * kWidth;
      if (pr.mode != kLinear) {  // act(gate) * up into the gate's columns of a [rows, half] y
        T* out = y + m * ldy + col[0];
        if (valid[0] == kWidth) {
          store(out, gated(pr.mode, a, a + kWidth));
          continue;
        }
        alignas(64) float h[kWidth];
        store(h, gated(pr.mode, a, a + kWidth));
        for (int64_t c = 0; c < valid[0]; ++c) out[c] = static_cast<T>(h[c]);
        continue;
      }
      for (int p = 0; p < P; ++p) {
        T* out = y + m * ldy + col[p];
        const float* ap = a + p * kWidth;
        if (valid[p] == kWidth) {  // a whole panel: in vectors, rounded as below
          Vec v = load(ap);
          if (bias) v = v + load(bias + col[p]);
          if (residual) v = v + load(residual + m * ldy + col[p]);
          store(out, v);
          continue;
        }
        for (int64_t c = 0; c < valid[p]; ++c) {
          float v = ap[c];
          if (bias) v += widen(bias[col[p] + c]);
          if (residual) v += widen(residual[m * ldy + col[p] + c]);
          out[c] = static_cast<T>(v);
        }
      }
    }
  }
}

// Below this many weight bytes a call runs on the calling thread: waking the pool costs more.
constexpr int64_t kBytesPerTask = 96 * 1024;
// Rows of x a thread keeps in its L2 (1 MB a core on the Zen 4) while its panels stream by.
constexpr int64_t kRowBlockBytes = 512 * 1024;
// Weight bytes a thread keeps in its L2 (2 MB a core on the Xeon with AMX) for the AMX tiles:
// 2,000 x 6,656 x 512 ran 1.25x faster than x's rows in blocks against all the panels, and
// 256 KiB-1.5 MiB all within noise of 1 MiB elsewhere.
constexpr int64_t kAmxPanelBytes = 1024 * 1024;

template <typename T>
void run(const Problem& pr, const at::Tensor& x, const at::Tensor& w,
         const OptTensor& bias, const OptTensor& residual,
         at::Tensor& y) {
  // bf16 rows without vdpbf16ps: widened once here, not once per panel pair in the tiles.
  at::Tensor widened;
  if constexpr (std::is_same_v<T, BF16> && !kBf16Dot) widened = x.to(at::kFloat);
  using X = std::conditional_t<std::is_same_v<T, BF16> && !kBf16Dot, float, T>;
  const X* xp = (std::is_same_v<X, T> ? x : widened).template data_ptr<X>();
  const T* wp = w.data_ptr<T>();
  const T* bp = bias ? bias->data_ptr<T>() : nullptr;
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  T* yp = y.data_ptr<T>();
  const int64_t units = (pr.panels + 1) / 2;
  const int64_t unit_bytes = 2 * pr.panel * static_cast<int64_t>(sizeof(T));
  const int64_t grain = std::max<int64_t>(1, kBytesPerTask / std::max<int64_t>(1, unit_bytes));
  bool amx = false;
#if defined(KVGATE_AMX)
  amx = std::is_same_v<X, BF16> && pr.rows >= kAmxMinRows && pr.K % kAmxK == 0 &&
        amx_permitted();
#endif
  // Vector tiles: x's rows a block at a time (kRowBlockBytes, in L2) while all the thread's
  // units stream past, instead of every unit re-reading all of x (2 MB at 2,000 x 512 bf16
  // rows, 13 MB for the down projection's K). AMX tiles: 32 rows at a time (in L1) against
  // units kAmxPanelBytes at a time (in L2), so no tile's operand comes from beyond L2.
  const int64_t row_bytes = pr.K * static_cast<int64_t>(sizeof(X));
  const int64_t block_rows =
      amx ? kAmxRows
          : std::max<int64_t>(kMaxRows,
                              kRowBlockBytes / std::max<int64_t>(1, row_bytes) / kMaxRows * kMaxRows);
  const int64_t chunk_units = amx ? std::max<int64_t>(1, kAmxPanelBytes / unit_bytes) : units;
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    int tiles = amx ? 0 : -1;  // configured per thread: oneDNN may have used its tiles since
    for (int64_t u0 = begin; u0 < end; u0 += chunk_units) {
      const int64_t u1 = std::min(end, u0 + chunk_units);
      for (int64_t m0 = 0; m0 < pr.rows; m0 += block_rows) {
        const int64_t m1 = std::min(pr.rows, m0 + block_rows);
        for (int64_t u = u0; u < u1; ++u) unit(pr, u, m0, m1, xp, wp, bp, rp, yp, tiles);
      }
    }
#if defined(KVGATE_AMX)
    if (tiles > 0) _tile_release();  // the kernel then saves no tile state on a switch
#endif
  });
}

}  // namespace

// y = x @ W^T for a weight packed by `gemm_layout()`'s rules: [rows, n], or [rows, half] for
// the gated modes (gate and up panels alternating; half = the columns of each).
at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t half,
                int64_t mode, const OptTensor& bias,
                const OptTensor& residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "gemm: x [rows, K]");
  TORCH_CHECK(packed.scalar_type() == x.scalar_type() && packed.is_contiguous() &&
                  packed.dim() == 3,
              "gemm: a packed weight of x's dtype");
  TORCH_CHECK(mode == kLinear || half > 0, "gemm: a gated mode needs gate/up panels");
  TORCH_CHECK(mode == kLinear || (!bias && !residual), "gemm: the gated modes take no bias");
  Problem pr{x.size(0), x.size(1), packed.size(0), packed.size(1) * packed.size(2), n, half, mode};
  const bool pairs = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(packed.size(2) == kWidth * (pairs ? 2 : 1) &&
                  packed.size(1) == (pairs ? (pr.K + 1) / 2 : pr.K),
              "gemm: the packed weight's K or panel width does not match this build");
  TORCH_CHECK(pr.panels * kWidth >= (half > 0 ? 2 * half : n), "gemm: too few panels for n");
  TORCH_CHECK(half == 0 || pr.panels % 2 == 0, "gemm: gate/up panels come in pairs");
  const int64_t cols = mode == kLinear ? n : half;
  for (const auto& t : {bias, residual}) {
    if (t) TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->is_contiguous(), "gemm: epilogue operand");
  }
  if (bias) TORCH_CHECK(bias->numel() == cols, "gemm: bias [n]");
  if (residual) TORCH_CHECK(residual->dim() == 2 && residual->size(0) == pr.rows &&
                                residual->size(1) == cols,
                            "gemm: residual [rows, n]");
  at::Tensor y = empty({pr.rows, cols}, x.scalar_type());
  if (pr.rows == 0) return y;
  if (x.scalar_type() == at::kBFloat16)
    run<BF16>(pr, x, packed, bias, residual, y);
  else if (x.scalar_type() == at::kFloat)
    run<float>(pr, x, packed, bias, residual, y);
  else
    TORCH_CHECK(false, "gemm: bf16 or fp32");
  return y;
}

// (panel width, whether bf16 weights are stored as interleaved pairs): how to pack for this
// build. Pairs on every build: vdpbf16ps reads them, and elsewhere they widen without shuffles.
std::tuple<int64_t, bool> gemm_layout() { return {kWidth, true}; }

}  // namespace kvgate
