"""Building blocks shared by the target models and the draft head (Flax NNX)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from peagle_jax import kernels
from peagle_jax.cache import LayerKV, LayerSlot


class RMSNorm(nnx.Module):
    """RMSNorm computed in fp32, as HF Llama/Qwen do, then cast back."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


_TRAINING_ON_KERNEL: contextvars.ContextVar = contextvars.ContextVar("training_on_kernel", default=False)


@contextlib.contextmanager
def training_matmuls_on_cpu_kernel():
    """Within the block, `matmul` runs on the CPU kernel with its gradients there too
    (`kernels.trainable_matmul`, bf16 operands): a draft head's training step on a CPU with
    AMX tiles (peagle_jax/train/train.py). Trace-time only."""
    token = _TRAINING_ON_KERNEL.set(True)
    try:
        yield
    finally:
        _TRAINING_ON_KERNEL.reset(token)


def matmul(x: Float[Array, "... I"], w: Float[Array, "I O"], *, out_dtype=None) -> Float[Array, "... O"]:
    """x @ w over the last axis, never computed as a one-row product on CPU.

    XLA:CPU lowers a bf16 dot with a single left-hand row to a matrix-vector loop that is
    several times slower than its 2-7 row matrix multiply (measured: a 49k-wide lm_head row
    took 60-70 ms, two rows 5 ms), and rounds differently. A lone row is padded to two and the
    pad dropped, so a 1-row decode step costs what a 2-row one does and gives the same values
    as a row of a K+1-row verify (tests/generate/test_row_invariance.py). `out_dtype` is the result and
    accumulation dtype (float32 for logits); default: the promoted input dtype. Within
    `training_matmuls_on_cpu_kernel` the product runs on the CPU kernel instead, where it fits.
    """
    lead = x.shape[:-1]
    if _TRAINING_ON_KERNEL.get() and kernels.trainable_fits(x, w):
        y = kernels.trainable_matmul(x.reshape(-1, x.shape[-1]), w).reshape(lead + (w.shape[-1],))
        return y.astype(out_dtype or jnp.result_type(x.dtype, w.dtype))
    if math.prod(lead) != 1 or jax.default_backend() != "cpu":
        return jnp.matmul(x, w, preferred_element_type=out_dtype)
    x3 = jnp.pad(x.reshape(1, 1, x.shape[-1]), ((0, 0), (0, 1), (0, 0)))
    # The barrier keeps XLA from folding the slice back into a one-row product.
    y = jax.lax.optimization_barrier(jnp.matmul(x3, w, preferred_element_type=out_dtype))[:, :1]
    return y.reshape(lead + (w.shape[-1],))


class PackedKernel(nnx.Variable):
    """A weight packed tile-major for `kernels.matmul` (an inference copy of a kernel; not trained)."""


KERNEL_MAX_ROWS = 32
"""Rows per sequence up to which `kernels.matmul` runs on a CPU without AMX: decode steps,
verifies and draft passes. Longer calls (prompt prefill) stay on XLA there, whose large matrix
multiply beats the FMA loops. With AMX the kernel takes every call: its tiles are faster than
XLA's at prefill too (a 160-token SmolLM2 prompt: 150 -> 120 ms with both kernels,
docs/cpu-kernels.md).
Plain and speculative decoding prefill a prompt through the same calls, so this split never
makes one method's tokens differ from the other's."""


@functools.cache
def kernel_max_rows() -> int | None:
    """`KERNEL_MAX_ROWS`, or None (no limit) where the matmul kernel runs on AMX tiles."""
    return None if kernels.cpu.instruction_set() == "amx" else KERNEL_MAX_ROWS


def uses_cpu_kernel(x: Float[Array, "... I"], packed: PackedKernel | None) -> bool:
    """Whether this call goes to `kernels.matmul`: a packed weight exists and the call is
    within `kernel_max_rows()` rows per sequence, or the weight is a GGUF file's blocks (their
    only copy, `models.options.pack_cpu_matmuls`). Decided at trace time."""
    if packed is None:
        return False
    limit = kernel_max_rows()
    return limit is None or (x.shape[-2] if x.ndim >= 2 else 1) <= limit or kernels.is_group_packed(packed[...])


