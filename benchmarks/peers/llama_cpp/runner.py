"""Runs inside the llama.cpp peer venv (benchmarks/peers/llama_cpp/setup.sh), driven by
benchmarks/peer_llama_cpp.py over JSON lines: the first stdin line sets the model up, each
later one is a job {"method", "prompt" (token ids), "max_new_tokens"}, answered on stdout by
{"tokens", "seconds"}. Two engines on the same GGUF file: plain greedy decoding, and greedy
decoding with llama.cpp's prompt lookup (`LlamaPromptLookupDecoding`). Standard library and
llama_cpp only: this file never imports peagle_jax.
"""

from __future__ import annotations

import json
import sys
import time

import llama_cpp
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    common = dict(model_path=spec["model"], n_ctx=spec["n_ctx"], n_threads=spec["threads"],
                  n_threads_batch=spec["threads"], n_batch=512, verbose=False)
    engines = {
        "llama_cpp_greedy": Llama(**common),
        "llama_cpp_prompt_lookup": Llama(**common, draft_model=LlamaPromptLookupDecoding(
            num_pred_tokens=spec["lookup_tokens"])),
    }
    eos = set(spec["eos_ids"])
    print(json.dumps({"ready": True, "version": llama_cpp.__version__}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        llm = engines[job["method"]]
        llm.reset()  # no prompt prefix reused from the previous job: every prompt is prefilled in full
        out: list[int] = []
        t0 = time.perf_counter()
        if job["max_new_tokens"] > 0:
            for tok in llm.generate(job["prompt"], temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
                out.append(int(tok))
                if tok in eos or len(out) >= job["max_new_tokens"]:
                    break
        print(json.dumps({"tokens": out, "seconds": time.perf_counter() - t0}), flush=True)


if __name__ == "__main__":
    main()
