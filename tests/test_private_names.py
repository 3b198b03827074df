"""A leading underscore means "this module only": no module of the package, the scripts, the benchmark or dev/
reads a private name (`_name`, not a dunder) that it does not define itself, whether another module of the
repository or a library defines it. What another module legitimately needs is a public name there.

A module defines a name by a def or class, an assignment (to a name, or to an attribute such as `self._x = ...`),
a loop, `with` or comprehension target, a function argument, an exception's name or an import alias. It uses a
private name by an attribute (`x._name`), a bare name, or `from m import _name`. The check is by name, not by
object: a module that defines `_x` for itself may read any object's `_x`. tests/ may reach into internals."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECKED = ("andrea/**/*.py", "scripts/*.py", "bench/*.py", "dev/**/*.py")


def is_private(name: str) -> bool:
    return name.startswith("_") and name.strip("_") != "" and not (name.startswith("__") and name.endswith("__"))


def _targets(node: ast.AST):
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            yield n.id
        elif isinstance(n, ast.Attribute):
            yield n.attr


def foreign_private_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of each use of a private name that the module `source` does not define, in source order."""
    tree = ast.parse(source)
    defined: set[str] = set()
    uses: list[tuple[int, str, bool]] = []  # (line, name, imported from another module)
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(n.name)
        elif isinstance(n, ast.arg):
            defined.add(n.arg)
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                defined.update(_targets(t))
        elif isinstance(n, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor, ast.comprehension, ast.NamedExpr)):
            defined.update(_targets(n.target))
        elif isinstance(n, ast.withitem) and n.optional_vars is not None:
            defined.update(_targets(n.optional_vars))
        elif isinstance(n, ast.ExceptHandler) and n.name:
            defined.add(n.name)
        elif isinstance(n, ast.Import):
            defined.update(a.asname or a.name.split(".")[0] for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            for a in n.names:
                if is_private(a.name):
                    uses.append((n.lineno, a.name, True))
                defined.add(a.asname or a.name)
        if isinstance(n, ast.Attribute) and is_private(n.attr):
            uses.append((n.lineno, n.attr, False))
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and is_private(n.id):
            uses.append((n.lineno, n.id, False))
    return sorted((line, name) for line, name, imported in uses if imported or name not in defined)


def checked_files() -> list[Path]:
    return sorted({p for pattern in CHECKED for p in REPO.glob(pattern)})


@pytest.mark.parametrize("source, found", [
    ("class A:\n    def f(self):\n        self._x = 1\n        return self._x\n", []),
    ("def f(engine):\n    return engine._launch()\n", [(2, "_launch")]),
    ("from m import _helper\n_helper()\n", [(1, "_helper")]),
    ("import numpy as _np\nfrom m import helper as _helper\n_np.ones(_helper())\n", []),
    ("def f(_scale):\n    return [_y for _y in _scale]\n", []),
    ("def f(parser):\n    return parser._actions, parser.__dict__\n", [(2, "_actions")]),
    ("class B(A):\n    def g(self):\n        return self._fp8_cast()\n", [(3, "_fp8_cast")]),
])
def test_the_check_tells_a_module_s_own_private_names_from_others(source, found):
    assert foreign_private_names(source) == found


def test_the_check_covers_the_package_the_scripts_the_benchmark_and_dev():
    files = {p.relative_to(REPO).as_posix() for p in checked_files()}
    assert {"andrea/schedule/model.py", "andrea/ops/fp8.py", "andrea/engines/cuda_engine.py", "scripts/bench.py",
            "bench/peer_pytorch.py"} <= files
    assert any(f.startswith("dev/") for f in files)


def test_no_module_reads_another_module_s_private_names():
    found = [f"{p.relative_to(REPO)}:{line}: {name}" for p in checked_files()
             for line, name in foreign_private_names(p.read_text())]
    assert not found, f"{len(found)} uses of private names defined elsewhere:\n" + "\n".join(found)
