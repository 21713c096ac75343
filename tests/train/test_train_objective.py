"""Training forwards vs brute-force dense references; the KL loss vs numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from peagle_jax.drafters import DrafterConfig, create_drafter
from peagle_jax.models import ModelConfig
from peagle_jax.train.cod import cod_batch
from peagle_jax.train.objective import Rows, eagle3_forward, eagle3_loss, kl_terms, peagle_forward, peagle_loss

V, H, K, N = 48, 32, 4, 40
TCFG = ModelConfig(architecture="llama", vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _drafter(layers=2, parallel=True, seed=0):
    cfg = DrafterConfig.for_target(TCFG, num_layers=layers, parallel_drafting=parallel,
                                   mask_token_id=V - 1 if parallel else None)
    d = create_drafter(cfg, seed=seed)
    # O(1) weights so attention patterns matter
    for path, var in nnx.to_flat_state(nnx.state(d, nnx.Param)):
        if path[-1] == "kernel":
            var.set_value(var.get_value() / (0.02 * np.sqrt(var.get_value().shape[0])))
    return d


def _rows(b=2, seed=0, docs=(1, 3)):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V - 1, (b, N)).astype(np.int32)
    aux = rng.normal(size=(b, N, 3 * H)).astype(np.float32)
    th = rng.normal(size=(b, N, H)).astype(np.float32) * 3
    doc = np.full((b, N), -1, np.int32)
    pos = np.zeros((b, N), np.int32)
    for r in range(b):
        nd = docs[r % len(docs)]
        used = N - 4
        cuts = [0, *sorted(rng.choice(np.arange(3, used - 3), nd - 1, replace=False).tolist()), used]
        for d in range(nd):
            doc[r, cuts[d] : cuts[d + 1]] = d
            pos[r, cuts[d] : cuts[d + 1]] = np.arange(cuts[d + 1] - cuts[d])
    lm = ((rng.random((b, N)) < 0.8) & (doc >= 0)).astype(np.float32)
    lay = cod_batch(lm, doc, num_depths=K, ratio=0.7, ratio_min=0.2, max_anchors=24, rng=rng)
    return Rows(jnp.asarray(tokens), jnp.asarray(aux), jnp.asarray(th), jnp.asarray(pos), jnp.asarray(doc),
                jnp.asarray(lm), jnp.asarray(lay.anchor), jnp.asarray(lay.depth), jnp.asarray(lay.valid),
                jnp.asarray(lay.chain_idx))


def _jit(d, fn):
    """fn(drafter, *args) jitted over the drafter's state (eager op-by-op is slow on CPU)."""
    g, st = nnx.split(d)
    jf = jax.jit(lambda st, *a: fn(nnx.merge(g, st), *a))
    return lambda *a: jf(st, *a)


