"""Training loop: `python -m peagle_jax.train.train --config configs/train/peagle_smollm2.yaml [key=value ...]`.

* AdamW with linear warmup + cosine decay, global-norm clipping (optax).
* Trainable: fc, drafter layers, final norm, mask_hidden, and the embedding according to
  `drafter.train_embed` (none / mask_row / all). The lm_head is frozen: it is the target's
  lm_head restricted to the draft vocabulary, so it also gives the target logits.
* Data-parallel over a `jax.sharding.Mesh` with one `data` axis: batch rows are sharded,
  parameters and optimizer state replicated; the loss is a global count-normalised sum, so it
  does not depend on the number of devices. Multi-host: set JAX_COORDINATOR_ADDRESS,
  JAX_NUM_PROCESSES and JAX_PROCESS_ID (or PEAGLE_DISTRIBUTED=1 on SLURM / TPU pods; see
  peagle_jax.sharding.maybe_initialize_distributed) and
  start the same command on every host; each process builds only its own rows. With disk
  features, run `python -m peagle_jax.train.features` once first (on a shared filesystem) so the hosts
  do not extract concurrently.
* Orbax checkpoints every `checkpoint_every` steps (trainable params, optimizer state, step,
  config). Orbax writes a step into a temporary directory and renames it when complete, so a
  crash never leaves a corrupt latest checkpoint. Data order and COD/noise randomness are pure
  functions of (seed, step, row), so a resumed run continues exactly.
* Metrics: one JSON line per step in <run_dir>/metrics.jsonl (loss, per-depth accuracy and
  KL, learning rate, grad norm, tokens/s, positions/s); a tqdm progress bar.

Launch example (2 hosts, 8 GPUs each):
    # host 0
    JAX_COORDINATOR_ADDRESS=10.0.0.1:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 \
        python -m peagle_jax.train.train --config configs/train/peagle_smollm2.yaml batch_size=64
    # host 1: the same with JAX_PROCESS_ID=1
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import yaml
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from peagle_jax import kernels
from peagle_jax.drafters import DrafterConfig, create_drafter
from peagle_jax.models.layers import training_matmuls_on_cpu_kernel
from peagle_jax.sharding import maybe_initialize_distributed
from peagle_jax.train.cod import cod_sample
from peagle_jax.train.committed import (
    DRAFT_IDS,
    draft_ids_file,
    load_trainable,
    read_metrics,
    read_state_info,
    save_state,
)
from peagle_jax.train.config import TrainConfig, config_from_argv
from peagle_jax.train.data import PackPlan, pack_row, raw_row
from peagle_jax.train.features import (
    FeatureStore,
    ensure_features,
    load_documents,
    load_target_and_tokenizer,
    open_train_store,
)
from peagle_jax.train.objective import Rows, eagle3_loss, peagle_loss
from peagle_jax.train.shards import git_commit
from peagle_jax.train.vocab import draft_ids_from_counts, token_counts, vocab_maps, with_draft_vocabulary


def make_mesh(n: int) -> Mesh:
    devs = jax.devices()
    n = len(devs) if n in (-1, 0, None) else n
    if n > len(devs):
        raise ValueError(f"mesh_data={n} but only {len(devs)} devices")
    return Mesh(np.array(devs[:n]), ("data",))


def _key(path) -> str:
    return "/".join(str(p) for p in path)


def _unflat(flat: dict[str, jax.Array | np.ndarray]) -> dict:
    return unflatten_dict({tuple(int(p) if p.isdigit() else p for p in k.split("/")): v for k, v in flat.items()})


def split_params(drafter, train_embed: str, method: str):
    """(graphdef, trainable flat dict, frozen flat dict)."""
    graphdef, state = nnx.split(drafter)
    flat = {_key(k): v for k, v in flatten_dict(nnx.to_pure_dict(state)).items()}
    frozen_keys = {"lm_head", "d2t"}
    if train_embed != "all":
        frozen_keys.add("embed_tokens")
    trainable = {k: v for k, v in flat.items() if k not in frozen_keys}
    frozen = {k: v for k, v in flat.items() if k in frozen_keys}
    if method == "peagle" and train_embed == "mask_row":
        trainable["mask_embed"] = flat["embed_tokens"][drafter.config.mask_token_id]
    return graphdef, trainable, frozen


def merged_drafter(graphdef, trainable, frozen):
    flat = {k: v for k, v in {**frozen, **trainable}.items() if k != "mask_embed"}
    return nnx.merge(graphdef, _unflat(flat))


def export_drafter(graphdef, trainable, frozen):
    """A concrete Eagle3Drafter with the trained mask row written into embed_tokens."""
    d = merged_drafter(graphdef, jax.device_get(trainable), jax.device_get(frozen))
    if "mask_embed" in trainable:
        d.embed_tokens.set_value(jnp.asarray(d.embed_tokens[...]).at[d.config.mask_token_id].set(jnp.asarray(trainable["mask_embed"])))
    return d


def head_to_fine_tune(cfg: TrainConfig, target):
    """The head `drafter.init_from` names, in the target's dtype, checked against the config.

    Fine-tuning keeps the head's draft vocabulary, layers and mode, so a setting that asks for
    another shape is an error naming both values, never a silent override."""
    from peagle_jax.checkpoints.drafter_io import load_drafter

    head = load_drafter(cfg.drafter.init_from, target=target, dtype=target.config.dtype)
    hc, peagle = head.config, cfg.objective.method == "peagle"
    given = cfg.drafter.model_fields_set  # settings the config states (defaults defer to the head)
    clashes = [f"{name}: config {want}, head {have}" for name, want, have in (
        ("drafter.num_layers", cfg.drafter.num_layers if "num_layers" in given else None, hc.num_hidden_layers),
        ("drafter.draft_vocab_size", cfg.drafter.draft_vocab_size if cfg.drafter.init_vocab == "head" else None,
         hc.draft_vocab_size),
        ("drafter.mask_token_id", cfg.drafter.mask_token_id if peagle else None, hc.mask_token_id),
        ("objective.method", cfg.objective.method, "peagle" if hc.parallel_drafting else "eagle3"),
    ) if want is not None and want != have]
    if clashes:
        raise ValueError(f"drafter.init_from {cfg.drafter.init_from} does not match the config: " + "; ".join(clashes))
    return head


def head_draft_ids(head) -> np.ndarray:
    """The sorted target ids of a head's draft vocabulary (d2t holds target id minus draft id)."""
    d2t = np.asarray(head.d2t[...])
    return (np.arange(d2t.shape[0]) + d2t).astype(np.int64)


