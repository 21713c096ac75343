// Cache attention for few query rows on AVX2+FMA CPUs, as an XLA FFI custom call (kernels_cpu;
// `kernels_pallas.cache_attention` picks it on CPU for bf16 caches, implementation "cpu").
//
// out[b, t, h] = softmax_s(q[b, t, h] . k[b, kvh, s] * scale) @ v[b, kvh, s], over the cache rows
// s <= pos[b, t] outside the hidden window [lo[b, t], hi[b, t]), kvh = h / (H / KVH).
//
// Why a kernel: XLA:CPU ran the blockwise reference as a loop of tiny batched products, about
// 0.14 ms per layer for one query row at 256 cached positions (a fifth of a SmolLM2 decode step)
// and 0.85 ms at 4 sequences x 4 rows. Here every query row is one pass over its visible keys.
//
// Exactness: each query row is computed alone, by the same instructions whatever else is in the
// call, and its sums run over its visible keys in increasing position, indexed by the order they
// are visited rather than by where they lie. So a row's result does not depend on the number of
// rows (decode step vs verify), on how far other rows reach, or on where its keys sit in the
// cache (a tree verify's second chain, which skips the first chain's rows, gets the bits of the
// same row at its natural place). peagle_jax's exact speculation rests on that.
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// 8 bf16 -> 8 float32, exactly.
inline __m256 load8_bf16(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// Sum of the 8 lanes, in a fixed order.
inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

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

constexpr int64_t kMaxHeadDim = 256;

struct Problem {
  int64_t B, T, H, KVH, S, D;
  float scale;
  const uint16_t *q, *k, *v;
  const int32_t *pos, *lo, *hi;
  float* out;
};

constexpr int64_t kMaxGroup = 16;  // query heads per kv head

// The G query heads of kv head `kvh` at row (b, t): scores of their visible keys in visit order,
// their softmax, then the weighted sum of the values. The G heads share each key and value as it
// is widened; every head's sums still run over the keys one by one in visit order.
// `scores` holds at least G * (S + 8) floats, `keys` S ints.
void attend_group(const Problem& p, int64_t item, float* scores, int32_t* keys) {
  const int64_t D = p.D, G = p.H / p.KVH, kvh = item % p.KVH, bt = item / p.KVH, b = bt / p.T;
  const int64_t stride = p.S + 8;
  const uint16_t* qr = p.q + (bt * p.H + kvh * G) * D;
  const uint16_t* kb = p.k + (b * p.KVH + kvh) * p.S * D;
  const uint16_t* vb = p.v + (b * p.KVH + kvh) * p.S * D;
  float* out = p.out + (bt * p.H + kvh * G) * D;
  const int64_t last = std::min<int64_t>(p.pos[bt], p.S - 1);
  const int64_t lo = p.lo[bt], hi = p.hi[bt];

  alignas(32) float qf[kMaxGroup * kMaxHeadDim];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(qf + g * D + d, load8_bf16(qr + g * D + d));

  int64_t n = 0;
  float m[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) m[g] = -INFINITY;
  __m256 kv[kMaxHeadDim / 8];
  for (int64_t s = 0; s <= last; ++s) {
    if (s >= lo && s < hi) continue;
    const uint16_t* ks = kb + s * D;
    for (int64_t d = 0; d < D; d += 8) kv[d / 8] = load8_bf16(ks + d);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      __m256 acc = _mm256_mul_ps(_mm256_load_ps(qg), kv[0]);
      for (int64_t d = 8; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_load_ps(qg + d), kv[d / 8], acc);
      const float sc = hsum8(acc) * p.scale;
      scores[g * stride + n] = sc;
      m[g] = std::max(m[g], sc);
    }
    keys[n] = static_cast<int32_t>(s);
    ++n;
  }
  if (n == 0) {  // rows that see nothing (padding): zeros
    std::memset(out, 0, sizeof(float) * G * D);
    return;
  }
  const int64_t padded = (n + 7) / 8 * 8;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - (padded - 8))), lane));
  float l[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * stride;
    const __m256 mv = _mm256_set1_ps(m[g]);
    __m256 lsum = _mm256_setzero_ps();
    for (int64_t i = 0; i < padded; i += 8) {
      __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), mv));  // lanes past n: garbage, zeroed
      if (i + 8 == padded) e = _mm256_and_ps(e, keep);
      _mm256_storeu_ps(sg + i, e);
      lsum = _mm256_add_ps(lsum, e);
    }
    l[g] = hsum8(lsum);
  }

  // Values: one 8-wide slice of the head dim at a time, every head accumulating over the keys.
  for (int64_t d = 0; d < D; d += 8) {
    __m256 acc[kMaxGroup];
    for (int64_t g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const __m256 vv = load8_bf16(vb + static_cast<int64_t>(keys[i]) * D + d);
      for (int64_t g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(scores[g * stride + i]), vv, acc[g]);
    }
    for (int64_t g = 0; g < G; ++g) _mm256_storeu_ps(out + g * D + d, _mm256_div_ps(acc[g], _mm256_set1_ps(l[g])));
  }
}

