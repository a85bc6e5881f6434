// Part of qmatmul.cc (included inside its anonymous namespace, after `Work` and the
// AVX2 helpers): the integer-dot-product path for up to kIntMaxRows rows of x (q4;
// kIntMaxRowsQ8 for q8).
// Defines JAXSERVE_INT_DOT, QuantX, QuantizeX, IntTile and kIntWideTiles when the CPU has
// AVX-512 VNNI (+BW, VL) and F16C; nothing otherwise.
#pragma once

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
// q4 goes in quads of blocks first (C = 4c .. 4c + 3), then the pairs and tail of what is
// left: one 64-byte load of a quad's weights is two vectors, low nibbles
// [C0 0..15 | C1 0..15 | C2 0..15 | C3 0..15] and high ones (elements 16..31), with no
// lane shuffle, and both dpbusd into the same lanes (lanes 4j..4j+3: block Cj), so four
// f16 scales make one lane-scale vector: about half the instructions per weight of the
// pair loop (notes/issue26_decode1.md). q8 pairs keep x's digits in natural order
// ([A 0..31 | B 0..31]: lanes 0-7 A, 8-15 B), so its 64 weight bytes need no permute.
constexpr int64_t kPairBytes = 128;  // per pair: hi[64], lo[64]
constexpr int64_t kPairLanes = 16;
constexpr int64_t kQuadBytes = 256;  // per quad: hi (elements 0..15, 16..31), lo (same)
constexpr int64_t kQuadLanes = 16;
constexpr bool kPrefetch = true;   // the next tile's weight rows, one pair ahead

// x quantized: rows of `row_bytes` digits, `row_lanes` per-lane scales / corrections:
// nquad quads (q4 only), then npair pairs from block 4 * nquad on, then the tail.
struct QuantX {
  int64_t nquad = 0, npair = 0, tail = 0, row_bytes = 0, row_lanes = 0, nb = 0;
  int64_t pair_byte0 = 0, pair_lane0 = 0;  // where the pairs start in a row
  bool q4 = true;  // the pairs' order: q4's (above) or q8's natural one
  std::vector<int8_t> q;       // [M, row_bytes]: pairs (hi 64, lo 64), tail (hi 32, lo 32)
  std::vector<float> dl;       // [M, row_lanes]: d / 256 of the lane's block
  std::vector<int32_t> corr;   // [M, row_lanes]: q8's 128 * (256 sum hi + sum lo) on a
                               // block's first lane, 0 elsewhere
  std::vector<float> xs;       // [M, nb]: d * (sum hi + sum lo / 256), the block's sum
};

// Where block b's digits and lanes lie in a row: the hi digits' first byte of its group,
// the lo digits' offset from them, its byte position function and its group's first lane.
struct BlockPlace {
  int64_t byte0, lo_off, lane0;
  int kind;  // 0 quad, 1 q4 pair, 2 tail, 3 q8 pair (natural order)
  int64_t slot;  // b's index inside its group
  int64_t DigitPos(int64_t e) const {
    if (kind == 0) return (e < 16 ? 0 : 64) + slot * 16 + (e & 15);
    if (kind == 1) return (e < 16 ? 0 : 32) + slot * 16 + (e & 15);
    return kind == 3 ? slot * 32 + e : e;
  }
  bool OwnsLane(int64_t l) const {
    if (kind == 0) return l / 4 == slot;
    if (kind == 3) return l / 8 == slot;
    return kind == 2 || ((l / 4) & 1) == slot;
  }
  int64_t CorrLane() const { return kind == 2 ? 0 : kind == 3 ? slot * 8 : slot * 4; }
};

inline BlockPlace PlaceOf(const QuantX& o, int64_t b) {
  if (b < 4 * o.nquad) return {(b / 4) * kQuadBytes, 128, (b / 4) * kQuadLanes, 0, b & 3};
  const int64_t p = (b - 4 * o.nquad) / 2;
  if (p < o.npair) {
    return {o.pair_byte0 + p * kPairBytes, 64, o.pair_lane0 + p * kPairLanes, o.q4 ? 1 : 3, b & 1};
  }
  return {o.pair_byte0 + o.npair * kPairBytes, 32, o.pair_lane0 + o.npair * kPairLanes, 2, 0};
}

