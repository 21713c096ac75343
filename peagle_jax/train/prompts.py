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
  chat           everyday requests from templates over subject lists (explain, advise,
                 compare, write an email or a story, play a role, plan, argue both sides),
                 the general-assistant share that Magpie turns of a code model rarely give;
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
           "math", "chat", "magpie")
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


_CONCEPTS = (
    "rainbows", "vaccines", "credit scores", "compound interest", "photosynthesis", "ocean tides", "inflation",
    "the water cycle", "black holes", "jet engines", "the immune system", "blockchains", "earthquakes",
    "supply and demand", "climate change", "electric cars", "the stock market", "antibiotic resistance",
    "solar panels", "memory in the human brain", "the seasons", "GPS navigation", "nuclear fusion", "sleep",
    "plate tectonics", "democracy", "the placebo effect", "recycling", "noise-cancelling headphones",
    "volcanoes", "the greenhouse effect", "microwave ovens", "muscle growth", "interest rates", "bees and pollination",
    "the printing press", "refrigerators", "the speed of light", "habit formation", "carbon dating",
    "wind turbines", "the Roman Republic", "evolution by natural selection", "public key encryption", "coffee roasting",
    "how airplanes fly", "batteries", "the human heart", "exchange rates", "fermentation",
)
_ACTIVITIES = (
    "learning a new language", "running a first marathon", "saving money on groceries", "working from home",
    "public speaking", "keeping houseplants alive", "sleeping better", "preparing for a job interview",
    "traveling on a budget", "studying for exams", "starting a vegetable garden", "cooking for one person",
    "making friends in a new city", "reducing screen time", "writing a resume", "learning to play the guitar",
    "taking better photos with a phone", "staying focused while studying", "organizing a small kitchen",
    "hosting a dinner party", "training a puppy", "negotiating a salary", "reading more books",
    "managing stress at work", "planning a wedding", "moving to a new apartment", "learning to swim as an adult",
    "writing a personal blog", "starting to exercise after a long break", "giving constructive feedback",
)
_PAIRS = (
    ("renting", "buying a home"), ("tea", "coffee"), ("trains", "planes for a 500 km trip"), ("cats", "dogs as pets"),
    ("e-books", "paper books"), ("city life", "country life"), ("solar power", "wind power"),
    ("a gap year", "going straight to university"), ("running", "swimming for fitness"), ("stocks", "bonds"),
    ("working at a startup", "working at a large company"), ("a laptop", "a desktop computer"),
    ("learning online", "learning in a classroom"), ("weather", "climate"), ("viruses", "bacteria"),
    ("a debit card", "a credit card"), ("Impressionism", "Realism in painting"), ("socialism", "capitalism"),
    ("a podcast", "a blog"), ("hiking boots", "trail running shoes"), ("baking", "frying"),
    ("the Olympic Games", "the World Cup"), ("an electric bike", "a regular bike"), ("memorizing", "understanding"),
)
_EVENTS = (
    "the French Revolution", "the invention of the steam engine", "the fall of the Berlin Wall", "the Black Death",
    "the moon landing", "the Industrial Revolution", "the Renaissance", "the building of the Panama Canal",
    "the invention of the internet", "the Silk Road", "the printing of the Gutenberg Bible", "the Great Depression",
    "the discovery of penicillin", "the age of exploration", "the end of the Cold War", "the rise of the Roman Empire",
)
_ROLES = (
    "a lighthouse keeper", "a museum guide", "a chef in a busy restaurant", "a park ranger", "a librarian",
    "a ship captain in 1850", "a tour guide in Rome", "a detective", "a science teacher", "a travel agent",
    "a personal trainer", "a customer support agent for an airline", "a medieval blacksmith", "a news anchor",
    "a gardener", "an astronaut on the space station",
)
_PLACES = (
    "Lisbon", "Kyoto", "Vancouver", "Marrakesh", "Iceland", "Buenos Aires", "Prague", "the Scottish Highlands",
    "Cape Town", "Seoul", "Istanbul", "Mexico City", "New Zealand's South Island", "Vienna", "Hanoi", "Sicily",
)
_EMAILS = (
    "asking a colleague to move a meeting to next week", "thanking a teacher at the end of the year",
    "complaining politely about a late delivery", "inviting neighbours to a street party",
    "asking a landlord to fix a broken heater", "declining a job offer", "requesting a day off",
    "following up after a job interview", "apologizing for missing a deadline", "welcoming a new team member",
    "asking a professor for a recommendation letter", "cancelling a gym membership",
)
_STORIES = (
    "a robot who learns to paint", "a girl who finds a map in her grandmother's attic",
    "a lost dog finding its way home",
    "a baker who wakes up able to hear thoughts", "two strangers stuck in an elevator", "the last tree in a city",
    "a time traveller who can only go back one minute", "a shy dragon", "a chess game that decides a kingdom",
    "a letter delivered fifty years late", "a lighthouse that turns itself off", "a cat who runs a bookshop",
)
_DEBATES = (
    "schools should start later in the morning", "homework should be banned", "cities should ban cars from their "
    "centers", "everyone should learn to code", "social media does more harm than good", "a four-day work week",
    "space exploration is worth its cost", "zoos should exist", "tipping should be abolished",
    "university should be free", "remote work is better than office work", "voting should be compulsory",
)


