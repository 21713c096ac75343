// A bf16 GEMV/GEMM for few rows on x86 CPUs, as an XLA FFI custom call (kernels_cpu; peagle_jax
// routes decode, verify and draft matmuls here on CPU, models.options.choose_matmul).
//
// y[m, o] = sum_i x[m, i] * W[i, o] in float32, every row by the same steps whatever the number of
// rows in the call, so a row's result never depends on the rows beside it (the row invariance
// that peagle_jax's exact speculation rests on). A host picks one loop set for every row count:
//   * AMX (AMX-BF16 CPUs where Linux grants the tile state): tile dot products, TDPBF16PS;
//   * else, with AVX512-BF16, pair dot products, VDPBF16PS (the FMA loops' bits);
//   * else FMAs on widened weights, AVX-512F for 3+ rows and AVX2 for 1-2 rows (or AVX2 only).
//     Both FMA sets take the same steps, bit for bit (tested): per input pair j, in order,
//     acc += x[2j+1] W[2j+1, o]; acc += x[2j] W[2j, o], each an FMA with denormals flushed.
//     (A bf16 x bf16 product is exact in float32, so each step rounds once.)
// AMX rounds its sums its own way, so an AMX host's tokens can differ from an FMA host's; on each
// host, speculative decoding still gives exactly that host's plain decoding tokens.
//
// W is packed [O/32, J, 32, 2], J = ceil(I/2) rounded up to a multiple of 16 (zero weights past
// I): per 32-column tile, per input pair j, each column's two weights W[2j, c], W[2j+1, c] side
// by side in one 32-bit lane (AMX's operand layout; the FMA loops split a lane with a shift and a
// mask). Each thread streams whole tiles in order.
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>
#include "amx.h"
#include "bf16.h"
#include "cpu_features.h"
#include "layer_view.h"
#include "spans.h"
#include "vmath.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
constexpr int64_t kTile = 32;             // output columns per tile
constexpr int64_t kPairStride = 2 * kTile;  // bf16 values per (tile, input pair): 128 bytes

// Weights are read kPrefetchPairs pairs (128 bytes each) ahead of use. The hardware's stream
// prefetcher stops at 4 KiB page boundaries; this keeps the next pages (the rest of the tile,
// then the next tile, which follows it in memory) arriving while the arithmetic runs.
// Prefetching past the end of the weights is harmless (a prefetch never faults).
constexpr int64_t kPrefetchPairs = 64;
static inline void prefetch_ahead(const uint16_t* wj) {
  const char* p = reinterpret_cast<const char*>(wj + kPrefetchPairs * kPairStride);
  _mm_prefetch(p, _MM_HINT_T0);
  _mm_prefetch(p + 64, _MM_HINT_T0);
}

// ---- AVX2 + FMA ------------------------------------------------------------------------------
// 8 lanes of packed pairs -> the even weights W[2j, c] and the odd ones W[2j+1, c] as float32.
static inline void split8(const uint16_t* p, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// One or two rows x a whole tile, all pairs: bound by memory, the weights are read once.
template <bool kTwo>
static void pair_tile(const float* x0, const float* x1, const uint16_t* w, int64_t J, float* y0, float* y1) {
  __m256 a[4], b[4];
  for (int g = 0; g < 4; ++g) a[g] = b[g] = _mm256_setzero_ps();
  for (int64_t j = 0; j < J; ++j) {
    const uint16_t* wj = w + j * kPairStride;
    prefetch_ahead(wj);
    const __m256 s0 = _mm256_broadcast_ss(x0 + 2 * j), s1 = _mm256_broadcast_ss(x0 + 2 * j + 1);
    __m256 u0, u1;
    if (kTwo) { u0 = _mm256_broadcast_ss(x1 + 2 * j); u1 = _mm256_broadcast_ss(x1 + 2 * j + 1); }
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      __m256 we, wo;
      split8(wj + 16 * g, we, wo);
      a[g] = _mm256_fmadd_ps(s0, we, _mm256_fmadd_ps(s1, wo, a[g]));
      if (kTwo) b[g] = _mm256_fmadd_ps(u0, we, _mm256_fmadd_ps(u1, wo, b[g]));
    }
  }
  for (int g = 0; g < 4; ++g) {
    _mm256_storeu_ps(y0 + 8 * g, a[g]);
    if (kTwo) _mm256_storeu_ps(y1 + 8 * g, b[g]);
  }
}

