"""The front door: one call that loads a target, its tokenizer and a draft head, ready to run.

  from peagle_jax import load
  llm = load()                                   # SmolLM2-135M-Instruct + its shipped P-EAGLE head
  out = llm.generate([llm.encode_chat("Write a haiku about JAX.")], max_new_tokens=64)
  print(llm.decode(out.tokens[0]))

`python -m peagle_jax.generate`, `python -m peagle_jax.serve` and the benchmarks call `load`, so
resolving the model and the head, choosing the method, encoding chat prompts, FP8 / kernel
options and the device mesh each happen here and nowhere else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle_jax.options import HEAD_METHODS, HYBRID_METHODS, LOAD_METHODS, QUANTIZED_DRAFT_WEIGHTS, Options

__all__ = ["HYBRID_METHODS", "LOAD_METHODS", "SECOND_ROOT_METHODS", "LoadedModel", "Options", "chat_ids", "load",
           "method_for", "resolve_drafter"]

log = logging.getLogger("peagle_jax")

#: Methods whose head may also propose its second choice for the first draft (`second_root`).
SECOND_ROOT_METHODS = HEAD_METHODS


def chat_ids(tokenizer, messages: Sequence[Mapping[str, str]] | str) -> list[int]:
    """Token ids of a chat prompt (the model's template, generation prompt appended).

    A bare string is one user message. transformers returns a list for some tokenizers and a
    BatchEncoding for others; both become a plain list of ints here.
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(i) for i in ids]


def method_for(drafter) -> str:
    """The method a drafter implies: "peagle" for a parallel-drafting head, "eagle3" for a sequential
    one, "ngram" for a drafter that reads no target features, "none" without one."""
    if drafter is None:
        return "none"
    if not drafter.uses_features:
        return "ngram"
    from peagle_jax.drafters.hybrid import HybridProposer

    if isinstance(drafter, HybridProposer):
        return method_for(drafter.head) + "+ngram"
    return "peagle" if drafter.config.parallel_drafting else "eagle3"


def is_default_model(model: str | None) -> bool:
    from peagle_jax.checkpoints.default_model import DEFAULT_MODEL_ALIASES

    return model is None or model.strip().lower() in DEFAULT_MODEL_ALIASES


def resolve_drafter(model: str | None, drafter: str | None, method: str) -> str | None:
    """Which head to load: an explicit path, none, or ("auto") the default model's shipped head
    for the method asked for (P-EAGLE unless method is "eagle3")."""
    if method not in LOAD_METHODS:
        raise ValueError(f"method must be one of {LOAD_METHODS}, got {method!r}")
    if drafter is None or drafter.strip().lower() == "none" or method == "none":
        return None
    if method == "ngram":
        if drafter != "auto":
            raise ValueError(f"method 'ngram' drafts from the context and takes no head; got drafter={drafter!r}")
        return None
    if drafter != "auto":
        return drafter
    from peagle_jax.checkpoints.default_model import shipped_drafter_path

    shipped = shipped_drafter_path(model, "eagle3" if method.startswith("eagle3") else "peagle")
    return None if shipped is None else str(shipped)