def _chat_prompts(split: str) -> list[Prompt]:
    """General-assistant requests: each template over its subject list."""
    asks = (
        (_CONCEPTS, "explain", "Explain how {} works in simple terms."),
        (_CONCEPTS, "child", "How would you explain {} to a ten-year-old?"),
        (_CONCEPTS, "myths", "What are three common misconceptions about {}?"),
        (_ACTIVITIES, "tips", "Give me five practical tips for {}."),
        (_ACTIVITIES, "mistakes", "What mistakes do beginners make when {}, and how can they avoid them?"),
        (_ACTIVITIES, "plan", "Make a simple four-week plan for {}."),
        ([f"{a} and {b}" for a, b in _PAIRS], "compare", "Compare {}. What are the main differences?"),
        ([f"{a} or {b}" for a, b in _PAIRS], "choose", "Should I choose {}? Help me decide."),
        (_EVENTS, "history", "Summarize the causes and consequences of {}."),
        (_EVENTS, "facts", "Tell me five interesting facts about {}."),
        (_ROLES, "roleplay", "Pretend you are {}. Describe a typical day, in the first person."),
        (_ROLES, "interview", "I am interviewing {} for a school project. Write five questions and their answers."),
        (_PLACES, "trip", "Plan a three-day trip to {} for someone on a budget."),
        (_PLACES, "pack", "What should I pack for a week in {} in spring?"),
        (_EMAILS, "email", "Write a short, polite email {}."),
        (_STORIES, "story", "Write a short story, under 200 words, about {}."),
        (_STORIES, "poem", "Write a short poem about {}."),
        (_DEBATES, "debate", "Give the strongest arguments for and against the claim that {}."),
        (_DEBATES, "essay", "Write a short persuasive paragraph arguing that {}."),
    )
    out = []
    for subjects, kind, template in asks:
        for subject in subjects:
            pid = f"chat/{kind}/{subject}"
            if is_validation(pid, 5.0) == (split == "val"):
                out.append(Prompt(pid, "chat", template.format(subject)))
    return out


def build_prompts(split: str = "train", *, seed: int = 0, math_problems: int = 3000) -> list[Prompt]:
    """Every offline prompt of the split (magpie ones come at generation time), shuffled by seed."""
    prompts = (_code_prompts(split) + _docs_prompts(split) + _translate_prompts(split) + _chat_prompts(split)
               + _math_prompts(math_problems if split == "train" else math_problems // 20, seed + (split == "val"),
                               split))
    random.Random(seed).shuffle(prompts)
    return prompts
