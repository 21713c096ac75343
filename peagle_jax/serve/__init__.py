"""OpenAI-compatible serving with continuous batching over the speculative round step API.

`python -m peagle_jax.serve` serves the built-in default model on 127.0.0.1:8000; see
`python -m peagle_jax.serve --help` and configs/serve/*.yaml.
"""

from peagle_jax.serve.config import DEFAULT_DRAFTER, Mesh, ServeConfig, parse_mesh

__all__ = ["DEFAULT_DRAFTER", "Mesh", "ServeConfig", "create_app", "parse_mesh", "run"]


def create_app(*args, **kwargs):
    from peagle_jax.serve.app import create_app as _create_app

    return _create_app(*args, **kwargs)


def run(*args, **kwargs):
    from peagle_jax.serve.__main__ import run as _run

    return _run(*args, **kwargs)