// R rows x half a tile (16 columns, 16 packed lanes) x the pairs j0 .. j1. The running sums stay
// in acc [R, 32] between chunks, the half's columns at the offset the caller gives (a float32
// store and load, exact). Two widened pairs of vectors serve all R rows.
template <int R>
static void rows_half_chunk(const float* x, int64_t J, const uint16_t* w, int64_t j0, int64_t j1, float* acc,
                            bool prefetch) {
  __m256 a[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) { a[r][0] = _mm256_loadu_ps(acc + r * kTile); a[r][1] = _mm256_loadu_ps(acc + r * kTile + 8); }
  for (int64_t j = j0; j < j1; ++j) {
    const uint16_t* wj = w + j * kPairStride;
    if (prefetch) prefetch_ahead(wj);
    __m256 e0, o0, e1, o1;
    split8(wj, e0, o0);
    split8(wj + 16, e1, o1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 s0 = _mm256_broadcast_ss(x + r * 2 * J + 2 * j), s1 = _mm256_broadcast_ss(x + r * 2 * J + 2 * j + 1);
      a[r][0] = _mm256_fmadd_ps(s0, e0, _mm256_fmadd_ps(s1, o0, a[r][0]));
      a[r][1] = _mm256_fmadd_ps(s0, e1, _mm256_fmadd_ps(s1, o1, a[r][1]));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) { _mm256_storeu_ps(acc + r * kTile, a[r][0]); _mm256_storeu_ps(acc + r * kTile + 8, a[r][1]); }
}

constexpr int64_t kMaxBlockRows = 5;
constexpr int64_t kMaxRows = 64;  // acc's rows; more rows run in several passes (see tiles)
constexpr int64_t kChunk = 32;    // input pairs per chunk: 32 x 128 bytes, 4 KiB, stay in L1

static void rows_half_chunk(int64_t R, const float* x, int64_t J, const uint16_t* w, int64_t j0, int64_t j1,
                            float* acc, bool prefetch) {
  switch (R) {
    case 1: return rows_half_chunk<1>(x, J, w, j0, j1, acc, prefetch);
    case 2: return rows_half_chunk<2>(x, J, w, j0, j1, acc, prefetch);
    case 3: return rows_half_chunk<3>(x, J, w, j0, j1, acc, prefetch);
    case 4: return rows_half_chunk<4>(x, J, w, j0, j1, acc, prefetch);
    default: return rows_half_chunk<5>(x, J, w, j0, j1, acc, prefetch);
  }
}

// Rows [0, M) (M <= kMaxRows) of one tile, streamed once chunk by chunk: each chunk (in L1)
// serves every block of rows and both halves of the tile before the next one is read.
static void rows_tile(int64_t M, const float* x, int64_t J, const uint16_t* w, float* yt, int64_t O) {
  alignas(32) float acc[kMaxRows * kTile];
  std::memset(acc, 0, sizeof(float) * M * kTile);
  const int64_t blocks = (M + kMaxBlockRows - 1) / kMaxBlockRows;
  for (int64_t j0 = 0; j0 < J; j0 += kChunk) {
    const int64_t j1 = std::min(J, j0 + kChunk);
    for (int64_t b = 0, r0 = 0; b < blocks; ++b) {
      const int64_t r1 = (b + 1) * M / blocks;
      for (int64_t h = 0; h < 2; ++h)
        rows_half_chunk(r1 - r0, x + r0 * 2 * J, J, w + 32 * h, j0, j1, acc + r0 * kTile + 16 * h, b == 0 && h == 0);
      r0 = r1;
    }
  }
  for (int64_t r = 0; r < M; ++r) std::memcpy(yt + r * O, acc + r * kTile, kTile * sizeof(float));
}

// ---- AVX-512F: the same FMAs, twice the lanes, for 3+ rows ------------------------------------
constexpr int64_t kMaxBlockRows512 = 12;  // 24 accumulators + 4 weight vectors + 2 broadcasts

template <int R>
PEAGLE_AVX512 static void rows_chunk512(const float* x, int64_t J, const uint16_t* w, int64_t j0, int64_t j1,
                                        float* acc, bool prefetch) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) { lo[r] = _mm512_loadu_ps(acc + r * kTile); hi[r] = _mm512_loadu_ps(acc + r * kTile + 16); }
  const __m512i mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t j = j0; j < j1; ++j) {
    const uint16_t* wj = w + j * kPairStride;
    if (prefetch) prefetch_ahead(wj);
    const __m512i v0 = _mm512_loadu_si512(wj), v1 = _mm512_loadu_si512(wj + 32);
    const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)), o0 = _mm512_castsi512_ps(_mm512_and_si512(v0, mask));
    const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16)), o1 = _mm512_castsi512_ps(_mm512_and_si512(v1, mask));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 s0 = _mm512_set1_ps(x[r * 2 * J + 2 * j]), s1 = _mm512_set1_ps(x[r * 2 * J + 2 * j + 1]);
      lo[r] = _mm512_fmadd_ps(s0, e0, _mm512_fmadd_ps(s1, o0, lo[r]));
      hi[r] = _mm512_fmadd_ps(s0, e1, _mm512_fmadd_ps(s1, o1, hi[r]));
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) { _mm512_storeu_ps(acc + r * kTile, lo[r]); _mm512_storeu_ps(acc + r * kTile + 16, hi[r]); }
}

