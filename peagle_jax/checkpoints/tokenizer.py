"""Tokenizers for target models: from a Hugging Face directory or rebuilt from GGUF metadata.

A GGUF file has no ``tokenizer.json``; it stores the vocabulary, merges, token types, special token
ids, the pre-tokenizer *name* and the chat template as metadata (llama.cpp key names).  For the
byte-level BPE vocabularies we need (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Qwen2/2.5,
Llama 3) we rebuild an equivalent ``tokenizers.Tokenizer`` directly and wrap it in a
``transformers.PreTrainedTokenizerFast`` so ``encode``/``decode``/``apply_chat_template`` work.

This mirrors transformers' own GGUF tokenizer conversion
(``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, ``transformers/integrations/gguf``) with
two deliberate differences, both towards the model's original ``tokenizer.json`` (and llama.cpp):

* ``smollm`` pre-tokenizer: ``Digits(individual_digits=True)`` before the GPT-2 byte-level split
  (SmolLM2's tokenizer.json; llama.cpp's ``smollm`` regexes ``\\p{N}`` then GPT-2).  transformers'
  loader uses the plain GPT-2 split.  The ids agree for ASCII digits and for any numeric character
  not preceded by a space (SmolLM2's vocabulary has no multi-character token containing a numeric
  character); they differ for a space followed by a non-ASCII numeric character such as " ²",
  " ½", " ①" or " ١": we give "Ġ" + "Â²" (as llama.cpp), transformers "ĠÂ" + "²".
* qwen2-family pre-tokenizers: an ``NFC`` normalizer, as in Qwen2's tokenizer.json.  transformers'
  GGUF loader does not normalise (nor, to our knowledge, llama.cpp); the difference shows only on non-NFC input
  (e.g. decomposed accents).

Metadata is read with a small ``struct`` parser (:func:`read_gguf_metadata`) rather than
``gguf.GGUFReader``, which takes ~2 s for SmolLM2's vocabulary and ~3x that for Qwen's; the test
suite checks both readers agree, and ``gguf.GGUFReader`` is the fallback for files the parser does
not handle (big-endian, GGUF v1).

No BOS token is added unless the metadata sets ``tokenizer.ggml.add_bos_token`` (same for EOS with
``tokenizer.ggml.add_eos_token``) -- transformers' loader does the same for ``gpt2`` vocabularies
(it defaults BOS on only for sentencepiece ``llama`` vocabularies, which we do not support).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "QWEN2_PATTERN",
    "LLAMA3_PATTERN",
    "GGUFTokenizerData",
    "read_gguf_metadata",
    "read_gguf_tokenizer_data",
    "build_gguf_tokenizer",
    "load_tokenizer",
    "eos_token_ids",
    "STOP_TOKEN_STRINGS",
]

#: Qwen2 pre-tokenizer split regex (Qwen2's tokenizer.json; llama.cpp ``qwen2``).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: Llama 3 pre-tokenizer split regex (llama.cpp ``llama-bpe``).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` values -> pre-tokenizer family.
_PRE_FAMILIES = {
    "smollm": "smollm",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "gpt2": "gpt2",
    "gpt-2": "gpt2",
    "default": "gpt2",
}

# llama.cpp token types.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

#: Token strings that end generation when present in the vocabulary (see :func:`eos_token_ids`).
STOP_TOKEN_STRINGS = ("<|im_end|>", "<|endoftext|>")


# --------------------------------------------------------------------------------------------
# GGUF metadata
# --------------------------------------------------------------------------------------------


@dataclass
class GGUFTokenizerData:
    """Tokenizer-related metadata of a GGUF file (llama.cpp key names in comments)."""

    architecture: str | None  # general.architecture
    model: str | None  # tokenizer.ggml.model
    pre: str | None  # tokenizer.ggml.pre
    tokens: list[str]  # tokenizer.ggml.tokens
    token_types: np.ndarray | None  # tokenizer.ggml.token_type
    merges: list[str] | None  # tokenizer.ggml.merges
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    eot_token_id: int | None = None
    eom_token_id: int | None = None
    padding_token_id: int | None = None
    unknown_token_id: int | None = None
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    chat_template: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# GGUF metadata value types (gguf.GGUFValueType) -> struct format of fixed-size scalars.
_GGUF_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: str | os.PathLike, keys: Container[str] | None = None) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (v2/v3, little-endian), without its tensors.

    Scalars come back as Python values, strings as ``str``, string arrays as ``list[str]`` and
    numeric arrays as 1-D numpy arrays.  With ``keys``, only those keys are decoded (the others are
    skipped over cheaply).

    This is a small ``struct``-based parser: ``gguf.GGUFReader`` builds a numpy memmap view per
    array element, which costs ~2 s for SmolLM2's 49k-token vocabulary and ~6 s for Qwen2.5's
    152k; this takes a fraction of that.  Files it cannot parse (big-endian, GGUF v1) are read with
    ``gguf.GGUFReader`` instead (:func:`_read_gguf_metadata_gguf_reader`).
    """
    path = os.fspath(path)
    try:
        return _read_gguf_metadata_fast(path, keys)
    except _UnsupportedGGUF:
        return _read_gguf_metadata_gguf_reader(path, keys)


