#!/usr/bin/env python
"""A small chat corpus made offline from the Python standard library's own source.

Every public function, class and method with a docstring (read with `ast`: nothing is
imported or run) gives a few question/answer turns, all of them true of the library as it
is on this machine:

  "What does `json.dumps` do?"                -> the docstring's first paragraphs
  "Write a function that returns ..."         -> the function's source, in a code block
  "What arguments does `shutil.copy` take?"   -> its `def` line
  "Which module defines `OrderedDict`?"       -> the module and the import line
  "What is the `zipfile` module for?"         -> the module docstring
  "What methods does `queue.Queue` have?"     -> its public methods

plus a few dozen written turns (greetings, who the model is, thanks) so that a first "Hi!"
gets a reply. Turns of one module are grouped into conversations of 1-3 exchanges, some with
a system message. The split follows the base model's: definitions from its held-out files
make the held-out conversations.

    python scripts/chat_corpus.py --show 5        # print a few conversations and the counts

Used by scripts/train_tiny_chat.py (docs/tiny-model.md, "The chat fine-tune").
"""
from __future__ import annotations

import argparse
import ast
import random
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny_moe import SourceFile, stdlib_files  # noqa: E402

MAX_ANSWER_CHARS = 700        # a doc answer: the first paragraphs up to this length
MAX_SOURCE_LINES = 24         # "write a function" answers: short functions only
MAX_SOURCE_CHARS = 1200
SYSTEM_SHARE = 0.2            # conversations that open with a system message

SYSTEM_PROMPTS = [
    "You are a helpful assistant who knows the Python standard library.",
    "You are colibri's tiny model. Answer questions about Python briefly.",
    "Answer questions about Python's standard library.",
]

# Imperative verbs docstrings start with ("Return the ..."), so that "Write a function that
# returns the ..." reads right; other first words get "Write a function for this: ...".
VERBS = {
    "return", "get", "set", "create", "make", "build", "convert", "compute", "calculate",
    "check", "test", "find", "search", "remove", "delete", "add", "append", "insert", "parse",
    "read", "write", "open", "close", "load", "save", "dump", "encode", "decode", "format",
    "split", "join", "copy", "move", "rename", "call", "run", "execute", "start", "stop",
    "send", "receive", "handle", "process", "update", "reset", "clear", "print", "display",
    "show", "generate", "yield", "count", "sort", "compare", "match", "replace", "translate",
    "escape", "quote", "unquote", "register", "install", "initialize", "initialise", "raise",
    "wait", "acquire", "release", "flush", "truncate", "extract", "determine", "fetch",
    "apply", "construct", "define", "emit", "ensure", "filter", "lookup", "look", "map",
    "normalize", "pack", "unpack", "strip", "validate", "wrap", "iterate", "list", "select",
}

# The written turns: (user phrasings, assistant reply).
SMALL_TALK = [
    (["Hi!", "Hello", "hello!", "Hey", "Hi there", "Good morning"],
     "Hello! I am a tiny mixture-of-experts model that knows the Python standard library. "
     "Ask me what a function does, or ask me to write one."),
    (["Who are you?", "What are you?", "Tell me about yourself."],
     "I am colibri's tiny model: 8 experts in each of 6 layers, 2 of them for every token, "
     "trained on the source of the Python standard library. I am small, so check what I say."),
    (["What can you do?", "How can you help me?", "What do you know?"],
     "I can tell you what a function or class of the standard library does, show its "
     "arguments, say which module defines it, and write short Python functions."),
    (["Thanks!", "Thank you", "thanks", "Great, thanks."],
     "You're welcome! Ask me anything else about Python."),
    (["Bye", "Goodbye!", "See you"],
     "Goodbye! Happy coding."),
    (["How are you?", "How are you doing?"],
     "I am fine, thank you! What would you like to know about Python?"),
    (["What is Python?", "Tell me about Python."],
     "Python is a programming language that is easy to read and write. Its standard library "
     "has modules for files, text, networking, data formats, math and much more."),
    (["What is the standard library?", "What is in the Python standard library?"],
     "The standard library is the set of modules that come with Python: `os` and `pathlib` "
     "for files, `re` for regular expressions, `json` and `csv` for data, `datetime` for "
     "dates, `collections` and `itertools` for data structures, and many more."),
    (["What is a mixture of experts?", "What is an MoE model?"],
     "A mixture-of-experts model has several feed-forward networks, the experts, in each "
     "layer, and a router that picks a few of them for each token. Only the chosen experts "
     "run, so the model is large in total but cheap per token."),
    (["Which experts do you use?", "How do you pick experts?"],
     "For every token, the router of each layer scores my 8 experts and the 2 best run. "
     "Type /routing in `colibri chat` to see them."),
    (["Can you write code?", "Can you write Python?"],
     "Yes, short functions. Ask me: write a function that returns the square of a number."),
    (["Write a function that returns the square of a number.",
      "Write a function to square a number."],
     "```python\ndef square(x):\n    \"\"\"Return x squared.\"\"\"\n    return x * x\n```"),
    (["Write a function that adds two numbers.", "Write a function to add two numbers."],
     "```python\ndef add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n```"),
    (["Write a function that reverses a string.", "How do I reverse a string?"],
     "```python\ndef reverse(s):\n    \"\"\"Return s reversed.\"\"\"\n    return s[::-1]\n```"),
    (["How do I read a file?", "How do I read a text file in Python?"],
     "Open it with `open()` in a `with` block:\n\n```python\nwith open(path, encoding=\"utf-8\") "
     "as f:\n    text = f.read()\n```"),
    (["How do I write a file?", "How do I write text to a file?"],
     "```python\nwith open(path, \"w\", encoding=\"utf-8\") as f:\n    f.write(text)\n```"),
    (["How do I list the files in a directory?", "How do I list a directory?"],
     "Use `os.listdir(path)`, or `pathlib.Path(path).iterdir()` for `Path` objects."),
    (["How do I parse JSON?", "How do I read JSON?"],
     "Use the `json` module: `json.loads(text)` parses a string, `json.load(f)` a file."),
    (["How do I get the current time?", "How do I get today's date?"],
     "Use the `datetime` module: `datetime.datetime.now()` gives the date and time, "
     "`datetime.date.today()` the date."),
    (["How do I run a shell command?", "How do I run another program?"],
     "Use `subprocess.run([\"ls\", \"-l\"], capture_output=True, text=True)`; the result "
     "has `returncode`, `stdout` and `stderr`."),
]


