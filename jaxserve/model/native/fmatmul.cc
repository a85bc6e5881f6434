// Float-weight matmul for XLA:CPU (XLA FFI) at few rows (decode): y f32[M, N] from x f32[M, K]
// and a float weight in one of two layouts:
//
//   nk (jaxserve_fmatmul_nk): W f32[N, K], y = x @ W^T. The tied LM head reads the
//       embedding [V, E] this way: each output is a dot product of contiguous rows.
//       Register tiles of 1 (up to kNKStreamMaxRows rows of x: one sequential stream) or
//       4 weight rows x 1-2 rows of x, 8-wide FMA along K.
//   kn (jaxserve_fmatmul_kn): W f32[K, N], y = x @ W (the layers' canonical matrices).
//       Split along K: task c owns the contiguous rows [k0, k1) of W and writes the
//       partial product x[:, k0:k1] @ W[k0:k1] into its own slice of a scratch buffer; the
//       caller then sums the partials in task order. Inside a task, W's rows go in chunks
//       of kKChunk (kKChunk sequential streams), each chunk strip by strip along N with
//       x's rows four at a time in 16-column strips (the 4 x 16 sums in registers) or,
//       from 5 rows, eight at a time (then 7, 6 or 5) in 8-column strips, added into the
//       partial rows once a chunk. The split depends on K alone and each
//       output's sum on its own row of x (at one row of x, KNOneRowStream reads W's rows
//       in memory order through an L1 buffer: the same chains), so the result is the same
//       whichever threads ran the tasks and whatever M is (batch-invariant; the engine
//       sends up to linear.FLOAT_NATIVE_MAX_ROWS rows here, XLA the rest).
//   kn_many (jaxserve_fmatmul_kn_many): up to kMaxProducts kn products of one x (a layer's
//       q, k, v; gate, up) in one call: their tasks are claimed from one list (one wake-up
//       of the pool; small weights such as k and v share the threads) and each product is
//       split and summed exactly as alone, so the same bits as one call each.
//
// Why: XLA:CPU runs a one-row dot at 13-19 GB/s of weight (a single-threaded loop for
// M = 1) and a 4-8-row one at 10-11 GB/s; these kernels split the weight over XLA's
// intra-op pool (ffi::ThreadPool) and the calling thread, in tasks of kRowsPerTask output
// rows (nk) or kKRowsPerTask rows of W (kn). Measured on 30 layers of SmolLM2's matrices
// in one program (notes/issue26.md, fourteenth session; two threads stream ~28 GB/s
// here): kn 16.3 / 17.6 / 21.8 / 34.0 ms at M = 1 / 2 / 4 / 8 against XLA's 21.2 / 23.8 /
// 38.6 / 42.0; XLA wins from 16 rows. (Earlier kn kernels: one row of W at a time added
// into the partial rows, a load and a store of the partial per multiply-add, ran 1.7x
// slower at 4 rows; 64 output columns a task over all of K, a strided walk, ~9 GB/s.)
// The accumulators are local 1-D arrays with unrolled loops: GCC otherwise stored them to
// the stack on every step (1.3-1.5x slower; the nk tiles too). Any K and N: tails are
// scalar. Without AVX2 a portable scalar loop computes the same sums in the same order
// (kn: the same fused multiply-add chains, so the same bits; nk: separate multiply and add).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <new>
#include <optional>
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
constexpr int64_t kKChunk = 8;  // kn: rows of W summed in registers before adding into out
// kn: at most this many bytes of partial products a call; past it (many rows of x, a large
// weight) a product's tasks run one by one on the caller through one [M, N] buffer, and
// several products that pass it only together run one call each.
constexpr int64_t kKNMaxScratchBytes = int64_t{64} << 20;
// kn products of fewer weight bytes than this run on the calling thread alone (waking the
// pool costs more than it saves).
constexpr int64_t kKNSerialBytes = int64_t{1} << 19;
std::atomic<int64_t> g_kn_serial_bytes{kKNSerialBytes};
// nk: rows of x up to which W is read one row at a time (see RunNK).
constexpr int64_t kNKStreamMaxRows = 4;
// kn at one row: columns of W's rows a stream pass covers (its chains wait in L1 between rows).
constexpr int64_t kKNStreamCols = 2048;
// Read W in the orders that stream it best (kn: at one row in memory order, from 5 rows in
// one pass a chunk; nk: one weight row at a time up to kNKStreamMaxRows); settable so
// measurements compare them with the register tiles alone in one process (the same bits).
std::atomic<bool> g_stream_order{true};

