"""A row-invariant bf16 matmul for few rows on XLA:CPU: an FFI custom call (AVX2 + FMA; AVX-512F
for 3+ rows where the CPU has it, with the same bits).

XLA:CPU's bf16 matmuls over 1-16 rows stream the weights at about half the machine's read
bandwidth (`benchmarks/decode_roofline.py`), and a small model's decode step is 90% matmuls.
`matmul(x, pack(w))` computes x @ w in float32 from weights packed tile-major [O/32, I, 32],
over the FFI's intra-op thread pool. Every row runs the same loop over I, so a row's result
is bitwise the same whatever the number of rows: the row invariance exact speculation needs.

The library is compiled from `gemv_bf16.cc` by `build()` (scripts/setup.sh runs it, and
`available()` does when it is missing). Without a compiler, or on a CPU without AVX2/FMA,
`available()` is False, `unavailable_reason()` says why, and callers keep XLA's matmul.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from jaxtyping import Array, BFloat16, Float

TILE = 32  # output columns per packed tile (4 x 8 float32 lanes)
SOURCE = Path(__file__).with_name("gemv_bf16.cc")
LIBRARY = Path(__file__).parent / "_build" / "libgemv_bf16.so"
TARGET_NAME = "peagle_gemv_bf16"


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(flags.split())


def _cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma", "f16c"} <= _cpu_flags()


def instruction_set() -> str:
    """The loops the library runs for 3+ rows here: "avx512f" (where the CPU has it and
    PEAGLE_CPU_KERNEL_AVX2 is unset) or "avx2". Both give the same bits (gemv_bf16.cc)."""
    if os.environ.get("PEAGLE_CPU_KERNEL_AVX2") is None and "avx512f" in _cpu_flags():
        return "avx512f"
    return "avx2"


def build(force: bool = False) -> Path:
    """Compile the library next to this file (atomically: a failed build never replaces a good one)."""
    if LIBRARY.exists() and not force and LIBRARY.stat().st_mtime >= SOURCE.stat().st_mtime:
        return LIBRARY
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("kernels_cpu: no C++ compiler found (install g++ or set CXX)")
    LIBRARY.parent.mkdir(exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=LIBRARY.parent, suffix=".so", delete=False) as tmp:
        cmd = [cxx, "-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-shared", "-fPIC", "-w",
               f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp.name]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp.name)
        raise RuntimeError(f"kernels_cpu: compiling {SOURCE.name} failed:\n{done.stderr[-2000:]}")
    os.replace(tmp.name, LIBRARY)
    return LIBRARY


@functools.cache
def unavailable_reason() -> str | None:
    """Why the custom call cannot run here (None: it is built, loaded and registered).

    A missing or stale library is compiled first (a few seconds, once per checkout)."""
    if not _cpu_has_avx2_fma():
        return "this CPU lacks AVX2/FMA/F16C"
    try:
        build()
        lib = ctypes.cdll.LoadLibrary(str(LIBRARY))
    except (RuntimeError, OSError) as e:
        return str(e)
    jax.ffi.register_ffi_target(TARGET_NAME, jax.ffi.pycapsule(lib.peagle_gemv_bf16), platform="cpu")
    return None


def available() -> bool:
    """Whether the custom call is built, loadable and registered on this CPU."""
    return unavailable_reason() is None


def pack(w: BFloat16[Array, "I O"]) -> BFloat16[Array, "T I 32"]:
    """[I, O] -> [O/32, I, 32]: each 32-column tile contiguous, so a thread streams it in order.

    Within a tile, each 16-column half is stored interleaved (c0, c8, c1, c9, ..., c7, c15): the
    kernel widens a 32-bit lane's two bf16 values with one shift and one mask (gemv_bf16.cc)."""
    i, o = w.shape
    if o % TILE:
        raise ValueError(f"kernels_cpu.pack: the output width {o} is not a multiple of {TILE}")
    halves = w.astype(jnp.bfloat16).reshape(i, o // TILE, 2, 2, 8)  # [I, tile, half, 8-block, j]
    return halves.transpose(1, 0, 2, 4, 3).reshape(o // TILE, i, TILE)


def matmul(x: BFloat16[Array, "*lead I"], packed: BFloat16[Array, "T I 32"]) -> Float[Array, "*lead O"]:
    """x @ w in float32, w given as `pack(w)`; any number of leading rows."""
    lead, i = x.shape[:-1], x.shape[-1]
    rows = 1
    for d in lead:
        rows *= d
    out = jax.ffi.ffi_call(TARGET_NAME, jax.ShapeDtypeStruct((rows, packed.shape[0] * TILE), jnp.float32))(
        x.reshape(rows, i).astype(jnp.bfloat16), packed)
    return out.reshape(*lead, packed.shape[0] * TILE)
