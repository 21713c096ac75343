"""Runs inside the speculators peer venv (never imported by peagle_jax): load a head we exported
in the speculators layout with the speculators package's own model class, run its forward on
inputs we saved, and write its logits.

  <peer venv>/bin/python benchmarks/peers/speculators/runner.py --head DIR --inputs IN.npz --out OUT.npz

IN.npz: hidden_states [T, A] (the target's concatenated feature taps), input_ids [T],
embed_tokens [V, H] (the target's embedding, which our export leaves out: speculators then
initialises it and expects the verifier's, see Eagle3DraftModel._keys_to_ignore_on_load_missing).
Optional mask_rows [T] (P-EAGLE heads): rows that get the model's mask token and mask_hidden.
OUT.npz: logits [T, Vd] of the first (non-TTT) drafting step, float32, and the package version.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    # from_pretrained ends by fetching the verifier's config and weights (embed_tokens, its
    # lm_head) from `speculators_config.verifier.name_or_path`, an HF hub id or directory. Our
    # export names none (the default target is a GGUF), and the one tensor that step would add
    # that we do not ship, embed_tokens, is set from IN.npz below.
    Eagle3DraftModel.load_verifier_weights = lambda self: None
    kind = json.loads((Path(a.head) / "config.json").read_text()).get("speculators_model_type")
    if kind == "peagle":
        from speculators.models.peagle import PEagleDraftModel as model_cls
        from speculators.models.peagle import PEagleSpeculatorConfig as config_cls
    else:
        model_cls, config_cls = Eagle3DraftModel, Eagle3SpeculatorConfig
    cfg = config_cls.from_pretrained(a.head)
    # Dense masks: the default flex-attention block masks are a GPU training path.
    cfg.transformer_layer_config._attn_implementation = "eager"  # noqa: SLF001
    model = model_cls.from_pretrained(a.head, config=cfg).float().eval()
    data = np.load(a.inputs)
    hidden = torch.from_numpy(data["hidden_states"])[None].float()
    ids = torch.from_numpy(data["input_ids"].astype(np.int64))[None]
    if "mask_rows" in data and data["mask_rows"].any():
        # P-EAGLE placeholder rows: the model's own mask token and learned mask_hidden, the
        # inputs its training forward gives every depth > 0 (PEagleDraftModel.forward).
        rows = torch.from_numpy(data["mask_rows"])[None]
        hidden = torch.where(rows[..., None], model.mask_hidden.detach().float(), hidden)
        ids = torch.where(rows, torch.tensor(model.mask_token_id), ids)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.from_numpy(data["embed_tokens"]))
    captured = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    t = ids.shape[1]
    with torch.no_grad():
        # The EAGLE-3 step (one drafter forward over the rows, causal): P-EAGLE's drafting pass
        # is the same forward over [pending rows | mask rows]; its own forward() is the COD
        # training objective, which samples and needs the verifier's last hidden states.
        Eagle3DraftModel.forward(model, hidden_states=hidden, input_ids=ids,
                                 document_ids=torch.zeros((1, t), dtype=torch.long),
                                 position_ids=torch.arange(t)[None], ttt_steps=1)
    version = importlib.metadata.version("speculators")
    np.savez(a.out, logits=captured[0][0].float().numpy(), version=np.asarray(version))


if __name__ == "__main__":
    main()
