// Quantized-weight matmul for XLA:CPU (XLA FFI): y[M, N] = x[M, K] @ W[N, K]^T, with W in
// ggml-style blocks along K (jaxserve/model/quant.py documents the formats), read once per
// call and never written out in float.
//
//   q8: q s8[N, K], scale f16[N, K/block]           w = scale * q
//   q4: q u8[N, K/2], scale, min f16[N, K/32]       w = scale * nib + min
//       (byte j of a 32-block: element j in the low nibble, element j + 16 in the high one)
//
// Up to kIntMaxRows rows of x (decode; kIntMaxRowsQ8 for q8) with AVX-512 VNNI, or
// kIntMaxRowsAvx2 / kIntMaxRowsQ8Avx2 with AVX2 alone: x is quantized once per call to two
// int8 digits per 32-element block and multiplied by the raw weight bytes with integer dot
// products (qmatmul_int.h: vpdpbusd; qmatmul_int_avx2.h: vpmaddwd on X = 256 hi + lo).
// Otherwise up to kDirectRows rows:
// 4 weight rows x 1-2 rows of x dequantized in registers (AVX2/FMA, f32 x); more rows:
// each task dequantizes its 32 weight rows once into an f32 panel (L2) and runs 4 x 3 fp32
// register tiles. K and block must be multiples of 32. Output rows are split into tasks of
// kRowsPerTask weight rows, taken by XLA's intra-op pool (ffi::ThreadPool) and the calling
// thread; small products run on the calling thread alone. Without AVX2 a portable scalar
// loop computes the f32 sums.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// IEEE half -> float (exact), portable: one per block and row, off the inner loop.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(man & 0x400)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

constexpr int64_t kRowsPerTask = 32;
constexpr int64_t kDirectRows = 2;  // up to this many rows of x: dequantize in registers
// Up to this many rows of x: integer dot products. q4: at M = 5-16 they beat the f32
// panel 1.1-2.1x on SmolLM2's layer shapes with the weights streamed from memory (as in a
// decode step), and break even at M = 32 (notes/issue26.md, fifth session; at M = 3 the
// first measurement, notes/issue26_q4.md, had 0.16 vs 0.24 ms on mlp_up). q8: the tied
// head [49152, 576] runs 0.71-0.93x the panel's speed at M = 8-32, so its cut stays at 4.
constexpr int64_t kIntMaxRows = 16;
constexpr int64_t kIntMaxRowsQ8 = 4;
// The AVX2 path (vpmaddwd: 16 multiply-adds an instruction, not 64) against the f32
// kernels on an AVX2-only Zen 3, weights streamed (scripts/bench_decode_matmuls.py,
// notes/issue26.md, eighth session): q4 1.3-2.0x at M = 1-4, ~1.1x at 8, 0.8-0.9x at 16;
// the q8 head 1.3x at M = 1-2, 0.86x at 4. With the ninth session's tile (factors set up
// before the block loop, the next tile's rows prefetched) the q8 head runs 1.3-1.8x the
// f32 kernels' speed at M = 1-8, 1.00x at 12 and 0.94x at 16; q4 still 0.83-0.93x at 12-16.
// Per-channel int8 (one scale a row) gains less, as its f32 kernel has no per-block
// scales to apply: 1.4-1.6x at M = 1-2, 1.03-1.22x at 3, 0.88-1.15x at 4-8.
constexpr int64_t kIntMaxRowsAvx2 = 8;
constexpr int64_t kIntMaxRowsQ8Avx2 = 8;
constexpr int64_t kIntMaxRowsInt8Avx2 = 3;
constexpr int64_t kIntCapRows = 64;  // the most `JaxserveQMatmulSetIntRows` accepts
// M * N * K below which one thread runs a product (JaxserveQMatmulSetSerialWork). On an
// AVX2 Zen 3 handing a product to XLA's pool pays from ~1e5 multiply-adds on, on either
// path: a k/v projection [192, 576] at M = 1 (1.1e5) 1.22x faster threaded, q/o
// [576, 576] 1.26-1.60x, [128, 128] at M = 4 (6.6e4) 0.89-0.93x (notes/issue26.md, eighth
// session; the earlier 2^21 came from an AVX-512 machine).
constexpr int64_t kSerialWork = 100'000;
std::atomic<int64_t> g_serial_work{kSerialWork};

