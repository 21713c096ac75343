"""Fill an NNX module's parameters from a flat {path: array} dict, validating everything."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from peagle_jax.pytree_paths import param_paths


class CheckpointError(ValueError):
    """A checkpoint does not fit the model: lists every offending key at once."""


def raise_if_mismatched(what: str, missing: list[str], unexpected: list[str], wrong_shape: list[str]) -> None:
    """One CheckpointError naming every missing, unexpected and wrong-shape tensor (if any)."""
    if not (missing or unexpected or wrong_shape):
        return
    lines = [f"{what}:"]
    if missing:
        lines.append(f"  missing ({len(missing)}): {', '.join(missing)}")
    if unexpected:
        lines.append(f"  unexpected ({len(unexpected)}): {', '.join(unexpected)}")
    if wrong_shape:
        lines.append(f"  wrong shape ({len(wrong_shape)}): " + "; ".join(wrong_shape))
    raise CheckpointError("\n".join(lines))


def assign_params(
    module: nnx.Module,
    tensors: Mapping[str, np.ndarray],
    *,
    dtype=None,
    source: str = "checkpoint",
    optional: Iterable[str] = (),
    describe: Callable[[str], str] | None = None,
    extra_missing: Iterable[str] = (),
    extra_unexpected: Iterable[str] = (),
) -> None:
    """Set every Param of `module` from `tensors` (already in our layout and naming).

    Missing, unexpected or mis-shaped tensors raise one CheckpointError naming them all;
    nothing is assigned in that case. Keys in `optional` may be absent (they keep their
    current value, which must then be concrete). `describe` renders a key for the message
    (e.g. with the checkpoint's own tensor name); `extra_missing` / `extra_unexpected` are
    problems a format converter found (already in the checkpoint's naming), reported in the
    same error.
    """
    params = param_paths(module)
    optional = set(optional)
    show = describe or (lambda k: k)
    missing = sorted(show(k) for k in params if k not in tensors and k not in optional)
    missing += sorted(extra_missing)
    unexpected = sorted(show(k) for k in tensors if k not in params)
    unexpected += sorted(extra_unexpected)
    bad_shape = [
        f"{show(k)}: checkpoint {tuple(np.shape(v))} vs model {tuple(params[k].value.shape)}"
        for k, v in tensors.items()
        if k in params and tuple(np.shape(v)) != tuple(params[k].value.shape)
    ]
    raise_if_mismatched(f"{source} does not match the model", missing, unexpected, bad_shape)
    for k, v in tensors.items():
        p = params[k]
        target_dtype = dtype if dtype is not None else p.value.dtype
        p.value = jnp.asarray(v, dtype=target_dtype)
