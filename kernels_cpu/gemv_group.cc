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
// included; on AMX-INT8 hosts calls of 4+ rows take the same integer sums from tile dot products
// and the same float steps after them (below), so every host gives the same bits.
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
#include "amx.h"
#include "bf16.h"
#include "cpu_features.h"
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

// ---- AMX: the same integer sums on tiles ----------------------------------------------------
// Where the CPU has AMX-INT8 (cpu_features.h), calls of kAmxMinRows rows or more take the group
// sums from integer tile dot products. A row's 16-bit integer splits exactly as
// x16 = 128 * hi + lo (hi = x16 >> 7 in [-128, 127], lo = x16 & 127 in [0, 127], both signed
// bytes), so a group's sum is 128 * (hi . q) + (lo . q): two int32 sums, each exact, and so is
// their combination. A block of b <= 8 rows goes in as one tile of 2b rows, its hi bytes above
// its lo bytes, so one tile dot product per 16 columns gives both sums. The float steps after
// them are the AVX2 loop's, in its order (2^e * scale times the sum, then the min term), so a
// row has the same bits on either path, at every row count.
// Per group the tile's 32 columns are laid out once into the tiles' operand layout (4
// consecutive inputs of a column in one 32-bit lane) and serve every block of the call.
constexpr int64_t kAmxMinRows = 4;  // fewer rows: the AVX2 loop is faster (docs/cpu-kernels.md)
constexpr int64_t kAmxBlocksPerChunk = 32;  // blocks whose bytes and sums stay in L2 while a tile serves them

// The tiles: 0 a block's hi and lo bytes of one group [2b, group], 2 and 3 the group's weights for
// columns 0-15 and 16-31 [group / 4, 64 bytes], 4 and 5 their sums [2b, 16] int32.
PEAGLE_AMX_INT8 inline void amx_int8_configure(int64_t group, int64_t block) {
  peagle::TileConfig cfg{};
  cfg.palette = 1;
  const uint8_t r = static_cast<uint8_t>(2 * block);
  cfg.rows[0] = r; cfg.colsb[0] = static_cast<uint16_t>(group);
  for (int t = 2; t < 4; ++t) { cfg.rows[t] = static_cast<uint8_t>(group / 4); cfg.colsb[t] = 64; }
  for (int t = 4; t < 6; ++t) { cfg.rows[t] = r; cfg.colsb[t] = 64; }
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");  // see amx.h: GCC must keep the stores
  _tile_loadconfig(&cfg);
}

// One group record's weights in the tiles' operand layout: b[h][k / 4][16 columns][4] for the
// half h (columns 16h .. 16h + 15), byte k % 4 of a lane holding input k.
template <class F>
PEAGLE_AMX_INT8 inline void operand_layout(const uint8_t* q, uint8_t* b0, uint8_t* b1);

template <>
PEAGLE_AMX_INT8 inline void operand_layout<G4>(const uint8_t* q, uint8_t* b0, uint8_t* b1) {
  // Input pairs 2k and 2k + 1 are 64 consecutive bytes; a 16-bit unit u < 16 of their low
  // nibbles is (q[4k, u], q[4k + 1, u]), unit 16 + u is (q[4k + 2, u], q[4k + 3, u]); the high
  // nibbles hold columns 16-31 the same way. Lane c takes units c and 16 + c.
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i nibble = _mm512_set1_epi8(0xF);
  for (int64_t k = 0; k < G4::kGroup / 4; ++k) {
    const __m512i v = _mm512_loadu_si512(q + 64 * k);
    _mm512_storeu_si512(b0 + 64 * k, _mm512_permutexvar_epi16(order, _mm512_and_si512(v, nibble)));
    _mm512_storeu_si512(b1 + 64 * k, _mm512_permutexvar_epi16(order, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble)));
  }
}

template <>
PEAGLE_AMX_INT8 inline void operand_layout<G8>(const uint8_t* q, uint8_t* b0, uint8_t* b1) {
  // Input pair j is 64 bytes, 16-bit unit c = (q[2j, c], q[2j + 1, c]) for the 32 columns; lane c
  // of half h takes unit 16h + c of pair 2k, then of pair 2k + 1.
  const __m512i lower = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                         39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i upper = _mm512_add_epi16(lower, _mm512_set1_epi16(16));
  for (int64_t k = 0; k < G8::kGroup / 4; ++k) {
    const __m512i a = _mm512_loadu_si512(q + 128 * k), b = _mm512_loadu_si512(q + 128 * k + 64);
    _mm512_storeu_si512(b0 + 64 * k, _mm512_permutex2var_epi16(a, lower, b));
    _mm512_storeu_si512(b1 + 64 * k, _mm512_permutex2var_epi16(a, upper, b));
  }
}

