// Cache attention on AVX2+FMA CPUs, as an XLA FFI custom call (kernels_cpu; bf16 in and out,
// float32 inside; `peagle_jax.kernels.cache_attention` picks it on CPU for bf16 caches, implementation "cpu").
//
// out[b, t, h] = softmax_s(q[b, t, h] . k[b, kvh, s] * scale) @ v[b, kvh, s], over the cache rows
// s <= pos[b, t] outside the hidden window [lo[b, t], hi[b, t]), kvh = h / (H / KVH).
//
// Why a kernel: XLA:CPU ran the blockwise reference as a loop of tiny batched products, about
// 0.14 ms per layer for one query row at 256 cached positions (a fifth of a SmolLM2 decode step)
// and 0.85 ms at 4 sequences x 4 rows.
//
// Layout of the work: one item is up to 8 query heads of one kv head in one sequence, one per
// float lane, taken from any of the call's rows (a verify's T rows x G heads share each key).
// Each key is widened once and scored for all 8 lanes; the 8 dot products end in one transposed
// add tree (sum8x8) instead of 8 horizontal sums, and the values are weighed with the
// accumulators in registers. At 4 verify rows this is about twice as fast as a row at a time.
// Where the CPU has AVX512-BF16 (and the head dim is a multiple of 32), attend_lanes_wide does
// the same item with bf16 pair dot products for the scores and 16-wide FMAs for the values; where
// the matmuls run on AMX tiles, attend_lanes_amx takes up to 16 heads an item and the scores of
// 16 keys at a time from tile dot products (a K=3 round 0.45 ms and a K=7 round 1.4 ms cheaper
// than with the dot products, on the Xeon of docs/notes/2026-12-05-session-30.md). All loops
// request a layer's keys and values ahead of use (struct Prefetch; a decode step ~4% faster).
//
// Exactness: every lane runs the same instructions on its own data, whatever else is in the call,
// and its sums run over its visible keys in increasing position. A key one lane does not see
// weighs exactly 0 there, and adding 0 changes no sum. So a row's result does not depend on the
// number of rows (decode step vs verify), on how far other rows reach, or on where its keys sit
// in the cache (a tree verify's second chain, which skips the first chain's rows, gets the bits of
// the same row at its natural place). peagle_jax's exact speculation rests on that.
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>
#include "amx.h"
#include "bf16.h"
#include "cpu_features.h"
#include "spans.h"
#include "vmath.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using peagle::exp8;
using peagle::load8_bf16;

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kLanes = 8;  // query heads per item: one float lane each
constexpr int64_t kLanesWide = 16;  // query heads per item on AMX tiles (attend_lanes_amx)

struct Problem {
  int64_t B, T, H, KVH, S, D;
  float scale;
  const uint16_t *q, *k, *v;
  const int32_t *pos, *lo, *hi;
  uint16_t* out;  // bf16, rounded from the float32 result
  int64_t tiles;  // items per (b, kv head): its T * G query heads split into this many lane sets
  bool amx;       // scores on AMX tiles (attend_lanes_amx)
  int64_t L = 1, layer = 0;  // k/v [B, L, KVH, S, D] read at `layer` (a scanned target's stacked cache)

  // Sequence b's rows of kv head kvh in k (or v): [S, D].
  const uint16_t* rows(const uint16_t* kv, int64_t b, int64_t kvh) const {
    return kv + ((b * L + layer) * KVH + kvh) * S * D;
  }

  // Query heads per item: 16 on AMX tiles (attend_lanes_amx), else 8 (one float lane each).
  int64_t lanes() const { return amx ? kLanesWide : kLanes; }
};

// Eight score vectors (one per query head, 8 partial sums each) -> one vector of the eight
// heads' sums. Every lane gets the same tree, ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)),
// so a head's score does not depend on the lane it sits in or on what the other lanes hold.
inline __m256 sum8x8(const __m256* a) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Scores of one key for lanes 0..N-1 (the rest 0): per lane, the head-dim chunks in order.
template <int N>
inline __m256 key_scores(const float* qf, const uint16_t* ks, int64_t D) {
  __m256 acc[kLanes];
  for (int g = 0; g < kLanes; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 kc = load8_bf16(ks + d);
    for (int g = 0; g < N; ++g) acc[g] = _mm256_fmadd_ps(_mm256_load_ps(qf + g * D + d), kc, acc[g]);
  }
  return sum8x8(acc);
}

