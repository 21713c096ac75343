"""Target features: the three EAGLE-3 taps and the final hidden state, per document.

`python -m peagle_jax.train.features --config configs/train/peagle_smollm2.yaml [key=value ...]` builds
the training and validation documents of the config's data source and writes their features
to `<features_dir>/{train,val}/shard_XXXXX/` (npy, fp16 or bf16 stored as uint16). Shards are
written to a temporary directory and renamed when complete, so an interrupted run resumes at
the first missing shard. The target logits are not stored: they come from the final hidden
state through the frozen lm_head inside the training step (576 values a token for SmolLM2
instead of 49152).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from peagle_jax.train.config import TrainConfig, config_from_argv
from peagle_jax.train.data import (
    Doc,
    chat_docs,
    chunk_doc,
    code_docs,
    generate_selfdistill,
    random_docs,
    read_selfdistill,
    stdlib_function_prompts,
)

_DTYPES = {"float16": np.float16, "float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


# --------------------------------------------------------------------------- target + docs


def load_target_and_tokenizer(cfg: TrainConfig):
    """(target CausalLM, tokenizer or None, eos ids, model path or None)."""
    if cfg.model.random_target is not None:
        from peagle_jax.models import ModelConfig, create_model

        mc = ModelConfig(**{"architecture": "llama", **cfg.model.random_target})
        model = create_model(mc, seed=cfg.model.random_seed)
        _rescale_random(model)
        return model, None, [], None
    from peagle_jax.checkpoints import load_target
    from peagle_jax.checkpoints.default_model import resolve_model_path
    from peagle_jax.checkpoints.tokenizer import eos_token_ids, load_tokenizer

    path = resolve_model_path(cfg.model.target)
    target = load_target(path, dtype=cfg.model.dtype)
    tok = load_tokenizer(path)
    return target, tok, eos_token_ids(tok, path), path


def _rescale_random(model) -> None:
    """Bring a randomly initialised (std 0.02) target to O(1) activations so its next-token
    distributions are peaked, like a trained model's: projections get std 1/sqrt(fan_in),
    the embedding std 1."""
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = path[-1]
        x = var.get_value()
        if name == "kernel":
            var.set_value(x / (0.02 * np.sqrt(x.shape[0])))
        elif name in ("embed_tokens", "lm_head"):
            var.set_value(x / 0.02 if name == "embed_tokens" else x / (0.02 * np.sqrt(x.shape[0])))


def generated_docs(data_dir: str | None, split: str) -> list[Doc]:
    """The target-written answers in a `generate_data` folder's shards (loss on the answers)."""
    from peagle_jax.train.shards import read_split

    if not data_dir:
        raise ValueError("data.source=generated needs data.generated_dir (a generate_data folder, "
                         "e.g. data/selfdistill/<model>)")
    docs = []
    for r in read_split(Path(data_dir), split):
        toks = np.asarray([*r.prompt, *r.response], np.int32)
        mask = np.concatenate([np.zeros(len(r.prompt), np.uint8), np.ones(len(r.response), np.uint8)])
        docs.append(Doc(toks, mask, r.name if r.turn == 1 else f"{r.name}/turn{r.turn}"))
    return docs


def chunk_len(cfg: TrainConfig) -> int:
    return min(cfg.data.max_doc_tokens, cfg.data.seq_len + 1)