class _UnsupportedGGUF(Exception):
    pass


def _read_gguf_metadata_fast(path: str, keys: Container[str] | None) -> dict[str, Any]:
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ValueError(f"{path!r} is not a GGUF file (bad magic)")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            (version,) = struct.unpack_from("<I", buf, 4)
            if version not in (2, 3):
                raise _UnsupportedGGUF(version)
            _n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
            pos = 24
            unpack = struct.unpack_from

            def read_str(pos: int) -> tuple[str, int]:
                (n,) = unpack("<Q", buf, pos)
                pos += 8
                return buf[pos : pos + n].decode("utf-8"), pos + n

            out: dict[str, Any] = {}
            for _ in range(n_kv):
                key, pos = read_str(pos)
                (vtype,) = unpack("<I", buf, pos)
                pos += 4
                want = keys is None or key in keys
                if vtype in _GGUF_SCALAR:
                    fmt = "<" + _GGUF_SCALAR[vtype]
                    if want:
                        (out[key],) = unpack(fmt, buf, pos)
                    pos += struct.calcsize(fmt)
                elif vtype == _GGUF_STRING:
                    value, pos = read_str(pos)
                    if want:
                        out[key] = value
                elif vtype == _GGUF_ARRAY:
                    etype, count = unpack("<IQ", buf, pos)
                    pos += 12
                    if etype in _GGUF_SCALAR:
                        dt = np.dtype("<" + _GGUF_SCALAR[etype])
                        if want:
                            out[key] = np.frombuffer(buf, dtype=dt, count=count, offset=pos).copy()
                        pos += dt.itemsize * count
                    elif etype == _GGUF_STRING:
                        values = [] if want else None
                        for _ in range(count):
                            (n,) = unpack("<Q", buf, pos)
                            pos += 8
                            if values is not None:
                                values.append(buf[pos : pos + n].decode("utf-8"))
                            pos += n
                        if want:
                            out[key] = values
                    else:  # nested arrays: not used by tokenizer metadata
                        raise _UnsupportedGGUF(f"array of type {etype}")
                else:
                    raise ValueError(f"{path!r}: unknown GGUF metadata value type {vtype} for key {key!r}")
            return out


