// A weight-only 7-bit GEMV/GEMM for few rows on x86 CPUs, as an XLA FFI custom call (kernels_cpu;
// peagle_jax sends a draft head's decode-sized matmuls here on CPU, models.options).
//
// A decode-sized matmul reads every weight once and does little arithmetic per byte, so its time
// is mostly the weights' bytes over the memory bandwidth. One byte per weight halves those bytes
// against bf16. A draft head's numerics never change which tokens speculative decoding emits
// (the target's verify decides), so its weights can be quantized where the target's must stay
// exact.
//
// Why 7 bits in a byte: a weight is stored as m = w7 + 64, w7 in [-63, 63] (per-column scale
// max |w| / 63). With AVX512-BF16, OR-ing 0x4300 onto a zero-extended m makes the bf16 number
// 128 + m exactly (exponent 2^7, m the 7 mantissa bits), so the bytes become VDPBF16PS operands
// in two instructions per 32 weights, with no conversion to float: a widening FMA loop (AVX2,
// kept for CPUs without AVX512-BF16) runs out of arithmetic before memory at 3 rows. The sums
// then carry 192 * sum(x) (or 64 * sum(x) in the FMA loop), subtracted before the scale:
//   y[m, o] = scale[o] * (sum_i x[m, i] * (c + w7[i, o]) - c * sum_i x[m, i]).
// On an AMX host the same bf16 weights go through tile dot products instead (tile_amx), 16 pairs
// at a time through an L1 buffer: at a draft pass's 4-8 rows the dot-product loop runs out of
// arithmetic there. Every row takes the same steps whatever the number of rows in the call, so a
// head's drafts do not depend on the batch beside them.
//
// Packed [O/32, 2 + J, 64] uint8, J = ceil(I/2): per 32-column tile, first the tile's 32 float32
// column scales (128 bytes, as 2 rows of 64), then per input pair j each column's two bytes
// m[2j, c], m[2j + 1, c] side by side (the bf16 kernel's pair layout, gemv_bf16.cc).
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>
#include "amx.h"
#include "bf16.h"
#include "spans.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace {

constexpr int64_t kTile = 32;       // output columns per tile
constexpr int64_t kPair = 2 * kTile;  // bytes per (tile, input pair)
constexpr int64_t kScaleRows = 2;   // 32 float32 scales = 2 rows of 64 bytes
constexpr int64_t kAhead = 2048;    // bytes prefetched ahead of the weights in use (32 pairs)
constexpr float kBiasDp = 192.0f;   // the dot-product loop's weights are 128 + m = 192 + w7
constexpr float kBiasFma = 64.0f;   // the FMA loop's weights are m = 64 + w7

// ---- AVX512-BF16: the bytes as bf16 pair operands ------------------------------------------------
#define PEAGLE_DPBF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))
constexpr int kBlockDp = 14;  // rows per pass: 28 accumulators + 2 weight vectors + 1 broadcast

template <int R>
PEAGLE_DPBF16 void rows_dp(const uint32_t* xp, int64_t J, const uint8_t* q, float* acc) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const __m512i exponent = _mm512_set1_epi16(0x4300);
  for (int64_t j = 0; j < J; ++j) {
    const uint8_t* qj = q + j * kPair;
    _mm_prefetch(reinterpret_cast<const char*>(qj) + kAhead, _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_or_si512(
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qj))), exponent);
    const __m512bh w1 = (__m512bh)_mm512_or_si512(
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qj + 32))), exponent);
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

PEAGLE_DPBF16 void rows_dp(int64_t R, const uint32_t* xp, int64_t J, const uint8_t* q, float* acc) {
  switch (R) {
    case 1: return rows_dp<1>(xp, J, q, acc);
    case 2: return rows_dp<2>(xp, J, q, acc);
    case 3: return rows_dp<3>(xp, J, q, acc);
    case 4: return rows_dp<4>(xp, J, q, acc);
    case 5: return rows_dp<5>(xp, J, q, acc);
    case 6: return rows_dp<6>(xp, J, q, acc);
    case 7: return rows_dp<7>(xp, J, q, acc);
    case 8: return rows_dp<8>(xp, J, q, acc);
    case 9: return rows_dp<9>(xp, J, q, acc);
    case 10: return rows_dp<10>(xp, J, q, acc);
    case 11: return rows_dp<11>(xp, J, q, acc);
    case 12: return rows_dp<12>(xp, J, q, acc);
    case 13: return rows_dp<13>(xp, J, q, acc);
    default: return rows_dp<14>(xp, J, q, acc);
  }
}

// ---- AMX: the bytes made bf16 in L1, then tile dot products ---------------------------------------
// On an AMX host the dot-product loop runs out of arithmetic before memory at a draft pass's 4-8
// rows (each row costs two VDPBF16PS per 64 bytes of weights). Here every 16 pairs of a tile (1 KiB
// of bytes) become 2 KiB of bf16 weights (128 + m, as above) in an L1 buffer, and one
// [rows, 16 pairs] x [16 pairs, 32 columns] tile product takes them for all rows at once. Needs
// J a multiple of 16 (the input tile's width); other widths keep the dot-product loop.
#define PEAGLE_AMX_Q7 __attribute__((target("avx512f,avx512bw,amx-tile,amx-bf16")))
constexpr int64_t kAmxPairs = 16;   // input pairs per tile product
constexpr int64_t kAmxRows = 16;    // rows per tile product

