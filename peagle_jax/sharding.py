"""Mesh and logical-axis rules: the one place that names mesh axes.

Parameters and caches get logical axis names from their paths (one table below); `RULES`
maps logical names to the mesh axes `data` and `model`. Attention heads, MLP hidden units,
MoE experts and the vocabulary are sharded over `model` (tensor parallelism, Megatron-style:
column-parallel q/k/v/gate/up, row-parallel o/down); the batch is sharded over `data`. The same
code runs on one CPU, on fake CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8) and on multi-host GPUs after
`maybe_initialize_distributed()`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from peagle_jax.pytree_paths import param_paths

MESH_AXES = ("data", "model")

# logical axis -> mesh axis (None = replicated)
RULES: Mapping[str, str | None] = {
    "batch": "data",
    "heads": "model",  # q/k/v output columns, o_proj input rows (whole heads per device)
    "kv_heads": "model",
    "mlp": "model",
    "experts": "model",
    "vocab": "model",
    "embed": None,
    "fc_in": None,
    "norm": None,
}

# (regex over the dotted param path, logical axes). First match wins; no match = replicated.
PARAM_AXES: list[tuple[str, tuple[str | None, ...]]] = [
    (r".*self_attn\.[qkv]_proj\.kernel", ("embed", "heads")),
    (r".*self_attn\.[qkv]_proj\.bias", ("heads",)),
    (r".*self_attn\.o_proj\.kernel", ("heads", "embed")),
    (r".*mlp\.(gate|up)_proj\.kernel", ("embed", "mlp")),
    (r".*mlp\.down_proj\.kernel", ("mlp", "embed")),
    (r".*mlp\.gate\.kernel", ("embed", None)),  # MoE router: small, replicated
    (r".*mlp\.(gate|up)_proj", ("experts", "embed", None)),  # stacked experts [E, D, I]
    (r".*mlp\.down_proj", ("experts", None, "embed")),
    (r"embed_tokens", ("vocab", "embed")),
    (r"lm_head", ("embed", "vocab")),
    (r"fc\.kernel", ("fc_in", "embed")),  # drafter's tap projection [3 * D_t, H]: replicated on purpose
]


def parse_mesh_spec(spec: str | None) -> dict[str, int]:
    """'data=2,model=4' -> {'data': 2, 'model': 4}; None or '' -> {} (no mesh)."""
    if not spec:
        return {}
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in MESH_AXES or not value.isdigit() or int(value) < 1:
            raise ValueError(f"bad mesh spec {spec!r}: expected e.g. 'data=2,model=4' with axes {MESH_AXES}")
        if name in sizes:
            raise ValueError(f"bad mesh spec {spec!r}: axis {name!r} given twice")
        sizes[name] = int(value)
    return sizes


def make_mesh(spec: str | Mapping[str, int] | None, devices=None) -> Mesh | None:
    """A ('data', 'model') mesh over the first data*model devices; None for an empty spec."""
    sizes = parse_mesh_spec(spec) if isinstance(spec, str) or spec is None else dict(spec)
    if not sizes:
        return None
    d, m = sizes.get("data", 1), sizes.get("model", 1)
    devices = list(devices if devices is not None else jax.devices())
    if d * m > len(devices):
        raise ValueError(f"mesh data={d} x model={m} needs {d * m} devices, only {len(devices)} available")
    return Mesh(np.array(devices[: d * m]).reshape(d, m), MESH_AXES)


def logical_to_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    """PartitionSpec for logical axes; a dimension the mesh axis does not divide stays replicated."""
    spec = []
    for name, dim in zip(axes, shape, strict=True):
        mesh_axis = RULES.get(name) if name else None
        if mesh_axis is not None and dim % mesh.shape[mesh_axis] != 0:
            mesh_axis = None
        spec.append(mesh_axis)
    return P(*spec)


def _param_rule(path: str, ndim: int) -> tuple[str | None, ...] | None:
    """Logical axes of the first PARAM_AXES rule naming `path` at this rank; None if none does.
    A scanned target's stacked layers (`layer_stack.*`, [L, ...]) follow their layer's rule
    with the layer axis unsplit."""
    if path.startswith("layer_stack."):
        axes = _param_rule("layers.0." + path.removeprefix("layer_stack."), ndim - 1)
        return None if axes is None else (None, *axes)
    for pattern, axes in PARAM_AXES:
        if re.fullmatch(pattern, path) and len(axes) == ndim:
            return axes
    return None


def param_logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    axes = _param_rule(path, ndim)
    return (None,) * ndim if axes is None else axes


def unmatched_params(module: nnx.Module, *, min_ndim: int = 2) -> list[str]:
    """Paths of the parameters of rank >= `min_ndim` that no PARAM_AXES rule names (sorted).

    Such a parameter is replicated on every device without anyone having decided so (e.g. after
    a rename); a rule whose logical axes all map to None (the MoE router, the drafter's fc)
    replicates on purpose and counts as a match. Works on abstract modules (`nnx.eval_shape`).
    """
    return sorted(path for path, var in param_paths(module).items()
                  if len(var.value.shape) >= min_ndim and _param_rule(path, len(var.value.shape)) is None)


def param_sharding(path: str, shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(param_logical_axes(path, len(shape)), shape, mesh))


def shard_module(module: nnx.Module, mesh: Mesh | None) -> nnx.Module:
    """Place every parameter per the rules and tell attention layers to shard_map over `mesh`."""
    if mesh is None:
        return module
    for path, var in param_paths(module).items():
        var.value = jax.device_put(var.value, param_sharding(path, var.value.shape, mesh))
    for _, node in nnx.iter_graph(module):
        if hasattr(node, "mesh") and not isinstance(node, nnx.Variable):
            node.mesh = mesh
    # Non-parameter state (e.g. d2t) is replicated.
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Variable) and not isinstance(node, nnx.Param):
            node.value = jax.device_put(node.value, NamedSharding(mesh, P()))
    return module


def cache_spec(batch: int, num_kv_heads: int, mesh: Mesh) -> P:
    """KV cache [B, KVH, S, D]: batch over data, KV heads over model."""
    return logical_to_spec(("batch", "kv_heads", None, None), (batch, num_kv_heads, 1, 1), mesh)


def constrain(x: jax.Array, spec: P, mesh: Mesh | None) -> jax.Array:
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def sharded_attention(attn_fn, mesh: Mesh, batch: int, num_kv_heads: int, *, fp8: bool = False, skip: bool = False):
    """Wrap a per-device attention op in shard_map: each device attends its own KV heads.

    q heads h = kv_head * G + g, so a contiguous split of the H query heads and of the KVH
    KV heads over `model` keeps every query head with its KV head on the same device. The
    wrapped op takes (q, k, v, slots[, skip_lo, skip_hi][, k_scale, v_scale]).
    """
    kv = cache_spec(batch, num_kv_heads, mesh)
    rows = P(kv[0], None, kv[1], None)  # q and the output [B, T, H, D]: heads split like the kv heads
    pos = P(kv[0], None)

    def fn(q, k, v, p, *rest):
        window = dict(zip(("skip_lo", "skip_hi"), rest[:2], strict=True)) if skip else {}
        scales = dict(zip(("k_scale", "v_scale"), rest[2 if skip else 0:], strict=True)) if fp8 else {}
        return attn_fn(q, k, v, p, **window, **scales)

    # K/V scales [B, KVH, S, 1] shard like the cache; the tree mask's windows like the slots
    in_specs = (rows, kv, kv, pos) + ((pos, pos) if skip else ()) + ((kv, kv) if fp8 else ())
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=rows, check_vma=False)


def maybe_initialize_distributed() -> bool:
    """Join a multi-host JAX job when the launcher asked for one; True when in one.

    Every entry point (generate, serve, train) calls this once, before touching devices:
      * JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID (deploy/launch_multihost.sh);
      * PEAGLE_DISTRIBUTED=1 (or "auto"): `jax.distributed.initialize()` auto-detects the job
        (SLURM, TPU pods, ...);
      * neither: a single-process run.
    """
    if _distributed_initialized():
        return True
    env = os.environ
    flag = env.get("PEAGLE_DISTRIBUTED", "").strip().lower()
    if flag not in ("", "0", "1", "auto", "true", "false"):
        raise ValueError(f"PEAGLE_DISTRIBUTED must be 1/auto (join the detected job) or 0, got {flag!r}")
    addr = env.get("JAX_COORDINATOR_ADDRESS")
    if addr:
        missing = [v for v in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if not env.get(v)]
        if missing:
            raise ValueError(f"JAX_COORDINATOR_ADDRESS is set but {', '.join(missing)} is not")
        jax.distributed.initialize(coordinator_address=addr, num_processes=int(env["JAX_NUM_PROCESSES"]),
                                   process_id=int(env["JAX_PROCESS_ID"]))
        return True
    if flag in ("1", "auto", "true"):
        jax.distributed.initialize()
        return True
    return False


def _distributed_initialized() -> bool:
    fn = getattr(jax.distributed, "is_initialized", None)
    return bool(fn()) if fn is not None else False
