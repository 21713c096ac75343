"""Inference options applied to a loaded model or drafter: attention kernels, FP8 KV cache, FP8
weights, and the CPU matmul kernel.

They are module attributes (static, part of the graph definition), so switching them
recompiles once and never at run time:

  configure_inference(model, attention="auto", kv_cache_dtype="float8_e4m3fn")
  quantize_weights_fp8(model)   # e4m3 linear weights with per-output-channel scales
  choose_matmul(model, "auto")  # bf16 on CPU: decode-sized matmuls through kernels.matmul
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from peagle_jax import kernels
from peagle_jax.checkpoints.gguf_blocks import GroupTensor
from peagle_jax.models.layer_stack import LAYER_LOOPS, stack_layers, unstack_layers
from peagle_jax.models.layers import MLP, Attention, Linear, MoE, PackedKernel
from peagle_jax.options import QUANTIZED_DRAFT_WEIGHTS

KV_CACHE_DTYPES = ("float32", "bfloat16", "float8_e4m3fn")


class FP8Scale(nnx.Variable):
    """Per-output-channel dequantization scale of an FP8 weight (not trained)."""


def configure_inference(
    module: nnx.Module,
    *,
    attention: str | None = None,
    interpret: bool = False,
    kv_cache_dtype: str | None = None,
    moe: str | None = None,
    layer_loop: str | None = None,
) -> nnx.Module:
    """Pick the cache-attention implementation ("xla" | "cpu" | "triton" | "mosaic" | "auto"), the KV
    cache dtype, the MoE evaluation ("dense" | "gathered" | "grouped", see `layers.MoE`) and, for a
    target, how its layers run ("unrolled" | "scan", see `layer_stack`) of a target model or
    drafter (in place). An option left None keeps its current setting. Stack the layers after
    packing the CPU kernel's weights (`choose_matmul`), which works on per-layer modules."""
    if attention is not None and attention not in kernels.IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {attention!r}; known: {kernels.IMPLEMENTATIONS}")
    if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}; known: {KV_CACHE_DTYPES}")
    if moe is not None and moe not in MoE.IMPLS:
        raise ValueError(f"unknown MoE implementation {moe!r}; known: {MoE.IMPLS}")
    if layer_loop is not None and layer_loop not in LAYER_LOOPS:
        raise ValueError(f"unknown layer loop {layer_loop!r}; known: {LAYER_LOOPS}")
    if layer_loop is not None and not hasattr(module, "layer_stack"):
        raise ValueError(f"layer_loop applies to a target model, not a {type(module).__name__}")
    for _, node in nnx.iter_graph(module):
        if isinstance(node, Attention) and attention is not None:
            node.attn_impl = attention
            node.attn_interpret = interpret
        if isinstance(node, MoE) and moe is not None:
            node.impl = moe
    if kv_cache_dtype is not None:
        module.kv_cache_dtype = kv_cache_dtype
    if layer_loop == "scan":
        stack_layers(module)
    elif layer_loop == "unrolled":
        unstack_layers(module)
    return module


def quantize_weights_fp8(module: nnx.Module, *, skip: tuple[str, ...] = ()) -> nnx.Module:
    """Store every Linear kernel as float8_e4m3fn with a per-output-channel fp32 scale.

    Embeddings, norms, the lm_head and routed-expert stacks stay in their dtype. The matmul
    upcasts the FP8 kernel to the activation dtype, then applies the scale per column, so the
    result equals x @ dequantize(W) up to rounding.
    """
    for path, node in nnx.iter_graph(module):
        name = ".".join(str(p) for p in path)
        if not isinstance(node, Linear) or any(s in name for s in skip) or node.kernel_scale is not None:
            continue
        w = node.kernel[...].astype(jnp.float32)
        amax = jnp.max(jnp.abs(w), axis=0)  # per output channel
        scale = jnp.maximum(amax, 1e-12) / 448.0
        node.kernel.value = jnp.clip(w / scale, -448.0, 448.0).astype(jnp.float8_e4m3fn)
        node.kernel_scale = FP8Scale(scale)
    return module


MATMULS = ("auto", "xla", "cpu_kernel")
# Linears of one module that share their input, packed side by side and run as one kernel
# call (`layers.fused_linears`): the module's attribute for the packed weights, their names.
FUSED_CALLS = {Attention: ("qkv_packed", ("q_proj", "k_proj", "v_proj")),
               MLP: ("gate_up_packed", ("gate_proj", "up_proj"))}


def cpu_kernel_blocker(module: nnx.Module) -> str | None:
    """Why `pack_cpu_matmuls` cannot serve this module (None: it can)."""
    if jax.default_backend() != "cpu":
        return f"the backend is {jax.default_backend()}, not cpu"
    if getattr(module, "mesh", None) is not None:
        return "the module is sharded over a mesh"
    linears = [n for _, n in nnx.iter_graph(module) if isinstance(n, Linear) and n.kernel is not None]
    if any(n.kernel_scale is not None for n in linears):
        return "the weights are FP8"
    if any(n.kernel[...].dtype != jnp.bfloat16 for n in linears):
        return "the weights are not bfloat16"
    return kernels.cpu.unavailable_reason()


