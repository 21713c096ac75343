// Vector math on AVX2 + FMA shared by the kernels: exp for the attention's softmax weights, and
// the SiLU-gated product that feeds a SwiGLU MLP's down projection (gemv_bf16.cc).
#pragma once

#include <immintrin.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "bf16.h"
#include "cpu_features.h"

namespace peagle {

// exp(x) for x <= 0 (Cephes' polynomial, about 1 ulp); inputs below -87 give ~1e-38, not 0.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// float32 -> the float32 value of its bf16 rounding (to nearest even, as store8_bf16; a NaN
// stays a quiet NaN), in registers.
inline __m256 round8_bf16(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), hi);
  const __m256i quiet = _mm256_or_si256(_mm256_and_si256(u, hi), _mm256_set1_epi32(0x400000));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q))));
}

// SiLU(g) * u on 8 bf16 values, as a bf16 model computes `jax.nn.silu(gate) * up`: SiLU in float32
// rounded to bf16, then the product rounded to bf16. The sigmoid takes exp of -|g| only (exp8's
// range), so no input overflows.
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 neg_abs = _mm256_or_ps(g, _mm256_set1_ps(-0.0f));  // -|g| (a NaN stays NaN)
  const __m256 t = exp8(neg_abs);                                 // exp(-|g|) in (0, 1]
  const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, t));   // sigmoid(|g|)
  const __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(t, inv), _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ));
  return round8_bf16(_mm256_mul_ps(round8_bf16(_mm256_mul_ps(g, sig)), u));
}

// ---- the same steps on 16 lanes (AVX-512F), bit for bit --------------------------------------------
PEAGLE_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// round8_bf16 on 16 lanes, the result's bits in the high halves.
PEAGLE_AVX512 inline __m512 round16_bf16(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), hi);
  const __m512i quiet = _mm512_or_si512(_mm512_and_si512(u, hi), _mm512_set1_epi32(0x400000));
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), r, quiet));
}

PEAGLE_AVX512 inline __m512 load16_bf16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// 16 float32 -> 16 bf16, rounded as store8_bf16.
PEAGLE_AVX512 inline void store16_bf16(uint16_t* p, __m512 f) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round16_bf16(f)), 16)));
}

PEAGLE_AVX512 inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 neg_abs = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(g), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
  const __m512 t = exp16(neg_abs);
  const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, t));
  const __m512 sig = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), inv, _mm512_mul_ps(t, inv));
  return round16_bf16(_mm512_mul_ps(round16_bf16(_mm512_mul_ps(g, sig)), u));
}

// 16 values at a time; the result is rounded already, so its high halves are the bf16 bits.
PEAGLE_AVX512 inline void silu_mul_bf16_512(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i + 16 <= n; i += 16) {
    const __m512 h = silu_mul16(load16_bf16(gate + i), load16_bf16(up + i));  // rounded already
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(h), 16)));
  }
}

// out[i] = bf16(SiLU(gate[i]) * up[i]) for n values: 16 lanes where the CPU has AVX-512F (and
// PEAGLE_CPU_KERNEL_AVX2 is unset), then 8;
// a tail shorter than 8 goes through the same vector steps (zero-padded). Every lane and width
// takes the same steps, so every position gets the same function on every x86 host.
inline void silu_mul_bf16(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
  int64_t i = 0;
  if (avx512_allowed()) {
    silu_mul_bf16_512(gate, up, out, n);
    i = n / 16 * 16;
  }
  for (; i + 8 <= n; i += 8) store8_bf16(out + i, silu_mul8(load8_bf16(gate + i), load8_bf16(up + i)));
  if (i < n) {
    alignas(16) uint16_t g[8] = {}, u[8] = {}, o[8];
    std::memcpy(g, gate + i, (n - i) * sizeof(uint16_t));
    std::memcpy(u, up + i, (n - i) * sizeof(uint16_t));
    store8_bf16(o, silu_mul8(load8_bf16(g), load8_bf16(u)));
    std::memcpy(out + i, o, (n - i) * sizeof(uint16_t));
  }
}

}  // namespace peagle
