// Float-weight matmul for XLA:CPU (XLA FFI) at few rows (decode): y f32[M, N] from x f32[M, K]
// and a float weight in one of two layouts:
//
//   nk (jaxserve_fmatmul_nk): W f32[N, K], y = x @ W^T. The tied LM head reads the
//       embedding [V, E] this way: each output is a dot product of contiguous rows.
//       Register tiles of 4 weight rows x 1-2 rows of x, 8-wide FMA along K.
//   kn (jaxserve_fmatmul_kn): W f32[K, N], y = x @ W (the layers' canonical matrices).
//       Axpy style: a task owns a block of output columns and streams W's rows through
//       it, y[r, cols] += x[r, k] * W[k, cols], 4 vectors of columns x 2 rows of x.
//
// Why: XLA:CPU runs a one-row dot at 13-19 GB/s of weight (a single-threaded loop for
// M = 1); these kernels split the weight over XLA's intra-op pool (ffi::ThreadPool) and the
// calling thread, in tasks of kRowsPerTask output rows (nk) or kColsPerTask columns (kn),
// so the product runs near memory bandwidth. Any K and N: tails are scalar. Without AVX2
// a portable scalar loop computes the same sums.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRowsPerTask = 32;  // nk: output rows (= weight rows) per task
constexpr int64_t kColsPerTask = 64;  // kn: output columns per task

struct Work {
  int64_t M, N, K;
  bool kn;
  const float* x;
  const float* w;
  float* y;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t n_tasks;