struct Work {
  int64_t M, N, K, block, nb;
  int64_t sub;  // block / 32: the 32-element sub-blocks that share a scale
  bool q4;
  const float* x;
  const void* q;
  const uint16_t* scale;  // f16 bits
  const uint16_t* mn;
  float* y;
  const void* xq = nullptr;  // QuantX of x when the integer path runs
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t n_tasks;

  void Run(int64_t t);
  void Drain() {
    for (int64_t t = next.fetch_add(1); t < n_tasks; t = next.fetch_add(1)) {
      Run(t);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// The scale index of 32-element sub-block sb. No division where block is 32 (every q4 and
// Q8_0 weight): a 64-bit idiv per block cost 2-14% of a product (1.05x median over
// SmolLM2's fused Q4 shapes and the Q8_0 head at M = 1-16, one process, eighth session).
inline int64_t ScaleIdx(const Work& w, int64_t sb) {
  return w.sub == 1 ? sb : w.nb == 1 ? 0 : sb / w.sub;  // nb == 1: one scale per row (int8)
}

#ifdef __AVX2__
inline int32_t HSumI(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The four 8-float chunks of one 32-element sub-block of weight row n (sub-block index sb).
template <bool Q4>
inline void Dequant32(const Work& w, int64_t n, int64_t sb, __m256 out[4]) {
  const int64_t b = ScaleIdx(w, sb);
  const __m256 d = _mm256_set1_ps(HalfToFloat(w.scale[n * w.nb + b]));
  if constexpr (Q4) {
    const __m256 m = _mm256_set1_ps(HalfToFloat(w.mn[n * w.nb + b]));
    const __m128i raw = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(w.q) + n * (w.K / 2) + sb * 16));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(raw, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    out[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m);
    out[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m);
    out[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m);
    out[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m);
  } else {
    const int8_t* qb = static_cast<const int8_t*>(w.q) + n * w.K + sb * 32;
    for (int c = 0; c < 4; ++c) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8 * c));
      out[c] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)));
    }
  }
}

