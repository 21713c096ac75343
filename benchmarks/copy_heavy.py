"""A copy-heavy prompt set built from offline text: prompts whose answers quote the prompt.

Summaries, edits of pasted code and answers about a pasted passage copy spans of the context,
which is where prompt-lookup drafting wins and a trained head cannot. Three kinds, 10 each,
interleaved, deterministic for a given Python version:
  rewrite   "add type hints and a docstring to this function" (a stdlib function, pasted);
  docs_qa   "answer from this passage" (the leading paragraphs of a Python language reference
            topic, `pydoc_data`);
  edit      "rename method X in this class and return the whole class" (a short stdlib class).
The code comes only from stdlib files in the draft heads' held-out split
(`peagle_jax.train.data.is_validation`) and the passages only from held-out reference topics
(`peagle_jax.train.data.pydoc_topics("val")`), so no prompt quotes training text.
"""

from __future__ import annotations

import ast
from typing import Any

KINDS = ("rewrite", "docs_qa", "edit")
PER_KIND = 10
MAX_CHARS = 1400  # keeps every prompt under 512 tokens with the chat template


def _held_out_modules():
    """(relative path, parsed module, source lines) of stdlib files held out from head training,
    test suites skipped."""
    from peagle_jax.train.data import is_test_file, stdlib_modules

    return stdlib_modules("val", 2.0, is_test_file)


def _functions() -> list[tuple[str, str]]:
    """(id, source) of public top-level functions of 6-40 lines."""
    found = []
    for rel, tree, lines in _held_out_modules():
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                if 6 <= node.end_lineno - node.lineno + 1 <= 40 and len(body) <= MAX_CHARS:
                    found.append((f"{rel}:{node.name}", body))
    return found


def _classes() -> list[tuple[str, str, str]]:
    """(id, source, a method name) of top-level classes short enough to paste whole."""
    found = []
    for rel, tree, lines in _held_out_modules():
        for node in tree.body:
            methods = [n.name for n in node.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("__")] \
                if isinstance(node, ast.ClassDef) else []
            if methods:
                body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                if 300 <= len(body) <= MAX_CHARS:
                    found.append((f"{rel}:{node.name}", body, methods[0]))
    return found


def _spread(items: list, n: int) -> list:
    """n items evenly spaced through a (sorted) list: deterministic, not just the first files."""
    if len(items) <= n:
        return items
    return [items[i * len(items) // n] for i in range(n)]


def load_copy_heavy() -> list[dict[str, Any]]:
    """The prompts as {id, text, kind: "chat", category}, the three kinds interleaved."""
    from peagle_jax.train.data import first_paragraphs, pydoc_topics

    rewrite = [dict(id=f"rewrite/{fid}", category="rewrite", text=(
        "Here is a Python function:\n\n```python\n" + src + "\n```\n\n"
        "Rewrite it with type hints and a docstring. Keep the logic exactly the same and reply with the "
        "full function in a code block.")) for fid, src in _spread(_functions(), PER_KIND)]
    passages = [(k, first_paragraphs(v, MAX_CHARS)) for k, v in pydoc_topics("val")]
    passages = [(k, v) for k, v in passages if len(v) >= 400]
    docs_qa = [dict(id=f"docs_qa/{k}", category="docs_qa", text=(
        "Read this passage from the Python language reference:\n\n" + v
        + f"\n\nUsing the passage, explain what it says about `{k}`. Quote the relevant sentences."))
        for k, v in _spread(passages, PER_KIND)]
    edit = [dict(id=f"edit/{cid}", category="edit", text=(
        f"Here is a class from `{cid.split(':')[0]}`:\n\n```python\n{src}\n```\n\n"
        f"Rename the method `{name}` to `{name}_v2` everywhere in this code and reply with the whole "
        "updated class in a code block."))
        for cid, src, name in _spread(_classes(), PER_KIND)]
    items = []
    for i in range(PER_KIND):
        for group in (rewrite, docs_qa, edit):
            if i < len(group):
                items.append(dict(group[i], kind="chat"))
    return items