@dataclass
class LoadedModel:
    """A target, its tokenizer and (optionally) a draft head, configured and placed."""

    target: Any
    tokenizer: Any
    eos_ids: list[int]
    drafter: Any
    method: str
    model_path: Path
    model_name: str
    drafter_path: str | None
    mesh: Any = None
    options: dict[str, Any] = field(default_factory=dict)  # dtype, attention, kv_cache_dtype
    #: load(draft_weights=...) as asked; options["draft_weights"] is what the last head got
    draft_weights_request: str = "auto"
    settings: Options = field(default_factory=Options)  # what `load` was asked for

    @classmethod
    def from_target(cls, target, tokenizer=None, *, eos_ids: Sequence[int] = (), drafter=None, method: str = "none",
                    name: str = "in-memory", dtype: str = "float32") -> LoadedModel:
        """Wrap a model built in memory (tests, tiny random targets) like a loaded one."""
        return cls(target=target, tokenizer=tokenizer, eos_ids=list(eos_ids), drafter=drafter, method=method,
                   model_path=Path(name), model_name=name, drafter_path=None, options=dict(dtype=dtype))

    def load_head(self, spec: str, draft_weights: str | None = None):
        """Another draft head for this target, with the same dtype, kernel options and mesh
        (benchmarks comparing heads load the target once). draft_weights: as `load`'s; None
        keeps what `load` was asked for (not what an earlier head resolved it to)."""
        from peagle_jax.checkpoints.drafter_io import load_drafter
        from peagle_jax.models.options import (
            choose_matmul,
            configure_inference,
            draft_weights_for,
        )
        from peagle_jax.sharding import shard_module

        head = load_drafter(spec, target=self.target, dtype=self.options.get("dtype", "bfloat16"))
        configure_inference(head, attention=self.options.get("attention"),
                            kv_cache_dtype=self.options.get("kv_cache_dtype"))
        requested = self.draft_weights_request if draft_weights is None else draft_weights
        weights = draft_weights_for(requested, self.options.get("matmul", "xla"))
        if self.options.get("matmul") == "cpu_kernel":
            if choose_matmul(head, "auto", weights if weights in QUANTIZED_DRAFT_WEIGHTS else "bf16") != "cpu_kernel":
                weights = draft_weights_for(requested, "xla")  # the kernel cannot serve this head
        self.options["draft_weights"] = weights
        return shard_module(head, self.mesh)

    def place_on(self, mesh) -> LoadedModel:
        """Shard the target and the head (if any) over `mesh` (None: leave them on one device);
        heads loaded later with `load_head` follow the same mesh."""
        from peagle_jax.sharding import shard_module

        self.mesh = mesh
        for module in (self.target, self.drafter):
            if module is not None:
                shard_module(module, mesh)
        return self

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text)]

    def encode_chat(self, messages: Sequence[Mapping[str, str]] | str) -> list[int]:
        return chat_ids(self.tokenizer, messages)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def generate(self, prompts: Sequence[Sequence[int]], **kwargs):
        """`speculative_generate` with this model's method, head and EOS ids (overridable)."""
        from peagle_jax.generate import speculative_generate

        kwargs.setdefault("method", self.method)
        kwargs.setdefault("eos_token_ids", self.eos_ids)
        return speculative_generate(self.target, self.drafter, prompts, **kwargs)


def _exact_two_chains(requested: bool, attention: str | None, option: str) -> bool:
    """`requested`, unless this host's attention would round a second chain's rows differently
    from their natural rows (then a two-chain verify could change greedy tokens: warn, refuse)."""
    from peagle_jax.generate.tree import two_chains_exact_here

    if requested and not two_chains_exact_here(attention or "xla"):
        log.warning("%s: on this host the attention rounds a second chain's rows differently from their natural "
                    "rows (generate.tree.second_chain_mismatches), so a two-chain verify could change greedy "
                    "tokens; verifying one chain per round instead", option)
        return False
    return requested


