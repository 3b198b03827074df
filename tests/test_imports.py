"""The package's layers import only those below them (DESIGN.md, "Layout of the repository"), so the
modules of `andrea` import each other without a cycle. The graph is read from the source, imports
inside functions included: an import moved into a function still runs, it only hides the cycle."""

from __future__ import annotations

from pathlib import Path

import pytest

from andrea.common.errors import AndreaError
from andrea.common.hashing import code_files, code_hash, imported_names

PACKAGE = Path(__file__).resolve().parents[1] / "andrea"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): (set(imported_names(p)) & modules) - {module_name(p)} for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, in sorted order for a stable answer)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if cycle := visit(nxt):
                return cycle
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        if cycle := visit(start):
            return cycle
    return None


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "andrea.engines" in graph["andrea.run.train"]  # only imported inside a method of Trainer
    assert "andrea.engines.numpy_engine" in graph["andrea.engines"]  # only inside make_engine


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b", "c"}, "b": set(), "c": {"c2"}, "c2": {"c"}}, ["c", "c2", "c"]),
])
def test_find_cycle(graph, cycle):
    assert find_cycle(graph) == cycle


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_code_files_follow_every_import_of_the_package(tmp_path):
    """What a stage's code hash covers (andrea.common.hashing.code_hash, the workflow's code_version)."""
    pkg = tmp_path / "andrea"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "stage.py").write_text("import json\n\ndef run():\n    from andrea.sub import helper\n")
    (pkg / "sub" / "helper.py").write_text("from andrea.sub.leaf import X\n")
    (pkg / "sub" / "leaf.py").write_text("X = 1\n")
    (pkg / "unused.py").write_text("")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "k.cu").write_text("")
    files = {p.relative_to(tmp_path).as_posix() for p in code_files(tmp_path, ["andrea.stage", "kernels/"])}
    assert files == {"andrea/__init__.py", "andrea/stage.py", "andrea/sub/__init__.py", "andrea/sub/helper.py",
                     "andrea/sub/leaf.py", "kernels/k.cu"}
    before = code_hash(tmp_path, ["andrea.stage"])
    (pkg / "sub" / "leaf.py").write_text("X = 2\n")
    assert code_hash(tmp_path, ["andrea.stage"]) != before
    with pytest.raises(AndreaError, match="andrea.nope: no such module"):
        code_files(tmp_path, ["andrea.nope"])


# The package's folders in layer order: a module imports only from its own folder and those before it (and the
# package's __init__, for its version). data/ is below the engine's layers so it never imports them.
LAYERS = ["common", "spec", "store", "data", "ops", "engines", "schedule", "tools", "dashboard", "run", "cli"]


def folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "andrea"


def test_every_module_sits_in_a_layer_folder():
    loose = sorted(m for m in import_graph() if folder(m) not in (*LAYERS, "andrea"))
    assert not loose, f"modules outside the layer folders {LAYERS}: {loose}"


def test_each_folder_imports_only_the_layers_before_it():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = sorted(f"{m} imports {d}" for m, deps in import_graph().items() for d in deps
                    if folder(m) in rank and folder(d) in rank and rank[folder(d)] > rank[folder(m)])
    assert not upward, "imports against the layer order: " + "; ".join(upward)


def test_every_import_of_the_package_resolves():
    """Each `import andrea...` and `from andrea... import name` of the package, the scripts, the benchmark, dev/ and
    the tests names a module (and a name) that exists, the imports inside functions included: those run only when
    their code does, some only on a GPU, so a moved or renamed module would otherwise pass every CPU test."""
    import ast
    import importlib
    import importlib.util

    repo = PACKAGE.parent
    unresolved = []
    for path in sorted(p for d in ("andrea", "scripts", "bench", "dev", "tests") for p in (repo / d).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "andrea":
                wanted = [(node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                wanted = [(a.name, None) for a in node.names if a.name.split(".")[0] == "andrea"]
            else:
                continue
            for module, name in wanted:
                try:
                    found = importlib.import_module(module)
                except ImportError as err:
                    unresolved.append(f"{path.relative_to(repo)}:{node.lineno}: {module} ({err})")
                    continue
                if name and not hasattr(found, name) and not (
                        hasattr(found, "__path__") and importlib.util.find_spec(f"{module}.{name}")):
                    unresolved.append(f"{path.relative_to(repo)}:{node.lineno}: {module}.{name}")
    assert not unresolved, "imports that name nothing:\n" + "\n".join(unresolved)
