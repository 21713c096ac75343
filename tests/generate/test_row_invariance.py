"""bf16 exactness on the real default model: a row's logits do not depend on how many rows
share its forward, so greedy speculative decoding emits exactly plain decoding's tokens.

XLA:CPU picks kernels by row count: a one-row dot (plain decoding), a K+1-row dot (verify)
and a dot fused with its neighbours round differently unless `models.layers.matmul`, the
cache attention's one batched product per (sequence, kv head) over a heads-major cache and
`generate.steps.STEP_COMPILER_OPTIONS` keep every row on the same path. The CPU kernels
(`kernels_cpu`'s matmul and attention, the default on CPU in bf16) are row-invariant by
construction. Every test runs
on both matmul paths (the speculative one at every K on the default path) and fails on a
batch-variant one.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks.common import encode_prompt
from peagle_jax.generate import speculative_generate
from peagle_jax.generate.steps import step_jit

pytestmark = pytest.mark.slow

MESSAGES = [
    "Write a Python function that checks whether a number is prime.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
]
BUDGET = 48


@pytest.fixture(scope="module", params=["xla", "cpu_kernel"])
def smollm2_bf16(request):
    import kernels_cpu
    from peagle_jax.checkpoints import load_target
    from peagle_jax.checkpoints.default_model import default_model_path
    from peagle_jax.checkpoints.tokenizer import eos_token_ids, load_tokenizer
    from peagle_jax.models.options import choose_matmul, configure_inference

    if request.param == "cpu_kernel" and not kernels_cpu.available():
        pytest.skip(f"kernels_cpu unavailable: {kernels_cpu.unavailable_reason()}")
    path = default_model_path()
    target = load_target(path, dtype="bfloat16")
    choose_matmul(target, request.param)
    if request.param == "cpu_kernel":  # as `load` sets it up: the attention on the kernel too
        configure_inference(target, attention="cpu")
    tok = load_tokenizer(path)
    prompts = [encode_prompt(tok, {"kind": "chat", "text": m}) for m in MESSAGES]
    return target, prompts, eos_token_ids(tok, path)


def test_step_rows_are_bitwise_row_count_invariant(smollm2_bf16):
    """Logits of row 0 after a prompt: the same bits whether the forward has 1 or up to 16 rows."""
    target, prompts, _ = smollm2_bf16
    gdef, state = nnx.split(target)

    @step_jit
    def forward(state, tokens, positions, cache):
        out = nnx.merge(gdef, state)(tokens, positions, cache)
        return out.logits, out.cache

    prompt = prompts[0]
    cache = target.init_cache(1, 256)
    _, cache = forward(state, jnp.asarray([prompt]), jnp.arange(len(prompt))[None], cache)
    cache = cache.with_lengths(jnp.asarray([len(prompt)]))
    rng = np.random.default_rng(0)
    for token in rng.integers(0, target.config.vocab_size, 4):
        rows = {}
        for r in (1, 2, 3, 4, 7, 8, 12, 16):
            tokens = np.full((1, r), 17, np.int32)
            tokens[0, 0] = token
            logits, _ = forward(state, jnp.asarray(tokens), jnp.asarray(len(prompt) + np.arange(r))[None], cache)
            rows[r] = np.asarray(logits[0, 0])
        for r, row in rows.items():
            assert np.array_equal(row, rows[1]), f"row 0 of a {r}-row forward differs from a 1-row forward"


# Every K on the default path (the CPU kernel); K=3 on the XLA fallback (each case compiles
# the 30-layer model again: minutes of CI).
CASES = [(path, method, k) for path in ("xla", "cpu_kernel") for method in ("peagle", "eagle3", "peagle+ngram/2c")
         for k in ((1, 3, 7) if path == "cpu_kernel" else (3,))]


@pytest.mark.parametrize(("smollm2_bf16", "method", "k"), CASES, indirect=["smollm2_bf16"])
def test_greedy_speculative_matches_plain_in_bf16(smollm2_bf16, method, k):
    """peagle+ngram/2c: the head's chain and prompt lookup's verified in one forward, the
    second chain's rows written 16 rows on (generate.tree)."""
    from peagle_jax.checkpoints.default_model import default_drafter_path
    from peagle_jax.checkpoints.drafter_io import load_drafter
    from peagle_jax.drafters.hybrid import HybridProposer
    from peagle_jax.drafters.ngram import NgramProposer
    from peagle_jax.models.options import choose_matmul, configure_inference

    target, prompts, eos = smollm2_bf16
    head = default_drafter_path(method.split("+")[0])
    if head is None:
        pytest.skip(f"no shipped {method} head")
    drafter = load_drafter(head, target=target, dtype="bfloat16")
    if target.lm_head_packed is not None:  # the cpu_kernel run: the head on the kernels too
        choose_matmul(drafter, "cpu_kernel")
        configure_inference(drafter, attention="cpu")
    if method.endswith("/2c"):
        drafter = HybridProposer(drafter, NgramProposer(2, 4), head_draft_tokens=1, two_chains=True)
        method = method.removesuffix("/2c")
    accept = []
    for prompt in prompts:  # batch 1: the rows of one sequence
        plain = speculative_generate(target, None, [prompt], method="none", max_new_tokens=BUDGET, eos_token_ids=eos)
        spec = speculative_generate(target, drafter, [prompt], method=method, num_draft_tokens=k,
                                    max_new_tokens=BUDGET, eos_token_ids=eos)
        assert spec.tokens == plain.tokens
        accept.append(spec.mean_acceptance_length)
    assert max(accept) > 1.0, accept  # the shipped head drafts something right


