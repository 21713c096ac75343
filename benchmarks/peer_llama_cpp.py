"""Peer: llama.cpp (llama-cpp-python) decoding the same GGUF file as ours, plainly and with its
prompt lookup (issue #51).

Why: every CPU user of a real model compares with llama.cpp first. llama.cpp lives in its own
venv, built from PyPI's source by `bash benchmarks/peers/llama_cpp/setup.sh` at
$LLAMA_CPP_PEER_DIR (default <repo>/../runs/peers/llama_cpp); it is never a dependency of
peagle-jax. `LlamaCppPeer` runs `benchmarks/peers/llama_cpp/runner.py` with that venv's python
as one long-lived process and hands it one prompt at a time, so the offline benchmark
(`--llama-cpp-peer`) interleaves llama.cpp's rows with ours prompt by prompt, at batch 1.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from benchmarks import common

REPO = Path(__file__).resolve().parent.parent
RUNNER = REPO / "benchmarks" / "peers" / "llama_cpp" / "runner.py"
SETUP = REPO / "benchmarks" / "peers" / "llama_cpp" / "setup.sh"
METHODS = ("llama_cpp_greedy", "llama_cpp_prompt_lookup")


def peer_python() -> Path:
    """The peer venv's python: $LLAMA_CPP_PEER_DIR/venv, or <repo>/../runs/peers/llama_cpp/venv."""
    return common.peer_dir("llama_cpp", "LLAMA_CPP_PEER_DIR") / "venv" / "bin" / "python"


def missing_reason() -> str | None:
    """Why the peer cannot run here (None: it can)."""
    py = peer_python()
    if not py.exists():
        return f"the llama.cpp peer is not built ({py} missing): run bash {SETUP.relative_to(REPO)}"
    return None


class LlamaCppPeer:
    """llama.cpp on one prompt at a time (the HF peer's interface: `methods`, `generate`, `warm_up`)."""

    name = "llama_cpp"
    methods = list(METHODS)

    def __init__(self, gguf: str | Path, eos_ids: list[int], *, lookup_tokens: int = 10, threads: int | None = None,
                 n_ctx: int = 4096):
        reason = missing_reason()
        if reason:
            raise RuntimeError(reason)
        self.threads = threads or len(os.sched_getaffinity(0))
        self.proc = subprocess.Popen([str(peer_python()), str(RUNNER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        ready = self._call(dict(model=str(gguf), n_ctx=n_ctx, threads=self.threads, lookup_tokens=lookup_tokens,
                                eos_ids=list(eos_ids)))
        self.version = ready["version"]
        self.skipped: dict[str, str] = {}

    def _call(self, message: dict) -> dict:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp peer exited (code {self.proc.poll()}); its stderr says why")
        return json.loads(line)

    def generate(self, method: str, prompt: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        """(new tokens, EOS included when hit; seconds, prompt prefill included)."""
        if method not in METHODS:
            raise ValueError(f"unknown llama.cpp peer method {method!r}; known: {METHODS}")
        r = self._call(dict(method=method, prompt=[int(t) for t in prompt], max_new_tokens=int(max_new_tokens)))
        return r["tokens"], float(r["seconds"])

    def warm_up(self, prompt: list[int]) -> None:
        for m in self.methods:
            self.generate(m, prompt, 4)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