@dataclass
class Definition:
    module: str             # 'json.decoder'
    qualname: str           # 'JSONDecoder.decode'
    kind: str               # 'function', 'method' or 'class'
    doc: str                # the cleaned docstring
    header: str             # 'def decode(self, s, _w=WHITESPACE.match):' / 'class JSONDecoder(object):'
    source: str | None      # the dedented source of a short function, else None
    methods: list[str]      # a class's public methods with docstrings


def module_name(rel: str) -> str | None:
    """'json/decoder.py' -> 'json.decoder', 'json/__init__.py' -> 'json'; None for private
    modules ('_pydecimal.py', 'asyncio/__main__.py')."""
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or any(p.startswith("_") for p in parts):
        return None
    return ".".join(parts)


def _header(node: ast.AST, lines: list[str]) -> str:
    """The `def ...:` / `class ...:` line(s) of a definition, as written (decorators out)."""
    head = textwrap.dedent("\n".join(lines[node.lineno - 1: node.body[0].lineno - 1])).rstrip()
    if not head.endswith(":"):          # a one-line body: "def f(x): return x"
        head = head.split(":\n")[0].rstrip() + ":"
    return head


def definitions(f: SourceFile) -> tuple[str | None, str | None, list[Definition]]:
    """(module, module docstring, public documented definitions) of one file."""
    module = module_name(f.rel)
    if module is None:
        return None, None, []
    try:
        tree = ast.parse(f.text)
    except SyntaxError:
        return module, None, []
    out: list[Definition] = []
    lines = f.text.splitlines()

    def visit(node, prefix: str, in_class: bool) -> None:
        for child in node.body:
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if child.name.startswith("_"):
                continue
            doc = ast.get_docstring(child)
            qual = prefix + child.name
            if isinstance(child, ast.ClassDef):
                methods = [m.name for m in child.body
                           if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                           and not m.name.startswith("_") and ast.get_docstring(m)]
                if doc:
                    out.append(Definition(module, qual, "class", doc, _header(child, lines),
                                          None, methods))
                if not in_class:
                    visit(child, qual + ".", True)
            elif doc:
                first = min([child.lineno] + [x.lineno for x in child.decorator_list])
                src = textwrap.dedent("\n".join(lines[first - 1: child.end_lineno])).strip("\n")
                short = src.count("\n") < MAX_SOURCE_LINES and len(src) <= MAX_SOURCE_CHARS
                out.append(Definition(module, qual, "method" if in_class else "function", doc,
                                      _header(child, lines), src if short else None, []))
    visit(tree, "", False)
    return module, ast.get_docstring(tree), out


