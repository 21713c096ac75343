"""The kernel seam (peagle_jax/kernels/): the only code under peagle_jax/ and benchmarks/ that
imports `kernels_cpu` or `kernels_pallas`, and `kernels_pallas` never imports `kernels_cpu` (its
"cpu" implementation is the seam's). Plus the seam's argmax and "xla" attention on tiny inputs."""

from __future__ import annotations

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peagle_jax import kernels

ROOT = Path(__file__).resolve().parents[2]
KERNEL_PACKAGES = {"kernels_cpu", "kernels_pallas"}


def _imported_packages(path: Path) -> set[str]:
    """The top-level packages a file imports: import statements, and importlib.import_module /
    __import__ calls with a literal name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            callee = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if callee in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return {name.split(".")[0] for name in found}


def _sources(*dirs: str, skip: str | None = None) -> list[Path]:
    files = [p for d in dirs for p in sorted((ROOT / d).rglob("*.py"))]
    return [p for p in files if skip is None or not p.is_relative_to(ROOT / skip)]


def test_only_the_seam_imports_the_kernel_packages():
    files = _sources("peagle_jax", "benchmarks", skip="peagle_jax/kernels")
    assert len(files) > 20 and ROOT / "peagle_jax/models/layers.py" in files
    offenders = {str(p.relative_to(ROOT)): sorted(_imported_packages(p) & KERNEL_PACKAGES) for p in files}
    assert {p: found for p, found in offenders.items() if found} == {}
    seam = {p.name for p in _sources("peagle_jax/kernels") if _imported_packages(p) & KERNEL_PACKAGES}
    assert {"attention.py", "matmul.py", "cpu.py"} <= seam  # the check above reads what it should


def test_kernels_pallas_does_not_import_kernels_cpu():
    files = _sources("kernels_pallas")
    assert files
    assert {str(p.relative_to(ROOT)) for p in files if "kernels_cpu" in _imported_packages(p)} == set()


def test_argmax_is_the_lowest_index_of_the_max():
    rng = np.random.default_rng(0)
    for vocab in (7, 1500):  # below and above the CPU kernel's vocabulary threshold
        x = np.round(rng.standard_normal((3, 2, vocab)) * 2).astype(np.float32)  # ties at the top
        x[0, 1, :] = -np.inf
        got = np.asarray(jax.jit(kernels.argmax)(jnp.asarray(x)))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


def test_xla_attention_is_the_reference():
    rng = np.random.default_rng(1)
    b, t, h, kvh, s, d = 2, 3, 4, 2, 8, 16
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    k = rng.standard_normal((b, kvh, s, d)).astype(np.float32)
    v = rng.standard_normal((b, kvh, s, d)).astype(np.float32)
    pos = np.array([[2, 3, 4], [5, 6, 7]], np.int32)
    got = np.asarray(kernels.cache_attention(*map(jnp.asarray, (q, k, v, pos)), implementation="xla"))
    want = np.zeros_like(q)
    for bi, ti, hi in np.ndindex(b, t, h):  # dense softmax over the visible keys, GQA by head group
        kh = hi // (h // kvh)
        scores = k[bi, kh, : pos[bi, ti] + 1] @ q[bi, ti, hi] / np.sqrt(d)
        w = np.exp(scores - scores.max())
        want[bi, ti, hi] = (w / w.sum()) @ v[bi, kh, : pos[bi, ti] + 1]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(got, np.asarray(kernels.cache_attention_reference(*map(jnp.asarray, (q, k, v, pos)))))


def test_the_seam_adds_cpu_to_the_pallas_names():
    import kernels_pallas

    assert kernels.IMPLEMENTATIONS == ("xla", "cpu", "triton", "mosaic", "auto")
    assert "cpu" not in kernels_pallas.IMPLEMENTATIONS
    assert kernels.resolve_implementation("cpu", q_dtype=jnp.float32, kv_dtype=jnp.float32) == "xla"
    assert kernels.resolve_implementation("auto") == "xla" == kernels.resolve_implementation(None)
    with pytest.raises(ValueError, match="'cpu', 'triton'"):
        kernels.cache_attention(jnp.zeros((1, 1, 2, 8)), jnp.zeros((1, 1, 4, 8)), jnp.zeros((1, 1, 4, 8)),
                                jnp.zeros((1, 1), jnp.int32), implementation="cudnn")
