// Paged decode attention for XLA:CPU, as an XLA FFI custom call (jaxserve "xla" backend,
// decode_impl="native"). Built and loaded by jaxserve/model/attention/native_cpu.py.
//
// One query per sequence slot (decode rows) against that slot's KV pages, read in place
// from the paged cache [L, N, B, K, D] (vLLM's PagedAttention layout, Kwon et al. 2023):
// no gathered copy, each key and value row is read once, and only the slot's first
// kv_len[s] keys are touched (unwritten / NaN-poisoned slots never are). Work is split
// into (slot, chunk of pages) tasks, flash-decoding style (Dao et al. 2023): each task
// keeps an online softmax (FlashAttention-2) per (KV head, query head in group), and the
// partials of one slot are merged at the end. Tasks run on XLA's intra-op thread pool
// (ffi::ThreadPool) and on the calling thread.
//
// Operands: q f32[S, K, G, D], kv_len s32[S] (0: not a decode row, output 0),
//   pages s32[S, P] (page ids of each slot, in [0, N)), k_cache / v_cache [L, N, B, K, D] in
//   f32, f16 or bf16 (one handler per cache dtype: JaxservePagedDecode{F32,F16,BF16}; a
//   16-bit row is converted to f32 in registers as it is read, F16C's vcvtph2ps for f16,
//   a 16-bit left shift for bf16, and all the math is f32),
//   layer s32[] (in [0, L)), window s32[] (> 0: a slot sees only its last `window` keys,
//   sliding-window attention; pages wholly before them are not read, keys before them
//   in the edge page are skipped). Attributes: sm_scale f32, chunk_pages i64 (> 0).
// Result: f32[S, K, G, D].
// Errors: kv_len above P * B, a page id or layer out of range -> kOutOfRange (the call fails
//   with that message instead of reading out of bounds).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define JAXSERVE_SIMD 1
#include <immintrin.h>
#else
#define JAXSERVE_SIMD 0
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kMaskValue = -0.7f * 3.4028234663852886e38f;

// The KV cache's element type; 16-bit ones are stored as uint16_t (XLA FFI's F16 / BF16).
enum class KvType { kF32, kF16, kBF16 };
template <KvType E>
struct KvElem {
  using T = uint16_t;
};
template <>
struct KvElem<KvType::kF32> {
  using T = float;
};