// out[lane] += e[i, lane] * v[keys[i]] over the keys in order, for NH lanes from `lane0`, on
// two 8-wide chunks of the head dim at a time (accumulators stay in registers).
template <int NH>
inline void weigh_values(const float* e, const int32_t* keys, int64_t n, const uint16_t* vb, int64_t D,
                         int lane0, const float* l, uint16_t* const* out) {
  for (int64_t d = 0; d < D; d += 16) {
    const bool two = d + 8 < D;
    __m256 acc0[NH], acc1[NH];
    for (int g = 0; g < NH; ++g) acc0[g] = acc1[g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t* vs = vb + static_cast<int64_t>(keys[i]) * D + d;
      const __m256 v0 = load8_bf16(vs), v1 = two ? load8_bf16(vs + 8) : _mm256_setzero_ps();
      for (int g = 0; g < NH; ++g) {
        const __m256 w = _mm256_broadcast_ss(e + i * kLanes + lane0 + g);
        acc0[g] = _mm256_fmadd_ps(w, v0, acc0[g]);
        acc1[g] = _mm256_fmadd_ps(w, v1, acc1[g]);
      }
    }
    for (int g = 0; g < NH; ++g) {
      const __m256 lv = _mm256_set1_ps(l[lane0 + g]);
      peagle::store8_bf16(out[lane0 + g] + d, _mm256_div_ps(acc0[g], lv));
      if (two) peagle::store8_bf16(out[lane0 + g] + d + 8, _mm256_div_ps(acc1[g], lv));
    }
  }
}

template <int NH>
void weigh_values_groups(const float* e, const int32_t* keys, int64_t n, const uint16_t* vb, int64_t D,
                         int lanes, const float* l, uint16_t* const* out) {
  int lane0 = 0;
  for (; lane0 + NH <= lanes; lane0 += NH) weigh_values<NH>(e, keys, n, vb, D, lane0, l, out);
  switch (lanes - lane0) {
    case 3: weigh_values<3>(e, keys, n, vb, D, lane0, l, out); break;
    case 2: weigh_values<2>(e, keys, n, vb, D, lane0, l, out); break;
    case 1: weigh_values<1>(e, keys, n, vb, D, lane0, l, out); break;
    default: break;
  }
}

// The lanes of one item: up to L query heads of kv head `kvh` in sequence b (any of its T rows).
template <int L>
struct LanesOf {
  alignas(64) int32_t pos[L], lo[L], hi[L];
  const uint16_t* q[L];  // each lane's query row (bf16, D values)
  uint16_t* out[L];
  int64_t last = -1;     // the furthest key any lane sees
};
using Lanes = LanesOf<kLanes>;

template <int N, int L = kLanes>
PEAGLE_INLINE void setup_lanes(const Problem& p, int64_t b, int64_t kvh, int64_t first, LanesOf<L>& ln) {
  const int64_t G = p.H / p.KVH;
  for (int g = 0; g < L; ++g) {
    if (g >= N) {
      ln.pos[g] = -1, ln.lo[g] = ln.hi[g] = 0, ln.q[g] = nullptr, ln.out[g] = nullptr;
      continue;
    }
    const int64_t h = first + g, t = h / G, head = kvh * G + h % G, bt = b * p.T + t;
    ln.q[g] = p.q + (bt * p.H + head) * p.D;
    ln.out[g] = p.out + (bt * p.H + head) * p.D;
    ln.pos[g] = static_cast<int32_t>(std::min<int64_t>(p.pos[bt], p.S - 1));
    ln.lo[g] = p.lo[bt], ln.hi[g] = p.hi[bt];
    ln.last = std::max<int64_t>(ln.last, ln.pos[g]);
  }
}