PACKED_WEIGHTS = ("bf16", "q7", "q4", "g4")


def pack_cpu_matmuls(module: nnx.Module, weights: str = "bf16",
                     file_weights: Mapping[str, GroupTensor] | None = None) -> nnx.Module:
    """Route the decode-sized matmuls of a bf16 model or drafter (every Linear and the lm_head)
    through `kernels.matmul`, the row-invariant CPU custom call, by giving each a packed
    copy of its weight (in place; the bf16 weights stay for longer calls such as prefill).
    Inference only: the custom call has no gradient. Raises ValueError naming the reason where
    it cannot run (`cpu_kernel_blocker`).

    weights: "bf16" (`kernels.pack`: the model's own numbers), "q7" (`kernels.pack_q7`:
    7-bit per-column weights in one byte each, half the bytes to stream), "q4" (the Linears in
    4 bits, `kernels.pack_q4`, a quarter of the bytes; the lm_head stays in 7 bits: its
    logits pick the drafts, and 4 bits there cost acceptance, docs/cpu-kernels.md) or "g4" (the
    Linears in 4-bit groups of 32 and the lm_head in 8-bit groups of 16,
    `kernels.quantize_group`: the integer group loop, which CPUs without AVX512-BF16 run
    faster than bf16 at a draft pass's rows). The quantized choices change the results, so only
    a draft head takes them: its drafts are verified by the target, never emitted unchecked.

    file_weights: a quantized GGUF target's Linears in the file's own blocks, by module path
    (`checkpoints.gguf_loader.load_gguf_group_weights`): those are packed from them
    (`kernels.pack_g4` / `pack_g8`, the file's numbers exactly, a third to a half of bf16's
    bytes) and the rest as `weights` says. Linears sharing a fused call are packed together
    only where all of them take the same format. The kernel serves those at every row count,
    prefill included, so their bf16 weights are dropped: the blocks are the only copy in memory
    (a 1.5B Q4_K_M target holds about 1.3 GB, not 3.1). The same holds for a "g4" head's
    packed Linears and lm_head: their group-packed weights are the only copy kept."""
    if weights not in PACKED_WEIGHTS:
        raise ValueError(f"unknown packed weights {weights!r}; known: {PACKED_WEIGHTS}")
    reason = cpu_kernel_blocker(module)
    if reason is not None:
        raise ValueError(f"the CPU matmul kernel cannot serve this model: {reason}")
    def group(fmt: str):
        return lambda w: jnp.asarray(kernels.quantize_group(np.asarray(w, np.float32), fmt))

    pack = {"bf16": kernels.pack, "q7": kernels.pack_q7, "q4": kernels.pack_q4, "g4": group("g4")}[weights]
    pack_head = {"q4": kernels.pack_q7, "g4": group("g8")}.get(weights, pack)

    file_weights = file_weights or {}
    paths = {id(node): ".".join(map(str, path)) for path, node in nnx.iter_graph(module)}

    def packable(*linears: Linear) -> bool:
        return all(lin.out_features % kernels.TILE == 0 for lin in linears)

    def file_tensor(lin: Linear) -> GroupTensor | None:  # the file's blocks of this Linear, if they serve it
        gw = file_weights.get(paths[id(lin)])
        return gw if gw is not None and gw.shape == (lin.in_features, lin.out_features) else None

    def file_format(lin: Linear) -> str:  # "g4" / "g8" where the file's blocks serve it, else `weights`
        gw = file_tensor(lin)
        if gw is None:
            if lin.kernel is None:
                raise ValueError(f"{paths[id(lin)]} has no weights: neither bf16 nor a GGUF file's blocks")
            return weights
        return gw.format

    def packed_one(lin: Linear):
        gw = file_tensor(lin)
        return pack(lin.kernel[...]) if gw is None else pack_group(gw)

    def packed(*linears: Linear) -> PackedKernel:  # side by side along the output tiles
        return PackedKernel(jnp.concatenate([packed_one(lin) for lin in linears], axis=0))

    grouped: set[int] = set()  # Linears served by a fused call (no packed copy of their own)
    for _, node in nnx.iter_graph(module):
        for kind, (attr, names) in FUSED_CALLS.items():
            linears = tuple(getattr(node, n) for n in names) if isinstance(node, kind) else ()
            if linears and packable(*linears) and len({file_format(lin) for lin in linears}) == 1:
                setattr(node, attr, packed(*linears))
                grouped.update(id(lin) for lin in linears)
    linears = [node for _, node in nnx.iter_graph(module) if isinstance(node, Linear)]
    for lin in linears:
        if id(lin) not in grouped and packable(lin):
            lin.kernel_packed = packed(lin)
    if hasattr(module, "lm_head_packed"):  # a target (tied or not) or a head
        tied = getattr(module.config, "tie_word_embeddings", False)
        gw = file_weights.get("embed_tokens" if tied else "lm_head")
        if gw is not None:
            module.lm_head_packed = PackedKernel(pack_group(gw))
            if not tied:
                module.lm_head = None  # the blocks are its only copy (CausalLM.lm_head_weight)
        elif (head := module.lm_head_weight()).shape[1] % kernels.TILE == 0:
            module.lm_head_packed = PackedKernel(pack_head(head))
            if weights == "g4" and not tied:
                module.lm_head = None  # the group loop serves every call: its pack is the only copy
    for lin in linears:  # group-packed weights serve every call (prefill too): the only copy kept
        served = lin.kernel_packed is not None or id(lin) in grouped
        if file_tensor(lin) is not None or (weights == "g4" and served):
            lin.kernel = None
    return module


