"""speculative_generate on a tiny random target: exactness, statistics, compilation."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from conftest import slow_except
from flax import nnx

from peagle_jax.drafters import DrafterConfig, create_drafter
from peagle_jax.drafters.drafting import Proposal
from peagle_jax.drafters.hybrid import HybridProposer
from peagle_jax.drafters.ngram import NgramProposer
from peagle_jax.drafters.reference import ReferenceDrafter
from peagle_jax.generate import speculative_generate
from peagle_jax.generate.speculative import _generate_jit
from peagle_jax.models import ModelConfig, create_model

VOCAB = 64
EOS = 0
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [5]]


@pytest.fixture(scope="module")
def target():
    cfg = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return create_model(cfg, seed=1)


@pytest.fixture(scope="module")
def drafter(target):
    cfg = DrafterConfig.for_target(target.config, num_layers=2, parallel_drafting=True, mask_token_id=VOCAB - 1)
    return create_drafter(cfg, seed=2)


@pytest.fixture(scope="module")
def reference(target):
    # Plain greedy decoding; long enough that an oracle can propose K tokens past the budget.
    return speculative_generate(target, None, PROMPTS, method="none", max_new_tokens=40, eos_token_ids=[EOS])


def _table(tokens: list[list[int]]) -> np.ndarray:
    n = max(len(t) for t in tokens)
    return np.array([t + [EOS] * (n - len(t)) for t in tokens])


@pytest.mark.parametrize("method, k", slow_except(itertools.product(["peagle", "eagle3"], [1, 3, 7]),
                                                  fast={("peagle", 7), ("eagle3", 3)}))
def test_greedy_exact_with_random_drafter(target, drafter, reference, method, k):
    out = speculative_generate(target, drafter, PROMPTS, method=method, num_draft_tokens=k,
                               max_new_tokens=24, eos_token_ids=[EOS])
    assert out.tokens == [t[:24] for t in reference.tokens]
    assert out.accepted_per_position.shape == (k,)


@pytest.mark.slow  # an experimental option (docs/usage.md)
@pytest.mark.parametrize("method", ["peagle", "eagle3"])
@pytest.mark.parametrize("k", [1, 3])
def test_second_root_keeps_greedy_exact_and_sampling_runs_one_chain(target, drafter, reference, method, k):
    """The head's runner-up for the first draft, verified as a second chain in the same
    forward (greedy), keeps plain decoding's tokens; sampled rounds propose no second chain."""
    head = nnx.clone(drafter)
    head.second_root = True
    out = speculative_generate(target, head, PROMPTS, method=method, num_draft_tokens=k,
                               max_new_tokens=24, eos_token_ids=[EOS])
    assert out.tokens == [t[:24] for t in reference.tokens]
    sampled = speculative_generate(target, head, PROMPTS, method=method, num_draft_tokens=k, max_new_tokens=8,
                                   temperature=0.8, seed=3)
    assert all(len(t) == 8 for t in sampled.tokens)


def test_second_choice_is_the_runner_up_never_the_first_draft(drafter):
    from peagle_jax.drafters.drafting import second_choice

    v = drafter.config.draft_vocab_size
    logits = jnp.full((3, v), -1.0).at[0, 1].set(5.0).at[0, 2].set(5.0)  # a tie: the lower id drafts first
    logits = logits.at[1, 0].set(3.0).at[1, 5].set(2.0).at[2, 7].set(1.0)  # row 2: every other id ties
    branch = second_choice(drafter, logits)
    want = drafter.to_target_ids(jnp.asarray([2, 5, 0]))
    assert branch.tokens.shape == (3, 1) and np.array_equal(branch.tokens[:, 0], want)
    assert np.array_equal(branch.num_drafts, [1, 1, 1])


@pytest.mark.parametrize("method, k", slow_except(itertools.product(["peagle", "eagle3"], [1, 3]),
                                                  fast={("peagle", 1)}))
