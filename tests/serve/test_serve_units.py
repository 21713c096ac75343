"""Server pieces without a server: incremental detokenization, stop strings, config, CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from peagle_jax.serve.config import Mesh, ServeConfig, build_parser, config_from_args, parse_mesh
from peagle_jax.serve.detokenize import IncrementalDetokenizer, StopStrings


@pytest.fixture(scope="module")
def tok():
    from peagle_jax.checkpoints.default_model import default_model_path
    from peagle_jax.checkpoints.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


@pytest.mark.parametrize("text", ["héllo wörld", "数据 and 日本語のテキスト", "emoji 🎉🚀 mixed 👩‍👩‍👧", "plain ascii"])
def test_incremental_detokenizer_multibyte(tok, text):
    ids = tok.encode(text)
    single = [len(tok.decode([i])) for i in ids]
    det = IncrementalDetokenizer(lambda x: tok.decode(x, skip_special_tokens=True))
    deltas = [det.add([i]) for i in ids]
    deltas.append(det.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    if not text.isascii():  # the case that matters: some characters span several tokens
        assert any("\ufffd" in tok.decode([i]) for i in ids) or single


def test_detokenizer_skips_special_tokens_and_flushes_partial(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    det = IncrementalDetokenizer(lambda x: tok.decode(x, skip_special_tokens=True))
    out = det.add(tok.encode("Hi")) + det.add([im_end])
    assert out == "Hi"
    partial = tok.encode("🎉")[:1]  # first byte(s) of a 4-byte character
    assert det.add(partial) == ""
    assert det.flush() == tok.decode(partial)


def test_stop_strings_hold_back_and_truncate():
    s = StopStrings(["STOP", "\n\n"])
    assert s.add("hello ST") == "hello "  # "ST" might start "STOP"
    assert s.add("ay") == "STay"
    assert s.add(" now\n") == " now"
    assert s.add("\nrest") == "" and s.hit and s.text == "hello STay now"
    assert s.add("more") == ""
    s = StopStrings(["abc"])
    assert s.add("xxab") == "xx"
    assert s.flush() == "ab"  # end of generation releases the held-back tail
    s = StopStrings([])
    assert s.add("anything") == "anything" and not s.hit
    s = StopStrings(["b", "abc"])  # the earliest match wins
    assert s.add("xxabc") == "xx" and s.hit  # "abc" starts before "b"


def test_mesh_parsing():
    assert parse_mesh("data=2,model=4") == Mesh(data=2, model=4)
    assert parse_mesh(" model = 2 ") == Mesh(data=1, model=2)
    assert parse_mesh(None).size == 1
    assert str(parse_mesh("data=2")) == "data=2,model=1"
    for bad in ("data=0", "data=2,data=3", "pipeline=2", "data=two", "", "data=-1", "data=2;model=2"):
        with pytest.raises((ValueError, ValidationError)):
            ServeConfig(mesh=bad)


def test_config_yaml_and_flags(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("max_batch_size: 3\nport: 9000\nmesh: data=1,model=1\nmethod: none\n")
    args = build_parser().parse_args(["--config", str(y), "--port", "9100", "-k", "4"])
    c = config_from_args(args)
    assert (c.max_batch_size, c.port, c.num_draft_tokens, c.method) == (3, 9100, 4, "none")
    assert c.host == "127.0.0.1" and c.api_key is None
    c = config_from_args(build_parser().parse_args([]), env={"PEAGLE_API_KEY": "s3cret"})
    assert c.api_key == "s3cret" and c.warmup
    assert not config_from_args(build_parser().parse_args(["--no-warmup"])).warmup
    y.write_text("max_batch_sise: 3\n")
    with pytest.raises(ValidationError):
        config_from_args(build_parser().parse_args(["--config", str(y)]))
    with pytest.raises(ValidationError):
        ServeConfig(max_batch_size=0)
    with pytest.raises(ValidationError):
        ServeConfig(drafter="none", method="peagle")
    assert config_from_args(build_parser().parse_args(["--second-root", "--method", "peagle"])).experimental.second_root
    with pytest.raises(ValidationError, match="second_root applies to"):
        config_from_args(build_parser().parse_args(["--second-root", "--method", "peagle+ngram"]))
    assert config_from_args(build_parser().parse_args(["--draft-cutoff", "0.2"])).draft_cutoff == 0.2
    with pytest.raises(ValidationError, match="draft_cutoff applies to"):
        config_from_args(build_parser().parse_args(["--draft-cutoff", "0.2", "--method", "ngram"]))
    with pytest.raises(ValidationError, match="do not combine"):
        config_from_args(build_parser().parse_args(["--draft-cutoff", "0.2", "--second-root"]))
    with pytest.raises(ValidationError, match="draft_cutoff"):
        ServeConfig(draft_cutoff=1.0)
    assert config_from_args(build_parser().parse_args(["--draft-weights", "q7"])).draft_weights == "q7"
    assert config_from_args(build_parser().parse_args(["--draft-weights", "q4"])).draft_weights == "q4"
    assert config_from_args(build_parser().parse_args(["--draft-weights", "g4"])).draft_weights == "g4"
    assert ServeConfig().draft_weights == "auto"
    with pytest.raises(ValidationError, match="quantizes a draft head"):
        config_from_args(build_parser().parse_args(["--draft-weights", "q7", "--method", "ngram"]))
    with pytest.raises(ValidationError):
        ServeConfig(draft_weights="int4")


def test_shipped_configs_validate():
    from pathlib import Path

    files = sorted(Path(__file__).parents[2].joinpath("configs", "serve").glob("*.yaml"))
    assert files
    defaults = ServeConfig()
    named = {"model", "drafter", "method"}  # what a config serves; every other setting keeps its default
    for f in files:
        config = ServeConfig.from_yaml(f)
        for name in set(ServeConfig.model_fields) - named:
            assert getattr(config, name) == getattr(defaults, name), f"{f.name} sets {name} away from its default"


@pytest.mark.parametrize("argv,needle", [
    (["--mesh", "data=0"], "mesh"),
    (["--max-batch-size", "0"], "max_batch_size"),
    (["--prefill-chunk", "100"], "prefill_chunk 100 must be a prompt bucket"),
    (["--config", "/nonexistent/x.yaml"], "error"),
    (["--model", "/nonexistent/model.gguf", "--no-warmup"], "does not exist"),
])
def test_cli_rejects_bad_settings(argv, needle):
    r = subprocess.run([sys.executable, "-m", "peagle_jax.serve", *argv], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr


def test_cli_help():
    r = subprocess.run([sys.executable, "-m", "peagle_jax.serve", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "--max-queue-size" in r.stdout and "--mesh" in r.stdout


def test_compilation_cache_dir_flag():
    args = build_parser().parse_args(["--compilation-cache-dir", "/tmp/xla-cache"])
    assert config_from_args(args, env={}).compilation_cache_dir == "/tmp/xla-cache"
    assert config_from_args(build_parser().parse_args([]), env={}).compilation_cache_dir is None


def _stop_reference(stops, deltas):
    """The stop-string semantics by brute force: of the stop strings ending in a delta, the one
    that starts first; a tail that could begin a stop string is held back."""
    text, sent, out = "", 0, []
    for d in deltas:
        start = max(0, len(text) - max(map(len, stops)) + 1)
        text += d
        found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
        if found:
            text = text[: min(found)]
            out.append(text[sent:])
            return out, True
        held = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        upto = max(sent, len(text) - held)
        out.append(text[sent:upto])
        sent = upto
    out.append(text[sent:])
    return out, False


def test_stop_strings_match_the_brute_force_semantics():
    import random

    rng = random.Random(0)
    for _ in range(400):
        alphabet = "ab\nxé"
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 6))]
        deltas = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 5))) for _ in range(rng.randint(1, 8))]
        s = StopStrings(stops)
        got = [s.add(d) for d in deltas]
        ref, hit = _stop_reference(stops, deltas)
        steps = ref if hit else ref[:-1]  # what each delta released, in order
        assert s.hit == hit and got[: len(steps)] == steps and not any(got[len(steps):]), (stops, deltas)
        assert ("" if s.hit else s.flush()) == ("" if hit else ref[-1])
        assert s.text == ("".join(ref) if hit else "".join(deltas))
