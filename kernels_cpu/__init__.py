"""Row-invariant CPU kernels as FFI custom calls: a bf16 matmul for few rows (AMX tiles where
the CPU has them, else AVX512-BF16 pair dot products or FMAs in AVX-512F / AVX2, which all give
the same bits), the same matmul on 7-bit weights stored in bytes or 4-bit ones in nibbles (`pack_q7`, `pack_q4`,
for draft heads: a half or a quarter of the bytes to stream) and a bf16 cache attention.

XLA:CPU's bf16 matmuls over 1-16 rows stream the weights at about half the machine's read
bandwidth (`benchmarks/decode_roofline.py`), and a small model's decode step is 90% matmuls.
`matmul(x, pack(w))` computes x @ w in float32 from weights packed tile-major in input pairs
[O/32, J, 64], over the FFI's intra-op thread pool. Every row runs the same steps over I, so
a row's result is bitwise the same whatever the number of rows: the row invariance exact
speculation needs.

`cache_attention(q, k, v, positions)` attends query rows to a bf16 KV cache, one row at a time
over its visible keys (`attention_bf16.cc`): a row's result depends on nothing else in the call,
so a decode step, a verify and a tree verify's second chain give a row the same bits.

Given `layer=`, `matmul` and `cache_attention` read one layer of stacked operands in place
(`layer_view.h`): a target whose layers run under a scan (`peagle_jax/models/layer_stack.py`).

`argmax(logits)` is a row argmax over float32 logits (`argmax_f32.cc`): the greedy token of
every decode step and verify row, a few microseconds where XLA:CPU took ~110 us a 49k row.

The library is compiled from `gemv_bf16.cc`, `gemv_quant.cc`, `attention_bf16.cc` and
`argmax_f32.cc` by `build()`
(scripts/setup.sh runs it, and `available()` does when it is missing). Without a compiler, or on a CPU without AVX2/FMA,
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
import numpy as np
from jaxtyping import Array, BFloat16, Float, Int, Int8, UInt8

TILE = 32  # output columns per packed tile (4 x 8 float32 lanes)
SOURCES = tuple(Path(__file__).with_name(n) for n in ("gemv_bf16.cc", "gemv_quant.cc", "gemv_group.cc",
                                                       "attention_bf16.cc", "argmax_f32.cc"))
HEADERS = tuple(Path(__file__).with_name(n) for n in ("spans.h", "bf16.h", "amx.h", "vmath.h",  # a change rebuilds too
                                                       "cpu_features.h", "u8_weights.h", "layer_view.h"))
# One library per jaxlib: the FFI's API version is compiled in, and a library built against
# another jaxlib's headers is refused at registration.
LIBRARY = Path(__file__).parent / "_build" / f"libpeagle_cpu-jaxlib{jax.lib.__version__}.so"
TARGET_NAME = "peagle_gemv_bf16"
TARGET_BF16_OUT = "peagle_gemv_bf16_to_bf16"  # the same sums, rounded to bf16 in the kernel
ATTENTION_TARGET = "peagle_cache_attention_bf16"
Q7_TARGET = "peagle_gemv_q7"  # weight-only 7-bit weights in bytes (`pack_q7`), float32 sums
Q7_BF16_OUT = "peagle_gemv_q7_to_bf16"
Q4_TARGET = "peagle_gemv_q4"  # weight-only 4-bit weights in nibbles (`pack_q4`), float32 sums
Q4_BF16_OUT = "peagle_gemv_q4_to_bf16"
G4_TARGET = "peagle_gemv_g4"  # a target's 4-bit GGUF groups (`pack_g4`), float32 sums
G4_BF16_OUT = "peagle_gemv_g4_to_bf16"
G8_TARGET = "peagle_gemv_g8"  # a target's 8-bit GGUF groups (`pack_g8`), float32 sums
G8_BF16_OUT = "peagle_gemv_g8_to_bf16"
G4_GROUP, G4_RECORD = 32, 768  # inputs per group; bytes per (tile, group): 32 scales, 32 mins, 32 x 16 nibble bytes
G8_GROUP, G8_RECORD = 16, 640  # inputs per group; bytes per (tile, group): 32 scales, 16 x 32 int8
GLU_TARGET = "peagle_gemv_glu_bf16_to_bf16"  # SiLU(gate) * up of [M, 2I] rows, then the matmul
ARGMAX_TARGET = "peagle_argmax_f32"
Q7_SCALE_ROWS = 2  # a packed 7-bit tile starts with its 32 float32 column scales: 2 rows of 64 bytes
Q4_SCALE_ROWS = 4  # a packed 4-bit tile's rows are 32 bytes (one input pair): its scales take 4
Q4_CLIPS = tuple(1.0 - 0.05 * k for k in range(11))  # pack_q4's candidate clips of max |w|, 1 .. 0.5


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them ("flags" on x86, "Features" on Arm);
    empty where it cannot be read."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())


def _cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma", "f16c"} <= cpu_flags()


def instruction_set() -> str:
    """The matmul loops the library runs here: "amx" (tile dot products for every row count),
    "avx512bf16" (bf16 pair dot products, VDPBF16PS, every row count), "avx512f" (512-bit FMAs
    for 3+ rows, AVX2 for 1-2) or "avx2" (gemv_bf16.cc; all but "amx" give the same bits).
    PEAGLE_CPU_KERNEL_NO_AMX=1 rules out "amx" and PEAGLE_CPU_KERNEL_NO_DPBF16=1 "avx512bf16";
    where neither runs, PEAGLE_CPU_KERNEL_AVX2=1 forces "avx2" (the library reads them once per
    process)."""
    if available():
        return ("avx2", "avx512f", "amx", "avx512bf16")[ctypes.cdll.LoadLibrary(str(LIBRARY)).peagle_gemv_loop_set()]
    flags = cpu_flags()
    if os.environ.get("PEAGLE_CPU_KERNEL_AVX2") is not None or "avx512f" not in flags:
        return "avx2"
    return "avx512f"


def build(force: bool = False) -> Path:
    """Compile the library next to this file (atomically: a failed build never replaces a good one)."""
    if LIBRARY.exists() and not force and LIBRARY.stat().st_mtime >= max(s.stat().st_mtime for s in SOURCES + HEADERS):
        return LIBRARY
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("kernels_cpu: no C++ compiler found (install g++ or set CXX)")
    LIBRARY.parent.mkdir(exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=LIBRARY.parent, suffix=".so", delete=False) as tmp:
        cmd = [cxx, "-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-shared", "-fPIC", "-w",
               f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", tmp.name]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp.name)
        raise RuntimeError(f"kernels_cpu: compiling {', '.join(s.name for s in SOURCES)} failed:\n"
                           f"{done.stderr[-2000:]}")
    os.replace(tmp.name, LIBRARY)
    return LIBRARY


def _layer_target(name: str) -> str:
    """The custom call that reads one layer of stacked operands [L, ...] in place (layer_view.h):
    peagle_gemv_bf16 -> peagle_gemv_bf16_layer, peagle_gemv_g4_to_bf16 -> peagle_gemv_g4_layer_to_bf16."""
    if name == ATTENTION_TARGET:
        return "peagle_cache_attention_layer_bf16"
    head, sep, tail = name.partition("_to_bf16")
    return f"{head}_layer{sep}{tail}"


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
    try:
        single = ((TARGET_NAME, lib.peagle_gemv_bf16), (TARGET_BF16_OUT, lib.peagle_gemv_bf16_to_bf16),
                  (ATTENTION_TARGET, lib.peagle_cache_attention_bf16), (Q7_TARGET, lib.peagle_gemv_q7),
                  (Q7_BF16_OUT, lib.peagle_gemv_q7_to_bf16), (Q4_TARGET, lib.peagle_gemv_q4),
                  (Q4_BF16_OUT, lib.peagle_gemv_q4_to_bf16), (ARGMAX_TARGET, lib.peagle_argmax_f32),
                  (GLU_TARGET, lib.peagle_gemv_glu_bf16_to_bf16), (G4_TARGET, lib.peagle_gemv_g4),
                  (G4_BF16_OUT, lib.peagle_gemv_g4_to_bf16), (G8_TARGET, lib.peagle_gemv_g8),
                  (G8_BF16_OUT, lib.peagle_gemv_g8_to_bf16))
        # Each matmul and the attention also read a layer of stacked operands (`_layer_target`).
        layered = tuple((_layer_target(n), getattr(lib, _layer_target(n))) for n, _ in single if n != ARGMAX_TARGET)
        for name, fn in single + layered:
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(fn), platform="cpu")
    except jax.errors.JaxRuntimeError as e:
        return f"jaxlib {jax.lib.__version__} refused {LIBRARY.name}: {e}"
    return None


def available() -> bool:
    """Whether the custom call is built, loadable and registered on this CPU."""
    return unavailable_reason() is None


def pack(w: BFloat16[Array, "I O"]) -> BFloat16[Array, "T J 64"]:
    """[I, O] -> [O/32, J, 64], J = ceil(I/2) rounded up to a multiple of 16: each 32-column
    tile contiguous, so a thread streams it in order; per input pair j, column c's two weights
    w[2j, c], w[2j + 1, c] side by side (one 32-bit lane: AMX's operand layout, gemv_bf16.cc).
    Rows past I are zero."""
    i, o = w.shape
    if o % TILE:
        raise ValueError(f"kernels_cpu.pack: the output width {o} is not a multiple of {TILE}")
    pairs = ((i + 1) // 2 + 15) // 16 * 16
    w = jnp.concatenate([w.astype(jnp.bfloat16), jnp.zeros((2 * pairs - i, o), jnp.bfloat16)])
    return w.reshape(pairs, 2, o // TILE, TILE).transpose(2, 0, 3, 1).reshape(o // TILE, pairs, 2 * TILE)


def pack_q7(w: Float[Array, "I O"]) -> UInt8[Array, "T S 64"]:
    """[I, O] -> [O/32, 2 + J, 64] uint8, J = ceil(I/2): weight-only 7-bit quantization per output
    column (symmetric, scale = max |w[:, c]| / 63), each weight w7 stored as the byte w7 + 64.
    Per 32-column tile, the tile's float32 scales (their bytes, 2 rows), then per input pair j
    each column's two bytes side by side (`pack`'s pair layout; gemv_quant.cc says why 7 bits).
    Half the bytes of `pack`, for matmuls whose rounding may move: a draft head's (its drafts
    are verified)."""
    i, o = w.shape
    if o % TILE:
        raise ValueError(f"kernels_cpu.pack_q7: the output width {o} is not a multiple of {TILE}")
    w = jnp.asarray(w, jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(w), axis=0), 1e-30) / 63.0
    q = (jnp.clip(jnp.round(w / scale), -63, 63) + 64).astype(jnp.uint8)
    pairs = (i + 1) // 2
    q = jnp.concatenate([q, jnp.full((2 * pairs - i, o), 64, jnp.uint8)])  # a pad row weighs 0
    q = q.reshape(pairs, 2, o // TILE, TILE).transpose(2, 0, 3, 1).reshape(o // TILE, pairs, 2 * TILE)
    scale_bytes = jax.lax.bitcast_convert_type(scale, jnp.uint8).reshape(o // TILE, Q7_SCALE_ROWS, 2 * TILE)
    return jnp.concatenate([scale_bytes, q], axis=1)


def unpack_q7(packed: UInt8[Array, "T S 64"], in_features: int) -> Float[Array, "I O"]:
    """The float32 weights [in_features, O] that `pack_q7` stands for (scale times w7)."""
    t = packed.shape[0]
    scale = jax.lax.bitcast_convert_type(packed[:, :Q7_SCALE_ROWS].reshape(t, TILE, 4), jnp.float32)
    q = packed[:, Q7_SCALE_ROWS:].reshape(t, -1, TILE, 2).astype(jnp.float32) - 64.0  # [T, J, 32, 2]
    w = (q * scale[:, None, :, None]).transpose(1, 3, 0, 2).reshape(-1, t * TILE)
    return w[:in_features]


def pack_q4(w: Float[Array, "I O"]) -> UInt8[Array, "T S 32"]:
    """[I, O] -> [O/32, 4 + J, 32] uint8, J = ceil(I/2): weight-only 4-bit quantization per output
    column (symmetric, w4 in [-7, 7] stored as the nibble w4 + 8). Each column's scale is the
    clip of max |w| (`Q4_CLIPS`) with the least squared error: at 4 bits a column's largest
    weight would otherwise set a step too coarse for all the others (on the shipped P-EAGLE
    head, absmax scales cost 3-4% of the acceptance length, the searched ones 1.5%).
    Per 32-column tile, the float32 scales (their bytes, 4 rows), then per input pair j 32 bytes:
    byte 2c + e holds input 2j + e of column c in its low nibble and of column c + 16 in its high
    one (gemv_quant.cc). A quarter of `pack`'s bytes, for a draft head's matmuls (its drafts are
    verified)."""
    i, o = w.shape
    if o % TILE:
        raise ValueError(f"kernels_cpu.pack_q4: the output width {o} is not a multiple of {TILE}")
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(w), axis=0), 1e-30)

    def squared_error(scale):
        return jnp.sum((jnp.clip(jnp.round(w / scale), -7, 7) * scale - w) ** 2, axis=0)

    best_scale = amax * Q4_CLIPS[0] / 7.0
    best_err = squared_error(best_scale)
    for clip in Q4_CLIPS[1:]:  # one clip at a time: all at once would hold len(Q4_CLIPS) copies of w
        scale = amax * clip / 7.0
        err = squared_error(scale)
        best_err, best_scale = jnp.where(err < best_err, err, best_err), jnp.where(err < best_err, scale, best_scale)
    q = (jnp.clip(jnp.round(w / best_scale), -7, 7) + 8).astype(jnp.uint8)
    pairs = (i + 1) // 2
    q = jnp.concatenate([q, jnp.full((2 * pairs - i, o), 8, jnp.uint8)])  # a pad row weighs 0
    q = q.reshape(pairs, 2, o // TILE, 2, TILE // 2).transpose(2, 0, 4, 1, 3)  # [T, J, c, e, half]
    q = (q[..., 0] | (q[..., 1] << 4)).reshape(o // TILE, pairs, TILE)
    scale_bytes = jax.lax.bitcast_convert_type(best_scale, jnp.uint8).reshape(o // TILE, Q4_SCALE_ROWS, TILE)
    return jnp.concatenate([scale_bytes, q], axis=1)


def unpack_q4(packed: UInt8[Array, "T S 32"], in_features: int) -> Float[Array, "I O"]:
    """The float32 weights [in_features, O] that `pack_q4` stands for (scale times w4)."""
    t = packed.shape[0]
    scale = jax.lax.bitcast_convert_type(packed[:, :Q4_SCALE_ROWS].reshape(t, TILE, 4), jnp.float32)
    b = packed[:, Q4_SCALE_ROWS:].reshape(t, -1, TILE // 2, 2)  # [T, J, c, e]
    q = jnp.stack([b & 0xF, b >> 4], axis=-1).astype(jnp.float32) - 8.0  # [T, J, c, e, half]
    q = q.transpose(0, 1, 4, 2, 3).reshape(t, -1, TILE, 2)  # [T, J, 32, e]
    w = (q * scale[:, None, :, None]).transpose(1, 3, 0, 2).reshape(-1, t * TILE)
    return w[:in_features]


def pack_g4(q: UInt8[np.ndarray, "I O"], scale: Float[np.ndarray, "G O"],
            minimum: Float[np.ndarray, "G O"]) -> UInt8[np.ndarray, "T G 768"]:
    """A target weight w = scale * q - min in groups of 32 inputs (q in [0, 15]: a GGUF file's
    Q4_0 / Q4_1 / Q4_K blocks, `peagle_jax.checkpoints.gguf_blocks`) -> [O/32, I/32, 768] uint8:
    per 32-column tile, per group, the 32 float32 scales, the 32 mins, then per input pair j 32
    bytes, byte 2c + e holding q[2j + e, c] in its low nibble and q[2j + e, c + 16] in its high one
    (gemv_group.cc). Numpy, at load time."""
    i, o = q.shape
    if o % TILE or i % G4_GROUP or scale.shape != (i // G4_GROUP, o) or minimum.shape != scale.shape:
        raise ValueError(f"kernels_cpu.pack_g4: q {q.shape}, scale {scale.shape}, min {minimum.shape} do not make "
                         f"[I, O] weights with I a multiple of {G4_GROUP} and O of {TILE}")
    t, g = o // TILE, i // G4_GROUP
    qt = np.asarray(q, np.uint8).reshape(g, G4_GROUP // 2, 2, t, TILE).transpose(3, 0, 1, 2, 4)  # [T, G, j, e, c]
    nibbles = (qt[..., :TILE // 2] | (qt[..., TILE // 2:] << 4)).swapaxes(-1, -2).reshape(t, g, -1)
    return np.concatenate([_tile_floats(scale, t), _tile_floats(minimum, t), nibbles], axis=-1)


def pack_g8(q: Int8[np.ndarray, "I O"], scale: Float[np.ndarray, "G O"]) -> UInt8[np.ndarray, "T G 640"]:
    """A target weight w = scale * q in groups of 16 inputs (q int8: a GGUF file's Q8_0 / Q6_K /
    Q5_0 blocks) -> [O/32, I/16, 640] uint8: per tile and group, the 32 float32 scales, then per
    input pair j 64 bytes, byte 2c + e holding q[2j + e, c] (gemv_group.cc). Numpy, at load time."""
    i, o = q.shape
    if o % TILE or i % G8_GROUP or scale.shape != (i // G8_GROUP, o):
        raise ValueError(f"kernels_cpu.pack_g8: q {q.shape}, scale {scale.shape} do not make [I, O] weights "
                         f"with I a multiple of {G8_GROUP} and O of {TILE}")
    t, g = o // TILE, i // G8_GROUP
    qt = np.asarray(q, np.int8).view(np.uint8).reshape(g, G8_GROUP // 2, 2, t, TILE).transpose(3, 0, 1, 4, 2)
    return np.concatenate([_tile_floats(scale, t), qt.reshape(t, g, G8_GROUP * TILE)], axis=-1)


def _tile_floats(v: Float[np.ndarray, "G O"], tiles: int) -> UInt8[np.ndarray, "T G 128"]:
    """Per-group, per-column float32s as each tile's 32 of them per group, in bytes."""
    g = v.shape[0]
    return np.ascontiguousarray(np.asarray(v, "<f4").reshape(g, tiles, TILE).transpose(1, 0, 2)).view(np.uint8)