// IEEE binary16 -> f32, exact (normals, subnormals, inf, NaN); the scalar tail of RowF32.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: man * 2^-24, renormalised
    uint32_t e = 0;
    while (!(man & 0x400u)) man <<= 1, ++e;
    bits = sign | ((113u - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float Bf16ToFloat(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// n elements of one cache row as f32: the row itself for an f32 cache, else converted
// into buf (8 at a time with AVX2 + F16C, exact: both 16-bit formats are subsets of f32).
template <KvType E>
inline const float* RowF32(const typename KvElem<E>::T* src, int64_t n, float* buf) {
  if constexpr (E == KvType::kF32) {
    (void)n, (void)buf;
    return src;
  } else {
    int64_t i = 0;
#if JAXSERVE_SIMD
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      __m256 f;
      if constexpr (E == KvType::kF16) {
        f = _mm256_cvtph_ps(h);
      } else {
        f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      }
      _mm256_storeu_ps(buf + i, f);
    }
#endif
    for (; i < n; ++i) buf[i] = E == KvType::kF16 ? HalfToFloat(src[i]) : Bf16ToFloat(src[i]);
    return buf;
  }
}

#if JAXSERVE_SIMD
// 8 elements of a cache row as f32 in one register (exact).
template <KvType E>
inline __m256 Load8(const typename KvElem<E>::T* p) {
  if constexpr (E == KvType::kF32) {
    return _mm256_loadu_ps(p);
  } else if constexpr (E == KvType::kF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtph_ps(h);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// D % 8 == 0, G <= 8 (AVX2 + F16C + FMA): key row b's scores sc[(h * G + g) * B + b]
// against the G queries of each KV head; each 8 elements of the row are loaded (16-bit:
// converted) once into a register and used for the G queries, G independent FMA chains.
// At 16 slots x 2000 keys x 30 layers (SmolLM2) an f16 / bf16 cache decodes ~1.4x faster
// than f32 here; f32 itself runs as fast as its scalar-loop form (notes/issue26_kv.md).
template <KvType E, int64_t kG>
inline void ScoresRow(const typename KvElem<E>::T* krow, const float* qs, int64_t K, int64_t g_rt,
                     int64_t D, float scale, float* sc, int64_t B, int64_t b) {
  const int64_t G = kG > 0 ? kG : g_rt;
  for (int64_t h = 0; h < K; ++h) {
    __m256 acc[8];
    for (int64_t g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 k8 = Load8<E>(krow + h * D + d);
      for (int64_t g = 0; g < G; ++g) {
        acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + (h * G + g) * D + d), k8, acc[g]);
      }
    }
    for (int64_t g = 0; g < G; ++g) sc[(h * G + g) * B + b] = HSum(acc[g]) * scale;
  }
}

// The same conditions: acc[h, g] += p[h, g, b] * v[b, h] for value row b.
template <KvType E, int64_t kG>
inline void AccumulateRow(const typename KvElem<E>::T* vrow, const float* sc, int64_t K, int64_t g_rt,
                          int64_t D, int64_t B, int64_t b, float* acc_out) {
  const int64_t G = kG > 0 ? kG : g_rt;
  for (int64_t h = 0; h < K; ++h) {
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 v8 = Load8<E>(vrow + h * D + d);
      for (int64_t g = 0; g < G; ++g) {
        float* a = acc_out + (h * G + g) * D + d;
        const __m256 pb = _mm256_set1_ps(sc[(h * G + g) * B + b]);
        _mm256_storeu_ps(a, _mm256_fmadd_ps(pb, v8, _mm256_loadu_ps(a)));
      }
    }
  }
}
#endif

struct Shape {
  int64_t S, K, G, D, P, L, N, B, chunk_pages, n_chunks, window;
  float scale;
};

// exp(x) for x <= 0 (softmax weights), vectorizable: Cephes' expf range reduction
// x = n ln2 + r, |r| <= ln2 / 2, and a degree-6 polynomial for e^r (relative error
// ~2e-7, like libm's expf); x below -87.3 gives 0 (exp would be denormal or 0).
inline float ExpNonPos(float x) {
  const float xc = std::max(x, -87.3f);
  const float n = std::nearbyint(xc * 1.44269504088896341f);
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = (p * r * r + r) + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.3f ? 0.f : e * scale;
}

// One task: slot s, pages [c * chunk_pages, ...), all KV heads. Writes m, l [K*G] and
// acc [K*G*D] (unnormalised) into its scratch slot. kD / kG / kK > 0: compile-time head
// dim / group size / KV heads (SmolLM2: 64 / 3 / 3), 0: read from the shape. A page is
// walked in memory order (key, head) for both K and V, the next page is prefetched while
// this one is read, and a page's exps run as one simd loop.
template <int64_t kD, int64_t kG, int64_t kK, KvType E>
void RunTask(const Shape& sh, int64_t s, int64_t c, const float* q, const int32_t* kv_len,
             const int32_t* pages, const typename KvElem<E>::T* kc,
             const typename KvElem<E>::T* vc, int64_t layer, float* m_out, float* l_out,
             float* acc_out) {
  using T = typename KvElem<E>::T;
  const int64_t D = kD > 0 ? kD : sh.D;
  const int64_t G = kG > 0 ? kG : sh.G;
  const int64_t K = kK > 0 ? kK : sh.K;
  const int64_t B = sh.B;
  const int64_t KG = K * G;
  const int64_t len = kv_len[s];
  const int64_t lo = std::max<int64_t>(0, len - sh.window);  // first key in the window
  const int64_t k0 = std::max(lo, c * sh.chunk_pages * B);
  const int64_t k1 = std::min(len, (c + 1) * sh.chunk_pages * B);
  for (int64_t i = 0; i < KG; ++i) {
    m_out[i] = kMaskValue;
    l_out[i] = 0.f;
  }
  std::fill(acc_out, acc_out + KG * D, 0.f);
  if (k1 <= k0) return;
  const float* qs = q + s * KG * D;
  const int64_t row = K * D;  // elements per token in a page
  const int64_t page_floats = B * row;
  const T* kl = kc + layer * sh.N * page_floats;
  const T* vl = vc + layer * sh.N * page_floats;
  std::vector<float> sc(static_cast<size_t>(KG * B));  // sc[i * B + b], i = h * G + g
  std::vector<float> rowbuf(static_cast<size_t>(E == KvType::kF32 ? 0 : row));  // a 16-bit row
  const int64_t lines_per_key = (row * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  // Rows in registers (ScoresRow / AccumulateRow) where the shapes allow; else RowF32.
  const bool simd = JAXSERVE_SIMD && D % 8 == 0 && G <= 8;
  for (int64_t p0 = k0 / B * B; p0 < k1; p0 += B) {
    const int64_t page = pages[s * sh.P + p0 / B];
    const int64_t nb = std::min(B, k1 - p0);
    const int64_t b0 = std::max<int64_t>(0, k0 - p0);  // keys before the window: skipped
    const T* kp = kl + page * page_floats;
    const T* vp = vl + page * page_floats;
    const bool has_next = p0 + B < k1;
    const int64_t next = has_next ? pages[s * sh.P + p0 / B + 1] : page;
    const char* kn = reinterpret_cast<const char*>(kl + next * page_floats);
    const char* vn = reinterpret_cast<const char*>(vl + next * page_floats);
    for (int64_t b = b0; b < nb; ++b) {
      if (has_next) {
        for (int64_t ln = 0; ln < lines_per_key; ++ln) {
          __builtin_prefetch(kn + (b * lines_per_key + ln) * 64);
          __builtin_prefetch(vn + (b * lines_per_key + ln) * 64);
        }
      }
#if JAXSERVE_SIMD
      if (simd) {
        ScoresRow<E, kG>(kp + b * row, qs, K, G, D, sh.scale, sc.data(), B, b);
        continue;
      }
#endif
      const float* krow = RowF32<E>(kp + b * row, row, rowbuf.data());
      for (int64_t h = 0; h < K; ++h) {
        const float* kv = krow + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qv = qs + (h * G + g) * D;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t d = 0; d < D; ++d) acc += qv[d] * kv[d];
          sc[(h * G + g) * B + b] = acc * sh.scale;
        }
      }
    }
    for (int64_t i = 0; i < KG; ++i) {
      float* si = sc.data() + i * B;
      float mx = m_out[i];
      for (int64_t b = b0; b < nb; ++b) mx = std::max(mx, si[b]);
      float lsum = 0.f;
#pragma omp simd reduction(+ : lsum)
      for (int64_t b = b0; b < nb; ++b) {
        si[b] = ExpNonPos(si[b] - mx);
        lsum += si[b];
      }
      const float alpha = ExpNonPos(m_out[i] - mx);
      float* a = acc_out + i * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
      m_out[i] = mx;
      l_out[i] = l_out[i] * alpha + lsum;
    }
    // acc[h, g] += sum_b p[h, g, b] v[b, h]: each value row loaded once for its G queries.
    for (int64_t b = b0; b < nb; ++b) {
#if JAXSERVE_SIMD
      if (simd) {
        AccumulateRow<E, kG>(vp + b * row, sc.data(), K, G, D, B, b, acc_out);
        continue;
      }
#endif
      const float* vrow = RowF32<E>(vp + b * row, row, rowbuf.data());
      for (int64_t h = 0; h < K; ++h) {
        const float* vv = vrow + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float pb = sc[(h * G + g) * B + b];
          float* a = acc_out + (h * G + g) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += pb * vv[d];
        }
      }
    }
  }
}

