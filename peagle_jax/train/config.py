"""Training configuration: YAML -> pydantic (frozen), every key overridable from the CLI.

Overrides use dotted keys: `optim.lr=3e-4`, `--optim.lr 3e-4` or `--optim.lr=3e-4`. Values
are parsed as YAML scalars (`true`, `null`, `1e-3`, `[1, 2]`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from peagle_jax.options import settings_error


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelSection(_Frozen):
    target: str = "default"  # .gguf, HF dir, or "default" (SmolLM2-135M-Instruct)
    dtype: str = "float32"
    # Tiny random target for tests / smoke runs (ModelConfig kwargs); overrides `target`.
    random_target: dict[str, Any] | None = None
    random_seed: int = 1


class DataSection(_Frozen):
    # code: stdlib .py files; chat: JSONL conversations; selfdistill: stdlib function prompts
    # answered by the target; generated: the multi-domain answers `peagle_jax.train.generate_data`
    # wrote to `generated_dir`; random: target-generated continuations of random prompts (tests).
    source: Literal["code", "chat", "selfdistill", "generated", "random"] = "code"
    chat_path: str | None = None  # JSONL with {"messages": [...]} or {"prompt", "response"}
    generated_dir: str | None = None  # a generate_data folder of shards (data/selfdistill/<model>)
    seq_len: int = 512  # packed row length (shifted elements)
    max_docs: int | None = None  # cap on training documents (None = all)
    max_doc_tokens: int = 2048  # documents are cut into chunks of at most this many tokens
    val_percent: float = 2.0  # whole files / prompts held out (by path hash)
    shuffle_seed: int = 0
    # Features: "disk" reads precomputed shards (peagle_jax.train.features), "online" runs the target in the step.
    features: Literal["disk", "online"] = "disk"
    features_dir: str | None = None  # default: <run_dir>/../features
    feature_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    shard_tokens: int = 65536
    extract_batch: int = 4
    # code source: one window of at most this many tokens per file (None = whole files), and
    # whether to leave out the stdlib's own test suites.
    code_tokens_per_file: int | None = None
    code_skip_tests: bool = False
    # Further precomputed training shards (other features_dir/train folders of the same target)
    # read together with this config's own, e.g. corpus features beside self-distilled ones.
    extra_train_features: list[str] = []
    noise_std: float = 0.0  # uniform noise U(-a, a) added to the taps (speculators: 0.05)
    # Self-distillation
    sd_max_prompts: int = 2000
    sd_max_new_tokens: int = 192
    sd_batch: int = 16
    # random source (tests)
    random_docs: int = 64
    random_prompt_len: int = 4
    random_new_tokens: int = 60


class DrafterSection(_Frozen):
    num_layers: int = 1
    draft_vocab_size: int | None = None  # None = full target vocabulary
    mask_token_id: int | None = None  # None = vocab_size - 1
    # none: embedding frozen (head ships without it, exact); mask_row: only the mask token's
    # row trains (head must ship embed_tokens); all: the whole table trains.
    train_embed: Literal["none", "mask_row", "all"] = "none"
    init_seed: int = 0
    # A saved head (AWS or speculators layout) to fine-tune instead of a fresh one: its weights,
    # draft vocabulary (d2t) and shape are kept; num_layers / draft_vocab_size must agree or be left out.
    init_from: str | None = None
    # With init_from: "head" keeps the head's draft vocabulary; "data" gives it this run's (the
    # draft_vocab_size, default the head's, most frequent response tokens of the training set),
    # keeping every trained weight (`train.vocab.with_draft_vocabulary`).
    init_vocab: Literal["head", "data"] = "head"

    @model_validator(mode="after")
    def _vocab_needs_a_head(self) -> DrafterSection:
        if self.init_vocab == "data" and self.init_from is None:
            raise ValueError("drafter.init_vocab=data re-vocabularises the head drafter.init_from names: set init_from")
        return self


class ObjectiveSection(_Frozen):
    method: Literal["peagle", "eagle3"] = "peagle"
    num_depths: int = 4  # K (P-EAGLE)
    down_sample_ratio: float = 0.7
    down_sample_ratio_min: float = 0.2
    max_anchors: int = 256  # per packed row
    ttt_steps: int = 3  # EAGLE-3
    ttt_decay: float = 1.0


class OptimSection(_Frozen):
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    total_steps: int = 2000
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0


class TrainConfig(_Frozen):
    run_dir: str = "runs/default"
    seed: int = 0
    batch_size: int = 4  # global packed rows per step
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    drafter: DrafterSection = Field(default_factory=DrafterSection)
    objective: ObjectiveSection = Field(default_factory=ObjectiveSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    log_every: int = 1
    eval_every: int = 0  # 0 = no periodic validation
    eval_batches: int = 4
    mesh_data: int = -1  # devices on the data axis (-1 = all)
    # The step's matrix products: cpu_kernel runs them and their gradients on the CPU kernel's
    # tiles (bf16 operands, float32 sums; one device); auto: there on a CPU with AMX, else XLA.
    matmul: Literal["auto", "xla", "cpu_kernel"] = "auto"
    progress: bool = True
    max_steps: int | None = None  # stop early (for tests / chunked runs); schedule uses optim.total_steps
    # A folder in the repository for the trainable weights (bf16, shards <= 20 MB), written every
    # state_every steps (default checkpoint_every) and at the end, and committed with state_commit:
    # a run with no orbax checkpoint in run_dir goes on from it (peagle_jax/train/committed.py).
    state_dir: str | None = None
    state_every: int | None = None
    state_commit: bool = False

    @model_validator(mode="after")
    def _check(self):
        if self.objective.num_depths < 1:
            raise ValueError("objective.num_depths must be >= 1")
        if not 0 < self.objective.down_sample_ratio <= 1:
            raise ValueError("objective.down_sample_ratio must be in (0, 1]")
        if self.batch_size < 1 or self.data.seq_len < 8:
            raise ValueError("batch_size >= 1 and data.seq_len >= 8 required")
        return self

    @property
    def features_dir(self) -> Path:
        if self.data.features_dir:
            return Path(self.data.features_dir)
        return Path(self.run_dir).parent / "features"


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {key!r}: {p!r} is not a section")
    node[parts[-1]] = value


def parse_overrides(args: Sequence[str]) -> tuple[str | None, dict[str, Any]]:
    """CLI words -> (config path, nested override dict). Accepts key=value and --key value."""
    cfg_path = None
    out: dict[str, Any] = {}
    i = 0
    args = list(args)
    while i < len(args):
        a = args[i]
        if a in ("--config", "-c"):
            cfg_path = args[i + 1]
            i += 2
            continue
        if a.startswith("--config="):
            cfg_path = a.split("=", 1)[1]
            i += 1
            continue
        if a.startswith("--"):
            a = a[2:]
            if "=" in a:
                k, v = a.split("=", 1)
                i += 1
            else:
                if i + 1 >= len(args):
                    raise ValueError(f"--{a} needs a value")
                k, v = a, args[i + 1]
                i += 2
        elif "=" in a:
            k, v = a.split("=", 1)
            i += 1
        else:
            raise ValueError(f"cannot parse argument {a!r} (use key=value or --key value)")
        _set_dotted(out, k.replace("-", "_"), _parse_value(v))
    return cfg_path, out


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    raw: dict[str, Any] = {}
    if path is not None:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    return TrainConfig.model_validate(_merge(raw, overrides or {}))


def config_from_argv(argv: Sequence[str]) -> TrainConfig:
    """The config an entry point's command line names. A missing or unreadable file, an unknown
    key or a bad value exits with one line naming it, not a traceback."""
    try:
        path, over = parse_overrides(argv)
        return load_config(path, over)
    except ValidationError as e:
        raise SystemExit(f"config: {settings_error(e)}") from None
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise SystemExit(f"config: {e}") from None