// One product: y = x @ W (kn) or x @ W^T (nk), in n_tasks tasks (see the top).
struct Work {
  int64_t M = 0, N = 0, K = 0;
  bool kn = false;
  const float* x = nullptr;
  const float* w = nullptr;
  float* y = nullptr;
  float* part = nullptr;  // kn: [n_tasks - 1, M, N] partial products of tasks 1..
  int64_t n_tasks = 0;

  void RunNK(int64_t n0, int64_t n1);
  void RunKN(int64_t k0, int64_t k1, float* out);
  void RunTask(int64_t t) {
    if (kn) {
      RunKN(t * kKRowsPerTask, std::min(K, (t + 1) * kKRowsPerTask),
            t == 0 ? y : part + (t - 1) * M * N);
    } else {
      RunNK(t * kRowsPerTask, std::min(N, (t + 1) * kRowsPerTask));
    }
  }
  void SumPartials() {  // kn: y = task 0's partial + the others', in task order
    for (int64_t t = 1; t < n_tasks; ++t) {
      const float* p = part + (t - 1) * M * N;
      for (int64_t i = 0; i < M * N; ++i) y[i] += p[i];
    }
  }
};

// The tasks of up to kMaxProducts products of one x (q, k and v; gate and up), claimed in
// order by the caller and the pool's helpers: one wake-up of the pool for all of them.
constexpr int kMaxProducts = 4;
struct Job {
  Work work[kMaxProducts];
  int64_t first[kMaxProducts + 1] = {0};  // product j owns tasks [first[j], first[j + 1])
  int n = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Drain() {
    for (int64_t t = next.fetch_add(1); t < first[n]; t = next.fetch_add(1)) {
      int j = 0;
      while (t >= first[j + 1]) ++j;
      work[j].RunTask(t - first[j]);
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

// One output's share of a chunk of W's rows [kc, ke), x[r, kc:ke] . W[kc:ke, c]: the fused
// multiply-add chain from zero that the AVX2 blocks compute lane by lane (so the same bits).
inline float KNChain(const Work& w, int64_t r, int64_t c, int64_t kc, int64_t ke) {
  float a = 0.f;
  for (int64_t k = kc; k < ke; ++k) a = std::fma(w.x[r * w.K + k], w.w[k * w.N + c], a);
  return a;
}

// out[:, :] = x[:, k0:k1] @ W[k0:k1, :] as the AVX2 RunKN does it, the same bits: W's rows
// in chunks of kKChunk, each chunk's chain added into the (zeroed) partial output.
void KNScalar(const Work& w, int64_t k0, int64_t k1, float* out) {
  std::fill(out, out + w.M * w.N, 0.f);
  for (int64_t kc = k0; kc < k1; kc += kKChunk) {
    const int64_t ke = std::min(k1, kc + kKChunk);
    for (int64_t r = 0; r < w.M; ++r)
      for (int64_t c = 0; c < w.N; ++c) out[r * w.N + c] += KNChain(w, r, c, kc, ke);
  }
}

#ifdef __AVX2__
inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[r0:r0+RT, n0:n0+NT] = x[r0:r0+RT] . W[n0:n0+NT] over the whole K. (Locals and a flat
// accumulator array, loops unrolled: otherwise GCC stores the accumulators every step.)
template <int NT, int RT>
void TileNK(const Work& w, int64_t n0, int64_t r0) {
  const int64_t K = w.K, N = w.N;
  const float* const wr = w.w + n0 * K;
  const float* const xr = w.x + r0 * K;
  __m256 acc[NT * RT];
#pragma GCC unroll 8
  for (int i = 0; i < NT * RT; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t k8 = K & ~int64_t{7};
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 wv[NT];
#pragma GCC unroll 8
    for (int i = 0; i < NT; ++i) wv[i] = _mm256_loadu_ps(wr + i * K + k);
#pragma GCC unroll 8
    for (int r = 0; r < RT; ++r) {
      const __m256 xv = _mm256_loadu_ps(xr + r * K + k);
#pragma GCC unroll 8
      for (int i = 0; i < NT; ++i) acc[i * RT + r] = _mm256_fmadd_ps(wv[i], xv, acc[i * RT + r]);
    }
  }
  for (int i = 0; i < NT; ++i)
    for (int r = 0; r < RT; ++r)
      w.y[(r0 + r) * N + n0 + i] =
          HSum(acc[i * RT + r]) + DotTail(xr + r * K, wr + i * K, k8, K);
}

template <int NT>
void RowsNK(const Work& w, int64_t n0) {
  int64_t r = 0;
  for (; r + 2 <= w.M; r += 2) TileNK<NT, 2>(w, n0, r);
  if (r < w.M) TileNK<NT, 1>(w, n0, r);
}

void Work::RunNK(int64_t n0, int64_t n1) {
  int64_t n = n0;
  // Up to kNKStreamMaxRows rows of x, one weight row at a time: the task's rows are one
  // sequential stream (each tile reads its row once from memory, then from L1 for the
  // other rows of x), 1.3-1.4x faster at one row than 4-row tiles, which read 4 interleaved
  // streams (notes/issue26.md, sixteenth session); past it the 4-row tiles reuse each x
  // load 4 times and win. The same chain per output either way, so the same bits.
  if (M > kNKStreamMaxRows || !g_stream_order.load(std::memory_order_relaxed)) {
    for (; n + 4 <= n1; n += 4) RowsNK<4>(*this, n);
  }
  for (; n < n1; ++n) RowsNK<1>(*this, n);
}

// The partial product of rows [r0, r0 + MR) of x over one chunk of W's rows [kc, ke) and
// the 16 (C = 2) or 8 (C = 1) columns from c: accumulators in registers (MR x C vectors),
// one fused multiply-add chain per output from zero, added into out at the end.
template <int MR, int C>
inline void KNBlock(const Work& w, int64_t r0, int64_t kc, int64_t ke, int64_t c, float* out) {
  // Locals, and one 1-D array a column vector: with w's members read in the loop, or one
  // [MR][C] array, GCC kept the accumulators on the stack (a store every step; 1.5x slower).
  static_assert(C == 1 || C == 2);
  const int64_t K = w.K, N = w.N;
  const float* const x = w.x + r0 * K;
  const float* wk = w.w + kc * N + c;
  __m256 a0[MR], a1[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t k = kc; k < ke; ++k, wk += N) {
    const __m256 w0 = _mm256_loadu_ps(wk);
    const __m256 w1 = C == 2 ? _mm256_loadu_ps(wk + 8) : w0;
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * K + k);
      a0[r] = _mm256_fmadd_ps(b, w0, a0[r]);
      if constexpr (C == 2) a1[r] = _mm256_fmadd_ps(b, w1, a1[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    float* o = out + (r0 + r) * N + c;
    _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), a0[r]));
    if constexpr (C == 2) _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_loadu_ps(o + 8), a1[r]));
  }
}

