// Quantized-weight matmul for XLA:CPU (XLA FFI): y[M, N] = x[M, K] @ W[N, K]^T, with W in
// ggml-style blocks along K (jaxserve/model/quant.py documents the formats), read once per
// call and never written out in float.
//
//   q8: q s8[N, K], scale f16[N, K/block]           w = scale * q
//   q4: q u8[N, K/2], scale, min f16[N, K/32]       w = scale * nib + min
//       (byte j of a 32-block: element j in the low nibble, element j + 16 in the high one)
//
// Up to kIntMaxRows rows of x (decode) with AVX-512 VNNI: x is quantized once per call to
// two int8 digits per 32-element block and multiplied by the raw weight bytes with integer
// dot products (the "Integer dot products" section). Otherwise up to kDirectRows rows:
// 4 weight rows x 1-2 rows of x dequantized in registers (AVX2/FMA, f32 x); more rows:
// each task dequantizes its 32 weight rows once into an f32 panel (L2) and runs 4 x 3 fp32
// register tiles. K and block must be multiples of 32. Output rows are split into tasks of
// kRowsPerTask weight rows, taken by XLA's intra-op pool (ffi::ThreadPool) and the calling
// thread; small products run on the calling thread alone. Without AVX2 a portable scalar
// loop computes the f32 sums.
#include <algorithm>
#include <atomic>
#include <cstdint>
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
constexpr int64_t kIntMaxRows = 2;  // up to this many rows of x: integer dot products
constexpr int64_t kSerialWork = int64_t{1} << 21;  // M * N * K below which one thread runs it

struct Work {
  int64_t M, N, K, block, nb;
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

#ifdef __AVX2__
inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The four 8-float chunks of one 32-element sub-block of weight row n (sub-block index sb).
template <bool Q4>
inline void Dequant32(const Work& w, int64_t n, int64_t sb, __m256 out[4]) {
  const int64_t b = (sb * 32) / w.block;
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

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define JAXSERVE_INT_DOT 1
// ---- Integer dot products (AVX-512 VNNI) ----------------------------------------------
// Each row of x is quantized once per call, per 32-element block b, to two int8 digits:
//   d = amax_b / 127, v = x * (127 / amax_b) (f32), hi = rint(v),
//   lo = min(rint((v - hi) * 256), 127),  x ~= d * (hi + lo / 256)
// |error| <= d / 512 (d / 256 on an exact tie), ~1.6e-5 of the block's amax (rint: round
// half to even; `native_qmatmul.quantize_x` is the NumPy reference). Per block the exact
// integer I = 256 * <w, hi> + <w, lo> comes from two vpdpbusd (u8 weights x s8 digits),
// and the block adds dw * d / 256 * I:
//   q4: unsigned nibbles; the min term adds min_b * sum(x_b) (sum of the quantized x);
//   q8: weights xor 0x80 = w + 128 (unsigned), minus 128 * (256 * sum(hi) + sum(lo)).
// Blocks go in pairs (A = 2p, B = 2p + 1): 64 bytes of a q4 pair unpack to
// [A 0..15 | B 0..15 | A 16..31 | B 16..31] (16 bytes each), so x's digits are stored in
// that order; dpbusd lanes 0-3, 8-11 hold A's sums and 4-7, 12-15 B's. An odd last block
// ("tail") is done with 256-bit registers in natural order.
constexpr int64_t kPairBytes = 128;  // per pair: hi[64], lo[64]
constexpr int64_t kPairLanes = 16;

// x quantized: rows of `row_bytes` digits, `row_lanes` per-lane scales / corrections.
struct QuantX {
  int64_t npair = 0, tail = 0, row_bytes = 0, row_lanes = 0, nb = 0;
  std::vector<int8_t> q;       // [M, row_bytes]: pairs (hi 64, lo 64), tail (hi 32, lo 32)
  std::vector<float> dl;       // [M, row_lanes]: d / 254 of the lane's block
  std::vector<int32_t> corr;   // [M, row_lanes]: q8's 128 * (256 sum hi + sum lo), a block's 1st lane
  std::vector<float> xs;       // [M, nb]: sum of the block's quantized x, d * (sum hi + sum lo / 256)
};

// Byte position of element e of block b inside its pair's (or the tail's) 64 / 32 bytes.
inline int64_t DigitPos(int64_t b, int64_t e, bool tail) {
  if (tail) return e;
  return (e < 16 ? 0 : 32) + (b & 1) * 16 + (e & 15);
}

void QuantizeX(const float* x, int64_t M, int64_t K, QuantX& o) {
  o.nb = K / 32, o.npair = o.nb / 2, o.tail = o.nb % 2;
  o.row_bytes = o.npair * kPairBytes + o.tail * 64;
  o.row_lanes = o.npair * kPairLanes + o.tail * 8;
  o.q.assign(M * o.row_bytes, 0), o.dl.assign(M * o.row_lanes, 0.f);
  o.corr.assign(M * o.row_lanes, 0), o.xs.assign(M * o.nb, 0.f);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < o.nb; ++b) {
      const float* xb = x + r * K + b * 32;
      float amax = 0.f;
      for (int e = 0; e < 32; ++e) amax = std::max(amax, std::fabs(xb[e]));
      const float id = amax > 0.f ? 127.f / amax : 0.f, d = amax / 127.f;
      const bool tail = b / 2 == o.npair;
      int8_t* hi = o.q.data() + r * o.row_bytes + (b / 2) * kPairBytes;
      int8_t* lo = hi + (tail ? 32 : 64);
      int32_t sh = 0, sl = 0;
      for (int e = 0; e < 32; ++e) {
        const float v = xb[e] * id, h = std::nearbyint(v);
        const float l = std::min(std::nearbyint((v - h) * 256.f), 127.f);
        hi[DigitPos(b, e, tail)] = static_cast<int8_t>(h);
        lo[DigitPos(b, e, tail)] = static_cast<int8_t>(l);
        sh += static_cast<int32_t>(h), sl += static_cast<int32_t>(l);
      }
      const int64_t lane0 = r * o.row_lanes + (b / 2) * kPairLanes;
      for (int l = 0; l < (tail ? 8 : kPairLanes); ++l) {
        if (tail || ((l / 4) & 1) == (b & 1)) o.dl[lane0 + l] = d / 256.f;
      }
      o.corr[lane0 + (tail ? 0 : (b & 1) * 4)] = 128 * (256 * sh + sl);
      o.xs[r * o.nb + b] = d * (static_cast<float>(sh) + static_cast<float>(sl) / 256.f);
    }
  }
}