def _read_gguf_metadata_gguf_reader(path: str, keys: Container[str] | None) -> dict[str, Any]:
    """Same as :func:`read_gguf_metadata`, through ``gguf.GGUFReader`` (slow on big vocabularies)."""
    import gguf

    reader = gguf.GGUFReader(path, "r")
    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if (keys is not None and key not in keys) or not f.types or key.startswith("GGUF."):
            continue  # "GGUF.*" are the reader's header pseudo-fields, not metadata
        main = f.types[0]
        if main == gguf.GGUFValueType.ARRAY:
            sub = f.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                out[key] = [f.parts[i].tobytes().decode("utf-8") for i in f.data]
            elif len(f.types) == 2:
                out[key] = (
                    np.concatenate([f.parts[i] for i in f.data]) if f.data else np.zeros((0,), np.int64)
                )
        elif main == gguf.GGUFValueType.STRING:
            out[key] = f.parts[f.data[0]].tobytes().decode("utf-8")
        else:
            value = f.parts[f.data[0]].tolist()[0]
            out[key] = bool(value) if main == gguf.GGUFValueType.BOOL else value
    return out


_TOKENIZER_KEYS = frozenset(
    {
        "general.architecture",
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_eos_token",
        "tokenizer.chat_template",
    }
)


def read_gguf_tokenizer_data(path: str | os.PathLike) -> GGUFTokenizerData:
    """Read the tokenizer metadata of a GGUF file."""
    meta = read_gguf_metadata(path, _TOKENIZER_KEYS)
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{os.fspath(path)!r} has no tokenizer.ggml.tokens; it carries no tokenizer")

    def tid(key):
        v = meta.get(f"tokenizer.ggml.{key}")
        return None if v is None else int(v)

    def flag(key):
        v = meta.get(f"tokenizer.ggml.{key}")
        return None if v is None else bool(v)

    types = meta.get("tokenizer.ggml.token_type")
    return GGUFTokenizerData(
        architecture=meta.get("general.architecture"),
        model=meta.get("tokenizer.ggml.model"),
        pre=meta.get("tokenizer.ggml.pre"),
        tokens=tokens,
        token_types=None if types is None else np.asarray(types),
        merges=meta.get("tokenizer.ggml.merges"),
        bos_token_id=tid("bos_token_id"),
        eos_token_id=tid("eos_token_id"),
        eot_token_id=tid("eot_token_id"),
        eom_token_id=tid("eom_token_id"),
        padding_token_id=tid("padding_token_id"),
        unknown_token_id=tid("unknown_token_id"),
        add_bos_token=flag("add_bos_token"),
        add_eos_token=flag("add_eos_token"),
        chat_template=meta.get("tokenizer.chat_template"),
    )


# --------------------------------------------------------------------------------------------
# Building the tokenizer
# --------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character table (as in transformers / tokenizers)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _split_merge(merge: str) -> tuple[str, str]:
    # Like llama.cpp: the separating space is searched from index 1, so a first part that is
    # itself a single space still works.  Byte-level tokens never contain a real space otherwise.
    pos = merge.find(" ", 1)
    if pos < 0:
        raise ValueError(f"Malformed GGUF merge {merge!r}")
    return merge[:pos], merge[pos + 1 :]


def _pre_tokenizer(pre: str | None):
    from tokenizers import Regex, normalizers, pre_tokenizers

    family = _PRE_FAMILIES.get(pre or "")
    if family is None:
        raise ValueError(
            f"Unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; supported: {sorted(_PRE_FAMILIES)}"
        )
    normalizer = None
    if family == "smollm":
        pre_tok = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif family in ("qwen2", "llama3"):
        pattern = QWEN2_PATTERN if family == "qwen2" else LLAMA3_PATTERN
        pre_tok = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        if family == "qwen2":
            normalizer = normalizers.NFC()
    else:  # gpt2
        pre_tok = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return normalizer, pre_tok


def _check_byte_level_bpe(data: GGUFTokenizerData) -> None:
    """Only byte-level BPE ('gpt2') GGUF vocabularies, with merges, can be rebuilt here."""
    if data.model != "gpt2":
        raise ValueError(
            f"Unsupported GGUF tokenizer model tokenizer.ggml.model={data.model!r}; only byte-level BPE "
            f"('gpt2') vocabularies are supported"
        )
    if not data.merges:
        raise ValueError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")


