"""One set of settings for every entry point: `load`, `generate`, `serve` and the benchmarks.

`Options` is a frozen, validated model: the checks that need no loaded model run once, when it
is built, and each entry point's flags are generated from its fields (`add_option_flags`), so
the list of settings is written here and nowhere else. Settings that measured no clear gain
sit in `Options.experimental` (docs/usage.md says what each measured).
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = ["HEAD_METHODS", "HYBRID_METHODS", "LOAD_METHODS", "Experimental", "Options", "add_option_flags",
           "option_settings", "options_from_args", "settings_error"]

#: Methods `load` accepts: the generation methods plus "auto" (from the head: parallel
#: drafting -> "peagle", else "eagle3"; no head -> "none"). "ngram" drafts from the context
#: (prompt lookup) and takes no head; "peagle+ngram" / "eagle3+ngram" pair the head with it.
LOAD_METHODS = ("auto", "none", "eagle3", "peagle", "ngram", "eagle3+ngram", "peagle+ngram")
HYBRID_METHODS = ("eagle3+ngram", "peagle+ngram")
#: Methods that draft with a head alone (the draft cutoff and the second root apply to them).
HEAD_METHODS = ("eagle3", "peagle")
# The draft_weights choices that quantize a head (CPU kernel only; models.options packs them).
QUANTIZED_DRAFT_WEIGHTS = ("q7", "q4", "g4")

Method = Literal["auto", "none", "eagle3", "peagle", "ngram", "eagle3+ngram", "peagle+ngram"]


class Experimental(BaseModel):
    """Settings that did not pay on the measured hosts; kept to reproduce those measurements."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    two_chains: bool = Field(False, description="X+ngram methods: verify the head's and the lookup's drafts "
                             "together in one forward where the lookup matches (greedy rounds; mixed results)")
    second_root: bool = Field(False, description="eagle3 / peagle: also verify the head's second choice for the "
                              "first draft in the same forward (greedy rounds; +0-2% on code, 0 to -5% on chat)")
    fp8_weights: bool = Field(False, description="store the target's linear weights in FP8 (e4m3); for "
                              "accelerators with FP8 matmuls")


