"""Whether and which CPU kernels run here: the one place that asks `kernels_cpu`.

The first question compiles the library if it is missing or stale (a few seconds, once per
checkout) and registers its custom calls; importing this module does neither.
"""

from __future__ import annotations

import kernels_cpu


def unavailable_reason() -> str | None:
    """Why the CPU kernels cannot run here (no AVX2/FMA, no compiler, a jaxlib that refuses the
    library), or None where they can."""
    return kernels_cpu.unavailable_reason()


def available() -> bool:
    """Whether the CPU kernels are built, loaded and registered here."""
    return kernels_cpu.available()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (`kernels_cpu.cpu_flags`; empty where they cannot be read)."""
    return kernels_cpu.cpu_flags()


def instruction_set() -> str:
    """The loops the CPU kernels run here: "amx", "avx512bf16", "avx512f" or "avx2"
    (`kernels_cpu.instruction_set`; all but "amx" give the same bits)."""
    return kernels_cpu.instruction_set()