def test_draft_cutoff_keeps_greedy_exact_and_verifies_only_confident_drafts(target, drafter, reference, method, k):
    """A head with a confidence cutoff gives plain decoding's tokens whatever it verifies: at a
    cutoff no draft clears, every round is a plain step (one token, nothing accepted); at 0,
    rounds are exactly those of the head without a cutoff; sampled rounds run too."""
    budget = 24
    never, always = nnx.clone(drafter), nnx.clone(drafter)
    never.draft_cutoff, always.draft_cutoff = 0.999, 0.0  # random heads spread over the vocabulary
    kw = dict(method=method, num_draft_tokens=k, max_new_tokens=budget, eos_token_ids=[EOS])
    plain_rounds = speculative_generate(target, never, PROMPTS, **kw)
    assert plain_rounds.tokens == [t[:budget] for t in reference.tokens]
    assert plain_rounds.accepted_per_position.sum() == 0
    assert list(plain_rounds.rounds) == [len(t) - 1 for t in plain_rounds.tokens]
    full = speculative_generate(target, always, PROMPTS, **kw)
    plain_head = speculative_generate(target, drafter, PROMPTS, **kw)
    assert full.tokens == plain_head.tokens and np.array_equal(full.rounds, plain_head.rounds)
    sampled = speculative_generate(target, never, PROMPTS, method=method, num_draft_tokens=k, max_new_tokens=8,
                                   temperature=0.8, seed=3)
    assert all(len(t) == 8 for t in sampled.tokens)


def test_confident_drafts_is_the_prefix_whose_probability_product_clears_the_cutoff():
    from peagle_jax.drafters.drafting import confident_drafts

    conf = jnp.asarray([[0.9, 0.5, 0.9], [0.05, 0.99, 0.99], [0.6, 0.9, 0.9], [1.0, 1.0, 1.0]])
    # products: [.9 .45 .405], [.05 .0495 .049], [.6 .54 .486], [1 1 1]
    assert np.array_equal(confident_drafts(conf, 0.42), [2, 0, 3, 3])
    assert np.array_equal(confident_drafts(conf, 0.5), [1, 0, 2, 3])
    assert np.array_equal(confident_drafts(conf, 0.0), [3, 3, 3, 3])


def test_draft_cutoff_and_second_root_are_refused_together(target, drafter):
    both = nnx.clone(drafter)
    both.second_root, both.draft_cutoff = True, 0.1
    with pytest.raises(ValueError, match="second_root and draft_cutoff do not combine"):
        speculative_generate(target, both, PROMPTS, method="peagle", num_draft_tokens=2, max_new_tokens=4)


def test_k_left_out_is_the_backends_measured_default(target, drafter, reference):
    from peagle_jax import kernels
    from peagle_jax.generate import default_draft_cutoff, default_num_draft_tokens

    # CPU (this suite runs on CPU): K=2 where the kernels run AMX tiles, whose verify rows cost
    # a tenth of a decode step, else 1 (docs/usage.md, the K left out)
    k = 2 if kernels.cpu.instruction_set() == "amx" else 1
    assert default_num_draft_tokens() == k
    assert default_draft_cutoff() == 0.1  # CPU: docs/notes/2026-12-05-session-27.md
    out = speculative_generate(target, drafter, PROMPTS, max_new_tokens=24, eos_token_ids=[EOS])
    assert out.num_draft_tokens == k and out.accepted_per_position.shape == (k,)
    assert out.tokens == [t[:24] for t in reference.tokens]
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 1"):
        speculative_generate(target, drafter, PROMPTS, num_draft_tokens=0, max_new_tokens=4)


