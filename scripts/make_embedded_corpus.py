"""Generate the embedded chat corpus from text that ships with Python itself.

    python scripts/make_embedded_corpus.py            # write andrea/data/embedded/
    python scripts/make_embedded_corpus.py --check    # regenerate in memory, compare content

Sources (PSF License): the language reference topics of `pydoc_data.topics`, and the module,
class and function docstrings of the standard library's own .py files, read with `ast` (never
imported). Each becomes a question -> answer conversation in the Hermes-3 schema; about a third
get a system turn, classes are multi-turn (the class, then some of its methods), long reference
topics continue over several turns.

The output is deterministic for a given Python version; it is committed (gzip, mtime 0) so the
corpus does not change with the Python that runs the pipeline. The JSON beside it records the
sha256 that `andrea pull-hermes3 --source embedded` verifies.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import io
import json
import platform
import sys
import sysconfig
from pathlib import Path

CORPUS_NAME = "hermes3-embedded.jsonl.gz"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "andrea" / "data" / "embedded"

# test suites, vendored wheels and installed third-party packages are not Python's documentation
SKIP_DIRS = {"test", "tests", "idle_test", "ensurepip", "site-packages", "dist-packages", "__pycache__"}
MIN_DOC_CHARS = 30
MAX_METHODS_PER_CLASS_CONVERSATION = 3
TOPIC_CHUNK_CHARS = 2500
TOPIC_TURNS_PER_CONVERSATION = 3

SYSTEM_PROMPTS = (
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


def pick(options: tuple[str, ...], key: str) -> str:
    """A stable choice by key (Python's hash() is salted per process)."""
    return options[int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % len(options)]


def conversation(key: str, exchanges: list[tuple[str, str]], source: str) -> dict:
    turns = []
    if pick(("system", "none", "none"), "system:" + key) == "system":
        turns.append({"from": "system", "value": pick(SYSTEM_PROMPTS, "prompt:" + key)})
    for question, answer in exchanges:
        turns += [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
    return {"conversations": turns, "source": source}


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
    source = "python-stdlib/docstrings"
    for module, path in stdlib_modules(stdlib):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        doc = docstring(tree)
        if doc:
            yield conversation(module, [(pick(MODULE_QUESTIONS, module).format(name=module), doc)], source)
        for node in top_level_definitions(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and is_public(node.name):
                doc = docstring(node)
                if doc:
                    name = f"{module}.{node.name}"
                    answer = f"`{module}.{signature(node, False)}`\n\n{doc}"
                    yield conversation(name, [(pick(FUNCTION_QUESTIONS, name).format(name=name), answer)], source)
            elif isinstance(node, ast.ClassDef) and is_public(node.name):
                yield from class_conversations(module, node, source)


def class_conversations(module: str, node: ast.ClassDef, source: str):
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
        yield conversation(name, exchanges, source)
        methods = methods[MAX_METHODS_PER_CLASS_CONVERSATION:]
    for method, answer in methods:
        key = f"{name}.{method}"
        yield conversation(key, [(pick(METHOD_QUESTIONS, key).format(name=name, method=method), answer)], source)


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

    source = "python-docs/reference"
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
            yield conversation(f"{key}:{part}", list(zip([first, *follow_ups], group)), source)


def build_corpus() -> list[dict]:
    """All conversations; an answer already given once is not repeated (inherited docstrings)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    seen, corpus = set(), []
    for conv in [*topic_conversations(), *docstring_conversations(stdlib)]:
        answers = tuple(t["value"] for t in conv["conversations"] if t["from"] == "gpt")
        if answers in seen:
            continue
        seen.add(answers)
        corpus.append(conv)
    return corpus


def jsonl_bytes(corpus: list[dict]) -> bytes:
    return "".join(json.dumps(c, ensure_ascii=False, separators=(",", ":")) + "\n" for c in corpus).encode()


def gzip_bytes(data: bytes) -> bytes:
    buffer = io.BytesIO()
    # mtime 0 and no file name in the header: same content, same bytes
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as f:
        f.write(data)
    return buffer.getvalue()


def describe(corpus: list[dict], content: bytes, compressed: bytes) -> dict:
    turns = [c["conversations"] for c in corpus]
    sources: dict[str, int] = {}
    for c in corpus:
        sources[c["source"]] = sources.get(c["source"], 0) + 1
    return {
        "file": CORPUS_NAME,
        "sha256": hashlib.sha256(compressed).hexdigest(),
        "bytes": len(compressed),
        "content_sha256": hashlib.sha256(content).hexdigest(),
        "conversations": len(corpus),
        "text_bytes": sum(len(t["value"].encode()) for conv in turns for t in conv),
        "with_system_turn": sum(conv[0]["from"] == "system" for conv in turns),
        "multi_turn": sum(sum(t["from"] == "human" for t in conv) > 1 for conv in turns),
        "sources": dict(sorted(sources.items())),
        "license": "PSF-2.0",
        "license_note": "Python documentation and standard-library docstrings, "
                        "Copyright Python Software Foundation, under the PSF License Agreement "
                        "(https://docs.python.org/3/license.html).",
        "origin": f"Python {platform.python_version()} standard library: pydoc_data.topics and docstrings",
        "generator": "scripts/make_embedded_corpus.py",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    parser.add_argument("--check", action="store_true",
                        help="regenerate and compare the content sha256 with the committed JSON; write nothing")
    args = parser.parse_args()

    corpus = build_corpus()
    content = jsonl_bytes(corpus)
    compressed = gzip_bytes(content)
    info = describe(corpus, content, compressed)
    info_path = args.out_dir / CORPUS_NAME.replace(".jsonl.gz", ".json")
    if args.check:
        committed = json.loads(info_path.read_text(encoding="utf-8"))
        same = committed["content_sha256"] == info["content_sha256"]
        print(f"content {'matches' if same else 'differs from'} {info_path} "
              f"(this Python: {platform.python_version()}; committed: {committed['origin']})")
        return 0 if same else 1
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / CORPUS_NAME).write_bytes(compressed)
    info_path.write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{info['conversations']:,} conversations, {info['text_bytes']:,} bytes of text, "
          f"{info['bytes']:,} bytes compressed -> {args.out_dir / CORPUS_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
