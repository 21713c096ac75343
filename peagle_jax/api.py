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

log = logging.getLogger("peagle_jax")

#: Methods `load` accepts: the generation methods plus "auto" (from the head: parallel
#: drafting -> "peagle", else "eagle3"; no head -> "none"). "ngram" drafts from the context
#: (prompt lookup) and takes no head; "peagle+ngram" / "eagle3+ngram" pair the head with it.
LOAD_METHODS = ("auto", "none", "eagle3", "peagle", "ngram", "eagle3+ngram", "peagle+ngram")
HYBRID_METHODS = ("eagle3+ngram", "peagle+ngram")
#: Methods whose head may also propose its second choice for the first draft (`second_root`).
SECOND_ROOT_METHODS = ("eagle3", "peagle")


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
    if not is_default_model(model):
        return None
    from peagle_jax.checkpoints.default_model import default_drafter_path

    shipped = default_drafter_path("eagle3" if method.startswith("eagle3") else "peagle")
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
            QUANTIZED_DRAFT_WEIGHTS,
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


def load(
    model: str | None = None,
    *,
    drafter: str | None = "auto",
    method: str = "auto",
    dtype: str = "bfloat16",
    mesh: str | Mapping[str, int] | None = None,
    attention: str | None = None,
    kv_cache_dtype: str | None = None,
    fp8_weights: bool = False,
    matmul: str = "auto",
    served_model_name: str | None = None,
    prompt_lookup_min: int = 2,
    prompt_lookup_max: int = 4,
    head_draft_tokens: int | None = None,
    two_chains: bool = False,
    second_root: bool = False,
    draft_cutoff: float | None = None,
    draft_weights: str = "auto",
) -> LoadedModel:
    """Load and configure a target model and its draft head.

    model: a .gguf file, an HF model directory, or None / "default" / "smollm2-135m-instruct"
      for the built-in SmolLM2-135M-Instruct.
    drafter: a head directory (AWS/EAGLE-3 or speculators layout), None / "none", or "auto":
      the shipped head of the default model that matches `method` (none for other models).
    method: "auto" | "none" | "eagle3" | "peagle" | "ngram" | "eagle3+ngram" | "peagle+ngram" (LOAD_METHODS).
    dtype: weights and activations (norms, softmax and logits stay float32).
    mesh: e.g. "model=4" or "data=2,model=4" (None: one device). A multi-host job is joined
      first when the launcher's variables say so (`sharding.maybe_initialize_distributed`).
    attention / kv_cache_dtype / fp8_weights: see `models.options`. attention None: "cpu" (the
      `kernels_cpu` attention) where the matmuls take the CPU kernel, else the XLA reference.
    matmul: "auto" | "xla" | "cpu_kernel" (MATMULS). "auto" sends the decode-sized matmuls of a
      bf16, unsharded, non-FP8 model on CPU (target and head) through the row-invariant AVX2
      kernel `kernels_cpu` (built on first use), else XLA's; `options["matmul"]` says which ran.
    prompt_lookup_min / prompt_lookup_max: the n-gram sizes the "ngram" methods match (vLLM's names).
    head_draft_tokens: in an "X+ngram" method, the drafts the head proposes where the lookup has
      no match (None: K, as many as a match); fewer verify rows when the head is right mostly
      on its first drafts (`drafters.hybrid`).
    two_chains: in an "X+ngram" method, verify the head's and the lookup's drafts together in
      one target forward where the lookup matches (greedy rounds; `generate.tree`).
    second_root: in a head method ("eagle3", "peagle"), also verify the head's second choice for
      the first draft, in the same target forward (greedy rounds; `drafters.drafting.second_choice`).
    draft_cutoff: in a head method, verify only the leading drafts whose product of the head's
      probabilities is >= this, in [0, 1) (`drafters.drafting.confident_drafts`; 0: all K). None:
      `generate.default_draft_cutoff()` (0.1 on CPU, 0 elsewhere), or 0 where second_root is on,
      whose second chain is verified at the full width.
    draft_weights: "auto" | "native" | "q7" | "q4" (`models.options.DRAFT_WEIGHTS`): the head's
      matmul weights. "q7" streams 7-bit weights, one byte each, through the CPU kernel: half the
      bytes of bf16 in a memory-bound draft pass; "q4" the Linears in 4 bits and the lm_head in 7.
      Drafts are verified, so greedy output stays exactly plain decoding's. "auto": "q4" on CPUs
      where it is faster (AVX512-BF16), else "native".
      `options["draft_weights"]` says which ran.

    Raises FileNotFoundError / ValueError with a message naming the bad setting.
    """
    from peagle_jax.checkpoints import load_target
    from peagle_jax.checkpoints.default_model import DEFAULT_MODEL_NAME, resolve_model_path
    from peagle_jax.checkpoints.tokenizer import eos_token_ids, load_tokenizer
    from peagle_jax.models.options import (
        DRAFT_WEIGHTS,
        MATMULS,
        QUANTIZED_DRAFT_WEIGHTS,
        choose_matmul,
        configure_inference,
        quantize_weights_fp8,
    )
    from peagle_jax.sharding import make_mesh, maybe_initialize_distributed

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if matmul not in MATMULS:
        raise ValueError(f"matmul must be one of {MATMULS}, got {matmul!r}")
    if matmul == "cpu_kernel" and mesh is not None:
        raise ValueError("matmul='cpu_kernel' serves one unsharded CPU device; drop mesh or use matmul='auto'")
    head_spec = resolve_drafter(model, drafter, method)
    if draft_weights not in DRAFT_WEIGHTS:
        raise ValueError(f"draft_weights must be one of {DRAFT_WEIGHTS}, got {draft_weights!r}")
    if draft_weights in QUANTIZED_DRAFT_WEIGHTS and head_spec is None:
        raise ValueError(f"draft_weights={draft_weights!r} quantizes a draft head, and method {method!r} loads none")
    if draft_weights in QUANTIZED_DRAFT_WEIGHTS and (dtype != "bfloat16" or matmul == "xla" or mesh is not None):
        raise ValueError(f"draft_weights={draft_weights!r} runs on the CPU matmul kernel: it needs dtype bfloat16, "
                         "one device "
                         f"(no mesh) and matmul 'auto' or 'cpu_kernel'; got dtype {dtype!r}, matmul {matmul!r}, "
                         f"mesh {mesh!r}")
    if "ngram" in method and not 1 <= prompt_lookup_min <= prompt_lookup_max:
        raise ValueError("prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                         f"{prompt_lookup_min} and {prompt_lookup_max}")
    if head_draft_tokens is not None and (method not in HYBRID_METHODS or head_draft_tokens < 1):
        raise ValueError(f"head_draft_tokens ({head_draft_tokens}) needs a method X+ngram "
                         f"({', '.join(HYBRID_METHODS)}) and a value >= 1; got method {method!r}")
    if two_chains and method not in HYBRID_METHODS:
        raise ValueError(f"two_chains needs a method X+ngram ({', '.join(HYBRID_METHODS)}); got method {method!r}")
    if second_root and (method not in ("auto", *SECOND_ROOT_METHODS) or head_spec is None):
        raise ValueError(f"second_root needs a draft head and a head method ({', '.join(SECOND_ROOT_METHODS)} "
                         f"or auto); got method {method!r}" + (" without a head" if head_spec is None else ""))
    if draft_cutoff is not None:
        if not 0.0 <= draft_cutoff < 1.0:
            raise ValueError(f"draft_cutoff must lie in [0, 1), got {draft_cutoff}")
        if draft_cutoff > 0 and (method not in ("auto", *SECOND_ROOT_METHODS) or head_spec is None):
            raise ValueError(f"draft_cutoff needs a draft head and a head method ({', '.join(SECOND_ROOT_METHODS)} "
                             f"or auto); got method {method!r}" + (" without a head" if head_spec is None else ""))
        if draft_cutoff > 0 and second_root:
            raise ValueError("draft_cutoff and second_root do not combine: the second chain is verified at the "
                             "full width K, so a cutoff would only drop accepted drafts; set one of them")
    if head_spec is None and method in ("eagle3", "peagle", *HYBRID_METHODS):
        raise ValueError(f"method {method!r} needs a draft head (drafter=DIR)"
                         + ("" if is_default_model(model) else "; only the default model ships one"))
    maybe_initialize_distributed()
    model_path = resolve_model_path(model)
    device_mesh = make_mesh(mesh)
    t0 = time.perf_counter()
    target = load_target(model_path, dtype=dtype)
    tokenizer = load_tokenizer(model_path)
    if fp8_weights:
        quantize_weights_fp8(target)
    configure_inference(target, attention=attention, kv_cache_dtype=kv_cache_dtype)
    matmul_path = "xla" if device_mesh is not None else choose_matmul(target, matmul)
    if attention is None and matmul_path == "cpu_kernel":
        # Where the matmuls run on the CPU kernel, attention does too: the C++ kernel is
        # row-invariant like them and costs a fraction of XLA's blockwise loop.
        attention = "cpu"
        configure_inference(target, attention=attention)
    name = served_model_name or (DEFAULT_MODEL_NAME if is_default_model(model)
                                 else model_path.stem if model_path.is_file() else model_path.name)
    llm = LoadedModel(target=target, tokenizer=tokenizer, eos_ids=eos_token_ids(tokenizer, model_path),
                      drafter=None, method="none", model_path=model_path, model_name=name, drafter_path=head_spec,
                      options=dict(dtype=dtype, attention=attention, kv_cache_dtype=kv_cache_dtype,
                                   matmul=matmul_path, draft_weights=draft_weights),
                      draft_weights_request=draft_weights)
    llm.place_on(device_mesh)
    if method == "ngram":
        from peagle_jax.drafters.ngram import NgramProposer

        llm.drafter = NgramProposer(prompt_lookup_min, prompt_lookup_max)
    if head_spec is not None:
        llm.drafter = llm.load_head(head_spec)
        if method.startswith("peagle") and not llm.drafter.can_draft_parallel:
            raise ValueError(f"method {method!r} needs a parallel-drafting head; {head_spec} drafts sequentially")
        if method in ("auto", *SECOND_ROOT_METHODS):
            llm.drafter.second_root = _exact_two_chains(second_root, attention, "second_root")
            llm.options["second_root"] = llm.drafter.second_root
            if draft_cutoff is None:
                from peagle_jax.generate import default_draft_cutoff

                draft_cutoff = 0.0 if llm.drafter.second_root else default_draft_cutoff()
            llm.drafter.draft_cutoff = float(draft_cutoff)
            llm.options["draft_cutoff"] = llm.drafter.draft_cutoff
        if method in HYBRID_METHODS:
            from peagle_jax.drafters.hybrid import HybridProposer
            from peagle_jax.drafters.ngram import NgramProposer

            two_chains = _exact_two_chains(two_chains, attention, "two_chains")
            llm.options["two_chains"] = two_chains

            llm.drafter = HybridProposer(llm.drafter, NgramProposer(prompt_lookup_min, prompt_lookup_max),
                                         head_draft_tokens, two_chains=two_chains)
    llm.method = method if method != "auto" else method_for(llm.drafter)
    log.info("loaded %s%s in %.1fs (method %s)", model_path.name, f" + {head_spec}" if head_spec else "",
             time.perf_counter() - t0, llm.method)
    return llm