def load(model: str | None = None, options: Options | None = None, **settings: Any) -> LoadedModel:
    """Load and configure a target model and its draft head.

    model: a .gguf file, an HF model directory, or a model name (None / "default": the built-in
      SmolLM2-135M-Instruct; `checkpoints.known_models.KNOWN_MODELS` lists the others).
    options: every other setting (`peagle_jax.options.Options`, where each field says what it
      does); `settings` are Options fields given as keywords (`load(method="none",
      dtype="float32")`), applied over `options`. Experimental ones may be given flat
      (`second_root=True`).

    Resolves the model and the head ("auto": the model's shipped head for the method), picks the
    method from the head, joins a multi-host job when the launcher's variables say so, and
    applies the kernel / FP8 / mesh options (on CPU in bf16 that includes the row-invariant CPU
    matmul kernel). `llm.options` records what ran. Raises FileNotFoundError / ValueError with a
    message naming the bad setting.
    """
    from peagle_jax.sharding import maybe_initialize_distributed

    opts = (options or Options()).replace(**settings, **({} if model is None else {"model": model}))
    head_spec = resolve_drafter(opts.model, opts.drafter or "none", opts.method)
    _check_head(opts, head_spec)
    maybe_initialize_distributed()
    t0 = time.perf_counter()
    llm = _load_target(opts, head_spec)
    if opts.method == "ngram":
        from peagle_jax.drafters.ngram import NgramProposer

        llm.drafter = NgramProposer(opts.prompt_lookup_min, opts.prompt_lookup_max)
    if head_spec is not None:
        _attach_head(llm, opts, head_spec)
    llm.method = opts.method if opts.method != "auto" else method_for(llm.drafter)
    log.info("loaded %s%s in %.1fs (method %s)", llm.model_path.name, f" + {head_spec}" if head_spec else "",
             time.perf_counter() - t0, llm.method)
    return llm


def _check_head(opts: Options, head_spec: str | None) -> None:
    """The checks that need to know whether a head was found (the rest ran in `Options`)."""
    if head_spec is not None:
        return
    if opts.method in ("eagle3", "peagle", *HYBRID_METHODS):
        raise ValueError(f"method {opts.method!r} needs a draft head (drafter=DIR)"
                         + ("" if is_default_model(opts.model) else f"; no head ships for {opts.model!r}"))
    if opts.draft_weights in QUANTIZED_DRAFT_WEIGHTS:
        raise ValueError(f"draft_weights={opts.draft_weights!r} quantizes a draft head, and method "
                         f"{opts.method!r} loads none")
    for name, on in (("second_root", opts.experimental.second_root), ("draft_cutoff", bool(opts.draft_cutoff))):
        if on:
            raise ValueError(f"{name} needs a draft head and a head method ({', '.join(HEAD_METHODS)} or auto); "
                             f"got method {opts.method!r} without a head")


def _load_target(opts: Options, head_spec: str | None) -> LoadedModel:
    """The target and tokenizer, with the kernel / FP8 options, placed on the mesh."""
    import jax

    from peagle_jax.checkpoints import load_target
    from peagle_jax.checkpoints.default_model import DEFAULT_MODEL_NAME, resolve_model_path
    from peagle_jax.checkpoints.known_models import known_model
    from peagle_jax.checkpoints.tokenizer import eos_token_ids, load_tokenizer
    from peagle_jax.models.layer_stack import stack_blocker
    from peagle_jax.models.options import choose_matmul, configure_inference, quantize_weights_fp8
    from peagle_jax.sharding import make_mesh

    model_path = resolve_model_path(opts.model)
    device_mesh = make_mesh(opts.mesh)
    why_not_file = "target_weights is bf16" if opts.target_weights == "bf16" else _file_weights_blocker(
        opts, model_path, device_mesh)
    file_weights = None
    if why_not_file is None:
        from peagle_jax.checkpoints.gguf_loader import load_gguf_model_with_blocks

        target, file_weights = load_gguf_model_with_blocks(model_path, dtype=opts.dtype)
        if not file_weights:
            why_not_file = "the file holds no Q4_0 / Q4_1 / Q4_K / Q5_0 / Q6_K / Q8_0 Linear weights"
    else:
        target = load_target(model_path, dtype=opts.dtype)
    if why_not_file is not None and opts.target_weights == "file":
        raise ValueError(f"target_weights 'file' cannot serve {model_path.name}: {why_not_file}")
    tokenizer = load_tokenizer(model_path)
    if opts.experimental.fp8_weights:
        quantize_weights_fp8(target)
    attention = opts.attention
    if attention is None and jax.default_backend() == "gpu":
        attention = "auto"  # the Pallas kernels (Mosaic on sm_90+, else Triton), as docs/gpu.md measures
    configure_inference(target, attention=attention, kv_cache_dtype=opts.kv_cache_dtype)
    matmul_path = "xla" if device_mesh is not None else choose_matmul(target, opts.matmul, file_weights=file_weights)
    if attention is None and matmul_path == "cpu_kernel":
        # Where the matmuls run on the CPU kernel, attention does too: the C++ kernel is
        # row-invariant like them and costs a fraction of XLA's blockwise loop.
        attention = "cpu"
        configure_inference(target, attention=attention)
    layer_loop = opts.layer_loop
    if layer_loop == "auto":  # the scan wherever the layers stack (results/compile_cost/README.md)
        why = stack_blocker(target)
        layer_loop = "scan" if why is None else "unrolled"
        if why is not None:
            log.info("layers unrolled: %s", why)
    configure_inference(target, layer_loop=layer_loop)
    named = None if opts.model is None else known_model(opts.model)
    name = opts.served_model_name or (DEFAULT_MODEL_NAME if is_default_model(opts.model) else named.name if named
                                      else model_path.stem if model_path.is_file() else model_path.name)
    llm = LoadedModel(target=target, tokenizer=tokenizer, eos_ids=eos_token_ids(tokenizer, model_path),
                      drafter=None, method="none", model_path=model_path, model_name=name, drafter_path=head_spec,
                      options=dict(dtype=opts.dtype, attention=attention, kv_cache_dtype=opts.kv_cache_dtype,
                                   layer_loop=layer_loop,
                                   matmul=matmul_path, draft_weights=opts.draft_weights,
                                   target_weights="file" if file_weights and matmul_path == "cpu_kernel" else "bf16"),
                      draft_weights_request=opts.draft_weights, settings=opts)
    return llm.place_on(device_mesh)