@pytest.mark.parametrize("k", slow_except([1, 3, 7], fast={3}))
def test_oracle_reaches_k_plus_one_and_partial_oracle_is_exact(target, reference, k):
    budget = 24
    oracle = ReferenceDrafter(_table(reference.tokens), VOCAB)
    out = speculative_generate(target, oracle, PROMPTS, method="peagle", num_draft_tokens=k,
                               max_new_tokens=budget, eos_token_ids=[EOS])
    assert out.tokens == [t[:budget] for t in reference.tokens]
    assert out.mean_acceptance_length == pytest.approx(k + 1)
    # Each round emits K+1 tokens; the first token comes from prefill.
    assert all(r == -(-(budget - 1) // (k + 1)) for r in out.rounds)

    partial = ReferenceDrafter(_table(reference.tokens), VOCAB, wrong_every=3)
    out = speculative_generate(target, partial, PROMPTS, method="eagle3", num_draft_tokens=k,
                               max_new_tokens=budget, eos_token_ids=[EOS])
    assert out.tokens == [t[:budget] for t in reference.tokens]
    if k > 1:
        assert 1.0 < out.mean_acceptance_length < k + 1


def test_acceptance_statistics_hand_computed(target, reference):
    """Oracle wrong exactly where (p*7+3) % 4 == 0, i.e. output positions p = 3, 7, 11, ..."""
    k, budget = 3, 12
    table = _table(reference.tokens)[:1]
    out = speculative_generate(target, ReferenceDrafter(table, VOCAB, wrong_every=4), [PROMPTS[0]],
                               method="peagle", num_draft_tokens=k, max_new_tokens=budget, eos_token_ids=[EOS])
    assert out.tokens[0] == reference.tokens[0][:budget]
    # out_len after prefill = 1. Round 1 drafts p=1,2,3: p=3 wrong -> accept 2, emit 3 (len 4).
    # Round 2 drafts p=4,5,6: all right -> emit 4 (len 8). Round 3 drafts p=8,9,10: right ->
    # emit 4 (len 12, budget reached).
    assert out.rounds.tolist() == [3]
    assert out.accepted_per_position.tolist() == [3, 3, 2]
    assert out.mean_acceptance_length == pytest.approx((3 + 8) / 3)


def test_eos_and_per_sequence_stop(target, reference):
    # Make token reference[1][3] an EOS id: sequence 1 must stop there, the others go on.
    eos = reference.tokens[1][3]
    plain = speculative_generate(target, None, PROMPTS, method="none", max_new_tokens=16, eos_token_ids=[eos])
    spec = speculative_generate(target, ReferenceDrafter(_table(reference.tokens), VOCAB), PROMPTS,
                                method="peagle", num_draft_tokens=3, max_new_tokens=16, eos_token_ids=[eos])
    assert spec.tokens == plain.tokens
    assert spec.finish_reasons == plain.finish_reasons
    assert spec.finish_reasons[1] == "stop" and spec.tokens[1][-1] == eos and len(spec.tokens[1]) <= 4


def test_no_recompile_for_new_prompts_of_same_bucket(target, drafter):
    kw = dict(method="peagle", num_draft_tokens=3, max_new_tokens=8, eos_token_ids=[EOS])
    speculative_generate(target, drafter, [[1, 2, 3], [4, 5]], **kw)
    before = _generate_jit._cache_size()
    speculative_generate(target, drafter, [[9, 8, 7, 6, 5], [3]], seed=5, **kw)
    speculative_generate(target, drafter, [[11, 12], [13, 14, 15, 16]], temperature=0.0, **kw)
    assert _generate_jit._cache_size() == before


def test_budgets_of_one_bucket_share_a_program_and_stop_at_their_own_length(target, reference):
    # 17..24 new tokens share the budget bucket 24: one program, and each call stops at its own
    # budget with plain greedy decoding's tokens
    kw = dict(method="none", eos_token_ids=[EOS])
    speculative_generate(target, None, PROMPTS, max_new_tokens=24, **kw)
    before = _generate_jit._cache_size()
    for n in (17, 20, 23):
        out = speculative_generate(target, None, PROMPTS, max_new_tokens=n, **kw)
        assert out.tokens == [r[:n] for r in reference.tokens]
        assert all(len(t) == n or reason == "stop" for t, reason in zip(out.tokens, out.finish_reasons, strict=True))
    assert _generate_jit._cache_size() == before


def test_prompt_buckets_step_by_half_powers_of_two():
    from peagle_jax.generate import prompt_bucket

    assert [prompt_bucket(n) for n in (1, 16, 17, 24, 25, 33, 180, 193, 257)] == [16, 16, 24, 24, 32, 48, 192, 256, 384]
    assert prompt_bucket(5, 1) == 6 and prompt_bucket(7, 3) == 9
    for n in range(1, 2000):  # smallest bucket that holds n, padding under a third of it past the minimum
        b = prompt_bucket(n)
        assert b >= n and (n <= 16 or 3 * (b - n) < b)
    with pytest.raises(ValueError, match="positive"):
        prompt_bucket(0)


def test_bad_arguments(target, drafter):
    # TypeError: SpecConfig's Literal annotation, when the tests' type checks are on (conftest.py)
    with pytest.raises((ValueError, TypeError), match="method"):
        speculative_generate(target, drafter, PROMPTS, method="medusa")
    with pytest.raises(ValueError, match="drafter"):
        speculative_generate(target, None, PROMPTS, method="peagle")
    with pytest.raises(ValueError, match="non-empty"):
        speculative_generate(target, drafter, [[]], method="peagle")
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(target, drafter, PROMPTS, max_new_tokens=0)
    seq = create_drafter(DrafterConfig.for_target(target.config), seed=0)
    with pytest.raises(ValueError, match="parallel drafting"):
        speculative_generate(target, seq, PROMPTS, method="peagle")


# ------------------------------------------------------------------ sampling exactness

SMALL_V = 8


@pytest.fixture(scope="module")
def small_target():
    cfg = ModelConfig(architecture="llama", vocab_size=SMALL_V, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = create_model(cfg, seed=3)
    # Random init gives near-uniform logits; sharpen them so top-p actually cuts tokens.
    model.embed_tokens.value = model.embed_tokens.value * 40.0
    return model


def _exact_joint(target, prompt, temperature, top_p):
    """p(t1, t2) of the processed target distribution, computed by enumeration."""
    from peagle_jax.sampling import process_logits

    def probs_after(tokens):
        t = jnp.asarray([tokens])
        pos = jnp.arange(len(tokens))[None]
        out = target(t, pos, target.init_cache(1, 16))
        one = jnp.ones((1,))
        p = process_logits(out.logits[:, -1:], one * temperature, jnp.zeros((1,), jnp.int32), one * top_p)
        return np.asarray(p[0, 0], np.float64)

    p1 = probs_after(prompt)
    return np.stack([p1[a] * probs_after(prompt + [a]) for a in range(SMALL_V)])


@pytest.mark.parametrize("method", slow_except(
    ["peagle", "eagle3", "ngram", "peagle+ngram", "peagle+ngram/2c", "peagle/cut"], fast={"peagle"}))
def test_sampling_matches_target_distribution(small_target, method):
    # peagle+ngram/2c: the hybrid built to verify both chains in greedy rounds; sampled rounds
    # take one chain per round (drafters.hybrid), which must stay exact. peagle/cut: a head
    # with a confidence cutoff, so sequences in one verify may accept different numbers of drafts.
    prompt, n = [1, 2, 3], 20000
    if method != "ngram":
        cfg = DrafterConfig.for_target(small_target.config, num_layers=1, parallel_drafting=True,
                                       mask_token_id=SMALL_V - 1)
        drafter = create_drafter(cfg, seed=4)
        drafter.lm_head.value = drafter.lm_head.value * 30.0  # a confident (and often wrong) drafter
        if method == "peagle/cut":
            drafter.draft_cutoff = 0.3  # cuts most chains here, not all
    if "ngram" in method:
        # A repetitive prompt and 2-grams: the context drafter proposes in some rounds (and the
        # hybrid's head in the others).
        prompt, lookup = [1, 2, 3, 1, 2, 3, 1, 2], NgramProposer(2, 3)
        drafter = lookup if method == "ngram" else HybridProposer(drafter, lookup, two_chains=method.endswith("/2c"))
    exact = _exact_joint(small_target, prompt, 0.8, 0.9)
    out = speculative_generate(small_target, drafter, [prompt] * n, method=method.split("/")[0],
                               num_draft_tokens=3,
                               max_new_tokens=2, temperature=0.8, top_p=0.9, seed=11)
    p = _chi_square_p(np.array([t[:2] for t in out.tokens]), exact)
    assert p > 0.01, p
    # Drafts were really used: some rounds accepted a draft, some rejected one. (Prompt lookup
    # drafts only where the sampled first token continues a seen 2-gram, so its rate is low.)
    rate = out.acceptance_rate_per_position[0]
    assert 0.005 < rate < 0.98, rate


def _exact_joint3(target, prompt, temperature, top_p):
    """p(t1, t2, t3) of the processed target distribution, by enumeration: ONE batched forward
    over every prompt + [a, b] gives the distributions after prompt, prompt + [a] and
    prompt + [a, b] at its last three positions (few programs, no per-prefix compiles)."""
    from peagle_jax.sampling import process_logits

    n = len(prompt)
    seqs = jnp.asarray([prompt + [a, b] for a in range(SMALL_V) for b in range(SMALL_V)])
    pos = jnp.broadcast_to(jnp.arange(n + 2)[None], seqs.shape)
    out = target(seqs, pos, target.init_cache(seqs.shape[0], 16))
    ones = jnp.ones((seqs.shape[0],))
    p = process_logits(out.logits[:, n - 1:n + 2], ones * temperature, jnp.zeros_like(ones, jnp.int32), ones * top_p)
    p = np.asarray(p, np.float64).reshape(SMALL_V, SMALL_V, 3, SMALL_V)
    first = p[0, 0, 0]  # after the prompt: the same in every row
    second = p[:, 0, 1]  # [a, t2]: after prompt + [a]
    third = p[:, :, 2]  # [a, b, t3]
    return first[:, None, None] * second[:, :, None] * third


def _chi_square_p(samples: np.ndarray, exact: np.ndarray) -> float:
    """Chi-square p-value of sampled token tuples [n, d] against their exact joint [V]*d."""
    counts = np.zeros(exact.shape)
    np.add.at(counts, tuple(samples.T), 1)
    expected = exact * len(samples)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token the processed target gives zero probability"
    # Pool cells with small expected counts so the chi-square approximation holds.
    small = keep & (expected < 5)
    obs = np.append(counts[keep & ~small], counts[small].sum())
    exp = np.append(expected[keep & ~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return scipy.stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.slow
def test_sampling_stays_exact_with_a_capped_head_in_a_mixed_batch(small_target):
    # The hybrid's head drafts 1 where the lookup drafts K=3, in one batch: rows without a
    # match are verified in a 4-row forward but may accept only their one draft. Both halves
    # must follow the target's distribution exactly.
    cfg = DrafterConfig.for_target(small_target.config, num_layers=1, parallel_drafting=True,
                                   mask_token_id=SMALL_V - 1)
    drafter = create_drafter(cfg, seed=4)
    drafter.lm_head.value = drafter.lm_head.value * 30.0
    hybrid = HybridProposer(drafter, NgramProposer(2, 3), head_draft_tokens=1)
    # Three tokens: the second and third come from the first round, so a capped row's third
    # token is its bonus draw after one accepted draft, never a second draft.
    repeat, plain, n = [1, 2, 3, 1, 2, 3, 1, 2], [1, 2, 3], 10000
    out = speculative_generate(small_target, hybrid, [repeat] * n + [plain] * n, method="peagle+ngram",
                               num_draft_tokens=3, max_new_tokens=3, temperature=0.8, top_p=0.9, seed=12)
    triples = np.array([t[:3] for t in out.tokens])
    for half, prompt in ((triples[:n], repeat), (triples[n:], plain)):
        p = _chi_square_p(half, _exact_joint3(small_target, prompt, 0.8, 0.9))
        assert p > 0.01, (prompt, p)
    # In their first round the plain rows have no lookup match: they never accept past their
    # one draft (a second round may find a match in the tokens sampled so far).
    first = out.accepted_per_sequence[n:][out.rounds[n:] == 1]
    assert len(first) > n // 10 and first[:, 1:].sum() == 0
    assert 0.02 < out.accepted_per_sequence[n:, 0].mean() < 0.98


def test_spec_config_is_the_one_static_setting():
    from peagle_jax.generate.steps import SpecConfig

    a, b = SpecConfig("peagle", 3, True, 128, 32), SpecConfig("peagle", 3, True, 128, 32)
    assert a == b and hash(a) == hash(b)  # equal settings reuse one compiled program
    # TypeError: the Literal annotation, when the tests' type checks are on (conftest.py)
    with pytest.raises((ValueError, TypeError), match="method must be one of|Literal"):
        SpecConfig("medusa", 3, True, 128, 32)
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 1"):
        SpecConfig("eagle3", 0, True, 128, 32)
    with pytest.raises(ValueError, match="drafts nothing"):
        SpecConfig("none", 2, True, 128, 32)
    with pytest.raises(ValueError, match="needs a drafter"):
        a.check_drafter(None)


class _ConstantProposer(nnx.Module):
    """A drafter written only against the Proposer interface: always proposes token 3."""

    can_draft_parallel = True
    uses_features = True

    def project(self, aux):
        return aux[..., :2]

    def init_cache(self, batch_size, capacity):
        return None

    def prefill(self, cache, tokens, feats, positions):
        return cache

    def propose(self, cache, pending, settings):
        b = pending.tokens.shape[0]
        return Proposal(jnp.full((b, settings.num_draft_tokens), 3, jnp.int32), None, cache)


def test_any_proposer_plugs_into_the_round(target, reference):
    # No isinstance in the steps: a new kind of drafter needs only the Proposer methods, and
    # greedy output stays exactly plain decoding's.
    out = speculative_generate(target, _ConstantProposer(), PROMPTS, method="peagle", num_draft_tokens=3,
                               max_new_tokens=24, eos_token_ids=[EOS])
    assert out.tokens == [t[:24] for t in reference.tokens]