PEAGLE_AVX512 static void rows_chunk512(int64_t R, const float* x, int64_t J, const uint16_t* w, int64_t j0,
                                        int64_t j1, float* acc, bool prefetch) {
  switch (R) {
    case 1: return rows_chunk512<1>(x, J, w, j0, j1, acc, prefetch);
    case 2: return rows_chunk512<2>(x, J, w, j0, j1, acc, prefetch);
    case 3: return rows_chunk512<3>(x, J, w, j0, j1, acc, prefetch);
    case 4: return rows_chunk512<4>(x, J, w, j0, j1, acc, prefetch);
    case 5: return rows_chunk512<5>(x, J, w, j0, j1, acc, prefetch);
    case 6: return rows_chunk512<6>(x, J, w, j0, j1, acc, prefetch);
    case 7: return rows_chunk512<7>(x, J, w, j0, j1, acc, prefetch);
    case 8: return rows_chunk512<8>(x, J, w, j0, j1, acc, prefetch);
    case 9: return rows_chunk512<9>(x, J, w, j0, j1, acc, prefetch);
    case 10: return rows_chunk512<10>(x, J, w, j0, j1, acc, prefetch);
    case 11: return rows_chunk512<11>(x, J, w, j0, j1, acc, prefetch);
    default: return rows_chunk512<12>(x, J, w, j0, j1, acc, prefetch);
  }
}

// ---- AVX512-BF16: dot products of bf16 pairs, every row count --------------------------------
// VDPBF16PS takes a lane's two products in the FMA loops' order (per the ISA: acc += odd pair's
// product, then acc += even pair's, each rounded once, denormals flushed), and a bf16 x bf16
// product is exact in float32, so it gives the FMA loops' bits (tested) with no widening of the
// weights and half the instructions per row. The rows come as bf16 pairs (as for AMX).
constexpr int64_t kMaxBlockRowsDp = 14;  // 28 accumulators + 2 weight vectors + 1 broadcast

template <int R>
PEAGLE_DPBF16 static void rows_chunk_dp(const uint32_t* xp, int64_t J, const uint16_t* w, int64_t j0, int64_t j1,
                                        float* acc, bool prefetch) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) { lo[r] = _mm512_loadu_ps(acc + r * kTile); hi[r] = _mm512_loadu_ps(acc + r * kTile + 16); }
  for (int64_t j = j0; j < j1; ++j) {
    const uint16_t* wj = w + j * kPairStride;
    if (prefetch) prefetch_ahead(wj);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wj), w1 = (__m512bh)_mm512_loadu_si512(wj + 32);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh s = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r * J + j]));
      lo[r] = _mm512_dpbf16_ps(lo[r], s, w0);
      hi[r] = _mm512_dpbf16_ps(hi[r], s, w1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) { _mm512_storeu_ps(acc + r * kTile, lo[r]); _mm512_storeu_ps(acc + r * kTile + 16, hi[r]); }
}