def _file_weights_blocker(opts: Options, model_path, device_mesh) -> str | None:
    """Why the target cannot keep a GGUF file's own blocks (`Options.target_weights`; None: it can)."""
    import jax

    from peagle_jax import kernels

    if model_path.suffix != ".gguf":
        return "the model is not a GGUF file"
    if opts.dtype != "bfloat16" or opts.matmul == "xla" or device_mesh is not None or opts.experimental.fp8_weights:
        return "it runs on the CPU matmul kernel: dtype bfloat16, one device, matmul auto or cpu_kernel, no FP8"
    if jax.default_backend() != "cpu":
        return f"the backend is {jax.default_backend()}, not cpu"
    return kernels.cpu.unavailable_reason()


def _attach_head(llm: LoadedModel, opts: Options, head_spec: str) -> None:
    """The draft head, with its cutoff / second root, wrapped with prompt lookup for X+ngram."""
    method, x = opts.method, opts.experimental
    llm.drafter = llm.load_head(head_spec)
    if method.startswith("peagle") and not llm.drafter.can_draft_parallel:
        raise ValueError(f"method {method!r} needs a parallel-drafting head; {head_spec} drafts sequentially")
    if method in ("auto", *HEAD_METHODS):
        llm.drafter.second_root = _exact_two_chains(x.second_root, llm.options["attention"], "second_root")
        llm.options["second_root"] = llm.drafter.second_root
        cutoff = opts.draft_cutoff
        if cutoff is None:
            from peagle_jax.generate import default_draft_cutoff

            cutoff = 0.0 if llm.drafter.second_root else default_draft_cutoff()
        llm.drafter.draft_cutoff = float(cutoff)
        llm.options["draft_cutoff"] = llm.drafter.draft_cutoff
    if method in HYBRID_METHODS:
        from peagle_jax.drafters.hybrid import HybridProposer
        from peagle_jax.drafters.ngram import NgramProposer

        two_chains = _exact_two_chains(x.two_chains, llm.options["attention"], "two_chains")
        llm.options["two_chains"] = two_chains
        llm.drafter = HybridProposer(llm.drafter, NgramProposer(opts.prompt_lookup_min, opts.prompt_lookup_max),
                                     opts.head_draft_tokens, two_chains=two_chains)
