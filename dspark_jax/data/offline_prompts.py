"""Training prompts at scale without network (SPEC §4 data: the prompts the target regenerates).

DeepSpec regenerates a large mixture of code, math and chat prompts; here the same mixture is
built locally, deterministically from a seed, from nothing but what is installed:

- code: one prompt per public, documented, top-level function of the Python standard library,
  read with `ast` from the source files (nothing is imported or executed): its signature and
  docstring wrapped in one of several task instructions (implement / explain / test / refactor),
  or, for a docstring that opens with an imperative sentence, that sentence alone as a short
  task ("Write a function to return …"), so the target also writes functions from scratch.
  The docstrings are the Python Software Foundation's (PSF License 2.0); the set depends on the
  Python version (3.11 here), so the exact prompts are deterministic per interpreter.
- math: word problems from templates with seeded numbers, the answer left to the target.
- chat: instructions composed from seed topics × task verbs × audiences (original text).

`build_offline_prompts(seed, code=, math=, chat=)` returns `Conversation`s with ids
`offline-<kind>-<i>`; the default sizes give 5,500 prompts. It never reads an evaluation
benchmark; `contamination.filter_contaminated` removes prompts sharing n-grams with one.
"""

from __future__ import annotations

import ast
import functools
import random
import sysconfig
import textwrap
from pathlib import Path

from dspark_jax.data.prompts import Conversation

DEFAULT_SIZES = {"code": 2000, "math": 1750, "chat": 1750}

# Standard-library modules with many documented functions (source files, read not imported).
_STDLIB_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "cgi", "cmd", "codecs", "colorsys",
    "configparser", "copy", "csv", "datetime", "decimal", "difflib", "dis", "doctest",
    "email/utils.py", "email/message.py", "email/header.py", "filecmp", "fnmatch",
    "fractions", "ftplib", "functools", "genericpath", "getopt", "gettext", "glob", "gzip",
    "hashlib", "heapq", "hmac", "html/__init__.py", "http/cookies.py", "imaplib",
    "importlib/util.py", "inspect", "ipaddress", "json/__init__.py", "json/decoder.py",
    "json/encoder.py", "keyword", "linecache", "locale", "logging/__init__.py", "mailbox",
    "mimetypes", "ntpath", "nntplib", "numbers", "operator", "optparse", "os", "pathlib",
    "pickle", "pickletools", "pkgutil", "platform", "plistlib", "poplib", "posixpath",
    "pprint", "pydoc", "quopri", "random", "re/__init__.py", "reprlib", "sched", "secrets",
    "selectors", "shlex", "shutil", "smtplib", "socket", "socketserver", "statistics",
    "string", "subprocess", "sysconfig", "tarfile", "tempfile", "textwrap", "threading",
    "timeit", "tokenize", "trace", "traceback", "turtle", "types", "typing", "urllib/parse.py",
    "urllib/request.py", "uuid", "warnings", "wave", "weakref", "webbrowser", "xml/dom/minidom.py",
    "xml/etree/ElementTree.py", "zipfile", "zipimport", "_pydecimal", "_pyio", "_strptime",
    "collections/__init__.py", "concurrent/futures/_base.py", "asyncio/tasks.py",
    "asyncio/base_events.py", "asyncio/streams.py", "unittest/case.py", "unittest/mock.py",
    "tkinter/__init__.py", "lib2to3/pytree.py", "idlelib/editor.py", "multiprocessing/pool.py",
)

_CODE_TASKS = (
    "Implement the following Python function. Keep the documented behaviour.\n```python\n{sig}\n```",
    "Write a Python implementation of this function from the standard library module `{mod}`:\n"
    "```python\n{sig}\n```",
    "Explain what this function from `{mod}` does, when one would use it, and give a short usage "
    "example.\n```python\n{sig}\n```",
    "Write pytest unit tests for the following function, covering edge cases:\n```python\n{sig}\n```",
    "Here is the signature and documentation of `{name}` from Python's `{mod}` module:\n"
    "```python\n{sig}\n```\nWrite an equivalent function in idiomatic modern Python with type hints.",
    "How would you implement `{name}` (from `{mod}`) in JavaScript? Its Python documentation:\n"
    "```python\n{sig}\n```",
)

# Short task statements from the docstring's first sentence, no code shown: the target writes
# the function from scratch (the form of the usual "write a function" coding requests).
_SHORT_TASKS = (
    "Write a python function to {task}",
    "Write a function to {task}",
    "Write a Python function `{short}` to {task}",
)

_NAMES = ("Ava", "Ben", "Chloe", "Dario", "Elif", "Farah", "Goran", "Hana", "Ivan", "Jun",
          "Kemal", "Lena", "Mateo", "Nia", "Omar", "Priya", "Quentin", "Rosa", "Sven", "Tariq")
_ITEMS = ("stickers", "marbles", "apples", "books", "pencils", "coins", "stamps", "shells",
          "cookies", "tickets", "plants", "cards")
