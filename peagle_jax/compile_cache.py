"""JAX's persistent compilation cache, on by default in the entry points (the server, `generate`,
the data generator): a restart loads its compiled programs instead of compiling them again
(docs/serving.md, start-up).

XLA's CPU programs are built for the host's instruction set, so the default folder is one per
machine kind: `<peagle cache>/xla/<arch>-<hash of the CPU's feature flags>`. A folder shared by
machines of different kinds could hand one a program it cannot run.
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

__all__ = ["OFF", "cache_folder", "enable_compilation_cache"]

OFF = "off"  # the setting that turns the cache off


def cache_folder() -> Path:
    """The default folder for this machine kind."""
    from peagle_jax.checkpoints.known_models import model_cache_dir
    from peagle_jax.kernels.cpu import cpu_flags

    flags = " ".join(sorted(cpu_flags())) or platform.processor()
    tag = hashlib.sha256(flags.encode()).hexdigest()[:12]
    return model_cache_dir() / "xla" / f"{platform.machine()}-{tag}"


def enable_compilation_cache(folder: str | None = None) -> Path | None:
    """Point JAX's persistent compilation cache at `folder` (None: the folder JAX was given by
    JAX_COMPILATION_CACHE_DIR, else `cache_folder()`; "off": no cache). Call it before the first
    compile. Returns the folder in use."""
    if folder == OFF or folder == "":
        return None
    import jax

    if folder is None and jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    path = Path(folder).expanduser() if folder else cache_folder()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    return path
