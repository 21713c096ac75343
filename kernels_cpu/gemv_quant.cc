// A weight-only 7-bit or 4-bit GEMV/GEMM for few rows on x86 CPUs, as XLA FFI custom calls
// (kernels_cpu; peagle_jax sends a draft head's decode-sized matmuls here on CPU, models.options).
//
// A decode-sized matmul reads every weight once and does little arithmetic per byte, so its time
// is mostly the weights' bytes over the memory bandwidth. One byte per weight halves those bytes
// against bf16, half a byte quarters them. A draft head's numerics never change which tokens
// speculative decoding emits (the target's verify decides), so its weights can be quantized where
// the target's must stay exact.
//
// Why 7 bits in a byte: a weight is stored as m = w7 + 64, w7 in [-63, 63] (per-column scale
// max |w| / 63). With AVX512-BF16, OR-ing 0x4300 onto a zero-extended m makes the bf16 number
// 128 + m exactly (exponent 2^7, m the 7 mantissa bits), so the bytes become VDPBF16PS operands
// in two instructions per 32 weights, with no conversion to float: a widening FMA loop (AVX2,
// kept for CPUs without AVX512-BF16) runs out of arithmetic before memory at 3 rows. The sums
// then carry 192 * sum(x) (or 64 * sum(x) in the FMA loop), subtracted before the scale:
//   y[m, o] = scale[o] * (sum_i x[m, i] * (c + w7[i, o]) - c * sum_i x[m, i]).
// 4 bits the same way: m = w4 + 8, w4 in [-7, 7], one nibble each, the bf16 number 128 + m =
// 136 + w4 (the FMA loop's m = 8 + w4); one more instruction (a shift) per 32 weights.
// On an AMX host the same bf16 weights go through tile dot products instead (tile_amx), 16 pairs
// at a time through an L1 buffer: at a draft pass's 4-8 rows the dot-product loop runs out of
// arithmetic there. Every row takes the same steps whatever the number of rows in the call, so a
// head's drafts do not depend on the batch beside them.
//
// Packed per 32-column tile, first the tile's 32 float32 column scales (128 bytes), then per
// input pair j the pair's weights of the 32 columns in the bf16 kernel's pair layout
// (gemv_bf16.cc: column c's two weights of inputs 2j, 2j + 1 side by side):
//   7 bits: [O/32, 2 + J, 64] uint8, J = ceil(I/2): the 64 bytes m[2j, c], m[2j + 1, c], c = 0..31.
//   4 bits: [O/32, 4 + J, 32] uint8: byte b = 2c + e (c = 0..15, e = 0, 1) holds m[2j + e, c] in its
//           low nibble and m[2j + e, c + 16] in its high one, so one widening gives both halves.
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>
#include "amx.h"
#include "bf16.h"
#include "cpu_features.h"
#include "spans.h"
#include "u8_weights.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace {

constexpr int64_t kTile = 32;        // output columns per tile
constexpr int64_t kScaleBytes = 128;  // a tile's 32 float32 scales
constexpr int64_t kAhead = 2048;     // bytes prefetched ahead of the weights in use
constexpr int64_t kPairBf16 = 2 * kTile;  // bf16 weights per (tile, input pair) once decoded

// The weight formats: their packed layout (for errors), bytes per (tile, input pair), the constants
// the sums carry, and the decoding of one input pair's 32 columns into bf16 pair operands (two
// vectors: columns 0-15 and 16-31) or into float32 (8 columns g, their even- and odd-input weights).
struct Q7 {
  static constexpr const char* kLayout = "gemv_q7: x [M, I] and packed w [O/32, 2 + ceil(I/2), 64] uint8 expected";
  static constexpr int64_t kPairBytes = 64;
  static constexpr float kBiasDp = 192.0f;  // the dot-product loops' weights are 128 + m = 192 + w7
  static constexpr float kBiasFma = 64.0f;  // the FMA loop's weights are m = 64 + w7
  static PEAGLE_AVX512BW PEAGLE_INLINE void bf16_pairs(const uint8_t* p, __m512i& w0, __m512i& w1) {
    const __m512i exponent = _mm512_set1_epi16(0x4300);
    w0 = _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), exponent);
    w1 = _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))),
                         exponent);
  }
  static inline __m256i widened16(const uint8_t* p, int g) {  // 16 bytes of columns 8g..8g+7
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * g)));
  }
};

struct Q4 {
  static constexpr const char* kLayout = "gemv_q4: x [M, I] and packed w [O/32, 4 + ceil(I/2), 32] uint8 expected";
  static constexpr int64_t kPairBytes = 32;
  static constexpr float kBiasDp = 136.0f;  // 128 + m = 136 + w4
  static constexpr float kBiasFma = 8.0f;   // m = 8 + w4
  static PEAGLE_AVX512BW PEAGLE_INLINE void bf16_pairs(const uint8_t* p, __m512i& w0, __m512i& w1) {
    const __m512i exponent = _mm512_set1_epi16(0x4300);
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    w0 = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi16(0x000F)), exponent);
    w1 = _mm512_or_si512(_mm512_srli_epi16(v, 4), exponent);
  }
  static inline __m256i widened16(const uint8_t* p, int g) {  // columns 8g..8g+7: nibbles of 16 bytes
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * (g & 1))));
    return g < 2 ? _mm256_and_si256(v, _mm256_set1_epi16(0x000F)) : _mm256_srli_epi16(v, 4);
  }
};