def build_drafter(cfg: TrainConfig, target, draft_ids: np.ndarray):
    if cfg.drafter.init_from is not None:
        head = head_to_fine_tune(cfg, target)
        if cfg.drafter.init_vocab == "data":
            return with_draft_vocabulary(head, target, draft_ids)
        if not np.array_equal(head_draft_ids(head), draft_ids):
            raise ValueError(f"drafter.init_from {cfg.drafter.init_from}: its draft vocabulary differs from "
                             "this run's draft_ids.npy (a run directory started from another head?)")
        return head
    tc = target.config
    peagle = cfg.objective.method == "peagle"
    mask_id = cfg.drafter.mask_token_id if cfg.drafter.mask_token_id is not None else tc.vocab_size - 1
    dc = DrafterConfig.for_target(
        tc, num_layers=cfg.drafter.num_layers, parallel_drafting=peagle, mask_token_id=mask_id if peagle else None,
        draft_vocab_size=int(draft_ids.shape[0]), num_depths=cfg.objective.num_depths,
    )
    d = create_drafter(dc, seed=cfg.drafter.init_seed)
    d.embed_tokens.set_value(jnp.asarray(target.embed_tokens[...], d.embed_tokens[...].dtype))
    d.lm_head.set_value(jnp.asarray(target.lm_head_weight()[:, draft_ids], d.lm_head[...].dtype))
    d2t, _ = vocab_maps(draft_ids, tc.vocab_size)
    d.d2t.set_value(jnp.asarray(d2t, jnp.int32))
    return d