def _byte_level_vocab(tokens: Sequence[str]) -> dict[str, int]:
    """token -> id, every token spelled in GPT-2's byte alphabet.

    Every real token of a byte-level vocabulary is spelled in that alphabet; a token that is not
    (a llama.cpp mislabel) is respelled into it, as transformers does.
    """
    b2u = _bytes_to_unicode()
    alphabet = frozenset(b2u.values())
    vocab: dict[str, int] = {}
    for idx, tok in enumerate(tokens):
        if not alphabet.issuperset(tok):
            tok = "".join(b2u[b] for b in tok.encode("utf-8"))
        vocab[tok] = idx
    return vocab


def _add_typed_tokens(tk, data: GGUFTokenizerData, vocab: dict[str, int]) -> None:
    """Control tokens -> special added tokens (kept whole, skipped by skip_special_tokens);
    user-defined tokens -> plain added tokens (kept whole)."""
    from tokenizers import AddedToken

    types = data.token_types
    if types is None or not len(types):
        return
    alphabet = frozenset(_bytes_to_unicode().values())
    control = [
        AddedToken(data.tokens[i], normalized=False, special=True)
        for i in np.flatnonzero(types == _TOKEN_TYPE_CONTROL)
        if alphabet.issuperset(data.tokens[i])
    ]
    if control:
        tk.add_special_tokens(control)
    user = [
        AddedToken(data.tokens[i], normalized=False, special=False)
        for i in np.flatnonzero(types == _TOKEN_TYPE_USER_DEFINED)
        if data.tokens[i] in vocab
    ]
    if user:
        tk.add_tokens(user)


def _token_name(data: GGUFTokenizerData, token_id: int | None) -> str | None:
    if token_id is None or not 0 <= token_id < len(data.tokens):
        return None
    return data.tokens[token_id]


def _bos_eos_template(data: GGUFTokenizerData, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool):
    """The post-processor that adds BOS / EOS around single sequences and pairs, as the GGUF flags ask."""
    from tokenizers import processors

    single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
    pair = single + " " + " ".join(([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else []))
    specials = ([(bos, data.bos_token_id)] if add_bos else []) + ([(eos, data.eos_token_id)] if add_eos else [])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _fast_tokenizer(tk, data: GGUFTokenizerData, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool):
    """Wrap the `tokenizers.Tokenizer` as a ``PreTrainedTokenizerFast`` with its special tokens and chat template."""
    from transformers import PreTrainedTokenizerFast

    kwargs: dict[str, Any] = dict(
        tokenizer_object=tk,
        bos_token=bos,
        eos_token=eos,
        pad_token=_token_name(data, data.padding_token_id),
        unk_token=_token_name(data, data.unknown_token_id),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        clean_up_tokenization_spaces=False,
    )
    if data.chat_template is not None:
        kwargs["chat_template"] = data.chat_template
    tokenizer = PreTrainedTokenizerFast(**{k: v for k, v in kwargs.items() if v is not None})
    if data.chat_template is not None:
        tokenizer.chat_template = data.chat_template
    return tokenizer


def build_gguf_tokenizer(data: GGUFTokenizerData):
    """Build a ``PreTrainedTokenizerFast`` from :class:`GGUFTokenizerData`."""
    from tokenizers import Tokenizer, decoders, models

    _check_byte_level_bpe(data)
    normalizer, pre_tok = _pre_tokenizer(data.pre)
    vocab = _byte_level_vocab(data.tokens)
    merges = [_split_merge(m) for m in data.merges]

    bpe = models.BPE(
        vocab=vocab,
        merges=merges,
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    tk = Tokenizer(bpe)
    if normalizer is not None:
        tk.normalizer = normalizer
    tk.pre_tokenizer = pre_tok
    tk.decoder = decoders.ByteLevel()
    _add_typed_tokens(tk, data, vocab)

    bos, eos = _token_name(data, data.bos_token_id), _token_name(data, data.eos_token_id)
    add_bos = bool(data.add_bos_token) and bos is not None
    add_eos = bool(data.add_eos_token) and eos is not None
    tk.post_processor = _bos_eos_template(data, bos, eos, add_bos, add_eos)
    return _fast_tokenizer(tk, data, bos, eos, add_bos, add_eos)


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def load_tokenizer(source: str | os.PathLike):
    """Load the tokenizer of a model.

    ``source`` is a ``.gguf`` file (tokenizer rebuilt from its metadata, see module docstring) or
    a Hugging Face model directory (``AutoTokenizer.from_pretrained(dir, local_files_only=True)``).
    Returns a ``transformers.PreTrainedTokenizerFast``.
    """
    path = Path(os.fspath(source)).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"Tokenizer source {str(path)!r} does not exist")
    if path.is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"Tokenizer source {str(path)!r} is neither a .gguf file nor a model directory")
    return build_gguf_tokenizer(read_gguf_tokenizer_data(path))