def paragraphs(doc: str, limit: int = MAX_ANSWER_CHARS) -> str:
    """The leading paragraphs of a docstring within `limit` characters; prose lines joined
    into one line per paragraph, indented or doctest blocks kept as they are."""
    out, size = [], 0
    for para in re.split(r"\n\s*\n", doc.strip()):
        lines = para.splitlines()
        literal = any(l.startswith((" ", "\t", ">>>")) or "   " in l.strip() for l in lines)
        text = para if literal else " ".join(l.strip() for l in lines)
        if out and size + len(text) > limit:
            break
        out.append(text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ...")
        size += len(text)
    return "\n\n".join(out)


def first_sentence(doc: str) -> str:
    para = " ".join(l.strip() for l in doc.strip().split("\n\n")[0].splitlines())
    m = re.match(r"(.+?[.!?])(\s|$)", para)
    return (m.group(1) if m else para).strip()


def _third_person(sentence: str) -> str | None:
    """'Return the x.' -> 'returns the x' (for "Write a function that ..."), else None."""
    word, _, rest = sentence.partition(" ")
    if word.lower() not in VERBS or not rest:
        return None
    w = word.lower()
    if w.endswith(("s", "sh", "ch", "x", "z")):
        w += "es"
    elif w.endswith("y") and w[-2] not in "aeiou":
        w = w[:-1] + "ies"
    else:
        w += "s"
    return f"{w} {rest.rstrip('.')}"


def turns_for(d: Definition, module_names: dict[str, int], rng: random.Random) -> list[tuple[str, str]]:
    """The question/answer turns one definition gives."""
    full = f"{d.module}.{d.qualname}"
    name = d.qualname.rsplit(".", 1)[-1]
    what = rng.choice(["What does `{q}` do?", "What is `{q}`?", "Explain `{q}`.",
                       "What is `{q}` for?", "Tell me about `{q}`.", "What does {q} do?"])
    answer = paragraphs(d.doc)
    says = _third_person(first_sentence(d.doc))
    if says and answer.startswith(first_sentence(d.doc)):   # "`json.dumps` serializes ..."
        answer = f"`{full}` {says}.{answer[len(first_sentence(d.doc)):]}"
    turns = [(what.format(q=full), answer)]
    if d.kind != "class":
        turns.append((rng.choice(["What arguments does `{q}` take?",
                                  "What is the signature of `{q}`?",
                                  "How do I call `{q}`?"]).format(q=full),
                      f"```python\n{d.header}\n```\n\n{first_sentence(d.doc)}"))
    if d.source is not None and d.kind == "function":
        task = _third_person(first_sentence(d.doc))
        ask = (f"Write a function that {task}." if task else
               f"Write a Python function for this: {first_sentence(d.doc)}")
        turns.append((ask, f"Here is `{name}` from the `{d.module}` module:\n\n"
                           f"```python\n{d.source}\n```"))
    if "." not in d.qualname and module_names.get(name) == 1:
        turns.append((rng.choice(["Which module defines `{n}`?", "Where is `{n}` defined?",
                                  "How do I import `{n}`?"]).format(n=name),
                      f"`{name}` is in the `{d.module}` module: "
                      f"`from {d.module} import {name}`."))
    if d.kind == "class" and d.methods:
        shown = ", ".join(f"`{m}()`" for m in d.methods[:12])
        turns.append((f"What methods does `{full}` have?",
                      f"`{full}` has these public methods: {shown}."))
    return turns


def conversations(files: list[SourceFile], seed: int) -> list[list[dict]]:
    """Conversations (lists of {"role", "content"}) made from `files`, shuffled with `seed`.
    The written small-talk turns come in every call (the held-out set gets other phrasings
    of them only through the random draws, so its loss measures the library turns)."""
    rng = random.Random(seed)
    per_file = [definitions(f) for f in files]
    names: dict[str, int] = {}
    for _, _, defs in per_file:
        for d in defs:
            if "." not in d.qualname:
                names[d.qualname] = names.get(d.qualname, 0) + 1
    convs: list[list[dict]] = []
    for module, mdoc, defs in per_file:
        turns: list[tuple[str, str]] = []
        if module and mdoc and len(mdoc) > 40:
            turns.append((rng.choice(["What is the `{m}` module for?", "What is `{m}`?",
                                      "Tell me about the `{m}` module."]).format(m=module),
                          paragraphs(mdoc)))
        for d in defs:
            turns += turns_for(d, names, rng)
        rng.shuffle(turns)
        while turns:
            n = min(len(turns), rng.choice([1, 1, 2, 2, 3]))
            convs.append(_messages(turns[:n], rng))
            turns = turns[n:]
    for asks, reply in SMALL_TALK:
        for ask in asks:
            for _ in range(3):      # a greeting opens many conversations: learn it well
                pair = [(ask, reply)]
                if rng.random() < 0.5 and convs:   # followed by a library question
                    other = [m for m in rng.choice(convs) if m["role"] != "system"]
                    pair.append((other[0]["content"], other[1]["content"]))
                convs.append(_messages(pair, rng))
    rng.shuffle(convs)
    return convs


def _messages(turns: list[tuple[str, str]], rng: random.Random) -> list[dict]:
    msgs = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] \
        if rng.random() < SYSTEM_SHARE else []
    for q, a in turns:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs


def split_conversations(seed: int = 0) -> tuple[list[list[dict]], list[list[dict]], dict]:
    """(train, held-out, corpus info): conversations from the base model's training files and
    from its held-out files."""
    train_files, val_files, info = stdlib_files()
    return conversations(train_files, seed), conversations(val_files, seed + 1), info


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--show", type=int, default=3, help="conversations to print")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    train, val, _ = split_conversations(args.seed)
    for conv in train[:args.show]:
        for m in conv:
            print(f"<{m['role']}> {m['content']}")
        print("-" * 60)
    chars = sum(len(m["content"]) for c in train for m in c)
    print(f"{len(train)} training conversations ({chars / 1e6:.2f} M characters), "
          f"{len(val)} held out")


if __name__ == "__main__":
    main()
