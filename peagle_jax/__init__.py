"""peagle-jax: P-EAGLE / EAGLE-3 speculative decoding in JAX.

  from peagle_jax import load
  llm = load()                      # default model + shipped P-EAGLE head
  out = llm.generate([llm.encode_chat("Hello!")], max_new_tokens=32)
  print(llm.decode(out.tokens[0]))

Names are imported on first use, so `import peagle_jax.<submodule>` stays cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load": "peagle_jax.api",
    "LoadedModel": "peagle_jax.api",
    "chat_ids": "peagle_jax.api",
    "speculative_generate": "peagle_jax.generate",
    "GenerationResult": "peagle_jax.generate",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'peagle_jax' has no attribute {name!r}")