def make_optimizer(cfg: TrainConfig, resume_step: int = 0):
    """(optimizer, learning rate at a global step). From a committed state (`resume_step` > 0,
    fresh moments) the schedule goes on where it was, under a re-warm-up of `warmup_steps`."""
    o = cfg.optim
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=max(o.warmup_steps, 1),
        decay_steps=max(o.total_steps, o.warmup_steps + 1), end_value=o.lr * o.min_lr_ratio,
    )
    if resume_step:
        def sched(step):
            return base(step) * jnp.clip((step - resume_step + 1) / max(o.warmup_steps, 1), 0.0, 1.0)
    else:
        sched = base
    tx = optax.chain(
        optax.clip_by_global_norm(o.clip_norm),
        # optax counts its own updates from 0: the global step is that count + resume_step
        optax.adamw(lambda count: sched(count + resume_step), b1=o.b1, b2=o.b2, weight_decay=o.weight_decay),
    )
    return tx, sched


def make_loss_fn(cfg: TrainConfig, graphdef):
    method = cfg.objective.method
    k = cfg.objective.num_depths

    def loss_fn(trainable, frozen, rows: Rows, key):
        if cfg.data.noise_std > 0:
            noise = jax.random.uniform(key, rows.aux.shape, jnp.float32, -cfg.data.noise_std, cfg.data.noise_std)
            rows = rows._replace(aux=rows.aux + noise.astype(rows.aux.dtype))
        drafter = merged_drafter(graphdef, trainable, frozen)
        if method == "peagle":
            if "mask_embed" in trainable:
                me = trainable["mask_embed"]
            else:
                me = drafter.embed_tokens[...][drafter.config.mask_token_id]
                if cfg.drafter.train_embed == "none":
                    me = jax.lax.stop_gradient(me)
            total, count, per = peagle_loss(drafter, rows, me, k)
        else:
            total, count, per = eagle3_loss(drafter, rows, cfg.objective.ttt_steps, cfg.objective.ttt_decay)
        return total / (count + 1e-5), per

    return loss_fn


# Documents a packed row holds when the target runs in the step: its raw input has room for
# seq_len + ONLINE_MAX_DOCS tokens (`data.raw_row`), 3% more than the elements at seq_len 512.
ONLINE_MAX_DOCS = 16


def online_rows(target_graphdef, target_state, raw: dict, rows: Rows) -> Rows:
    """Fill aux / target_hidden from a frozen target forward over the rows' raw documents
    (`data.RawRow` fields, batched): one forward over the packed row, each document attending
    only to itself (cache rows before its start are skipped) at positions from 0, so every
    element gets the features a forward over its document alone gives."""
    tgt = nnx.merge(target_graphdef, target_state)
    tokens = raw["tokens"]
    b, t = tokens.shape
    slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    out = tgt(tokens, raw["positions"], tgt.init_cache(b, t), return_aux=True, return_final_hidden=True,
              compute_logits=False, slots=slots, skip=(jnp.zeros_like(slots), raw["start"]))
    idx = raw["elem_index"][..., None]
    aux = jax.lax.stop_gradient(jnp.take_along_axis(out.aux_hidden, idx, axis=1))
    fh = jax.lax.stop_gradient(jnp.take_along_axis(out.final_hidden, idx + 1, axis=1))
    return rows._replace(aux=aux, target_hidden=fh)


def records_up_to(metrics: str, step: int) -> str:
    """The lines of a metrics.jsonl text whose step is at most `step` (a run resumed at `step`
    repeats the steps after it), blank lines dropped."""
    return "".join(line + "\n" for line in metrics.splitlines()
                   if line.strip() and json.loads(line).get("step", 0) <= step)


