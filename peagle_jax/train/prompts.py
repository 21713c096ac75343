"""Training prompts across domains, from offline sources only (self-distillation, issue #13).

The target answers every prompt itself (`peagle_jax.train.generate_data`), so a prompt only
has to be a realistic request; its answer is what the head must learn to predict. Sources,
all available on any machine with CPython (and, for translation, the system's gettext
catalogs), none of them HumanEval or MT-Bench (the evaluation):

  code_complete  "complete this function": stdlib signature + docstring (train split);
  code_explain   "explain this function step by step" (stdlib source, train split);
  code_tests     "write pytest tests for this function";
  code_task      "write a function that <its docstring's first line>";
  docs_summary   summarize / explain for a beginner / list the key points of a Python
                 language-reference passage (`pydoc_data`, train split of the topics);
  rewrite        rewrite / extract from such a passage (formal, simple, JSON keywords);
  translate      English UI sentences of the system's gettext catalogs into 8 languages;
  math           templated word problems (shopping, speed, ages, percentages, sharing);
  magpie         user turns the instruct target writes itself from its chat template up to
                 the user turn (built at generation time, `generate_data.magpie_prompts`).

A share of the conversations gets a follow-up turn after the first answer (`FOLLOW_UPS`).
Every prompt has a stable id; the mix is deterministic for a seed.
"""

from __future__ import annotations

import ast
import gettext
import glob
import random
from collections.abc import Iterator
from dataclasses import dataclass

from peagle_jax.train.data import first_paragraphs, is_test_file, is_validation, pydoc_topics, stdlib_modules

__all__ = ["DOMAINS", "FOLLOW_UPS", "Prompt", "build_prompts"]

DOMAINS = ("code_complete", "code_explain", "code_tests", "code_task", "docs_summary", "rewrite", "translate",
           "math", "magpie")
FOLLOW_UPS = (
    "Can you give a short example?",
    "Explain that more briefly.",
    "Why is that? Please explain.",
    "Can you summarize your answer in one sentence?",
    "What is a common mistake people make here?",
    "Can you make it simpler?",
)
_LANGUAGES = {"fr": "French", "de": "German", "es": "Spanish", "it": "Italian", "pt_BR": "Portuguese",
              "zh_CN": "Chinese", "ja": "Japanese", "ru": "Russian"}
_MAX_SOURCE_CHARS = 1500


@dataclass(frozen=True)
class Prompt:
    id: str
    domain: str
    text: str  # the first user message


def _functions(split: str) -> Iterator[tuple[str, str, str]]:
    """(id, source, docstring) of public top-level stdlib functions with a docstring, 5-60 lines."""
    for rel, tree, lines in stdlib_modules(split, 2.0, is_test_file):
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                if doc and len(doc) >= 20 and 5 <= node.end_lineno - node.lineno + 1 <= 60 \
                        and len(body) <= _MAX_SOURCE_CHARS:
                    yield f"{rel}:{node.name}", body, doc


def _code_prompts(split: str) -> list[Prompt]:
    from peagle_jax.train.data import stdlib_function_prompts

    out = [Prompt(f"code_complete/{name}", "code_complete", text)
           for name, text in stdlib_function_prompts(split=split, val_percent=2.0, limit=None)]
    for fid, src, doc in _functions(split):
        block = f"```python\n{src}\n```"
        out.append(Prompt(f"code_explain/{fid}", "code_explain",
                          f"Explain what this Python function does, step by step:\n\n{block}"))
        out.append(Prompt(f"code_tests/{fid}", "code_tests", f"Write pytest unit tests for this function:\n\n{block}"))
        first = doc.strip().splitlines()[0].rstrip(".")
        name = fid.rsplit(":", 1)[1]
        out.append(Prompt(f"code_task/{fid}", "code_task",
                          f"Write a Python function `{name}` that does the following: {first}. "
                          "Include a docstring and an example call."))
    return out