// y[r0:r0+RT, n0:n0+NT] over the whole K: NT weight rows dequantized once per chunk and
// used by RT rows of x (NT * RT accumulators in registers).
template <bool Q4, int NT, int RT>
void Tile(const Work& w, int64_t n0, int64_t r0) {
  __m256 acc[NT][RT];
  for (int i = 0; i < NT; ++i)
    for (int r = 0; r < RT; ++r) acc[i][r] = _mm256_setzero_ps();
  const int64_t nsb = w.K / 32;
  for (int64_t sb = 0; sb < nsb; ++sb) {
    __m256 wv[NT][4];
    for (int i = 0; i < NT; ++i) Dequant32<Q4>(w, n0 + i, sb, wv[i]);
    for (int c = 0; c < 4; ++c) {
      for (int r = 0; r < RT; ++r) {
        const __m256 xv = _mm256_loadu_ps(w.x + (r0 + r) * w.K + sb * 32 + 8 * c);
        for (int i = 0; i < NT; ++i) acc[i][r] = _mm256_fmadd_ps(wv[i][c], xv, acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NT; ++i)
    for (int r = 0; r < RT; ++r) w.y[(r0 + r) * w.N + n0 + i] = HSum(acc[i][r]);
}

template <bool Q4, int NT>
void Rows(const Work& w, int64_t n0) {
  int64_t r = 0;
  for (; r + 2 <= w.M; r += 2) Tile<Q4, NT, 2>(w, n0, r);
  if (r < w.M) Tile<Q4, NT, 1>(w, n0, r);
}

// Panel path (M > kDirectRows): the task's weight rows are dequantized once into an
// f32 panel [rows, K] (L2-resident), then an fp32 register-tiled product of NT panel
// rows x RT rows of x, so the dequantization is not repeated for every pair of x rows.
template <int NT, int RT>
void PanelTile(const Work& w, const float* panel, int64_t p0, int64_t n0, int64_t r0) {
  __m256 acc[NT][RT];
  for (int i = 0; i < NT; ++i)
    for (int r = 0; r < RT; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < w.K; k += 8) {
    __m256 wv[NT];
    for (int i = 0; i < NT; ++i) wv[i] = _mm256_loadu_ps(panel + (p0 + i) * w.K + k);
    for (int r = 0; r < RT; ++r) {
      const __m256 xv = _mm256_loadu_ps(w.x + (r0 + r) * w.K + k);
      for (int i = 0; i < NT; ++i) acc[i][r] = _mm256_fmadd_ps(wv[i], xv, acc[i][r]);
    }
  }
  for (int i = 0; i < NT; ++i)
    for (int r = 0; r < RT; ++r) w.y[(r0 + r) * w.N + n0 + p0 + i] = HSum(acc[i][r]);
}

template <int NT>
void PanelRows(const Work& w, const float* panel, int64_t p0, int64_t n0) {
  int64_t r = 0;
  for (; r + 3 <= w.M; r += 3) PanelTile<NT, 3>(w, panel, p0, n0, r);
  for (; r < w.M; ++r) PanelTile<NT, 1>(w, panel, p0, n0, r);
}

template <bool Q4>
void RunPanel(const Work& w, int64_t n0, int64_t n1) {
  thread_local std::vector<float> panel;
  panel.resize((n1 - n0) * w.K);
  const int64_t nsb = w.K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    float* row = panel.data() + (n - n0) * w.K;
    for (int64_t sb = 0; sb < nsb; ++sb) {
      __m256 v[4];
      Dequant32<Q4>(w, n, sb, v);
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(row + sb * 32 + 8 * c, v[c]);
    }
  }
  int64_t p = 0;
  for (; p + 4 <= n1 - n0; p += 4) PanelRows<4>(w, panel.data(), p, n0);
  for (; p < n1 - n0; ++p) PanelRows<1>(w, panel.data(), p, n0);
}

#ifdef __F16C__
// q4's offset term on the integer paths: sum over blocks of min_b * sum(x_b), x as
// quantized (QX: either path's QuantX, with its block sums xs [M, nb]).
template <class QX>
inline float MinTerm(const Work& w, const QX& xq, int64_t n, int64_t row) {
  const uint16_t* mn = w.mn + n * w.nb;
  const float* xs = xq.xs.data() + row * xq.nb;
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= w.nb; b += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + b));
    acc = _mm256_fmadd_ps(_mm256_cvtph_ps(h), _mm256_loadu_ps(xs + b), acc);
  }
  float s = HSum(acc);
  for (; b < w.nb; ++b) s += HalfToFloat(mn[b]) * xs[b];
  return s;
}
#endif

#include "qmatmul_int.h"  // integer dot products (AVX-512 VNNI); needs Work
#include "qmatmul_int_avx2.h"  // the same on AVX2 (16-bit) where there is no VNNI

#ifdef JAXSERVE_INT_DOT
// Weight rows [n0, n1) of the product on either integer path (its IntTile): 4 weight rows
// x 2 (and 1) rows of x, each weight block read once for both; where the path has wide
// tiles (kIntWideTiles, AVX2), 2 x 4 from 4 rows of x on; the last rows one at a time.
template <bool Q4>
void RunInt(const Work& w, int64_t n0, int64_t n1) {
  const QuantX& xq = *static_cast<const QuantX*>(w.xq);
  int64_t n = n0;
  if constexpr (kIntWideTiles) {
    if (w.M >= 4) {
      for (; n + 2 <= n1; n += 2) {
        int64_t r = 0;
        for (; r + 4 <= w.M; r += 4) IntTile<Q4, 2, 4>(w, xq, n, r);
        for (; r + 2 <= w.M; r += 2) IntTile<Q4, 2, 2>(w, xq, n, r);
        if (r < w.M) IntTile<Q4, 2, 1>(w, xq, n, r);
      }
    }
  }
  for (; n + 4 <= n1; n += 4) {
    int64_t r = 0;
    for (; r + 2 <= w.M; r += 2) IntTile<Q4, 4, 2>(w, xq, n, r);
    if (r < w.M) IntTile<Q4, 4, 1>(w, xq, n, r);
  }
  for (; n < n1; ++n) {
    for (int64_t r = 0; r < w.M; ++r) IntTile<Q4, 1, 1>(w, xq, n, r);
  }
}
#endif
#endif  // __AVX2__