// Weight row n's scales of blocks b, b + 1 on the dpbusd lanes of a pair.
inline __m512 PairScales(const Work& w, int64_t n, int64_t b) {
  const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
  __m128 d2;
  if (w.block == 32) {
    uint32_t bits;
    std::memcpy(&bits, w.scale + n * w.nb + b, sizeof bits);
    d2 = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
  } else {
    d2 = _mm_setr_ps(_cvtsh_ss(w.scale[n * w.nb + b * 32 / w.block]),
                     _cvtsh_ss(w.scale[n * w.nb + (b + 1) * 32 / w.block]), 0.f, 0.f);
  }
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(d2));
}

// 64 unsigned weight bytes of pair p of row n, in the pair order above.
template <bool Q4>
inline __m512i PairWeights(const Work& w, int64_t n, int64_t p) {
  if constexpr (Q4) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        static_cast<const uint8_t*>(w.q) + n * (w.K / 2) + p * 32));
    const __m256i m = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(raw, m), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  } else {
    const __m512i order = _mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7);
    const __m512i raw = _mm512_loadu_si512(static_cast<const int8_t*>(w.q) + n * w.K + p * 64);
    return _mm512_xor_si512(_mm512_permutexvar_epi64(order, raw), _mm512_set1_epi8(-128));
  }
}

template <bool Q4>
inline __m256i TailWeights(const Work& w, int64_t n, int64_t b) {
  if constexpr (Q4) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
        static_cast<const uint8_t*>(w.q) + n * (w.K / 2) + b * 16));
    const __m128i m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m), _mm_and_si128(raw, m));
  } else {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        static_cast<const int8_t*>(w.q) + n * w.K + b * 32));
    return _mm256_xor_si256(raw, _mm256_set1_epi8(-128));
  }
}

// I = 256 * <w, hi> + <w, lo> per lane (the q8 offset removed).
template <bool Q4>
inline __m512i PairDot(__m512i wq, const int8_t* xp, const int32_t* corr) {
  const __m512i zero = _mm512_setzero_si512();
  __m512i t = _mm512_dpbusd_epi32(zero, wq, _mm512_loadu_si512(xp));
  t = _mm512_slli_epi32(t, 8);
  t = _mm512_dpbusd_epi32(t, wq, _mm512_loadu_si512(xp + 64));
  if constexpr (!Q4) t = _mm512_sub_epi32(t, _mm512_loadu_si512(corr));
  return t;
}