PEAGLE_DPBF16 static void rows_chunk_dp(int64_t R, const uint32_t* xp, int64_t J, const uint16_t* w, int64_t j0,
                                        int64_t j1, float* acc, bool prefetch) {
  switch (R) {
    case 1: return rows_chunk_dp<1>(xp, J, w, j0, j1, acc, prefetch);
    case 2: return rows_chunk_dp<2>(xp, J, w, j0, j1, acc, prefetch);
    case 3: return rows_chunk_dp<3>(xp, J, w, j0, j1, acc, prefetch);
    case 4: return rows_chunk_dp<4>(xp, J, w, j0, j1, acc, prefetch);
    case 5: return rows_chunk_dp<5>(xp, J, w, j0, j1, acc, prefetch);
    case 6: return rows_chunk_dp<6>(xp, J, w, j0, j1, acc, prefetch);
    case 7: return rows_chunk_dp<7>(xp, J, w, j0, j1, acc, prefetch);
    case 8: return rows_chunk_dp<8>(xp, J, w, j0, j1, acc, prefetch);
    case 9: return rows_chunk_dp<9>(xp, J, w, j0, j1, acc, prefetch);
    case 10: return rows_chunk_dp<10>(xp, J, w, j0, j1, acc, prefetch);
    case 11: return rows_chunk_dp<11>(xp, J, w, j0, j1, acc, prefetch);
    case 12: return rows_chunk_dp<12>(xp, J, w, j0, j1, acc, prefetch);
    case 13: return rows_chunk_dp<13>(xp, J, w, j0, j1, acc, prefetch);
    default: return rows_chunk_dp<14>(xp, J, w, j0, j1, acc, prefetch);
  }
}

// Rows [0, M) (M <= kMaxRows) of one tile with 512-bit loops, `chunk` summing R rows over the
// pairs j0 .. j1 into acc (rows_chunk512, rows_chunk_dp). One block (M <= kBlock) streams the
// tile once with its sums in registers; more rows go chunk by chunk, each chunk (in L1) serving
// every block before the next is read. Row r's inputs start at x + r * row_stride.
template <int64_t kBlock, typename In, typename Chunk>
static void rows_tile_blocked(int64_t M, const In* x, int64_t row_stride, int64_t J, const uint16_t* w, float* yt,
                              int64_t O, Chunk chunk) {
  alignas(64) float acc[kMaxRows * kTile];
  std::memset(acc, 0, sizeof(float) * M * kTile);
  const int64_t blocks = (M + kBlock - 1) / kBlock;
  const int64_t step = blocks == 1 ? J : kChunk;
  for (int64_t j0 = 0; j0 < J; j0 += step) {
    const int64_t j1 = std::min(J, j0 + step);
    for (int64_t b = 0, r0 = 0; b < blocks; ++b) {
      const int64_t r1 = (b + 1) * M / blocks;
      chunk(r1 - r0, x + r0 * row_stride, J, w, j0, j1, acc + r0 * kTile, b == 0);
      r0 = r1;
    }
  }
  for (int64_t r = 0; r < M; ++r) std::memcpy(yt + r * O, acc + r * kTile, kTile * sizeof(float));
}

// Rows [0, M) (M <= kMaxRows) of one tile with the bf16 dot products (see rows_tile_blocked).
static void rows_tile_dp(int64_t M, const uint32_t* xp, int64_t J, const uint16_t* w, float* yt, int64_t O) {
  rows_tile_blocked<kMaxBlockRowsDp>(M, xp, J, J, w, yt, O,
                                     [](int64_t R, const uint32_t* x, int64_t J, const uint16_t* w, int64_t j0,
                                        int64_t j1, float* acc, bool prefetch) {
                                       rows_chunk_dp(R, x, J, w, j0, j1, acc, prefetch);
                                     });
}

// Tiles [t0, t1) of one call with the bf16 dot products, rows in groups of at most kMaxRows.
static void dp_tiles(int64_t t0, int64_t t1, int64_t M, int64_t J, int64_t O, const uint32_t* xp,
                     const uint16_t* W, float* y) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t r0 = 0; r0 < M; r0 += kMaxRows)
      rows_tile_dp(std::min(M, r0 + kMaxRows) - r0, xp + r0 * J, J, W + t * J * kPairStride, y + r0 * O + t * kTile, O);
}