// Which lanes see key s: s <= pos and not lo <= s < hi (all ones where seen).
struct Visibility {
  __m256i pos, lo, hi;
  PEAGLE_INLINE explicit Visibility(const Lanes& ln)
      : pos(_mm256_load_si256(reinterpret_cast<const __m256i*>(ln.pos))),
        lo(_mm256_load_si256(reinterpret_cast<const __m256i*>(ln.lo))),
        hi(_mm256_load_si256(reinterpret_cast<const __m256i*>(ln.hi))) {}
  PEAGLE_INLINE __m256 at(int64_t s) const {
    const __m256i vs = _mm256_set1_epi32(static_cast<int32_t>(s));
    const __m256i beyond = _mm256_cmpgt_epi32(vs, pos);
    const __m256i hidden = _mm256_andnot_si256(_mm256_cmpgt_epi32(lo, vs), _mm256_cmpgt_epi32(hi, vs));
    return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_or_si256(beyond, hidden), _mm256_set1_epi32(-1)));
  }
};

// Records key s's lane scores (times the scale; -inf where a lane does not see it) as entry n of
// e [n, 8] and keys, and folds them into the lanes' running max m.
PEAGLE_INLINE void record_key(int64_t s, __m256 scores, __m256 seen, float scale, float* e, int32_t* keys, int64_t& n,
                              __m256& m) {
  const __m256 sc = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_mul_ps(scores, _mm256_set1_ps(scale)), seen);
  _mm256_storeu_ps(e + n * kLanes, sc);
  m = _mm256_max_ps(m, sc);
  keys[n++] = static_cast<int32_t>(s);
}

// Weights exp(score - max) in place, exactly 0 where a lane does not see the key, and each
// lane's normaliser in key order (inf for a lane that sees nothing: padding, 0 / inf = zeros).
PEAGLE_INLINE void softmax_weights(float* e, int64_t n, __m256 m, int lanes, float* l) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 lsum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const __m256 sc = _mm256_loadu_ps(e + i * kLanes);
    const __m256 seen = _mm256_cmp_ps(sc, ninf, _CMP_GT_OQ);
    const __m256 w = _mm256_and_ps(exp8(_mm256_sub_ps(sc, m)), seen);
    _mm256_storeu_ps(e + i * kLanes, w);
    lsum = _mm256_add_ps(lsum, w);
  }
  _mm256_store_ps(l, lsum);
  for (int g = 0; g < lanes; ++g)
    if (l[g] == 0.0f) l[g] = INFINITY;
}

// Memory: a layer's keys and values come from DRAM (the weights streamed since the last step
// evicted them), and the stream of one item's rows alone did not wake the hardware prefetcher
// soon enough: a decode step's attention took ~45 us per layer at 256 positions with its rows
// in memory against ~12 us in cache. So the loops below ask for the keys kPrefetchAhead bytes
// before they reach them, and for each block's values (needed after all the scores) into L2.
constexpr int64_t kKeyBlock = 16;         // keys per prefetch step (and per AMX score tile)
constexpr int64_t kPrefetchAhead = 4096;  // bytes of keys requested ahead of the block in use

struct Prefetch {
  const char *k, *v;
  int64_t row_bytes, end;  // bytes per key row; bytes up to the last key any lane sees

  PEAGLE_INLINE Prefetch(const uint16_t* kb, const uint16_t* vb, int64_t D, int64_t last)
      : k(reinterpret_cast<const char*>(kb)), v(reinterpret_cast<const char*>(vb)), row_bytes(2 * D),
        end((last + 1) * 2 * D) {
    for (int64_t off = 0; off < std::min(end, kPrefetchAhead); off += 64) _mm_prefetch(k + off, _MM_HINT_T0);
  }
  // Keys [s0, s0 + kKeyBlock): the keys kPrefetchAhead bytes on, and these keys' values.
  PEAGLE_INLINE void block(int64_t s0) const {
    for (int64_t off = s0 * row_bytes, stop = std::min(end, off + kKeyBlock * row_bytes); off < stop; off += 64) {
      if (off + kPrefetchAhead < end) _mm_prefetch(k + off + kPrefetchAhead, _MM_HINT_T0);
      _mm_prefetch(v + off, _MM_HINT_T1);
    }
  }
};