inline int32_t HSumI(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// The odd last block of weight row n against x row `row` (256-bit, natural order).
template <bool Q4>
inline float TailDot(const Work& w, const QuantX& xq, int64_t n, int64_t row) {
  const int64_t b = xq.nb - 1, lane0 = row * xq.row_lanes + xq.npair * kPairLanes;
  const int8_t* xp = xq.q.data() + row * xq.row_bytes + xq.npair * kPairBytes;
  const __m256i wq = TailWeights<Q4>(w, n, b);
  __m256i t = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq,
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp)));
  t = _mm256_slli_epi32(t, 8);
  t = _mm256_dpbusd_epi32(t, wq, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 32)));
  int32_t total = HSumI(t);
  if constexpr (!Q4) total -= xq.corr[lane0];
  const float dw = _cvtsh_ss(w.scale[n * w.nb + b * 32 / w.block]);
  return dw * xq.dl[lane0] * static_cast<float>(total);
}

// q4's offset term: sum over blocks of min_b * sum(x_b) (x quantized).
inline float MinTerm(const Work& w, const QuantX& xq, int64_t n, int64_t row) {
  const uint16_t* mn = w.mn + n * w.nb;
  const float* xs = xq.xs.data() + row * xq.nb;
  __m512 acc = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 16 <= w.nb; b += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn + b));
    acc = _mm512_fmadd_ps(_mm512_cvtph_ps(h), _mm512_loadu_ps(xs + b), acc);
  }
  float s = _mm512_reduce_add_ps(acc);
  for (; b < w.nb; ++b) s += _cvtsh_ss(mn[b]) * xs[b];
  return s;
}

// y[r0:r0+RT, n0:n0+NT] over the whole K with the integer dot products.
template <bool Q4, int NT, int RT>
void IntTile(const Work& w, const QuantX& xq, int64_t n0, int64_t r0) {
  __m512 acc[NT][RT];
  for (int i = 0; i < NT; ++i)
    for (int r = 0; r < RT; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < xq.npair; ++p) {
    for (int i = 0; i < NT; ++i) {
      _mm_prefetch(static_cast<const char*>(w.q) + (n0 + NT + i) * (Q4 ? w.K / 2 : w.K) +
                       p * (Q4 ? 32 : 64), _MM_HINT_T0);
      const __m512i wq = PairWeights<Q4>(w, n0 + i, p);
      const __m512 dw = PairScales(w, n0 + i, 2 * p);
      for (int r = 0; r < RT; ++r) {
        const int64_t row = r0 + r;
        const __m512i t = PairDot<Q4>(wq, xq.q.data() + row * xq.row_bytes + p * kPairBytes,
                                      xq.corr.data() + row * xq.row_lanes + p * kPairLanes);
        const __m512 s = _mm512_mul_ps(dw, _mm512_loadu_ps(xq.dl.data() + row * xq.row_lanes + p * kPairLanes));
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), s, acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NT; ++i) {
    for (int r = 0; r < RT; ++r) {
      const int64_t n = n0 + i, row = r0 + r;
      float y = _mm512_reduce_add_ps(acc[i][r]);
      if (xq.tail) y += TailDot<Q4>(w, xq, n, row);
      if constexpr (Q4) y += MinTerm(w, xq, n, row);
      w.y[row * w.N + n] = y;
    }
  }
}

template <bool Q4>
void RunInt(const Work& w, int64_t n0, int64_t n1) {
  const QuantX& xq = *static_cast<const QuantX*>(w.xq);
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    int64_t r = 0;
    for (; r + 2 <= w.M; r += 2) IntTile<Q4, 4, 2>(w, xq, n, r);
    if (r < w.M) IntTile<Q4, 4, 1>(w, xq, n, r);
  }
  for (; n < n1; ++n) {
    for (int64_t r = 0; r < w.M; ++r) IntTile<Q4, 1, 1>(w, xq, n, r);
  }
}
#endif  // integer dot products

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
  w->M = M, w->N = N, w->K = K, w->block = block, w->nb = nb, w->q4 = q4;
  w->x = x.typed_data(), w->q = q, w->mn = mn;
  w->scale = reinterpret_cast<const uint16_t*>(scale.typed_data());
  w->y = y->typed_data();
  w->n_tasks = (N + kRowsPerTask - 1) / kRowsPerTask;
#ifdef JAXSERVE_INT_DOT
  thread_local QuantX xq;  // the calling thread's; helpers only read it while it waits
  if (M <= kIntMaxRows) {
    QuantizeX(w->x, M, K, xq);
    w->xq = &xq;
  }
#endif
  // Small products run on the calling thread: handing tasks to the pool costs more
  // than it saves below ~kSerialWork multiply-adds; never more threads than cores.
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t helpers = M * N * K < kSerialWork ? 0 :
      std::min<int64_t>({pool.num_threads(), cores - 1, w->n_tasks - 1});
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

// Rows of x up to which x is quantized to two int8 digits (0: f32 activations, no VNNI).
extern "C" int64_t JaxserveQMatmulIntRows() {
#ifdef JAXSERVE_INT_DOT
  return kIntMaxRows;
#else
  return 0;
#endif
}