def packed_matmul(x: Float[Array, "... I"], packed: PackedKernel | None, w: Float[Array, "I O"] | None, *,
                  out_dtype=None) -> Float[Array, "... O"]:
    """x @ w through the row-invariant CPU custom call when `packed` holds `kernels.pack(w)`
    and the call is decode-sized (`uses_cpu_kernel`), else through `matmul`. w is None where
    `packed` is a GGUF file's blocks, the weight's only copy."""
    if not uses_cpu_kernel(x, packed):
        return matmul(x, w, out_dtype=out_dtype)

    return kernel_matmul(x, packed, out_dtype or (x.dtype if w is None else jnp.result_type(x.dtype, w.dtype)))


_SCAN_LAYER: contextvars.ContextVar = contextvars.ContextVar("scan_layer", default=None)


@contextlib.contextmanager
def reading_layer(index: Int[Array, ""]):
    """Within the block (one step of a scan over stacked layers, `models.layer_stack`), the CPU
    kernels read layer `index` of the stacked packed weights in place: slicing it out in the
    graph would have XLA:CPU copy it before every call. Trace-time only."""
    token = _SCAN_LAYER.set(index)
    try:
        yield
    finally:
        _SCAN_LAYER.reset(token)


def packed_call(x: Float[Array, "... I"], packed: jax.Array, out_dtype, *, glu: bool = False) -> Float[Array, "... O"]:
    """`kernels.matmul(x, packed, out_dtype, glu=glu)`, at the scan's layer (`reading_layer`)
    where `packed` is a stack of every layer's packing."""
    layer = None
    if packed.ndim == 4:  # every single packing is [tiles, rows, bytes or pairs]
        layer = _SCAN_LAYER.get()
        if layer is None:
            raise ValueError(f"stacked packed weights {packed.shape} are read inside a scan step (reading_layer)")
    return kernels.matmul(x, packed, out_dtype, glu=glu, layer=layer)


def kernel_matmul(x: Float[Array, "... I"], packed: PackedKernel, out_dtype) -> Float[Array, "... O"]:
    """`kernels.matmul` with its result in `out_dtype`: a bf16 result is rounded in the
    kernel (the bits of converting its float32 sums), anything else converted from float32."""
    return packed_call(x, packed[...], out_dtype)


def fused_linears(x: Float[Array, "... I"], packed: PackedKernel | None, linears: tuple[Linear, ...]) -> tuple:
    """Each of `linears` applied to x. With `packed` (their kernels packed side by side, see
    `models.options.pack_cpu_matmuls`) and a decode-sized x, one kernel call computes all of
    them: fewer, larger calls split better over the cores, and since output columns never mix,
    each output has exactly the bits of that Linear's own kernel call."""
    if not uses_cpu_kernel(x, packed):
        return tuple(linear(x) for linear in linears)
    weight = linears[0].kernel
    y = kernel_matmul(x, packed, x.dtype if weight is None else jnp.result_type(x.dtype, weight.dtype))
    edges = np.cumsum([linear.out_features for linear in linears])[:-1]
    return tuple(part if linear.bias is None else part + linear.bias[...]
                 for part, linear in zip(jnp.split(y, edges, axis=-1), linears, strict=True))


