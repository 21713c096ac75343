"""How much data a head needs: held-out acceptance length against training tokens.

For each budget of answer tokens it trains the config's head on the first conversations of the
`generate_data` folder that hold that many answer tokens (`data.max_docs`; `shards.read_split`
reads them in a fixed mixed order, so every prefix has every domain), for steps in proportion to the budget (the same
epochs at every size), exports it, and measures greedy acceptance on the folder's held-out val
prompts (`peagle_jax.train.evaluate`). Features are extracted once, for all the data, and every
run reads its prefix of them. Each step is its own process, and a budget whose evaluation is
already in the output folder is not run again, so a killed curve resumes.

  .venv/bin/python -m benchmarks.learning_curve --config configs/train/peagle_qwen05.yaml
      [--tokens 250000 500000 1000000 all] [--num-draft-tokens 7] [--prompts 32]
      [--max-new-tokens 128] [--min-steps 200] [--out results/learning_curve/<config name>]
      [key=value ...  (train overrides for every run)]

Writes <out>/learning_curve.{json,md,png}; the runs (checkpoints, exported heads) go to
<run_dir of the config>_curve/<budget>/, outside the repository.

A cheaper curve, from the checkpoints of the one run the config trains (no extra training):
`--checkpoints DIR` evaluates every head exported as DIR/step_<N> (`train.export --step N --out`,
while the run goes on, since a run keeps only its last checkpoints), and counts the tokens step N
had read from the run's metrics.jsonl. Its points share one learning-rate schedule, so an early
point is a head still at a high rate, not a head trained to the end on less data.

  .venv/bin/python -m benchmarks.learning_curve --config configs/train/peagle_qwen05.yaml \
      --checkpoints ../runs/curve_qwen05 [--out results/learning_curve/peagle_qwen05_one_run]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks import common


def budget_docs(generated_dir: Path, budgets: list[int | None]) -> dict[int | None, tuple[int, int]]:
    """{budget: (documents, answer tokens)}: the fewest leading training conversations holding at
    least `budget` answer tokens (None: all of them)."""
    from peagle_jax.train.shards import read_split

    records = read_split(generated_dir, "train")  # the order training reads them in
    total = sum(len(r.response) for r in records)
    out: dict[int | None, tuple[int, int]] = {}
    for budget in budgets:
        if budget is None or budget >= total:
            out[budget] = (len(records), total)
            continue
        seen = 0
        for i, r in enumerate(records):
            seen += len(r.response)
            if seen >= budget:
                out[budget] = (i + 1, seen)
                break
    return out


def run(cmd: list[str], log: Path) -> str:
    """Run one step in its own process, its output appended to `log`; its stdout on success."""
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    with log.open("a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}\n")
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[2]} failed (exit {proc.returncode}); see {log}:\n{proc.stderr[-2000:]}")
    return proc.stdout


def answer_share(generated_dir: Path) -> float:
    """Answer tokens over all the tokens of the training conversations (prompts and answers)."""
    from peagle_jax.train.shards import read_split

    records = read_split(generated_dir, "train")
    answers = sum(len(r.response) for r in records)
    return answers / (answers + sum(len(r.prompt) for r in records))


def tokens_read(metrics: Path) -> dict[int, float]:
    """{step: document tokens read up to and including it} from a run's metrics.jsonl (a resumed
    run appends; its last record for a step counts)."""
    per_step: dict[int, float] = {}
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if "tokens" in rec and "step" in rec:
            per_step[int(rec["step"])] = float(rec["tokens"])
    seen, total = {}, 0.0
    for step in sorted(per_step):
        total += per_step[step]
        seen[step] = total
    return seen


def one_run_rows(cfg, heads: Path, share: float, a) -> list[dict[str, Any]]:
    """Held-out acceptance of every head exported as `heads`/step_<N> from the config's run;
    `share`: the answers' share of the document tokens (`answer_share`)."""
    seen = tokens_read(Path(cfg.run_dir) / "metrics.jsonl")
    steps = sorted(int(p.name.split("_", 1)[1]) for p in heads.glob("step_*") if p.name.split("_", 1)[1].isdigit())
    if not steps:
        raise SystemExit(f"--checkpoints {heads}: no step_<N> head folders (train.export --step N --out .../step_N)")
    rows = []
    for step in steps:
        if step not in seen:
            raise SystemExit(f"{cfg.run_dir}/metrics.jsonl has no record of step {step}")
        head = heads / f"step_{step}"
        head = head / "aws" if (head / "aws").is_dir() else head  # `train.export` writes a folder per layout
        result = heads / f"step_{step}.evaluate.json"
        if not result.exists():
            stdout = run([sys.executable, "-m", "peagle_jax.train.evaluate", "--run_dir", str(cfg.run_dir),
                          "--head", str(head), "--num_draft_tokens", str(a.num_draft_tokens),
                          "--prompts", str(a.prompts), "--max_new_tokens", str(a.max_new_tokens)],
                         heads / "learning_curve.log")
            result.write_text(stdout.strip().splitlines()[-1] + "\n")
        row = json.loads(result.read_text())
        rows.append({"answer_tokens": round(seen[step] * share), "document_tokens": round(seen[step]),
                     "steps": step, **row})
        print(f"CURVE step={step} tokens={rows[-1]['answer_tokens']} al={row['mean_acceptance_length']:.3f}",
              flush=True)
    return rows


