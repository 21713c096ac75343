// bf16 <-> float32 on AVX2, shared by the kernels.
#pragma once

#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace peagle {

// 8 bf16 -> 8 float32, exactly.
inline __m256 load8_bf16(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// 8 float32 -> 8 bf16, rounded to nearest even as XLA's convert rounds (so a kernel that rounds
// its own result gives the bits of its float32 result converted afterwards); a NaN stays a
// quiet NaN of the same sign.
inline void store8_bf16(uint16_t* p, __m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (f != f) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

inline void to_bf16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8_bf16(dst + i, _mm256_loadu_ps(src + i));
  for (; i < n; ++i) dst[i] = to_bf16(src[i]);
}

}  // namespace peagle