def step_matmuls_on_cpu_kernel(cfg: TrainConfig, devices: int) -> bool:
    """Whether the step's matrix products run on the CPU kernel (`TrainConfig.matmul`): asked
    for, or auto on a single CPU device whose kernel runs AMX tiles (2.4x XLA's float32 dot on
    a head's shapes, docs/cpu-kernels.md)."""
    if cfg.matmul == "xla":
        return False
    why = (f"the {jax.default_backend()} backend" if jax.default_backend() != "cpu" else
           f"{devices} devices (the kernel runs on one)" if devices != 1 else kernels.cpu.unavailable_reason())
    if cfg.matmul == "cpu_kernel" and why:
        raise ValueError(f"matmul=cpu_kernel cannot run here: {why}")
    return why is None and (cfg.matmul == "cpu_kernel" or kernels.cpu.instruction_set() == "amx")


class Trainer:
    def __init__(self, cfg: TrainConfig, log=print):
        maybe_initialize_distributed()
        self.cfg, self.log = cfg, log
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.mesh = make_mesh(cfg.mesh_data)
        ndata = self.mesh.devices.size
        if cfg.batch_size % ndata:
            raise ValueError(f"batch_size {cfg.batch_size} not divisible by {ndata} data devices")
        self.target, self.tokenizer, self.eos_ids, _ = load_target_and_tokenizer(cfg)
        tc = self.target.config
        self.aux_dim = tc.hidden_size * len(tc.eagle_aux_layer_ids)
        self.hid_dim = tc.hidden_size
        self.online = cfg.data.features == "online"
        if self.online:
            self.docs = {s: load_documents(cfg, s, self.target, self.tokenizer, self.eos_ids, log=log)
                         for s in ("train", "val")}
            lengths = [len(d.tokens) for d in self.docs["train"]]
            pairs = ((d.tokens, d.loss_mask) for d in self.docs["train"])
        else:
            paths, limits = ensure_features(cfg, self.target, self.tokenizer, self.eos_ids, log=log)
            self.stores = {"train": open_train_store(cfg, paths["train"], limits["train"]),
                           "val": FeatureStore(paths["val"], limits["val"])}
            st = self.stores["train"]
            lengths = st.lengths()
            pairs = (st.get(i, with_features=False)[:2] for i in range(len(st)))
        self.plan = PackPlan(lengths, cfg.data.seq_len, cfg.data.shuffle_seed,
                             max_docs=ONLINE_MAX_DOCS if self.online else None)
        self.ckpt = ocp.CheckpointManager(
            (self.run_dir / "checkpoints").absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints, create=True,
                                                 enable_async_checkpointing=False),
        )
        # No checkpoint here (a fresh machine): go on from the weights committed to the repository.
        committed = read_state_info(cfg.state_dir) if self.ckpt.latest_step() is None else None
        vocab_file = self.run_dir / "draft_ids.npy"
        if committed is not None and jax.process_index() == 0:  # the vocabulary the weights were trained with
            shutil.copyfile(draft_ids_file(cfg.state_dir), vocab_file)
        if vocab_file.exists():
            draft_ids = np.load(vocab_file)
        elif cfg.drafter.init_from is not None and cfg.drafter.init_vocab == "head":  # keep the head's vocabulary
            draft_ids = head_draft_ids(head_to_fine_tune(cfg, self.target))
            if jax.process_index() == 0:
                np.save(vocab_file, draft_ids)
        else:
            size = cfg.drafter.draft_vocab_size
            if cfg.drafter.init_from is not None and size is None:  # "data": the head's size, new tokens
                size = head_to_fine_tune(cfg, self.target).config.draft_vocab_size
            counts = token_counts(pairs, tc.vocab_size)
            draft_ids = draft_ids_from_counts(counts, size, always=self.eos_ids)
            if jax.process_index() == 0:
                np.save(vocab_file, draft_ids)
        self.draft_ids = draft_ids
        drafter = build_drafter(cfg, self.target, draft_ids)
        self.drafter_config = drafter.config
        self.graphdef, trainable, frozen = split_params(drafter, cfg.drafter.train_embed, cfg.objective.method)
        self.step = 0
        if committed is not None:
            self.step, trainable = load_trainable(cfg.state_dir, trainable)
            log(f"resumed from the committed state of step {self.step} ({cfg.state_dir}): fresh optimizer moments")
            carried = read_metrics(cfg.state_dir)
            mpath = self.run_dir / "metrics.jsonl"
            if carried is not None and not mpath.exists() and jax.process_index() == 0:  # the run's history so far
                mpath.write_text(records_up_to(carried, self.step))
        self.tx, self.sched = make_optimizer(cfg, self.step)
        rep = NamedSharding(self.mesh, P())
        self.rep, self.data_sharding = rep, NamedSharding(self.mesh, P("data"))
        self.trainable = jax.device_put(trainable, rep)
        self.frozen = jax.device_put(frozen, rep)
        self.opt_state = jax.device_put(self.tx.init(self.trainable), rep)
        if self.online:
            self.target_graphdef, tstate = nnx.split(self.target)
            self.target_state = jax.device_put(tstate, rep)
        else:
            self.target_graphdef, self.target_state = None, None
        if jax.process_index() == 0:
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
        self._restore()
        self._build_step()

    # ----------------------------------------------------------------- checkpoints

    def _restore(self):
        latest = self.ckpt.latest_step()
        if latest is None:
            return
        abstract = {"trainable": self.trainable, "opt_state": self.opt_state}
        out = self.ckpt.restore(latest, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        self.trainable, self.opt_state = out["state"]["trainable"], out["state"]["opt_state"]
        self.step = int(out["meta"]["step"])
        self.log(f"resumed from step {self.step} ({self.run_dir / 'checkpoints'})")
        mpath = self.run_dir / "metrics.jsonl"
        if mpath.exists() and jax.process_index() == 0:  # drop records past the checkpoint
            mpath.write_text(records_up_to(mpath.read_text(), self.step))

    def save(self):
        meta = {"step": self.step, "draft_vocab_size": int(self.draft_ids.shape[0]),
                "method": self.cfg.objective.method}
        self.ckpt.save(self.step, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"trainable": self.trainable, "opt_state": self.opt_state}),
            meta=ocp.args.JsonSave(meta)), force=True)
        self.ckpt.wait_until_finished()

    def save_state(self):
        """The trainable weights into the repository's `state_dir` (committed with `state_commit`)."""
        cfg = self.cfg
        if jax.process_index() != 0:
            return
        about = {"method": cfg.objective.method, "target": cfg.model.target, "num_layers": cfg.drafter.num_layers,
                 "draft_vocab_size": int(self.draft_ids.shape[0]), "total_steps": cfg.optim.total_steps}
        weights = {k: np.asarray(v) for k, v in jax.device_get(self.trainable).items()}
        mpath = self.run_dir / "metrics.jsonl"
        save_state(cfg.state_dir, self.step, weights, about, {DRAFT_IDS: np.asarray(self.draft_ids)},
                   metrics=mpath.read_text() if mpath.exists() else None)
        if cfg.state_commit:
            git_commit(Path(cfg.state_dir), f"train state: {Path(cfg.state_dir).name} step {self.step}")

    # ----------------------------------------------------------------- data

    def host_rows(self, step: int, split: str = "train") -> tuple[dict, int]:
        """This process's rows of the global batch of `step` (numpy)."""
        cfg = self.cfg
        b = cfg.batch_size
        nproc, pid = jax.process_count(), jax.process_index()
        local = b // nproc
        n = cfg.data.seq_len
        cols = {k: [] for k in ("tokens", "aux", "target_hidden", "positions", "doc", "loss_mask")}
        raws = []
        chains = []
        plan = self.plan if split == "train" else self._val_plan()
        for r in range(pid * local, (pid + 1) * local):
            gidx = step * b + r
            _, ids = plan.row(gidx)
            if self.online:
                src = self.docs[split]
                docs = [(src[i].tokens, src[i].loss_mask, None, None) for i in ids]
                t, lm, pos, doc, _, _ = pack_row(n, docs, 0, 0)
                raws.append(raw_row(n, [d[0] for d in docs], ONLINE_MAX_DOCS))
                aux = fh = None
            else:
                st = self.stores[split]
                t, lm, pos, doc, aux, fh = pack_row(n, [st.get(i) for i in ids], self.aux_dim, self.hid_dim)
            for k, v in (("tokens", t), ("aux", aux), ("target_hidden", fh), ("positions", pos), ("doc", doc),
                         ("loss_mask", lm)):
                cols[k].append(v)
            if cfg.objective.method == "peagle":
                o = cfg.objective
                rng = np.random.default_rng([cfg.seed, 17 if split == "train" else 23, step, r])
                chains.append(cod_sample(lm, doc, num_depths=o.num_depths, ratio=o.down_sample_ratio,
                                         ratio_min=o.down_sample_ratio_min, max_anchors=o.max_anchors, rng=rng))
        out = {k: np.stack(v) for k, v in cols.items() if v and v[0] is not None}
        if raws:
            out.update({f"raw_{f}": np.stack([getattr(r, f) for r in raws]) for f in raws[0]._fields})
        if chains:
            out["chain_anchor"] = np.stack([c.anchor for c in chains])
            out["chain_depth"] = np.stack([c.depth for c in chains])
            out["chain_valid"] = np.stack([c.valid for c in chains])
            out["chain_idx"] = np.stack([c.chain_idx for c in chains])
        return out, b

    def _val_plan(self):
        if not hasattr(self, "_vplan"):
            lengths = ([len(d.tokens) for d in self.docs["val"]] if self.online else self.stores["val"].lengths())
            self._vplan = PackPlan(lengths, self.cfg.data.seq_len, 0, max_docs=ONLINE_MAX_DOCS if self.online else None)
        return self._vplan

    def device_rows(self, host: dict, global_b: int):
        def put(x):
            if x is None:
                return None
            return jax.make_array_from_process_local_data(self.data_sharding, x, (global_b,) + x.shape[1:])

        arrs = {k: put(v) for k, v in host.items()}
        raw = {k[len("raw_"):]: arrs.pop(k) for k in list(arrs) if k.startswith("raw_")} or None
        rows = Rows(**{f: arrs.get(f) for f in Rows._fields})
        return rows, raw

    # ----------------------------------------------------------------- step

    def _build_step(self):
        loss_fn = make_loss_fn(self.cfg, self.graphdef)
        tx, tg = self.tx, self.target_graphdef
        seed = self.cfg.seed
        on_kernel = step_matmuls_on_cpu_kernel(self.cfg, self.mesh.devices.size)
        self.log(f"step matmuls: {'the CPU kernel (bf16 operands)' if on_kernel else 'XLA'}")
        products = training_matmuls_on_cpu_kernel if on_kernel else contextlib.nullcontext

        def prepare(rows, raw, target_state):
            if tg is not None:
                rows = online_rows(tg, target_state, raw, rows)
            return rows

        def train_step(trainable, opt_state, frozen, rows, raw, target_state, step):
            key = jax.random.fold_in(jax.random.key(seed), step)
            with products():
                rows = prepare(rows, raw, target_state)
                (loss, per), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, frozen, rows, key)
            updates, opt_state = tx.update(grads, opt_state, trainable)
            trainable = optax.apply_updates(trainable, updates)
            return trainable, opt_state, {"loss": loss, "per": per, "grad_norm": optax.global_norm(grads)}

        def eval_step(trainable, frozen, rows, raw, target_state):
            with products():
                rows = prepare(rows, raw, target_state)
                loss, per = loss_fn(trainable, frozen, rows, jax.random.key(0))
            return {"loss": loss, "per": per}

        self._train_step = jax.jit(train_step, donate_argnums=(0, 1))
        self._eval_step = jax.jit(eval_step)

    def train_one(self) -> dict:
        host, gb = self.host_rows(self.step)
        rows, raw = self.device_rows(host, gb)
        lr = float(self.sched(self.step))
        self.trainable, self.opt_state, m = self._train_step(
            self.trainable, self.opt_state, self.frozen, rows, raw, self.target_state, jnp.int32(self.step))
        self.step += 1
        per = np.asarray(m["per"])  # [D, 3] count, kl, hits
        rec = {"step": self.step, "loss": float(m["loss"]), "lr": lr, "grad_norm": float(m["grad_norm"])}
        rec["acc"] = [float(h / c) if c else None for c, _, h in per]
        rec["kl"] = [float(k / c) if c else None for c, k, _ in per]
        rec["count"] = [int(c) for c, _, _ in per]
        tok = float(np.sum(host["doc"] >= 0)) * jax.process_count()
        rec["tokens"] = tok
        chain = float(host["chain_valid"].sum()) * jax.process_count() if "chain_valid" in host else 0.0
        rec["positions"] = tok + chain
        return rec

    def evaluate(self, batches: int) -> dict:
        tot, per = [], None
        for i in range(batches):
            host, gb = self.host_rows(i, split="val")
            rows, raw = self.device_rows(host, gb)
            m = self._eval_step(self.trainable, self.frozen, rows, raw, self.target_state)
            tot.append(float(m["loss"]))
            p = np.asarray(m["per"])
            per = p if per is None else per + p
        return {"val_loss": float(np.mean(tot)), "val_acc": [float(h / c) if c else None for c, _, h in per]}

    def run(self) -> list[dict]:
        cfg = self.cfg
        last = cfg.optim.total_steps if cfg.max_steps is None else min(cfg.max_steps, cfg.optim.total_steps)
        records = []
        bar = None
        if cfg.progress and jax.process_index() == 0:
            from tqdm import tqdm

            bar = tqdm(total=last, initial=self.step, desc="train", dynamic_ncols=True)
        mpath = self.run_dir / "metrics.jsonl"
        while self.step < last:
            t0 = time.time()
            rec = self.train_one()
            dt = time.time() - t0
            rec["step_time"] = dt
            rec["tokens_per_s"] = rec["tokens"] / dt
            rec["positions_per_s"] = rec["positions"] / dt
            if cfg.eval_every and self.step % cfg.eval_every == 0:
                rec.update(self.evaluate(cfg.eval_batches))
            records.append(rec)
            if jax.process_index() == 0 and self.step % cfg.log_every == 0:
                with open(mpath, "a") as fh:
                    fh.write(json.dumps(rec) + "\n")
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", acc0=f"{rec['acc'][0] or 0:.2f}",
                                tok_s=f"{rec['tokens_per_s']:.0f}")
            if self.step % cfg.checkpoint_every == 0 or self.step == last:
                self.save()
            if cfg.state_dir and (self.step % (cfg.state_every or cfg.checkpoint_every) == 0 or self.step == last):
                self.save_state()
        if bar is not None:
            bar.close()
        return records

    def drafter(self):
        return export_drafter(self.graphdef, self.trainable, self.frozen)


def main(argv=None):
    cfg = config_from_argv(sys.argv[1:] if argv is None else argv)
    try:
        trainer = Trainer(cfg)
    except FileNotFoundError as e:  # data or a head the config names (the message says which)
        raise SystemExit(f"train: {e}") from None
    trainer.run()


if __name__ == "__main__":
    main()