def write_report(summary: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    one_run = summary.get("kind") == "one run"
    lines = [f"# Held-out acceptance against training tokens: {summary['config']}", "",
             f"`{summary['command']}`", "",
             f"Target {summary['target']}, {summary['method']} head, K={summary['num_draft_tokens']}, "
             f"{summary['prompts']} held-out prompts, greedy, {summary['max_new_tokens']} new tokens.", ""]
    if one_run:
        lines += ["Points are checkpoints of one run (one learning-rate schedule); answer tokens are the "
                  "document tokens read times the answers' share of the training conversations "
                  f"({summary['answer_share']:.3f}).", ""]
    lines += [f"| answer tokens | {'document tokens' if one_run else 'conversations'} | steps | held-out AL "
              "| acceptance per position |", "|---|---|---|---|---|"]
    for r in rows:
        rates = " ".join(f"{x:.2f}" for x in r["acceptance_rate_per_position"])
        second = r["document_tokens"] if one_run else r["docs"]
        lines.append(f"| {r['answer_tokens']:,} | {second:,} | {r['steps']} | {r['mean_acceptance_length']:.3f} "
                     f"| {rates} |")
    lines += ["", "## Machine", "", *(f"- {k}: {v}" for k, v in summary["machine"].items())]
    out.mkdir(parents=True, exist_ok=True)
    (out / "learning_curve.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["answer_tokens"] for r in rows], [r["mean_acceptance_length"] for r in rows], "o-")
    ax.set_xscale("log")
    ax.set_xlabel("training answer tokens")
    ax.set_ylabel(f"held-out acceptance length (K={summary['num_draft_tokens']})")
    ax.set_title(f"{summary['method']} head on {summary['target']}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "learning_curve.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.learning_curve", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="a training config with data.source: generated")
    ap.add_argument("--tokens", nargs="+", default=["250000", "500000", "1000000", "all"],
                    help="answer-token budgets ('all': every training conversation)")
    ap.add_argument("--num-draft-tokens", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=32, help="held-out val prompts to evaluate on")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--min-steps", type=int, default=200, help="the fewest training steps of a run")
    ap.add_argument("--out", default=None, help="default: results/learning_curve/<config name>[_one_run]")
    ap.add_argument("--checkpoints", default=None,
                    help="a folder of step_<N> heads exported from the config's one run: evaluate those, train nothing")
    ap.add_argument("overrides", nargs="*", help="key=value train overrides for every run")
    a = ap.parse_args(argv)
    from peagle_jax.train.config import load_config, parse_overrides

    _, overrides = parse_overrides(a.overrides)
    cfg = load_config(a.config, overrides)
    if cfg.data.source != "generated":
        ap.error(f"{a.config}: data.source is {cfg.data.source!r}; a learning curve reads a generate_data folder")
    budgets = [None if t == "all" else int(float(t)) for t in a.tokens]
    name = Path(a.config).stem
    command = "python -m benchmarks.learning_curve " + " ".join(argv or sys.argv[1:])
    if a.checkpoints is not None:
        out = Path(a.out or f"results/learning_curve/{name}_one_run")
        share = answer_share(Path(cfg.data.generated_dir))
        summary = {"config": a.config, "command": command, "kind": "one run", "target": cfg.model.target,
                   "method": cfg.objective.method, "num_draft_tokens": a.num_draft_tokens, "prompts": a.prompts,
                   "max_new_tokens": a.max_new_tokens, "answer_share": share,
                   "rows": one_run_rows(cfg, Path(a.checkpoints), share, a), "machine": common.machine_info()}
        common.write_json(out / "learning_curve.json", summary)
        write_report(summary, out)
        return 0
    out = Path(a.out or f"results/learning_curve/{name}")
    runs = Path(str(cfg.run_dir) + "_curve")
    runs.mkdir(parents=True, exist_ok=True)
    log = runs / "learning_curve.log"
    sizes = budget_docs(Path(cfg.data.generated_dir), budgets)
    total_tokens = max(tokens for _, tokens in sizes.values())
    py = [sys.executable, "-m"]
    # features of every conversation, once (each run reads its prefix)
    run([*py, "peagle_jax.train.features", "--config", a.config, *a.overrides], log)
    rows = []
    for budget in budgets:
        docs, tokens = sizes[budget]
        run_dir = runs / ("all" if budget is None else str(budget))
        result = run_dir / "evaluate.json"
        steps = max(a.min_steps, round(cfg.optim.total_steps * tokens / total_tokens))
        if not result.exists():
            run([*py, "peagle_jax.train.train", "--config", a.config, *a.overrides, f"run_dir={run_dir}",
                 f"data.max_docs={docs}", f"optim.total_steps={steps}", "progress=false"], log)
            run([*py, "peagle_jax.train.export", "--run_dir", str(run_dir), "--out", str(run_dir / "export"),
                 "--layout", "aws"], log)
            stdout = run([*py, "peagle_jax.train.evaluate", "--run_dir", str(run_dir),
                          "--head", str(run_dir / "export" / "aws"),
                          "--num_draft_tokens", str(a.num_draft_tokens), "--prompts", str(a.prompts),
                          "--max_new_tokens", str(a.max_new_tokens)], log)
            result.write_text(stdout.strip().splitlines()[-1] + "\n")
        row = json.loads(result.read_text())
        rows.append({"answer_tokens": tokens, "docs": docs, "steps": steps, **row})
        print(f"CURVE tokens={tokens} steps={steps} al={row['mean_acceptance_length']:.3f}", flush=True)
    summary = {"config": a.config, "command": command,
               "target": cfg.model.target, "method": cfg.objective.method, "num_draft_tokens": a.num_draft_tokens,
               "prompts": a.prompts, "max_new_tokens": a.max_new_tokens, "rows": rows,
               "machine": common.machine_info()}
    common.write_json(out / "learning_curve.json", summary)
    write_report(summary, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