struct Work {
  Shape sh;
  const float* q;
  const int32_t* kv_len;
  const int32_t* pages;
  const void* kc;  // KvElem<type>::T [L, N, B, K, D]
  const void* vc;
  KvType type;
  int64_t layer;
  std::vector<int64_t> task_row, task_chunk;
  std::vector<float> m, l, acc;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  template <KvType E>
  void RunTyped(int64_t t) {
    using T = typename KvElem<E>::T;
    const T* k = static_cast<const T*>(kc);
    const T* v = static_cast<const T*>(vc);
    const int64_t KG = sh.K * sh.G;
    float* mo = m.data() + t * KG;
    float* lo = l.data() + t * KG;
    float* ao = acc.data() + t * KG * sh.D;
    const int64_t s = task_row[t], c = task_chunk[t];
    if (sh.D == 64 && sh.G == 3 && sh.K == 3) {
      RunTask<64, 3, 3, E>(sh, s, c, q, kv_len, pages, k, v, layer, mo, lo, ao);
    } else if (sh.D == 64) {
      RunTask<64, 0, 0, E>(sh, s, c, q, kv_len, pages, k, v, layer, mo, lo, ao);
    } else if (sh.D == 128) {
      RunTask<128, 0, 0, E>(sh, s, c, q, kv_len, pages, k, v, layer, mo, lo, ao);
    } else {
      RunTask<0, 0, 0, E>(sh, s, c, q, kv_len, pages, k, v, layer, mo, lo, ao);
    }
  }