_MATH_TEMPLATES = (
    "{n1} has {a} {item}. {n1} gives {b} to {n2} and then buys {c} more. How many {item} does "
    "{n1} have now?",
    "A shop sells {item} at ${a} each. {n1} buys {b} of them and pays with a ${c}00 note. How "
    "much change does {n1} get?",
    "A train travels {a} km in {b} hours, then {c} km in {d} hours. What is its average speed "
    "over the whole trip?",
    "{n1} saves ${a} every week. After {b} weeks {n1} spends ${c} on a gift. How much money is "
    "left?",
    "A rectangle is {a} cm long and {b} cm wide. A square has the same perimeter. What is the "
    "area of the square?",
    "Solve for x: {a}x + {b} = {c}x - {d}.",
    "What is the sum of all multiples of {a} or {b} below {c}0?",
    "{n1} reads {a} pages on Monday and {b}% more on Tuesday. How many pages did {n1} read on "
    "the two days together?",
    "A tank holds {a}00 litres. It leaks {b} litres per hour while a pump adds {c} litres per "
    "hour. If it starts half full, after how many hours is it full or empty?",
    "Find the greatest common divisor and the least common multiple of {a}{b} and {c}{d}.",
    "A class has {a}{b} students; {c}0% of them play chess and a third of those also play go. "
    "How many students play both?",
    "The price of a jacket is ${a}{b}. It is discounted by {c}0% and then a {d}% tax is added. "
    "What is the final price?",
    "How many ways can {a} different {item} be arranged in a row if two particular ones must "
    "not be next to each other?",
    "A recipe needs {a} cups of flour for {b} people. How much flour is needed for {c}{d} "
    "people?",
    "Compute {a}{b} × {c}{d} − {a}{c} and explain each step.",
    "If f(x) = {a}x² − {b}x + {c}, what is f({d}) and where is the minimum of f?",
    "{n1} and {n2} paint a fence. {n1} alone needs {a} hours, {n2} alone needs {b} hours. How "
    "long do they need together?",
    "A bag has {a} red, {b} blue and {c} green balls. Two are drawn without replacement. What is "
    "the probability that both are the same colour?",
    "The sequence starts {a}, {a}+{b}, … adding {b} each time. What is the {c}{d}th term and the "
    "sum of the first {c}{d} terms?",
    "Convert {a}{b}{c} from base 10 to base {d} and check the result.",
)
_TOPICS = (
    "photosynthesis", "the French Revolution", "black holes", "compound interest", "the immune "
    "system", "plate tectonics", "machine learning", "the Silk Road", "climate change",
    "the printing press", "quantum entanglement", "supply and demand", "the water cycle",
    "volcanoes", "the Roman Empire", "vaccines", "renewable energy", "the internet",
    "honeybees", "the stock market", "jazz music", "the Renaissance", "sleep", "coral reefs",
    "electric cars", "the Moon landing", "DNA", "inflation", "public speaking", "meditation",
    "time management", "composting", "chess openings", "bread baking", "marathon training",
    "learning a language", "budgeting", "job interviews", "remote work", "urban gardening",
    "digital privacy", "recycling", "the Olympic Games", "ancient Egypt", "earthquakes",
    "antibiotics", "cryptography", "the solar system", "democracy", "impressionist painting",
    "coffee", "rainforests", "3D printing", "bird migration", "the Cold War", "nutrition",
    "open-source software", "tea ceremonies", "glaciers", "video game design",
)
_CHAT_TASKS = (
    "Explain {topic} to {audience}.",
    "Write a short story for {audience} in which {topic} plays a central role.",
    "Give me five surprising facts about {topic}, each with one sentence of explanation.",
    "What are the most common misconceptions about {topic}? Correct each one.",
    "Write a haiku and a limerick about {topic}.",
    "Draft an email to {audience} inviting them to a workshop on {topic}.",
    "Compare two opposing viewpoints on {topic} and summarise the strongest argument of each.",
    "Create a one-week study plan to learn about {topic}, written for {audience}.",
    "Summarise the history of {topic} in a timeline of about eight entries.",
    "I have to give a three-minute talk on {topic} to {audience}. Write an outline.",
    "Write ten quiz questions (with answers) about {topic}.",
    "How does {topic} affect everyday life? Give concrete examples.",
    "Role-play a friendly expert answering a question from {audience} about {topic}.",
    "List the pros and cons of {topic} in a table.",
    "Write a persuasive paragraph arguing that everyone should know more about {topic}.",
    "Describe {topic} using only simple words, as if writing for {audience}.",
    "What questions would a curious person ask about {topic}? Answer three of them.",
    "Write a dialogue between two friends who disagree about {topic}.",
)
_AUDIENCES = ("a ten-year-old", "a university student", "a busy manager", "my grandmother",
              "a software engineer", "a group of high-school teachers", "a complete beginner",
              "a skeptical journalist")


