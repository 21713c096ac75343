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
// A group's sum is taken over the integers widened to float32, then scaled once:
//   y[m, o] = sum_g scale[g, o] * sum_{i in g} x[m, i] q[i, o]  -  min[g, o] * sum_{i in g} x[m, i].
// Every row runs the same steps (its own accumulators, inputs in order), whatever the number of
// rows in the call: a row's result has the same bits in a 1-row decode step and a K+1-row verify,
// so speculative decoding stays token-identical to plain decoding. One AVX2 + FMA loop runs on
// every x86-64-v3 CPU (AVX-512 hosts included), so every host gives the same bits.
//
// Packed per 32-column tile, groups in input order, each group one record:
//   G4 record (768 bytes): 32 float32 scales, 32 float32 mins, then per input i of the group 16
//      bytes: byte b holds column b's q in its low nibble and column b + 16's in its high one.
//   G8 record (640 bytes): 32 float32 scales, then per input 32 int8 q, one per column.
// The packed weights are uint8 [O/32, I/group, record].
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>
#include "bf16.h"
#include "spans.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace {

constexpr int64_t kTile = 32;     // output columns per tile
constexpr int64_t kAhead = 1024;  // bytes prefetched ahead of the weights in use
constexpr int kBlock = 2;         // rows per pass: 8 group sums + 4 weight vectors + 2 broadcasts

struct G4 {
  static constexpr const char* kLayout = "gemv_g4: x [M, I] and packed w [O/32, I/32, 768] uint8 expected";
  static constexpr int64_t kGroup = 32, kInputBytes = 16, kHeader = 256, kRecord = kHeader + kGroup * kInputBytes;
  static constexpr bool kMin = true;
  // One input's 32 weights as float32, columns 0-7, 8-15, 16-23, 24-31.
  static inline void widen(const uint8_t* p, __m256 w[4]) {
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    const __m256i nibble = _mm256_set1_epi32(0xF);
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(lo, nibble));
    w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(hi, nibble));
    w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4));
    w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4));
  }
};

struct G8 {
  static constexpr const char* kLayout = "gemv_g8: x [M, I] and packed w [O/32, I/16, 640] uint8 expected";
  static constexpr int64_t kGroup = 16, kInputBytes = 32, kHeader = 128, kRecord = kHeader + kGroup * kInputBytes;
  static constexpr bool kMin = false;
  static inline void widen(const uint8_t* p, __m256 w[4]) {
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g)
      w[g] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * g))));
  }
};

// R rows (float32, row stride I; per-group sums of x, row stride G) times one tile: acc [R, 32].
template <class F, int R>
void tile_rows(const float* x, int64_t I, const float* xsum, int64_t G, const uint8_t* tile, float* acc) {
  __m256 a[R][4];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = tile + g * F::kRecord;
    const uint8_t* q = rec + F::kHeader;
    __m256 s[R][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) s[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < F::kGroup; ++k) {
      const uint8_t* qk = q + k * F::kInputBytes;
      if ((k * F::kInputBytes) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(qk) + kAhead, _MM_HINT_T0);
      __m256 w[4];
      F::widen(qk, w);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * I + g * F::kGroup + k);
        for (int c = 0; c < 4; ++c) s[r][c] = _mm256_fmadd_ps(xb, w[c], s[r][c]);
      }
    }
    const float* scale = reinterpret_cast<const float*>(rec);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 xs = _mm256_broadcast_ss(xsum + r * G + g);
      for (int c = 0; c < 4; ++c) {
        a[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(scale + 8 * c), s[r][c], a[r][c]);
        if constexpr (F::kMin) a[r][c] = _mm256_fnmadd_ps(_mm256_loadu_ps(scale + kTile + 8 * c), xs, a[r][c]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + r * kTile + 8 * c, a[r][c]);
}

// One call's work: spans of output tiles (spans.h).
template <class F>
struct Job {
  int64_t M, I, G, O, tiles;
  peagle::Spans spans;
  std::vector<float> x;     // the rows widened to float32 [M, I]
  std::vector<float> xsum;  // per row, per group: sum of its inputs, in input order [M, G]
  const uint8_t* Q;
  float* y;                 // float32 result, or `sums` when the result is bf16
  std::unique_ptr<float[]> sums;
  uint16_t* yb = nullptr;

  void Tiles(int64_t t0, int64_t t1) {
    alignas(64) float acc[kBlock * kTile];
    for (int64_t r0 = 0; r0 < M; r0 += kBlock) {
      const int64_t rows = std::min<int64_t>(M - r0, kBlock);
      for (int64_t t = t0; t < t1; ++t) {
        const uint8_t* tile = Q + t * G * F::kRecord;
        if (rows == 1) tile_rows<F, 1>(x.data() + r0 * I, I, xsum.data() + r0 * G, G, tile, acc);
        else tile_rows<F, 2>(x.data() + r0 * I, I, xsum.data() + r0 * G, G, tile, acc);
        for (int64_t r = 0; r < rows; ++r) std::memcpy(y + (r0 + r) * O + t * kTile, acc + r * kTile, sizeof(float) * kTile);
      }
    }
    if (yb != nullptr)
      for (int64_t m = 0; m < M; ++m) peagle::to_bf16(y + m * O + t0 * kTile, yb + m * O + t0 * kTile, (t1 - t0) * kTile);
  }

  void Work() { spans.Claim([&](int64_t t0, int64_t t1) { Tiles(t0, t1); }); }
};

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
  job->x.resize(M * I);
  job->xsum.assign(M * G, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    float* row = job->x.data() + m * I;
    for (int64_t i = 0; i < I; ++i) {
      const uint32_t u = uint32_t(xs[m * I + i]) << 16;
      std::memcpy(row + i, &u, 4);
    }
    if constexpr (F::kMin) {
      for (int64_t g = 0; g < G; ++g) {
        float s = 0.0f;
        for (int64_t k = 0; k < F::kGroup; ++k) s += row[g * F::kGroup + k];
        job->xsum[m * G + g] = s;
      }
    }
  }
  const int64_t workers = peagle::tile_workers(pool, job->tiles);
  job->spans.Split(job->tiles, workers);
  peagle::RunSpans(pool, job, workers);
  return ffi::Error::Success();
}

template <class F>
ffi::Error GemvGroupF32(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> w,
                        ffi::ResultBuffer<ffi::F32> y) {
  return GemvGroup<F>(pool, x, w, y->typed_data(), nullptr);
}

template <class F>
ffi::Error GemvGroupBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> w,
                         ffi::ResultBuffer<ffi::BF16> y) {
  return GemvGroup<F>(pool, x, w, nullptr, reinterpret_cast<uint16_t*>(y->typed_data()));
}

}  // namespace

#define PEAGLE_GROUP_HANDLER(name, impl, out)                                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl,                                               \
                                ffi::Ffi::Bind()                                          \
                                    .Ctx<ffi::ThreadPool>()                               \
                                    .Arg<ffi::Buffer<ffi::BF16>>()                        \
                                    .Arg<ffi::Buffer<ffi::U8>>()                          \
                                    .Ret<ffi::Buffer<out>>());

PEAGLE_GROUP_HANDLER(peagle_gemv_g4, GemvGroupF32<G4>, ffi::F32)
PEAGLE_GROUP_HANDLER(peagle_gemv_g4_to_bf16, GemvGroupBf16<G4>, ffi::BF16)
PEAGLE_GROUP_HANDLER(peagle_gemv_g8, GemvGroupF32<G8>, ffi::F32)
PEAGLE_GROUP_HANDLER(peagle_gemv_g8_to_bf16, GemvGroupBf16<G8>, ffi::BF16)
