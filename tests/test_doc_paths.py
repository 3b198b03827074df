"""Every repository path that README.md and docs/*.md name exists, and every one the code's comments and
docstrings name.

A path is named when it sits in backticks (inline or a fenced block) or is a link's target, starts with one
of the repository's folders below and ends in a file extension or a slash. Paths with placeholders
(`<hash>`, `{V}`, `NAME`, `*`) and outputs (`results/...`, not a prefix below) are not checked; a link's
target is resolved from the document's own folder, as GitHub does.
"""
import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PREFIXES = ("andrea", "scripts", "tests", "kernels", "workflow", "config", "dev", "docs", "profiles")
# a path token: one of the prefixes at the start of a word (not inside /abs/andrea/..., a URL or runs/dev/...)
PATH = re.compile(r"(?<![\w./~:-])(?:\./)?((?:%s)/[^\s`'\"()\[\],;]*)" % "|".join(PREFIXES))
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def is_placeholder(path: str) -> bool:
    """A path written as a pattern (`<hash>`, `{V}`, `*`, `$X`, `...`) or with an all-capitals stand-in
    (NAME, RUN): not a file to look for. Names that are really spelt in capitals (README.md, ANDREA.md,
    the experiments' ANDREA-12M-TRAIN.json) are checked."""
    if re.search(r"[<>{}*$]|\.\.\.|…", path):
        return True
    for part in path.rstrip("/").split("/"):
        stem = part.split(".")[0]
        if stem in ("NAME", "RUN", "V", "X", "N", "OP", "HASH", "TAG", "ID") or re.fullmatch(r"[A-Z]", stem):
            return True
    return False


def _looks_like_path(path: str) -> bool:
    return path.endswith("/") or bool(re.search(r"\.[A-Za-z0-9]+$", path.rsplit("/", 1)[-1]))


def named_paths(text: str, doc: Path, repo: Path = REPO):
    """(line number, path relative to the repository) for each repository path `text` (the document
    `doc`, inside `repo`) names."""
    found = []
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        spans = [line] if fenced else [m.group(2) for m in INLINE_CODE.finditer(line)]
        for span in spans:
            for m in PATH.finditer(span):
                path = m.group(1).rstrip(".:")
                if _looks_like_path(path) and not is_placeholder(path):
                    found.append((number, path))
        if fenced:
            continue
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            target = m.group(1).split("#", 1)[0]
            if not target or re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
                continue  # an anchor in the page, a URL (http:, mailto:, file:) or a site path
            resolved = (doc.parent / target).resolve()
            try:
                path = resolved.relative_to(repo.resolve()).as_posix() + ("/" if target.endswith("/") else "")
            except ValueError:
                found.append((number, target))  # outside the repository: cannot exist in it
                continue
            if not is_placeholder(path):
                found.append((number, path))
    return found


def missing_paths(docs, repo: Path = REPO):
    """'doc:line: path' for each named path that is not in `repo`."""
    missing = []
    for doc in docs:
        for number, path in named_paths(doc.read_text(), doc, repo):
            if not (repo / path).exists():
                missing.append(f"{doc.relative_to(repo)}:{number}: {path}")
    return missing


def documents():
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", documents(), ids=lambda doc: doc.relative_to(REPO).as_posix())
def test_every_path_the_docs_name_exists(doc):
    missing = missing_paths([doc])
    assert not missing, "paths named in the docs that the repository does not have:\n" + "\n".join(missing)


def test_the_scanner_finds_a_made_up_path(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "andrea").mkdir()
    (tmp_path / "andrea" / "model.py").write_text("")
    doc = tmp_path / "docs" / "X.md"
    doc.write_text("\n".join([
        "The model is in `andrea/model.py`; the step in `andrea/no_such_step.py`.",
        "Run `.venv/bin/python scripts/gone.py --fast` or read [the loader](../andrea/loader.py).",
        "```bash",
        "bash ./dev/missing/run.sh",
        "```",
        "Placeholders: `kernels/<op>.cu`, `config/experiments/ANDREA-*-TRAIN.json`, `runs/NAME/NAME.ckpt`,",
        "`andrea/{V}/x.py`; outputs `results/a.json`; not paths: `andrea.config`, andrea/prose.py outside code,",
        "/abs/andrea/elsewhere.py, https://example.com/andrea/x.py, [site](https://x.org/docs/y.md).",
    ]))
    assert missing_paths([doc], tmp_path) == [
        "docs/X.md:1: andrea/no_such_step.py",
        "docs/X.md:2: scripts/gone.py",
        "docs/X.md:2: andrea/loader.py",
        "docs/X.md:4: dev/missing/run.sh",
    ]