// Rows [r0, r0 + MR) of x over W's rows [k0, k1): chunk by chunk (kKChunk rows of W, i.e.
// kKChunk sequential streams, which the prefetcher follows), strip by strip along N.
template <int MR, int C = 2>
void KNRows(const Work& w, int64_t r0, int64_t k0, int64_t k1, float* out) {
  const int64_t n16 = C == 2 ? w.N & ~int64_t{15} : 0, n8 = w.N & ~int64_t{7};
  for (int64_t kc = k0; kc < k1; kc += kKChunk) {
    const int64_t ke = std::min(k1, kc + kKChunk);
    for (int64_t c = 0; c < n16; c += 16) KNBlock<MR, 2>(w, r0, kc, ke, c, out);
    for (int64_t c = n16; c < n8; c += 8) KNBlock<MR, 1>(w, r0, kc, ke, c, out);
    for (int64_t c = n8; c < w.N; ++c)  // scalar tail, the same chain per output
      for (int64_t r = r0; r < r0 + MR; ++r) out[r * w.N + c] += KNChain(w, r, c, kc, ke);
  }
}

// One row of x: out[0, :] = x[0, k0:k1] @ W[k0:k1, :] with KNBlock<1, C>'s chains (each
// output's fused multiply-add chain from zero over a chunk's rows, added into out), but
// W's rows read in memory order, kKNStreamCols columns at a time: one sequential stream a
// thread where the strips read kKChunk interleaved ones (~10% slower at one row on this
// machine's prefetchers; notes/issue26.md, sixteenth session). The chains wait in an 8 KB
// stack buffer (L1) between rows (a thread_local one cost a __tls_get_addr call a vector
// in this shared library). The same bits as KNRows<1>.
void KNOneRowStream(const Work& w, int64_t k0, int64_t k1, float* out) {
  alignas(64) float acc[kKNStreamCols];
  const int64_t N = w.N, n8 = N & ~int64_t{7};
  const float* const x = w.x;
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t kc = k0; kc < k1; kc += kKChunk) {
    const int64_t ke = std::min(k1, kc + kKChunk);
    for (int64_t c0 = 0; c0 < n8; c0 += kKNStreamCols) {
      const int64_t nc = std::min(n8, c0 + kKNStreamCols) - c0;
      for (int64_t k = kc; k < ke; ++k) {
        const __m256 b = _mm256_broadcast_ss(x + k);
        const float* const wk = w.w + k * N + c0;
        // A chunk's first row starts each chain from zero; its last adds it into out.
        const bool first = k == kc, last = k == ke - 1;
        for (int64_t c = 0; c < nc; c += 8) {
          const __m256 a = _mm256_fmadd_ps(b, _mm256_loadu_ps(wk + c),
                                           first ? zero : _mm256_load_ps(acc + c));
          if (last) {
            float* o = out + c0 + c;
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), a));
          } else {
            _mm256_store_ps(acc + c, a);
          }
        }
      }
    }
    for (int64_t c = n8; c < N; ++c) out[c] += KNChain(w, 0, c, kc, ke);  // the scalar tail
  }
}