// Rows [0, rows) (tiles configured for them) of one tile: sums into acc [rows, 32].
PEAGLE_AMX_Q7 void tile_amx(const uint32_t* xp, int64_t J, const uint8_t* q, float* acc) {
  alignas(64) uint16_t w[kAmxPairs * kPair];  // 16 pairs x 32 columns x 2 bf16
  const __m512i exponent = _mm512_set1_epi16(0x4300);
  _tile_zero(3);
  _tile_zero(4);
  for (int64_t j = 0; j < J; j += kAmxPairs) {
    const uint8_t* qj = q + j * kPair;
#pragma GCC unroll 16
    for (int64_t p = 0; p < kAmxPairs; ++p) {
      const uint8_t* src = qj + p * kPair;
      _mm_prefetch(reinterpret_cast<const char*>(src) + kAhead, _MM_HINT_T0);
      _mm512_store_si512(w + p * kPair, _mm512_or_si512(
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), exponent));
      _mm512_store_si512(w + p * kPair + 32, _mm512_or_si512(
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32))), exponent));
    }
    // GCC does not treat the tile loads as reading `w`, and drops the stores above without this.
    __asm__ __volatile__("" : : "r"(w) : "memory");
    _tile_loadd(0, xp + j, J * 4);
    _tile_loadd(1, w, kPair * 2);
    _tile_loadd(2, w + kTile, kPair * 2);
    _tile_dpbf16ps(3, 0, 1);
    _tile_dpbf16ps(4, 0, 2);
  }
  _tile_stored(3, acc, kTile * 4);
  _tile_stored(4, acc + 16, kTile * 4);
}

// ---- AVX2 + FMA: the bytes widened to float32 ------------------------------------------------------
constexpr int kBlockFma = 2;  // rows per pass: 8 accumulators + 8 weight vectors + 2 broadcasts

// 8 columns' pairs (16 bytes) -> their even-input and odd-input weights m as float32.
static inline void split8(const uint8_t* p, __m256& even, __m256& odd) {
  const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  even = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)));
  odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 16));
}

template <int R>
void rows_fma(const float* x, int64_t J, const uint8_t* q, float* acc) {
  __m256 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < 4; ++g) a[r][g] = _mm256_setzero_ps();
  for (int64_t j = 0; j < J; ++j) {
    const uint8_t* qj = q + j * kPair;
    _mm_prefetch(reinterpret_cast<const char*>(qj) + kAhead, _MM_HINT_T0);
    __m256 e[4], o[4];
    for (int g = 0; g < 4; ++g) split8(qj + 16 * g, e[g], o[g]);
    for (int r = 0; r < R; ++r) {
      const __m256 s0 = _mm256_broadcast_ss(x + r * 2 * J + 2 * j), s1 = _mm256_broadcast_ss(x + r * 2 * J + 2 * j + 1);
      for (int g = 0; g < 4; ++g) a[r][g] = _mm256_fmadd_ps(s0, e[g], _mm256_fmadd_ps(s1, o[g], a[r][g]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < 4; ++g) _mm256_storeu_ps(acc + r * kTile + 8 * g, a[r][g]);
}

void rows_fma(int64_t R, const float* x, int64_t J, const uint8_t* q, float* acc) {
  if (R == 1) return rows_fma<1>(x, J, q, acc);
  return rows_fma<2>(x, J, q, acc);
}


extern "C" int peagle_gemv_loop_set();  // gemv_bf16.cc: 2 where the bf16 matmul runs on AMX tiles

enum class Loop { kFma, kDp, kAmx };

// The loop for a call with J input pairs: AMX tiles where the bf16 matmul uses them (and J fits
// the tiles), else the dot products where the CPU has AVX512-BF16, else the FMAs.
Loop loop_for(int64_t J) {
  if (!peagle::dot_products_allowed()) return Loop::kFma;
  return peagle_gemv_loop_set() == 2 && J % kAmxPairs == 0 ? Loop::kAmx : Loop::kDp;
}

// One call's work: spans of output tiles (spans.h).
struct Job {
  int64_t M, J, O, tiles;
  peagle::Spans spans;
  Loop loop;
  std::vector<uint32_t> xp;  // the dot-product loop: the rows as bf16 pairs
  std::vector<float> x;      // the FMA loop: the rows widened to float32
  std::vector<float> bias;   // per row: the loop's constant times sum(x)
  const uint8_t* Q;
  float* y;                  // float32 result, or `sums` when the result is bf16
  std::unique_ptr<float[]> sums;
  uint16_t* yb = nullptr;

  void Tiles(int64_t t0, int64_t t1) {
    const int64_t block = loop == Loop::kAmx ? kAmxRows : loop == Loop::kDp ? kBlockDp : kBlockFma;
    alignas(64) float acc[kAmxRows * kTile];
    for (int64_t r0 = 0; r0 < M; r0 += block) {
      const int64_t rows = std::min(M - r0, block);
      if (loop == Loop::kAmx) peagle::amx_configure(rows);
      for (int64_t t = t0; t < t1; ++t) {
        const uint8_t* tile = Q + t * (kScaleRows + J) * kPair;
        float scale[kTile];
        std::memcpy(scale, tile, sizeof(scale));
        const uint8_t* q = tile + kScaleRows * kPair;
        if (loop == Loop::kAmx) tile_amx(xp.data() + r0 * J, J, q, acc);
        else if (loop == Loop::kDp) rows_dp(rows, xp.data() + r0 * J, J, q, acc);
        else rows_fma(rows, x.data() + r0 * 2 * J, J, q, acc);
        for (int64_t r = 0; r < rows; ++r) {
          float* yr = y + (r0 + r) * O + t * kTile;
          for (int64_t c = 0; c < kTile; ++c) yr[c] = scale[c] * (acc[r * kTile + c] - bias[r0 + r]);
        }
      }
    }
    if (loop == Loop::kAmx) peagle::amx_release();
    if (yb != nullptr)
      for (int64_t m = 0; m < M; ++m) peagle::to_bf16(y + m * O + t0 * kTile, yb + m * O + t0 * kTile, (t1 - t0) * kTile);
  }

  void Work() { spans.Claim([&](int64_t t0, int64_t t1) { Tiles(t0, t1); }); }
};

// sum(x) of one bf16 row in float32, for the bias term: 16 lanes in two vectors, then one fixed
// tree, so a row's sum does not depend on the other rows. A scalar loop here (one add chain
// over every input value) cost ~35 us of a K=7 draft pass's down projection, before any thread
// started on the weights.
float row_sum(const uint16_t* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_add_ps(a0, peagle::load8_bf16(x + i));
    a1 = _mm256_add_ps(a1, peagle::load8_bf16(x + i + 8));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(a0, a1));
  float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; i < n; ++i) {
    const uint32_t u = uint32_t(x[i]) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    sum += v;
  }
  return sum;
}

