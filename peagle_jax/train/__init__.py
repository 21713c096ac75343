"""Training pipeline for P-EAGLE and EAGLE-3 draft heads.

Modules:
  config    pydantic schema, YAML loading, `key=value` / `--key value` overrides
  data      corpora (stdlib code, chat JSONL, self-distillation), chat-template loss masks,
            deterministic splits/shuffles, packing with document ids
  features  target feature extraction (3 taps + final hidden), online or to disk shards
            (`python -m peagle_jax.train.features`)
  vocab     draft vocabulary (d2t / t2d) from token frequencies
  cod       COD sampling for P-EAGLE with static shapes
  objective training forwards (P-EAGLE flattened chains, EAGLE-3 TTT) and the KL loss
  train     the loop: AdamW + warmup/cosine, clipping, orbax checkpoints, data-parallel mesh,
            progress bar, JSONL metrics (`python -m peagle_jax.train.train`, or `python -m peagle_jax.train`)
  export    trained state -> AWS / speculators drafter checkpoints (`python -m peagle_jax.train.export`)
"""