def _dense_forward(drafter, embeds, feats, positions, allowed):
    """Reference: every layer with a dense [E, E] boolean mask over one flattened sequence."""
    x = feats[None]
    e = embeds[None]
    p = positions[None]
    for layer in drafter.layers:
        attn_in, res = layer.attention_input(x, e)
        q, k, v = layer.self_attn.project_qkv(attn_in, p)
        g = q.shape[2] // k.shape[2]
        k = jnp.repeat(k, g, axis=2)
        v = jnp.repeat(v, g, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        s = jnp.where(allowed[None, None], s, -jnp.inf)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(1, q.shape[1], -1)
        x = layer.finish(res, layer.self_attn.o_proj(a))
    return x[0]


def test_peagle_attention_matches_dense_reference():
    d = _drafter()
    rows = _rows()
    me = d.embed_tokens[...][V - 1]
    x0, xc = _jit(d, lambda dd, r: peagle_forward(dd, r, dd.embed_tokens[...][V - 1], dd.mask_feature()))(rows)
    emb = d.embed_tokens[...]
    dense = _jit(d, _dense_forward)
    for b in range(rows.tokens.shape[0]):
        valid = np.asarray(rows.chain_valid[b])
        anc = np.concatenate([np.arange(N), np.asarray(rows.chain_anchor[b])[valid]])
        dep = np.concatenate([np.zeros(N, int), np.asarray(rows.chain_depth[b])[valid]])
        doc = np.asarray(rows.doc[b])
        pos = np.asarray(rows.positions[b])[anc] + dep
        embeds = jnp.concatenate([emb[rows.tokens[b]], jnp.broadcast_to(me, (int(valid.sum()), H))])
        feats = jnp.concatenate([d.project(rows.aux[b]), jnp.broadcast_to(d.mask_feature(), (int(valid.sum()), H))])
        # reference §2.3 predicate
        aq, ak = anc[:, None], anc[None, :]
        dq, dk = dep[:, None], dep[None, :]
        allowed = (doc[aq] != -1) & (doc[aq] == doc[ak]) & (((dk == 0) & (ak <= aq)) | ((ak == aq) & (dk <= dq)))
        allowed |= np.eye(len(anc), dtype=bool)  # padding rows: keep softmax finite
        ref = dense(embeds, feats, jnp.asarray(pos), jnp.asarray(allowed))
        real = doc >= 0
        np.testing.assert_allclose(np.asarray(x0[b])[real], np.asarray(ref[:N])[real], rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(np.asarray(xc[b])[valid], np.asarray(ref[N:]), rtol=2e-4, atol=2e-4)


def test_peagle_chain_matches_inference_drafter():
    """A chain element equals the inference forward over [context..anchor, mask x depth]."""
    d = _drafter()
    rows = _rows(b=1, docs=(1,))
    x0, xc = _jit(d, lambda dd, r: peagle_forward(dd, r, dd.embed_tokens[...][V - 1], dd.mask_feature()))(rows)
    logits_c = d.logits_from_prenorm(xc[0])
    valid = np.flatnonzero(np.asarray(rows.chain_valid[0]))
    g, st = nnx.split(d)

    @jax.jit
    def infer(st, toks, feats, pos, row):
        dd = nnx.merge(g, st)
        return dd(toks, feats, pos, dd.init_cache(1, 64), logit_rows=row)

    deepest = valid[np.asarray(rows.chain_depth[0])[valid] == np.asarray(rows.chain_depth[0])[valid].max()]
    picks = sorted(set(valid[:: max(1, len(valid) // 4)].tolist()) | set(deepest[:2].tolist()))
    for m in picks:
        a, dep = int(rows.chain_anchor[0, m]), int(rows.chain_depth[0, m])
        L = 48  # fixed padded length: rows past a + dep are causally invisible
        toks = jnp.concatenate([rows.tokens[0, : a + 1], jnp.full((L - a - 1,), V - 1, jnp.int32)])[None]
        feats = jnp.concatenate([d.project(rows.aux[0, : a + 1]),
                                 jnp.broadcast_to(d.mask_feature(), (L - a - 1, H))])[None]
        pos = jnp.arange(L, dtype=jnp.int32)[None]
        out = infer(st, toks, feats, pos, jnp.array([[a + dep]]))
        np.testing.assert_allclose(np.asarray(out.logits[0, 0]), np.asarray(logits_c[m]), rtol=3e-4, atol=3e-4)
        np.testing.assert_allclose(np.asarray(out.prenorm[0, a]), np.asarray(x0[0, a]), rtol=3e-4, atol=3e-4)


def test_eagle3_ttt_matches_dense_reference():
    d = _drafter(parallel=False)
    rows = _rows(b=1, docs=(2,))
    steps = 3
    outs = _jit(d, lambda dd, r: eagle3_forward(dd, r, steps))(rows)
    dense = _jit(d, _dense_forward)
    emb = d.embed_tokens[...]
    doc = np.asarray(rows.doc[0])
    feats = [d.project(rows.aux[0])]
    embeds, poss, idx, stp = [], [], [], []
    for s in range(steps):
        tok = np.concatenate([np.asarray(rows.tokens[0, s:]), np.zeros(s, np.int32)])
        embeds.append(emb[tok])
        poss.append(np.asarray(rows.positions[0]) + s)
        idx.append(np.arange(N))
        stp.append(np.full(N, s))
        i_all, s_all = np.concatenate(idx), np.concatenate(stp)
        iq, ik, sq, sk = i_all[:, None], i_all[None], s_all[:, None], s_all[None]
        causal = ((sk == 0) & (ik <= iq)) | ((ik == iq) & (sk >= 1) & (sk <= sq))
        allowed = (doc[iq] >= 0) & (doc[iq] == doc[ik]) & causal
        allowed |= np.eye(len(i_all), dtype=bool)
        ref = dense(jnp.concatenate(embeds), jnp.concatenate(feats), jnp.asarray(np.concatenate(poss)),
                             jnp.asarray(allowed))
        got = ref[s * N : (s + 1) * N]
        real = doc >= 0
        np.testing.assert_allclose(np.asarray(outs[s][0])[real], np.asarray(got)[real], rtol=3e-4, atol=3e-4)
        feats.append(outs[s][0])  # next step's feature = this step's pre-norm output


def _np_kl(dl, tl):
    def lsm(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = lsm(tl.astype(np.float64)), lsm(dl.astype(np.float64))
    return (np.exp(lp) * (lp - lq)).sum(-1)


def test_kl_terms_vs_numpy():
    rng = np.random.default_rng(0)
    dl, tl = rng.normal(size=(7, 33)) * 3, rng.normal(size=(7, 33)) * 3
    kl, hit = kl_terms(jnp.asarray(dl, jnp.float32), jnp.asarray(tl, jnp.float32))
    np.testing.assert_allclose(np.asarray(kl), _np_kl(dl, tl), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(hit), dl.argmax(-1) == tl.argmax(-1))


def test_peagle_loss_vs_numpy():
    d = _drafter()
    rows = _rows()
    total, count, per = _jit(d, lambda dd, r: peagle_loss(dd, r, dd.embed_tokens[...][V - 1], K))(rows)
    x0, xc = _jit(d, lambda dd, r: peagle_forward(dd, r, dd.embed_tokens[...][V - 1], dd.mask_feature()))(rows)
    dl0 = np.asarray(d.logits_from_prenorm(x0), np.float64)
    dlc = np.asarray(d.logits_from_prenorm(xc), np.float64)
    w = np.asarray(d.lm_head[...], np.float64)
    th = np.asarray(rows.target_hidden, np.float64)
    lm, doc = np.asarray(rows.loss_mask), np.asarray(rows.doc)
    num = den = 0.0
    per_ref = np.zeros((K, 3))
    for b in range(th.shape[0]):
        kl0 = _np_kl(dl0[b], th[b] @ w)
        w0 = lm[b] * (doc[b] >= 0)
        num += (w0 * kl0).sum()
        den += w0.sum()
        per_ref[0] += [w0.sum(), (w0 * kl0).sum(), (w0 * (dl0[b].argmax(-1) == (th[b] @ w).argmax(-1))).sum()]
        for m in np.flatnonzero(np.asarray(rows.chain_valid[b])):
            sup = int(rows.chain_anchor[b, m] + rows.chain_depth[b, m])
            tl = th[b, sup] @ w
            kl = _np_kl(dlc[b, m][None], tl[None])[0] * lm[b, sup]
            num += kl
            den += lm[b, sup]
            dd = int(rows.chain_depth[b, m])
            per_ref[dd] += [lm[b, sup], kl, lm[b, sup] * (dlc[b, m].argmax() == tl.argmax())]
    np.testing.assert_allclose(float(total / count), num / den, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(per), per_ref, rtol=1e-4, atol=1e-3)


def test_eagle3_loss_decay_and_grad_finite():
    d = _drafter(parallel=False)
    rows = _rows(docs=(2,))
    t1, c1, p1 = _jit(d, lambda dd, r: eagle3_loss(dd, r, 3, 1.0))(rows)
    t2, c2, p2 = _jit(d, lambda dd, r: eagle3_loss(dd, r, 3, 0.5))(rows)
    kls = np.asarray(p1)[:, 1]
    np.testing.assert_allclose(float(t2), kls[0] + 0.5 * kls[1] + 0.25 * kls[2], rtol=1e-4)
    g, s, rest = nnx.split(d, nnx.Param, ...)

    def f(st):
        return eagle3_loss(nnx.merge(g, st, rest), rows, 3, 1.0)[0]

    grads = jax.jit(jax.grad(f))(s)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(grads))
