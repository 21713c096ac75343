"""Peer baseline: Hugging Face transformers (PyTorch, CPU) greedy decoding on the same weights.

Three peers, all batch 1, all greedy, same prompts / token budget / EOS ids as ours:
  hf_greedy         plain `generate`
  hf_prompt_lookup  prompt-lookup decoding (`prompt_lookup_num_tokens=N`): n-gram drafts copied
                    from the prompt, no draft model
  hf_assisted       assisted decoding with a smaller draft model (`assistant_model=`). It needs an
                    assistant that shares the target's tokenizer. No smaller SmolLM2 than the 135M
                    target is available offline, so it runs only when `--assistant PATH` is given
                    (a .gguf file or an HF directory); otherwise it is skipped and the report says so.
HF's assisted/prompt-lookup generation supports batch size 1 only, so the peers run at batch 1.

Run inside the offline report: `.venv/bin/python -m benchmarks.offline --hf-peer ...` (see
offline.py). Standalone, on HumanEval:

  .venv/bin/python -m benchmarks.peer_hf [--limit 4] [--max-new-tokens 64] [--assistant PATH]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

PEER_METHODS = ("hf_greedy", "hf_prompt_lookup", "hf_assisted")


def load_hf(path: str | Path):
    """AutoModelForCausalLM from a .gguf file (dequantised, float32) or an HF directory."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
    return model.eval()


class HFPeer:
    """Runs the HF peers on one prompt at a time; EOS handling matches `speculative_generate`.

    eos_ids: the ids that stop generation (ours: `eos_token_ids(tokenizer, path)`); empty = never
    stop (ours: `eos_token_ids=[]`), so both sides produce exactly max_new_tokens tokens.
    """

    def __init__(self, model_path: str | Path, eos_ids: list[int], pad_id: int | None, *,
                 prompt_lookup_tokens: int = 10, assistant: str | Path | None = None,
                 torch_threads: int | None = None):
        import torch

        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.torch_threads = torch.get_num_threads()

        self.torch = torch
        self.model = load_hf(model_path)
        gc = self.model.generation_config
        gc.eos_token_id = list(eos_ids) if eos_ids else None
        gc.pad_token_id = pad_id if pad_id is not None else (eos_ids[0] if eos_ids else 0)
        gc.do_sample = False
        for k in ("temperature", "top_p", "top_k"):  # silence "sampling flag set" warnings
            if hasattr(gc, k):
                setattr(gc, k, None)
        self.eos_ids = list(eos_ids)
        self.prompt_lookup_tokens = prompt_lookup_tokens
        self.assistant = None
        if assistant:
            self.assistant = load_hf(assistant)
            self.assistant.generation_config.eos_token_id = gc.eos_token_id
            self.assistant.generation_config.pad_token_id = gc.pad_token_id
        self.methods = ["hf_greedy", "hf_prompt_lookup"] + (["hf_assisted"] if self.assistant is not None else [])
        self.skipped = {} if self.assistant is not None else {
            "hf_assisted": "no assistant model: no SmolLM2 smaller than the 135M target is available offline; "
                           "pass --assistant PATH (same tokenizer) to run assisted decoding"}

    def _kwargs(self, method: str) -> dict[str, Any]:
        if method == "hf_greedy":
            return {}
        if method == "hf_prompt_lookup":
            return dict(prompt_lookup_num_tokens=self.prompt_lookup_tokens)
        if method == "hf_assisted":
            return dict(assistant_model=self.assistant)
        raise ValueError(method)

    def generate(self, method: str, prompt: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        """(new tokens, EOS included when hit; seconds)."""
        torch = self.torch
        with torch.inference_mode():
            x = torch.tensor([prompt])
            attn = torch.ones_like(x)
            t0 = time.perf_counter()
            y = self.model.generate(x, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=False,
                                    **self._kwargs(method))
            dt = time.perf_counter() - t0
        out = y[0, len(prompt):].tolist()
        if self.eos_ids:  # generate pads nothing at batch 1, but be safe: cut after the first EOS
            for i, t in enumerate(out):
                if t in self.eos_ids:
                    out = out[: i + 1]
                    break
        return out, dt

    def warm_up(self, prompt: list[int]) -> None:
        for m in self.methods:
            self.generate(m, prompt, 4)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Standalone peer run on HumanEval prompts (the offline report embeds the same peers)."""
    from benchmarks import common
    from peagle_jax.checkpoints.default_model import resolve_model_path
    from peagle_jax.checkpoints.tokenizer import eos_token_ids, load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dataset", default="humaneval", choices=common.DATASETS)
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-lookup-tokens", type=int, default=10)
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch.set_num_threads for the HF peers (1 is much faster on a contended CPU)")
    ap.add_argument("--assistant", default=None)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--out", default="results/peer_hf")
    args = ap.parse_args(argv)
    path = resolve_model_path(args.model)
    tok = load_tokenizer(path)
    eos = [] if args.ignore_eos else eos_token_ids(tok, path)
    peer = HFPeer(path, eos, tok.pad_token_id, prompt_lookup_tokens=args.prompt_lookup_tokens,
                  assistant=args.assistant, torch_threads=args.torch_threads)
    items = common.load_prompts(args.dataset, limit=args.limit)
    prompts = [common.encode_prompt(tok, it) for it in items]
    peer.warm_up(prompts[0])
    rows = {m: dict(tokens=0, seconds=0.0) for m in peer.methods}
    outs = {m: [] for m in peer.methods}
    for p in prompts:
        for m in peer.methods:
            toks, dt = peer.generate(m, p, args.max_new_tokens)
            rows[m]["tokens"] += len(toks)
            rows[m]["seconds"] += dt
            outs[m].append(toks)
    for m, r in rows.items():
        r["tok_s"] = r["tokens"] / r["seconds"]
        r["identical_to_hf_greedy"] = outs[m] == outs["hf_greedy"]
        print(f"{m:18s} {r['tok_s']:7.2f} tok/s  ({r['tokens']} tokens)  same as greedy: {r['identical_to_hf_greedy']}")
    summary = dict(machine=common.machine_info(), model=str(path), dataset=args.dataset, prompts=len(prompts),
                   max_new_tokens=args.max_new_tokens, eos_ids=eos, torch_threads=peer.torch_threads,
                   results=rows, skipped=peer.skipped)
    out = Path(args.out)
    common.write_json(out / "peer_hf.json", summary)
    md = common.md_table(["method", "tok/s", "tokens", "same as hf_greedy"],
                         [[m, r["tok_s"], r["tokens"], r["identical_to_hf_greedy"]] for m, r in rows.items()])
    skipped = "".join(f"\n- {k} skipped: {v}" for k, v in peer.skipped.items())
    (out / "peer_hf.md").write_text(md + "\n" + skipped + "\n")
    return summary


if __name__ == "__main__":
    main()