class Linear(nnx.Module):
    """y = x @ W (+ b), W stored [in, out] (the transpose of torch's [out, in])."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype, rngs: nnx.Rngs, std: float = 0.02):
        self.in_features, self.out_features = d_in, d_out
        # None where a GGUF file's blocks are the only copy (kernel_packed, models.options)
        self.kernel = nnx.Param(std * jax.random.normal(rngs.params(), (d_in, d_out), dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None
        self.kernel_scale = nnx.data(None)  # per-output-channel scale of an FP8 kernel (models.options)
        self.kernel_packed = nnx.data(None)  # PackedKernel for kernels.matmul (models.options)

    def __call__(self, x: Float[Array, "... I"]) -> Float[Array, "... O"]:
        if self.kernel_scale is not None:  # FP8 weights: dequantize after the matmul (per column)
            y = matmul(x, self.kernel[...].astype(x.dtype)) * self.kernel_scale[...].astype(x.dtype)
        else:
            y = packed_matmul(x, self.kernel_packed, None if self.kernel is None else self.kernel[...])
        if self.bias is not None:
            y = y + self.bias[...]
        return y


def rope_inv_freq(head_dim: int, theta: float, scaling: tuple | None) -> jax.Array:
    """Inverse frequencies, including HF's llama3 and linear scaling rules."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if not scaling:
        return inv
    s = dict(scaling)
    rtype = s.get("rope_type", s.get("type"))
    factor = float(s.get("factor", 1.0))
    if rtype == "linear":
        return inv / factor
    if rtype == "freq_factors":  # GGUF rope_freqs.weight: per-frequency divisors (llama3 files)
        return inv / jnp.asarray(s["factors"], jnp.float32)
    if rtype == "llama3":
        low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_ctx = float(s["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(medium, smoothed, scaled)
    if rtype == "yarn":
        return _yarn_inv_freq(inv, head_dim, theta, s)
    raise ValueError(f"unsupported rope scaling {rtype!r}")


def _yarn_inv_freq(inv: jax.Array, head_dim: int, theta: float, s: dict) -> jax.Array:
    """YaRN (arXiv 2309.00071), as HF computes it: frequencies that turn fewer than `beta_slow`
    times over the original context are interpolated by `factor`, those that turn more than
    `beta_fast` times are kept, and a linear ramp over the dimensions blends the two."""
    factor, old_ctx = float(s["factor"]), float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)
    dim_at = lambda turns: head_dim * math.log(old_ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_at(beta_fast), dim_at(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def rope_attention_factor(scaling: tuple | None) -> float:
    """The factor YaRN multiplies cos and sin by (1 for every other rule): its `attention_factor`,
    else 0.1 ln(factor) + 1, or the ratio of the two `mscale` forms where both are given."""
    s = dict(scaling or ())
    if s.get("rope_type", s.get("type")) != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])
    mscale = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(float(s["mscale"])) / mscale(float(s["mscale_all_dim"]))
    return mscale(1.0)


class RotaryAngles(NamedTuple):
    """cos and sin of every row's rotary angles, [B, T, 1, D/2] each: computed once per forward
    and shared by all layers (per layer, XLA:CPU recomputed them inside each consumer fusion: 240
    transcendental loops a SmolLM2 forward, 0.66 ms at 4 rows)."""

    cos: Float[Array, "B T 1 D2"]
    sin: Float[Array, "B T 1 D2"]


def rotary_angles(positions: Int[Array, "B T"], inv_freq: Float[Array, " D2"], scale: float = 1.0) -> RotaryAngles:
    """The angles of `apply_rope`, materialized once (the barrier keeps XLA from fusing the
    cos/sin back into every layer's rotation); `scale` multiplies both (YaRN's attention factor)."""
    freqs = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos, sin = jax.lax.optimization_barrier((cos, sin))
    return RotaryAngles(cos[:, :, None, :], sin[:, :, None, :])


def apply_rope(x: Float[Array, "B T N D"], angles: RotaryAngles) -> Float[Array, "B T N D"]:
    """Rotary embedding in HF's rotate-half layout (first and second halves pair up)."""
    cos, sin = angles
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class AttentionWindow(nnx.Variable):
    """How many positions a layer attends back over, held as data rather than as a static
    attribute, so that layers with different windows (GPT-OSS alternates 128 and all) still
    stack into one scan (`models.layer_stack`). Not trained."""


FULL_WINDOW = 1 << 30
"""The window of a full-attention layer in a model that has sliding ones: beyond any position."""


class Attention(nnx.Module):
    """GQA self-attention over a KV cache indexed by absolute position."""

    def __init__(
        self,
        d_in: int,
        d_model: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        eps: float,
        rope_theta: float,
        rope_scaling: tuple | None,
        dtype,
        rngs: nnx.Rngs,
        sinks: bool = False,
        window: int | None = None,
        windowed: bool = False,
    ):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # GPT-OSS: a learned sink logit per head, and sliding-window layers (cache_attention_reference).
        # In a model with any sliding layer (`windowed`) every layer holds its window, FULL_WINDOW if none.
        self.sinks = nnx.Param(jnp.zeros((num_heads,), dtype)) if sinks else None
        self.window = AttentionWindow(jnp.int32(FULL_WINDOW if window is None else window)) if windowed else None
        self.q_proj = Linear(d_in, num_heads * head_dim, bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d_in, num_kv_heads * head_dim, bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d_in, num_kv_heads * head_dim, bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(num_heads * head_dim, d_model, bias=o_bias, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(head_dim, eps, dtype=dtype) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, dtype=dtype) if qk_norm else None
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self.attn_impl: str | None = None  # kernels.cache_attention implementation name; None = XLA
        self.attn_interpret = False  # run a Pallas kernel in interpret mode (CPU tests)
        self.mesh = None  # set by peagle_jax.sharding.shard_module: attention runs under shard_map
        self.qkv_packed = nnx.data(None)  # q/k/v kernels packed side by side for kernels.matmul (models.options)

    def rotary(self, positions: Int[Array, "B T"]) -> RotaryAngles:
        """This layer's rotary angles at `positions` (the same for every layer of a model, so a
        forward computes them once and passes them to each)."""
        return rotary_angles(positions, rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling),
                             rope_attention_factor(self.rope_scaling))

    def project_qkv(
        self, x: Float[Array, "B T Din"], positions: Int[Array, "B T"], angles: RotaryAngles | None = None
    ) -> tuple[Float[Array, "B T N D"], Float[Array, "B T KVH D"], Float[Array, "B T KVH D"]]:
        """Rotary-embedded queries, keys and values of T rows: the seam between the
        projections and the attention itself, shared by the cached forward here and the
        training objective's document-masked attention (peagle_jax.train.objective).
        `angles`: `self.rotary(positions)`, when the caller has them already."""
        b, t, _ = x.shape
        q, k, v = fused_linears(x, self.qkv_packed, (self.q_proj, self.k_proj, self.v_proj))
        q = q.reshape(b, t, self.num_heads, self.head_dim)
        k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
        v = v.reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        angles = self.rotary(positions) if angles is None else angles
        return apply_rope(q, angles), apply_rope(k, angles), v

    def __call__(
        self, x: Float[Array, "B T Din"], positions: Int[Array, "B T"], kv: LayerKV | LayerSlot,
        slots: Int[Array, "B T"] | None = None, skip: tuple[Int[Array, "B T"], Int[Array, "B T"]] | None = None,
        angles: RotaryAngles | None = None,
    ) -> tuple[Float[Array, "B T D"], LayerKV | LayerSlot]:
        """`positions` rotate q and k (`angles`: their rotary angles, if computed already);
        `slots` (default: the positions) are the cache rows the new K/V go to and each query's
        causal limit, and `skip` hides a window of rows per query: a tree verify's second chain
        shares its positions with the first but not its rows. `kv` is this layer's cache, or its
        slot in a stacked cache under a scan (`models.layer_stack`), which reads and writes alike."""
        b, t, _ = x.shape
        q, k, v = self.project_qkv(x, positions, angles)
        slots = positions if slots is None else slots
        kv = kv.write(k, v, slots)
        attn = functools.partial(kernels.cache_attention, implementation=self.attn_impl, interpret=self.attn_interpret,
                                 **self._sink_and_window(skip))
        window = {} if skip is None else {"skip_lo": skip[0], "skip_hi": skip[1]}
        if self.mesh is not None:
            from peagle_jax.sharding import sharded_attention

            scales = (kv.k_scale, kv.v_scale) if kv.is_fp8 else ()
            attend = sharded_attention(attn, self.mesh, b, self.num_kv_heads, fp8=kv.is_fp8, skip=skip is not None)
            out = attend(q, kv.k, kv.v, slots, *(() if skip is None else skip), *scales)
        elif kv.is_fp8:
            out = attn(q, kv.k, kv.v, slots, k_scale=kv.k_scale, v_scale=kv.v_scale, **window)
        elif isinstance(kv, LayerSlot):  # the CPU kernel reads the layer of the stack in place
            out = attn(q, kv.stack.k, kv.stack.v, slots, layer=kv.index, **window)
        else:
            out = attn(q, kv.k, kv.v, slots, **window)
        return self.o_proj(out.reshape(b, t, -1)), kv

    def _sink_and_window(self, skip) -> dict:
        """The GPT-OSS arguments of `kernels.cache_attention`, where this layer has them."""
        if self.sinks is None and self.window is None:
            return {}
        if self.mesh is not None:
            raise ValueError("attention sinks and sliding windows do not run on a mesh yet")
        if self.window is not None and skip is not None:
            # a tree verify's second chain lies at other cache rows than its positions
            raise ValueError("a sliding-window layer cannot run a tree verify: its window counts cache rows")
        return {"sinks": None if self.sinks is None else self.sinks[...],
                "window": None if self.window is None else self.window[...]}


def silu(x: Float[Array, "..."]) -> Float[Array, "..."]:
    """SiLU computed in float32 and rounded once to x's dtype, as torch computes it for bf16
    (and as the CPU kernel's gated product does, `kernels.matmul(glu=True)`); XLA's bf16
    `jax.nn.silu` rounds its steps in bf16."""
    return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


class MLP(nnx.Module):
    """SiLU-gated feed-forward block."""

    def __init__(self, d_model: int, d_ff: int, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(d_model, d_ff, bias=False, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d_model, d_ff, bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(d_ff, d_model, bias=False, dtype=dtype, rngs=rngs)
        self.gate_up_packed = nnx.data(None)  # gate/up kernels packed side by side for kernels.matmul (models.options)

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        if self.gated_in_kernel(x):
            gate_up = kernel_matmul(x, self.gate_up_packed, jnp.bfloat16)
            return packed_call(gate_up, self.down_proj.kernel_packed[...], jnp.bfloat16, glu=True)
        gate, up = fused_linears(x, self.gate_up_packed, (self.gate_proj, self.up_proj))
        return self.down_proj(silu(gate) * up)

    def gated_in_kernel(self, x: Float[Array, "... D"]) -> bool:
        """Whether SiLU(gate) * up runs inside the down projection's CPU kernel call (bf16,
        decode-sized, both matmuls packed in bf16, no biases): it spares XLA:CPU an elementwise
        pass that cost 4-11 us a layer (a profiled SmolLM2 round). Decided at trace time."""
        down = self.down_proj
        return (x.dtype == jnp.bfloat16 and uses_cpu_kernel(x, self.gate_up_packed)
                and uses_cpu_kernel(x, down.kernel_packed) and down.kernel_packed[...].dtype == jnp.bfloat16
                and down.kernel_scale is None
                and all(linear.bias is None for linear in (self.gate_proj, self.up_proj, down)))


class MoE(nnx.Module):
    """Routed top-k experts: Qwen3-MoE (softmax router, optional top-k renormalisation) and
    GPT-OSS (router bias, softmax over the top-k logits, expert biases, clamped SwiGLU).

    Experts are stacked [E, ...]. `impl` (set by `models.options.configure_inference`):
      "dense": every expert runs, with routing weights that are zero outside the top-k. One
        code path for every token count, so a token's output does not depend on how many
        rows share the forward (exact speculation), at E/top_k times the weight reads.
      "gathered": when 3 * tokens * top_k <= E, only the routed experts' weights are gathered
        (copied out, then read: about 3x their bytes) and applied, so a decode step reads far
        less than all E experts, nearer to what a grouped-GEMM MoE kernel reads; larger steps,
        where the copies would cost more than reading every expert, fall back to dense.
        Rounding can then differ between step sizes, so greedy outputs may differ from plain
        decoding in near-ties.
      "grouped": the (token, expert) pairs sorted by expert and each expert's rows multiplied
        by its weights in one grouped matmul (`jax.lax.ragged_dot`), so each routed expert's
        weights are read once per step, however many rows route to it, and the unrouted ones
        not at all: what a GPU verify of K+1 rows needs (XLA:CPU lowers it densely, so the CPU
        keeps "dense"). Rounding may differ from "dense" as with "gathered".
    """

    IMPLS = ("dense", "gathered", "grouped")

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 *, dtype, rngs: nnx.Rngs, std: float = 0.02, router: str = "softmax_topk", bias: bool = False,
                 swiglu_limit: float | None = None, swiglu_alpha: float = 1.702):
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.router, self.swiglu_limit, self.swiglu_alpha = router, swiglu_limit, swiglu_alpha
        self.gate = Linear(d_model, num_experts, bias=bias, dtype=dtype, rngs=rngs)
        init = lambda shape: nnx.Param(std * jax.random.normal(rngs.params(), shape, dtype))
        self.gate_proj = init((num_experts, d_model, d_ff))
        self.up_proj = init((num_experts, d_model, d_ff))
        self.down_proj = init((num_experts, d_ff, d_model))
        # GPT-OSS's experts add a bias after each projection
        zeros = lambda shape: nnx.Param(jnp.zeros(shape, dtype)) if bias else None
        self.gate_bias, self.up_bias, self.down_bias = (zeros((num_experts, d_ff)), zeros((num_experts, d_ff)),
                                                        zeros((num_experts, d_model)))
        self.impl = "dense"

    def route(self, x: Float[Array, "B T D"]) -> tuple[Float[Array, "B T K"], Int[Array, "B T K"]]:
        """Each token's top-k experts and their weights: Qwen3-MoE softmaxes all logits, then
        takes the top k (optionally renormalised); GPT-OSS takes the top-k logits, then softmaxes them."""
        logits = self.gate(x).astype(jnp.float32)  # [B,T,E]
        if self.router == "topk_softmax":
            top_l, top_i = jax.lax.top_k(logits, self.top_k)
            return jax.nn.softmax(top_l, axis=-1), top_i
        top_w, top_i = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), self.top_k)
        if self.norm_topk_prob:
            top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
        return top_w, top_i

    def gated(self, gate: Float[Array, "..."], up: Float[Array, "..."]) -> Float[Array, "..."]:
        """The experts' gated activation: SiLU(gate) * up, or GPT-OSS's clamped SwiGLU
        (up + 1) * g * sigmoid(alpha g), with g = min(gate, limit) and up within +-limit."""
        if self.swiglu_limit is None:
            return jax.nn.silu(gate) * up
        gate = jnp.minimum(gate, self.swiglu_limit)
        up = jnp.clip(up, -self.swiglu_limit, self.swiglu_limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * self.swiglu_alpha))

    def __call__(self, x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
        top_w, top_i = self.route(x)
        e = self.gate_proj.shape[0]
        if self.impl == "grouped":
            return self._grouped(x, top_w, top_i)
        if self.impl == "gathered" and 3 * math.prod(x.shape[:2]) * self.top_k <= e:
            return self._routed_only(x, top_w, top_i)
        weights = jnp.sum(jax.nn.one_hot(top_i, e, dtype=jnp.float32) * top_w[..., None], axis=-2)
        gate = jnp.einsum("btd,edf->btef", x, self.gate_proj[...])
        up = jnp.einsum("btd,edf->btef", x, self.up_proj[...])
        if self.gate_bias is not None:
            gate, up = gate + self.gate_bias[...], up + self.up_bias[...]
        y = jnp.einsum("btef,efd->bted", self.gated(gate, up), self.down_proj[...])
        if self.down_bias is not None:
            y = y + self.down_bias[...]
        return jnp.einsum("bted,bte->btd", y, weights.astype(x.dtype))

    def _grouped(self, x: Float[Array, "B T D"], top_w: Float[Array, "B T K"],
                 top_i: Int[Array, "B T K"]) -> Float[Array, "B T D"]:
        """Each token's top-k experts by grouped matmuls over the pairs sorted by expert."""
        b, t, d = x.shape
        experts = top_i.reshape(-1)  # [N*k], token-major
        order = jnp.argsort(experts, stable=True)
        token = order // self.top_k  # the token of each sorted pair
        sizes = jnp.bincount(experts, length=self.gate_proj.shape[0]).astype(jnp.int32)
        rows = x.reshape(b * t, d)[token]  # [N*k, D], grouped by expert
        gate = jax.lax.ragged_dot(rows, self.gate_proj[...], sizes)
        up = jax.lax.ragged_dot(rows, self.up_proj[...], sizes)
        if self.gate_bias is not None:
            expert = experts[order]
            gate, up = gate + self.gate_bias[...][expert], up + self.up_bias[...][expert]
        y = jax.lax.ragged_dot(self.gated(gate, up), self.down_proj[...], sizes)  # [N*k, D]
        if self.down_bias is not None:
            y = y + self.down_bias[...][expert]
        y = y * top_w.reshape(-1)[order][:, None].astype(y.dtype)
        return jnp.zeros((b * t, d), y.dtype).at[token].add(y).reshape(b, t, d)

    def _routed_only(self, x: Float[Array, "B T D"], top_w: Float[Array, "B T K"],
                     top_i: Int[Array, "B T K"]) -> Float[Array, "B T D"]:
        """Apply only each token's top-k experts (weights gathered per token)."""
        gate, up, down = (p[...][top_i] for p in (self.gate_proj, self.up_proj, self.down_proj))
        g, u = jnp.einsum("btd,btkdf->btkf", x, gate), jnp.einsum("btd,btkdf->btkf", x, up)
        if self.gate_bias is not None:
            g, u = g + self.gate_bias[...][top_i], u + self.up_bias[...][top_i]
        y = jnp.einsum("btkf,btkfd->btkd", self.gated(g, u), down)
        if self.down_bias is not None:
            y = y + self.down_bias[...][top_i]
        return jnp.einsum("btkd,btk->btd", y, top_w.astype(x.dtype))
