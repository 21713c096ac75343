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
Best scan(const float* x, int64_t begin, int64_t end) {
  int64_t i = begin;
  Best best{x[i], i, std::isnan(x[i])};
  ++i;
  if (end - i >= 8) {
    __m256 vmax = _mm256_loadu_ps(x + i);
    __m256i vidx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i cur = vidx;
    __m256 nan = _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q);
    const __m256i eight = _mm256_set1_epi32(8);
    for (i += 8; i + 8 <= end; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      cur = _mm256_add_epi32(cur, eight);
      const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);  // strictly greater: a lane keeps its first max
      vmax = _mm256_blendv_ps(vmax, v, gt);
      vidx = _mm256_blendv_epi8(vidx, cur, _mm256_castps_si256(gt));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    alignas(32) float m[8];
    alignas(32) int32_t k[8];
    _mm256_store_ps(m, vmax);
    _mm256_store_si256(reinterpret_cast<__m256i*>(k), vidx);
    best.nan = best.nan || _mm256_movemask_ps(nan) != 0;
    for (int l = 0; l < 8; ++l)
      if (m[l] > best.value || (m[l] == best.value && k[l] < best.index)) best = Best{m[l], k[l], best.nan};
  }
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