// False if x holds a NaN or an infinity: the caller then keeps x in f32, so they propagate.
// Vectorized per block (AVX-512F). quads: the q4 layout (blocks in quads first), else pairs only (q8).
bool QuantizeX(const float* x, int64_t M, int64_t K, bool quads, QuantX& o) {
  o.nb = K / 32, o.nquad = quads ? o.nb / 4 : 0, o.q4 = quads;
  o.npair = (o.nb - 4 * o.nquad) / 2, o.tail = o.nb % 2;
  o.pair_byte0 = o.nquad * kQuadBytes, o.pair_lane0 = o.nquad * kQuadLanes;
  o.row_bytes = o.pair_byte0 + o.npair * kPairBytes + o.tail * 64;
  o.row_lanes = o.pair_lane0 + o.npair * kPairLanes + o.tail * 8;
  o.q.assign(M * o.row_bytes, 0), o.dl.assign(M * o.row_lanes, 0.f);
  o.corr.assign(M * o.row_lanes, 0), o.xs.assign(M * o.nb, 0.f);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < o.nb; ++b) {
      // 32 elements as two 16-lane halves (elements 0..15, 16..31): the same f32 ops as
      // `native_qmatmul.quantize_x` (rint is round-half-even), so the digits are exact.
      const __m512 x0 = _mm512_loadu_ps(x + r * K + b * 32), x1 = _mm512_loadu_ps(x + r * K + b * 32 + 16);
      const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1), big = _mm512_set1_ps(FLT_MAX);
      if ((_mm512_cmp_ps_mask(a0, big, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1, big, _CMP_LE_OQ)) != 0xffff) {
        return false;  // a NaN or an infinity
      }
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
      const float id = amax > 0.f ? 127.f / amax : 0.f, d = amax / 127.f;
      const BlockPlace at = PlaceOf(o, b);
      int8_t* hi = o.q.data() + r * o.row_bytes + at.byte0;
      int8_t* lo = hi + at.lo_off;
      __m512i shv = _mm512_setzero_si512(), slv = _mm512_setzero_si512();
      for (int half = 0; half < 2; ++half) {
        constexpr int kRint = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m512 v = _mm512_mul_ps(half ? x1 : x0, _mm512_set1_ps(id));
        const __m512 h = _mm512_roundscale_ps(v, kRint);
        const __m512 l = _mm512_min_ps(
            _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v, h), _mm512_set1_ps(256.f)), kRint),
            _mm512_set1_ps(127.f));
        const __m512i hq = _mm512_cvtps_epi32(h), lq = _mm512_cvtps_epi32(l);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + at.DigitPos(16 * half)), _mm512_cvtepi32_epi8(hq));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + at.DigitPos(16 * half)), _mm512_cvtepi32_epi8(lq));
        shv = _mm512_add_epi32(shv, hq), slv = _mm512_add_epi32(slv, lq);
      }
      const int32_t sh = _mm512_reduce_add_epi32(shv), sl = _mm512_reduce_add_epi32(slv);
      const int64_t lane0 = r * o.row_lanes + at.lane0;
      for (int l = 0; l < (at.kind == 2 ? 8 : 16); ++l) {
        if (at.OwnsLane(l)) o.dl[lane0 + l] = d / 256.f;
      }
      if (at.kind != 0) o.corr[lane0 + at.CorrLane()] = 128 * (256 * sh + sl);
      o.xs[r * o.nb + b] = d * (static_cast<float>(sh) + static_cast<float>(sl) / 256.f);
    }
  }
  return true;
}

// Weight row n's scales of blocks b, b + 1 on the dpbusd lanes of a pair (q4's or q8's order).
template <bool Q4>
inline __m512 PairScales(const Work& w, int64_t n, int64_t b) {
  const __m512i idx = Q4 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1)
                         : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m128 d2;
  if (w.block == 32) {
    uint32_t bits;
    std::memcpy(&bits, w.scale + n * w.nb + b, sizeof bits);
    d2 = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
  } else {
    d2 = _mm_setr_ps(_cvtsh_ss(w.scale[n * w.nb + ScaleIdx(w, b)]),
                     _cvtsh_ss(w.scale[n * w.nb + ScaleIdx(w, b + 1)]), 0.f, 0.f);
  }
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(d2));
}

