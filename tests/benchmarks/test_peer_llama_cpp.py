"""The llama.cpp peer (benchmarks/peer_llama_cpp.py) on the default model's GGUF file, and its
rows in the offline benchmark. Slow: it needs the peer venv (bash
benchmarks/peers/llama_cpp/setup.sh, about 10 minutes of compiling) and skips with the reason
without it."""

from __future__ import annotations

import pytest

from benchmarks import peer_llama_cpp

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The three primary colors are red, blue and"]


@pytest.fixture(scope="module")
def peer_env():
    reason = peer_llama_cpp.missing_reason()
    if reason:
        pytest.skip(reason)


def test_the_peer_decodes_the_same_file_plainly_and_with_prompt_lookup(peer_env):
    from peagle_jax.checkpoints.default_model import default_model_path
    from peagle_jax.checkpoints.tokenizer import load_tokenizer

    path = default_model_path()
    tok = load_tokenizer(path)
    peer = peer_llama_cpp.LlamaCppPeer(path, [], lookup_tokens=4, n_ctx=512)  # no EOS: every run is 24 tokens
    try:
        assert peer.version
        for text in PROMPTS:
            ids = tok.encode(text)
            plain, dt = peer.generate("llama_cpp_greedy", ids, 24)
            lookup, _ = peer.generate("llama_cpp_prompt_lookup", ids, 24)
            assert len(plain) == len(lookup) == 24 and dt > 0
            assert plain == peer.generate("llama_cpp_greedy", ids, 24)[0]  # greedy and no prefix carried over
            # The same model greedily: prompt lookup agrees with plain decoding on its first tokens at least.
            assert lookup[:4] == plain[:4], tok.decode(plain) + " | " + tok.decode(lookup)
        with pytest.raises(ValueError, match="unknown llama.cpp peer method"):
            peer.generate("llama_cpp_beam", ids, 4)
    finally:
        peer.close()


def test_offline_benchmark_has_llama_cpp_rows(peer_env, tmp_path):
    from benchmarks import offline

    summary = offline.main(["--methods", "none", "ngram", "--dataset", "humaneval", "--limit", "2", "--ks", "3",
                            "--batch-sizes", "1", "--max-new-tokens", "16", "--no-hf-peer", "--llama-cpp-peer",
                            "--out", str(tmp_path)])
    methods = {r["method"] for r in summary["results"]}
    assert {"llama_cpp_greedy", "llama_cpp_prompt_lookup", "none", "ngram"} <= methods
    assert summary["peer_versions"]["llama_cpp"]
    assert summary["exactness"]["ours_identical"]
    assert summary["exactness"]["llama_cpp_plain_identical_to_ours"] is not None
