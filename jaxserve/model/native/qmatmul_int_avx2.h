// Part of qmatmul.cc (included inside its anonymous namespace, after `Work` and the
// AVX2 helpers, when qmatmul_int.h found no AVX-512 VNNI): the integer path on AVX2 CPUs.
// Defines JAXSERVE_INT_DOT, JAXSERVE_INT_DOT_AVX2, QuantX, QuantizeX, IntTile and
// kIntWideTiles when the CPU has AVX2, FMA and F16C; nothing otherwise.
#pragma once

#if !defined(JAXSERVE_INT_DOT) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JAXSERVE_INT_DOT 1
#define JAXSERVE_INT_DOT_AVX2 1
// ---- Integer dot products (AVX2, 16-bit) ----------------------------------------------
// x is quantized to the same two digits as the VNNI path (qmatmul_int.h; the NumPy
// reference is `native_qmatmul.quantize_x`), held as one int16 per element,
// X = 256 * hi + lo (|X| <= 256 * 127 + 127 = 32639), in natural order. Per 32-element
// block the exact integer I = <w, X> = 256 * <w, hi> + <w, lo> comes from two vpmaddwd
// (16-bit weights x X, pairs summed into eight int32 lanes; a lane sums four products,
// |sum| <= 4 * 128 * 32639 < 2^24, so it converts to f32 exactly), and the block adds
// dw * d / 256 * I, as on the VNNI path:
//   q4: nibbles 0..15 widened to int16; the min term adds min_b * sum(x_b);
//   q8: signed weights widened to int16 (no offset to remove).
// llama.cpp's AVX2 vec_dot kernels multiply u8 x s8 (vpmaddubsw) against x quantized to
// one int8 digit (q8_1); two digits keep the VNNI path's activation error (~1.6e-5 of a
// block's amax) and the same integers, at one vpmaddwd per 16 weights.
struct QuantX {
  int64_t nb = 0, K = 0;
  std::vector<int16_t> q;  // [M, K]: X = 256 hi + lo
  std::vector<float> dl;   // [M, nb]: d / 256 of the block
  std::vector<float> xs;   // [M, nb]: d * (sum hi + sum lo / 256), the block's sum
};

inline float HMax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// False if x holds a NaN or an infinity: the caller then keeps x in f32, so they propagate.
// `quads` (the VNNI path's q4 layout) has no meaning here: one layout serves q4 and q8.
bool QuantizeX(const float* x, int64_t M, int64_t K, bool /*quads*/, QuantX& o) {
  o.nb = K / 32, o.K = K;
  o.q.assign(M * K, 0), o.dl.assign(M * o.nb, 0.f), o.xs.assign(M * o.nb, 0.f);
  const __m256 sign = _mm256_set1_ps(-0.f), big = _mm256_set1_ps(FLT_MAX);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < o.nb; ++b) {
      const float* xb = x + r * K + b * 32;
      __m256 v[4], amax = _mm256_setzero_ps();
      int finite = 0xff;
      for (int c = 0; c < 4; ++c) {
        v[c] = _mm256_loadu_ps(xb + 8 * c);
        const __m256 a = _mm256_andnot_ps(sign, v[c]);
        finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_LE_OQ));
        amax = _mm256_max_ps(amax, a);
      }
      if (finite != 0xff) return false;  // a NaN or an infinity
      // The same f32 operations as `native_qmatmul.quantize_x` (round: half to even).
      const float m = HMax(amax), id = m > 0.f ? 127.f / m : 0.f, d = m / 127.f;
      constexpr int kRint = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      __m256i sh = _mm256_setzero_si256(), sl = _mm256_setzero_si256(), q32[4];
      for (int c = 0; c < 4; ++c) {
        const __m256 s = _mm256_mul_ps(v[c], _mm256_set1_ps(id));
        const __m256 h = _mm256_round_ps(s, kRint);
        const __m256 l = _mm256_min_ps(
            _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(s, h), _mm256_set1_ps(256.f)), kRint),
            _mm256_set1_ps(127.f));
        const __m256i hq = _mm256_cvtps_epi32(h), lq = _mm256_cvtps_epi32(l);
        sh = _mm256_add_epi32(sh, hq), sl = _mm256_add_epi32(sl, lq);
        q32[c] = _mm256_add_epi32(_mm256_slli_epi32(hq, 8), lq);
      }
      // packs works within 128-bit lanes: [a0..3 b0..3 | a4..7 b4..7]; 0xd8 puts them in order.
      int16_t* out = o.q.data() + r * K + b * 32;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(q32[0], q32[1]), 0xd8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(q32[2], q32[3]), 0xd8));
      o.dl[r * o.nb + b] = d / 256.f;
      o.xs[r * o.nb + b] = d * (static_cast<float>(HSumI(sh)) + static_cast<float>(HSumI(sl)) / 256.f);
    }
  }
  return true;
}