// out[:, :] = x[:, k0:k1] @ W[k0:k1, :]: one row of x streamed (KNOneRowStream); from 5
// rows eight at a time, then 7, 6 or 5, in 8-column strips; else four at a time (a block
// of 4 x 16 outputs fills 8 of the 16 AVX2 registers) and the last 3, 2 or 1. Each
// output's sum is the same chain whatever M is (batch-invariant), and the same bits as
// KNScalar.
void Work::RunKN(int64_t k0, int64_t k1, float* out) {
  std::fill(out, out + M * N, 0.f);
  if (M == 1 && g_stream_order.load(std::memory_order_relaxed)) {
    KNOneRowStream(*this, k0, k1, out);
    return;
  }
  int64_t r = 0;
  // 5-8 rows of x in one pass over each chunk, 8 columns a strip (MR + 1 registers; past
  // 8 rows, 8 at a time and then the rest): the chunk is read once instead of twice (4 +
  // the rest); 1.03-1.11x at 6-8 rows on 30 layers (notes/issue26.md, sixteenth session).
  // The same chains, so the same bits.
  if (g_stream_order.load(std::memory_order_relaxed)) {
    for (; r + 8 <= M; r += 8) KNRows<8, 1>(*this, r, k0, k1, out);
    if (M - r == 7) KNRows<7, 1>(*this, r, k0, k1, out), r += 7;
    if (M - r == 6) KNRows<6, 1>(*this, r, k0, k1, out), r += 6;
    if (M - r == 5) KNRows<5, 1>(*this, r, k0, k1, out), r += 5;
  }
  for (; r + 4 <= M; r += 4) KNRows<4>(*this, r, k0, k1, out);
  if (M - r == 3) KNRows<3>(*this, r, k0, k1, out);
  if (M - r == 2) KNRows<2>(*this, r, k0, k1, out);
  if (M - r == 1) KNRows<1>(*this, r, k0, k1, out);
}
#else
void Work::RunNK(int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < M; ++r) y[r * N + n] = DotTail(x + r * K, w + n * K, 0, K);
}