// One block's sums of one group, hi rows above lo rows, for each half: sums[2][2b][16] int32
// (G4: q unsigned, G8: signed; the bytes are signed either way).
template <class F>
PEAGLE_AMX_INT8 inline void tile_sums(const int8_t* block, int64_t stride, int32_t* sums) {
  _tile_loadd(0, block, stride);
  _tile_zero(4);
  _tile_zero(5);
  if constexpr (F::kMin) {
    _tile_dpbsud(4, 0, 2);
    _tile_dpbsud(5, 0, 3);
  } else {
    _tile_dpbssd(4, 0, 2);
    _tile_dpbssd(5, 0, 3);
  }
  _tile_stored(4, sums, 64);
  _tile_stored(5, sums + 256, 64);
}

// One block's sums of one group (rows of the b-row block) into the accumulators: the AVX2
// loop's float steps (tile_rows), 16 columns at a time, so the same bits.
template <class F>
PEAGLE_AMX_INT8 inline void add_group(const int32_t* sums, int64_t b, const float* scale, int64_t rows,
                                      const float* pow2, const float* xsum, int64_t G, float* acc) {
  const __m512 scale_lo = _mm512_loadu_ps(scale), scale_hi = _mm512_loadu_ps(scale + 16);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 e = _mm512_set1_ps(pow2[r * G]);
    float* a = acc + r * kTile;
    const int32_t *h = sums + r * 16, *l = sums + (b + r) * 16;
    const __m512i s0 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(h), 7), _mm512_loadu_si512(l));
    const __m512i s1 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(h + 256), 7), _mm512_loadu_si512(l + 256));
    __m512 v0 = _mm512_fmadd_ps(_mm512_mul_ps(scale_lo, e), _mm512_cvtepi32_ps(s0), _mm512_loadu_ps(a));
    __m512 v1 = _mm512_fmadd_ps(_mm512_mul_ps(scale_hi, e), _mm512_cvtepi32_ps(s1), _mm512_loadu_ps(a + 16));
    if constexpr (F::kMin) {
      const __m512 xs = _mm512_set1_ps(xsum[r * G]);
      v0 = _mm512_fnmadd_ps(_mm512_loadu_ps(scale + kTile), xs, v0);
      v1 = _mm512_fnmadd_ps(_mm512_loadu_ps(scale + kTile + 16), xs, v1);
    }
    _mm512_storeu_ps(a, v0);
    _mm512_storeu_ps(a + 16, v1);
  }
}

// Rows [r0, r1) (whole blocks of b rows but the call's last; at most kAmxBlocksPerChunk blocks)
// times tile `tile`, into y [M, O] at the tile's columns. `bytes`: per block of b rows, 2b rows
// of I bytes (hi, then lo; a last block padded with zero rows). Pipelined by one step: while the
// tiles sum a block, the vector units add the previous block's sums and lay out the next
// group's weights (double buffers).
template <class F>
PEAGLE_AMX_INT8 void amx_tile_rows(int64_t r0, int64_t r1, int64_t b, const int8_t* bytes, int64_t I,
                                   const float* pow2, const float* xsum, int64_t G, const uint8_t* tile, float* y,
                                   int64_t O) {
  alignas(64) float acc[kAmxBlocksPerChunk * 8 * kTile];
  alignas(64) uint8_t w[2][2][F::kGroup / 4 * 64];
  alignas(64) int32_t sums[2][2 * 256];
  const int64_t rows = r1 - r0;
  std::memset(acc, 0, sizeof(float) * rows * kTile);
  operand_layout<F>(tile + F::kHeader, w[0][0], w[0][1]);
  int64_t last_g = -1, last_b = 0, cur = 0;
  auto add_last = [&](const int32_t* s) {
    const int64_t m = r0 + last_b;
    add_group<F>(s, b, reinterpret_cast<const float*>(tile + last_g * F::kRecord), std::min(b, rows - last_b),
                 pow2 + m * G + last_g, xsum + m * G + last_g, G, acc + last_b * kTile);
  };
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = tile + g * F::kRecord;
    _tile_loadd(2, w[g & 1][0], 64);
    _tile_loadd(3, w[g & 1][1], 64);
    for (int64_t b0 = 0; b0 < rows; b0 += b) {
      tile_sums<F>(bytes + (r0 + b0) * 2 * I + g * F::kGroup, I, sums[cur]);
      if (b0 == 0 && g + 1 < G) {
        _mm_prefetch(reinterpret_cast<const char*>(rec + F::kRecord) + kAhead, _MM_HINT_T0);
        operand_layout<F>(rec + F::kRecord + F::kHeader, w[(g + 1) & 1][0], w[(g + 1) & 1][1]);
      }
      if (last_g >= 0) add_last(sums[cur ^ 1]);
      last_g = g;
      last_b = b0;
      cur ^= 1;
    }
  }
  add_last(sums[cur ^ 1]);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(y + (r0 + r) * O, acc + r * kTile, sizeof(float) * kTile);
}