// Each (weight row i, x row r) pair's block factors dw_ib * d_rb / 256, made once per tile
// (eight blocks a vector where the scales are one per block) into `f` [NT][RT][nb]: the
// block loop then broadcasts one float per product instead of converting an f16 scale
// and multiplying (the same f32 product, so the same result).
template <int NT, int RT>
void TileFactors(const Work& w, const QuantX& xq, int64_t n0, int64_t r0, float* f) {
  const int64_t nb = xq.nb;
  for (int i = 0; i < NT; ++i) {
    const uint16_t* sc = w.scale + (n0 + i) * w.nb;
    for (int r = 0; r < RT; ++r) {
      const float* dl = xq.dl.data() + (r0 + r) * nb;
      float* out = f + (i * RT + r) * nb;
      int64_t b = 0;
      if (w.sub == 1) {
        for (; b + 8 <= nb; b += 8) {
          const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + b));
          _mm256_storeu_ps(out + b, _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_loadu_ps(dl + b)));
        }
      }
      for (; b < nb; ++b) out[b] = _cvtsh_ss(sc[ScaleIdx(w, b)]) * dl[b];
    }
  }
}

// y[r0:r0+RT, n0:n0+NT] over the whole K: each weight block is widened once and used by
// RT rows of x (NT * RT accumulators in registers); row pointers and the block factors
// (`TileFactors`) are set up before the block loop, so the loop is loads, widening,
// vpmaddwd and one fma per product.
template <bool Q4, int NT, int RT>
void IntTile(const Work& w, const QuantX& xq, int64_t n0, int64_t r0) {
  const int64_t nb = xq.nb;
  thread_local std::vector<float> fbuf;
  if (static_cast<int64_t>(fbuf.size()) < NT * RT * nb) fbuf.resize(NT * RT * nb);
  float* f = fbuf.data();
  TileFactors<NT, RT>(w, xq, n0, r0, f);
  const int64_t row_bytes = Q4 ? w.K / 2 : w.K;
  const uint8_t* wq[NT];
  for (int i = 0; i < NT; ++i) wq[i] = static_cast<const uint8_t*>(w.q) + (n0 + i) * row_bytes;
  const int16_t* xr[RT];
  for (int r = 0; r < RT; ++r) xr[r] = xq.q.data() + (r0 + r) * xq.K;
  __m256 acc[NT][RT];
  for (int i = 0; i < NT; ++i)
    for (int r = 0; r < RT; ++r) acc[i][r] = _mm256_setzero_ps();
  const __m128i m15 = _mm_set1_epi8(15);
  // The next tile's weight rows, a 64-byte line per row every line's worth of blocks:
  // 1.25-1.45x on the Q8_0 head and ~1.3x on mlp_down [576, 1536] at M = 1-2, 1.0-1.07x
  // on the other SmolLM2 shapes (streamed chains, this AVX2 CPU). Only the tile of the
  // first rows of x prefetches (the others read the same weights). The address is an
  // integer, so one past the weights' end is a hint the CPU drops, never a fault.
  constexpr int64_t kBlockBytes = Q4 ? 16 : 32, kLineBlocks = 64 / kBlockBytes;
  const uintptr_t ahead = static_cast<uintptr_t>(NT * row_bytes);
  const bool prefetch = r0 == 0;
  for (int64_t b = 0; b < nb; ++b) {
    if (prefetch && b % kLineBlocks == 0) {
      for (int i = 0; i < NT; ++i) {
        const uintptr_t at = reinterpret_cast<uintptr_t>(wq[i]) + ahead + b * kBlockBytes;
        _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T0);
      }
    }
    for (int i = 0; i < NT; ++i) {
      __m256i wa, wc;  // the block as int16: elements 0..15, 16..31
      if constexpr (Q4) {
        const auto* src = reinterpret_cast<const __m128i*>(wq[i] + b * kBlockBytes);
        const __m128i raw = _mm_loadu_si128(src);
        wa = _mm256_cvtepu8_epi16(_mm_and_si128(raw, m15));
        wc = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m15));
      } else {
        const __m128i* p = reinterpret_cast<const __m128i*>(wq[i] + b * kBlockBytes);
        wa = _mm256_cvtepi8_epi16(_mm_loadu_si128(p));
        wc = _mm256_cvtepi8_epi16(_mm_loadu_si128(p + 1));
      }
      for (int r = 0; r < RT; ++r) {
        const __m256i* xp = reinterpret_cast<const __m256i*>(xr[r] + b * 32);
        const __m256i t = _mm256_add_epi32(_mm256_madd_epi16(wa, _mm256_loadu_si256(xp)),
                                           _mm256_madd_epi16(wc, _mm256_loadu_si256(xp + 1)));
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t),
                                    _mm256_broadcast_ss(f + (i * RT + r) * nb + b), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NT; ++i) {
    for (int r = 0; r < RT; ++r) {
      float y = HSum(acc[i][r]);
      if constexpr (Q4) y += MinTerm(w, xq, n0 + i, r0 + r);
      w.y[(r0 + r) * w.N + n0 + i] = y;
    }
  }
}

// RunInt (qmatmul.cc) tiles with 2 weight rows x 4 rows of x from 4 rows on (each weight
// block widened once for four: fewer widenings per product), 4 x 2 (and 1) below.
constexpr bool kIntWideTiles = true;
#endif  // integer dot products (AVX2)