class Options(BaseModel):
    """What to load and how to run it. Every field is a flag of `generate` and `serve` and a
    key of the server's YAML; None means "the measured default for this backend"."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(None, description="a .gguf file, an HF directory, or a model name "
                              "(default: smollm2-135m-instruct; also qwen2.5-coder-1.5b-instruct, "
                              "qwen2.5-coder-0.5b-instruct)")
    drafter: str | None = Field("auto", description="draft head directory (AWS/EAGLE-3 or speculators layout), "
                                "'none', or 'auto': the model's shipped head for the method")
    method: Method = Field("auto", description="auto: from the head (peagle / eagle3), none without one; "
                           "ngram: prompt lookup, no head; X+ngram: the lookup's drafts where the context "
                           "matches, the head's elsewhere")
    num_draft_tokens: int | None = Field(None, ge=1, le=32, description="drafts per round, K (default: the "
                                         "fastest measured: 2 on CPUs with AMX, 1 on other CPUs, 3 elsewhere)")
    dtype: Literal["float32", "bfloat16"] = Field("bfloat16", description="weights and activations (norms, "
                                                  "softmax and logits stay float32)")
    draft_cutoff: float | None = Field(None, ge=0.0, lt=1.0, description="eagle3 / peagle: verify only the "
                                       "leading drafts whose product of head probabilities is >= this (0: all; "
                                       "default 0.1 on CPU, 0 elsewhere)")
    draft_weights: Literal["auto", "native", "q7", "q4", "g4"] = Field(
        "auto", description="the head's matmul weights on the CPU kernel: q7 7-bit, q4 4-bit Linears and a "
        "7-bit lm_head, g4 4-bit groups and an 8-bit-group lm_head (drafts are verified: output unchanged); "
        "auto: q4 with AVX512-BF16, else g4")
    target_weights: Literal["auto", "file", "bf16"] = Field(
        "auto", description="the target's matmul weights on the CPU kernel: file: a GGUF file's own 4- and 8-bit "
        "blocks (Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0; other types in bf16), its numbers exactly; bf16: "
        "dequantized to bf16; auto: file for a quantized GGUF where the kernel runs")
    prompt_lookup_min: int = Field(2, ge=1, description="smallest n-gram the ngram methods match")
    prompt_lookup_max: int = Field(4, ge=1, description="largest n-gram the ngram methods match")
    head_draft_tokens: int | None = Field(None, ge=1, description="X+ngram methods: drafts the head proposes "
                                          "where the lookup has no match (default: K)")
    mesh: str | None = Field(None, description="devices, e.g. 'model=4' or 'data=2,model=4' (default: one)")
    attention: Literal["xla", "cpu", "triton", "mosaic", "auto"] | None = Field(
        None, description="cache attention (default: auto, the Pallas kernels, on a GPU; cpu, the C++ kernel, "
        "where the matmuls run on the CPU kernel; else xla)")
    kv_cache_dtype: Literal["float32", "bfloat16", "float8_e4m3fn"] | None = Field(
        None, description="KV cache dtype (default: the model dtype)")
    matmul: Literal["auto", "xla", "cpu_kernel"] = Field(
        "auto", description="decode-sized matmuls: auto takes the row-invariant CPU kernel for bf16 on one CPU")
    layer_loop: Literal["auto", "unrolled", "scan"] = Field(
        "auto", description="the target's decoder layers: scan runs them under one lax.scan over stacked weights "
        "(compile time and program memory independent of depth), unrolled as a loop in the program; auto: scan "
        "unless on a mesh or the layers differ (e.g. a GGUF that quantizes some layers in another format)")
    served_model_name: str | None = Field(None, description="the model id reported and accepted (default: "
                                          "derived from the model)")
    experimental: Experimental = Field(default_factory=Experimental)

    @field_validator("model", "drafter", "served_model_name", mode="before")
    @classmethod
    def _blank_is_none(cls, v: Any) -> Any:
        v = os.fspath(v) if isinstance(v, os.PathLike) else v  # a pathlib.Path names a file or folder
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("mesh", mode="before")
    @classmethod
    def _mesh(cls, v: Any) -> Any:
        """"data=2,model=4", a mapping of those axes, or an object with them -> "data=2,model=4";
        one device in all -> None (no mesh)."""
        if v is None:
            return None
        if isinstance(v, str):
            from peagle_jax.sharding import parse_mesh_spec

            if not v.strip():
                raise ValueError("mesh must look like 'data=D,model=M', got an empty string")
            axes = parse_mesh_spec(v.replace(" ", ""))
        else:
            axes = dict(v) if isinstance(v, dict) else {"data": v.data, "model": v.model}
        data, model = int(axes.get("data", 1)), int(axes.get("model", 1))
        if data < 1 or model < 1 or set(axes) - {"data", "model"}:
            raise ValueError(f"mesh must look like 'data=D,model=M' with sizes >= 1, got {v!r}")
        return None if data * model == 1 else f"data={data},model={model}"

    @field_validator("drafter", mode="after")
    @classmethod
    def _drafter(cls, v: str | None) -> str | None:
        return None if v is not None and v.strip().lower() == "none" else v

    @model_validator(mode="before")
    @classmethod
    def _flat_experimental(cls, data: Any) -> Any:
        """Experimental settings may be given flat (`two_chains=True`) as well as grouped."""
        if isinstance(data, dict) and any(k in Experimental.model_fields for k in data):
            data = dict(data)
            grouped = dict(data.pop("experimental", None) or {})
            for k in Experimental.model_fields:
                if k in data:
                    grouped[k] = data.pop(k)
            data["experimental"] = grouped
        return data

    @model_validator(mode="after")
    def _check(self) -> Options:
        m, x = self.method, self.experimental
        if self.drafter is None and m not in ("auto", "none", "ngram"):
            raise ValueError(f"method {m!r} needs a draft head (drafter is 'none')")
        if m == "ngram" and self.drafter not in (None, "auto"):
            raise ValueError(f"method 'ngram' drafts from the context and takes no head; got drafter={self.drafter!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.head_draft_tokens is not None and m not in HYBRID_METHODS:
            raise ValueError(f"head_draft_tokens applies to the methods {', '.join(HYBRID_METHODS)}, not {m!r}")
        if x.two_chains and m not in HYBRID_METHODS:
            raise ValueError(f"two_chains applies to the methods {', '.join(HYBRID_METHODS)}, not {m!r}")
        for name, on in (("second_root", x.second_root), ("draft_cutoff", bool(self.draft_cutoff))):
            if on and m not in ("auto", *HEAD_METHODS):
                raise ValueError(f"{name} applies to the methods auto, {', '.join(HEAD_METHODS)}, not {m!r}")
        if self.draft_cutoff and x.second_root:
            raise ValueError("draft_cutoff and second_root do not combine: the second chain is verified at the "
                             "full width K, so a cutoff would only drop accepted drafts; set one of them")
        if self.draft_weights in QUANTIZED_DRAFT_WEIGHTS:
            if m in ("none", "ngram") or self.drafter is None:
                raise ValueError(f"draft_weights {self.draft_weights!r} quantizes a draft head; method {m!r} "
                                 f"with drafter {self.drafter!r} loads none")
            if self.dtype != "bfloat16" or self.matmul == "xla" or self.mesh is not None:
                raise ValueError(f"draft_weights {self.draft_weights!r} runs on the CPU matmul kernel: it needs "
                                 f"dtype bfloat16, one device (no mesh) and matmul 'auto' or 'cpu_kernel'; got "
                                 f"dtype {self.dtype!r}, matmul {self.matmul!r}, mesh {self.mesh!r}")
        on_kernel = self.dtype == "bfloat16" and self.matmul != "xla" and self.mesh is None
        if self.target_weights == "file" and not on_kernel:
            raise ValueError(f"target_weights 'file' runs on the CPU matmul kernel: it needs dtype bfloat16, one "
                             f"device (no mesh) and matmul 'auto' or 'cpu_kernel'; got dtype {self.dtype!r}, "
                             f"matmul {self.matmul!r}, mesh {self.mesh!r}")
        if self.matmul == "cpu_kernel" and self.mesh is not None:
            raise ValueError("matmul 'cpu_kernel' serves one unsharded CPU device; drop mesh or use matmul 'auto'")
        if self.layer_loop == "scan" and self.mesh is not None:
            raise ValueError("layer_loop 'scan' does not run on a mesh yet (the sharding rules name per-layer "
                             "parameters); drop mesh or use layer_loop 'unrolled'")
        return self

    def replace(self, **changes: Any) -> Options:
        """A copy with some settings changed (flat experimental names too), validated again."""
        data = self.model_dump()
        data.update(changes)
        return Options(**data)


# --------------------------------------------------------------------------- flags


def _fields() -> list[tuple[str, Any, bool]]:
    """(name, field info, is experimental) of every setting, in declaration order."""
    out = [(n, f, False) for n, f in Options.model_fields.items() if n != "experimental"]
    return out + [(n, f, True) for n, f in Experimental.model_fields.items()]


def _choices(annotation: Any) -> tuple[tuple | None, type]:
    """(Literal choices or None, scalar type) of a field's annotation (Optional unwrapped)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation), str
    return None, annotation if annotation in (int, float, bool) else str