def _ids_from_value(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (int, np.integer)):
        return [int(value)]
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [int(v) for v in value if v is not None]
    return []


def _ids_from_hf_dir(path: Path) -> list[int]:
    out: list[int] = []
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            with open(f, encoding="utf-8") as fh:
                cfg = json.load(fh)
            out += _ids_from_value(cfg.get("eos_token_id"))
            text_cfg = cfg.get("text_config")
            if isinstance(text_cfg, Mapping):
                out += _ids_from_value(text_cfg.get("eos_token_id"))
    return out


def _config_ids(gguf_or_config) -> list[int]:
    if gguf_or_config is None:
        return []
    if isinstance(gguf_or_config, GGUFTokenizerData):
        d = gguf_or_config
        return [i for i in (d.eos_token_id, d.eot_token_id, d.eom_token_id) if i is not None]
    if isinstance(gguf_or_config, Mapping):
        return _ids_from_value(gguf_or_config.get("eos_token_id"))
    if isinstance(gguf_or_config, (str, os.PathLike)):
        path = Path(os.fspath(gguf_or_config)).expanduser()
        if path.is_dir():
            return _ids_from_hf_dir(path)
        if path.suffix.lower() == ".gguf":
            return _config_ids(read_gguf_tokenizer_data(path))
        if path.suffix.lower() == ".json":
            with open(path, encoding="utf-8") as fh:
                return _ids_from_value(json.load(fh).get("eos_token_id"))
        raise ValueError(f"Cannot read eos token ids from {str(path)!r}")
    # A transformers PretrainedConfig / GenerationConfig or anything with `eos_token_id`.
    return _ids_from_value(getattr(gguf_or_config, "eos_token_id", None))


def eos_token_ids(tokenizer, gguf_or_config=None) -> list[int]:
    """The token ids that end generation.

    Rule, in this order, duplicates dropped, out-of-vocabulary ids dropped:

    1. ``tokenizer.eos_token_id`` (for our GGUF tokenizers: ``tokenizer.ggml.eos_token_id``);
    2. ids declared by ``gguf_or_config`` when given: for a ``.gguf`` path (or
       :class:`GGUFTokenizerData`) its ``eos``/``eot``/``eom`` token ids; for a Hugging Face model
       directory the ``eos_token_id`` (int or list) of ``generation_config.json`` and
       ``config.json``; for a ``.json`` path, a mapping or a config object its ``eos_token_id``;
    3. ``<|im_end|>`` and ``<|endoftext|>`` when they are single tokens of the vocabulary: chat
       models in the ChatML family (SmolLM2, Qwen2.5) end a turn with ``<|im_end|>`` and a document
       with ``<|endoftext|>``, and their generation configs stop on both.

    The result is never empty unless the tokenizer has none of these.
    """
    vocab_size = len(tokenizer)
    out: list[int] = []

    def add(i):
        if i is not None and 0 <= int(i) < vocab_size and int(i) not in out:
            out.append(int(i))

    add(tokenizer.eos_token_id)
    for i in _config_ids(gguf_or_config):
        add(i)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        lookup = backend.token_to_id  # None when absent
    else:
        lookup = tokenizer.get_vocab().get
    for s in STOP_TOKEN_STRINGS:
        add(lookup(s))
    return out