// ---- AMX: tile dot products, every row count ------------------------------------------------
// Where the CPU has AMX-BF16 (and Linux grants the tile state), every call runs on the tiles:
// a [rows <= 16, 16 pairs] tile of the inputs times two [16 pairs, 16 columns] tiles of the
// packed weights (the same bytes, read with a 128-byte row stride) into two [rows, 16] float32
// accumulator tiles. TDPBF16PS rounds its sums its own way (not as the FMA loops do), but it
// computes each output row from its input row alone, so a row's bits still do not depend on
// the rows beside it; a host with AMX runs every row count here.
using peagle::amx_configure;
using peagle::amx_release;

// Rows [0, M) (M <= 16, tiles configured for M rows) of one tile, all pairs.
PEAGLE_AMX static void amx_tile(const uint32_t* xp, int64_t J, const uint16_t* w, float* yt, int64_t O) {
  _tile_zero(3);
  _tile_zero(4);
  for (int64_t j = 0; j < J; j += 16) {
    const uint16_t* wj = w + j * kPairStride;
    prefetch_ahead(wj);
    _tile_loadd(0, xp + j, J * 4);
    _tile_loadd(1, wj, kPairStride * 2);
    _tile_loadd(2, wj + kTile, kPairStride * 2);
    _tile_dpbf16ps(3, 0, 1);
    _tile_dpbf16ps(4, 0, 2);
  }
  _tile_stored(3, yt, O * 4);
  _tile_stored(4, yt + 16, O * 4);
}

// Which loops run here (cpu_features.h): 2 = AMX, 3 = AVX512-BF16 dot products, 1 = AVX-512F
// FMAs for 3+ rows, 0 = AVX2 only.
extern "C" int peagle_gemv_loop_set() { return peagle::loop_set(); }  // for kernels_cpu.instruction_set

// Rows [0, M) (M <= kMaxRows) of one tile with the AVX-512F FMAs (see rows_tile_blocked).
static void rows_tile512(int64_t M, const float* x, int64_t J, const uint16_t* w, float* yt, int64_t O) {
  rows_tile_blocked<kMaxBlockRows512>(M, x, 2 * J, J, w, yt, O,
                                      [](int64_t R, const float* x, int64_t J, const uint16_t* w, int64_t j0,
                                         int64_t j1, float* acc, bool prefetch) {
                                        rows_chunk512(R, x, J, w, j0, j1, acc, prefetch);
                                      });
}

// Tiles [t0, t1) of one call with the FMA loops, rows in groups of at most kMaxRows.
static void fma_tiles(int64_t t0, int64_t t1, int64_t M, int64_t J, int64_t O, const float* x, const uint16_t* W,
                      float* y, bool wide) {
  for (int64_t t = t0; t < t1; ++t) {
    const uint16_t* w = W + t * J * kPairStride;
    float* yt = y + t * kTile;
    for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
      const int64_t m = std::min(M, r0 + kMaxRows) - r0;
      const float* xr = x + r0 * 2 * J;
      if (wide && m >= 3) rows_tile512(m, xr, J, w, yt + r0 * O, O);
      else if (m == 1) pair_tile<false>(xr, xr, w, J, yt + r0 * O, yt + r0 * O);
      else if (m == 2) pair_tile<true>(xr, xr + 2 * J, w, J, yt + r0 * O, yt + (r0 + 1) * O);
      else rows_tile(m, xr, J, w, yt + r0 * O, O);
    }
  }
}

// Rows per pass over a span of tiles: their bf16 pairs (256 rows of a 896-input call: 460 KB)
// stay in L2 while each tile's weights (J pairs x 32 columns: 57 KB there) serve all of them.
// Row blocks outermost instead streamed every weight of the span once per 16 rows: a 2048-row
// prefill read each matrix 128 times, and ran at a fifth of the tiles' rate.
constexpr int64_t kAmxRowChunk = 256;

