"""Prompt-lookup (n-gram) drafting: the matcher, exactness, and the plain-step fallback."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import slow_except

from peagle_jax.drafters.ngram import NgramProposer, match_ngram
from peagle_jax.generate import speculative_generate
from peagle_jax.models import ModelConfig, create_model

VOCAB = 64
EOS = 0
# Random tiny targets fall into greedy loops: the context then predicts the continuation.
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9, 7, 8, 9, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [5]]


@pytest.fixture(scope="module")
def target():
    cfg = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return create_model(cfg, seed=1)


@pytest.fixture(scope="module")
def reference(target):
    return speculative_generate(target, None, PROMPTS, method="none", max_new_tokens=40, eos_token_ids=[EOS])


def _match(rows, lengths, k, min_n, max_n):
    width = max(len(r) for r in rows)
    hist = jnp.asarray([r + [0] * (width - len(r)) for r in rows], jnp.int32)
    drafts, has = match_ngram(hist, jnp.asarray(lengths, jnp.int32), k, min_n, max_n)
    return np.asarray(drafts).tolist(), np.asarray(has).tolist()


def test_match_continues_the_latest_longest_occurrence():
    # "5 6 7" occurred at rows 0..2: propose what followed it (8), then continue periodically.
    drafts, has = _match([[5, 6, 7, 8, 5, 6, 7, 0]], [7], 4, 2, 3)
    assert has == [True] and drafts == [[8, 5, 6, 7]]
    # The latest occurrence wins over an older one: "1 2" is followed by 9 most recently.
    drafts, has = _match([[1, 2, 3, 1, 2, 9, 1, 2]], [8], 2, 2, 2)
    assert drafts == [[9, 1]]
    # The longest n wins: "4 1 2" (n=3) occurred followed by 7; "1 2" alone last by 9.
    drafts, _ = _match([[4, 1, 2, 7, 1, 2, 9, 4, 1, 2]], [10], 1, 2, 3)
    assert drafts == [[7]]


def test_no_match_reports_no_drafts():
    drafts, has = _match([[1, 2, 3, 4, 5, 6]], [6], 3, 2, 4)
    assert has == [False] and drafts == [[6, 6, 6]]  # the last token: cheap and harmless
    # Rows past the valid length never match (they hold stale tokens).
    _, has = _match([[1, 2, 3, 1, 2, 3]], [4], 2, 2, 2)
    assert has == [False]
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(3, 2)


@pytest.mark.parametrize("k", slow_except([1, 3, 7], fast={3}))
def test_greedy_ngram_is_exactly_plain_decoding(target, reference, k):
    out = speculative_generate(target, None, PROMPTS, method="ngram", num_draft_tokens=k, max_new_tokens=32,
                               eos_token_ids=[EOS])
    assert out.tokens == [t[:32] for t in reference.tokens]
    assert out.accepted_per_position.shape == (k,)
    assert out.mean_acceptance_length > 1.0  # the loops were drafted from the context


def test_rounds_without_a_match_emit_one_token_each(target, reference):
    # min_n larger than any repeat the outputs have: no round ever drafts (each runs the plain
    # 1-row step of `steps._target_step`), one token per round, exactly as method "none".
    prompt = [[3]]
    none = speculative_generate(target, None, prompt, method="none", max_new_tokens=12, eos_token_ids=[EOS])
    out = speculative_generate(target, NgramProposer(12, 12), prompt, method="ngram", num_draft_tokens=3,
                               max_new_tokens=12, eos_token_ids=[EOS])
    assert out.tokens == none.tokens
    assert out.accepted_per_position.sum() == 0
    assert out.total_rounds == none.total_rounds


def test_ngram_refuses_heads_and_feature_drafters(target):
    from peagle_jax.api import resolve_drafter
    from peagle_jax.drafters import DrafterConfig, create_drafter

    with pytest.raises(ValueError, match="takes no head"):
        resolve_drafter(None, "assets/heads/smollm2-135m-peagle", "ngram")
    head = create_drafter(DrafterConfig.for_target(target.config, num_layers=1), seed=0)
    with pytest.raises(ValueError, match="does not read target features"):
        speculative_generate(target, head, PROMPTS, method="ngram", num_draft_tokens=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="reads target features"):
        speculative_generate(target, NgramProposer(), PROMPTS, method="eagle3", num_draft_tokens=2, max_new_tokens=4)


# --------------------------------------------------------------------------- head + prompt lookup


@pytest.mark.parametrize("two_chains, head_draft_tokens, k, method", slow_except(
    itertools.product([False, True], [None, 1], [1, 3, 7], ["peagle+ngram", "eagle3+ngram"]),
    fast={(False, None, 3, "peagle+ngram"), (True, 1, 7, "eagle3+ngram"), (True, None, 1, "peagle+ngram")}))
def test_greedy_hybrid_is_exactly_plain_decoding(target, reference, method, k, head_draft_tokens, two_chains):
    from peagle_jax.drafters import DrafterConfig, create_drafter
    from peagle_jax.drafters.hybrid import HybridProposer

    cfg = DrafterConfig.for_target(target.config, num_layers=1, parallel_drafting=True, mask_token_id=VOCAB - 1)
    hybrid = HybridProposer(create_drafter(cfg, seed=2), NgramProposer(1, 3), head_draft_tokens,
                            two_chains=two_chains)
    out = speculative_generate(target, hybrid, PROMPTS, method=method, num_draft_tokens=k, max_new_tokens=32,
                               eos_token_ids=[EOS])
    assert out.tokens == [t[:32] for t in reference.tokens]
    assert out.mean_acceptance_length > 1.0  # the lookup branch drafted the loops a random head cannot


@pytest.mark.slow
def test_hybrid_takes_the_lookup_where_the_context_matches_and_the_head_elsewhere(target):
    from peagle_jax.drafters import DrafterConfig, create_drafter
    from peagle_jax.drafters.drafting import DraftSettings, Pending
    from peagle_jax.drafters.hybrid import HybridProposer
    from peagle_jax.sampling import SamplingParams

    cfg = DrafterConfig.for_target(target.config, num_layers=1, parallel_drafting=True, mask_token_id=VOCAB - 1)
    head = create_drafter(cfg, seed=2)
    hybrid = HybridProposer(head, NgramProposer(2, 2))
    # Row 0's context ends in "5 6", seen before followed by 7; row 1's context has no repeat.
    rows = jnp.asarray([[5, 6, 7, 5, 6, 0], [1, 2, 3, 4, 9, 0]], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(6)[None], (2, 6))
    feats = jnp.zeros((2, 6, cfg.hidden_size), jnp.float32)
    cache = hybrid.prefill(hybrid.init_cache(2, 16), rows, feats, pos)
    pending = Pending(jnp.asarray([[6], [9]]), jnp.zeros((2, 1, cfg.hidden_size)), jnp.asarray([1, 1]),
                      jnp.asarray([4, 4]))
    import jax

    settings = DraftSettings(2, True, jax.random.split(jax.random.key(0), 2), SamplingParams.full(2), True, VOCAB,
                             jnp.zeros((2,), jnp.int32))
    got = hybrid.propose(cache, pending, settings)
    head_only = head.propose(cache.head, pending, settings)
    assert got.tokens[0].tolist() == [7, 5]  # the lookup: what followed "5 6" before, then periodic
    assert got.tokens[1].tolist() == head_only.tokens[1].tolist()  # no match: the head's drafts
    assert got.num_drafts.tolist() == [2, 2] and got.widths == (2,)
    # A head capped at one draft: the lookup row keeps its K, the other proposes 1.
    capped = HybridProposer(head, NgramProposer(2, 2), head_draft_tokens=1).propose(cache, pending, settings)
    one = head.propose(cache.head, pending, settings._replace(num_draft_tokens=1))
    assert capped.tokens[0].tolist() == [7, 5] and capped.tokens[1, 0] == one.tokens[1, 0]
    assert capped.num_drafts.tolist() == [2, 1] and capped.widths == (1, 2)
    with pytest.raises(ValueError, match="head_draft_tokens"):
        HybridProposer(head, NgramProposer(), head_draft_tokens=0)


def test_hybrid_skips_the_head_while_the_lookup_matches_and_catches_up_exactly(target):
    # Rounds 1 and 2 match in the context, so the head is skipped and their rows wait; round 3
    # has no match, and the head reads the 5 waiting rows and the new one in one pass. Its
    # cache and drafts must then be those of a head that ran every round.
    import jax

    from peagle_jax.drafters import DrafterConfig, create_drafter
    from peagle_jax.drafters.drafting import DraftSettings, Pending
    from peagle_jax.drafters.hybrid import HybridProposer
    from peagle_jax.sampling import SamplingParams

    cfg = DrafterConfig.for_target(target.config, num_layers=1, parallel_drafting=True, mask_token_id=VOCAB - 1)
    head = create_drafter(cfg, seed=2)
    deferring, every_round = HybridProposer(head, NgramProposer(2, 2), defer_rows=8), \
        HybridProposer(head, NgramProposer(2, 2), defer_rows=0)
    h = cfg.hidden_size
    feats = jax.random.normal(jax.random.key(7), (1, 12, h), jnp.float32)
    prompt = jnp.asarray([[1, 2, 3, 4, 1, 2]], jnp.int32)
    caches = [d.prefill(d.init_cache(1, 32), prompt, feats[:, :6], jnp.arange(6)[None])
              for d in (deferring, every_round)]
    settings = DraftSettings(2, True, jax.random.key(0)[None], SamplingParams.full(1), True, VOCAB,
                             jnp.zeros((1,), jnp.int32))
    rounds = [([3, 4], 6), ([1, 2, 3], 8), ([9], 11)]  # accepted rows, position of the first
    for i, (toks, base) in enumerate(rounds):
        c = len(toks)
        pending = Pending(jnp.asarray([toks + [0] * (3 - c)], jnp.int32),
                          jnp.pad(feats[:, base:base + c], ((0, 0), (0, 3 - c), (0, 0))),
                          jnp.asarray([c]), jnp.asarray([base]), jnp.asarray([True]))
        got, ref = (d.propose(cache, pending, settings)
                    for d, cache in zip((deferring, every_round), caches, strict=True))
        caches = [got.cache, ref.cache]
        waiting = int(got.cache.deferred.count[0])
        if i < 2:  # matched: the lookup's drafts, the head untouched, the rows waiting
            assert got.tokens.tolist() == ref.tokens.tolist() and int(got.num_drafts[0]) == 2
            assert waiting == [2, 5][i]
            untouched = deferring.prefill(deferring.init_cache(1, 32), prompt, feats[:, :6], jnp.arange(6)[None]).head
            for a, b in zip(jax.tree.leaves(got.cache.head), jax.tree.leaves(untouched), strict=True):
                np.testing.assert_array_equal(a, b)
        else:  # no match: the head caught up and drafted as if it had run every round
            assert waiting == 0 and got.tokens.tolist() == ref.tokens.tolist()
            for a, b in zip(got.cache.head.layers, ref.cache.head.layers, strict=True):
                np.testing.assert_allclose(a.k[:, :, :12], b.k[:, :, :12], atol=1e-5)
                np.testing.assert_allclose(a.v[:, :, :12], b.v[:, :, :12], atol=1e-5)
    # A full buffer makes the head run even on a match; a finished sequence never holds it up.
    full = caches[0]._replace(deferred=caches[0].deferred._replace(count=jnp.asarray([7])))
    pending = Pending(jnp.asarray([[3, 4, 0]], jnp.int32), jnp.zeros((1, 3, h)), jnp.asarray([2]), jnp.asarray([12]),
                      jnp.asarray([True]))
    assert int(deferring.propose(full, pending, settings).cache.deferred.count[0]) == 0
    with pytest.raises(ValueError, match="defer_rows"):
        HybridProposer(head, NgramProposer(), defer_rows=-1)


def test_hybrid_head_drafts_fewer_and_the_round_verifies_only_those(target, reference):
    # A perfect head (the replay oracle) capped at 1 draft, and a lookup that never matches:
    # every round verifies 2 rows and accepts exactly 1 draft, never more, and the output is
    # still plain decoding's. Uncapped, the same oracle is accepted K per round.
    from peagle_jax.drafters.hybrid import HybridProposer
    from peagle_jax.drafters.reference import ReferenceDrafter

    table = np.zeros((len(PROMPTS), 64), np.int32)
    for i, t in enumerate(reference.tokens):
        table[i, :len(t)] = t
    never = NgramProposer(30, 30)
    capped = speculative_generate(target, HybridProposer(ReferenceDrafter(table, VOCAB), never, 1), PROMPTS,
                                  method="eagle3+ngram", num_draft_tokens=3, max_new_tokens=24, eos_token_ids=[EOS])
    assert capped.tokens == [t[:24] for t in reference.tokens]
    hist = capped.accepted_per_sequence
    assert hist[:, 1:].sum() == 0 and hist[:, 0].sum() > 0
    assert np.all(hist[:, 0] >= capped.rounds - 1)  # every round but a sequence's last accepts its one draft
    full = speculative_generate(target, HybridProposer(ReferenceDrafter(table, VOCAB), never), PROMPTS,
                                method="eagle3+ngram", num_draft_tokens=3, max_new_tokens=24, eos_token_ids=[EOS])
    assert full.tokens == capped.tokens and full.accepted_per_position[2] > 0


def test_verify_width_is_the_smallest_that_holds_every_active_sequence():
    from peagle_jax.generate.steps import verify_width_index

    widths = (0, 1, 3)
    active = jnp.asarray([True, True, False])
    assert int(verify_width_index(widths, jnp.asarray([0, 0, 3]), active)) == 0  # the finished row is ignored
    assert int(verify_width_index(widths, jnp.asarray([1, 0, 3]), active)) == 1
    assert int(verify_width_index(widths, jnp.asarray([1, 2, 0]), active)) == 2  # 2 drafts need width 3
    assert int(verify_width_index((3,), jnp.asarray([0, 0, 0]), active)) == 0


def test_hybrid_methods_resolve_through_the_front_door(target):
    from peagle_jax.api import method_for, resolve_drafter
    from peagle_jax.drafters import DrafterConfig, create_drafter
    from peagle_jax.drafters.hybrid import HybridProposer

    for parallel, method in ((True, "peagle+ngram"), (False, "eagle3+ngram")):
        cfg = DrafterConfig.for_target(target.config, num_layers=1, parallel_drafting=parallel,
                                       mask_token_id=VOCAB - 1 if parallel else None)
        assert method_for(HybridProposer(create_drafter(cfg, seed=0), NgramProposer())) == method
        shipped = resolve_drafter(None, "auto", method)
        assert shipped is None or shipped.endswith(method.split("+")[0])  # the shipped head of the base method
    assert method_for(NgramProposer()) == "ngram"
    from peagle_jax.api import load

    with pytest.raises(ValueError, match="head_draft_tokens"):  # refused before any model is loaded
        load(None, method="peagle", head_draft_tokens=1)


@pytest.mark.slow  # loads the default model
def test_load_keeps_two_chains_only_where_they_are_exact(monkeypatch):
    """`load(two_chains=True)` verifies two chains only where this backend's attention gives a
    second chain's rows their natural bits (generate.tree.two_chains_exact_here); elsewhere it
    falls back to one chain per round, which is exact everywhere, and says so in `options`."""
    from peagle_jax.api import load
    from peagle_jax.generate import tree

    llm = load(None, method="peagle+ngram", two_chains=True)
    exact = tree.two_chains_exact_here(llm.options["attention"] or "xla")
    assert llm.options["two_chains"] == llm.drafter.two_chains == exact
    monkeypatch.setattr(tree, "two_chains_exact_here", lambda implementation="xla": False)
    llm = load(None, method="peagle+ngram", two_chains=True)
    assert llm.options["two_chains"] is False and llm.drafter.two_chains is False
    llm = load(None, method="peagle", second_root=True)  # the head's runner-up is a second chain too
    assert llm.options["second_root"] is False and llm.drafter.second_root is False


@pytest.mark.slow  # loads the default model
def test_load_gives_the_head_its_second_root_or_refuses_it():
    """`load(second_root=True)` sets the head's flag where its two-chain verify is exact (and
    says so in `options`); without a head method it is refused before any model is loaded."""
    from peagle_jax.api import load
    from peagle_jax.generate import tree

    llm = load(None, second_root=True)  # auto: the shipped P-EAGLE head
    exact = tree.two_chains_exact_here(llm.options["attention"] or "xla")
    assert llm.method == "peagle" and llm.options["second_root"] == llm.drafter.second_root == exact
    # the second chain is verified at full width: no cutoff beside it (the default where load turned it off)
    assert llm.drafter.draft_cutoff == llm.options["draft_cutoff"] == (0.0 if exact else 0.1)
    for method in ("none", "ngram", "peagle+ngram"):
        with pytest.raises(ValueError, match="second_root applies to the methods"):
            load(None, method=method, second_root=True)


def _assert_head_weights(llm, requested):
    """The head's packed weights are what `options["draft_weights"]` says: bytes for "q7", "q4"
    (4-bit Linears, 32 bytes a pair row, beside a 7-bit lm_head) and "g4" (4-bit group records
    beside an 8-bit-group lm_head), bf16 for "native"."""
    from flax import nnx

    from peagle_jax.models.layers import PackedKernel
    from peagle_jax.models.options import q7_blocker

    want = {"auto": "q4" if q7_blocker() is None else "g4"}.get(requested, requested)
    assert llm.options["draft_weights"] == want
    packs = [v[...] for _, v in nnx.iter_graph(llm.drafter) if isinstance(v, PackedKernel)]
    assert {p.dtype.name for p in packs} == ({"bfloat16"} if want == "native" else {"uint8"})
    if want != "native":
        assert {p.shape[-1] for p in packs} == {"q7": {64}, "q4": {32, 64}, "g4": {768, 640}}[want]


@pytest.mark.slow  # loads the default model
def test_load_gives_the_head_the_weights_asked_for():
    """draft_weights: "auto" takes 4-bit Linears (q4 with bf16 dot products, else g4), "native"
    keeps bf16, "q7", "q4" and "g4" force theirs; the target's packed weights stay the same either way."""
    from flax import nnx

    from peagle_jax.api import load
    from peagle_jax.models.layers import PackedKernel

    target_packs = None  # the target's packed weights (its file's blocks where it is a GGUF) never follow the head's
    for requested in ("native", "q7", "q4", "g4"):
        llm = load(None, draft_weights=requested)
        _assert_head_weights(llm, requested)
        packs = {(v[...].dtype.name, v[...].shape[-1])
                 for _, v in nnx.iter_graph(llm.target) if isinstance(v, PackedKernel)}
        assert packs and packs == (target_packs := target_packs or packs), requested
    # a later head follows its own request, or load's, never what an earlier head resolved to
    llm = load(None, draft_weights="auto")
    llm.drafter = llm.load_head(llm.drafter_path, draft_weights="native")
    _assert_head_weights(llm, "native")
    llm.drafter = llm.load_head(llm.drafter_path)
    _assert_head_weights(llm, "auto")


