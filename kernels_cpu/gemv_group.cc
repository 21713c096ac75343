// A target model's matmul for few rows on weights kept in their GGUF quantization, as XLA FFI
// custom calls (kernels_cpu; peagle_jax sends a quantized target's decode-sized matmuls here).
//
// A decode step of a real-size model streams every weight once, so its time is the weights'
// bytes over the memory bandwidth. Dequantized to bf16 a Q4_K_M file streams 2 bytes a weight;
// here its blocks stream as they are, about 0.75 (4-bit) or 1.25 (6- and 8-bit) bytes a weight.
// Two formats hold the file's numbers exactly (kernels_cpu.pack_gguf, docs/cpu-kernels.md):
//   G4: groups of 32 inputs, w = scale * q - min, q in [0, 15] (Q4_0, Q4_1, Q4_K: each 32-weight
//       block or sub-block of the file is one group, its scale and min products exact in float32);
//   G8: groups of 16 inputs, w = scale * q, q in [-128, 127] (Q8_0, Q6_K, Q5_0: symmetric blocks of
//       16 or 32 weights, Q6_K's 16-weight sub-blocks setting the group).
// The rows go in as 16-bit integers: per row and group, x = 2^e * x16 with e the smallest power
// that keeps |x16| < 2^14 (a bf16 row's values within 2^6 of the group's largest are exact; the
// rest round at 2^-14 of it). A group's sum is then taken in integers, exactly (VPMADDWD: two
// inputs of 8 columns a step, no float conversion of the weights), and scaled once:
//   y[m, o] = sum_g 2^e[m, g] * (scale[g, o] * sum_{i in g} x16[m, i] q[i, o]  -  min[g, o] * sum_{i in g} x16[m, i]).
// A row's steps depend on nothing but its own values (its exponent, its integer sums, then its
// float sums in group order), whatever the number of rows in the call: a row's result has the
// same bits in a 1-row decode step and a K+1-row verify, so speculative decoding stays
// token-identical to plain decoding. One AVX2 loop runs on every x86-64-v3 CPU, AVX-512 hosts
// included, so every host gives the same bits.
//
// Packed per 32-column tile, groups in input order, each group one record:
//   G4 record (768 bytes): 32 float32 scales, 32 float32 mins, then per input pair j of the group
//      32 bytes: byte 2c + e holds q[2j + e, c] in its low nibble and q[2j + e, c + 16] in its
//      high one (c < 16);
//   G8 record (640 bytes): 32 float32 scales, then per input pair 64 bytes: byte 2c + e holds
//      q[2j + e, c] (int8).
// The packed weights are uint8 [O/32, I/group, record].
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>
#include "bf16.h"
#include "spans.h"
#include "u8_weights.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace {

constexpr int64_t kTile = 32;     // output columns per tile
constexpr int64_t kAhead = 1024;  // bytes prefetched ahead of the weights in use
constexpr int kBlock = 2;         // rows per pass: 8 integer sums + 4 weight vectors + 2 broadcasts
constexpr int kXBits = 14;        // |x16| < 2^14: a group's integer sums stay below 2^31 (G8) and 2^24 (G4)

struct G4 {
  static constexpr const char* kLayout = "gemv_g4: x [M, I] and packed w [O/32, I/32, 768] uint8 expected";
  static constexpr int64_t kGroup = 32, kPairBytes = 32, kHeader = 256;
  static constexpr int64_t kRecord = kHeader + kGroup / 2 * kPairBytes;
  static constexpr bool kMin = true;
  // One input pair's 32 columns as 16-bit pairs (q[2j, c], q[2j + 1, c]): columns 0-7, 8-15, 16-23, 24-31.
  static inline void widen(const uint8_t* p, __m256i w[4]) {
    const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i hi = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
    const __m256i nibble = _mm256_set1_epi16(0xF);
    w[0] = _mm256_and_si256(lo, nibble);
    w[1] = _mm256_and_si256(hi, nibble);
    w[2] = _mm256_srli_epi16(lo, 4);
    w[3] = _mm256_srli_epi16(hi, 4);
  }
};

struct G8 {
  static constexpr const char* kLayout = "gemv_g8: x [M, I] and packed w [O/32, I/16, 640] uint8 expected";
  static constexpr int64_t kGroup = 16, kPairBytes = 64, kHeader = 128;
  static constexpr int64_t kRecord = kHeader + kGroup / 2 * kPairBytes;
  static constexpr bool kMin = false;
  static inline void widen(const uint8_t* p, __m256i w[4]) {
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g)
      w[g] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * g)));
  }
};

// R rows (16-bit input pairs, row stride I/2; per group the power 2^e and, for G4, 2^e * sum x16,
// row stride G) times one tile: acc [R, 32] float32.
template <class F, int R>
void tile_rows(const uint32_t* xp, int64_t I, const float* pow2, const float* xsum, int64_t G, const uint8_t* tile,
               float* acc) {
  constexpr int64_t kPairs = F::kGroup / 2;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kTile; ++c) acc[r * kTile + c] = 0.0f;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = tile + g * F::kRecord;
    const uint8_t* q = rec + F::kHeader;
    __m256i s[R][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) s[r][c] = _mm256_setzero_si256();
    for (int64_t j = 0; j < kPairs; ++j) {
      const uint8_t* qj = q + j * F::kPairBytes;
      if ((j * F::kPairBytes) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(qj) + kAhead, _MM_HINT_T0);
      __m256i w[4];
      F::widen(qj, w);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i xb = _mm256_set1_epi32(static_cast<int>(xp[r * (I / 2) + g * kPairs + j]));
        for (int c = 0; c < 4; ++c) s[r][c] = _mm256_add_epi32(s[r][c], _mm256_madd_epi16(w[c], xb));
      }
    }
    const float* scale = reinterpret_cast<const float*>(rec);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 e = _mm256_set1_ps(pow2[r * G + g]);
      const __m256 xs = _mm256_set1_ps(xsum[r * G + g]);
      for (int c = 0; c < 4; ++c) {
        float* a = acc + r * kTile + 8 * c;
        // 2^e * (scale * sum): the product by a power of two is exact, so this is one rounding
        __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(scale + 8 * c), e), _mm256_cvtepi32_ps(s[r][c]),
                                   _mm256_loadu_ps(a));
        if constexpr (F::kMin) v = _mm256_fnmadd_ps(_mm256_loadu_ps(scale + kTile + 8 * c), xs, v);
        _mm256_storeu_ps(a, v);
      }
    }
  }
}

