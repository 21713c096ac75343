"""GPT-OSS's expert and router tensors -> our MoE layout, MXFP4 experts included.

GPT-OSS stores each layer's experts fused: `gate_up_proj` [E, D, 2I] with the gate and up
columns interleaved (gate at even columns, up at odd), `down_proj` [E, I, D], each with a bias
[E, out]. The released checkpoints keep the expert weights in MXFP4 instead: `*_blocks`
[E, out, D/32, 16] (two 4-bit e2m1 values a byte, the low nibble first) and `*_scales`
[E, out, D/32] (a power of two a block of 32, biased by 127), which `dequantize_mxfp4` expands to
[E, in, out]. The router is a biased Linear (`mlp.router`), the attention sinks one logit per
head (`self_attn.sinks`).
"""

from __future__ import annotations

import re

import numpy as np
from jaxtyping import Float, UInt8

from peagle_jax.checkpoints.params import CheckpointError

# The 16 values of a 4-bit e2m1 code: sign bit, then 2 exponent bits and 1 mantissa bit.
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    np.float32)

_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")
_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.router\.(weight|bias)")
_SINKS = re.compile(r"model\.layers\.(\d+)\.self_attn\.sinks")


def dequantize_mxfp4(blocks: UInt8[np.ndarray, "..."], scales: UInt8[np.ndarray, "..."]
                     ) -> Float[np.ndarray, "E I O"]:
    """MXFP4 expert weights, blocks [E, out, G, 16] and scales [E, out, G] (checked here, with a
    message naming both shapes), as float32 [E, in, out] (in = 32 G): each byte holds two e2m1
    codes, the low nibble the earlier column, and each block of 32 is scaled by 2^(scale - 127)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} / {scales.dtype}")
    if blocks.ndim != 4 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not fit scales {scales.shape} (expected [..., G, 16] "
                         "beside [..., G])")
    values = np.empty(blocks.shape[:-1] + (32,), np.float32)
    values[..., 0::2] = FP4_E2M1[blocks & 0x0F]
    values[..., 1::2] = FP4_E2M1[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    e, o, g, _ = values.shape
    return np.swapaxes(values.reshape(e, o, g * 32), 1, 2)


def convert_gpt_oss_tensors(named: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(our tensors for GPT-OSS's experts, router and sinks; the rest of `named`, untouched)."""
    out: dict[str, np.ndarray] = {}
    rest: dict[str, np.ndarray] = {}
    quantized: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for name, arr in named.items():
        if m := _EXPERTS.fullmatch(name):
            layer, proj, suffix = m[1], m[2], m[3] or ""
            if suffix in ("_blocks", "_scales"):
                quantized.setdefault((layer, proj), {})[suffix] = arr
            else:
                out.update(_expert_tensors(layer, proj, suffix, arr))
        elif m := _ROUTER.fullmatch(name):
            weight = m[2] == "weight"
            out[f"layers.{m[1]}.mlp.gate.{'kernel' if weight else 'bias'}"] = arr.T if weight else arr
        elif m := _SINKS.fullmatch(name):
            out[f"layers.{m[1]}.self_attn.sinks"] = arr
        else:
            rest[name] = arr
    for (layer, proj), parts in quantized.items():
        if set(parts) != {"_blocks", "_scales"}:
            absent = ({"_blocks", "_scales"} - set(parts)).pop()
            raise CheckpointError(f"checkpoint has model.layers.{layer}.mlp.experts.{proj}{next(iter(parts))} "
                                  f"but not its model.layers.{layer}.mlp.experts.{proj}{absent} (MXFP4 needs both)")
        out.update(_expert_tensors(layer, proj, "", dequantize_mxfp4(parts["_blocks"], parts["_scales"])))
    return out, rest


def _expert_tensors(layer: str, proj: str, suffix: str, arr: np.ndarray) -> dict[str, np.ndarray]:
    """One fused expert tensor [E, in, out] (or its bias [E, out]) as our per-projection stacks."""
    prefix = f"layers.{layer}.mlp."
    if proj == "down_proj":
        return {prefix + ("down_bias" if suffix else "down_proj"): arr}
    gate, up = arr[..., 0::2], arr[..., 1::2]  # interleaved columns
    if suffix:
        return {prefix + "gate_bias": gate, prefix + "up_bias": up}
    return {prefix + "gate_proj": gate, prefix + "up_proj": up}
