"""The CPU cache attention kernel (kernels_cpu.cache_attention, implementation "cpu" of
peagle_jax.kernels.cache_attention).

It must (1) match the float32 reference to bf16 accuracy, with GQA, the causal limit and the
tree mask's hidden window, (2) give a query row the same bits whatever else the call holds:
other rows, other sequences, how far they reach, and where the row's keys lie in the cache
(a tree verify's second chain), and (3) be what `load` runs on CPU next to the matmul kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import slow_except

import kernels_cpu
from peagle_jax.kernels import attention
from peagle_jax.kernels.attention import cache_attention, cache_attention_reference, resolve_implementation

needs_kernel = pytest.mark.skipif(not kernels_cpu.available(),
                                  reason=f"kernels_cpu unavailable: {kernels_cpu.unavailable_reason()}")


def _inputs(seed, b, t, h, kvh, s, d, first=40):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, kvh, s, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, kvh, s, d)), jnp.bfloat16)
    pos = jnp.asarray(first + np.arange(t)[None, :] + rng.integers(0, s - first - t, (b, 1)), jnp.int32)
    return q, k, v, pos


def _f32(*xs):
    return [x.astype(jnp.float32) for x in xs]


@needs_kernel
@pytest.mark.parametrize(("b", "t", "h", "kvh", "s", "d"),
                         [(1, 1, 9, 3, 300, 64), (2, 5, 8, 2, 200, 32), (3, 8, 4, 4, 160, 128), (1, 33, 16, 1, 96, 16)])
def test_matches_the_float32_reference(b, t, h, kvh, s, d):
    q, k, v, pos = _inputs(0, b, t, h, kvh, s, d, first=min(40, s - t - 2))
    want = np.asarray(cache_attention_reference(*_f32(q, k, v), pos))
    got = kernels_cpu.cache_attention(q, k, v, pos)
    assert got.dtype == jnp.bfloat16 and got.shape == q.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=1e-2, rtol=1e-2)
    # the same through the dispatcher, with a custom softmax scale
    got2 = cache_attention(q, k, v, pos, sm_scale=0.3, implementation="cpu")
    want2 = np.asarray(cache_attention_reference(*_f32(q, k, v), pos, sm_scale=0.3))
    np.testing.assert_allclose(np.asarray(got2, np.float32), want2, atol=1e-2, rtol=1e-2)


@needs_kernel
def test_hidden_window_matches_the_reference():
    q, k, v, pos = _inputs(1, 2, 6, 9, 3, 256, 64)
    rng = np.random.default_rng(2)
    lo = jnp.asarray(rng.integers(0, 30, (2, 6)), jnp.int32)
    hi = lo + jnp.asarray(rng.integers(0, 20, (2, 6)), jnp.int32)
    want = np.asarray(cache_attention_reference(*_f32(q, k, v), pos, skip_lo=lo, skip_hi=hi))
    got = kernels_cpu.cache_attention(q, k, v, pos, skip_lo=lo, skip_hi=hi)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="together"):
        kernels_cpu.cache_attention(q, k, v, pos, skip_lo=lo)


@needs_kernel
def test_a_row_has_the_same_bits_whatever_shares_its_call():
    """Row 2 of sequence 1: alone, in a 7-row verify, and beside sequences that reach further."""
    q, k, v, pos = _inputs(3, 3, 7, 9, 3, 384, 64)
    full = np.asarray(kernels_cpu.cache_attention(q, k, v, pos))
    alone = np.asarray(kernels_cpu.cache_attention(q[1:2, 2:3], k[1:2], v[1:2], pos[1:2, 2:3]))
    assert np.array_equal(full[1:2, 2:3], alone)
    further = pos.at[0].add(100).at[2].add(50)
    mixed = np.asarray(kernels_cpu.cache_attention(q, k, v, further))
    assert np.array_equal(mixed[1], full[1])


@needs_kernel
def test_a_second_chain_gets_its_natural_bits():
    """The tree verify's layout (generate.tree): a chain written further on, with the rows in
    between hidden, gives exactly the rows it has at its natural place, so two-chain verify is
    exact on every host with this kernel (XLA's attention is not on AVX-512 hosts)."""
    from peagle_jax.generate.tree import second_chain_mismatches, two_chains_exact_here

    assert second_chain_mismatches(7, batch=64, implementation="cpu") == 0
    assert two_chains_exact_here("cpu")


@needs_kernel
def test_padding_rows_that_see_nothing_give_zeros():
    q, k, v, pos = _inputs(4, 2, 3, 4, 2, 64, 16, first=5)
    pos = pos.at[1, 2].set(-1)
    got = np.asarray(kernels_cpu.cache_attention(q, k, v, pos), np.float32)
    assert np.all(got[1, 2] == 0) and np.all(np.isfinite(got))


_OTHER_LOOP_SCRIPT = """
import sys
import numpy as np, jax.numpy as jnp
sys.path[:0] = [sys.argv[1], sys.argv[2]]  # this test's folder, and tests/ for its conftest
import kernels_cpu
from test_kernels_cpu_attention import _inputs, _f32
from kernels_pallas.cache_attention import cache_attention_reference
from peagle_jax.generate.tree import second_chain_mismatches
assert kernels_cpu.available()
q, k, v, pos = _inputs(0, 2, 5, 9, 3, 200, 64)
err = np.abs(np.asarray(kernels_cpu.cache_attention(q, k, v, pos), np.float32)
             - np.asarray(cache_attention_reference(*_f32(q, k, v), pos))).max()
full = np.asarray(kernels_cpu.cache_attention(q, k, v, pos))
alone = np.asarray(kernels_cpu.cache_attention(q[1:2, 2:3], k[1:2], v[1:2], pos[1:2, 2:3]))
print(float(err), np.array_equal(full[1:2, 2:3], alone), second_chain_mismatches(7, batch=16, implementation="cpu"))
"""


@needs_kernel
@pytest.mark.parametrize("switch", slow_except(["PEAGLE_CPU_KERNEL_NO_DPBF16", "PEAGLE_CPU_KERNEL_NO_AMX"],
                                                fast={"PEAGLE_CPU_KERNEL_NO_DPBF16"}))
def test_the_other_loops_keep_the_invariances(switch):
    """The tests above run the loop this host picks: AMX score tiles where the matmuls use AMX,
    else 16-pair dot products where the CPU has AVX512-BF16 (head dims in multiples of 32), else
    the 8-lane FMA loop every AVX2 host runs. PEAGLE_CPU_KERNEL_NO_AMX=1 picks the dot products
    on an AMX host, PEAGLE_CPU_KERNEL_NO_DPBF16=1 the 8-lane loop. Each also matches the
    reference and gives a row the same bits alone, in a verify and as a second chain."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if not k.startswith("PEAGLE_CPU_KERNEL_")}
    env[switch] = "1"
    here = Path(__file__).parent
    done = subprocess.run([sys.executable, "-c", _OTHER_LOOP_SCRIPT, str(here), str(here.parent)], check=True,
                          env=env, timeout=300, capture_output=True, text=True)
    err, same, mismatches = done.stdout.split()[-3:]
    assert float(err) < 2e-2 and same == "True" and mismatches == "0", done.stdout


@needs_kernel
def test_dispatch_and_fallbacks(caplog):
    """"cpu" runs the kernel for bf16; float32 inputs, FP8 caches and other backends keep the
    XLA reference (logged once); "auto" on CPU stays "xla" (it picks GPU kernels)."""
    assert resolve_implementation("cpu") == "cpu"
    assert resolve_implementation("auto") == "xla"
    attention._log_once.cache_clear()  # an earlier test may have logged this fallback already
    with caplog.at_level("INFO", logger="peagle_jax.kernels"):
        assert resolve_implementation("cpu", q_dtype=jnp.float32, kv_dtype=jnp.float32) == "xla"
    assert any("bf16" in r.getMessage() for r in caplog.records)
    q, k, v, pos = _inputs(5, 1, 2, 4, 2, 64, 16, first=5)
    q32, k32, v32 = _f32(q, k, v)
    np.testing.assert_array_equal(np.asarray(cache_attention(q32, k32, v32, pos, implementation="cpu")),
                                  np.asarray(cache_attention_reference(q32, k32, v32, pos)))
    with pytest.raises(ValueError, match="bf16 caches"):
        kernels_cpu.cache_attention(q, k32, v32, pos)
    with pytest.raises(ValueError, match="kv head"):
        kernels_cpu.cache_attention(q[:, :, :3], k, v, pos)


@needs_kernel
@pytest.mark.slow  # loads the default model
def test_load_puts_attention_on_the_kernel_with_the_matmuls():
    """`load` on CPU in bf16: matmuls and attention on the kernels; float32 keeps XLA for both."""
    from peagle_jax.api import load

    llm = load(None, method="none")
    assert llm.options["matmul"] == "cpu_kernel" and llm.options["attention"] == "cpu"
    assert {layer.self_attn.attn_impl for layer in llm.target.layers} == {"cpu"}
    out = llm.generate([llm.encode_chat("Say hello.")], max_new_tokens=4, eos_token_ids=[])
    assert len(out.tokens[0]) == 4
    llm32 = load(None, method="none", dtype="float32")
    assert llm32.options["matmul"] == "xla" and llm32.options["attention"] is None
    assert jax.default_backend() == "cpu"
