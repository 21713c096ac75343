// A bf16 GEMV/GEMM for few rows on AVX2+FMA CPUs (AVX-512F for 3+ rows where present, with the
// same bits), as an XLA FFI custom call (kernels_cpu;
// peagle_jax routes decode, verify and draft matmuls here on CPU, models.options.choose_matmul).
// y[m, o] = sum_i x[m, i] * W[i, o], accumulated in float32 in a fixed order over i for every
// row, so a row's result never depends on how many rows share the call (the row invariance
// that peagle_jax's exact speculation rests on).
// W is packed tile-major [O/32, I, 32] so each thread streams contiguous memory (and each
// 16-column half interleaved for a cheap bf16 -> float32 widening, see load16).
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
constexpr int64_t kTile = 32;

// 16 packed bf16 weights -> two float32 vectors, exactly. `pack` stores each 16-column half
// of a tile interleaved (c0, c8, c1, c9, ...), so a 32-bit lane holds columns j and 8 + j:
// a shift gives columns 0-7 and a mask gives 8-15, two integer ops per 16 weights.
static inline void load16(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Weights are read kPrefetchLines lines (64 bytes, one i of a tile) ahead of use. The
// hardware's stream prefetcher stops at 4 KiB page boundaries; this keeps the next pages (the
// rest of the tile, then the next tile, which follows it in memory) arriving while the FMAs run.
// Prefetching past the end of the weights is harmless (a prefetch never faults).
constexpr int64_t kPrefetchLines = 128;
static inline void prefetch_ahead(const uint16_t* wi) {
  _mm_prefetch(reinterpret_cast<const char*>(wi + kPrefetchLines * kTile), _MM_HINT_T0);
}

// One or two rows x a whole 32-column tile: acc a (row x0) and b (row x1, if kTwo) += x[i] *
// w[i, 0:32] for i in order, one FMA per element and step. The weights are read once and
// widened in registers: with this few rows the call is bound by memory.
template <bool kTwo>
static void pair_tile(const float* x0, const float* x1, const uint16_t* w, int64_t I, float* y0, float* y1) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (int64_t i = 0; i < I; ++i) {
    const uint16_t* wi = w + i * kTile;
    prefetch_ahead(wi);
    __m256 w0, w1, w2, w3;
    load16(wi, w0, w1);
    load16(wi + 16, w2, w3);
    const __m256 s = _mm256_broadcast_ss(x0 + i);
    a0 = _mm256_fmadd_ps(s, w0, a0); a1 = _mm256_fmadd_ps(s, w1, a1);
    a2 = _mm256_fmadd_ps(s, w2, a2); a3 = _mm256_fmadd_ps(s, w3, a3);
    if (kTwo) {
      const __m256 u = _mm256_broadcast_ss(x1 + i);
      b0 = _mm256_fmadd_ps(u, w0, b0); b1 = _mm256_fmadd_ps(u, w1, b1);
      b2 = _mm256_fmadd_ps(u, w2, b2); b3 = _mm256_fmadd_ps(u, w3, b3);
    }
  }
  _mm256_storeu_ps(y0, a0); _mm256_storeu_ps(y0 + 8, a1); _mm256_storeu_ps(y0 + 16, a2); _mm256_storeu_ps(y0 + 24, a3);
  if (kTwo) {
    _mm256_storeu_ps(y1, b0); _mm256_storeu_ps(y1 + 8, b1); _mm256_storeu_ps(y1 + 16, b2); _mm256_storeu_ps(y1 + 24, b3);
  }
}

