"""Generate the embedded chat corpus: one Hermes-3 JSONL file per domain, from freely licensed text.

    python scripts/make_embedded_corpus.py                  # write every domain to andrea/data/embedded/
    python scripts/make_embedded_corpus.py --domain NAME    # one domain
    python scripts/make_embedded_corpus.py --check          # regenerate in memory, compare; write nothing

Domains, in the order of `andrea.data.embedded_corpus.DOMAINS`:

- pydocs (PSF License): text that ships with Python itself, the language reference topics of
  `pydoc_data.topics` and the module, class and function docstrings of the standard library's
  own .py files, read with `ast` (never imported). Each becomes a question -> answer
  conversation; classes are multi-turn (the class, then some of its methods), long reference
  topics continue over several turns.
- wordnet (WordNet 3.0 license): the English lexical database of Debian's `wordnet-base`
  package (`apt-get install wordnet-base`). Every word that WordNet's sense-tagged corpus
  attests gets a "what does X mean" conversation (its senses by part of speech) with follow-ups
  drawn from the database: examples, synonyms, opposites, the hypernym chain, kinds, parts,
  related words. Concepts whose words are all rarer are asked the other way round ("what is
  the word for ..."), when they come with an example sentence.

About a third of the conversations get a system turn. Each domain writes `<domain>.jsonl.gz`
(gzip, mtime 0: the same content gives the same bytes), `<domain>.json` (counts, the sha256 that
`andrea.data.embedded_corpus.iter_rows` verifies, licence, upstream package and version) and
`LICENSE-<domain>.txt` (the upstream licence, copied from the upstream files). The output is
deterministic for a given upstream version; it is committed, so the corpus does not change
with the machine that runs the pipeline.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import io
import json
import platform
import re
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from andrea.data.embedded_corpus import DOMAINS, EMBEDDED_DIR


def pick(options: tuple, key: str):
    """A stable choice by key (Python's hash() is salted per process)."""
    return options[int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % len(options)]


def conversation(key: str, exchanges: list[tuple[str, str]], source: str, system_prompts: tuple[str, ...]) -> dict:
    turns = []
    if pick(("system", "none", "none"), "system:" + key) == "system":
        turns.append({"from": "system", "value": pick(system_prompts, "prompt:" + key)})
    for question, answer in exchanges:
        turns += [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
    return {"conversations": turns, "source": source}


def without_repeated_answers(conversations) -> list[dict]:
    """An answer sequence already given once is not repeated (inherited docstrings, shared senses)."""
    seen, corpus = set(), []
    for conv in conversations:
        answers = tuple(t["value"] for t in conv["conversations"] if t["from"] == "gpt")
        if answers not in seen:
            seen.add(answers)
            corpus.append(conv)
    return corpus


@dataclass
class Domain:
    """A built domain: its rows, where they come from, and the upstream licence text."""

    corpus: list[dict]
    license: str
    license_note: str
    license_text: str
    upstream: dict


# --- pydocs: Python's own documentation ----------------------------------------------------

# test suites, vendored wheels and installed third-party packages are not Python's documentation
SKIP_DIRS = {"test", "tests", "idle_test", "ensurepip", "site-packages", "dist-packages", "__pycache__"}
MIN_DOC_CHARS = 30
MAX_METHODS_PER_CLASS_CONVERSATION = 3
TOPIC_CHUNK_CHARS = 2500
TOPIC_TURNS_PER_CONVERSATION = 3

PYDOCS_SYSTEM_PROMPTS = (
    "You are a helpful assistant who explains the Python standard library.",
    "You answer questions about Python precisely, in the words of its documentation.",
    "You are a patient Python tutor. Answer clearly and completely.",
)
MODULE_QUESTIONS = (
    "What is the `{name}` module in Python's standard library for?",
    "Give me an overview of the Python module `{name}`.",
    "What do I get from `import {name}`?",
)
FUNCTION_QUESTIONS = (
    "What does `{name}()` do?",
    "How do I use `{name}` in Python?",
    "Explain the function `{name}`.",
)
CLASS_QUESTIONS = (
    "What is the `{name}` class?",
    "Describe the Python class `{name}`.",
    "What is `{name}` used for?",
)
METHOD_FOLLOW_UPS = (
    "And what does its `{method}()` method do?",
    "What about `{method}`?",
    "How does `{name}.{method}` work?",
)
METHOD_QUESTIONS = (
    "What does the method `{name}.{method}()` do?",
    "Explain `{name}.{method}`.",
)
TOPIC_QUESTIONS = (
    "What does the Python language reference say about {title}?",
    "Explain {title} in Python.",
)
TOPIC_FOLLOW_UPS = ("Please continue.", "Go on.", "What else should I know?")
TOPIC_CONTINUATION = "Continue the Python reference on {title} (part {part})."


def pydocs_conversation(key: str, exchanges: list[tuple[str, str]], source: str) -> dict:
    return conversation(key, exchanges, f"pydocs/{source}", PYDOCS_SYSTEM_PROMPTS)


def signature(node: ast.FunctionDef | ast.AsyncFunctionDef, is_method: bool) -> str:
    args = node.args
    if is_method:
        positional = args.posonlyargs + args.args
        if positional and positional[0].arg in ("self", "cls"):
            args = ast.arguments(
                posonlyargs=args.posonlyargs[1:] if args.posonlyargs else [],
                args=args.args if args.posonlyargs else args.args[1:],
                vararg=args.vararg, kwonlyargs=args.kwonlyargs, kw_defaults=args.kw_defaults,
                kwarg=args.kwarg, defaults=args.defaults,
            )
    return f"{node.name}({ast.unparse(args)})"


def docstring(node) -> str | None:
    doc = ast.get_docstring(node, clean=True)
    return doc if doc and len(doc) >= MIN_DOC_CHARS else None


def is_public(name: str) -> bool:
    """Public names and special methods (`__init__` documents a constructor); not `_helpers`."""
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


def stdlib_modules(stdlib: Path):
    """(module name, path) of standard-library modules, in a stable order.

    Private modules stay: several (`_pydecimal`, `_pyio`, `_collections_abc`) are where the
    documented classes are written in Python."""
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        if any(part in SKIP_DIRS or part.startswith("config-") for part in relative.parts[:-1]):
            continue
        parts = list(relative.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts and parts[-1] != "__main__":
            yield ".".join(parts), path


def top_level_definitions(body: list[ast.stmt]):
    """Module-level defs, including those under `if`/`try` (platform-specific variants)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node
        elif isinstance(node, ast.If):
            yield from top_level_definitions(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from top_level_definitions(node.body + node.orelse + node.finalbody
                                             + [s for h in node.handlers for s in h.body])


def docstring_conversations(stdlib: Path):
    for module, path in stdlib_modules(stdlib):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        doc = docstring(tree)
        if doc:
            yield pydocs_conversation(module, [(pick(MODULE_QUESTIONS, module).format(name=module), doc)], "docstrings")
        for node in top_level_definitions(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and is_public(node.name):
                doc = docstring(node)
                if doc:
                    name = f"{module}.{node.name}"
                    answer = f"`{module}.{signature(node, False)}`\n\n{doc}"
                    question = pick(FUNCTION_QUESTIONS, name).format(name=name)
                    yield pydocs_conversation(name, [(question, answer)], "docstrings")
            elif isinstance(node, ast.ClassDef) and is_public(node.name):
                yield from class_conversations(module, node)


def class_conversations(module: str, node: ast.ClassDef):
    name = f"{module}.{node.name}"
    methods = [
        (m.name, f"`{node.name}.{signature(m, True)}`\n\n{doc}")
        for m in node.body
        if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and is_public(m.name) and (doc := docstring(m))
    ]
    doc = docstring(node)
    if doc:
        answer = f"`{name}` is a class of the `{module}` module.\n\n{doc}"
        exchanges = [(pick(CLASS_QUESTIONS, name).format(name=name), answer)]
        for method, answer in methods[:MAX_METHODS_PER_CLASS_CONVERSATION]:
            exchanges.append((pick(METHOD_FOLLOW_UPS, f"{name}.{method}").format(name=name, method=method), answer))
        yield pydocs_conversation(name, exchanges, "docstrings")
        methods = methods[MAX_METHODS_PER_CLASS_CONVERSATION:]
    for method, answer in methods:
        key = f"{name}.{method}"
        question = pick(METHOD_QUESTIONS, key).format(name=name, method=method)
        yield pydocs_conversation(key, [(question, answer)], "docstrings")


def chunks(text: str, limit: int) -> list[str]:
    """Paragraph-aligned pieces of at most `limit` characters (a longer paragraph stays whole)."""
    pieces, current = [], ""
    for paragraph in text.split("\n\n"):
        if current and len(current) + 2 + len(paragraph) > limit:
            pieces.append(current)
            current = paragraph
        else:
            current = f"{current}\n\n{paragraph}" if current else paragraph
    if current.strip():
        pieces.append(current)
    return pieces


def topic_conversations():
    from pydoc_data.topics import topics

    for key in sorted(topics):
        heading, _, body = topics[key].strip().partition("\n")
        body = body.lstrip("*\n")  # the reST underline of the heading
        title = f"“{heading.strip()}”"
        parts = chunks(body.strip(), TOPIC_CHUNK_CHARS)
        for start in range(0, len(parts), TOPIC_TURNS_PER_CONVERSATION):
            group = parts[start:start + TOPIC_TURNS_PER_CONVERSATION]
            part = start // TOPIC_TURNS_PER_CONVERSATION + 1
            first = (pick(TOPIC_QUESTIONS, key).format(title=title) if part == 1
                     else TOPIC_CONTINUATION.format(title=title, part=part))
            follow_ups = [pick(TOPIC_FOLLOW_UPS, f"{key}:{start + i}") for i in range(1, len(group))]
            yield pydocs_conversation(f"{key}:{part}", list(zip([first, *follow_ups], group)), "reference")


def pydocs_version() -> str:
    return platform.python_version()


def build_pydocs(version: str) -> Domain:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return Domain(
        corpus=without_repeated_answers([*topic_conversations(), *docstring_conversations(stdlib)]),
        license="PSF-2.0",
        license_note="Python documentation and standard-library docstrings, Copyright Python Software "
                     "Foundation, under the PSF License Agreement (https://docs.python.org/3/license.html).",
        license_text=("The pydocs domain of ANDREA's embedded corpus (pydocs.jsonl.gz) is derived from the\n"
                      "documentation and docstrings of Python, distributed under the PSF License Agreement.\n"
                      "The LICENSE file of the Python it was made from follows.\n\n"
                      + (stdlib / "LICENSE.txt").read_text(encoding="utf-8")),
        upstream={"name": platform.python_implementation(), "version": version,
                  "data": "pydoc_data.topics and the standard library's docstrings"},
    )


# --- wordnet: the English lexical database ------------------------------------------------

WORDNET_PACKAGE = "wordnet-base"
WORDNET_DIR = Path("/usr/share/wordnet")
WORDNET_FILES = (("noun", "n"), ("verb", "v"), ("adj", "a"), ("adv", "r"))
SYNSET_FILE = {"n": "n", "v": "v", "a": "a", "s": "a", "r": "r"}  # adjective satellites live in data.adj
POS_NAMES = {"n": "noun", "v": "verb", "a": "adjective", "r": "adverb"}
ARTICLES = {"n": "a", "v": "a", "a": "an", "r": "an"}
MAX_SENSES = 5         # per part of speech in a definition
MAX_LISTED = 6         # words in a list answer (synonym senses, kinds, parts, related words)
MAX_EXAMPLES = 3
MAX_FOLLOW_UPS = 2

WORDNET_SYSTEM_PROMPTS = (
    "You are a helpful English dictionary.",
    "You explain the meanings of English words clearly, with examples.",
    "You are a patient English teacher. Answer precisely and briefly.",
)
DEFINE_QUESTIONS = (
    'What does "{w}" mean?',
    'Define "{w}".',
    'What is the meaning of the word "{w}"?',
    'What does the word "{w}" mean?',
)
FOLLOW_UP_QUESTIONS = {
    "examples": ("Can you use it in a sentence?", 'Give me some examples of "{w}" in use.', 'How is "{w}" used?'),
    "synonyms": ("What are some synonyms?", 'What other words mean the same as "{w}"?', "Is there another word for it?"),
    "antonyms": ('What is the opposite of "{w}"?', "And its opposite?", "What are its antonyms?"),
    "hypernyms": ("What kind of thing is that?", 'What is "{w}" a kind of?', 'How is "{w}" classified?'),
    "hyponyms": ('What are some kinds of "{w}"?', 'Can you name some types of "{w}"?'),
    "parts": ('What parts does "{w}" have?', 'What is "{w}" made up of?'),
    "part_of": ('What is "{w}" a part of?', "What is it part of?"),
    "related": ('What words are related to "{w}"?', 'Which words are formed from "{w}"?'),
}
REVERSE_QUESTIONS = (
    'What is the word for "{d}"?',
    'Which word means "{d}"?',
    'Is there a word for "{d}"?',
)


@dataclass
class Synset:
    pos: str                           # n, v, a (satellites included), r
    words: list[str]                   # as displayed: spaces for underscores, no adjective markers
    pointers: list[tuple[str, tuple[str, int], int, int]]  # symbol, target, source word, target word (1-based; 0: the synset)
    definition: str
    examples: list[str]


Sense = tuple[Synset, int]             # a synset and the 1-based position of the word in it


def display(word: str) -> str:
    """`ice_cream` -> `ice cream`; `galore(ip)` -> `galore` (adjective position markers)."""
    return re.sub(r"\((a|p|ip)\)$", "", word).replace("_", " ")


def split_gloss(gloss: str) -> tuple[str, list[str]]:
    """`definition; "example"; "example"` -> (definition, examples). A few glosses start their
    examples after `:` or `,`; a quote after other text (`("straw" is archaic)`) is the definition's."""
    start = re.search(r'(^|[;:,])\s*"', gloss)
    if not start:
        return gloss.strip(), []
    examples = [e.strip() for e in re.findall(r'"([^"]*)"', gloss[start.start():])]
    return gloss[:start.start()].strip(), [e for e in examples if e]


def database_lines(path: Path) -> list[str]:
    """The lines of a WordNet database file without its licence header (lines that start with spaces)."""
    return [line for line in path.read_text(encoding="utf-8").splitlines() if not line.startswith("  ")]


def read_synsets(wordnet: Path) -> dict[tuple[str, int], Synset]:
    synsets = {}
    for name, pos in WORDNET_FILES:
        for line in database_lines(wordnet / f"data.{name}"):
            head, _, gloss = line.partition(" | ")
            fields = head.split()
            n_words = int(fields[3], 16)
            words = [display(fields[4 + 2 * i]) for i in range(n_words)]
            at = 4 + 2 * n_words
            pointers = []
            for i in range(int(fields[at])):
                symbol, offset, target_pos, source_target = fields[at + 1 + 4 * i:at + 5 + 4 * i]
                pointers.append((symbol, (SYNSET_FILE[target_pos], int(offset)),
                                 int(source_target[:2], 16), int(source_target[2:], 16)))
            synsets[(pos, int(fields[0]))] = Synset(pos, words, pointers, *split_gloss(gloss))
    return synsets


def read_index(wordnet: Path) -> dict[str, list[tuple[str, list[int], int]]]:
    """lemma -> [(part of speech, synset offsets in WordNet's sense order, sense-tagged count)]."""
    index: dict[str, list] = {}
    for name, pos in WORDNET_FILES:
        for line in database_lines(wordnet / f"index.{name}"):
            fields = line.split()
            n_synsets, n_pointer_kinds = int(fields[2]), int(fields[3])
            tagged = int(fields[5 + n_pointer_kinds])
            offsets = [int(o) for o in fields[6 + n_pointer_kinds:6 + n_pointer_kinds + n_synsets]]
            index.setdefault(fields[0], []).append((pos, offsets, tagged))
    return index


class WordNet:
    def __init__(self, wordnet: Path):
        self.synsets = read_synsets(wordnet)
        self.index = read_index(wordnet)

    def senses(self, lemma: str) -> list[Sense]:
        out = []
        for pos, offsets, _ in self.index[lemma]:
            for offset in offsets:
                synset = self.synsets[(pos, offset)]
                keys = [w.lower().replace(" ", "_") for w in synset.words]
                out.append((synset, keys.index(lemma) + 1 if lemma in keys else 0))
        return out

    def targets(self, synset: Synset, symbols: tuple[str, ...], word: int | None = None) -> list[Sense]:
        """What `synset`'s pointers of these kinds reach, from the whole synset or, given `word`,
        from that word only (lexical pointers: antonyms, derived forms)."""
        return [(self.synsets[target], target_word) for symbol, target, source_word, target_word in synset.pointers
                if symbol in symbols and (word is None or source_word == word)]

    def chain(self, synset: Synset) -> list[Synset]:
        """The first hypernym (or instance hypernym) of each level, up to the root."""
        out = []
        while up := self.targets(synset, ("@", "@i")):
            synset = up[0][0]
            out.append(synset)
        return out


def quoted(words: list[str], limit: int = MAX_LISTED) -> str:
    more = f", and {len(words) - limit} more" if len(words) > limit else ""
    return ", ".join(f'"{w}"' for w in words[:limit]) + more


def meanings(word: str, senses: list[Sense]) -> str:
    by_pos: dict[str, list[Synset]] = {}
    for synset, _ in senses:
        by_pos.setdefault(synset.pos, []).append(synset)
    if len(senses) == 1:
        return f'"{word}" ({POS_NAMES[senses[0][0].pos]}): {senses[0][0].definition}.'
    blocks = []
    if len(by_pos) > 1:
        names = [f"{ARTICLES[pos]} {POS_NAMES[pos]}" for pos in by_pos]
        blocks.append(f'"{word}" can be {", ".join(names[:-1])} or {names[-1]}.')
    for pos, synsets in by_pos.items():
        if len(by_pos) > 1:
            heading = f"As {ARTICLES[pos]} {POS_NAMES[pos]}:"
        else:
            heading = f'"{word}" is {ARTICLES[pos]} {POS_NAMES[pos]} with {len(synsets)} senses:'
        lines = [f"{i}. {s.definition}" for i, s in enumerate(synsets[:MAX_SENSES], 1)]
        if len(synsets) > MAX_SENSES:
            rarer = len(synsets) - MAX_SENSES
            lines.append(f"(and {rarer} rarer {'sense' if rarer == 1 else 'senses'})")
        blocks.append("\n".join([heading, *lines]))
    return "\n\n".join(blocks)


def examples_answer(wn: WordNet, word: str, senses: list[Sense]) -> str | None:
    """Example sentences in which the word (or a form of it) appears."""
    stem = re.compile(r"\b" + re.escape(word.lower()[:max(3, len(word) - 2)]))
    examples = [e for s, _ in senses for e in s.examples if stem.search(e.lower())][:MAX_EXAMPLES]
    return "\n".join(f"- {e}" for e in examples) or None


def synonyms_answer(wn: WordNet, word: str, senses: list[Sense]) -> str | None:
    lines = [(s.definition, quoted([w for j, w in enumerate(s.words, 1) if j != i]))
             for s, i in senses if len(s.words) > 1][:MAX_LISTED]
    if len(lines) == 1:
        return f'In the sense "{lines[0][0]}": {lines[0][1]}.'
    return "It depends on the sense:\n\n" + "\n".join(f"- {d}: {w}" for d, w in lines) if lines else None


def antonyms_answer(wn: WordNet, word: str, senses: list[Sense]) -> str | None:
    lines = [f'- as in "{s.definition}": "{t.words[j - 1]}", {t.definition}'
             for s, i in senses if i for t, j in wn.targets(s, ("!",), i)]
    return "\n".join(lines) or None


def hypernyms_answer(wn: WordNet, word: str, senses: list[Sense]) -> str | None:
    synset = senses[0][0]
    chain = wn.chain(synset)
    if not chain:
        return None
    kind = "a way to" if synset.pos == "v" else (
        "an instance of" if wn.targets(synset, ("@i",)) else "a kind of")
    answer = f'In the sense "{synset.definition}", "{word}" is {kind} "{chain[0].words[0]}": {chain[0].definition}.'
    if len(chain) > 1:
        answer += "\n\nUp the hierarchy: " + " > ".join([word, *(s.words[0] for s in chain)])
    return answer


def listing(symbols: tuple[str, ...], says: str) -> Callable:
    """An answer listing what the first sense's pointers of these kinds reach (kinds, parts)."""
    def answer(wn: WordNet, word: str, senses: list[Sense]) -> str | None:
        synset = senses[0][0]
        found = [t.words[0] for t, _ in wn.targets(synset, symbols)]
        return f'"{word}" ({synset.definition}) {says}: {quoted(found)}.' if found else None
    return answer


def related_answer(wn: WordNet, word: str, senses: list[Sense]) -> str | None:
    related: dict[str, str] = {}
    for s, i in senses:
        for t, j in (wn.targets(s, ("+",), i) if i else []):
            related.setdefault(t.words[j - 1], POS_NAMES[t.pos])
    return ", ".join(f'"{w}" ({pos})' for w, pos in list(related.items())[:MAX_LISTED]) + "." if related else None


# follow-up kind -> its answer (None where the database has nothing for the word)
FOLLOW_UPS = {
    "examples": examples_answer,
    "synonyms": synonyms_answer,
    "antonyms": antonyms_answer,
    "hypernyms": hypernyms_answer,
    "hyponyms": listing(("~", "~i"), "has these kinds"),
    "parts": listing(("%p", "%s", "%m"), "is made up of"),
    "part_of": listing(("#p", "#s", "#m"), "is part of"),
    "related": related_answer,
}


def definition_conversation(wn: WordNet, lemma: str) -> dict:
    senses = [(s, i) for s, i in wn.senses(lemma) if s.definition]
    first, position = senses[0]
    word = first.words[position - 1] if position else lemma.replace("_", " ")
    questions = DEFINE_QUESTIONS if " " not in word else DEFINE_QUESTIONS[:2]  # "the word" fits one word
    exchanges = [(pick(questions, lemma).format(w=word), meanings(word, senses))]
    available = [(kind, answer) for kind, build in FOLLOW_UPS.items() if (answer := build(wn, word, senses))]
    # which follow-ups, how many and in which order: stable per word, varied across words
    available.sort(key=lambda kind_answer: hashlib.sha256(f"{kind_answer[0]}:{lemma}".encode()).digest())
    for kind, answer in available[:pick(tuple(range(MAX_FOLLOW_UPS + 1)), "follow-ups:" + lemma)]:
        exchanges.append((pick(FOLLOW_UP_QUESTIONS[kind], f"{kind}:{lemma}").format(w=word), answer))
    return conversation(lemma, exchanges, "wordnet/definitions", WORDNET_SYSTEM_PROMPTS)


def reverse_conversation(key: str, synset: Synset, example: str) -> dict:
    answer = f'"{synset.words[0]}" ({POS_NAMES[synset.pos]})'
    if len(synset.words) > 1:
        answer += f"; also {quoted(synset.words[1:])}"
    answer += f". For example: {example}"
    question = pick(REVERSE_QUESTIONS, key).format(d=synset.definition)
    return conversation(key, [(question, answer)], "wordnet/reverse", WORDNET_SYSTEM_PROMPTS)


def wordnet_conversations(wn: WordNet):
    """A definition conversation for each headword (a word that WordNet's sense-tagged corpus
    attests: the common vocabulary), then a reverse question for each concept none of them has,
    when an example sentence shows its word."""
    headwords = sorted(lemma for lemma, entries in wn.index.items() if any(tagged for _, _, tagged in entries))
    for lemma in headwords:
        yield definition_conversation(wn, lemma)
    covered = {(pos, offset) for lemma in headwords for pos, offsets, _ in wn.index[lemma] for offset in offsets}
    for key in sorted(wn.synsets):
        synset = wn.synsets[key]
        example = next((e for e in synset.examples if synset.words[0].lower() in e.lower()), None)
        if key not in covered and synset.definition and example:
            yield reverse_conversation(f"{key[0]}{key[1]:08d}", synset, example)


def wordnet_version() -> str | None:
    """The installed wordnet-base package's version; None when it or its database is absent."""
    if not (WORDNET_DIR / "data.noun").is_file():
        return None
    try:
        query = subprocess.run(["dpkg-query", "-W", "-f=${Version}", WORDNET_PACKAGE],
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return query.stdout or None


def build_wordnet(version: str) -> Domain:
    # the licence heads every database file as numbered lines: "  14 WordNet 3.0 Copyright ..."
    notice = "\n".join(re.sub(r"^ +\d+ ?", "", line).rstrip()
                       for line in (WORDNET_DIR / "data.noun").read_text(encoding="utf-8").splitlines()
                       if line.startswith("  "))
    return Domain(
        corpus=without_repeated_answers(wordnet_conversations(WordNet(WORDNET_DIR))),
        license="WordNet-3.0",
        license_note="WordNet 3.0 Copyright 2006 by Princeton University, under the WordNet 3.0 license "
                     "(use, copy, modify and distribute with its notice, which LICENSE-wordnet.txt holds).",
        license_text=("The wordnet domain of ANDREA's embedded corpus (wordnet.jsonl.gz) is derived from\n"
                      f"WordNet 3.0, as Debian packages it ({WORDNET_PACKAGE}). WordNet's license, as it\n"
                      f"heads every file of the database, follows.\n\n{notice}\n"),
        upstream={"name": f"{WORDNET_PACKAGE} (Debian package)", "version": version,
                  "data": f"WordNet 3.0: {WORDNET_DIR}/index.* and data.*"},
    )


# --- output -------------------------------------------------------------------------------

# domain -> (the version of its upstream data installed here, None if absent; its builder)
BUILDERS: dict[str, tuple[Callable[[], str | None], Callable[[str], Domain]]] = {
    "pydocs": (pydocs_version, build_pydocs),
    "wordnet": (wordnet_version, build_wordnet),
}


def upstream_version(name: str) -> str | None:
    """The version of the domain's upstream data on this machine; None when it is not installed."""
    return BUILDERS[name][0]()


def jsonl_bytes(corpus: list[dict]) -> bytes:
    return "".join(json.dumps(c, ensure_ascii=False, separators=(",", ":")) + "\n" for c in corpus).encode()


def gzip_bytes(data: bytes) -> bytes:
    buffer = io.BytesIO()
    # mtime 0 and no file name in the header: same content, same bytes
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as f:
        f.write(data)
    return buffer.getvalue()


def describe(name: str, domain: Domain, content: bytes, compressed: bytes) -> dict:
    turns = [c["conversations"] for c in domain.corpus]
    sources: dict[str, int] = {}
    for c in domain.corpus:
        sources[c["source"]] = sources.get(c["source"], 0) + 1
    return {
        "domain": name,
        "file": f"{name}.jsonl.gz",
        "sha256": hashlib.sha256(compressed).hexdigest(),
        "bytes": len(compressed),
        "content_sha256": hashlib.sha256(content).hexdigest(),
        "conversations": len(domain.corpus),
        "text_bytes": sum(len(t["value"].encode()) for conv in turns for t in conv),
        "with_system_turn": sum(conv[0]["from"] == "system" for conv in turns),
        "multi_turn": sum(sum(t["from"] == "human" for t in conv) > 1 for conv in turns),
        "sources": dict(sorted(sources.items())),
        "license": domain.license,
        "license_file": f"LICENSE-{name}.txt",
        "license_note": domain.license_note,
        "upstream": domain.upstream,
        "generator": f"python scripts/make_embedded_corpus.py --domain {name}",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--domain", choices=DOMAINS, action="append",
                        help="build only this domain (repeatable); default: all of them")
    parser.add_argument("--out-dir", type=Path, default=EMBEDDED_DIR, help=f"default: {EMBEDDED_DIR}")
    parser.add_argument("--check", action="store_true",
                        help="regenerate and compare the content sha256 and licence text with the "
                             "committed files; write nothing")
    args = parser.parse_args()

    failed = False
    for name in args.domain or DOMAINS:
        version_of, build = BUILDERS[name]
        version = version_of()
        if version is None:
            print(f"{name}: its upstream data is not installed here; the list of domains at the top of "
                  f"{Path(__file__).name} says what to install", file=sys.stderr)
            failed = True
            continue
        domain = build(version)
        content = jsonl_bytes(domain.corpus)
        compressed = gzip_bytes(content)
        info = describe(name, domain, content, compressed)
        info_path, license_path = args.out_dir / f"{name}.json", args.out_dir / info["license_file"]
        if args.check:
            committed = json.loads(info_path.read_text(encoding="utf-8"))
            differ = [what for what, same in (
                ("the content", committed["content_sha256"] == info["content_sha256"]),
                (license_path.name,
                 license_path.is_file() and license_path.read_text(encoding="utf-8") == domain.license_text),
            ) if not same]
            print(f"{name}: {' and '.join(differ) + ' differ from' if differ else 'matches'} {info_path} "
                  f"(here: {info['upstream']['name']} {info['upstream']['version']}; "
                  f"committed: {committed['upstream']['name']} {committed['upstream']['version']})")
            failed |= bool(differ)
            continue
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / info["file"]).write_bytes(compressed)
        info_path.write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        license_path.write_text(domain.license_text, encoding="utf-8")
        print(f"{name}: {info['conversations']:,} conversations, {info['text_bytes']:,} bytes of text, "
              f"{info['bytes']:,} bytes compressed -> {args.out_dir / info['file']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
