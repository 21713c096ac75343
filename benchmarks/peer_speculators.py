"""Our exported heads in the `speculators` package's own model classes: the same logits?

A head we train must serve wherever EAGLE-3 / P-EAGLE heads serve (#19). vLLM is checked end to
end by `benchmarks/peer_vllm.py`; this checks the other consumer of the speculators layout. For
each shipped head it
  1. exports the head in the speculators layout (`peagle_jax.train.export.reexport`);
  2. runs the real target on a chat prompt to get its feature taps, and our drafter over the
     prompt's rows (token p+1 with the features of position p); for the P-EAGLE head the last
     K-1 rows are placeholders (mask token, learned mask_hidden), as in a P-EAGLE drafting pass;
  3. has `benchmarks/peers/speculators/runner.py`, in the peer venv of
     `bash benchmarks/peers/speculators/setup.sh`, load the export with
     `speculators.models.{eagle3,peagle}` and run the same rows through it;
  4. compares the draft-vocabulary logits (both in float32).

  .venv/bin/python -m benchmarks.peer_speculators [--placeholders 3] [--out results/peer_speculators]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common

REPO = Path(__file__).resolve().parent.parent
RUNNER = REPO / "benchmarks" / "peers" / "speculators" / "runner.py"
SETUP = REPO / "benchmarks" / "peers" / "speculators" / "setup.sh"
HEADS = {"eagle3": REPO / "assets" / "heads" / "smollm2-135m-eagle3",
         "peagle": REPO / "assets" / "heads" / "smollm2-135m-peagle"}
PROMPT = "Write a Python function that reverses a string."


def peer_python() -> Path:
    return common.peer_dir("speculators", "SPECULATORS_PEER_DIR") / "venv" / "bin" / "python"


def missing_reason() -> str | None:
    """None when the peer venv is ready, else why not and how to build it (looks at files only)."""
    py = peer_python()
    build = f"build it with: bash {SETUP.relative_to(REPO)}"
    if not py.exists():
        return f"no speculators peer venv at {py.parent.parent}; {build}"
    if not list((py.parent.parent / "lib").glob("python3*/site-packages/speculators/__init__.py")):
        return f"the peer venv {py.parent.parent} has no speculators installed; {build}"
    return None


def our_inputs_and_logits(llm, drafter, placeholders: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The rows both sides run (features, ids, the shared embedding, mask rows) and our logits."""
    import jax.numpy as jnp

    target = llm.target
    ids = llm.encode_chat(PROMPT)
    t = len(ids)
    out = target(jnp.asarray([ids]), jnp.arange(t)[None], target.init_cache(1, 2 * t), return_aux=True)
    aux = out.aux_hidden  # [1, T, A]
    tokens = jnp.asarray([ids[1:] + [0]])  # row p: token p+1 with the features of position p
    feats = drafter.project(aux)
    mask_rows = np.zeros(t, bool)
    if placeholders and drafter.can_draft_parallel:
        mask_rows[t - placeholders:] = True
        rows = jnp.asarray(mask_rows)[None]
        tokens = jnp.where(rows, drafter.config.mask_token_id, tokens)
        feats = jnp.where(rows[..., None], drafter.mask_feature().astype(feats.dtype), feats)
    logits = drafter(tokens, feats, jnp.arange(t)[None], drafter.init_cache(1, 2 * t)).logits[0]
    inputs = {"hidden_states": np.asarray(aux[0], np.float32), "input_ids": np.asarray(tokens[0], np.int64),
              "embed_tokens": np.asarray(target.embed_tokens[...], np.float32), "mask_rows": mask_rows}
    return inputs, np.asarray(logits, np.float32)


def run_peer(head_dir: Path, inputs: dict[str, np.ndarray], work: Path) -> tuple[np.ndarray, str]:
    reason = missing_reason()
    if reason:
        raise RuntimeError(reason)
    np.savez(work / "inputs.npz", **inputs)
    env = common.peer_env()
    env["HF_HUB_OFFLINE"] = "1"  # nothing to fetch: the export and the inputs are local
    proc = subprocess.run([str(peer_python()), str(RUNNER), "--head", str(head_dir), "--inputs",
                           str(work / "inputs.npz"), "--out", str(work / "out.npz")],
                          capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"speculators runner failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = np.load(work / "out.npz")
    return out["logits"], str(out["version"])


def compare(method: str, llm, placeholders: int) -> dict[str, Any]:
    from peagle_jax.checkpoints.drafter_io import load_drafter
    from peagle_jax.train.export import reexport

    with tempfile.TemporaryDirectory(prefix=f"peer_spec_{method}_") as tmp:
        work = Path(tmp)
        export = work / "speculators"
        reexport(HEADS[method], export, layout="speculators", dtype="bfloat16")
        drafter = load_drafter(export, target=llm.target, dtype="float32")  # our loader, the same file
        inputs, ours = our_inputs_and_logits(llm, drafter, placeholders if method == "peagle" else 0)
        theirs, version = run_peer(export, inputs, work)
    diff = np.abs(ours - theirs)
    return {"method": method, "rows": int(ours.shape[0]), "mask_rows": int(inputs["mask_rows"].sum()),
            "draft_vocab": int(ours.shape[1]), "max_abs_diff": float(diff.max()),
            "max_abs_logit": float(np.abs(ours).max()),
            "argmax_agreement": float(np.mean(ours.argmax(-1) == theirs.argmax(-1))), "speculators_version": version}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--placeholders", type=int, default=3, help="P-EAGLE mask rows at the end (K-1)")
    ap.add_argument("--out", default="results/peer_speculators")
    args = ap.parse_args(argv)
    reason = missing_reason()
    if reason:
        raise SystemExit(reason)
    from peagle_jax.api import load

    llm = load(None, method="none", dtype="float32")
    rows = [compare(m, llm, args.placeholders) for m in HEADS]
    summary = {"prompt": PROMPT, "results": rows, "machine": common.machine_info()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "peer_speculators.json", summary)
    table = [[r["method"], r["rows"], r["mask_rows"], common.fmt(r["max_abs_diff"], 7), common.fmt(r["max_abs_logit"]),
              common.fmt(r["argmax_agreement"], 3), r["speculators_version"]] for r in rows]
    md = ["# Our exported heads in speculators' own model classes (float32 logits)", "",
          common.md_table(["head", "rows", "of them mask rows", "max |ours - theirs|", "max |logit|",
                           "argmax agreement", "speculators"], table), ""]
    (out / "peer_speculators.md").write_text("\n".join(md))
    print("\n".join(md))
    return summary


if __name__ == "__main__":
    main()