@functools.lru_cache(maxsize=1)
def _stdlib_functions() -> tuple[tuple[str, str, str], ...]:
    """(module, name, signature + docstring source) of documented public top-level functions."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[tuple[str, str, str]] = []
    for mod in _STDLIB_MODULES:
        path = root / mod if mod.endswith(".py") else root / f"{mod}.py"
        if not path.is_file():
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        name = mod.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for node in tree.body:
            nodes = [node] + ([n for n in node.body] if isinstance(node, ast.ClassDef)
                              and not node.name.startswith("_") else [])
            for fn in nodes:
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if fn.name.startswith("_"):
                    continue
                doc = ast.get_docstring(fn)
                if not doc or len(doc) < 40:
                    continue
                qual = fn.name if fn is node else f"{node.name}.{fn.name}"
                args = ast.unparse(fn.args)
                doc = textwrap.indent(doc.strip()[:1200], "    ").lstrip()
                sig = f'def {fn.name}({args}):\n    """{doc}\n    """'
                out.append((name, qual, sig))
    return tuple(out)


def _task_statement(sig: str) -> str | None:
    """The docstring's first sentence as a task ("Return the …" → "return the …."), when it is
    one imperative sentence of reasonable length; None otherwise."""
    doc = sig.split('"""', 2)[1].strip()
    first = " ".join(doc.split("\n\n", 1)[0].split())
    end = first.find(". ")
    first = first if end < 0 else first[:end + 1]
    words = first.split()
    if not (30 <= len(first) <= 160) or not first.endswith("."):
        return None
    verb = words[0]
    # an imperative verb: capitalised, alphabetic, not "Returns", "Called", "Fairly", "This"
    if (not verb.isalpha() or not verb[:1].isupper() or not verb[1:].islower()
            or verb.endswith(("s", "ed", "ly"))
            or verb in ("This", "The", "A", "An", "If", "For", "In", "When", "Note", "Internal")):
        return None
    return verb.lower() + first[len(verb):]


def code_prompts(n: int, rng: random.Random) -> list[str]:
    """`n` code prompts: a function's signature and docstring under one of `_CODE_TASKS`, or,
    for a function whose docstring opens with an imperative sentence, a short task statement
    (`_SHORT_TASKS`) about as often as each of them."""
    if n == 0:
        return []
    funcs = list(_stdlib_functions())
    rng.shuffle(funcs)
    out, seen = [], set()
    for mod, name, sig in funcs:
        task = _task_statement(sig)
        templates = _CODE_TASKS + (_SHORT_TASKS if task else ())
        text = rng.choice(templates).format(sig=sig, mod=mod, name=name, task=task,
                                            short=name.rsplit(".", 1)[-1])
        if text not in seen:
            seen.add(text)
            out.append(text)
        if len(out) == n:
            break
    return out


def math_prompts(n: int, rng: random.Random) -> list[str]:
    out, seen = [], set()
    while len(out) < n:
        n1, n2 = rng.sample(_NAMES, 2)
        text = rng.choice(_MATH_TEMPLATES).format(
            n1=n1, n2=n2, item=rng.choice(_ITEMS), a=rng.randint(2, 9), b=rng.randint(2, 9),
            c=rng.randint(2, 9), d=rng.randint(2, 9))
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def chat_prompts(n: int, rng: random.Random) -> list[str]:
    combos = [(t, k, a) for t in _TOPICS for k in _CHAT_TASKS for a in _AUDIENCES]
    rng.shuffle(combos)
    out, seen = [], set()
    for topic, task, audience in combos:
        if len(out) >= n:
            break
        text = task.format(topic=topic, audience=audience)
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def build_offline_prompts(seed: int = 0, *, code: int = DEFAULT_SIZES["code"],
                          math: int = DEFAULT_SIZES["math"],
                          chat: int = DEFAULT_SIZES["chat"]) -> list[Conversation]:
    """The offline code/math/chat mixture: `code + math + chat` single-turn prompts, the kinds
    interleaved in a seeded order. Raises ValueError when a kind cannot supply its count."""
    for kind, k in (("code", code), ("math", math), ("chat", chat)):
        if k < 0:
            raise ValueError(f"offline prompts: {kind} count must be >= 0, got {k}")
    made = {"code": code_prompts(code, random.Random(f"{seed}-code")),
            "math": math_prompts(math, random.Random(f"{seed}-math")),
            "chat": chat_prompts(chat, random.Random(f"{seed}-chat"))}
    wanted = {"code": code, "math": math, "chat": chat}
    for kind, texts in made.items():
        if len(texts) < wanted[kind]:
            raise ValueError(f"offline prompts: only {len(texts)} {kind} prompts available, "
                             f"{wanted[kind]} requested")
    convs = [Conversation(f"offline-{kind}-{i}", [{"role": "user", "content": t}])
             for kind, texts in made.items() for i, t in enumerate(texts)]
    random.Random(f"{seed}-order").shuffle(convs)
    return convs


__all__ = ["DEFAULT_SIZES", "build_offline_prompts", "code_prompts", "math_prompts",
           "chat_prompts"]