void Work::RunKN(int64_t k0, int64_t k1, float* out) { KNScalar(*this, k0, k1, out); }
#endif

std::string Dims(const ffi::Span<const int64_t>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

ffi::Error ShapeError(const char* name, const ffi::Span<const int64_t>& xd,
                      const ffi::Span<const int64_t>& wd, const ffi::Span<const int64_t>& yd) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string(name) + ": shapes do not agree (x " + Dims(xd) + ", w " +
                        Dims(wd) + ", y " + Dims(yd) + ")");
}

// y_j = x @ W_j for the n weights and results given (n <= kMaxProducts; the kn layout when
// n > 1), each product split exactly as it would be alone, so the same bits.
ffi::Error Run(ffi::ThreadPool& pool, bool kn, ffi::Buffer<ffi::F32>& x, int n,
               ffi::Buffer<ffi::F32>* const* ws, ffi::ResultBuffer<ffi::F32>* const* ys) {
  const char* name = n > 1 ? "fmatmul_kn_many" : kn ? "fmatmul_kn" : "fmatmul_nk";
  auto xd = x.dimensions();
  if (xd.size() != 2) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "fmatmul: x must be 2-D");
  }
  const int64_t M = xd[0], K = xd[1];
  auto job = std::make_shared<Job>();
  job->n = n;
  int64_t scratch_floats = 0, weight_bytes = 0;
  for (int j = 0; j < n; ++j) {
    auto wd = ws[j]->dimensions(), yd = (*ys[j])->dimensions();
    if (wd.size() != 2 || yd.size() != 2 || (kn ? wd[0] : wd[1]) != K ||
        yd[0] != M || yd[1] != (kn ? wd[1] : wd[0])) {
      return ShapeError(name, xd, wd, yd);
    }
    const int64_t N = kn ? wd[1] : wd[0];
    Work& w = job->work[j];
    w.M = M, w.N = N, w.K = K, w.kn = kn;
    w.x = x.typed_data(), w.w = ws[j]->typed_data(), w.y = (*ys[j])->typed_data();
    w.n_tasks = kn ? std::max<int64_t>(1, (K + kKRowsPerTask - 1) / kKRowsPerTask)
                   : (N + kRowsPerTask - 1) / kRowsPerTask;
    job->first[j + 1] = job->first[j] + w.n_tasks;
    if (kn) scratch_floats += (w.n_tasks - 1) * M * N;
    weight_bytes += K * N * 4;
  }
  // Several products past kKNMaxScratchBytes of partials together: one call each, as alone
  // (each threaded unless it alone passes the cap); the same bits.
  if (n > 1 && kn && scratch_floats * 4 > kKNMaxScratchBytes) {
    for (int j = 0; j < n; ++j) {
      ffi::Error e = Run(pool, kn, x, 1, ws + j, ys + j);
      if (e.failure()) return e;
    }
    return ffi::Error::Success();
  }
  // One product past kKNMaxScratchBytes of partials (many rows of x, a large weight): its
  // tasks run one after another on the caller through one [M, N] buffer, the same sums in
  // the same order.
  const bool one_by_one = kn && scratch_floats * 4 > kKNMaxScratchBytes;
  thread_local std::vector<float> scratch;  // the caller's; helpers write it while it waits
  if (scratch_floats > 0) {
    const size_t need = static_cast<size_t>(one_by_one ? M * job->work[0].N : scratch_floats);
    try {
      if (scratch.size() < need) scratch.resize(need);
    } catch (const std::bad_alloc&) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        "fmatmul_kn: no memory for " + std::to_string(need) + " partial sums");
    }
    float* part = scratch.data();
    for (int j = 0; j < n && !one_by_one; ++j) {
      job->work[j].part = part;
      part += (job->work[j].n_tasks - 1) * M * job->work[j].N;
    }
  }
  if (one_by_one) {
    Work& w = job->work[0];
    w.RunKN(0, std::min(K, kKRowsPerTask), w.y);
    for (int64_t t = 1; t < w.n_tasks; ++t) {
      w.RunKN(t * kKRowsPerTask, std::min(K, (t + 1) * kKRowsPerTask), scratch.data());
      for (int64_t i = 0; i < M * w.N; ++i) w.y[i] += scratch[i];
    }
    return ffi::Error::Success();
  }
  const bool serial = kn && weight_bytes < g_kn_serial_bytes.load(std::memory_order_relaxed);
  // Never more threads than cores: the caller is itself one of XLA's threads.
  static const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t helpers = serial ? 0 :
      std::min<int64_t>({pool.num_threads(), cores - 1, job->first[n] - 1});
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job]() { job->Drain(); });
  job->Drain();
  while (job->done.load(std::memory_order_acquire) < job->first[n]) std::this_thread::yield();
  if (kn) {
    for (int j = 0; j < n; ++j) job->work[j].SumPartials();
  }
  return ffi::Error::Success();
}