@pytest.mark.parametrize(("method", "k"), [("peagle", 2), ("eagle3", 1)])
def test_second_root_is_exact_and_wins_rounds(method, k):
    """The shipped head's runner-up for the first draft, verified as a second chain in the
    same forward (`drafting.second_choice`), keeps plain decoding's bf16 tokens, and takes
    fewer rounds for them: the second chain wins where the first draft is rejected."""
    from peagle_jax.api import load
    from peagle_jax.generate import tree

    llm = load(None, method=method, second_root=True)
    if not llm.drafter.second_root:
        pytest.skip("two-chain verify is not exact with this host's attention (load turned it off)")
    assert tree.two_chains_exact_here(llm.options["attention"] or "xla")
    one_root = nnx.clone(llm.drafter)
    one_root.second_root = False
    prompts = [encode_prompt(llm.tokenizer, {"kind": "chat", "text": m}) for m in MESSAGES]
    plain = speculative_generate(llm.target, None, prompts, method="none", max_new_tokens=BUDGET,
                                 eos_token_ids=llm.eos_ids)
    rounds = {}
    for name, head in (("one", one_root), ("two", llm.drafter)):
        out = speculative_generate(llm.target, head, prompts, method=method, num_draft_tokens=k,
                                   max_new_tokens=BUDGET, eos_token_ids=llm.eos_ids)
        assert out.tokens == plain.tokens, name
        rounds[name] = out.total_rounds
    assert rounds["two"] < rounds["one"], rounds


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_draft_cutoff_is_exact_alone_and_in_a_batch(method):
    """The shipped head with the default cutoff (`load`: 0.1 on CPU) and K=3 keeps plain
    decoding's bf16 tokens at batch 1, where a round verifies 1 to 4 rows, and in a batch,
    where it verifies as many as the most confident sequence needs and each sequence accepts
    at most its own confident drafts."""
    from peagle_jax.api import load

    llm = load(None, method=method)
    assert llm.drafter.draft_cutoff > 0
    prompts = [encode_prompt(llm.tokenizer, {"kind": "chat", "text": m}) for m in MESSAGES]
    plain = speculative_generate(llm.target, None, prompts, method="none", max_new_tokens=BUDGET,
                                 eos_token_ids=llm.eos_ids)
    accepted = 0
    for prompt, want in zip(prompts, plain.tokens, strict=True):
        out = llm.generate([prompt], num_draft_tokens=3, max_new_tokens=BUDGET)
        assert out.tokens == [want]
        accepted += out.accepted_per_position.sum()
    assert accepted > 0  # the head's confident drafts were verified and taken
    batch = llm.generate(prompts, num_draft_tokens=3, max_new_tokens=BUDGET)
    assert batch.tokens == plain.tokens