def add_option_flags(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """One flag per setting (`--num-draft-tokens` / `-k`, `--two-chains`, ...), all defaulting to
    None ("not given"), so `options_from_args` layers them over a YAML file or the defaults."""
    group = parser.add_argument_group("model and speculation (peagle_jax.options.Options)")
    exp = parser.add_argument_group("experimental (Options.experimental)")
    for name, info, experimental in _fields():
        if name in skip:
            continue
        flags = ["-k"] if name == "num_draft_tokens" else []
        flags.append("--" + name.replace("_", "-"))
        choices, kind = _choices(info.annotation)
        kw: dict[str, Any] = {"default": None, "dest": name, "help": (info.description or "").replace("%", "%%")}
        if kind is bool:
            kw.update(action="store_const", const=True)
        elif choices is not None:
            kw.update(choices=choices)
        else:
            kw.update(type=kind)
        (exp if experimental else group).add_argument(*flags, **kw)


def option_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings flags gave (None: not given), by field name."""
    names = {n for n, _, _ in _fields()}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def settings_error(e: ValidationError) -> str:
    """A validation error as one line per bad setting: "field: what is wrong"."""
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ())) or "settings"
        lines.append(f"{loc}: {err.get('msg')}")
    return "; ".join(lines)


def options_from_args(args: argparse.Namespace, base: Options | None = None) -> Options:
    """`base` (default: the defaults) with the flags that were given."""
    return (base or Options()).replace(**option_settings(args))