// One item: up to 8 query heads of kv head `kvh` in sequence b (any of its T rows), one per lane.
// The keys visible to any lane are visited once, in increasing position; a key a lane does not
// see gets score -inf and weight exactly 0 there, and adding 0 leaves every sum as it was. So each
// lane's max, normaliser and weighted values are its own visible keys' sums, in order: the bits
// of the same row computed alone, whatever shares its call and wherever its keys sit in the cache.
// `e` holds at least 8 * S floats, `keys` S ints.
template <int N>
void attend_lanes(const Problem& p, int64_t b, int64_t kvh, int64_t first, float* e, int32_t* keys) {
  const int64_t D = p.D;
  Lanes ln;
  setup_lanes<N>(p, b, kvh, first, ln);
  alignas(32) float qf[kLanes * kMaxHeadDim];  // the query rows widened to float32 once
  for (int g = 0; g < N; ++g)
    for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(qf + g * D + d, load8_bf16(ln.q[g] + d));
  const uint16_t* kb = p.rows(p.k, b, kvh);
  const uint16_t* vb = p.rows(p.v, b, kvh);
  const Prefetch prefetch(kb, vb, D, ln.last);
  const Visibility visible(ln);
  int64_t n = 0;
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (int64_t s = 0; s <= ln.last; ++s) {
    if (s % kKeyBlock == 0) prefetch.block(s);
    const __m256 seen = visible.at(s);
    if (_mm256_movemask_ps(seen) == 0) continue;
    record_key(s, key_scores<N>(qf, kb + s * D, D), seen, p.scale, e, keys, n, m);
  }
  alignas(32) float l[kLanes];
  softmax_weights(e, n, m, N, l);
  weigh_values_groups<4>(e, keys, n, vb, D, N, l, ln.out);
}

// ---- AVX-512 with AVX512-BF16: the same item in half the instructions ---------------------------
// Scores: VDPBF16PS on the bf16 query and key pairs as stored (16 pairs per instruction, no
// widening), each head's 16 partial sums folded to 8 and then the 8x8 tree. Values: 16 head-dim
// values per FMA, the keys in the same order as the 8-lane loop (so the same bits there). Each
// lane still runs the same instructions on its own data whatever shares the call, so a row's
// result keeps every invariance above; the scores' rounding differs from the 8-lane loop's,
// so a host's tokens depend on which of the two it runs (as with the matmul's loop sets).

template <int N>
PEAGLE_DPBF16 PEAGLE_INLINE __m256 key_scores_dp(const uint16_t* const* q, const uint16_t* ks, int64_t D) {
  __m512 acc[N];
#pragma GCC unroll 8
  for (int g = 0; g < N; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    const __m512bh kc = (__m512bh)_mm512_loadu_si512(ks + d);
#pragma GCC unroll 8
    for (int g = 0; g < N; ++g) acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)_mm512_loadu_si512(q[g] + d), kc);
  }
  __m256 a[kLanes];
#pragma GCC unroll 8
  for (int g = 0; g < kLanes; ++g)
    a[g] = g < N ? _mm256_add_ps(_mm512_castps512_ps256(acc[g]),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[g]), 1)))
                 : _mm256_setzero_ps();
  return sum8x8(a);
}

// out[lane] += e[i, lane] * v[keys[i]] (see weigh_values), 32 head-dim values a pass.
template <int NH, int Stride = kLanes>
PEAGLE_DPBF16 PEAGLE_INLINE void weigh_values_wide(const float* e, const int32_t* keys, int64_t n, const uint16_t* vb,
                                                   int64_t D, int lane0, const float* l, uint16_t* const* out) {
  for (int64_t d = 0; d < D; d += 32) {
    __m512 acc0[NH], acc1[NH];
#pragma GCC unroll 8
    for (int g = 0; g < NH; ++g) acc0[g] = acc1[g] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t* vs = vb + static_cast<int64_t>(keys[i]) * D + d;
      const __m512 v0 = peagle::load16_bf16(vs), v1 = peagle::load16_bf16(vs + 16);
#pragma GCC unroll 8
      for (int g = 0; g < NH; ++g) {
        const __m512 w = _mm512_set1_ps(e[i * Stride + lane0 + g]);
        acc0[g] = _mm512_fmadd_ps(w, v0, acc0[g]);
        acc1[g] = _mm512_fmadd_ps(w, v1, acc1[g]);
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < NH; ++g) {
      const __m512 lv = _mm512_set1_ps(l[lane0 + g]);
      peagle::store16_bf16(out[lane0 + g] + d, _mm512_div_ps(acc0[g], lv));
      peagle::store16_bf16(out[lane0 + g] + d + 16, _mm512_div_ps(acc1[g], lv));
    }
  }
}