// Rows are claimed in spans from a counter by the calling thread and the pool tasks (as in
// gemv_bf16.cc: the caller never waits for a task still queued behind other work).
struct Job {
  Problem p;
  int64_t rows, spans;  // rows: (b, t, kv head) groups
  std::atomic<int64_t> next{0}, done{0};

  void Work() {
    std::vector<float> scores((p.H / p.KVH) * (p.S + 8));
    std::vector<int32_t> keys(p.S);
    for (int64_t s; (s = next.fetch_add(1, std::memory_order_relaxed)) < spans;) {
      for (int64_t r = s * rows / spans; r < (s + 1) * rows / spans; ++r) attend_group(p, r, scores.data(), keys.data());
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

}  // namespace

static ffi::Error CacheAttentionBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> k,
                                     ffi::Buffer<ffi::BF16> v, ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> lo,
                                     ffi::Buffer<ffi::S32> hi, float scale, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), pd = pos.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || pd.size() != 2)
    return ffi::Error::InvalidArgument("cache_attention_bf16: q [B, T, H, D], k/v [B, KVH, S, D], pos [B, T] expected");
  const int64_t B = qd[0], T = qd[1], H = qd[2], D = qd[3], KVH = kd[1], S = kd[2];
  if (kd[0] != B || kd[3] != D || vd[0] != B || vd[1] != KVH || vd[2] != S || vd[3] != D || pd[0] != B ||
      pd[1] != T || lo.dimensions()[0] != B || hi.dimensions()[0] != B || KVH == 0 || H % KVH != 0)
    return ffi::Error::InvalidArgument("cache_attention_bf16: mismatched shapes");
  if (D % 8 != 0 || D > kMaxHeadDim || H / KVH > kMaxGroup)
    return ffi::Error::InvalidArgument("cache_attention_bf16: head_dim must be a multiple of 8 up to 256, and at most "
                                       "16 query heads per kv head");
  auto job = std::make_shared<Job>();
  job->p = Problem{B, T, H, KVH, S, D, scale,
                   reinterpret_cast<const uint16_t*>(q.typed_data()), reinterpret_cast<const uint16_t*>(k.typed_data()),
                   reinterpret_cast<const uint16_t*>(v.typed_data()), pos.typed_data(), lo.typed_data(),
                   hi.typed_data(), out->typed_data()};
  job->rows = B * T * KVH;
  if (job->rows == 0) return ffi::Error::Success();
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), job->rows));
  job->spans = std::min<int64_t>(job->rows, 4 * workers);
  for (int64_t w = 1; w < workers; ++w) pool.Schedule([job] { job->Work(); });
  job->Work();
  while (job->done.load(std::memory_order_acquire) < job->spans) _mm_pause();
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(peagle_cache_attention_bf16, CacheAttentionBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
