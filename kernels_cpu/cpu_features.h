// The CPU features the kernels use: the target attributes their wider loops are compiled with,
// and the run-time checks that pick which loops run (each once per process). The library is
// built for AVX2 + FMA + F16C (kernels_cpu.build); a function marked with a wider target below
// runs only behind the check that guards it, so both live here, side by side.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>
#include <cstdlib>

// ---- Target attributes -------------------------------------------------------------------------
#define PEAGLE_INLINE inline __attribute__((always_inline))  // a small step inlined into its loop
#define PEAGLE_AVX512 __attribute__((target("avx512f")))
#define PEAGLE_AVX512BW __attribute__((target("avx512f,avx512bw")))
// AVX512-BF16 dot products (VDPBF16PS). AVX512BW is listed because the byte-decoding and masked
// loops use it; GCC enables it with AVX512-BF16 anyway (the ISA extension depends on it), so the
// bf16 matmul's loops compile to the same code as with "avx512f,avx512bf16" alone, which they
// were declared with before this header.
#define PEAGLE_DPBF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define PEAGLE_AMX __attribute__((target("amx-tile,amx-bf16")))
#define PEAGLE_AMX_BW __attribute__((target("avx512f,avx512bw,amx-tile,amx-bf16")))
#define PEAGLE_AMX_DPBF16 __attribute__((target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")))
#define PEAGLE_AMX_INT8 __attribute__((target("avx512f,avx512bw,amx-tile,amx-int8")))

namespace peagle {

// ---- Run-time checks ---------------------------------------------------------------------------
// Environment switches (tests compare the loops' bits, benchmarks time them):
//   PEAGLE_CPU_KERNEL_NO_AMX=1     no AMX tiles;
//   PEAGLE_CPU_KERNEL_NO_DPBF16=1  no AVX512-BF16 dot products;
//   PEAGLE_CPU_KERNEL_AVX2=1       where neither of those runs, AVX2 only (8 lanes).

// CPUID leaf 7, subleaf 0: EDX holds the AMX bits (22 AMX-BF16, 24 AMX-TILE, 25 AMX-INT8).
inline unsigned cpuid7_edx() {
  unsigned a, b, c, d;
  __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  return d;
}

// AMX-BF16 and AMX-TILE in CPUID leaf 7, and the kernel's permission to use the tile state.
inline bool amx_usable() {
  const unsigned d = cpuid7_edx();
  if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// The bf16 matmul's loops here (gemv_bf16.cc), chosen once per process: 2 = AMX (every row
// count), 3 = AVX512-BF16 dot products (every row count), 1 = AVX-512F FMAs (3+ rows; AVX2 for
// 1-2), 0 = AVX2 only. The quantized matmul and the attention take AMX where this is 2.
// kernels_cpu.instruction_set reads it through gemv_bf16.cc's peagle_gemv_loop_set.
inline int loop_set() {
  static const int set = [] {
    if (std::getenv("PEAGLE_CPU_KERNEL_NO_AMX") == nullptr && amx_usable()) return 2;
    if (std::getenv("PEAGLE_CPU_KERNEL_AVX2") != nullptr || !__builtin_cpu_supports("avx512f")) return 0;
    if (std::getenv("PEAGLE_CPU_KERNEL_NO_DPBF16") == nullptr && __builtin_cpu_supports("avx512bf16")) return 3;
    return 1;
  }();
  return set;
}

// Whether the GGUF blocks' matmul may run its integer sums on AMX tiles (gemv_group.cc): the
// AMX loops run here (loop_set() == 2) and the CPU has AMX-INT8 (CPUID leaf 7, EDX bit 25).
inline bool amx_int8_usable() {
  static const bool usable = loop_set() == 2 && ((cpuid7_edx() >> 25) & 1) != 0;
  return usable;
}

// Whether this host may run the AVX512-BF16 dot-product loops (gemv_quant.cc's, attention_bf16.cc's
// wide lanes): the CPU has AVX-512F/BW and AVX512-BF16, and neither PEAGLE_CPU_KERNEL_NO_DPBF16
// nor PEAGLE_CPU_KERNEL_AVX2 is set.
inline bool dot_products_allowed() {
  static const bool allowed = std::getenv("PEAGLE_CPU_KERNEL_NO_DPBF16") == nullptr &&
                              std::getenv("PEAGLE_CPU_KERNEL_AVX2") == nullptr && __builtin_cpu_supports("avx512f") &&
                              __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16");
  return allowed;
}

// Whether the 16-lane AVX-512F vector math may run (vmath.h): the CPU has AVX-512F and
// PEAGLE_CPU_KERNEL_AVX2 is unset.
inline bool avx512_allowed() {
  static const bool wide = __builtin_cpu_supports("avx512f") && std::getenv("PEAGLE_CPU_KERNEL_AVX2") == nullptr;
  return wide;
}

}  // namespace peagle