// Tiles [t0, t1) of one call on AMX, rows in blocks of 16 (the tiles' rows), then the rows left.
// Each output row is computed from its input row alone, in the same order, whatever the blocking.
static void amx_tiles(int64_t t0, int64_t t1, int64_t M, int64_t J, int64_t O, const uint32_t* xp,
                      const uint16_t* W, float* y) {
  const int64_t full = M / 16 * 16;
  if (full > 0) {
    amx_configure(16);
    for (int64_t c0 = 0; c0 < full; c0 += kAmxRowChunk) {
      const int64_t c1 = std::min(full, c0 + kAmxRowChunk);
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t r0 = c0; r0 < c1; r0 += 16)
          amx_tile(xp + r0 * J, J, W + t * J * kPairStride, y + r0 * O + t * kTile, O);
    }
  }
  if (full < M) {
    amx_configure(M - full);
    for (int64_t t = t0; t < t1; ++t) amx_tile(xp + full * J, J, W + t * J * kPairStride, y + full * O + t * kTile, O);
  }
  amx_release();
}

// One call's work: spans of output tiles, shared out as spans.h says.
struct Job {
  int64_t M, J, O, tiles;
  peagle::Spans spans;
  std::vector<float> x;      // the FMA loops: the rows widened to float32 once, padded to 2 * J inputs
  std::vector<uint32_t> xp;  // AMX: the rows as bf16 pairs, padded to J pairs
  const uint16_t* W;
  float* y;                  // float32 sums: the result, or `sums` when the result is bf16
  std::unique_ptr<float[]> sums;  // not zeroed: every tile's sums are stored before they are read
  uint16_t* yb = nullptr;    // the bf16 result, if asked for: each span rounds its own columns

  void Tiles(int64_t t0, int64_t t1, int set) {
    if (set == 2) amx_tiles(t0, t1, M, J, O, xp.data(), W, y);
    else if (set == 3) dp_tiles(t0, t1, M, J, O, xp.data(), W, y);
    else fma_tiles(t0, t1, M, J, O, x.data(), W, y, set == 1);
    if (yb != nullptr)
      for (int64_t m = 0; m < M; ++m) peagle::to_bf16(y + m * O + t0 * kTile, yb + m * O + t0 * kTile, (t1 - t0) * kTile);
  }

  void Work() {
    const int set = peagle::loop_set();
    if (set == 2) {
      spans.Claim([&](int64_t t0, int64_t t1) { Tiles(t0, t1, set); });
      return;
    }
    // The FMA loops flush denormals (FTZ | DAZ), on this thread, for this call.
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u);
    spans.Claim([&](int64_t t0, int64_t t1) { Tiles(t0, t1, set); });
    _mm_setcsr(csr);
  }
};

// y = x @ W in float32 (y32) or rounded to bf16 (yb16); exactly one of the two is given. With
// `glu`, x is [M, 2I] (a SwiGLU MLP's gate and up projections side by side) and the product is
// taken of its rows' SiLU(gate) * up in bf16 (vmath.h), which spares XLA that elementwise pass.
static ffi::Error Gemv(ffi::ThreadPool& pool, ffi::Buffer<ffi::BF16>& x, ffi::Buffer<ffi::BF16>& w, float* y32,
                       uint16_t* yb16, bool glu = false) {
  auto xd = x.dimensions(), wd = w.dimensions();
  const int64_t I = xd.size() == 2 ? (glu ? xd[1] / 2 : xd[1]) : 0;
  if (xd.size() != 2 || (glu && xd[1] % 2 != 0) || wd.size() != 3 || wd[2] != 2 * kTile ||
      wd[1] != ((I + 1) / 2 + 15) / 16 * 16)
    return ffi::Error::InvalidArgument("gemv_bf16: x [M, I] (gated: [M, 2I]) and packed w [O/32, J, 64] expected, "
                                       "J = ceil(I / 2) rounded up to a multiple of 16");
  auto job = std::make_shared<Job>();
  job->M = xd[0]; job->J = wd[1]; job->tiles = wd[0]; job->O = wd[0] * kTile;
  job->W = reinterpret_cast<const uint16_t*>(w.typed_data());
  if (y32 != nullptr) {
    job->y = y32;
  } else {
    job->sums.reset(new float[job->M * job->O]);
    job->y = job->sums.get();
    job->yb = yb16;
  }
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.typed_data());
  std::vector<uint16_t> gated;
  if (glu) {
    gated.resize(job->M * I);
    for (int64_t m = 0; m < job->M; ++m) peagle::silu_mul_bf16(xs + m * 2 * I, xs + m * 2 * I + I, gated.data() + m * I, I);
    xs = gated.data();
  }
  const int64_t width = 2 * job->J;  // inputs past I are zero (their packed weights are zero too)
  if (peagle::loop_set() >= 2) {
    // A row's bf16 values in order are its pairs already (little-endian: x[2j] in the low
    // half); only the pad past I is zeroed.
    job->xp.resize(job->M * job->J);
    for (int64_t m = 0; m < job->M; ++m) {
      uint32_t* row = job->xp.data() + m * job->J;
      std::memcpy(row, xs + m * I, I * sizeof(uint16_t));
      std::memset(reinterpret_cast<uint16_t*>(row) + I, 0, (2 * job->J - I) * sizeof(uint16_t));
    }
  } else {
    job->x.assign(job->M * width, 0.0f);
    for (int64_t m = 0; m < job->M; ++m)
      for (int64_t i = 0; i < I; ++i) {
        const uint32_t u = uint32_t(xs[m * I + i]) << 16;
        std::memcpy(&job->x[m * width + i], &u, 4);
      }
  }
  const int64_t workers = peagle::tile_workers(pool, job->tiles);
  job->spans.Split(job->tiles, workers);
  peagle::RunSpans(pool, job, workers);
  return ffi::Error::Success();
}