// ---- AVX512-BF16: the weights as bf16 pair operands ----------------------------------------------
constexpr int kBlockDp = 14;  // rows per pass: 28 accumulators + 2 weight vectors + 1 broadcast

template <class F, int R>
PEAGLE_DPBF16 void rows_dp(const uint32_t* xp, int64_t J, const uint8_t* q, float* acc) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < J; ++j) {
    const uint8_t* qj = q + j * F::kPairBytes;
    _mm_prefetch(reinterpret_cast<const char*>(qj) + kAhead, _MM_HINT_T0);
    __m512i w0, w1;
    F::bf16_pairs(qj, w0, w1);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh s = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r * J + j]));
      lo[r] = _mm512_dpbf16_ps(lo[r], s, (__m512bh)w0);
      hi[r] = _mm512_dpbf16_ps(hi[r], s, (__m512bh)w1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) { _mm512_storeu_ps(acc + r * kTile, lo[r]); _mm512_storeu_ps(acc + r * kTile + 16, hi[r]); }
}

template <class F>
PEAGLE_DPBF16 void rows_dp(int64_t R, const uint32_t* xp, int64_t J, const uint8_t* q, float* acc) {
  switch (R) {
    case 1: return rows_dp<F, 1>(xp, J, q, acc);
    case 2: return rows_dp<F, 2>(xp, J, q, acc);
    case 3: return rows_dp<F, 3>(xp, J, q, acc);
    case 4: return rows_dp<F, 4>(xp, J, q, acc);
    case 5: return rows_dp<F, 5>(xp, J, q, acc);
    case 6: return rows_dp<F, 6>(xp, J, q, acc);
    case 7: return rows_dp<F, 7>(xp, J, q, acc);
    case 8: return rows_dp<F, 8>(xp, J, q, acc);
    case 9: return rows_dp<F, 9>(xp, J, q, acc);
    case 10: return rows_dp<F, 10>(xp, J, q, acc);
    case 11: return rows_dp<F, 11>(xp, J, q, acc);
    case 12: return rows_dp<F, 12>(xp, J, q, acc);
    case 13: return rows_dp<F, 13>(xp, J, q, acc);
    default: return rows_dp<F, 14>(xp, J, q, acc);
  }
}

// ---- AMX: the weights made bf16 in L1, then tile dot products -------------------------------------
// On an AMX host the dot-product loop runs out of arithmetic before memory at a draft pass's 4-8
// rows (each row costs two VDPBF16PS per input pair of a tile). Here every 16 pairs of a tile
// become 2 KiB of bf16 weights (128 + m, as above) in an L1 buffer, and one
// [rows, 16 pairs] x [16 pairs, 32 columns] tile product takes them for all rows at once. Needs
// J a multiple of 16 (the input tile's width); other widths keep the dot-product loop.
constexpr int64_t kAmxPairs = 16;   // input pairs per tile product
constexpr int64_t kAmxRows = 16;    // rows per tile product

// One block of 16 input pairs of a tile, made bf16 pair operands in `w` (16 pairs x 32 columns).
template <class F>
PEAGLE_AMX_BW inline void decode_block(const uint8_t* qj, uint16_t* w) {
#pragma GCC unroll 16
  for (int64_t p = 0; p < kAmxPairs; ++p) {
    const uint8_t* src = qj + p * F::kPairBytes;
    if (p % (64 / F::kPairBytes) == 0) _mm_prefetch(reinterpret_cast<const char*>(src) + kAhead, _MM_HINT_T0);
    __m512i w0, w1;
    F::bf16_pairs(src, w0, w1);
    _mm512_store_si512(w + p * kPairBf16, w0);
    _mm512_store_si512(w + p * kPairBf16 + 32, w1);
  }
}