// All `lanes` lanes of an item (e's rows `Stride` floats apart), 6 at a time: 12 accumulators
// plus the values and a broadcast fit the 32 registers.
template <int Stride>
PEAGLE_DPBF16 PEAGLE_INLINE void weigh_values_wide_lanes(const float* e, const int32_t* keys, int64_t n,
                                                         const uint16_t* vb, int64_t D, int lanes, const float* l,
                                                         uint16_t* const* out) {
  int lane0 = 0;
  for (; lane0 + 6 <= lanes; lane0 += 6) weigh_values_wide<6, Stride>(e, keys, n, vb, D, lane0, l, out);
  switch (lanes - lane0) {
    case 5: weigh_values_wide<5, Stride>(e, keys, n, vb, D, lane0, l, out); break;
    case 4: weigh_values_wide<4, Stride>(e, keys, n, vb, D, lane0, l, out); break;
    case 3: weigh_values_wide<3, Stride>(e, keys, n, vb, D, lane0, l, out); break;
    case 2: weigh_values_wide<2, Stride>(e, keys, n, vb, D, lane0, l, out); break;
    case 1: weigh_values_wide<1, Stride>(e, keys, n, vb, D, lane0, l, out); break;
    default: break;
  }
}

template <int N>
PEAGLE_DPBF16 void attend_lanes_wide(const Problem& p, int64_t b, int64_t kvh, int64_t first, float* e, int32_t* keys) {
  const int64_t D = p.D;
  Lanes ln;
  setup_lanes<N>(p, b, kvh, first, ln);
  const uint16_t* kb = p.rows(p.k, b, kvh);
  const uint16_t* vb = p.rows(p.v, b, kvh);
  const Prefetch prefetch(kb, vb, D, ln.last);
  const Visibility visible(ln);
  int64_t n = 0;
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (int64_t s = 0; s <= ln.last; ++s) {
    if (s % kKeyBlock == 0) prefetch.block(s);
    const __m256 seen = visible.at(s);
    if (_mm256_movemask_ps(seen) == 0) continue;
    record_key(s, key_scores_dp<N>(ln.q, kb + s * D, D), seen, p.scale, e, keys, n, m);
  }
  alignas(32) float l[kLanes];
  softmax_weights(e, n, m, N, l);
  weigh_values_wide_lanes<kLanes>(e, keys, n, vb, D, N, l, ln.out);
}

// ---- AMX: 16 heads an item, the scores of 16 keys x 16 heads in tile dot products ------------------
// Where the matmuls run on AMX tiles (gemv_bf16.cc's loop set 2), an item's scores come from
// TDPBF16PS: the keys straight from the cache as a [16 keys, 32 dims] tile, the lanes' query
// rows as a [16 dim pairs, 16 lanes] tile, the scores a [16 keys, 16 lanes] float32 tile, the head
// dim in chunks of 32 in order (the per-key dot products and add trees were most of an item's
// instructions). An item takes up to 16 query heads of a kv head (a 4-row verify's 12 in one), so
// a verify reads a layer's keys and values from memory once per kv head, and the softmax runs on
// 16 lanes in one vector. A score is computed from its key row and its query row alone, whatever
// tile row or column they sit in, and each lane's softmax and values are its own, so every
// invariance above holds; the values are weighed as in attend_lanes_wide (16-wide FMAs, keys in
// order). The scores round their own way (as the AMX matmul's do), so an AMX host's tokens can
// differ from a dot-product host's. Interleaved on real round programs against the 8-head items
// with AMX scores: a K=7 round 0.58 ms cheaper, K=3 the same.