// R rows x half a tile (16 columns) x the chunk i0 .. i1 of the inputs, the same FMA sequence
// per element as pair_tile: the running sums live in acc [R, 32] between chunks (a float32
// store and load, exact). Two widened weight vectors serve all R rows, so with 3+ rows the
// call is bound by FMAs, not by widening (2R + 3 registers: R <= 6).
template <int R>
static void rows_half_chunk(const float* x, int64_t I, const uint16_t* w, int64_t i0, int64_t i1, float* acc,
                            bool prefetch) {
  __m256 a[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) { a[r][0] = _mm256_loadu_ps(acc + r * kTile); a[r][1] = _mm256_loadu_ps(acc + r * kTile + 8); }
  for (int64_t i = i0; i < i1; ++i) {
    if (prefetch) prefetch_ahead(w + i * kTile);
    __m256 w0, w1;
    load16(w + i * kTile, w0, w1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_broadcast_ss(x + r * I + i);
      a[r][0] = _mm256_fmadd_ps(s, w0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(s, w1, a[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) { _mm256_storeu_ps(acc + r * kTile, a[r][0]); _mm256_storeu_ps(acc + r * kTile + 8, a[r][1]); }
}

constexpr int64_t kMaxBlockRows = 6;
constexpr int64_t kMaxRows = 64;  // acc's rows; more rows run in several passes (see tiles)
constexpr int64_t kChunk = 64;    // inputs per chunk: 64 lines of a tile, 4 KiB, stay in L1

static void rows_half_chunk(int64_t R, const float* x, int64_t I, const uint16_t* w, int64_t i0, int64_t i1,
                            float* acc, bool prefetch) {
  switch (R) {
    case 1: return rows_half_chunk<1>(x, I, w, i0, i1, acc, prefetch);
    case 2: return rows_half_chunk<2>(x, I, w, i0, i1, acc, prefetch);
    case 3: return rows_half_chunk<3>(x, I, w, i0, i1, acc, prefetch);
    case 4: return rows_half_chunk<4>(x, I, w, i0, i1, acc, prefetch);
    case 5: return rows_half_chunk<5>(x, I, w, i0, i1, acc, prefetch);
    default: return rows_half_chunk<6>(x, I, w, i0, i1, acc, prefetch);
  }
}

// Rows [0, M) (M <= kMaxRows) of one tile. The tile streams from memory once, chunk by chunk:
// each chunk (in L1) serves every block of at most six rows (split evenly) and both halves of
// the tile before the next one is read, so the reads overlap the FMAs instead of preceding them.
static void rows_tile(int64_t M, const float* x, int64_t I, const uint16_t* w, float* yt, int64_t O) {
  alignas(32) float acc[kMaxRows * kTile];
  std::memset(acc, 0, sizeof(float) * M * kTile);
  const int64_t blocks = (M + kMaxBlockRows - 1) / kMaxBlockRows;
  for (int64_t i0 = 0; i0 < I; i0 += kChunk) {
    const int64_t i1 = std::min(I, i0 + kChunk);
    for (int64_t b = 0, r0 = 0; b < blocks; ++b) {
      const int64_t r1 = (b + 1) * M / blocks;
      for (int64_t h = 0; h < 2; ++h)
        rows_half_chunk(r1 - r0, x + r0 * I, I, w + 16 * h, i0, i1, acc + r0 * kTile + 16 * h, b == 0 && h == 0);
      r0 = r1;
    }
  }
  for (int64_t r = 0; r < M; ++r) std::memcpy(yt + r * O, acc + r * kTile, kTile * sizeof(float));
}

// ---- AVX-512F: the same sums, twice the lanes -------------------------------------------
// On CPUs with AVX-512F one 512-bit load holds a whole packed tile. Shifting and masking its
// 32-bit lanes gives lo = columns (0-7, 16-23) and hi = (8-15, 24-31) as float32, exactly.
// Each output element still gets one FMA per input i, in order, from a zero start: the very
// same rounding steps as the AVX2 loops above, so the two paths agree bit for bit (tested) and
// only the instruction count halves. 32 vector registers hold up to 14 rows x 32 columns.
#define PEAGLE_AVX512 __attribute__((target("avx512f")))
constexpr int64_t kMaxBlockRows512 = 14;

// Whether the AVX-512 loops run (PEAGLE_CPU_KERNEL_AVX2=1 keeps the AVX2 ones, for tests), and
// from how many rows: 1-2 rows are bound by memory, and the AVX2 pair_tile streams them slightly
// faster (SmolLM2-shaped stack: 10.5 against 11.0 ms at 1 row); PEAGLE_CPU_KERNEL_MIN512
// overrides the threshold, for measuring.
static bool cpu_has_avx512f() {
  static const bool has = __builtin_cpu_supports("avx512f") && std::getenv("PEAGLE_CPU_KERNEL_AVX2") == nullptr;
  return has;
}
static int64_t min_avx512_rows() {
  static const int64_t rows = std::getenv("PEAGLE_CPU_KERNEL_MIN512") ? std::atoll(std::getenv("PEAGLE_CPU_KERNEL_MIN512")) : 3;
  return rows;
}

// R rows x a whole tile x the inputs i0 .. i1; running sums in acc [R, 32] (in lo/hi lane
// order, see store_tile512) between chunks: a float32 store and load, exact.
template <int R>
PEAGLE_AVX512 static void rows_chunk512(const float* x, int64_t I, const uint16_t* w, int64_t i0, int64_t i1,
                                        float* acc, bool prefetch) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) { lo[r] = _mm512_loadu_ps(acc + r * kTile); hi[r] = _mm512_loadu_ps(acc + r * kTile + 16); }
  const __m512i mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t i = i0; i < i1; ++i) {
    const uint16_t* wi = w + i * kTile;
    if (prefetch) prefetch_ahead(wi);
    const __m512i v = _mm512_loadu_si512(wi);
    const __m512 wl = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 wh = _mm512_castsi512_ps(_mm512_and_si512(v, mask));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(x[r * I + i]);
      lo[r] = _mm512_fmadd_ps(s, wl, lo[r]);
      hi[r] = _mm512_fmadd_ps(s, wh, hi[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) { _mm512_storeu_ps(acc + r * kTile, lo[r]); _mm512_storeu_ps(acc + r * kTile + 16, hi[r]); }
}

PEAGLE_AVX512 static void rows_chunk512(int64_t R, const float* x, int64_t I, const uint16_t* w, int64_t i0,
                                        int64_t i1, float* acc, bool prefetch) {
  switch (R) {
#define PEAGLE_ROWS_CASE(n) case n: return rows_chunk512<n>(x, I, w, i0, i1, acc, prefetch);
    PEAGLE_ROWS_CASE(1) PEAGLE_ROWS_CASE(2) PEAGLE_ROWS_CASE(3) PEAGLE_ROWS_CASE(4) PEAGLE_ROWS_CASE(5)
    PEAGLE_ROWS_CASE(6) PEAGLE_ROWS_CASE(7) PEAGLE_ROWS_CASE(8) PEAGLE_ROWS_CASE(9) PEAGLE_ROWS_CASE(10)
    PEAGLE_ROWS_CASE(11) PEAGLE_ROWS_CASE(12) PEAGLE_ROWS_CASE(13)
#undef PEAGLE_ROWS_CASE
    default: return rows_chunk512<14>(x, I, w, i0, i1, acc, prefetch);
  }
}

// acc's lane order back to columns: lo holds (0-7, 16-23), hi (8-15, 24-31).
static void store_tile512(const float* acc, float* y) {
  std::memcpy(y, acc, 8 * sizeof(float));
  std::memcpy(y + 16, acc + 8, 8 * sizeof(float));
  std::memcpy(y + 8, acc + 16, 8 * sizeof(float));
  std::memcpy(y + 24, acc + 24, 8 * sizeof(float));
}

// Rows [0, M) (M <= kMaxRows) of one tile. One block (M <= 14) streams the tile once with its
// sums in registers; more rows go chunk by chunk as in rows_tile, each chunk (in L1) serving
// every block before the next is read.
PEAGLE_AVX512 static void rows_tile512(int64_t M, const float* x, int64_t I, const uint16_t* w, float* yt,
                                       int64_t O) {
  alignas(64) float acc[kMaxRows * kTile];
  std::memset(acc, 0, sizeof(float) * M * kTile);
  const int64_t blocks = (M + kMaxBlockRows512 - 1) / kMaxBlockRows512;
  const int64_t chunk = blocks == 1 ? I : kChunk;
  for (int64_t i0 = 0; i0 < I; i0 += chunk) {
    const int64_t i1 = std::min(I, i0 + chunk);
    for (int64_t b = 0, r0 = 0; b < blocks; ++b) {
      const int64_t r1 = (b + 1) * M / blocks;
      rows_chunk512(r1 - r0, x + r0 * I, I, w, i0, i1, acc + r0 * kTile, b == 0);
      r0 = r1;
    }
  }
  for (int64_t r = 0; r < M; ++r) store_tile512(acc + r * kTile, yt + r * O);
}

// Tiles [t0, t1) of one call. Up to two rows: one pass over each tile (pair_tile). More: rows
// in groups of at most kMaxRows, each group over the tile chunk by chunk (rows_tile).
static void tiles(int64_t t0, int64_t t1, int64_t M, int64_t I, int64_t O, const float* x,
                  const uint16_t* W, float* y) {
  for (int64_t t = t0; t < t1; ++t) {
    const uint16_t* w = W + t * I * kTile;
    float* yt = y + t * kTile;
    if (M >= min_avx512_rows() && cpu_has_avx512f()) {
      for (int64_t r0 = 0; r0 < M; r0 += kMaxRows)
        rows_tile512(std::min(M, r0 + kMaxRows) - r0, x + r0 * I, I, w, yt + r0 * O, O);
      continue;
    }
    if (M == 1) { pair_tile<false>(x, x, w, I, yt, yt); continue; }
    if (M == 2) { pair_tile<true>(x, x + I, w, I, yt, yt + O); continue; }
    for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
      const int64_t r1 = std::min(M, r0 + kMaxRows);
      rows_tile(r1 - r0, x + r0 * I, I, w, yt + r0 * O, O);
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