ffi::Error GemvQ7(ffi::ThreadPool& pool, ffi::Buffer<ffi::BF16>& x, ffi::Buffer<ffi::U8>& w, float* y32,
                    uint16_t* yb16) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kPair || wd[1] != kScaleRows + (xd[1] + 1) / 2)
    return ffi::Error::InvalidArgument("gemv_q7: x [M, I] and packed w [O/32, 2 + ceil(I/2), 64] uint8 expected");
  auto job = std::make_shared<Job>();
  const int64_t I = xd[1], M = xd[0], J = wd[1] - kScaleRows;
  job->M = M; job->J = J; job->tiles = wd[0]; job->O = wd[0] * kTile;
  job->Q = reinterpret_cast<const uint8_t*>(w.typed_data());
  job->loop = loop_for(J);
  const bool pairs = job->loop != Loop::kFma;
  if (y32 != nullptr) {
    job->y = y32;
  } else {
    job->sums.reset(new float[M * job->O]);
    job->y = job->sums.get();
    job->yb = yb16;
  }
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.typed_data());
  job->bias.assign(M, 0.0f);
  if (pairs) job->xp.resize(M * J);
  else job->x.assign(M * 2 * J, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    if (pairs) {  // a row's bf16 values in order are its pairs already (x[2j] in the low half)
      uint32_t* row = job->xp.data() + m * J;
      std::memcpy(row, xs + m * I, I * sizeof(uint16_t));
      std::memset(reinterpret_cast<uint16_t*>(row) + I, 0, (2 * J - I) * sizeof(uint16_t));
    } else {
      for (int64_t i = 0; i < I; ++i) {
        const uint32_t u = uint32_t(xs[m * I + i]) << 16;
        std::memcpy(&job->x[m * 2 * J + i], &u, 4);
      }
    }
    job->bias[m] = (pairs ? kBiasDp : kBiasFma) * row_sum(xs + m * I, I);
  }
  const int64_t workers = peagle::tile_workers(pool, job->tiles);
  job->spans.Split(job->tiles, workers);
  peagle::RunSpans(pool, job, workers);
  return ffi::Error::Success();
}

ffi::Error GemvQ7F32(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> w,
                       ffi::ResultBuffer<ffi::F32> y) {
  return GemvQ7(pool, x, w, y->typed_data(), nullptr);
}

ffi::Error GemvQ7Bf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> w,
                        ffi::ResultBuffer<ffi::BF16> y) {
  return GemvQ7(pool, x, w, nullptr, reinterpret_cast<uint16_t*>(y->typed_data()));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(peagle_gemv_q7, GemvQ7F32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(peagle_gemv_q7_to_bf16, GemvQ7Bf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