struct Visibility16 {
  __m512i pos, lo, hi;
  PEAGLE_AMX_DPBF16 PEAGLE_INLINE explicit Visibility16(const LanesOf<kLanesWide>& ln)
      : pos(_mm512_load_si512(ln.pos)), lo(_mm512_load_si512(ln.lo)), hi(_mm512_load_si512(ln.hi)) {}
  // Lanes that see key s: s <= pos and not lo <= s < hi.
  PEAGLE_AMX_DPBF16 PEAGLE_INLINE __mmask16 at(int64_t s) const {
    const __m512i vs = _mm512_set1_epi32(static_cast<int32_t>(s));
    const __mmask16 beyond = _mm512_cmpgt_epi32_mask(vs, pos);
    const __mmask16 hidden = _mm512_cmpgt_epi32_mask(hi, vs) & static_cast<__mmask16>(~_mm512_cmpgt_epi32_mask(lo, vs));
    return static_cast<__mmask16>(~(beyond | hidden));
  }
};

PEAGLE_AMX_DPBF16 inline void amx_configure_scores() {
  peagle::TileConfig cfg{};
  cfg.palette = 1;
  cfg.rows[0] = kKeyBlock; cfg.colsb[0] = 64;
  cfg.rows[1] = 16; cfg.colsb[1] = kLanesWide * 4;
  cfg.rows[2] = kKeyBlock; cfg.colsb[2] = kLanesWide * 4;
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");  // see amx.h
  _tile_loadconfig(&cfg);
}

// `e` holds at least 16 * S floats, `keys` S ints.
template <int N>
PEAGLE_AMX_DPBF16 void attend_lanes_amx(const Problem& p, int64_t b, int64_t kvh, int64_t first, float* e,
                                          int32_t* keys) {
  const int64_t D = p.D, chunks = D / 32;
  LanesOf<kLanesWide> ln;
  setup_lanes<N, kLanesWide>(p, b, kvh, first, ln);
  alignas(64) uint32_t qt[kMaxHeadDim / 32][16][kLanesWide];  // [chunk][dim pair][lane]
  for (int64_t c = 0; c < chunks; ++c)
    for (int j = 0; j < 16; ++j)
      for (int g = 0; g < kLanesWide; ++g) {
        uint32_t pair = 0;
        if (g < N) std::memcpy(&pair, ln.q[g] + 32 * c + 2 * j, 4);
        qt[c][j][g] = pair;
      }
  const uint16_t* kb = p.rows(p.k, b, kvh);
  const uint16_t* vb = p.rows(p.v, b, kvh);
  const Prefetch prefetch(kb, vb, D, ln.last);
  alignas(64) uint16_t tail[kKeyBlock * kMaxHeadDim];
  alignas(64) float sc[kKeyBlock][kLanesWide];
  const Visibility16 visible(ln);
  const __m512 ninf = _mm512_set1_ps(-INFINITY), scale = _mm512_set1_ps(p.scale);
  int64_t n = 0;
  __m512 m = ninf;
  for (int64_t s0 = 0; s0 <= ln.last; s0 += kKeyBlock) {
    const uint16_t* kblock = kb + s0 * D;
    prefetch.block(s0);
    if (s0 + kKeyBlock > p.S) {
      std::memset(tail, 0, sizeof(uint16_t) * kKeyBlock * D);
      std::memcpy(tail, kblock, sizeof(uint16_t) * (p.S - s0) * D);
      kblock = tail;
    }
    _tile_zero(2);
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(0, kblock + 32 * c, D * 2);
      _tile_loadd(1, qt[c], kLanesWide * 4);
      _tile_dpbf16ps(2, 0, 1);
    }
    _tile_stored(2, sc, kLanesWide * 4);
    const int64_t s1 = std::min<int64_t>(s0 + kKeyBlock, ln.last + 1);
    for (int64_t s = s0; s < s1; ++s) {
      const __mmask16 seen = visible.at(s);
      if (seen == 0) continue;
      // The score times the scale where a lane sees the key, -inf where it does not.
      const __m512 x = _mm512_mask_blend_ps(seen, ninf, _mm512_mul_ps(_mm512_load_ps(sc[s - s0]), scale));
      _mm512_storeu_ps(e + n * kLanesWide, x);
      m = _mm512_max_ps(m, x);
      keys[n++] = static_cast<int32_t>(s);
    }
  }
  // Weights exp(score - max), exactly 0 where a lane does not see the key; normalisers in key order.
  __m512 lsum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const __m512 x = _mm512_loadu_ps(e + i * kLanesWide);
    const __m512 w = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, ninf, _CMP_GT_OQ), peagle::exp16(_mm512_sub_ps(x, m)));
    _mm512_storeu_ps(e + i * kLanesWide, w);
    lsum = _mm512_add_ps(lsum, w);
  }
  alignas(64) float l[kLanesWide];
  _mm512_store_ps(l, lsum);
  for (int g = 0; g < N; ++g)
    if (l[g] == 0.0f) l[g] = INFINITY;  // a lane that sees nothing (padding): 0 / inf = zeros
  weigh_values_wide_lanes<kLanesWide>(e, keys, n, vb, D, N, l, ln.out);
}

