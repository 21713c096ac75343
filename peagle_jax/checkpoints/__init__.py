"""Checkpoint formats <-> NNX state: HF safetensors, GGUF, drafter layouts, tokenizers."""

from __future__ import annotations

from pathlib import Path

from peagle_jax.checkpoints.params import CheckpointError


def load_target(path: str | Path, *, dtype: str = "float32"):
    """Load a target CausalLM from a .gguf file or an HF directory (config.json + safetensors)."""
    path = Path(path)
    if path.suffix == ".gguf":
        from peagle_jax.checkpoints.gguf_loader import load_gguf_model

        return load_gguf_model(path, dtype=dtype)
    if path.is_dir():
        from peagle_jax.checkpoints.hf import load_hf_model

        return load_hf_model(path, dtype=dtype)
    raise FileNotFoundError(f"not a .gguf file or an HF model directory: {path}")


__all__ = ["CheckpointError", "load_target"]