@pytest.mark.slow  # loads the default model
def test_load_gives_the_head_its_draft_cutoff_or_refuses_it():
    """The head gets the backend's default cutoff (0.1 on CPU) or the one asked for; a cutoff
    outside [0, 1), without a head method, or beside second_root is refused before loading."""
    from peagle_jax.api import load

    llm = load(None)
    assert llm.method == "peagle" and llm.drafter.draft_cutoff == llm.options["draft_cutoff"] == 0.1
    _assert_head_weights(llm, "auto")
    assert load(None, draft_cutoff=0.0).drafter.draft_cutoff == 0.0
    with pytest.raises(ValueError, match="draft_cutoff"):
        load(None, draft_cutoff=1.0)
    for method in ("none", "ngram", "peagle+ngram"):
        with pytest.raises(ValueError, match="draft_cutoff applies to the methods"):
            load(None, method=method, draft_cutoff=0.2)
    with pytest.raises(ValueError, match="draft_cutoff and second_root do not combine"):
        load(None, draft_cutoff=0.2, second_root=True)


# --------------------------------------------------------------------------- two chains, one forward


@pytest.fixture(scope="module")
def target_bf16():
    cfg = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      dtype="bfloat16")
    return create_model(cfg, seed=5)


@pytest.mark.slow  # two chains: an experimental option
@pytest.mark.parametrize("winner", ["second", "main"])
def test_two_chain_verify_keeps_the_longer_chain_bitwise(target_bf16, winner):
    """One forward over [root | main | second]: the winning chain is accepted as far as plain
    greedy decoding goes, its rows' logits are bitwise those of a verify of that chain alone
    (so greedy output stays plain decoding's in bf16), and the committed K/V rows are bitwise
    where a verify of the winner alone would have written them."""
    import jax

    from peagle_jax.drafters.drafting import Branch, Proposal
    from peagle_jax.generate import steps, tree
    from peagle_jax.sampling import SamplingParams

    target = target_bf16
    prompt = [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    plain = speculative_generate(target, None, prompt, method="none", max_new_tokens=8).tokens[0]
    k = 3
    config = steps.SpecConfig("ngram", k, True, capacity=64, out_size=16)
    state = steps.prefill(target, NgramProposer(), jnp.asarray(prompt, jnp.int32), jnp.asarray([9]), config,
                          max_new=jnp.asarray([8]), sp=SamplingParams.full(1), eos_ids=jnp.asarray([EOS]),
                          key=jax.random.key(0)[None])
    right = jnp.asarray([plain[1:1 + k]], jnp.int32)
    wrong = (right + 7) % (VOCAB - 1) + 1
    main, second = (wrong, right) if winner == "second" else (right.at[0, 2].set(wrong[0, 2]), wrong)
    proposal = Proposal(main, None, None, jnp.asarray([k]), (k,), Branch(second, jnp.asarray([k])))
    # jitted with the step programs' compiler options, which keep every row's value independent
    # of the row count (tests/generate/test_row_invariance.py)
    target_step = steps.step_jit(lambda: steps._target_step(target, state, proposal, jax.random.key(1)[None],
                                                            config, jnp.asarray([True])))
    verify = steps.step_jit(lambda d: steps.verify_forward(target, state.target_cache, state.last_token, d,
                                                           return_aux=False))
    cache, m, nxt, _, drafts = target_step()
    expect_m = k if winner == "second" else 2
    assert int(m[0]) == expect_m and int(nxt[0]) == plain[1 + expect_m]
    assert drafts.tolist() == (second if winner == "second" else main).tolist()
    # the same chain verified alone, at its natural rows
    alone = verify(right)
    n = int(state.target_cache.lengths[0])
    for got, want in zip(cache.layers, alone.cache.layers, strict=True):
        np.testing.assert_array_equal(np.asarray(got.k[:, :, :n + 1 + expect_m], np.float32),
                                      np.asarray(want.k[:, :, :n + 1 + expect_m], np.float32))
        np.testing.assert_array_equal(np.asarray(got.v[:, :, :n + 1 + expect_m], np.float32),
                                      np.asarray(want.v[:, :, :n + 1 + expect_m], np.float32))
    layout = tree.two_chain_layout(state.target_cache.lengths, k, k)
    both = steps.step_jit(lambda t: target(t, layout.positions, state.target_cache, slots=layout.slots,
                                           skip=(layout.skip_lo, layout.skip_hi)))(
        jnp.concatenate([state.last_token[:, None], main, second], axis=1))
    rows = tree.second_chain_rows(k, k)
    natural = (alone if winner == "second" else verify(second)).logits
    np.testing.assert_array_equal(np.asarray(both.logits[:, rows]), np.asarray(natural))


def test_second_chain_is_verified_only_where_it_fits():
    from peagle_jax.generate import tree

    assert tree.chain_offset(1, 3) == 16 and tree.chain_offset(3, 15) == 16 and tree.chain_offset(16, 3) == 32
    lengths = jnp.asarray([0, 40, 45, 495, 520])
    # capacity 64, one key block: the chain's last row n + 16 + 3 must lie below 64
    assert tree.second_chain_fits(lengths, 1, 3, 64).tolist() == [True, True, False, False, False]
    # several key blocks: the chain must stay in the key block of its natural rows
    assert tree.second_chain_fits(lengths, 1, 3, 1024, key_block=512).tolist() == [True, True, True, False, True]