@pytest.mark.parametrize("path", ["kernels/<op>.cu", "results/<hash>/x.json", "runs/{V}/a.ckpt",
                                  "config/experiments/ANDREA-*-TRAIN.json", "tests/NAME.best.ckpt"])
def test_placeholders_are_not_checked(path):
    assert is_placeholder(path) or not PATH.search(path)


def test_capitalised_real_names_are_checked():
    assert not is_placeholder("docs/PERFORMANCE.md")
    assert not is_placeholder("config/experiments/ANDREA-12M-TRAIN.json")


# The code whose comments and docstrings are read: what a reader follows a path from.
CODE_FOLDERS = ("andrea", "scripts", "bench", "dev", "workflow", "kernels", "tests", "config", "profiles")
CODE_SUFFIXES = (".py", ".cu", ".cuh", ".smk", ".sh", ".yaml")


def code_comments(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of a source file's comments, and of its docstrings for Python."""
    text = path.read_text()
    found = []
    if path.suffix == ".py":
        found += [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
                  if t.type == tokenize.COMMENT]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                first = node.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                        and isinstance(first.value.value, str):
                    found += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    elif path.suffix in (".cu", ".cuh"):
        for m in re.finditer(r"//[^\n]*|/\*.*?\*/", text, re.S):
            start = text.count("\n", 0, m.start()) + 1
            found += [(start + i, line) for i, line in enumerate(m.group(0).splitlines())]
    else:  # Snakefile, .smk, .sh, .yaml: what follows a '#'
        found += [(i, line[line.index("#"):]) for i, line in enumerate(text.splitlines(), 1) if "#" in line]
    return found


def missing_in_code(files, repo: Path = REPO) -> list[str]:
    missing = []
    for path in files:
        for number, text in code_comments(path):
            for m in PATH.finditer(text):
                named = m.group(1).rstrip(".:")
                if _looks_like_path(named) and not is_placeholder(named) and not (repo / named).exists():
                    missing.append(f"{path.relative_to(repo)}:{number}: {named}")
    return missing


def code_files(repo: Path = REPO) -> list[Path]:
    return [repo / "Snakefile", *sorted(p for d in CODE_FOLDERS for p in (repo / d).rglob("*") if p.is_file()
                                        and (p.suffix in CODE_SUFFIXES or p.name == "Snakefile")
                                        and "__pycache__" not in p.parts and p != Path(__file__).resolve())]


def test_every_path_the_code_comments_name_exists():
    files = code_files()
    assert len(files) > 100
    missing = missing_in_code(files)
    assert not missing, "paths named in comments and docstrings that the repository does not have:\n" + "\n".join(missing)


def test_the_comment_scanner_finds_a_made_up_path(tmp_path):
    (tmp_path / "andrea").mkdir()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "andrea" / "real.py").write_text("")
    (tmp_path / "andrea" / "m.py").write_text(
        '"""Reads andrea/real.py and andrea/gone.py."""\n'
        "x = 'andrea/strings_are_code.py'  # see kernels/missing.cu, andrea/<op>.py\n"
        "def f():\n    \"\"\"After docs/NOPE.md.\"\"\"\n")
    (tmp_path / "kernels" / "k.cu").write_text("/* andrea/a.py\n   andrea/real.py */ int x; // scripts/b.py\n")
    files = [tmp_path / "andrea" / "m.py", tmp_path / "kernels" / "k.cu"]
    assert missing_in_code(files, tmp_path) == [
        "andrea/m.py:2: kernels/missing.cu", "andrea/m.py:1: andrea/gone.py", "andrea/m.py:4: docs/NOPE.md",
        "kernels/k.cu:1: andrea/a.py", "kernels/k.cu:2: scripts/b.py"]


def test_the_user_pages_stay_short():
    """docs/PERFORMANCE.md is the user's page (current figures, commands, knobs, limits; one line a lever tried), not
    a log; dev/ keeps only what someone would run again. Past figures live in git history."""
    lines = lambda p: len(p.read_text(encoding="utf-8").splitlines())  # noqa: E731
    assert lines(REPO / "docs" / "PERFORMANCE.md") <= 250
    dev = [p for p in (REPO / "dev").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert sum(lines(p) for p in dev) <= 1500, "dev/ holds at most 1,500 lines"
    assert lines(REPO / "dev" / "cuda" / "README.md") <= 60