def load_documents(cfg: TrainConfig, split: str, target, tokenizer, eos_ids, log=print) -> list[Doc]:
    d = cfg.data
    limit = d.max_docs if split == "train" else max(8, (d.max_docs or 10**9) // 20)
    if d.source == "code":
        docs = code_docs(tokenizer, split=split, val_percent=d.val_percent, max_docs=limit,
                         eos_id=eos_ids[-1] if eos_ids else None, tokens_per_file=d.code_tokens_per_file,
                         skip_tests=d.code_skip_tests)
    elif d.source == "chat":
        if not d.chat_path:
            raise ValueError("data.source=chat needs data.chat_path")
        docs = chat_docs(tokenizer, d.chat_path, split=split, val_percent=d.val_percent, max_docs=limit)
    elif d.source == "selfdistill":
        n = d.sd_max_prompts if split == "train" else max(8, d.sd_max_prompts // 20)
        prompts = stdlib_function_prompts(split=split, val_percent=d.val_percent, limit=n)
        out = cfg.features_dir / f"selfdistill_{split}.jsonl"
        generate_selfdistill(target, tokenizer, prompts, out, max_new_tokens=d.sd_max_new_tokens,
                             batch=d.sd_batch, eos_ids=eos_ids, log=log)
        docs = read_selfdistill(out)
    elif d.source == "generated":
        docs = generated_docs(d.generated_dir, split)[:limit]
    elif d.source == "random":
        num = d.random_docs if split == "train" else max(4, d.random_docs // 8)
        docs = random_docs(target, num=num, prompt_len=d.random_prompt_len, new_tokens=d.random_new_tokens,
                           seed=cfg.data.shuffle_seed + (0 if split == "train" else 7919))
    else:  # pragma: no cover
        raise ValueError(d.source)
    out_docs: list[Doc] = []
    for doc in docs:
        out_docs.extend(chunk_doc(doc, chunk_len(cfg)))
    return out_docs


# --------------------------------------------------------------------------- extraction


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _extract(graphdef, state, tokens):
    model = nnx.merge(graphdef, state)
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    out = model(tokens, pos, model.init_cache(b, t), return_aux=True, return_final_hidden=True,
                compute_logits=False)
    return out.aux_hidden, out.final_hidden


def target_features(target, tokens: np.ndarray):
    """aux [B,T,3H], final hidden [B,T,H] for a padded batch (float32 numpy)."""
    g, s = nnx.split(target)
    a, h = _extract(g, s, jnp.asarray(tokens, jnp.int32))
    return np.asarray(a, np.float32), np.asarray(h, np.float32)


def _bucket(n: int, step: int = 64) -> int:
    """The padded length of a batch whose longest document has n tokens: the next multiple of
    `step`. Powers of two padded the self-distilled documents to 1.9x their tokens; this and
    length-sorted batches (`_EXTRACT_WINDOW`) to about 1.1x, for a handful more programs."""
    return max(step, -(-n // step) * step)


_EXTRACT_WINDOW = 16
"""Batches per window of consecutive documents: a window is batched in length order, so a
batch holds documents of similar length, and its features are written in document order."""


class FeatureStore:
    """Read side of the shards: per-document tokens, loss mask, taps and final hidden state."""

    def __init__(self, root: str | Path, limit: int | None = None):
        """`limit`: read only the first `limit` documents (a run capped by `data.max_docs` on
        features extracted for more; the documents are in the same order either way)."""
        self.root = Path(root)
        meta = json.loads((self.root / "meta.json").read_text())
        self.meta = meta
        self.dtype = meta["dtype"]
        self.docs: list[tuple[int, int, int]] = []  # (shard, offset, length)
        self.shards = []
        for i, name in enumerate(meta["shards"]):
            d = self.root / name
            arrs = {k: np.load(d / f"{k}.npy", mmap_mode="r") for k in ("tokens", "mask", "aux", "hidden", "docs")}
            self.shards.append(arrs)
            for off, ln in np.asarray(arrs["docs"]):
                self.docs.append((i, int(off), int(ln)))
        if limit is not None:
            if limit > len(self.docs):
                raise ValueError(f"{self.root} holds features of {len(self.docs)} documents, fewer than the {limit} "
                                 "this run reads; extract them again (python -m peagle_jax.train.features)")
            self.docs = self.docs[:limit]

    def __len__(self):
        return len(self.docs)

    def lengths(self) -> list[int]:
        return [d[2] for d in self.docs]

    def _cast(self, x):
        if self.dtype == "bfloat16":
            return np.asarray(x).view(ml_dtypes.bfloat16).astype(np.float32)
        return np.asarray(x, np.float32)

    def get(self, i: int, with_features: bool = True):
        s, off, ln = self.docs[i]
        a = self.shards[s]
        t = np.asarray(a["tokens"][off : off + ln])
        m = np.asarray(a["mask"][off : off + ln])
        if not with_features:
            return t, m, None, None
        return t, m, self._cast(a["aux"][off : off + ln]), self._cast(a["hidden"][off : off + ln])


def complete_meta(root: Path) -> dict | None:
    """The `meta.json` of a feature folder whose extraction finished, else None."""
    path = Path(root) / "meta.json"
    if not path.exists():
        return None
    meta = json.loads(path.read_text())
    return meta if meta.get("complete") else None


class ConcatStore:
    """Several FeatureStores of one target read as one (document indices run through them in order)."""

    def __init__(self, stores: Sequence[FeatureStore]):
        first = stores[0].meta
        for st in stores[1:]:
            for key in ("aux_dim", "hidden_dim", "target"):
                if st.meta.get(key) != first.get(key):
                    raise ValueError(f"feature shards {st.root} have {key}={st.meta.get(key)!r} but "
                                     f"{stores[0].root} has {first.get(key)!r}; they come from different targets")
        self.stores = list(stores)
        self.meta = first
        self.index = [(k, i) for k, st in enumerate(self.stores) for i in range(len(st))]

    def __len__(self):
        return len(self.index)

    def lengths(self) -> list[int]:
        return [n for st in self.stores for n in st.lengths()]

    def get(self, i: int, with_features: bool = True):
        k, j = self.index[i]
        return self.stores[k].get(j, with_features)


def open_train_store(cfg: TrainConfig, own: Path, limit: int | None = None) -> FeatureStore | ConcatStore:
    """This config's training shards (the first `limit` documents) plus any
    `data.extra_train_features` folders."""
    extra = []
    for p in cfg.data.extra_train_features:
        root = Path(p)
        if complete_meta(root) is None:
            raise FileNotFoundError(f"data.extra_train_features: {root} holds no complete feature shards "
                                    "(run python -m peagle_jax.train.features with that features_dir first)")
        extra.append(FeatureStore(root))
    own_store = FeatureStore(own, limit)
    return ConcatStore([own_store] + extra) if extra else own_store


def _write_shard(root: Path, idx: int, first_doc: int, docs: list[Doc], aux: list, hid: list, dtype: str):
    name = f"shard_{idx:05d}"
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lens = [len(d.tokens) for d in docs]
    offs = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    npdt = _DTYPES[dtype]

    def conv(x):
        x = np.concatenate(x).astype(npdt)
        return x.view(np.uint16) if dtype == "bfloat16" else x

    np.save(tmp / "tokens.npy", np.concatenate([d.tokens for d in docs]).astype(np.int32))
    np.save(tmp / "mask.npy", np.concatenate([d.loss_mask for d in docs]).astype(np.uint8))
    np.save(tmp / "aux.npy", conv(aux))
    np.save(tmp / "hidden.npy", conv(hid))
    np.save(tmp / "docs.npy", np.stack([offs, np.asarray(lens, np.int64)], axis=1))
    (tmp / "shard.json").write_text(json.dumps({"first_doc": first_doc, "num_docs": len(docs),
                                                "names": [d.name for d in docs]}))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    os.rename(tmp, root / name)
    return name


def extract_to_disk(cfg: TrainConfig, split: str, target, docs: list[Doc], log=print) -> Path:
    """Write features of `docs` to <features_dir>/<split>; resumes at the first missing shard."""
    root = cfg.features_dir / split
    root.mkdir(parents=True, exist_ok=True)
    meta = complete_meta(root)
    if meta is not None and meta.get("num_docs") == len(docs):
        log(f"features {split}: complete ({len(docs)} docs)")
        return root
    done = []
    next_doc = 0
    for d in sorted(root.glob("shard_*")):
        info = json.loads((d / "shard.json").read_text())
        done.append(d.name)
        next_doc = info["first_doc"] + info["num_docs"]
    # process docs in index order, batched by similar length inside a window
    bs = cfg.data.extract_batch
    buf_docs, buf_aux, buf_hid = [], [], []
    shard_idx, first = len(done), next_doc
    t0, ntok = time.time(), 0
    i = next_doc
    while i < len(docs):
        window = docs[i : i + bs * _EXTRACT_WINDOW]
        order = sorted(range(len(window)), key=lambda j: len(window[j].tokens))
        features: list[tuple[np.ndarray, np.ndarray]] = [None] * len(window)  # type: ignore[list-item]
        for start in range(0, len(order), bs):
            rows = order[start : start + bs]
            arr = np.zeros((bs, _bucket(max(len(window[j].tokens) for j in rows))), np.int32)
            for r, j in enumerate(rows):
                arr[r, : len(window[j].tokens)] = window[j].tokens
            a, h = target_features(target, arr)
            for r, j in enumerate(rows):
                n = len(window[j].tokens)
                features[j] = (a[r, :n], h[r, :n])
        for d, (a, h) in zip(window, features, strict=True):
            buf_docs.append(d)
            buf_aux.append(a)
            buf_hid.append(h)
            ntok += len(d.tokens)
        i += len(window)
        if sum(len(d.tokens) for d in buf_docs) >= cfg.data.shard_tokens or i >= len(docs):
            done.append(_write_shard(root, shard_idx, first, buf_docs, buf_aux, buf_hid, cfg.data.feature_dtype))
            shard_idx += 1
            first = i
            buf_docs, buf_aux, buf_hid = [], [], []
            el = time.time() - t0
            log(f"features {split}: {i}/{len(docs)} docs, {ntok / max(el, 1e-9):.0f} tokens/s")
    meta = {
        "complete": True, "num_docs": len(docs), "shards": done, "dtype": cfg.data.feature_dtype,
        "aux_dim": int(target.config.hidden_size * len(target.config.eagle_aux_layer_ids)),
        "hidden_dim": int(target.config.hidden_size), "chunk_len": chunk_len(cfg),
        "source": cfg.data.source, "target": cfg.model.target if cfg.model.random_target is None else "random",
        "max_docs": cfg.data.max_docs,  # None: every document of the source
    }
    tmp = root / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, root / "meta.json")
    return root


def ensure_features(cfg: TrainConfig, target=None, tokenizer=None, eos_ids=(), log=print
                    ) -> tuple[dict[str, Path], dict[str, int | None]]:
    """The feature folders of both splits, extracted where missing, and how many of their
    documents this run reads (None: all). Features extracted without `data.max_docs` serve any
    capped run (a learning curve extracts once); a capped extraction is extended when a later
    run reads more."""
    out, limits = {}, {}
    extractor = None
    for split in ("train", "val"):
        root = cfg.features_dir / split
        meta = complete_meta(root)
        limits[split] = None
        if meta is not None and meta.get("max_docs") is None and cfg.data.max_docs is None:
            out[split] = root
            continue
        if target is None:
            target, tokenizer, eos_ids, _ = load_target_and_tokenizer(cfg)
        docs = load_documents(cfg, split, target, tokenizer, eos_ids, log=log)
        if cfg.data.max_docs is not None:
            limits[split] = len(docs)
        if meta is not None and (meta.get("max_docs") is None or meta["num_docs"] >= len(docs)):
            out[split] = root
            continue
        log(f"{split}: {len(docs)} documents, {sum(len(d.tokens) for d in docs)} tokens")
        extractor = extractor or extraction_target(cfg, target, log)
        out[split] = extract_to_disk(cfg, split, extractor, docs, log=log)
    return out, limits


def extraction_target(cfg: TrainConfig, target, log=print):
    """The target that computes the features: on a CPU in bf16, the one `peagle_jax.load`
    configures (bf16 weights through the row-invariant CPU kernels, AMX tiles where the CPU has
    them, the layers under a scan; XLA:CPU's own bf16 matmuls are slow, docs/cpu-kernels.md).
    Anywhere else, and for random targets, `target` itself."""
    if cfg.model.random_target is not None or cfg.model.dtype != "bfloat16" or jax.default_backend() != "cpu":
        return target
    from peagle_jax.api import load

    llm = load(cfg.model.target, method="none", dtype="bfloat16", target_weights="bf16")
    log(f"features computed with load()'s target: {llm.options}")
    return llm.target


def main(argv=None):
    cfg = config_from_argv(sys.argv[1:] if argv is None else argv)
    try:
        ensure_features(cfg)
    except FileNotFoundError as e:  # data the config names (the message says which)
        raise SystemExit(f"features: {e}") from None


if __name__ == "__main__":
    main()