// Rows of x up to which the integer path runs (JaxserveQMatmulSetIntRows), and which
// path it is (JaxserveQMatmulIntPath: 0 none, 1 AVX2, 2 AVX-512 VNNI).
#if defined(JAXSERVE_INT_DOT_AVX2)
std::atomic<int64_t> g_int_rows{kIntMaxRowsAvx2};
constexpr int64_t kQ8Cap = kIntMaxRowsQ8Avx2, kInt8Cap = kIntMaxRowsInt8Avx2, kIntPath = 1;
#elif defined(JAXSERVE_INT_DOT)
std::atomic<int64_t> g_int_rows{kIntMaxRows};
constexpr int64_t kQ8Cap = kIntMaxRowsQ8, kInt8Cap = kIntMaxRowsQ8, kIntPath = 2;
#else
std::atomic<int64_t> g_int_rows{0};
constexpr int64_t kQ8Cap = 0, kInt8Cap = 0, kIntPath = 0;
#endif

// The integer path's row cut for q4 or q8 weights (q8: at most kQ8Cap; q8 with one
// scale a row, i.e. per-channel int8: at most kInt8Cap).
int64_t IntRows(bool q4, bool per_channel = false) {
  const int64_t rows = g_int_rows.load(std::memory_order_relaxed);
  return q4 ? rows : std::min(rows, per_channel ? kInt8Cap : kQ8Cap);
}

#ifdef __AVX2__

template <bool Q4>
void RunRows(const Work& w, int64_t n0, int64_t n1) {
#ifdef JAXSERVE_INT_DOT
  if (w.xq != nullptr) return RunInt<Q4>(w, n0, n1);
#endif
  if (w.M > kDirectRows) return RunPanel<Q4>(w, n0, n1);
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) Rows<Q4, 4>(w, n);
  for (; n < n1; ++n) Rows<Q4, 1>(w, n);
}

void Work::Run(int64_t t) {
  const int64_t n0 = t * kRowsPerTask, n1 = std::min(N, n0 + kRowsPerTask);
  if (q4) {
    RunRows<true>(*this, n0, n1);
  } else {
    RunRows<false>(*this, n0, n1);
  }
}
#else
// Portable fallback (no AVX2): the same arithmetic, one element at a time.
void Work::Run(int64_t t) {
  const int64_t n0 = t * kRowsPerTask, n1 = std::min(N, n0 + kRowsPerTask);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t r = 0; r < M; ++r) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t b = k / block;
        float v;
        if (q4) {
          const uint8_t byte = static_cast<const uint8_t*>(q)[n * (K / 2) + (k / 32) * 16 + (k % 16)];
          const int nib = (k % 32) < 16 ? (byte & 15) : (byte >> 4);
          v = HalfToFloat(scale[n * nb + b]) * static_cast<float>(nib) + HalfToFloat(mn[n * nb + b]);
        } else {
          v = HalfToFloat(scale[n * nb + b]) *
              static_cast<float>(static_cast<const int8_t*>(q)[n * K + k]);
        }
        acc += x[r * K + k] * v;
      }
      y[r * N + n] = acc;
    }
  }
}
#endif

ffi::Error Run(ffi::ThreadPool& pool, bool q4, ffi::Buffer<ffi::F32>& x, const void* q,
               int64_t q_cols, ffi::Buffer<ffi::F16>& scale, const uint16_t* mn,
               ffi::ResultBuffer<ffi::F32>& y, int64_t block) {
  auto xd = x.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || sd.size() != 2) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "qmatmul: x and scale must be 2-D");
  }
  const int64_t M = xd[0], K = xd[1], N = sd[0], nb = sd[1];
  if (block <= 0 || K != nb * block || K % 32 != 0 || block % 32 != 0 || q_cols != (q4 ? K / 2 : K) || (q4 && block != 32) ||
      y->dimensions()[0] != M || y->dimensions()[1] != N) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "qmatmul: shapes do not agree (M=" + std::to_string(M) + " K=" +
                          std::to_string(K) + " N=" + std::to_string(N) + " blocks=" +
                          std::to_string(nb) + " block=" + std::to_string(block) + ")");
  }
  auto w = std::make_shared<Work>();
  w->M = M, w->N = N, w->K = K, w->block = block, w->nb = nb, w->sub = block / 32, w->q4 = q4;
  w->x = x.typed_data(), w->q = q, w->mn = mn;
  w->scale = reinterpret_cast<const uint16_t*>(scale.typed_data());
  w->y = y->typed_data();
  w->n_tasks = (N + kRowsPerTask - 1) / kRowsPerTask;
