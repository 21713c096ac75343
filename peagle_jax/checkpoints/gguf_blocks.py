"""A GGUF weight's own integers and per-group scales, for the CPU kernel's quantized target
weights (`kernels.pack_g4` / `pack_g8`, docs/cpu-kernels.md).

llama.cpp's block formats all store w = scale * q - min over small groups of consecutive
inputs. The ones the supported files use map exactly onto two kernel formats, with no
rounding: every scale and min below is a float16 times a small integer, exact in float32.

  4-bit groups of 32, w = scale * q - min, q in [0, 15]:  Q4_0, Q4_1, Q4_K
  8-bit groups of 16, w = scale * q, q in [-128, 127]:    Q8_0, Q6_K, Q5_0

Other types (F32, F16, BF16, Q5_1, Q5_K, Q2_K, Q3_K, the IQ formats) return None: their
weights stay in bf16 on the kernel (`models.options.pack_cpu_matmuls`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T
from jaxtyping import Float, Int8, UInt8

G4_GROUP = 32
G8_GROUP = 16


@dataclass(frozen=True)
class GroupWeights:
    """w[i, o] = scale[i // group, o] * q[i, o] - min[i // group, o], inputs along axis 0 (the
    [in, out] orientation of a Linear's kernel)."""

    format: str  # "g4" or "g8"
    q: UInt8[np.ndarray, "I O"] | Int8[np.ndarray, "I O"]
    scale: Float[np.ndarray, "G O"]
    min: Float[np.ndarray, "G O"] | None  # None for "g8"

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def dequantize(self) -> Float[np.ndarray, "I O"]:
        """The float32 weights (a test reference; the kernel never builds them)."""
        group = G4_GROUP if self.format == "g4" else G8_GROUP
        w = np.repeat(self.scale, group, axis=0) * self.q.astype(np.float32)
        return w if self.min is None else w - np.repeat(self.min, group, axis=0)


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 bytes [..., 2] -> float32 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] packed bytes -> [n, 32]: llama.cpp's order, low nibbles first, then high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(b):
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:18]), d[:, None], 8.0 * d[:, None]


def _q4_1(b):
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return _nibbles(b[:, 4:20]), d[:, None], -m[:, None]


def _q4_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    s = b[:, 4:16].reshape(n, 3, 4)  # 8 six-bit scales and mins (gguf.quants.Q4_K.get_scale_min)
    sc = np.concatenate([s[:, 0] & 0x3F, (s[:, 2] & 0x0F) | ((s[:, 0] >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([s[:, 1] & 0x3F, (s[:, 2] >> 4) | ((s[:, 1] >> 2) & 0x30)], axis=-1)
    qs = b[:, 16:144].reshape(n, 4, 32)  # 4 chunks of 32 bytes: sub-block 2k low nibbles, 2k + 1 high
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 256)
    return q, d[:, None] * sc.astype(np.float32), dmin[:, None] * mn.astype(np.float32)


def _q8_0(b):
    d = _f16(b[:, 0:2])
    return np.ascontiguousarray(b[:, 2:34]).view(np.int8), np.repeat(d[:, None], 2, axis=1), None


def _q5_0(b):
    d = _f16(b[:, 0:2])
    qh = np.ascontiguousarray(b[:, 2:6]).view("<u4")[:, :1] >> np.arange(32, dtype=np.uint32)
    q = (_nibbles(b[:, 6:22]) | ((qh & 1).astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)
    return q, np.repeat(d[:, None], 2, axis=1), None


def _q6_k(b):
    n = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    lo = ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    lo = (lo & 0x0F).reshape(n, 2, 4, 32)
    hi = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    hi = (hi & 0x03).reshape(n, 2, 4, 32)
    q = (lo | (hi << 4)).astype(np.int8).reshape(n, 256) - np.int8(32)
    return q, d[:, None] * sc, None


# type -> (format, weights per block, bytes per block, parser returning q [n, block], scale and
# min [n, groups per block])
_FORMATS = {
    T.Q4_0: ("g4", 32, 18, _q4_0),
    T.Q4_1: ("g4", 32, 20, _q4_1),
    T.Q4_K: ("g4", 256, 144, _q4_k),
    T.Q8_0: ("g8", 32, 34, _q8_0),
    T.Q5_0: ("g8", 32, 22, _q5_0),
    T.Q6_K: ("g8", 256, 210, _q6_k),
}
GROUP_TYPES = tuple(t.name for t in _FORMATS)


@dataclass(frozen=True)
class GroupTensor:
    """A GGUF tensor with an exact kernel format, parsed when `parse()` is called: a loader
    packs one tensor at a time, never holding a whole model's parsed integers."""

    format: str  # "g4" or "g8"
    shape: tuple[int, int]  # [in, out]
    parse: Callable[[], GroupWeights]


def group_tensor(data: np.ndarray, qtype: T, out_features: int, in_features: int,
                 row_order: np.ndarray | None = None) -> GroupTensor | None:
    """`group_weights`, deferred: None where the type has no exact kernel format."""
    if qtype not in _FORMATS or in_features % _FORMATS[qtype][1]:
        return None
    return GroupTensor(_FORMATS[qtype][0], (in_features, out_features),
                       lambda: group_weights(data, qtype, out_features, in_features, row_order))


def group_weights(data: np.ndarray, qtype: T, out_features: int, in_features: int,
                  row_order: np.ndarray | None = None) -> GroupWeights | None:
    """A 2-D GGUF tensor ([out, in] rows of blocks, `ReaderTensor.data`) as `GroupWeights`, or
    None where its type has no exact kernel format. `row_order` permutes the output rows (the
    loader's rotary un-permutation of llama q/k). Raises ValueError on a size mismatch."""
    if qtype not in _FORMATS:
        return None
    fmt, block, nbytes, parse = _FORMATS[qtype]
    if in_features % block:
        return None
    raw = np.asarray(data, np.uint8).reshape(-1)
    if raw.size != out_features * in_features // block * nbytes:
        raise ValueError(f"a {qtype.name} tensor of {raw.size} bytes does not hold [{out_features}, {in_features}]")
    q, scale, mn = parse(raw.reshape(-1, nbytes))
    q = q.reshape(out_features, in_features)
    scale = scale.reshape(out_features, -1)
    mn = None if mn is None else mn.reshape(out_features, -1)
    if row_order is not None:
        q, scale, mn = q[row_order], scale[row_order], None if mn is None else mn[row_order]
    return GroupWeights(fmt, np.ascontiguousarray(q.T), np.ascontiguousarray(scale.T, np.float32),
                        None if mn is None else np.ascontiguousarray(mn.T, np.float32))