def quantize_group(w: Float[np.ndarray, "I O"], fmt: str) -> UInt8[np.ndarray, "T G _"]:
    """Float weights [I, O] in a group format, packed (`pack_g4` / `pack_g8`): a draft head's
    weights, quantized at load time for CPUs whose integer group loop (gemv_group.cc) streams
    them faster than bf16 (docs/cpu-kernels.md). "g4": per group of 32 inputs and column, 16
    levels over the group's range (w = scale * q - min, as a GGUF Q4_1 block); "g8": per group
    of 16, w = scale * q with q in [-127, 127] (as Q8_0). Numpy."""
    size = {"g4": G4_GROUP, "g8": G8_GROUP}.get(fmt)
    if size is None:
        raise ValueError(f"kernels_cpu.quantize_group: format must be 'g4' or 'g8', got {fmt!r}")
    i, o = w.shape
    if i % size or o % TILE:
        raise ValueError(f"kernels_cpu.quantize_group: {fmt} needs the input width a multiple of {size} and the "
                         f"output width of {TILE}; got [{i}, {o}]")
    g = np.asarray(w, np.float32).reshape(i // size, size, o)
    if fmt == "g4":
        low, high = g.min(axis=1), g.max(axis=1)
        scale = (high - low) / 15.0
        q = np.rint((g - low[:, None]) / np.where(scale > 0, scale, 1.0)[:, None])
        return pack_g4(np.clip(q, 0, 15).astype(np.uint8).reshape(i, o), scale, -low)
    scale = np.abs(g).max(axis=1) / 127.0
    q = np.rint(g / np.where(scale > 0, scale, 1.0)[:, None])
    return pack_g8(np.clip(q, -127, 127).astype(np.int8).reshape(i, o), scale)


def unpack_group(packed: UInt8[Array, "T G R"]) -> Float[Array, "I O"]:
    """The float32 weights [I, O] that `pack_g4` or `pack_g8` packed (jnp, so it also runs in a
    graph)."""
    t, g, record = packed.shape
    floats = jax.lax.bitcast_convert_type(packed[..., :record - _GROUP_BYTES[record]].reshape(t, g, -1, TILE, 4),
                                          jnp.float32)  # [T, G, 1 or 2, 32]
    body = packed[..., record - _GROUP_BYTES[record]:]
    if record == G4_RECORD:
        b = body.reshape(t, g, G4_GROUP // 2, TILE // 2, 2).swapaxes(-1, -2)  # [T, G, j, e, c < 16]
        q = jnp.concatenate([b & 0xF, b >> 4], axis=-1).reshape(t, g, G4_GROUP, TILE).astype(jnp.float32)
        w = q * floats[:, :, None, 0] - floats[:, :, None, 1]
    else:
        q = jax.lax.bitcast_convert_type(body, jnp.int8).reshape(t, g, G8_GROUP // 2, TILE, 2)
        q = q.swapaxes(-1, -2).reshape(t, g, G8_GROUP, TILE).astype(jnp.float32)
        w = q * floats[:, :, None, 0]
    return w.transpose(1, 2, 0, 3).reshape(-1, t * TILE)


_GROUP_BYTES = {G4_RECORD: G4_GROUP * TILE // 2, G8_RECORD: G8_GROUP * TILE}  # a record's weight bytes


def matmul(x: BFloat16[Array, "*lead I"],
           packed: BFloat16[Array, "*L T J 64"] | UInt8[Array, "*L T S _"],
           out_dtype=jnp.float32, *, glu: bool = False, layer: Int[Array, ""] | None = None) -> Float[Array, "*lead O"]:
    """x @ w summed in float32, w given as `pack(w)`, `pack_q7(w)` or `pack_q4(w)` (bytes 64 or 32
    wide); any number of leading
    rows. With out_dtype bfloat16 the kernel rounds the sums itself (to nearest even, the bits
    XLA's convert gives), which spares the graph a convert after every call.

    `glu=True` (bf16 weights and result): x is [..., 2I], a SwiGLU MLP's gate and up outputs
    side by side, and the product is taken of bf16(SiLU(gate) * up) (SiLU rounded to bf16 as
    `jax.nn.silu` in bf16 is, then the product), computed while the rows are prepared.

    `layer`: `packed` is a stack of L packings [L, ...] (a scanned target's, models/layer_stack.py)
    and the call reads layer `layer` of it in place."""
    stacked = layer is not None
    if stacked != (packed.ndim == 4):
        raise ValueError(f"kernels_cpu.matmul: stacked weights [L, ...] go with a layer index and single ones "
                         f"without; got weights {packed.shape} and layer {layer!r}")
    one = packed.shape[1:] if stacked else packed.shape  # one layer's packing
    lead, i = x.shape[:-1], x.shape[-1]
    rows = 1
    for d in lead:
        rows *= d
    bf16_out = jnp.dtype(out_dtype) == jnp.bfloat16
    if not bf16_out and jnp.dtype(out_dtype) != jnp.float32:
        raise ValueError(f"kernels_cpu.matmul: out_dtype must be float32 or bfloat16, got {out_dtype}")
    shape = jax.ShapeDtypeStruct((rows, one[0] * TILE), jnp.bfloat16 if bf16_out else jnp.float32)
    if glu:
        if packed.dtype == jnp.uint8 or not bf16_out or i % 2:
            raise ValueError("kernels_cpu.matmul(glu=True): bf16-packed weights, a bfloat16 result and an even "
                             f"input width (gate | up) only; got {packed.dtype} weights, {jnp.dtype(out_dtype)}, "
                             f"width {i}")
        target = GLU_TARGET
    elif packed.dtype == jnp.uint8 and one[-1] in (G4_RECORD, G8_RECORD):
        g4 = one[-1] == G4_RECORD
        if i != one[1] * (G4_GROUP if g4 else G8_GROUP):
            raise ValueError(f"kernels_cpu.matmul: {i} inputs do not match group-packed weights {one}")
        target = (G4_BF16_OUT if bf16_out else G4_TARGET) if g4 else (G8_BF16_OUT if bf16_out else G8_TARGET)
    elif packed.dtype == jnp.uint8 and one[-1] == TILE:
        target = Q4_BF16_OUT if bf16_out else Q4_TARGET
    elif packed.dtype == jnp.uint8:
        target = Q7_BF16_OUT if bf16_out else Q7_TARGET
    else:
        target = TARGET_BF16_OUT if bf16_out else TARGET_NAME
    operands = (x.reshape(rows, i).astype(jnp.bfloat16), packed)
    if stacked:
        target, operands = _layer_target(target), (*operands, jnp.asarray(layer, jnp.int32))
    out = jax.ffi.ffi_call(target, shape)(*operands)
    return out.reshape(*lead, one[0] * TILE)


def argmax(logits: Float[Array, "*lead V"]) -> Int[Array, "*lead"]:
    """The lowest index of each row's maximum over the last axis (`jnp.argmax`), a row holding a
    NaN giving the last index (`peagle_jax.sampling.greedy_token`'s convention); float32 only."""
    if logits.dtype != jnp.float32:
        raise ValueError(f"kernels_cpu.argmax: float32 logits only, got {logits.dtype}")
    lead, v = logits.shape[:-1], logits.shape[-1]
    rows = 1
    for d in lead:
        rows *= d
    out = jax.ffi.ffi_call(ARGMAX_TARGET, jax.ShapeDtypeStruct((rows,), jnp.int32))(logits.reshape(rows, v))
    return out.reshape(lead)


def cache_attention(
    q: BFloat16[Array, "B T H D"],
    k_cache: BFloat16[Array, "B *L KVH S D"],
    v_cache: BFloat16[Array, "B *L KVH S D"],
    q_positions: Int[Array, "B T"],
    *,
    sm_scale: float | None = None,
    skip_lo: Int[Array, "B T"] | None = None,
    skip_hi: Int[Array, "B T"] | None = None,
    layer: Int[Array, ""] | None = None,
) -> BFloat16[Array, "B T H D"]:
    """Query row (b, t) attends to cache rows s <= q_positions[b, t] outside [skip_lo, skip_hi)
    (the layout and mask of `kernels_pallas.cache_attention`), softmax in float32; bf16 in and out.
    Each row sums over its own visible keys in increasing position, whatever shares the call
    (attention_bf16.cc), so its bits do not depend on the row count.

    `layer`: the caches are a scanned target's stacks [B, L, KVH, S, D] (`cache.StackedKV`),
    read at layer `layer` in place."""
    if (layer is not None) != (k_cache.ndim == 5):
        raise ValueError(f"kernels_cpu.cache_attention: stacked caches [B, L, KVH, S, D] go with a layer index and "
                         f"single ones without; got {k_cache.shape} and layer {layer!r}")
    b, t, h, d = q.shape
    kv_heads = k_cache.shape[-3]
    if k_cache.dtype != jnp.bfloat16 or v_cache.dtype != jnp.bfloat16:
        raise ValueError(f"kernels_cpu.cache_attention: bf16 caches only, got {k_cache.dtype} / {v_cache.dtype}")
    if d % 8 or d > 256 or h % kv_heads:
        raise ValueError(f"kernels_cpu.cache_attention: head_dim {d} must be a multiple of 8 up to 256, and the "
                         f"{h} query heads a multiple of the {kv_heads} kv heads")
    if (why := unavailable_reason()) is not None:  # builds and registers the library on first use
        raise RuntimeError(f"kernels_cpu.cache_attention cannot run here: {why}")
    if sm_scale is None:
        sm_scale = 1.0 / float(d) ** 0.5
    if (skip_lo is None) != (skip_hi is None):
        raise ValueError("skip_lo and skip_hi go together: pass both or neither")
    if skip_lo is None:
        skip_lo = skip_hi = jnp.zeros((b, t), jnp.int32)
    operands = (q.astype(jnp.bfloat16), k_cache, v_cache, q_positions.astype(jnp.int32), skip_lo.astype(jnp.int32),
                skip_hi.astype(jnp.int32))
    target = ATTENTION_TARGET
    if layer is not None:
        target, operands = _layer_target(target), (*operands, jnp.asarray(layer, jnp.int32))
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16))(*operands,
                                                                                    scale=np.float32(sm_scale))
    return out.astype(q.dtype)