static ffi::Error GemvBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                          ffi::ResultBuffer<ffi::F32> y) {
  return Gemv(pool, x, w, y->typed_data(), nullptr);
}

static ffi::Error GemvBf16ToBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                                 ffi::ResultBuffer<ffi::BF16> y) {
  return Gemv(pool, x, w, nullptr, reinterpret_cast<uint16_t*>(y->typed_data()));
}

static ffi::Error GemvGluBf16ToBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                                    ffi::ResultBuffer<ffi::BF16> y) {
  return Gemv(pool, x, w, nullptr, reinterpret_cast<uint16_t*>(y->typed_data()), true);
}

static ffi::Error GemvLayer(ffi::ThreadPool& pool, ffi::Buffer<ffi::BF16>& x, ffi::Buffer<ffi::BF16>& stack,
                            ffi::Buffer<ffi::S32>& layer, float* y32, uint16_t* yb16, bool glu = false) {
  peagle::LayerOf<ffi::BF16> view(stack, layer);
  if (!view.ok()) return ffi::Error::InvalidArgument("gemv_bf16: stacked weights [L, O/32, J, 64] and a layer "
                                                     "index in [0, L) expected");
  auto w = view.buffer();
  return Gemv(pool, x, w, y32, yb16, glu);
}

// The three on layer `layer` of stacked weights [L, O/32, J, 64] (layer_view.h).
static ffi::Error GemvLayerBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                                ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  return GemvLayer(pool, x, w, layer, y->typed_data(), nullptr);
}

static ffi::Error GemvLayerBf16ToBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::BF16> y) {
  return GemvLayer(pool, x, w, layer, nullptr, reinterpret_cast<uint16_t*>(y->typed_data()));
}

static ffi::Error GemvLayerGluBf16ToBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                                         ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::BF16> y) {
  return GemvLayer(pool, x, w, layer, nullptr, reinterpret_cast<uint16_t*>(y->typed_data()), true);
}

#define PEAGLE_GEMV_LAYER_HANDLER(name, entry, out)                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, entry,                                              \
                                ffi::Ffi::Bind()                                          \
                                    .Ctx<ffi::ThreadPool>()                               \
                                    .Arg<ffi::Buffer<ffi::BF16>>()                        \
                                    .Arg<ffi::Buffer<ffi::BF16>>()                        \
                                    .Arg<ffi::Buffer<ffi::S32>>()                         \
                                    .Ret<ffi::Buffer<out>>());

PEAGLE_GEMV_LAYER_HANDLER(peagle_gemv_bf16_layer, GemvLayerBf16, ffi::F32)
PEAGLE_GEMV_LAYER_HANDLER(peagle_gemv_bf16_layer_to_bf16, GemvLayerBf16ToBf16, ffi::BF16)
PEAGLE_GEMV_LAYER_HANDLER(peagle_gemv_glu_bf16_layer_to_bf16, GemvLayerGluBf16ToBf16, ffi::BF16)

XLA_FFI_DEFINE_HANDLER_SYMBOL(peagle_gemv_glu_bf16_to_bf16, GemvGluBf16ToBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(peagle_gemv_bf16, GemvBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(peagle_gemv_bf16_to_bf16, GemvBf16ToBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
