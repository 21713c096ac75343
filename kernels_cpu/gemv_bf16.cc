// A bf16 GEMV/GEMM for few rows on AVX2+FMA CPUs, as an XLA FFI custom call (kernels_cpu;
// peagle_jax routes decode, verify and draft matmuls here on CPU, models.options.choose_matmul).
// y[m, o] = sum_i x[m, i] * W[i, o], accumulated in float32 in a fixed order over i for every
// row, so a row's result never depends on how many rows share the call (the row invariance
// that peagle_jax's exact speculation rests on).
// W is packed tile-major [O/32, I, 32] so each thread streams contiguous memory.
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
constexpr int64_t kTile = 32;

static inline __m256 load8(const uint16_t* p) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// Weights as stored (bf16, widened on the fly) or a tile chunk already widened to float32.
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// acc[0..3] (row x0) and acc[4..7] (row x1, if kTwo) += x[i] * w[i, 0:32] for i in [0, n), in
// order, one FMA per element and step: the same sequence for every row whatever its block.
template <bool kTwo, typename T>
static inline void accumulate(const float* x0, const float* x1, const T* w, int64_t n, __m256* acc) {
  __m256 a0 = acc[0], a1 = acc[1], a2 = acc[2], a3 = acc[3];
  __m256 b0 = acc[4], b1 = acc[5], b2 = acc[6], b3 = acc[7];
  for (int64_t i = 0; i < n; ++i) {
    const T* wi = w + i * kTile;
    const __m256 w0 = load8(wi), w1 = load8(wi + 8), w2 = load8(wi + 16), w3 = load8(wi + 24);
    const __m256 s = _mm256_broadcast_ss(x0 + i);
    a0 = _mm256_fmadd_ps(s, w0, a0); a1 = _mm256_fmadd_ps(s, w1, a1);
    a2 = _mm256_fmadd_ps(s, w2, a2); a3 = _mm256_fmadd_ps(s, w3, a3);
    if (kTwo) {
      const __m256 u = _mm256_broadcast_ss(x1 + i);
      b0 = _mm256_fmadd_ps(u, w0, b0); b1 = _mm256_fmadd_ps(u, w1, b1);
      b2 = _mm256_fmadd_ps(u, w2, b2); b3 = _mm256_fmadd_ps(u, w3, b3);
    }
  }
  acc[0] = a0; acc[1] = a1; acc[2] = a2; acc[3] = a3;
  acc[4] = b0; acc[5] = b1; acc[6] = b2; acc[7] = b3;
}

// Rows [0, M) over one weight span of n inputs starting at input i0: accumulators start at
// zero (i0 == 0) or at the partial sums in y, and go back to y (float32 stores are exact).
template <typename T>
static void rows_over_span(int64_t M, int64_t I, int64_t O, const float* x, const T* w, int64_t i0,
                           int64_t n, int64_t col, float* y) {
  for (int64_t r = 0; r < M; r += 2) {
    const bool two = r + 1 < M;
    float* y0 = y + r * O + col;
    float* y1 = y0 + O;
    __m256 acc[8];
    for (int k = 0; k < 4; ++k) {
      acc[k] = i0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(y0 + 8 * k);
      acc[4 + k] = (i0 == 0 || !two) ? _mm256_setzero_ps() : _mm256_loadu_ps(y1 + 8 * k);
    }
    const float* x0 = x + r * I + i0;
    if (two) accumulate<true>(x0, x0 + I, w, n, acc);
    else accumulate<false>(x0, x0, w, n, acc);
    for (int k = 0; k < 4; ++k) {
      _mm256_storeu_ps(y0 + 8 * k, acc[k]);
      if (two) _mm256_storeu_ps(y1 + 8 * k, acc[4 + k]);
    }
  }
}

constexpr int64_t kChunk = 128;  // inputs of a tile widened at a time: 16 KiB of float32, in L1

// Tiles [t0, t1) of one call. One or two rows stream the bf16 weights once, widening them in
// registers (the call is bound by memory). More rows widen each chunk of a tile to float32
// once and reuse it from L1 for every pair of rows (the call is bound by arithmetic, and
// widening per row pair would double it). Both give each element the same FMA sequence.
static void tiles(int64_t t0, int64_t t1, int64_t M, int64_t I, int64_t O, const float* x,
                  const uint16_t* W, float* y) {
  alignas(32) float wf[kChunk * kTile];
  for (int64_t t = t0; t < t1; ++t) {
    const uint16_t* w = W + t * I * kTile;
    if (M <= 2) { rows_over_span(M, I, O, x, w, 0, I, t * kTile, y); continue; }
    for (int64_t i0 = 0; i0 < I; i0 += kChunk) {
      const int64_t n = std::min(kChunk, I - i0);
      for (int64_t j = 0; j < n * kTile; j += 8) _mm256_store_ps(wf + j, load8(w + i0 * kTile + j));
      rows_over_span(M, I, O, x, wf, i0, n, t * kTile, y);
    }
  }
}

// One call's work, shared by the calling thread and the pool tasks it schedules. Spans of
// tiles are claimed from a counter: the caller works through them too and then waits only
// for spans another thread is computing right now, never for a task still queued behind
// other work (so concurrent calls on a small pool cannot deadlock). A task that starts after
// the call returned finds nothing to claim; the shared_ptr keeps this state alive for it.
struct Job {
  int64_t M, I, O, tiles, spans;
  std::vector<float> x;  // the rows widened to float32 once
  const uint16_t* W;
  float* y;
  std::atomic<int64_t> next{0}, done{0};

  void Work() {
    for (int64_t s; (s = next.fetch_add(1, std::memory_order_relaxed)) < spans;) {
      tiles_span(s * tiles / spans, (s + 1) * tiles / spans);
      done.fetch_add(1, std::memory_order_release);
    }
  }
  void tiles_span(int64_t t0, int64_t t1) { ::tiles(t0, t1, M, I, O, x.data(), W, y); }
};

static ffi::Error GemvBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                          ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kTile || wd[1] != xd[1])
    return ffi::Error::InvalidArgument("gemv_bf16: x [M, I] and packed w [O/32, I, 32] expected");
  auto job = std::make_shared<Job>();
  job->M = xd[0]; job->I = xd[1]; job->tiles = wd[0]; job->O = wd[0] * kTile;
  job->W = reinterpret_cast<const uint16_t*>(w.typed_data());
  job->y = y->typed_data();
  job->x.resize(job->M * job->I);
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.typed_data());
  for (int64_t j = 0; j < job->M * job->I; ++j) {
    const uint32_t u = uint32_t(xs[j]) << 16;
    std::memcpy(&job->x[j], &u, 4);
  }
  // Small weights (a few tiles) stay on the calling thread: a hand-off costs more than it saves.
  const int64_t workers = job->tiles < 8 ? 1 : std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), job->tiles));
  job->spans = std::min<int64_t>(job->tiles, 4 * workers);
  for (int64_t k = 1; k < workers; ++k) pool.Schedule([job] { job->Work(); });
  job->Work();
  while (job->done.load(std::memory_order_acquire) < job->spans) _mm_pause();
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(peagle_gemv_bf16, GemvBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
