"""Training forwards for the draft head (P-EAGLE and EAGLE-3 TTT) and the KL objective.

The inference forward (`Eagle3Drafter.__call__`) attends through a KV cache with an
absolute-position causal mask. Training needs other masks, so these functions reuse the
drafter's submodules (fc, q/k/v/o projections, norms, MLP, lm_head) and compute attention
themselves.

Packed-row convention (the EAGLE shift, reference §1.2): element i of a row holds the token
x_{i+1}, the target taps g_i, the target's final hidden state at position i+1 (its logits are
the distribution over x_{i+2}) and the loss mask of position i+1. `doc` is the document id of
the element within the row (-1 = padding); `positions` restart at 0 in each document.

P-EAGLE attention (reference §2.3) without a dense mask over the flattened sequence (§8):
  * depth-0 rows: causal attention over depth-0 keys of the same document;
  * chain element (anchor a, depth d): depth-0 keys j <= a of a's document, plus the keys of
    its own chain at depths 1..d (gathered through `chain_idx`); both parts go through one
    softmax (a joint log-sum-exp). Masks are built from index comparisons inside the step,
    never stored; the cost is O(n^2 + M n + M K) per row.
EAGLE-3 TTT (reference §5.3): step s >= 1 feeds back the previous step's pre-norm output and
the ground-truth token shifted by s, at position i + s; query i attends to depth-0 keys j <= i
plus its own keys from steps 1..s (the "diagonal").
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from peagle_jax.models.layers import matmul

NEG = -1e30


class Rows(NamedTuple):
    """One packed batch (device arrays). Chain fields are None for EAGLE-3."""

    tokens: jax.Array  # [B, n] int32
    aux: jax.Array  # [B, n, 3Ht]
    target_hidden: jax.Array  # [B, n, Ht] (after the target's final norm)
    positions: jax.Array  # [B, n] int32
    doc: jax.Array  # [B, n] int32
    loss_mask: jax.Array  # [B, n] float32
    chain_anchor: jax.Array | None = None  # [B, M]
    chain_depth: jax.Array | None = None  # [B, M]
    chain_valid: jax.Array | None = None  # [B, M]
    chain_idx: jax.Array | None = None  # [B, M, K-1]


def attend(q, k0, v0, ctx_limit, doc, extra_k=None, extra_v=None, extra_mask=None):
    """Queries [B,R,Nh,D] over depth-0 keys j <= ctx_limit[b,r] of the same document
    (doc of the key == doc of element ctx_limit), plus optional per-query extra keys
    [B,R,E,Nkv,D] (mask [B,R,E]) in the same softmax. Returns [B,R,Nh,D].

    The scores are laid out [B, Nkv, G, R, S] (batch axes first, keys last), so neither product
    nor softmax transposes them, and the extra keys join the softmax through a shared max and
    sum instead of a concatenation: in the step's profile the [B, R, Nkv, G, S] layout spent
    more time copying the scores than computing them (docs/notes/2026-12-06-session-40.md)."""
    b, r, nh, d = q.shape
    num_kv = k0.shape[2]
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    qg = q.astype(jnp.float32).reshape(b, r, num_kv, nh // num_kv, d).transpose(0, 2, 3, 1, 4)  # [B,Nkv,G,R,D]
    kt = k0.astype(jnp.float32).transpose(0, 2, 1, 3)  # [B,Nkv,S,D]
    vt = v0.astype(jnp.float32).transpose(0, 2, 1, 3)
    s_ctx = jnp.einsum("bkgrd,bksd->bkgrs", qg, kt) * scale
    n = k0.shape[1]
    j = jnp.arange(n)[None, None, :]
    qdoc = jnp.take_along_axis(doc, ctx_limit, axis=1)  # [B,R]
    ok = (j <= ctx_limit[..., None]) & (doc[:, None, :] == qdoc[..., None]) & (qdoc[..., None] >= 0)
    s_ctx = jnp.where(ok[:, None, None], s_ctx, NEG)
    if extra_k is None:
        p = jax.nn.softmax(s_ctx, axis=-1)
        out = jnp.einsum("bkgrs,bksd->bkgrd", p, vt)
    else:
        s_ex = jnp.einsum("bkgrd,brekd->bkgre", qg, extra_k.astype(jnp.float32)) * scale
        s_ex = jnp.where(extra_mask[:, None, None], s_ex, NEG)
        top = jax.lax.stop_gradient(jnp.maximum(s_ctx.max(-1, keepdims=True), s_ex.max(-1, keepdims=True)))
        e_ctx, e_ex = jnp.exp(s_ctx - top), jnp.exp(s_ex - top)
        total = e_ctx.sum(-1, keepdims=True) + e_ex.sum(-1, keepdims=True)
        out = (jnp.einsum("bkgrs,bksd->bkgrd", e_ctx, vt)
               + jnp.einsum("bkgre,brekd->bkgrd", e_ex, extra_v.astype(jnp.float32))) / total
    return out.transpose(0, 3, 1, 2, 4).reshape(b, r, nh * d).astype(q.dtype)


def peagle_forward(drafter, rows: Rows, mask_embed, mask_feature):
    """Pre-norm outputs for depth-0 rows [B,n,H] and chain slots [B,M,H]."""
    b, n = rows.tokens.shape
    m = rows.chain_anchor.shape[1]
    emb_table = drafter.embed_tokens[...]
    e0 = jnp.take(emb_table, rows.tokens, axis=0)
    x0 = drafter.project(rows.aux).astype(e0.dtype)
    ec = jnp.broadcast_to(mask_embed.astype(e0.dtype), (b, m, e0.shape[-1]))
    xc = jnp.broadcast_to(mask_feature.astype(e0.dtype), (b, m, x0.shape[-1]))
    pos0 = rows.positions
    posc = jnp.take_along_axis(pos0, rows.chain_anchor, axis=1) + rows.chain_depth
    self0 = jnp.broadcast_to(jnp.arange(n)[None], (b, n))
    cidx = jnp.maximum(rows.chain_idx, 0)
    cmask = rows.chain_idx >= 0
    for layer in drafter.layers:
        in0, res0 = layer.attention_input(x0, e0)
        inc, resc = layer.attention_input(xc, ec)
        q0, k0, v0 = layer.self_attn.project_qkv(in0, pos0)
        qc, kc, vc = layer.self_attn.project_qkv(inc, posc)
        a0 = attend(q0, k0, v0, self0, rows.doc)
        gk = jax.vmap(lambda kk, ii: kk[ii])(kc, cidx)  # [B,M,K-1,Nkv,D]
        gv = jax.vmap(lambda vv, ii: vv[ii])(vc, cidx)
        ac = attend(qc, k0, v0, rows.chain_anchor, rows.doc, gk, gv, cmask)
        x0, xc = layer.finish(res0, layer.self_attn.o_proj(a0)), layer.finish(resc, layer.self_attn.o_proj(ac))
    return x0, xc


def eagle3_forward(drafter, rows: Rows, steps: int):
    """TTT unroll: list of (prenorm [B,n,H], tokens index shift s) for s = 0..steps-1."""
    b, n = rows.tokens.shape
    emb_table = drafter.embed_tokens[...]
    self0 = jnp.broadcast_to(jnp.arange(n)[None], (b, n))
    outs = []
    kv0: list = []
    extra: list[list] = [[] for _ in drafter.layers]
    x = drafter.project(rows.aux).astype(emb_table.dtype)
    for s in range(steps):
        tok = _shift(rows.tokens, s)
        e = jnp.take(emb_table, tok, axis=0)
        pos = rows.positions + s
        h = x
        for li, layer in enumerate(drafter.layers):
            attn_in, res = layer.attention_input(h, e)
            q, k, v = layer.self_attn.project_qkv(attn_in, pos)
            if s == 0:
                kv0.append((k, v))
                a = attend(q, k, v, self0, rows.doc)
            else:
                extra[li].append((k, v))
                ek = jnp.stack([kv[0] for kv in extra[li]], axis=2)
                ev = jnp.stack([kv[1] for kv in extra[li]], axis=2)
                em = jnp.ones(ek.shape[:3], bool)
                a = attend(q, kv0[li][0], kv0[li][1], self0, rows.doc, ek, ev, em)
            h = layer.finish(res, layer.self_attn.o_proj(a))
        outs.append(h)
        x = h  # pre-norm output fed back as the next step's feature
    return outs


def _shift(x, s):
    """x[:, i + s] (zero / False past the end)."""
    if s == 0:
        return x
    pad = jnp.zeros((x.shape[0], s) + x.shape[2:], x.dtype)
    return jnp.concatenate([x[:, s:], pad], axis=1)


def kl_terms(draft_logits, target_logits):
    """Forward KL(p_target || q_draft) per row (fp32, over the draft vocabulary) and argmax hit."""
    tl = target_logits.astype(jnp.float32)
    dl = draft_logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(tl, axis=-1)
    logq = jax.nn.log_softmax(dl, axis=-1)
    kl = jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)
    hit = jnp.argmax(dl, axis=-1) == jnp.argmax(tl, axis=-1)
    return kl, hit


def _draft_logits(drafter, prenorm):
    return drafter.logits_from_prenorm(prenorm)


def _target_logits(drafter, hidden):
    # The drafter's lm_head is frozen and equal to the target's draft-vocab rows.
    w = jax.lax.stop_gradient(drafter.lm_head[...])
    return matmul(hidden.astype(jnp.float32), w.astype(jnp.float32), out_dtype=jnp.float32)


def peagle_loss(drafter, rows: Rows, mask_embed, num_depths: int):
    """Count-normalised KL over depth-0 and chain elements; per-depth sums for metrics."""
    x0, xc = peagle_forward(drafter, rows, mask_embed, drafter.mask_feature())
    n = rows.tokens.shape[1]
    kl0, hit0 = kl_terms(_draft_logits(drafter, x0), _target_logits(drafter, rows.target_hidden))
    w0 = rows.loss_mask * (rows.doc >= 0)
    sup = jnp.clip(rows.chain_anchor + rows.chain_depth, 0, n - 1)
    th = jnp.take_along_axis(rows.target_hidden, sup[..., None], axis=1)
    klc, hitc = kl_terms(_draft_logits(drafter, xc), _target_logits(drafter, th))
    wc = rows.chain_valid.astype(jnp.float32) * jnp.take_along_axis(rows.loss_mask, sup, axis=1)
    total = jnp.sum(w0 * kl0) + jnp.sum(wc * klc)
    count = jnp.sum(w0) + jnp.sum(wc)
    per = [(jnp.sum(w0), jnp.sum(w0 * kl0), jnp.sum(w0 * hit0))]
    for d in range(1, num_depths):
        sel = wc * (rows.chain_depth == d)
        per.append((jnp.sum(sel), jnp.sum(sel * klc), jnp.sum(sel * hitc)))
    return total, count, jnp.array(per)  # per: [K, 3] (count, kl sum, hits)


def eagle3_loss(drafter, rows: Rows, steps: int, decay: float):
    outs = eagle3_forward(drafter, rows, steps)
    total = 0.0
    count = 0.0
    per = []
    for s, h in enumerate(outs):
        th = _shift(rows.target_hidden, s)
        w = _shift(rows.loss_mask, s) * (rows.doc >= 0) * (_shift(rows.doc, s) == rows.doc)
        kl, hit = kl_terms(_draft_logits(drafter, h), _target_logits(drafter, th))
        total = total + (decay**s) * jnp.sum(w * kl)
        if s == 0:
            count = jnp.sum(w)  # loss = sum_s decay^s * KL_s / (step-0 count) ~ sum of per-step means
        per.append((jnp.sum(w), jnp.sum(w * kl), jnp.sum(w * hit)))
    return total, count, jnp.array(per)