// 64 unsigned weight bytes of pair p of row n, in the pair order above (q8: as stored).
template <bool Q4>
inline __m512i PairWeights(const Work& w, int64_t n, int64_t p) {
  if constexpr (Q4) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        static_cast<const uint8_t*>(w.q) + n * (w.K / 2) + p * 32));
    const __m256i m = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(raw, m), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  } else {
    const __m512i raw = _mm512_loadu_si512(static_cast<const int8_t*>(w.q) + n * w.K + p * 64);
    return _mm512_xor_si512(raw, _mm512_set1_epi8(-128));
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

// The odd last block of weight row n against x row `row` (256-bit, natural order).
template <bool Q4>
inline float TailDot(const Work& w, const QuantX& xq, int64_t n, int64_t row) {
  const int64_t b = xq.nb - 1, lane0 = row * xq.row_lanes + xq.pair_lane0 + xq.npair * kPairLanes;
  const int8_t* xp = xq.q.data() + row * xq.row_bytes + xq.pair_byte0 + xq.npair * kPairBytes;
  const __m256i wq = TailWeights<Q4>(w, n, b);
  __m256i t = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq,
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp)));
  t = _mm256_slli_epi32(t, 8);
  t = _mm256_dpbusd_epi32(t, wq, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 32)));
  int32_t total = HSumI(t);
  if constexpr (!Q4) total -= xq.corr[lane0];
  const float dw = _cvtsh_ss(w.scale[n * w.nb + ScaleIdx(w, b)]);
  return dw * xq.dl[lane0] * static_cast<float>(total);
}

// q4 quad c of weight row n against x row `row`'s digits: I per lane (lanes 4j..4j+3:
// block 4c + j), times the lane scales dw * d / 256, added to acc.
inline __m512 QuadDot(const Work& w, const QuantX& xq, int64_t n, int64_t c, int64_t row,
                      __m512 acc) {
  const __m512i raw = _mm512_loadu_si512(static_cast<const uint8_t*>(w.q) + n * (w.K / 2) + c * 64);
  const __m512i m = _mm512_set1_epi8(15);
  const __m512i w0 = _mm512_and_si512(raw, m), w1 = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m);
  const int8_t* xp = xq.q.data() + row * xq.row_bytes + c * kQuadBytes;
  __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, _mm512_loadu_si512(xp));
  t = _mm512_dpbusd_epi32(t, w1, _mm512_loadu_si512(xp + 64));
  t = _mm512_slli_epi32(t, 8);
  t = _mm512_dpbusd_epi32(t, w0, _mm512_loadu_si512(xp + 128));
  t = _mm512_dpbusd_epi32(t, w1, _mm512_loadu_si512(xp + 192));
  const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m128 d4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.scale + n * w.nb + 4 * c)));
  const __m512 s = _mm512_mul_ps(_mm512_permutexvar_ps(idx, _mm512_castps128_ps512(d4)),
                                 _mm512_loadu_ps(xq.dl.data() + row * xq.row_lanes + c * kQuadLanes));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), s, acc);
}

// y[r0:r0+RT, n0:n0+NT] over the whole K with the integer dot products.
template <bool Q4, int NT, int RT>
void IntTile(const Work& w, const QuantX& xq, int64_t n0, int64_t r0) {
  __m512 acc[NT][RT];
  for (int i = 0; i < NT; ++i)
    for (int r = 0; r < RT; ++r) acc[i][r] = _mm512_setzero_ps();
  if constexpr (Q4) {
    for (int64_t c = 0; c < xq.nquad; ++c) {
      for (int i = 0; i < NT; ++i) {
        if (kPrefetch) _mm_prefetch(static_cast<const char*>(w.q) + (n0 + NT + i) * (w.K / 2) + c * 64,
                                    _MM_HINT_T0);
        for (int r = 0; r < RT; ++r) acc[i][r] = QuadDot(w, xq, n0 + i, c, r0 + r, acc[i][r]);
      }
    }
  }
  const int64_t b0 = 4 * xq.nquad;  // the pairs' first block
  for (int64_t p = 0; p < xq.npair; ++p) {
    for (int i = 0; i < NT; ++i) {
      if (kPrefetch) _mm_prefetch(static_cast<const char*>(w.q) + (n0 + NT + i) * (Q4 ? w.K / 2 : w.K) +
                       (b0 / 2 + p) * (Q4 ? 32 : 64), _MM_HINT_T0);
      const __m512i wq = PairWeights<Q4>(w, n0 + i, b0 / 2 + p);
      const __m512 dw = PairScales<Q4>(w, n0 + i, b0 + 2 * p);
      for (int r = 0; r < RT; ++r) {
        const int64_t row = r0 + r;
        const int64_t byte = xq.pair_byte0 + p * kPairBytes, lane = xq.pair_lane0 + p * kPairLanes;
        const __m512i t = PairDot<Q4>(wq, xq.q.data() + row * xq.row_bytes + byte,
                                      xq.corr.data() + row * xq.row_lanes + lane);
        const __m512 s = _mm512_mul_ps(dw, _mm512_loadu_ps(xq.dl.data() + row * xq.row_lanes + lane));
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

// RunInt (qmatmul.cc) tiles with 4 weight rows x 2 (and 1) rows of x at every M here.
constexpr bool kIntWideTiles = false;
#endif  // integer dot products
