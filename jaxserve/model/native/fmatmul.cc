// Float-weight matmul for XLA:CPU (XLA FFI) at few rows (decode): y f32[M, N] from x f32[M, K]
// and a float weight in one of two layouts:
//
//   nk (jaxserve_fmatmul_nk): W f32[N, K], y = x @ W^T. The tied LM head reads the
//       embedding [V, E] this way: each output is a dot product of contiguous rows.
//       Register tiles of 4 weight rows x 1-2 rows of x, 8-wide FMA along K.
//   kn (jaxserve_fmatmul_kn): W f32[K, N], y = x @ W (the layers' canonical matrices).
//       Split along K: task c owns the contiguous rows [k0, k1) of W (one sequential
//       stream of memory) and writes the partial product x[:, k0:k1] @ W[k0:k1] into its
//       own slice of a scratch buffer, one row of W at a time added into its partial rows
//       (kept in L1/L2); the caller then sums the partials in task order. The split
//       depends on K alone, so the result is the same whichever threads ran the tasks, and
//       each row of y depends only on its row of x (the kernel is batch-invariant; the
//       engine sends only up to linear.FLOAT_NATIVE_MAX_ROWS rows here, XLA the rest).
//
// Why: XLA:CPU runs a one-row dot at 13-19 GB/s of weight (a single-threaded loop for
// M = 1); these kernels split the weight over XLA's intra-op pool (ffi::ThreadPool) and the
// calling thread, in tasks of kRowsPerTask output rows (nk) or kKRowsPerTask rows of W
// (kn). Measured (notes/issue26.md): the kn kernel at ~20-25 GB/s, 0.87-0.91x XLA's
// time on SmolLM2's layer matrices at M = 1-2 (not faster at 3-4), below the ~46 GB/s
// two streaming threads reach here. (The first kn kernel gave each task a
// block of 64 output columns over all of K: 256 bytes of each row of W, one row apart, a
// strided walk that ran at ~9 GB/s against XLA's ~18.) Any K and N: tails are scalar.
// Without AVX2 a portable scalar loop computes the same sums in the same order (kn: the
// same fused multiply-adds, so the same bits; nk: separate multiply and add).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <new>
#include <cstdint>
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

constexpr int64_t kRowsPerTask = 32;  // nk: output rows (= weight rows) per task
constexpr int64_t kKRowsPerTask = 64;  // kn: rows of W (along K) per task
// kn: at most this many bytes of partial products; past it (many rows of x, a large
// weight) the product runs as one task, with no scratch.
constexpr int64_t kKNMaxScratchBytes = int64_t{64} << 20;
// kn products of fewer weight bytes than this run on the calling thread alone (waking the
// pool costs more than it saves).
constexpr int64_t kKNSerialBytes = int64_t{1} << 19;
std::atomic<int64_t> g_kn_serial_bytes{kKNSerialBytes};

struct Work {
  int64_t M, N, K;
  bool kn;
  const float* x;
  const float* w;
  float* y;
  float* part = nullptr;  // kn: [n_tasks - 1, M, N] partial products of tasks 1..
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t n_tasks;