// Item r of the call: sequence b, kv head kvh, lane set j of its T * G query heads.
void attend_item(const Problem& p, int64_t r, float* e, int32_t* keys) {
  const int64_t heads = p.T * (p.H / p.KVH), j = r % p.tiles, kvh = (r / p.tiles) % p.KVH, b = r / (p.tiles * p.KVH);
  const int64_t first = j * heads / p.tiles, n = (j + 1) * heads / p.tiles - first;
  // attend_lanes_wide where the dot products may run (cpu_features.h) and head dims are multiples of 32
  const bool wide = p.D % 32 == 0 && peagle::dot_products_allowed();
#define PEAGLE_ATTEND(k)                                                                                 \
  return p.amx ? attend_lanes_amx<k>(p, b, kvh, first, e, keys)                                          \
       : wide ? attend_lanes_wide<k>(p, b, kvh, first, e, keys) : attend_lanes<k>(p, b, kvh, first, e, keys)
#define PEAGLE_ATTEND16(k)                                                                               \
  return attend_lanes_amx<k>(p, b, kvh, first, e, keys)
  switch (n) {
    case 1: PEAGLE_ATTEND(1);
    case 2: PEAGLE_ATTEND(2);
    case 3: PEAGLE_ATTEND(3);
    case 4: PEAGLE_ATTEND(4);
    case 5: PEAGLE_ATTEND(5);
    case 6: PEAGLE_ATTEND(6);
    case 7: PEAGLE_ATTEND(7);
    case 8: PEAGLE_ATTEND(8);
    case 9: PEAGLE_ATTEND16(9);
    case 10: PEAGLE_ATTEND16(10);
    case 11: PEAGLE_ATTEND16(11);
    case 12: PEAGLE_ATTEND16(12);
    case 13: PEAGLE_ATTEND16(13);
    case 14: PEAGLE_ATTEND16(14);
    case 15: PEAGLE_ATTEND16(15);
    case 16: PEAGLE_ATTEND16(16);
    default: return;
  }
#undef PEAGLE_ATTEND16
#undef PEAGLE_ATTEND
}

// One call's work: spans of items, shared out as spans.h says.
struct Job {
  Problem p;
  peagle::Spans spans;

  void Work() {
    // Scratch kept per thread across calls (no allocation or zeroing per call; every entry
    // read is written first).
    thread_local std::vector<float> e;
    thread_local std::vector<int32_t> keys;
    if (static_cast<int64_t>(keys.size()) < p.S || static_cast<int64_t>(e.size()) < p.lanes() * p.S) {
      e.resize(p.lanes() * p.S);
      keys.resize(p.S);
    }
    if (p.amx) amx_configure_scores();
    spans.Claim([&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) attend_item(p, r, e.data(), keys.data());
    });
    if (p.amx) peagle::amx_release();
  }
};

}  // namespace