  void Run(int64_t t) {
    switch (type) {
      case KvType::kF32: return RunTyped<KvType::kF32>(t);
      case KvType::kF16: return RunTyped<KvType::kF16>(t);
      case KvType::kBF16: return RunTyped<KvType::kBF16>(t);
    }
  }

  // Take tasks until none is left; returns after the tasks it took are done.
  void Drain() {
    const int64_t n = static_cast<int64_t>(task_row.size());
    for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) {
      Run(t);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <ffi::DataType DT, KvType E>
ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::S32> pages,
                           ffi::Buffer<DT> k_cache, ffi::Buffer<DT> v_cache,
                           ffi::Buffer<ffi::S32> layer_buf, ffi::Buffer<ffi::S32> window_buf,
                           ffi::Result<ffi::Buffer<ffi::F32>> out,
                           float sm_scale, int64_t chunk_pages) {
  auto qd = q.dimensions();
  auto cd = k_cache.dimensions();
  auto pd = pages.dimensions();
  if (qd.size() != 4 || cd.size() != 5 || pd.size() != 2 || kv_len.dimensions().size() != 1) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "paged_decode: want q [S,K,G,D], kv_len [S], pages [S,P], "
                      "caches [L,N,B,K,D]");
  }
  if (chunk_pages <= 0) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "paged_decode: chunk_pages must be > 0");
  }
  auto w = std::make_shared<Work>();
  Shape& sh = w->sh;
  sh.S = qd[0], sh.K = qd[1], sh.G = qd[2], sh.D = qd[3];
  sh.P = pd[1], sh.L = cd[0], sh.N = cd[1], sh.B = cd[2];
  sh.chunk_pages = chunk_pages;
  sh.n_chunks = (sh.P + chunk_pages - 1) / chunk_pages;
  sh.scale = sm_scale;
  if (cd[3] != sh.K || cd[4] != sh.D || pd[0] != sh.S || kv_len.dimensions()[0] != sh.S) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "paged_decode: shapes do not agree");
  }
  const int64_t layer = layer_buf.typed_data()[0];
  sh.window = window_buf.typed_data()[0];
  if (sh.window <= 0) {
    return ffi::Error(ffi::ErrorCode::kOutOfRange,
                      "paged_decode: window " + std::to_string(sh.window) + " must be > 0");
  }
  if (layer < 0 || layer >= sh.L) {
    return ffi::Error(ffi::ErrorCode::kOutOfRange,
                      "paged_decode: layer " + std::to_string(layer) + " not in [0, " +
                          std::to_string(sh.L) + ")");
  }
  const int32_t* lens = kv_len.typed_data();
  const int32_t* pg = pages.typed_data();
  for (int64_t s = 0; s < sh.S; ++s) {
    const int64_t len = lens[s];
    if (len < 0 || len > sh.P * sh.B) {
      return ffi::Error(ffi::ErrorCode::kOutOfRange,
                        "paged_decode: kv_len[" + std::to_string(s) + "]=" + std::to_string(len) +
                            " not in [0, " + std::to_string(sh.P * sh.B) + "]");
    }
    const int64_t np = (len + sh.B - 1) / sh.B;
    const int64_t p_lo = std::max<int64_t>(0, len - sh.window) / sh.B;  // first page read
    for (int64_t j = p_lo; j < np; ++j) {
      const int64_t p = pg[s * sh.P + j];
      if (p < 0 || p >= sh.N) {
        return ffi::Error(ffi::ErrorCode::kOutOfRange,
                          "paged_decode: page " + std::to_string(p) + " of slot " +
                              std::to_string(s) + " not in [0, " + std::to_string(sh.N) + ")");
      }
    }
    const int64_t nc = (np + chunk_pages - 1) / chunk_pages;
    for (int64_t c = p_lo / chunk_pages; c < nc; ++c) {
      w->task_row.push_back(s);
      w->task_chunk.push_back(c);
    }
  }
  const int64_t n_tasks = static_cast<int64_t>(w->task_row.size());
  const int64_t KG = sh.K * sh.G;
  w->q = q.typed_data(), w->kv_len = lens, w->pages = pg;
  w->kc = k_cache.untyped_data(), w->vc = v_cache.untyped_data(), w->layer = layer;
  w->type = E;
  w->m.resize(n_tasks * KG), w->l.resize(n_tasks * KG), w->acc.resize(n_tasks * KG * sh.D);

  // Helpers hold the shared Work, so one that starts after the caller returned finds no
  // task left and touches nothing else.
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n_tasks - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([w]() { w->Drain(); });
  }
  w->Drain();
  while (w->done.load(std::memory_order_acquire) < n_tasks) std::this_thread::yield();

  // Merge each slot's task partials (tasks of one slot are contiguous).
  float* o = out->typed_data();
  std::fill(o, o + sh.S * KG * sh.D, 0.f);
  for (int64_t t0 = 0; t0 < n_tasks;) {
    const int64_t s = w->task_row[t0];
    int64_t t1 = t0;
    while (t1 < n_tasks && w->task_row[t1] == s) ++t1;
    for (int64_t i = 0; i < KG; ++i) {
      float mx = kMaskValue;
      for (int64_t t = t0; t < t1; ++t) mx = std::max(mx, w->m[t * KG + i]);
      float lsum = 0.f;
      float* os = o + (s * KG + i) * sh.D;
      for (int64_t t = t0; t < t1; ++t) {
        const float a = std::exp(w->m[t * KG + i] - mx);
        lsum += w->l[t * KG + i] * a;
        const float* at = w->acc.data() + (t * KG + i) * sh.D;
        for (int64_t d = 0; d < sh.D; ++d) os[d] += a * at[d];
      }
      const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
      for (int64_t d = 0; d < sh.D; ++d) os[d] *= inv;
    }
    t0 = t1;
  }
  return ffi::Error::Success();
}

}  // namespace

// One handler per cache dtype (the custom-call targets of native_cpu.py's TARGETS).
#define JAXSERVE_PAGED_DECODE(NAME, DT, E)                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, (PagedDecodeImpl<DT, E>),                      \
                                ffi::Ffi::Bind()                                     \
                                    .Ctx<ffi::ThreadPool>()                          \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* q */            \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* kv_len */       \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* pages */        \
                                    .Arg<ffi::Buffer<DT>>() /* k_cache */            \
                                    .Arg<ffi::Buffer<DT>>() /* v_cache */            \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* layer */        \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* window */       \
                                    .Ret<ffi::Buffer<ffi::F32>>() /* out */          \
                                    .Attr<float>("sm_scale")                         \
                                    .Attr<int64_t>("chunk_pages"));

JAXSERVE_PAGED_DECODE(JaxservePagedDecodeF32, ffi::F32, KvType::kF32)
JAXSERVE_PAGED_DECODE(JaxservePagedDecodeF16, ffi::F16, KvType::kF16)
JAXSERVE_PAGED_DECODE(JaxservePagedDecodeBF16, ffi::BF16, KvType::kBF16)
