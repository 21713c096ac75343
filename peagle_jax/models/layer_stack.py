"""A target's decoder layers as one layer with stacked parameters, run under `jax.lax.scan`.

Unrolled (a Python loop inside jit), a round program holds every layer's operations, so its
compile time and the host memory the compiled program keeps grow with depth: a 48-layer
Qwen3-30B-A3B P-EAGLE round took 25 s to compile on XLA:CPU and did not compile in the time
a GPU was lent (results/compile_cost/README.md). Under a scan the program holds one layer once,
whatever the depth: the default server compiles in half the time and keeps half the memory
(results/serve_startup/README.md). On CPU the kernels read each step's layer of the stacked
weights and cache in place (`layers.reading_layer`, kernels_cpu/layer_view.h), so a scanned
decode runs as fast as the unrolled one. `Options.layer_loop="auto"` scans wherever the layers
stack (`stack_blocker`).

The weights are stacked once, after loading: every layer's parameter becomes one [L, ...] array
(checkpoint loaders keep writing per-layer paths, `layers.<i>.*`). The KV cache becomes one
`cache.StackedKV`, carried through the scan and written in place, a layer's new rows at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from peagle_jax.cache import StackedKV
from peagle_jax.models.layers import PackedKernel, reading_layer

LAYER_LOOPS = ("unrolled", "scan")


@jax.jit(donate_argnums=0)
def _put(stack: jax.Array, leaf: jax.Array, index: Int[Array, ""]) -> jax.Array:
    return stack.at[index].set(leaf)


def _stack(leaves: list) -> jax.Array | jax.ShapeDtypeStruct:
    """One [L, ...] array of L equal-shaped leaves (abstract where they are, `nnx.eval_shape`),
    filled in place a layer at a time while the list lets each leaf go, so stacking a parameter
    needs one layer's copy of it beside the model, not L (a 48-layer Qwen3-30B-A3B expert stack
    is 19 GB in bf16)."""
    first = leaves[0]
    if isinstance(first, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(leaves),) + first.shape, first.dtype, sharding=first.sharding)
    stack = jnp.zeros((len(leaves),) + first.shape, first.dtype)
    del first
    for i in range(len(leaves)):
        stack, leaves[i] = _put(stack, leaves[i], i), None
    return stack


def stack_blocker(model) -> str | None:
    """Why `stack_layers` cannot stack this target's layers (None: it can)."""
    if model.layer_stack is not None:
        return None
    splits = [nnx.split(layer) for layer in model.layers]
    if len(splits) < 2:
        return "the model has fewer than two layers"
    (graphdef, state), rest = splits[0], splits[1:]
    spec = lambda st: [(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(st)]
    for i, (g, st) in enumerate(rest, start=1):
        if g != graphdef:
            return (f"layer {i} differs from layer 0 in structure (e.g. a dense MLP among MoE layers, or weights that "
                    "a GGUF file quantizes in another format packed apart)")
        if spec(st) != spec(state):
            return (f"layer {i}'s weights differ from layer 0's in shape or type (e.g. a GGUF file that "
                    "quantizes some layers in another format)")
    return None


def stack_layers(model) -> None:
    """Replace `model.layers` by `model.layer_stack`: one DecoderLayer whose every parameter
    (and packed kernel copy) holds all layers on a leading axis (in place). Raises ValueError
    naming the reason where the layers cannot be stacked (`stack_blocker`)."""
    if model.layer_stack is not None:
        return
    if (why := stack_blocker(model)) is not None:
        raise ValueError(f"layer_loop 'scan' cannot run this model: {why}; use layer_loop 'unrolled'")
    graphdefs, states = zip(*(nnx.split(layer) for layer in model.layers), strict=True)
    model.layers = nnx.List([])  # the per-layer copies go as their stacks are built
    flat = [jax.tree.flatten(state) for state in states]
    del states
    treedef = flat[0][1]
    columns = [[leaves[j] for leaves, _ in flat] for j in range(len(flat[0][0]))]
    del flat
    stacked = []
    while columns:  # one parameter at a time, so at most one extra layer-set of it is alive
        stacked.append(_stack(columns.pop(0)))
    model.layer_stack = nnx.merge(graphdefs[0], jax.tree.unflatten(treedef, stacked))


def unstack_layers(model) -> None:
    """Undo `stack_layers`: per-layer modules again, for the unrolled loop (in place)."""
    if model.layer_stack is None:
        return
    graphdef, state = nnx.split(model.layer_stack)
    count = jax.tree.leaves(state)[0].shape[0]
    take = lambda i: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
                                  if isinstance(a, jax.ShapeDtypeStruct) else a[i], state)
    model.layers = nnx.List([nnx.merge(graphdef, take(i)) for i in range(count)])
    model.layer_stack = None


def run_stacked(
    stack: nnx.Module,
    x: Float[Array, "B T D"],
    positions: Int[Array, "B T"],
    cache: StackedKV,
    slots: Int[Array, "B T"] | None,
    skip: tuple[Int[Array, "B T"], Int[Array, "B T"]] | None,
    angles,
    tap_ids: tuple[int, ...],
) -> tuple[Float[Array, "B T D"], StackedKV, Float[Array, "N B T D"]]:
    """x through every layer of `stack` in order, as the unrolled loop computes it: the new
    residual stream, the cache with every layer's new rows written, and the residual stream
    entering each layer of `tap_ids` (EAGLE-3's taps; [0, B, T, D] when none)."""
    # The CPU kernels' packed weights stay whole: each step's calls read their layer in place
    # (`layers.reading_layer`). The rest is sliced per step by the scan.
    graphdef, packed, params = nnx.split(stack, PackedKernel, ...)
    taps = jnp.zeros((len(tap_ids),) + x.shape, x.dtype)
    tap_at = jnp.asarray(tap_ids, jnp.int32).reshape(-1, 1, 1, 1)

    def body(carry, layer_params):
        x, kv, taps, i = carry
        taps = jnp.where(tap_at == i, x[None], taps)
        with reading_layer(i):
            x, slot = nnx.merge(graphdef, packed, layer_params)(x, positions, kv.at_layer(i), slots, skip, angles)
        return (x, slot.stack, taps, i + 1), None

    (x, cache, taps, _), _ = jax.lax.scan(body, (x, cache, taps, jnp.int32(0)), params)
    return x, cache, taps
