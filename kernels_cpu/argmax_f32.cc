// Row argmax of float32 logits, as an XLA FFI custom call (kernels_cpu.argmax; peagle_jax's
// greedy_token uses it on CPU).
//
// XLA:CPU lowered greedy_token's max-then-min-index over a 49k vocabulary to split reductions
// that cost ~110 us a row, ~290 us for a verify's 4 rows (a profiled round): 2% of a decode step.
// This scans a row in 8 float lanes, each keeping its first maximum, in chunks shared by the
// threads. Semantics of greedy_token (and jnp.argmax): the lowest index of the row's maximum; a
// row of -inf gives 0; a row holding a NaN gives the last index (greedy_token's convention).
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>
#include "spans.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace {

constexpr int64_t kChunk = 8192;  // values per work item (a row splits across threads)

struct Best {
  float value;
  int64_t index;
  bool nan;
};

// The first maximum of x[begin, end) (end - begin >= 1), and whether a NaN is there.
// Four independent sets of 8 lanes: one set's compare-and-blend chain (~6 cycles per 8 values)
// bounded the scan at ~10 GB/s, slower than the logits come from cache. Each lane keeps its first
// maximum over the indices it visits (increasing), and the lanes merge by value, then lowest
// index, so the result is the row's first maximum whatever the lane layout.
Best scan(const float* x, int64_t begin, int64_t end) {
  constexpr int kSets = 4;
  int64_t i = begin;
  Best best{x[i], i, std::isnan(x[i])};
  ++i;
  if (end - i >= 8 * kSets) {
    __m256 vmax[kSets], nan[kSets];
    __m256i vidx[kSets], cur[kSets];
    const __m256i step = _mm256_set1_epi32(8 * kSets);
    for (int g = 0; g < kSets; ++g) {
      vmax[g] = _mm256_loadu_ps(x + i + 8 * g);
      cur[g] = vidx[g] = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(i + 8 * g)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      nan[g] = _mm256_cmp_ps(vmax[g], vmax[g], _CMP_UNORD_Q);
    }
    for (i += 8 * kSets; i + 8 * kSets <= end; i += 8 * kSets) {
#pragma GCC unroll 4
      for (int g = 0; g < kSets; ++g) {
        const __m256 v = _mm256_loadu_ps(x + i + 8 * g);
        cur[g] = _mm256_add_epi32(cur[g], step);
        const __m256 gt = _mm256_cmp_ps(v, vmax[g], _CMP_GT_OQ);  // strictly greater: a lane keeps its first max
        vmax[g] = _mm256_blendv_ps(vmax[g], v, gt);
        vidx[g] = _mm256_blendv_epi8(vidx[g], cur[g], _mm256_castps_si256(gt));
        nan[g] = _mm256_or_ps(nan[g], _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
    }
    for (int g = 0; g < kSets; ++g) {
      alignas(32) float m[8];
      alignas(32) int32_t k[8];
      _mm256_store_ps(m, vmax[g]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(k), vidx[g]);
      best.nan = best.nan || _mm256_movemask_ps(nan[g]) != 0;
      for (int l = 0; l < 8; ++l)
        if (m[l] > best.value || (m[l] == best.value && k[l] < best.index)) best = Best{m[l], k[l], best.nan};
    }
  }
  // The rest in order; a later index replaces the best only when strictly greater.
  for (; i < end; ++i) {
    if (std::isnan(x[i])) best.nan = true;
    if (x[i] > best.value) best = Best{x[i], i, best.nan};
  }
  return best;
}

struct Job {
  const float* x;
  int32_t* out;
  int64_t V, chunks;
  std::vector<Best> parts;  // [rows, chunks]
  peagle::Spans spans;

  void Work() {
    spans.Claim([&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t row = i / chunks, c = i % chunks;
        const int64_t begin = c * V / chunks, end = (c + 1) * V / chunks;
        parts[i] = scan(x + row * V, begin, end);
      }
    });
  }
};

ffi::Error ArgmaxF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  auto d = x.dimensions();
  if (d.size() != 2 || d[1] < 1 || out->dimensions().size() != 1 || out->dimensions()[0] != d[0])
    return ffi::Error::InvalidArgument("argmax_f32: x [N, V] (V >= 1) and out [N] expected");
  const int64_t N = d[0], V = d[1];
  if (N == 0) return ffi::Error::Success();
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->out = out->typed_data();
  job->V = V;
  job->chunks = std::max<int64_t>(1, V / kChunk);
  job->parts.resize(N * job->chunks);
  const int64_t items = N * job->chunks;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), items / 2));
  job->spans.Split(items, workers);
  peagle::RunSpans(pool, job, workers);
  for (int64_t r = 0; r < N; ++r) {
    Best best = job->parts[r * job->chunks];
    for (int64_t c = 1; c < job->chunks; ++c) {  // chunks in order: a tie keeps the earlier index
      const Best& p = job->parts[r * job->chunks + c];
      best.nan = best.nan || p.nan;
      if (p.value > best.value) best = Best{p.value, p.index, best.nan};
    }
    job->out[r] = static_cast<int32_t>(best.nan ? V - 1 : best.index);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(peagle_argmax_f32, ArgmaxF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
