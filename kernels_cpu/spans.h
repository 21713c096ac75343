// How the kernels' custom calls share one call's work among the calling thread and XLA's pool.
//
// A call's items are cut into spans claimed from a counter. The calling thread claims spans
// too, and then waits only for spans another thread is computing right now, never for a pool
// task still queued behind other work: so concurrent calls on a small pool cannot deadlock. A
// task that starts after its call returned finds nothing left to claim; the job's shared_ptr
// keeps the state alive for it.
#pragma once

#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace peagle {

struct Spans {
  int64_t items = 0, count = 0;
  std::atomic<int64_t> next{0}, done{0};

  // Up to 4 spans per worker: a thread that finishes early takes over work, spans stay long.
  void Split(int64_t n, int64_t workers) {
    items = n;
    count = std::min<int64_t>(n, 4 * workers);
  }

  // body(begin, end) on each span this thread claims, until none is left.
  template <class Body>
  void Claim(Body&& body) {
    for (int64_t s; (s = next.fetch_add(1, std::memory_order_relaxed)) < count;) {
      body(s * items / count, (s + 1) * items / count);
      done.fetch_add(1, std::memory_order_release);
    }
  }

  void WaitAll() const {
    while (done.load(std::memory_order_acquire) < count) _mm_pause();
  }
};

// Threads for a matmul call over `tiles` output tiles: small weights (a few tiles) stay on the
// calling thread, since a hand-off costs more than it saves.
inline int64_t tile_workers(xla::ffi::ThreadPool& pool, int64_t tiles) {
  return tiles < 8 ? 1 : std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), tiles));
}

// Runs job->Work() (which calls job->spans.Claim) on the calling thread and workers - 1 pool
// tasks, and returns once every span is done.
template <class Job>
void RunSpans(xla::ffi::ThreadPool& pool, const std::shared_ptr<Job>& job, int64_t workers) {
  for (int64_t w = 1; w < workers; ++w) pool.Schedule([job] { job->Work(); });
  job->Work();
  job->spans.WaitAll();
}

}  // namespace peagle