// One call's work: spans of output tiles (spans.h).
template <class F>
struct Job {
  int64_t M, I, G, O, tiles;
  peagle::Spans spans;
  std::vector<uint32_t> xp;  // the rows as 16-bit integer pairs [M, I/2]
  std::vector<float> pow2;   // per row, per group: the power of two x16 counts in [M, G]
  std::vector<float> xsum;   // per row, per group: 2^e * sum x16 (G4's min term) [M, G]
  const uint8_t* Q;
  float* y;                  // float32 result, or `sums` when the result is bf16
  std::unique_ptr<float[]> sums;
  uint16_t* yb = nullptr;

  // Tile by tile, every row block over the tile while it is in cache: a long call (a prompt's
  // prefill) reads each weight from memory once, not once per block of rows.
  void Tiles(int64_t t0, int64_t t1) {
    alignas(64) float acc[kBlock * kTile];
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* tile = Q + t * G * F::kRecord;
      for (int64_t r0 = 0; r0 < M; r0 += kBlock) {
        const int64_t rows = std::min<int64_t>(M - r0, kBlock);
        const uint32_t* x = xp.data() + r0 * (I / 2);
        const float *p = pow2.data() + r0 * G, *xs = xsum.data() + r0 * G;
        if (rows == 1) tile_rows<F, 1>(x, I, p, xs, G, tile, acc);
        else tile_rows<F, 2>(x, I, p, xs, G, tile, acc);
        for (int64_t r = 0; r < rows; ++r) std::memcpy(y + (r0 + r) * O + t * kTile, acc + r * kTile, sizeof(float) * kTile);
      }
    }
    if (yb != nullptr)
      for (int64_t m = 0; m < M; ++m) peagle::to_bf16(y + m * O + t0 * kTile, yb + m * O + t0 * kTile, (t1 - t0) * kTile);
  }

  void Work() { spans.Claim([&](int64_t t0, int64_t t1) { Tiles(t0, t1); }); }
};

// One bf16 row's group as 16-bit integers: x = 2^e * x16, |x16| < 2^kXBits (rounded to nearest
// even); returns 2^e and, through `sum`, 2^e * sum x16 (exact: an integer below 2^24 times 2^e).
float to_x16(const uint16_t* x, int64_t n, int16_t* x16, float* sum) {
  float big = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = uint32_t(x[i] & 0x7FFF) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    big = std::max(big, v);
  }
  int exponent = 0;
  std::frexp(big, &exponent);  // big < 2^exponent (0 for a zero group)
  const float pow2 = std::ldexp(1.0f, exponent - kXBits), inverse = std::ldexp(1.0f, kXBits - exponent);
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = uint32_t(x[i]) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    x16[i] = static_cast<int16_t>(std::nearbyint(v * inverse));
    total += x16[i];
  }
  *sum = pow2 * static_cast<float>(total);
  return pow2;
}

template <class F>
ffi::Error GemvGroup(ffi::ThreadPool& pool, ffi::Buffer<ffi::BF16>& x, ffi::Buffer<ffi::U8>& w, float* y32,
                     uint16_t* yb16) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != F::kRecord || xd[1] != wd[1] * F::kGroup)
    return ffi::Error::InvalidArgument(F::kLayout);
  auto job = std::make_shared<Job<F>>();
  const int64_t M = xd[0], I = xd[1], G = wd[1];
  job->M = M; job->I = I; job->G = G; job->tiles = wd[0]; job->O = wd[0] * kTile;
  job->Q = reinterpret_cast<const uint8_t*>(w.typed_data());
  if (y32 != nullptr) {
    job->y = y32;
  } else {
    job->sums.reset(new float[M * job->O]);
    job->y = job->sums.get();
    job->yb = yb16;
  }
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.typed_data());
  job->xp.resize(M * I / 2);
  job->pow2.resize(M * G);
  job->xsum.resize(M * G);
  for (int64_t m = 0; m < M; ++m) {
    int16_t* row = reinterpret_cast<int16_t*>(job->xp.data() + m * I / 2);
    for (int64_t g = 0; g < G; ++g)
      job->pow2[m * G + g] = to_x16(xs + m * I + g * F::kGroup, F::kGroup, row + g * F::kGroup, &job->xsum[m * G + g]);
  }
  const int64_t workers = peagle::tile_workers(pool, job->tiles);
  job->spans.Split(job->tiles, workers);
  peagle::RunSpans(pool, job, workers);
  return ffi::Error::Success();
}

}  // namespace

PEAGLE_U8_WEIGHTS_HANDLERS(peagle_gemv_g4, GemvGroup<G4>)
PEAGLE_U8_WEIGHTS_HANDLERS(peagle_gemv_g8, GemvGroup<G8>)