GROUP_FORMATS = ("g4", "g8")


def pack_group(tensor: GroupTensor) -> jax.Array:
    """A GGUF weight's blocks parsed and packed for the kernel (`kernels.pack_g4` / `pack_g8`)."""
    gw = tensor.parse()
    if gw.format == "g4":
        return jnp.asarray(kernels.pack_g4(gw.q, gw.scale, gw.min))
    return jnp.asarray(kernels.pack_g8(gw.q, gw.scale))


def q7_blocker() -> str | None:
    """Why 7-bit packed weights would not be faster here (None: they are). Their loop turns
    bytes into bf16 dot-product operands (AVX512-BF16); elsewhere it widens them to float32
    and runs out of arithmetic before memory at 3 rows (slower than bf16: docs/cpu-kernels.md,
    "The matmul on 7-bit and 4-bit weights")."""
    if (why := kernels.cpu.unavailable_reason()) is not None:
        return why
    if kernels.cpu.instruction_set() not in ("avx512bf16", "amx"):
        return f"this CPU runs the {kernels.cpu.instruction_set()} loops, without AVX512-BF16 dot products"
    return None


DRAFT_WEIGHTS = ("auto", "native", *QUANTIZED_DRAFT_WEIGHTS)


def choose_matmul(module: nnx.Module, matmul: str, weights: str = "bf16",
                  file_weights: Mapping[str, GroupTensor] | None = None) -> str:
    """Apply a `load(matmul=...)` choice: "auto" packs for the CPU kernel where it can run (and
    says why not in the log where it cannot), "cpu_kernel" requires it, "xla" never uses it.
    `weights` and `file_weights` are `pack_cpu_matmuls`'s (the quantized ones for draft heads
    only). Returns the path taken: "cpu_kernel" or "xla"."""
    import logging

    if matmul not in MATMULS:
        raise ValueError(f"unknown matmul {matmul!r}; known: {MATMULS}")
    if matmul == "xla":
        return "xla"
    reason = cpu_kernel_blocker(module)
    if reason is None:
        pack_cpu_matmuls(module, weights, file_weights)
        return "cpu_kernel"
    if matmul == "cpu_kernel":
        raise ValueError(f"matmul='cpu_kernel' cannot serve this model: {reason}")
    logging.getLogger(__name__).info("matmuls on XLA: %s", reason)
    return "xla"


def draft_weights_for(requested: str, matmul_path: str) -> str:
    """A `load(draft_weights=...)` choice resolved for a head whose matmuls take `matmul_path`:
    "q7" / "q4" / "g4" (quantized weights, `pack_cpu_matmuls`) or "native" (the head's weights
    in the load dtype). "auto" takes, where the CPU kernel serves the head, "q4" where its loop
    has bf16 dot products (`q7_blocker`: on the shipped P-EAGLE head its acceptance equals q7's
    and its rounds are 0.1-0.3 ms shorter) and "g4" elsewhere (the integer group loop: half the
    time of bf16 for a 0.5B head's matmuls at 1-4 rows on an AVX2 EPYC, docs/cpu-kernels.md).
    An explicit quantized choice needs only the kernel. Raises ValueError naming the reason."""
    if requested not in DRAFT_WEIGHTS:
        raise ValueError(f"draft_weights must be one of {DRAFT_WEIGHTS}, got {requested!r}")
    if requested == "native":
        return "native"
    if matmul_path != "cpu_kernel":
        if requested in QUANTIZED_DRAFT_WEIGHTS:
            raise ValueError(f"draft_weights={requested!r} runs on the CPU matmul kernel, and this model's matmuls "
                             f"run on {matmul_path} ({requested} needs dtype bfloat16, one CPU device and matmul "
                             "'auto' or 'cpu_kernel')")
        return "native"
    if requested in QUANTIZED_DRAFT_WEIGHTS:
        return requested
    return "q4" if q7_blocker() is None else "g4"