def _docs_prompts(split: str) -> list[Prompt]:
    asks = {
        "docs_summary": ("Summarize this passage from the Python documentation in a few sentences:",
                         "Explain this passage from the Python documentation to a beginner:",
                         "List the key points of this passage as bullets:"),
        "rewrite": ("Rewrite this passage in simpler words:",
                    "Extract the Python keywords and built-in names this passage mentions, as a JSON list:",
                    "Rewrite this passage as a short FAQ with three questions and answers:"),
    }
    out = []
    for k, text in pydoc_topics(split):
        passage = first_paragraphs(text, _MAX_SOURCE_CHARS)
        if len(passage) < 200:
            continue
        for domain, variants in asks.items():
            for i, ask in enumerate(variants):
                out.append(Prompt(f"{domain}/{k}/{i}", domain, f"{ask}\n\n{passage}"))
    return out


def english_sentences(limit_per_catalog: int = 40) -> list[str]:
    """English sentences (msgids) of the system's gettext catalogs: sorted, deduplicated."""
    seen = set()
    for path in sorted(glob.glob("/usr/share/locale/fr/LC_MESSAGES/*.mo")):
        try:
            with open(path, "rb") as fh:
                catalog = gettext.GNUTranslations(fh)._catalog  # the msgid -> msgstr table
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        taken = 0
        for msgid in sorted(k for k in catalog if isinstance(k, str)):
            text = " ".join(msgid.split())
            if 30 <= len(text) <= 200 and len(text.split()) >= 5 and text[0].isalpha() and "%" not in text \
                    and text not in seen:
                seen.add(text)
                taken += 1
                if taken >= limit_per_catalog:
                    break
    return sorted(seen)


def _translate_prompts(split: str) -> list[Prompt]:
    out = []
    for i, text in enumerate(english_sentences()):
        if is_validation(f"translate/{text}", 2.0) != (split == "val"):
            continue
        code = list(_LANGUAGES)[i % len(_LANGUAGES)]
        out.append(Prompt(f"translate/{code}/{i}", "translate", f"Translate into {_LANGUAGES[code]}:\n\n{text}"))
    return out


_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lena")
_ITEMS = ("apples", "notebooks", "pencils", "tickets", "cookies", "stamps", "marbles", "books")


def _math_prompts(n: int, seed: int, split: str) -> list[Prompt]:
    """Word problems from templates with seeded names and numbers (answers by the target)."""
    rng = random.Random(seed)
    templates = (
        lambda a, b, c, p, q, i: f"{p} buys {a} {i} at ${b} each and pays with a ${a * b + c} bill. How much "
                                 "change does {p} get? Show your steps.".replace("{p}", p),
        lambda a, b, c, p, q, i: f"A train travels {a * 10} km in {b} hours. At the same speed, how far does it "
                                 f"go in {b + c} hours? Explain.",
        lambda a, b, c, p, q, i: f"{p} is {a} years older than {q}. In {c} years their ages will add up to "
                                 f"{2 * b + a + 2 * c}. How old is {q} now?",
        lambda a, b, c, p, q, i: f"A shirt costs ${a * 10}. It is discounted by {b * 5}%. What is the new "
                                 "price? Show the calculation.",
        lambda a, b, c, p, q, i: f"{p} and {q} share {a * (c + 1)} {i} so that {p} gets {c} times as many as {q}. "
                                 f"How many does each get?",
        lambda a, b, c, p, q, i: f"A recipe needs {b} cups of flour for {a} cookies. How much flour is needed "
                                 f"for {a * c} cookies?",
    )
    out = []
    for j in range(n):
        p, q = rng.sample(_NAMES, 2)
        args = (rng.randint(2, 12), rng.randint(2, 9), rng.randint(1, 5), p, q, rng.choice(_ITEMS))
        t = j % len(templates)
        out.append(Prompt(f"math/{split}/{t}/{j}", "math", templates[t](*args)))
    return out


def build_prompts(split: str = "train", *, seed: int = 0, math_problems: int = 3000) -> list[Prompt]:
    """Every offline prompt of the split (magpie ones come at generation time), shuffled by seed."""
    prompts = (_code_prompts(split) + _docs_prompts(split) + _translate_prompts(split)
               + _math_prompts(math_problems if split == "train" else math_problems // 20, seed + (split == "val"),
                               split))
    random.Random(seed).shuffle(prompts)
    return prompts