// k/v are [B, KVH, S, D], or, given a layer index, [B, L, KVH, S, D] read at that layer.
static ffi::Error Attend(ffi::ThreadPool& pool, ffi::Buffer<ffi::BF16>& q, ffi::Buffer<ffi::BF16>& k,
                         ffi::Buffer<ffi::BF16>& v, ffi::Buffer<ffi::S32>& pos, ffi::Buffer<ffi::S32>& lo,
                         ffi::Buffer<ffi::S32>& hi, float scale, ffi::ResultBuffer<ffi::BF16>& out,
                         const int32_t* layer_index) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), pd = pos.dimensions();
  const size_t o = layer_index != nullptr, kv_rank = 4 + o;  // o: the layer axis, where there is one
  if (qd.size() != 4 || kd.size() != kv_rank || vd.size() != kv_rank || pd.size() != 2)
    return ffi::Error::InvalidArgument("cache_attention_bf16: q [B, T, H, D], k/v [B, KVH, S, D] (or [B, L, KVH, S, D] "
                                       "with a layer), pos [B, T] expected");
  const int64_t B = qd[0], T = qd[1], H = qd[2], D = qd[3], KVH = kd[1 + o], S = kd[2 + o];
  const int64_t L = o ? kd[1] : 1, layer = o ? *layer_index : 0;
  if (kd[0] != B || kd[3 + o] != D || vd[0] != B || vd[1 + o] != KVH || vd[2 + o] != S || vd[3 + o] != D ||
      pd[0] != B || pd[1] != T || lo.dimensions()[0] != B || hi.dimensions()[0] != B || KVH == 0 || H % KVH != 0 ||
      (o == 1 && (vd[1] != L || layer < 0 || layer >= L)))
    return ffi::Error::InvalidArgument("cache_attention_bf16: mismatched shapes");
  if (D % 8 != 0 || D > kMaxHeadDim)
    return ffi::Error::InvalidArgument("cache_attention_bf16: head_dim must be a multiple of 8 up to 256");
  auto job = std::make_shared<Job>();
  job->p = Problem{B, T, H, KVH, S, D, scale,
                   reinterpret_cast<const uint16_t*>(q.typed_data()), reinterpret_cast<const uint16_t*>(k.typed_data()),
                   reinterpret_cast<const uint16_t*>(v.typed_data()), pos.typed_data(), lo.typed_data(),
                   hi.typed_data(), reinterpret_cast<uint16_t*>(out->typed_data()), 1,
                   D % 32 == 0 && peagle::loop_set() == 2, L, layer};  // 2: the matmuls run on AMX
  // As few lane sets as hold the heads: measured, splitting them further only repeats the key
  // loads (at 1 row, 3 sets of 1 head ran 40% slower than 1 set of 3).
  const int64_t heads = T * (H / KVH), tiles = (heads + job->p.lanes() - 1) / job->p.lanes();
  job->p.tiles = tiles;
  const int64_t items = B * KVH * tiles;
  if (items == 0) return ffi::Error::Success();
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), items));
  job->spans.Split(items, workers);
  peagle::RunSpans(pool, job, workers);
  return ffi::Error::Success();
}

static ffi::Error CacheAttentionBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> k,
                                     ffi::Buffer<ffi::BF16> v, ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> lo,
                                     ffi::Buffer<ffi::S32> hi, float scale, ffi::ResultBuffer<ffi::BF16> out) {
  return Attend(pool, q, k, v, pos, lo, hi, scale, out, nullptr);
}

// The same over a scanned target's stacked cache [B, L, KVH, S, D], at layer `layer`.
static ffi::Error CacheAttentionLayerBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> k,
                                          ffi::Buffer<ffi::BF16> v, ffi::Buffer<ffi::S32> pos,
                                          ffi::Buffer<ffi::S32> lo, ffi::Buffer<ffi::S32> hi,
                                          ffi::Buffer<ffi::S32> layer, float scale, ffi::ResultBuffer<ffi::BF16> out) {
  if (layer.element_count() != 1)
    return ffi::Error::InvalidArgument("cache_attention_bf16 (layer): one layer index expected");
  return Attend(pool, q, k, v, pos, lo, hi, scale, out, layer.typed_data());
}

// q, k, v, pos, lo, hi: what both entry points take first.
static auto AttentionOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::BF16>>()
      .Arg<ffi::Buffer<ffi::BF16>>()
      .Arg<ffi::Buffer<ffi::BF16>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(peagle_cache_attention_layer_bf16, CacheAttentionLayerBf16,
                              AttentionOperands()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(peagle_cache_attention_bf16, CacheAttentionBf16,
                              AttentionOperands().Attr<float>("scale").Ret<ffi::Buffer<ffi::BF16>>());