// Rows [0, rows) (tiles configured for them) of one tile: sums into acc [rows, 32]. Two buffers:
// a block is decoded while the tiles load the one before it, so a tile load never waits on the
// stores just issued (a tile load takes nothing from the store buffer).
template <class F>
PEAGLE_AMX_BW void tile_amx(const uint32_t* xp, int64_t J, const uint8_t* q, float* acc) {
  alignas(64) uint16_t w[2][kAmxPairs * kPairBf16];  // 2 x (16 pairs x 32 columns x 2 bf16)
  _tile_zero(3);
  _tile_zero(4);
  decode_block<F>(q, w[0]);
  for (int64_t j = 0, b = 0; j < J; j += kAmxPairs, b ^= 1) {
    if (j + kAmxPairs < J) decode_block<F>(q + (j + kAmxPairs) * F::kPairBytes, w[b ^ 1]);
    // GCC does not treat the tile loads as reading `w`, and drops the stores above without this.
    __asm__ __volatile__("" : : "r"(w) : "memory");
    _tile_loadd(0, xp + j, J * 4);
    _tile_loadd(1, w[b], kPairBf16 * 2);
    _tile_loadd(2, w[b] + kTile, kPairBf16 * 2);
    _tile_dpbf16ps(3, 0, 1);
    _tile_dpbf16ps(4, 0, 2);
  }
  _tile_stored(3, acc, kTile * 4);
  _tile_stored(4, acc + 16, kTile * 4);
}

// ---- AVX2 + FMA: the weights widened to float32 ----------------------------------------------------
constexpr int kBlockFma = 2;  // rows per pass: 8 accumulators + 8 weight vectors + 2 broadcasts

template <class F, int R>
void rows_fma(const float* x, int64_t J, const uint8_t* q, float* acc) {
  __m256 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < 4; ++g) a[r][g] = _mm256_setzero_ps();
  for (int64_t j = 0; j < J; ++j) {
    const uint8_t* qj = q + j * F::kPairBytes;
    _mm_prefetch(reinterpret_cast<const char*>(qj) + kAhead, _MM_HINT_T0);
    __m256 e[4], o[4];
    for (int g = 0; g < 4; ++g) {  // 8 columns' pairs -> their even-input and odd-input weights m
      const __m256i v = F::widened16(qj, g);
      e[g] = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)));
      o[g] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 16));
    }
    for (int r = 0; r < R; ++r) {
      const __m256 s0 = _mm256_broadcast_ss(x + r * 2 * J + 2 * j), s1 = _mm256_broadcast_ss(x + r * 2 * J + 2 * j + 1);
      for (int g = 0; g < 4; ++g) a[r][g] = _mm256_fmadd_ps(s0, e[g], _mm256_fmadd_ps(s1, o[g], a[r][g]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < 4; ++g) _mm256_storeu_ps(acc + r * kTile + 8 * g, a[r][g]);
}

template <class F>
void rows_fma(int64_t R, const float* x, int64_t J, const uint8_t* q, float* acc) {
  if (R == 1) return rows_fma<F, 1>(x, J, q, acc);
  return rows_fma<F, 2>(x, J, q, acc);
}


enum class Loop { kFma, kDp, kAmx };

// The loop for a call with J input pairs: AMX tiles where the bf16 matmul uses them (and J fits
// the tiles), else the dot products where the CPU has AVX512-BF16, else the FMAs.
Loop loop_for(int64_t J) {
  if (!peagle::dot_products_allowed()) return Loop::kFma;
  return peagle::loop_set() == 2 && J % kAmxPairs == 0 ? Loop::kAmx : Loop::kDp;  // 2: the bf16 matmul's AMX
}

// One call's work: spans of output tiles (spans.h), weights in format F.
template <class F>
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
        const uint8_t* tile = Q + t * (kScaleBytes + J * F::kPairBytes);
        float scale[kTile];
        std::memcpy(scale, tile, sizeof(scale));
        const uint8_t* q = tile + kScaleBytes;
        if (loop == Loop::kAmx) tile_amx<F>(xp.data() + r0 * J, J, q, acc);
        else if (loop == Loop::kDp) rows_dp<F>(rows, xp.data() + r0 * J, J, q, acc);
        else rows_fma<F>(rows, x.data() + r0 * 2 * J, J, q, acc);
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

// x [M, I] bf16 times packed F weights: [O/32, S, 64 or 32] uint8 with S * width = 128 + J * F::kPairBytes.
template <class F>
ffi::Error GemvQuant(ffi::ThreadPool& pool, ffi::Buffer<ffi::BF16>& x, ffi::Buffer<ffi::U8>& w, float* y32,
                     uint16_t* yb16) {
  constexpr int64_t width = F::kPairBytes, scale_rows = kScaleBytes / width;
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != width || wd[1] != scale_rows + (xd[1] + 1) / 2)
    return ffi::Error::InvalidArgument(F::kLayout);
  auto job = std::make_shared<Job<F>>();
  const int64_t I = xd[1], M = xd[0], J = wd[1] - scale_rows;
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
    job->bias[m] = (pairs ? F::kBiasDp : F::kBiasFma) * row_sum(xs + m * I, I);
  }
  const int64_t workers = peagle::tile_workers(pool, job->tiles);
  job->spans.Split(job->tiles, workers);
  peagle::RunSpans(pool, job, workers);
  return ffi::Error::Success();
}

}  // namespace

PEAGLE_U8_WEIGHTS_HANDLERS(peagle_gemv_q7, GemvQuant<Q7>)
PEAGLE_U8_WEIGHTS_HANDLERS(peagle_gemv_q4, GemvQuant<Q4>)
