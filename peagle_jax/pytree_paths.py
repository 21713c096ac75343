"""Dotted parameter paths of an NNX module.

This lives outside `peagle_jax.checkpoints` on purpose: the mesh rules (`peagle_jax.sharding`)
name parameters by these paths too, and they should not import a file-format package to do it.
Checkpoint loading (`checkpoints/params.py`, `checkpoints/drafter_io.py`) uses the same paths.
"""

from __future__ import annotations

from flax import nnx


def param_paths(module: nnx.Module) -> dict[str, nnx.Param]:
    """Dotted path -> Param for every parameter of `module` (e.g. 'layers.0.mlp.up_proj.kernel')."""
    out: dict[str, nnx.Param] = {}
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Param):
            out[".".join(str(p) for p in path)] = node
    return out