  void RunNK(int64_t n0, int64_t n1);
  void RunKN(int64_t k0, int64_t k1, float* out);
  void Drain() {
    for (int64_t t = next.fetch_add(1); t < n_tasks; t = next.fetch_add(1)) {
      if (kn) {
        RunKN(t * kKRowsPerTask, std::min(K, (t + 1) * kKRowsPerTask),
              t == 0 ? y : part + (t - 1) * M * N);
      } else {
        RunNK(t * kRowsPerTask, std::min(N, (t + 1) * kRowsPerTask));
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Scalar pieces: one output of nk (also the AVX2 tail), and kn without AVX2.
inline float DotTail(const float* a, const float* b, int64_t k0, int64_t K) {
  float s = 0.f;
  for (int64_t k = k0; k < K; ++k) s += a[k] * b[k];
  return s;
}

// out[:, :] = x[:, k0:k1] @ W[k0:k1, :] as the AVX2 RunKN does it: W's rows in order, one
// fused multiply-add per element into the zeroed partial rows (the same bits).
void KNScalar(const Work& w, int64_t k0, int64_t k1, float* out) {
  std::fill(out, out + w.M * w.N, 0.f);
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w.w + k * w.N;
    for (int64_t r = 0; r < w.M; ++r) {
      const float xv = w.x[r * w.K + k];
      float* o = out + r * w.N;
      for (int64_t c = 0; c < w.N; ++c) o[c] = std::fma(xv, wk[c], o[c]);
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

// out[:, :] = x[:, k0:k1] @ W[k0:k1, :]: W's rows in order, one at a time, each added into
// every partial row of out (8-float chunks, then a scalar tail), out staying in L1/L2 and W
// read once as one sequential stream. (Four rows of W per pass, i.e. four streams, measured
// slower.) One output's sum is the chain of fused multiply-adds over k from 0: the same
// whatever M is.
void Work::RunKN(int64_t k0, int64_t k1, float* out) {
  const int64_t n8 = N & ~int64_t{7};
  for (int64_t r = 0; r < M; ++r) std::fill(out + r * N, out + (r + 1) * N, 0.f);
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * N;
    for (int64_t r = 0; r < M; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * K + k);
      float* o = out + r * N;
      for (int64_t c = 0; c < n8; c += 8)
        _mm256_storeu_ps(o + c, _mm256_fmadd_ps(a, _mm256_loadu_ps(wk + c), _mm256_loadu_ps(o + c)));
      for (int64_t c = n8; c < N; ++c) o[c] = std::fma(x[r * K + k], wk[c], o[c]);
    }
  }
}
#else
void Work::RunNK(int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < M; ++r) y[r * N + n] = DotTail(x + r * K, w + n * K, 0, K);
}

void Work::RunKN(int64_t k0, int64_t k1, float* out) { KNScalar(*this, k0, k1, out); }
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
  work->n_tasks = kn ? std::max<int64_t>(1, (K + kKRowsPerTask - 1) / kKRowsPerTask)
                     : (N + kRowsPerTask - 1) / kRowsPerTask;
  if (kn && (work->n_tasks - 1) * M * N * 4 > kKNMaxScratchBytes) work->n_tasks = 1;
  thread_local std::vector<float> scratch;  // the caller's; helpers write it while it waits
  if (kn && work->n_tasks > 1) {
    const size_t need = static_cast<size_t>((work->n_tasks - 1) * M * N);
    try {
      if (scratch.size() < need) scratch.resize(need);
    } catch (const std::bad_alloc&) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        "fmatmul_kn: no memory for " + std::to_string(need) + " partial sums");
    }
    work->part = scratch.data();
  }
  const bool serial = kn && K * N * 4 < g_kn_serial_bytes.load(std::memory_order_relaxed);
  // Never more threads than cores: the caller is itself one of XLA's threads.
  static const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t helpers = serial ? 0 :
      std::min<int64_t>({pool.num_threads(), cores - 1, work->n_tasks - 1});
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work]() { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->n_tasks) std::this_thread::yield();
  if (kn) {  // y = task 0's partial + the others', in task order
    float* yd = work->y;
    for (int64_t t = 1; t < work->n_tasks; ++t) {
      const float* p = work->part + (t - 1) * M * N;
      for (int64_t i = 0; i < M * N; ++i) yd[i] += p[i];
    }
  }
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

// kn products of fewer weight bytes than this run on the calling thread alone (default
// kKNSerialBytes); settable so measurements compare both in one process.
extern "C" int64_t JaxserveFMatmulKNSerialBytes() { return g_kn_serial_bytes.load(); }

extern "C" int64_t JaxserveFMatmulSetKNSerialBytes(int64_t bytes) {
  g_kn_serial_bytes.store(bytes < 0 ? 0 : bytes);
  return g_kn_serial_bytes.load();
}