#ifdef JAXSERVE_INT_DOT
  thread_local QuantX xq;  // the calling thread's; helpers only read it while it waits
  if (M <= IntRows(q4, nb == 1 && K > 32) && QuantizeX(w->x, M, K, q4, xq)) {
    w->xq = &xq;
  }
#endif
  // Small products run on the calling thread: handing tasks to the pool costs more
  // than it saves below ~kSerialWork multiply-adds, so each helper gets at least that
  // much work (on a many-core host a small product wakes few threads); never more
  // threads than cores.
  static const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t serial = std::max<int64_t>(1, g_serial_work.load(std::memory_order_relaxed));
  const int64_t helpers = M * N * K < serial ? 0 :
      std::min<int64_t>({pool.num_threads(), cores - 1, w->n_tasks - 1, M * N * K / serial});
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([w]() { w->Drain(); });
  w->Drain();
  while (w->done.load(std::memory_order_acquire) < w->n_tasks) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error Q8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                  ffi::Buffer<ffi::F16> scale, ffi::ResultBuffer<ffi::F32> y, int64_t block) {
  if (q.dimensions().size() != 2 || q.dimensions()[0] != scale.dimensions()[0]) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "qmatmul_q8: q must be [N, K]");
  }
  return Run(pool, false, x, q.typed_data(), q.dimensions()[1], scale, nullptr, y, block);
}

ffi::Error Q4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                  ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> mn,
                  ffi::ResultBuffer<ffi::F32> y, int64_t block) {
  if (q.dimensions().size() != 2 || q.dimensions()[0] != scale.dimensions()[0] ||
      mn.dimensions().size() != 2 || mn.dimensions()[0] != scale.dimensions()[0] ||
      mn.dimensions()[1] != scale.dimensions()[1]) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "qmatmul_q4: q must be [N, K/2], scale and min [N, K/32]");
  }
  return Run(pool, true, x, q.typed_data(), q.dimensions()[1], scale,
             reinterpret_cast<const uint16_t*>(mn.typed_data()), y, block);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQMatmulQ8, Q8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // q [N, K]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // scale [N, K/block]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQMatmulQ4, Q4Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // q [N, K/2]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // scale [N, K/32]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // min [N, K/32]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("block"));

// Rows of x up to which x is quantized to two int8 digits for q4 weights (0: f32
// activations); q8 weights: at most kQ8Cap of them. Default kIntMaxRows with AVX-512 VNNI,
// kIntMaxRowsAvx2 with AVX2 alone, 0 without; settable up to kIntCapRows (measurements
// compare both paths).
extern "C" int64_t JaxserveQMatmulIntRows() { return g_int_rows.load(); }

extern "C" int64_t JaxserveQMatmulIntPath() { return kIntPath; }

extern "C" int64_t JaxserveQMatmulIntRowsQ8() { return IntRows(false); }

extern "C" int64_t JaxserveQMatmulIntRowsInt8() { return IntRows(false, true); }

extern "C" int64_t JaxserveQMatmulSetIntRows(int64_t rows) {
#ifdef JAXSERVE_INT_DOT
  g_int_rows.store(std::clamp<int64_t>(rows, 0, kIntCapRows));
#endif
  return g_int_rows.load();
}

// Multiply-adds (M * N * K) below which a product runs on the calling thread alone
// (default kSerialWork); settable so measurements compare both in one process.
extern "C" int64_t JaxserveQMatmulSerialWork() { return g_serial_work.load(); }

extern "C" int64_t JaxserveQMatmulSetSerialWork(int64_t work) {
  g_serial_work.store(std::max<int64_t>(work, 0));
  return g_serial_work.load();
}