// One call's work: spans of output tiles (spans.h).
template <class F>
struct Job {
  int64_t M, I, G, O, tiles;
  peagle::Spans spans;
  std::vector<uint32_t> xp;  // the rows as 16-bit integer pairs [M, I/2]
  std::vector<float> pow2;   // per row, per group: the power of two x16 counts in [M, G]
  std::vector<float> xsum;   // per row, per group: 2^e * sum x16 (G4's min term) [M, G]
  int64_t amx_block = 0;     // the integer sums on AMX tiles, in blocks of this many rows (0: AVX2), from
  std::vector<int8_t> bytes;  // per block its rows' x16 >> 7, then their x16 & 127 [M / block, 2 * block, I]
  const uint8_t* Q;
  float* y;                  // float32 result, or `sums` when the result is bf16
  std::unique_ptr<float[]> sums;
  uint16_t* yb = nullptr;

  // Tile by tile, every row block over the tile while it is in cache: a long call (a prompt's
  // prefill) reads each weight from memory once, not once per block of rows.
  void Tiles(int64_t t0, int64_t t1) {
    if (amx_block > 0) {
      AmxTiles(t0, t1);
    } else {
      AvxTiles(t0, t1);
    }
    if (yb != nullptr)
      for (int64_t m = 0; m < M; ++m) peagle::to_bf16(y + m * O + t0 * kTile, yb + m * O + t0 * kTile, (t1 - t0) * kTile);
  }

  // Row chunks outermost, so a chunk's bytes stay in L2 while the span's tiles pass over them.
  PEAGLE_AMX_INT8 void AmxTiles(int64_t t0, int64_t t1) {
    amx_int8_configure(F::kGroup, amx_block);
    const int64_t chunk = kAmxBlocksPerChunk * amx_block;
    for (int64_t r0 = 0; r0 < M; r0 += chunk)
      for (int64_t t = t0; t < t1; ++t)
        amx_tile_rows<F>(r0, std::min(M, r0 + chunk), amx_block, bytes.data(), I, pow2.data(), xsum.data(), G,
                         Q + t * G * F::kRecord, y + t * kTile, O);
    _tile_release();
  }

  void AvxTiles(int64_t t0, int64_t t1) {
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
  if (M >= kAmxMinRows && peagle::amx_int8_usable()) {
    const int64_t b = std::min<int64_t>(M, 8), blocks = (M + b - 1) / b;
    job->amx_block = b;
    job->bytes.assign(blocks * 2 * b * I, 0);
    const int16_t* x16 = reinterpret_cast<const int16_t*>(job->xp.data());
    for (int64_t m = 0; m < M; ++m) {
      int8_t* hi = job->bytes.data() + ((m / b) * 2 * b + m % b) * I;
      int8_t* lo = hi + b * I;
      for (int64_t i = 0; i < I; ++i) {
        hi[i] = static_cast<int8_t>(x16[m * I + i] >> 7);
        lo[i] = static_cast<int8_t>(x16[m * I + i] & 127);
      }
    }
  }
  const int64_t workers = peagle::tile_workers(pool, job->tiles);
  job->spans.Split(job->tiles, workers);
  peagle::RunSpans(pool, job, workers);
  return ffi::Error::Success();
}

}  // namespace

PEAGLE_U8_WEIGHTS_HANDLERS(peagle_gemv_g4, GemvGroup<G4>)
PEAGLE_U8_WEIGHTS_HANDLERS(peagle_gemv_g8, GemvGroup<G8>)