ffi::Error NKImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  ffi::Buffer<ffi::F32>* ws[] = {&w};
  ffi::ResultBuffer<ffi::F32>* ys[] = {&y};
  return Run(pool, false, x, 1, ws, ys);
}

ffi::Error KNImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  ffi::Buffer<ffi::F32>* ws[] = {&w};
  ffi::ResultBuffer<ffi::F32>* ys[] = {&y};
  return Run(pool, true, x, 1, ws, ys);
}

// kn over several weights of one x: the remaining arguments are W_j f32[K, N_j], the
// results y_j f32[M, N_j], as many of each (1..kMaxProducts).
ffi::Error KNManyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                      ffi::RemainingRets rets) {
  const size_t n = args.size();
  if (n < 1 || n > kMaxProducts || rets.size() != n) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "fmatmul_kn_many: needs 1.." + std::to_string(kMaxProducts) +
                          " weights and as many results, got " + std::to_string(n) + " and " +
                          std::to_string(rets.size()));
  }
  std::optional<ffi::Buffer<ffi::F32>> w[kMaxProducts];
  std::optional<ffi::ResultBuffer<ffi::F32>> y[kMaxProducts];
  ffi::Buffer<ffi::F32>* ws[kMaxProducts];
  ffi::ResultBuffer<ffi::F32>* ys[kMaxProducts];
  for (size_t j = 0; j < n; ++j) {
    auto wj = args.get<ffi::Buffer<ffi::F32>>(j);
    if (wj.has_error()) return wj.error();
    auto yj = rets.get<ffi::Buffer<ffi::F32>>(j);
    if (yj.has_error()) return yj.error();
    w[j].emplace(*wj), y[j].emplace(*yj);
    ws[j] = &*w[j], ys[j] = &*y[j];
  }
  return Run(pool, true, x, static_cast<int>(n), ws, ys);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveFMatmulKNMany, KNManyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .RemainingArgs()  // W_j [K, N_j]
                                  .RemainingRets());  // y_j [M, N_j]

// kn products of fewer weight bytes than this run on the calling thread alone (default
// kKNSerialBytes); settable so measurements compare both in one process.
extern "C" int64_t JaxserveFMatmulKNSerialBytes() { return g_kn_serial_bytes.load(); }

// Whether W is read in the streaming orders (1, the default; see g_stream_order) or by the
// register tiles alone (0); the same bits either way. Returns the setting in force.
extern "C" int64_t JaxserveFMatmulSetStreamOrder(int64_t on) {
  g_stream_order.store(on != 0);
  return g_stream_order.load() ? 1 : 0;
}

extern "C" int64_t JaxserveFMatmulSetKNSerialBytes(int64_t bytes) {
  g_kn_serial_bytes.store(bytes < 0 ? 0 : bytes);
  return g_kn_serial_bytes.load();
}