  void RunNK(int64_t n0, int64_t n1);
  void RunKN(int64_t c0, int64_t c1);
  void Drain() {
    for (int64_t t = next.fetch_add(1); t < n_tasks; t = next.fetch_add(1)) {
      if (kn) {
        RunKN(t * kColsPerTask, std::min(N, (t + 1) * kColsPerTask));
      } else {
        RunNK(t * kRowsPerTask, std::min(N, (t + 1) * kRowsPerTask));
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Scalar pieces shared by both builds: one output of nk, and kn over a column range.
inline float DotTail(const float* a, const float* b, int64_t k0, int64_t K) {
  float s = 0.f;
  for (int64_t k = k0; k < K; ++k) s += a[k] * b[k];
  return s;
}

void KNScalar(const Work& w, int64_t c0, int64_t c1) {
  for (int64_t r = 0; r < w.M; ++r) {
    float* yr = w.y + r * w.N;
    for (int64_t c = c0; c < c1; ++c) yr[c] = 0.f;
    for (int64_t k = 0; k < w.K; ++k) {
      const float xv = w.x[r * w.K + k];
      const float* wr = w.w + k * w.N;
      for (int64_t c = c0; c < c1; ++c) yr[c] += xv * wr[c];
    }
  }
}

#ifdef __AVX2__
inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[r0:r0+RT, n0:n0+NT] = x[r0:r0+RT] . W[n0:n0+NT] over the whole K.
template <int NT, int RT>
void TileNK(const Work& w, int64_t n0, int64_t r0) {
  __m256 acc[NT][RT];
  for (int i = 0; i < NT; ++i)
    for (int r = 0; r < RT; ++r) acc[i][r] = _mm256_setzero_ps();
  const int64_t k8 = w.K & ~int64_t{7};
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 wv[NT];
    for (int i = 0; i < NT; ++i) wv[i] = _mm256_loadu_ps(w.w + (n0 + i) * w.K + k);
    for (int r = 0; r < RT; ++r) {
      const __m256 xv = _mm256_loadu_ps(w.x + (r0 + r) * w.K + k);
      for (int i = 0; i < NT; ++i) acc[i][r] = _mm256_fmadd_ps(wv[i], xv, acc[i][r]);
    }
  }
  for (int i = 0; i < NT; ++i)
    for (int r = 0; r < RT; ++r)
      w.y[(r0 + r) * w.N + n0 + i] =
          HSum(acc[i][r]) + DotTail(w.x + (r0 + r) * w.K, w.w + (n0 + i) * w.K, k8, w.K);
}

template <int NT>
void RowsNK(const Work& w, int64_t n0) {
  int64_t r = 0;
  for (; r + 2 <= w.M; r += 2) TileNK<NT, 2>(w, n0, r);
  if (r < w.M) TileNK<NT, 1>(w, n0, r);
}

void Work::RunNK(int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) RowsNK<4>(*this, n);
  for (; n < n1; ++n) RowsNK<1>(*this, n);
}

// y[r0:r0+RT, c0:c0+8*CV] = x[r0:r0+RT] @ W[:, c0:c0+8*CV], streaming W's rows.
template <int CV, int RT>
void TileKN(const Work& w, int64_t c0, int64_t r0) {
  __m256 acc[CV][RT];
  for (int j = 0; j < CV; ++j)
    for (int r = 0; r < RT; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < w.K; ++k) {
    __m256 wv[CV];
    for (int j = 0; j < CV; ++j) wv[j] = _mm256_loadu_ps(w.w + k * w.N + c0 + 8 * j);
    for (int r = 0; r < RT; ++r) {
      const __m256 xv = _mm256_broadcast_ss(w.x + (r0 + r) * w.K + k);
      for (int j = 0; j < CV; ++j) acc[j][r] = _mm256_fmadd_ps(wv[j], xv, acc[j][r]);
    }
  }
  for (int j = 0; j < CV; ++j)
    for (int r = 0; r < RT; ++r) _mm256_storeu_ps(w.y + (r0 + r) * w.N + c0 + 8 * j, acc[j][r]);
}

template <int CV>
void RowsKN(const Work& w, int64_t c0) {
  int64_t r = 0;
  for (; r + 2 <= w.M; r += 2) TileKN<CV, 2>(w, c0, r);
  if (r < w.M) TileKN<CV, 1>(w, c0, r);
}

void Work::RunKN(int64_t c0, int64_t c1) {
  int64_t c = c0;
  for (; c + 32 <= c1; c += 32) RowsKN<4>(*this, c);
  for (; c + 8 <= c1; c += 8) RowsKN<1>(*this, c);
  if (c < c1) KNScalar(*this, c, c1);
}
#else
void Work::RunNK(int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < M; ++r) y[r * N + n] = DotTail(x + r * K, w + n * K, 0, K);
}

void Work::RunKN(int64_t c0, int64_t c1) { KNScalar(*this, c0, c1); }
#endif

ffi::Error Run(ffi::ThreadPool& pool, bool kn, ffi::Buffer<ffi::F32>& x,
               ffi::Buffer<ffi::F32>& w, ffi::ResultBuffer<ffi::F32>& y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "fmatmul: x, w and y must be 2-D");
  }
  const int64_t M = xd[0], K = xd[1], N = kn ? wd[1] : wd[0];
  if ((kn ? wd[0] : wd[1]) != K || yd[0] != M || yd[1] != N) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      std::string("fmatmul_") + (kn ? "kn" : "nk") +
                          ": shapes do not agree (x [" + std::to_string(M) + ", " +
                          std::to_string(K) + "], w [" + std::to_string(wd[0]) + ", " +
                          std::to_string(wd[1]) + "])");
  }
  auto work = std::make_shared<Work>();
  work->M = M, work->N = N, work->K = K, work->kn = kn;
  work->x = x.typed_data(), work->w = w.typed_data(), work->y = y->typed_data();
  const int64_t per = kn ? kColsPerTask : kRowsPerTask;
  work->n_tasks = (N + per - 1) / per;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->n_tasks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work]() { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->n_tasks) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error NKImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  return Run(pool, false, x, w, y);
}

ffi::Error KNImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  return Run(pool, true, x, w, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveFMatmulNK, NKImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [N, K]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveFMatmulKN, KNImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [K, N]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
